//! Evaluating a step's expectations against an observed response.
//!
//! Every check that fails adds one line to the failure; a response that is not JSON where a
//! JSON check needs it is a failure of the target (not of the harness).

use base64::Engine as _;
use regex::Regex;
use serde_json::Value;

use super::vars::{Vars, scalar_text};
use crate::scenario::{Capture, Expect, HeaderCheck, JsonCheck};

/// A response as the engine saw it.
#[derive(Debug, Clone)]
pub struct Observed {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: bytes::Bytes,
}

impl Observed {
    pub fn content_type(&self) -> &str {
        self.headers
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// The body as JSON, or why it is not.
    pub fn json(&self) -> Result<Value, String> {
        serde_json::from_slice(&self.body).map_err(|_| {
            let ct = self.content_type();
            let ct = if ct.is_empty() {
                "no content-type".to_owned()
            } else {
                format!("content-type `{ct}`")
            };
            format!(
                "response body is not JSON ({ct}, {} bytes)",
                self.body.len()
            )
        })
    }

    /// The body as JSON lines: an array of one value per non-empty line, or why it is not.
    /// A last line without its newline that is not JSON is a line cut short (a body the
    /// client stopped reading) and is left out.
    pub fn json_lines(&self) -> Result<Value, String> {
        let text = String::from_utf8_lossy(&self.body);
        let complete = text.ends_with('\n');
        let lines: Vec<&str> = text.split('\n').collect();
        let mut out = Vec::new();
        for (i, line) in lines.iter().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<Value>(line) {
                Ok(v) => out.push(v),
                Err(_) if i + 1 == lines.len() && !complete => {}
                Err(_) => {
                    return Err(format!(
                        "response body line {} is not JSON: {}",
                        i + 1,
                        truncate(line)
                    ));
                }
            }
        }
        Ok(Value::Array(out))
    }
}

/// Status the expectation allows; `default_status` applies when none is given
/// (`None` = any 2xx).
pub fn status_ok(e: &Expect, status: u16, default_status: Option<u16>) -> Result<(), String> {
    if let Some(want) = e.status {
        return if status == want {
            Ok(())
        } else {
            Err(format!("status {status}, expected {want}"))
        };
    }
    if !e.status_in.is_empty() {
        return if e.status_in.contains(&status) {
            Ok(())
        } else {
            Err(format!(
                "status {status}, expected one of {:?}",
                e.status_in
            ))
        };
    }
    match default_status {
        Some(want) if status != want => Err(format!("status {status}, expected {want}")),
        None if !(200..300).contains(&status) => Err(format!("status {status}, expected a 2xx")),
        _ => Ok(()),
    }
}

/// Checks everything in `e` except the status; returns every failed check.
pub fn check_response(e: &Expect, obs: &Observed, vars: &Vars<'_>) -> Vec<String> {
    let mut failures = Vec::new();
    let needs_json = e.code.is_some() || !e.json.is_empty();
    let json = if needs_json {
        match obs.json() {
            Ok(v) => Some(v),
            Err(msg) => {
                failures.push(msg);
                None
            }
        }
    } else {
        None
    };
    if let Some(code) = &e.code {
        if !obs.content_type().starts_with("application/problem+json") {
            failures.push(format!(
                "content-type `{}`, expected application/problem+json",
                obs.content_type()
            ));
        }
        if let Some(json) = &json {
            let got = json.get("code").and_then(Value::as_str);
            if got != Some(code.as_str()) {
                failures.push(format!(
                    "problem code {}, expected `{code}`",
                    got.map_or("missing".into(), |c| format!("`{c}`"))
                ));
            }
            if json.get("status").and_then(Value::as_u64) != Some(u64::from(obs.status)) {
                failures.push(format!(
                    "problem `status` field does not equal the HTTP status {}",
                    obs.status
                ));
            }
        }
    }
    if let Some(prefix) = &e.content_type
        && !obs.content_type().starts_with(prefix.as_str())
    {
        failures.push(format!(
            "content-type `{}`, expected `{prefix}`",
            obs.content_type()
        ));
    }
    if let Some(json) = &json {
        for check in &e.json {
            if let Err(msg) = json_check(check, json, vars) {
                failures.push(msg);
            }
        }
    }
    if !e.json_lines.is_empty() {
        match obs.json_lines() {
            Ok(lines) => {
                for check in &e.json_lines {
                    if let Err(msg) = json_check(check, &lines, vars) {
                        failures.push(format!("JSON lines: {msg}"));
                    }
                }
            }
            Err(msg) => failures.push(msg),
        }
    }
    failures.extend(check_headers(&e.headers, obs, vars));
    if let Some(t) = &e.body_text {
        match vars.render(t) {
            Ok(want) if want.as_bytes() == obs.body.as_ref() => {}
            Ok(want) => failures.push(format!(
                "body {:?}, expected {:?}",
                truncate(&String::from_utf8_lossy(&obs.body)),
                truncate(&want)
            )),
            Err(err) => failures.push(err.to_string()),
        }
    }
    if let Some(b64) = &e.body_base64 {
        let want = base64::engine::general_purpose::STANDARD
            .decode(b64.value.as_bytes())
            .unwrap_or_default();
        if want != obs.body.as_ref() {
            failures.push(format!(
                "body differs from the expected {} bytes (got {} bytes)",
                want.len(),
                obs.body.len()
            ));
        }
    }
    failures
}

