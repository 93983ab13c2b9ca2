//! Normal forms of sanitized evidence for snapshot tests: everything that differs between two
//! runs of the same build against the same target (run and object IDs, times, durations,
//! ports, digests, the machine) becomes a stable placeholder, so a snapshot changes only when
//! observed behaviour does.
//!
//! This works on evidence that already went through the sanitizer; it removes variation,
//! not secrets.

use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value;

use super::placeholders::Placeholders;

/// Numeric fields that measure time or size, replaced by `"<ms>"`, `"<s>"` or `"<n>"`.
const MS_FIELDS: &[&str] = &[
    "duration_ms",
    "started_ms",
    "at_ms",
    "first_frame_ms",
    "eof_ms",
    "waited_ms",
];

/// Fields whose whole value is run- or machine-specific.
const OPAQUE_FIELDS: &[(&str, &str)] = &[
    ("run_id", "<run-id>"),
    ("started_at", "<time>"),
    ("ended_at", "<time>"),
    ("commit", "<commit>"),
    ("environment", "<environment>"),
    ("sha256", "<sha256>"),
];

/// Response headers whose values vary from run to run.
const VARYING_HEADERS: &[&str] = &["date", "content-length", "x-request-id", "retry-after"];

static TIME: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?(?:Z|[+-][0-9]{2}:[0-9]{2})")
        .expect("time regex")
});
static LOCAL_PORT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b(127\.0\.0\.1|localhost|\[::1\]):[0-9]{1,5}\b").expect("port regex")
});
static REQUEST_ID: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\breq_[0-9A-Za-z]{26}\b").expect("request id regex"));
static RUN_MARKER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b[0-9a-z]{26}\b").expect("ulid regex"));

/// Normalizes JSON evidence (a receipt or a transcript). `run_id`, when given, is replaced
/// wherever it appears (scenarios tag what they create with it).
pub fn normalize(value: &Value, run_id: Option<&str>) -> Value {
    let mut placeholders = Placeholders::new();
    walk(value, None, run_id, &mut placeholders)
}

fn walk(value: &Value, key: Option<&str>, run_id: Option<&str>, ph: &mut Placeholders) -> Value {
    if let Some(k) = key {
        if let Some((_, p)) = OPAQUE_FIELDS.iter().find(|(name, _)| *name == k) {
            return Value::String((*p).to_owned());
        }
        if MS_FIELDS.contains(&k) && value.is_number() {
            return Value::String("<ms>".to_owned());
        }
        if (k == "seconds" || k == "sandbox_seconds") && value.is_number() {
            return Value::String("<s>".to_owned());
        }
        if k == "measurements" && value.is_object() {
            let map = value.as_object().expect("object");
            return Value::Object(
                map.keys()
                    .map(|k| (k.clone(), Value::String("<s>".to_owned())))
                    .collect(),
            );
        }
        if matches!(k, "len" | "bytes_sent" | "bytes_received") && value.is_number() {
            return Value::String("<n>".to_owned());
        }
    }
    match value {
        Value::String(s) => Value::String(text(s, run_id, ph)),
        Value::Array(items) => {
            // A recorded header pair: `[name, value]`.
            if let [Value::String(name), Value::String(_)] = items.as_slice()
                && VARYING_HEADERS.iter().any(|h| h.eq_ignore_ascii_case(name))
            {
                return Value::Array(vec![
                    Value::String(name.clone()),
                    Value::String(format!("<{name}>")),
                ]);
            }
            Value::Array(items.iter().map(|i| walk(i, None, run_id, ph)).collect())
        }
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), walk(v, Some(k), run_id, ph)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// A string with IDs, times, ports and the run ID replaced. JSON kept as text (response
/// bodies) is normalized as JSON, so its own timestamps and sizes go too.
fn text(s: &str, run_id: Option<&str>, ph: &mut Placeholders) -> String {
    if (s.starts_with('{') || s.starts_with('['))
        && let Ok(inner) = serde_json::from_str::<Value>(s)
    {
        return serde_json::to_string(&walk(&inner, None, run_id, ph)).unwrap_or_default();
    }
    let mut out = REQUEST_ID.replace_all(s, "<request-id>").into_owned();
    out = ph.apply(&out);
    if let Some(id) = run_id.filter(|id| !id.is_empty()) {
        out = out.replace(id, "<run-id>");
    }
    out = TIME.replace_all(&out, "<time>").into_owned();
    out = LOCAL_PORT.replace_all(&out, "$1:<port>").into_owned();
    // Anything else shaped like a bare ULID (a run marker a scenario derived) goes too.
    out = RUN_MARKER.replace_all(&out, "<ulid>").into_owned();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn variation_is_replaced_and_behaviour_kept() {
        let run = "01jrunidabcdefghjkmnpqrstv";
        let input = json!({
            "run_id": run,
            "duration_ms": 12,
            "outcome": "fail",
            "reason": format!("GET http://127.0.0.1:40123/v1/sandboxes/local:sbx_01jabcdefghjkmnpqrstvwxyz0: status 500 at 2026-01-02T03:04:05.123Z (run {run})"),
            "measurements": {"time_to_eof": 1.25},
            "headers": [["date", "Mon"], ["content-type", "application/json"]],
            "body": {"text": r#"{"id":"local:sbx_01jabcdefghjkmnpqrstvwxyz0","created_at":"2026-01-02T03:04:05Z"}"#, "len": 80}
        });
        let out = normalize(&input, Some(run));
        assert_eq!(
            out,
            json!({
                "run_id": "<run-id>",
                "duration_ms": "<ms>",
                "outcome": "fail",
                "reason": "GET http://127.0.0.1:<port>/v1/sandboxes/local:<sbx-1>: status 500 at <time> (run <run-id>)",
                "measurements": {"time_to_eof": "<s>"},
                "headers": [["date", "<date>"], ["content-type", "application/json"]],
                "body": {"text": r#"{"created_at":"<time>","id":"local:<sbx-1>"}"#, "len": "<n>"}
            })
        );
    }
}
