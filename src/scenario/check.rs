//! The checks serde cannot make, for the parts of a scenario that several step kinds share:
//! variables defined before use, known capabilities for what a step needs, JSON pointers,
//! regular expressions and base64, each error reported as `file:line:col: message`. Each
//! step kind checks its own model with these (`crate::engine::steps`).

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use regex::Regex;

use super::fields::{Expect, HeaderCheck, JsonCheck, NumExpr, Principal, Via};
use super::pos::{Located, Pos};
use super::template::{Template, parse_parts};

/// Limit keys a scenario may refer to as `{{limits.<key>}}`.
pub const LIMIT_KEYS: &[&str] = &[
    "max_body_bytes",
    "max_file_bytes",
    "default_page_size",
    "max_page_size",
    "max_streams_per_principal",
    "heartbeat_interval_s",
    "max_stream_duration_s",
    "max_sandboxes_per_principal",
    "max_timeout_s",
    "default_timeout_s",
    "max_queue_depth",
    "max_process_output_bytes",
];

/// Retention keys a scenario may refer to as `{{retention.<key>}}`.
pub const RETENTION_KEYS: &[&str] = &["process_output_s", "result_s", "events_s", "idempotency_s"];

/// A scenario file that cannot be used, with the place that is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    pub file: PathBuf,
    pub pos: Pos,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file.display(),
            self.pos.line,
            self.pos.col,
            self.message
        )
    }
}

impl std::error::Error for ParseError {}

/// The message of a rendered error, without the location and snippet the YAML crate adds.
pub fn first_line(rendered: &str) -> String {
    let line = rendered.lines().next().unwrap_or(rendered).trim();
    let line = line.strip_prefix("error: ").unwrap_or(line);
    // The crate appends " at line L column C"; the location is reported separately.
    let line = match line.rfind(" at line ") {
        Some(i) => &line[..i],
        None => line,
    };
    // ... or prefixes "line L column C: ".
    match line
        .strip_prefix("line ")
        .and_then(|rest| rest.split_once(": "))
    {
        Some((coords, message)) if coords.contains(" column ") => message.to_owned(),
        _ => line.to_owned(),
    }
}

/// Post-parse checks, collecting every error rather than stopping at the first.
pub struct Checker<'a> {
    file: &'a Path,
    pub errors: Vec<ParseError>,
    /// The built-in variables the scenario uses (`base_dir`, `limits.max_file_bytes`):
    /// what it needs of the run beyond its `requires`.
    pub builtins: BTreeSet<String>,
}

/// Names defined so far while walking the steps.
#[derive(Default, Clone)]
pub struct Scope {
    pub captures: BTreeSet<String>,
    /// Captures marked `secret: true`.
    pub secrets: BTreeSet<String>,
    pub digests: BTreeSet<String>,
    pub snapshots: BTreeSet<String>,
}

impl<'a> Checker<'a> {
    /// A checker of the file at `file`, with no error yet.
    pub fn new(file: &'a Path) -> Self {
        Checker {
            file,
            errors: Vec::new(),
            builtins: BTreeSet::new(),
        }
    }

    pub fn err(&mut self, pos: Pos, message: impl Into<String>) {
        self.errors.push(ParseError {
            file: self.file.to_owned(),
            pos,
            message: message.into(),
        });
    }

    pub fn define_capture(&mut self, name: &str, pos: Pos, scope: &mut Scope) {
        let re_ok = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !re_ok {
            self.err(
                pos,
                format!("capture name `{name}` must be lower_snake_case"),
            );
        } else if builtin(name).is_some() {
            self.err(
                pos,
                format!("capture name `{name}` shadows a built-in variable"),
            );
        }
        scope.captures.insert(name.to_owned());
    }