/// One JSON pointer assertion.
pub fn json_check(c: &JsonCheck, doc: &Value, vars: &Vars<'_>) -> Result<(), String> {
    let pointer = vars.render(&c.pointer).map_err(|e| e.to_string())?;
    let got = doc.pointer(&pointer);
    let show =
        |v: Option<&Value>| v.map_or_else(|| "nothing".to_owned(), |v| truncate(&v.to_string()));
    if c.exists == Some(true) {
        return got.map(|_| ()).ok_or_else(|| format!("{pointer}: missing"));
    }
    if c.absent == Some(true) {
        return match got {
            None => Ok(()),
            Some(v) => Err(format!(
                "{pointer}: expected absent, found {}",
                show(Some(v))
            )),
        };
    }
    if let Some(want) = &c.equals {
        let want = vars.render_json(&want.value).map_err(|e| e.to_string())?;
        return if got.is_some_and(|g| json_eq(g, &want)) {
            Ok(())
        } else {
            Err(format!(
                "{pointer}: {} , expected {}",
                show(got),
                truncate(&want.to_string())
            ))
        };
    }
    if let Some(not) = &c.not_equals {
        let not = vars.render_json(&not.value).map_err(|e| e.to_string())?;
        let Some(g) = got else {
            return Err(format!("{pointer}: missing"));
        };
        return if json_eq(g, &not) {
            Err(format!(
                "{pointer}: must not be {}",
                truncate(&not.to_string())
            ))
        } else {
            Ok(())
        };
    }
    if let Some(re) = &c.matches {
        let regex = Regex::new(&re.value).map_err(|e| e.to_string())?;
        return match got {
            Some(Value::String(s)) if regex.is_match(s) => Ok(()),
            other => Err(format!(
                "{pointer}: {} does not match /{}/",
                show(other),
                re.value
            )),
        };
    }
    if let Some(n) = &c.length {
        let want = vars.num(n).map_err(|e| e.to_string())?;
        let len = match got {
            Some(Value::Array(a)) => Some(a.len()),
            Some(Value::Object(o)) => Some(o.len()),
            Some(Value::String(s)) => Some(s.chars().count()),
            _ => None,
        };
        return match len {
            Some(len) if i64::try_from(len).ok() == Some(want) => Ok(()),
            Some(len) => Err(format!("{pointer}: length {len}, expected {want}")),
            None => Err(format!("{pointer}: {} has no length", show(got))),
        };
    }
    if let Some(n) = c.gte.as_ref().or(c.lte.as_ref()) {
        let bound = vars.num(n).map_err(|e| e.to_string())? as f64;
        let Some(value) = got.and_then(Value::as_f64) else {
            return Err(format!("{pointer}: {} is not a number", show(got)));
        };
        let ok = if c.gte.is_some() {
            value >= bound
        } else {
            value <= bound
        };
        let op = if c.gte.is_some() { ">=" } else { "<=" };
        return if ok {
            Ok(())
        } else {
            Err(format!("{pointer}: {value}, expected {op} {bound}"))
        };
    }
    if let Some(item) = c.includes.as_ref().or(c.excludes.as_ref()) {
        let item = vars.render_json(&item.value).map_err(|e| e.to_string())?;
        let Some(Value::Array(items)) = got else {
            return Err(format!("{pointer}: {} is not an array", show(got)));
        };
        let found = items.iter().any(|i| contains(i, &item));
        return match (c.includes.is_some(), found) {
            (true, true) | (false, false) => Ok(()),
            (true, false) => Err(format!(
                "{pointer}: no element contains {}",
                truncate(&item.to_string())
            )),
            (false, true) => Err(format!(
                "{pointer}: an element contains {}",
                truncate(&item.to_string())
            )),
        };
    }
    Err(format!("{pointer}: no check given"))
}

