//! Variables at run time: captures, built-ins (`run_id`, `uuid`, `rand`, providers, limits,
//! retention) and the rendering of templates and JSON bodies.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::scenario::{Atom, Expr, NumExpr, Part, Template, parse_parts};
use crate::target::Capabilities;

/// A variable that has no value now (a capture that did not happen, or a limit the target
/// does not advertise).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VarError {
    #[error("variable `{0}` has no value (its capture did not happen)")]
    Missing(String),
    #[error("the target does not advertise `{0}`")]
    NotAdvertised(String),
    #[error("`{0}` is not a number, so it cannot be used in arithmetic")]
    NotANumber(String),
    #[error("arithmetic overflow in `{0}`")]
    Overflow(String),
}

/// Values visible to one scenario run.
pub struct Vars<'a> {
    pub captures: BTreeMap<String, Value>,
    pub run_id: &'a str,
    pub caps: &'a Capabilities,
    /// The run's canary secret, for `{{canary}}` in request bodies.
    pub canary: &'a str,
}

impl<'a> Vars<'a> {
    pub fn new(run_id: &'a str, caps: &'a Capabilities, canary: &'a str) -> Self {
        Vars {
            captures: BTreeMap::new(),
            run_id,
            caps,
            canary,
        }
    }

    fn lookup(&self, name: &str) -> Result<Value, VarError> {
        if let Some(v) = self.captures.get(name) {
            return Ok(v.clone());
        }
        match name {
            "run_id" => Ok(Value::String(self.run_id.to_owned())),
            "canary" => Ok(Value::String(self.canary.to_owned())),
            "uuid" => Ok(Value::String(uuid_v4())),
            "rand" => Ok(Value::String(format!("{}", rand::random::<u32>()))),
            "provider.default" => Ok(Value::String(self.caps.default_provider().to_owned())),
            "base_dir" => self
                .caps
                .base_dir
                .as_ref()
                .map(|d| Value::String(d.clone()))
                .ok_or_else(|| VarError::NotAdvertised("a base directory (--base-dir)".into())),
            "provider.other" => self
                .caps
                .other_provider()
                .map(|p| Value::String(p.to_owned()))
                .ok_or_else(|| VarError::NotAdvertised("a second provider".into())),
            _ => {
                let advertised = |map: &BTreeMap<String, i64>, key: &str| {
                    map.get(key)
                        .map(|n| Value::from(*n))
                        .ok_or_else(|| VarError::NotAdvertised(name.to_owned()))
                };
                if let Some(key) = name.strip_prefix("limits.") {
                    advertised(&self.caps.limits, key)
                } else if let Some(key) = name.strip_prefix("retention.") {
                    advertised(&self.caps.retention, key)
                } else {
                    Err(VarError::Missing(name.to_owned()))
                }
            }
        }
    }

    /// Evaluates an expression to a JSON value (a number when arithmetic was applied).
    pub fn eval(&self, expr: &Expr) -> Result<Value, VarError> {
        let value = match &expr.atom {
            Atom::Int(n) => Value::from(*n),
            Atom::Var(name) => self.lookup(name)?,
        };
        match expr.op {
            None => Ok(value),
            Some(_) => {
                let n = as_int(&value).ok_or_else(|| VarError::NotANumber(expr.to_string()))?;
                expr.apply(n)
                    .map(Value::from)
                    .ok_or_else(|| VarError::Overflow(expr.to_string()))
            }
        }
    }

    pub fn num(&self, n: &NumExpr) -> Result<i64, VarError> {
        let v = self.eval(&n.expr)?;
        as_int(&v).ok_or_else(|| VarError::NotANumber(n.expr.to_string()))
    }

    pub fn render(&self, t: &Template) -> Result<String, VarError> {
        render_parts(&t.parts, self)
    }

    /// Renders every string in a JSON value; a string that is exactly one `{{expr}}` takes
    /// the value's own type (so `"{{limits.max_timeout_s}}"` becomes a number).
    pub fn render_json(&self, v: &Value) -> Result<Value, VarError> {
        Ok(match v {
            Value::String(s) => {
                // The parser already checked every template; a failure here is impossible.
                let parts = parse_parts(s).unwrap_or_else(|_| vec![Part::Lit(s.clone())]);
                match parts.as_slice() {
                    [Part::Expr(e)] => self.eval(e)?,
                    _ => Value::String(render_parts(&parts, self)?),
                }
            }
            Value::Array(items) => Value::Array(
                items
                    .iter()
                    .map(|i| self.render_json(i))
                    .collect::<Result<_, _>>()?,
            ),
            Value::Object(map) => {
                let mut out = serde_json::Map::new();
                for (k, v) in map {
                    let parts = parse_parts(k).unwrap_or_else(|_| vec![Part::Lit(k.clone())]);
                    out.insert(render_parts(&parts, self)?, self.render_json(v)?);
                }
                Value::Object(out)
            }
            other => other.clone(),
        })
    }
}

fn render_parts(parts: &[Part], vars: &Vars<'_>) -> Result<String, VarError> {
    let mut out = String::new();
    for part in parts {
        match part {
            Part::Lit(s) => out.push_str(s),
            Part::Expr(e) => out.push_str(&scalar_text(&vars.eval(e)?)),
        }
    }
    Ok(out)
}

/// A JSON value as text in a path or header: strings without quotes.
pub fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn as_int(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// A random version-4 UUID.
fn uuid_v4() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Pos;

    fn caps() -> Capabilities {
        Capabilities::from_json(serde_json::json!({
            "providers": [{"name": "local", "default": true}, {"name": "local-b"}],
            "features": [],
            "limits": {"max_timeout_s": 86400},
            "retention": {"process_output_s": 2}
        }))
        .unwrap()
    }

    #[test]
    fn renders_templates_and_typed_json() {
        let caps = caps();
        let mut vars = Vars::new("run1", &caps, "sandspec-canary-test");
        vars.captures
            .insert("sbx".into(), Value::String("local:sbx_1".into()));
        let t =
            Template::parse("/v1/sandboxes/{{sbx}}?p={{provider.other}}", Pos::default()).unwrap();
        assert_eq!(
            vars.render(&t).unwrap(),
            "/v1/sandboxes/local:sbx_1?p=local-b"
        );
        let body = serde_json::json!({"timeout_s": "{{limits.max_timeout_s + 1}}", "m": {"run": "r-{{run_id}}"}});
        assert_eq!(
            vars.render_json(&body).unwrap(),
            serde_json::json!({"timeout_s": 86401, "m": {"run": "r-run1"}})
        );
        let missing = Template::parse("{{nope}}", Pos::default()).unwrap();
        assert_eq!(vars.render(&missing), Err(VarError::Missing("nope".into())));
        let unadvertised = Template::parse("{{limits.max_queue_depth}}", Pos::default()).unwrap();
        assert!(matches!(
            vars.render(&unadvertised),
            Err(VarError::NotAdvertised(_))
        ));
    }

    #[test]
    fn uuid_is_fresh_and_well_formed() {
        let (a, b) = (uuid_v4(), uuid_v4());
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
    }
}