    pub fn expect(&mut self, e: &Expect, scope: &Scope, ctx: &CheckCtx<'_>) {
        for check in e.json.iter().chain(&e.json_lines) {
            self.json_check(check, scope, ctx);
        }
        for h in &e.headers {
            self.header_check(h, scope, ctx);
        }
        if let Some(t) = &e.body_text {
            self.template(t, scope, ctx);
        }
        if let Some(b) = &e.body_base64 {
            self.base64(b);
        }
        if e.status.is_some() && !e.status_in.is_empty() {
            self.err(Pos::default(), "give `status` or `status_in`, not both");
        }
    }

    pub fn json_check(&mut self, c: &JsonCheck, scope: &Scope, ctx: &CheckCtx<'_>) {
        self.template(&c.pointer, scope, ctx);
        if !(c.pointer.raw.is_empty() || c.pointer.raw.starts_with('/')) {
            self.err(
                c.pointer.pos,
                format!("JSON pointer `{}` must start with `/`", c.pointer.raw),
            );
        }
        let n = [
            c.equals.is_some(),
            c.not_equals.is_some(),
            c.exists.is_some(),
            c.absent.is_some(),
            c.matches.is_some(),
            c.length.is_some(),
            c.gte.is_some(),
            c.lte.is_some(),
            c.includes.is_some(),
            c.excludes.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count();
        if n != 1 {
            self.err(
                c.pointer.pos,
                format!("check on `{}` must give exactly one of equals, not_equals, exists, absent, matches, length, gte, lte, includes, excludes", c.pointer.raw),
            );
        }
        if c.exists == Some(false) || c.absent == Some(false) {
            self.err(
                c.pointer.pos,
                "write `absent: true` instead of `exists: false` (and vice versa)",
            );
        }
        for v in [&c.equals, &c.not_equals, &c.includes, &c.excludes]
            .into_iter()
            .flatten()
        {
            self.json_value(v, scope, ctx);
        }
        if let Some(re) = &c.matches {
            self.regex(re);
        }
        for n in [&c.length, &c.gte, &c.lte].into_iter().flatten() {
            self.num(n, scope, ctx);
        }
    }

    pub fn header_check(&mut self, h: &HeaderCheck, scope: &Scope, ctx: &CheckCtx<'_>) {
        let n = [
            h.present.is_some(),
            h.absent.is_some(),
            h.equals.is_some(),
            h.matches.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count();
        if n != 1 {
            self.err(
                Pos::of(&h.name),
                "a header check gives exactly one of present, absent, equals, matches",
            );
        }
        if let Some(t) = &h.equals {
            self.template(t, scope, ctx);
        }
        if let Some(re) = &h.matches {
            self.regex(re);
        }
    }

    pub fn regex(&mut self, re: &Located<String>) {
        if let Err(e) = Regex::new(&re.value) {
            self.err(
                Pos::of(re),
                format!("invalid regular expression: {}", first_line(&e.to_string())),
            );
        }
    }

    pub fn base64(&mut self, b: &Located<String>) {
        use base64::Engine as _;
        if base64::engine::general_purpose::STANDARD
            .decode(b.value.as_bytes())
            .is_err()
        {
            self.err(Pos::of(b), "invalid base64");
        }
    }

    pub fn json_value(
        &mut self,
        v: &Located<serde_json::Value>,
        scope: &Scope,
        ctx: &CheckCtx<'_>,
    ) {
        let pos = Pos::of(v);
        let mut strings = Vec::new();
        collect_strings(&v.value, &mut strings);
        for s in strings {
            match parse_parts(s) {
                Ok(_) => {
                    let t = Template::parse(s, pos).expect("parsed above");
                    self.template(&t, scope, ctx);
                }
                Err(e) => self.err(pos, e),
            }
        }
    }

    pub fn num(&mut self, n: &NumExpr, scope: &Scope, ctx: &CheckCtx<'_>) {
        if let Some(var) = n.expr.var() {
            self.var(var, n.pos, scope, ctx);
        }
    }

    /// Acting as the admin needs the admin token, which only some runs are given.
    pub fn principal(&mut self, principal: Principal, pos: Pos, ctx: &CheckCtx<'_>) {
        if principal == Principal::Admin && !ctx.requires.contains("admin_token") {
            self.err(pos, "`as: admin` needs `requires: [admin_token]`");
        }
        if principal == Principal::Unscoped && !ctx.requires.contains("unscoped_token") {
            self.err(pos, "`as: unscoped` needs `requires: [unscoped_token]`");
        }
    }

    /// Test controls (`/v1/test/...`, protocol §9) exist only where advertised.
    pub fn test_control(&mut self, path: &Template, ctx: &CheckCtx<'_>) {
        if path.raw.starts_with("/v1/test/") && !ctx.requires.contains("test_controls") {
            self.err(
                path.pos,
                format!(
                    "`{}` is a test control: needs `requires: [test_controls]`",
                    path.raw
                ),
            );
        }
    }

    /// A step sent through the peer needs a target that has one.
    pub fn via(&mut self, via: Via, pos: Pos, ctx: &CheckCtx<'_>) {
        if via == Via::Peer && !ctx.requires.contains("peer") {
            self.err(pos, "`via: peer` needs `requires: [peer]`");
        }
    }

    pub fn template(&mut self, t: &Template, scope: &Scope, ctx: &CheckCtx<'_>) {
        for var in t.vars() {
            self.var(var, t.pos, scope, ctx);
        }
    }

    fn var(&mut self, var: &str, pos: Pos, scope: &Scope, ctx: &CheckCtx<'_>) {
        if builtin(var).is_some() {
            self.builtins.insert(var.to_owned());
        }
        match builtin(var) {
            Some(Builtin::Known) => {}
            Some(Builtin::OtherProvider) => {
                if !ctx.requires.contains("two_providers") {
                    self.err(
                        pos,
                        "`{{provider.other}}` needs `requires: [two_providers]`",
                    );
                }
            }
            Some(Builtin::UnknownKey) => self.err(
                pos,
                format!("unknown variable `{var}` (not an advertised limit or retention)"),
            ),
            None if scope.captures.contains(var) => {}
            None => {
                let when = if ctx.cleanup {
                    "in any step"
                } else {
                    "by an earlier step"
                };
                self.err(
                    pos,
                    format!("unknown variable `{var}`: not built in and not captured {when}"),
                );
            }
        }
    }
}

/// Where a step is checked: what its scenario requires, and whether it is a cleanup step
/// (which may use any capture: one that never happened skips the step).
pub struct CheckCtx<'a> {
    pub requires: &'a BTreeSet<&'a str>,
    pub cleanup: bool,
}

enum Builtin {
    Known,
    OtherProvider,
    UnknownKey,
}

fn builtin(name: &str) -> Option<Builtin> {
    match name {
        "run_id" | "canary" | "uuid" | "rand" | "provider.default" | "base_dir" => {
            Some(Builtin::Known)
        }
        "provider.other" => Some(Builtin::OtherProvider),
        _ => {
            if let Some(key) = name.strip_prefix("limits.") {
                Some(if LIMIT_KEYS.contains(&key) {
                    Builtin::Known
                } else {
                    Builtin::UnknownKey
                })
            } else if let Some(key) = name.strip_prefix("retention.") {
                Some(if RETENTION_KEYS.contains(&key) {
                    Builtin::Known
                } else {
                    Builtin::UnknownKey
                })
            } else if name.starts_with("provider.") {
                Some(Builtin::UnknownKey)
            } else {
                None
            }
        }
    }
}

fn collect_strings<'v>(v: &'v serde_json::Value, out: &mut Vec<&'v str>) {
    match v {
        serde_json::Value::String(s) => out.push(s),
        serde_json::Value::Array(items) => items.iter().for_each(|i| collect_strings(i, out)),
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                out.push(k);
                collect_strings(v, out);
            }
        }
        _ => {}
    }
}