/// Equality that treats `1` and `1.0` alike (servers may print either).
fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| json_eq(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_eq(v, w)))
        }
        _ => a == b,
    }
}

/// `item` contains `want`: objects when every key of `want` matches, else equality.
fn contains(item: &Value, want: &Value) -> bool {
    match (item, want) {
        (Value::Object(got), Value::Object(want)) => want
            .iter()
            .all(|(k, w)| got.get(k).is_some_and(|g| contains(g, w))),
        _ => json_eq(item, want),
    }
}

/// Every failed header check of `checks` against `obs`.
pub fn check_headers(checks: &[HeaderCheck], obs: &Observed, vars: &Vars<'_>) -> Vec<String> {
    checks
        .iter()
        .filter_map(|h| header_check(h, &obs.headers, vars).err())
        .collect()
}

fn header_check(
    h: &HeaderCheck,
    headers: &reqwest::header::HeaderMap,
    vars: &Vars<'_>,
) -> Result<(), String> {
    let name = h.name.value.to_ascii_lowercase();
    let values: Vec<String> = headers
        .get_all(name.as_str())
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    if h.present == Some(true) {
        return if values.is_empty() {
            Err(format!("header {name}: missing"))
        } else {
            Ok(())
        };
    }
    if h.absent == Some(true) {
        return if values.is_empty() {
            Ok(())
        } else {
            Err(format!("header {name}: present ({})", values.join(", ")))
        };
    }
    if let Some(t) = &h.equals {
        let want = vars.render(t).map_err(|e| e.to_string())?;
        return if values.contains(&want) {
            Ok(())
        } else {
            Err(format!("header {name}: {:?}, expected {want:?}", values))
        };
    }
    if let Some(re) = &h.matches {
        let regex = Regex::new(&re.value).map_err(|e| e.to_string())?;
        return if values.iter().any(|v| regex.is_match(v)) {
            Ok(())
        } else {
            Err(format!(
                "header {name}: {:?} does not match /{}/",
                values, re.value
            ))
        };
    }
    Err(format!("header {name}: no check given"))
}

/// Takes a capture's value from a response.
pub fn capture(c: &Capture, obs: &Observed) -> Result<Value, String> {
    let value = if let Some(pointer) = &c.json {
        let json = obs.json()?;
        json.pointer(pointer)
            .cloned()
            .ok_or_else(|| format!("capture: {pointer} not found in the response"))?
    } else if let Some(name) = &c.header {
        obs.headers
            .get(name.to_ascii_lowercase().as_str())
            .map(|v| Value::String(String::from_utf8_lossy(v.as_bytes()).into_owned()))
            .ok_or_else(|| format!("capture: header {name} not in the response"))?
    } else if c.body == Some(true) {
        Value::String(String::from_utf8_lossy(&obs.body).into_owned())
    } else {
        return Err("capture names no source".into());
    };
    let Some(re) = &c.regex else { return Ok(value) };
    let regex = Regex::new(re).map_err(|e| e.to_string())?;
    let text = scalar_text(&value);
    let caps = regex
        .captures(&text)
        .ok_or_else(|| format!("capture: `{text}` does not match /{re}/"))?;
    let m = caps
        .get(1)
        .or_else(|| caps.get(0))
        .map(|m| m.as_str())
        .unwrap_or_default();
    Ok(Value::String(m.to_owned()))
}

fn truncate(s: &str) -> String {
    if s.chars().count() > 200 {
        format!("{}…", s.chars().take(200).collect::<String>())
    } else {
        s.to_owned()
    }
}

/// Used by tallies: the problem code of a response, if it has one.
pub fn problem_code(obs: &Observed) -> Option<String> {
    obs.json().ok().and_then(|j| j.get("code").map(scalar_text))
}
