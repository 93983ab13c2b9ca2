//! The one sanitizer: everything that reaches disk (evidence, transcripts, logs, snapshots)
//! passes through it first.
//!
//! It removes the values of every configured secret and every token captured at run time,
//! credential headers (Authorization, Cookie, Set-Cookie, preview tokens), credential query
//! parameters, passwords in URLs, and values shaped like API keys. [`Sanitizer::leaks`] scans
//! text for anything that should have been removed; the evidence writer refuses to write a
//! folder in which it finds one.

use std::borrow::Cow;
use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value;

/// What replaces a removed value. Stable, so snapshots of sanitized output are stable.
pub const REDACTED: &str = "[REDACTED]";

/// Secrets shorter than this are not matched by value: they would redact ordinary words.
/// Such secrets are refused when added (see [`Sanitizer::add_secret`]).
pub const MIN_SECRET_LEN: usize = 8;

/// Headers whose values are credentials, compared case-insensitively.
const SECRET_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "set-cookie",
    "x-preview-token",
    "x-api-key",
    "api-key",
    "x-sandspec-signature",
    "x-sandspec-canary",
];

/// Query parameters and JSON keys whose values are credentials, compared case-insensitively.
const SECRET_NAMES: &[&str] = &[
    "token",
    "preview_token",
    "access_token",
    "refresh_token",
    "id_token",
    "api_key",
    "apikey",
    "key",
    "secret",
    "client_secret",
    "password",
    "passwd",
    "signature",
    "sig",
    "authorization",
    "admin_token",
];

/// Shapes of well-known credentials, matched anywhere in text.
static KEY_SHAPES: LazyLock<Vec<(&'static str, Regex)>> = LazyLock::new(|| {
    [
        ("bearer", r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}"),
        ("basic", r"(?i)\bbasic\s+[A-Za-z0-9+/=]{8,}"),
        ("openai-key", r"\bsk-[A-Za-z0-9_-]{16,}"),
        ("github-token", r"\bgh[pousr]_[A-Za-z0-9]{20,}"),
        ("aws-access-key", r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"),
        ("slack-token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
        (
            "jwt",
            r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",
        ),
        ("private-key", r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    ]
    .into_iter()
    .map(|(name, re)| (name, Regex::new(re).expect("key shape regex")))
    .collect()
});

/// `scheme://user:password@host` → the password part.
static URL_PASSWORD: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]+:)([^@\s/]+)(@)").expect("url regex")
});

/// `name=value` pairs in query strings and form bodies.
static QUERY_PAIR: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"([?&;]|^)([A-Za-z0-9_.-]+)=([^&#\s]*)").expect("query regex"));

/// A JSON pointer and the string value found there, as failure reasons quote them:
/// `/next_page_token: "abc"`.
static POINTER_VALUE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"((?:/[^/\s:"]+)*/([A-Za-z0-9_.-]+): )"((?:[^"\\]|\\.)*)""#)
        .expect("pointer regex")
});

/// A credential header written as a line of text (`Authorization: Bearer x`, `Cookie: a=b`).
static HEADER_LINE: LazyLock<Regex> = LazyLock::new(|| {
    let names = SECRET_HEADERS
        .iter()
        .map(|h| regex::escape(h))
        .collect::<Vec<_>>()
        .join("|");
    Regex::new(&format!(
        r"(?im)^([ \t]*(?:{names})[ \t]*:[ \t]*)([^\r\n]*)"
    ))
    .expect("header line regex")
});

/// A credential query parameter inside a larger text such as a JSON file. The value stops at
/// a quote so the closing quote of a JSON string is not taken for part of it.
static EMBEDDED_QUERY_PAIR: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"[?&;]([A-Za-z0-9_.-]+)=([^&#\s"]*)"#).expect("embedded query regex")
});

/// A secret-named field in JSON: `"token": "v"`.
static JSON_SECRET_FIELD: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#""([A-Za-z0-9_.-]+)"\s*:\s*"((?:[^"\\]|\\.)*)""#).expect("json field regex")
});

/// A recorded header pair in JSON: `["authorization", "v"]`.
static JSON_HEADER_PAIR: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"\[\s*"([A-Za-z0-9_.-]+)"\s*,\s*"((?:[^"\\]|\\.)*)"\s*\]"#)
        .expect("json pair regex")
});

/// Something that should have been removed, found by [`Sanitizer::leaks`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leak {
    /// What kind of secret: a configured secret's label, or a shape name.
    pub what: String,
    /// Byte offset in the scanned text.
    pub offset: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    #[error(
        "a secret labelled `{0}` is shorter than {MIN_SECRET_LEN} characters and cannot be redacted reliably"
    )]
    TooShort(String),
}

/// Knows the run's secrets and removes them, and every credential shape, from text and JSON.
#[derive(Debug, Clone, Default)]
pub struct Sanitizer {
    /// Secret values with their labels, longest first so overlapping secrets redact whole.
    secrets: Vec<(String, String)>,
}

impl Sanitizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a secret value (a token, a key, the canary) under a label used in reports.
    pub fn add_secret(&mut self, value: &str, label: &str) -> Result<(), SecretError> {
        if value.chars().count() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort(label.to_owned()));
        }
        if !self.secrets.iter().any(|(v, _)| v == value) {
            self.secrets.push((value.to_owned(), label.to_owned()));
            self.secrets.sort_by_key(|s| std::cmp::Reverse(s.0.len()));
        }
        Ok(())
    }

    /// Whether `value` is registered for redaction. The evidence writer uses it to refuse a
    /// canary that would be redacted instead of detected.
    pub fn knows(&self, value: &str) -> bool {
        self.secrets.iter().any(|(v, _)| v == value)
    }

    /// Number of registered secret values.
    pub fn secret_count(&self) -> usize {
        self.secrets.len()
    }

    /// Text with every secret value, URL password, credential query value and key shape removed.
    pub fn text<'a>(&self, s: &'a str) -> Cow<'a, str> {
        let mut out: Cow<'a, str> = Cow::Borrowed(s);
        for (value, _) in &self.secrets {
            if out.contains(value.as_str()) {
                out = Cow::Owned(out.replace(value.as_str(), REDACTED));
            }
        }
        if HEADER_LINE.is_match(&out) {
            let replaced = HEADER_LINE.replace_all(&out, |c: &regex::Captures<'_>| {
                if c[2].is_empty() {
                    c[0].to_owned()
                } else {
                    format!("{}{REDACTED}", &c[1])
                }
            });
            out = Cow::Owned(replaced.into_owned());
        }
        redact_group(&mut out, &POINTER_VALUE, 2, 3, is_secret_name);
        redact_group(&mut out, &JSON_SECRET_FIELD, 1, 2, |n| {
            is_secret_name(n) || is_secret_header(n)
        });
        redact_group(&mut out, &JSON_HEADER_PAIR, 1, 2, is_secret_header);
        if URL_PASSWORD.is_match(&out) {
            out = Cow::Owned(
                URL_PASSWORD
                    .replace_all(&out, format!("${{1}}{REDACTED}${{3}}"))
                    .into_owned(),
            );
        }
        if QUERY_PAIR.is_match(&out) {
            let replaced = QUERY_PAIR.replace_all(&out, |c: &regex::Captures<'_>| {
                if is_secret_name(&c[2]) && !c[3].is_empty() && &c[3] != REDACTED {
                    format!("{}{}={REDACTED}", &c[1], &c[2])
                } else {
                    c[0].to_owned()
                }
            });
            if let Cow::Owned(r) = replaced {
                out = Cow::Owned(r);
            }
        }
        for (_, re) in KEY_SHAPES.iter() {
            if re.is_match(&out) {
                out = Cow::Owned(re.replace_all(&out, REDACTED).into_owned());
            }
        }
        out
    }

    /// A header value as it may be recorded: credential headers are replaced whole.
    pub fn header(&self, name: &str, value: &str) -> String {
        if is_secret_header(name) {
            REDACTED.to_owned()
        } else {
            self.text(value).into_owned()
        }
    }

    /// A JSON value with secret-named keys' values replaced and every string sanitized.
    pub fn json(&self, v: &Value) -> Value {
        match v {
            Value::String(s) => Value::String(self.text(s).into_owned()),
            Value::Array(items) => Value::Array(items.iter().map(|i| self.json(i)).collect()),
            Value::Object(map) => Value::Object(
                map.iter()
                    .map(|(k, v)| {
                        let v = if is_secret_name(k) && !v.is_null() {
                            Value::String(REDACTED.to_owned())
                        } else {
                            self.json(v)
                        };
                        (self.text(k).into_owned(), v)
                    })
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    /// Everything in `s` that [`Sanitizer::text`] would have removed: a secret value, a
    /// password in a URL or a credential shape. Empty means the text is clean.
    pub fn leaks(&self, s: &str) -> Vec<Leak> {
        let mut found = Vec::new();
        for (value, label) in &self.secrets {
            if let Some(offset) = s.find(value.as_str()) {
                found.push(Leak {
                    what: label.clone(),
                    offset,
                });
            }
        }
        for c in URL_PASSWORD.captures_iter(s) {
            let pw = c.get(2).expect("group 2");
            if pw.as_str() != REDACTED {
                found.push(Leak {
                    what: "url-password".into(),
                    offset: pw.start(),
                });
            }
        }
        for (name, re) in KEY_SHAPES.iter() {
            if let Some(m) = re.find(s) {
                found.push(Leak {
                    what: (*name).to_owned(),
                    offset: m.start(),
                });
            }
        }
        for c in HEADER_LINE.captures_iter(s) {
            let value = c.get(2).expect("group 2");
            if !value.as_str().is_empty() && !value.as_str().starts_with(REDACTED) {
                found.push(Leak {
                    what: "credential-header".into(),
                    offset: value.start(),
                });
            }
        }
        for c in EMBEDDED_QUERY_PAIR.captures_iter(s) {
            let value = c.get(2).expect("group 2");
            if is_secret_name(&c[1])
                && !value.as_str().is_empty()
                && !value.as_str().starts_with(REDACTED)
            {
                found.push(Leak {
                    what: "credential-parameter".into(),
                    offset: value.start(),
                });
            }
        }
        for c in JSON_SECRET_FIELD.captures_iter(s) {
            let value = c.get(2).expect("group 2");
            let name = &c[1];
            let secret = is_secret_name(name) || is_secret_header(name);
            if secret && !value.as_str().is_empty() && value.as_str() != REDACTED {
                found.push(Leak {
                    what: "credential-field".into(),
                    offset: value.start(),
                });
            }
        }
        for c in JSON_HEADER_PAIR.captures_iter(s) {
            let value = c.get(2).expect("group 2");
            if is_secret_header(&c[1]) && !value.as_str().is_empty() && value.as_str() != REDACTED {
                found.push(Leak {
                    what: "credential-header".into(),
                    offset: value.start(),
                });
            }
        }
        found.sort_by_key(|l| l.offset);
        found
    }
}

/// Replaces capture group `value` of every match of `re` whose group `name` passes
/// `is_secret` (and whose value is not empty or already redacted) with [`REDACTED`].
fn redact_group(
    out: &mut Cow<'_, str>,
    re: &Regex,
    name: usize,
    value: usize,
    is_secret: fn(&str) -> bool,
) {
    if !re.is_match(out) {
        return;
    }
    let replaced = re.replace_all(out, |c: &regex::Captures<'_>| {
        let whole = c.get(0).expect("group 0");
        let v = c.get(value).expect("value group");
        if !is_secret(&c[name]) || v.as_str().is_empty() || v.as_str() == REDACTED {
            return whole.as_str().to_owned();
        }
        let (start, end) = (v.start() - whole.start(), v.end() - whole.start());
        format!(
            "{}{REDACTED}{}",
            &whole.as_str()[..start],
            &whole.as_str()[end..]
        )
    });
    if let Cow::Owned(r) = replaced {
        *out = Cow::Owned(r);
    }
}

fn is_secret_header(name: &str) -> bool {
    SECRET_HEADERS.iter().any(|h| h.eq_ignore_ascii_case(name))
}

fn is_secret_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    SECRET_NAMES.contains(&lower.as_str())
        || lower.ends_with("_token")
        || lower.ends_with("_secret")
        || lower.ends_with("_password")
        || lower.ends_with("_api_key")
}

/// The sanitizer for a run against a target: the target's tokens are secrets by value. The
/// canary is deliberately not added (see [`crate::evidence::WriteOptions::canary`]).
pub fn for_tokens(tokens: &crate::target::Tokens) -> Result<Sanitizer, SecretError> {
    let mut s = Sanitizer::new();
    s.add_secret(&tokens.owner, "owner-token")?;
    s.add_secret(&tokens.other, "other-token")?;
    if let Some(admin) = &tokens.admin {
        s.add_secret(admin, "admin-token")?;
    }
    if let Some(unscoped) = &tokens.unscoped {
        s.add_secret(unscoped, "unscoped-token")?;
    }
    Ok(s)
}

/// A fresh canary secret for one run: it travels in a header and a request body, and must
/// never survive into anything written.
pub fn new_canary() -> String {
    let bytes: [u8; 16] = rand::random();
    format!("sandspec-canary-{}", hex::encode(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn with_secret(value: &str) -> Sanitizer {
        let mut s = Sanitizer::new();
        s.add_secret(value, "owner-token").unwrap();
        s
    }

    #[test]
    fn text_cases() {
        let s = with_secret("tok-alice-0123456789");
        let cases = [
            ("plain words stay", "plain words stay"),
            ("x tok-alice-0123456789 y", "x [REDACTED] y"),
            (
                "Authorization: Bearer abcdefghijkl",
                "Authorization: [REDACTED]",
            ),
            (
                "postgres://u:hunter22@127.0.0.1:5432/db",
                "postgres://u:[REDACTED]@127.0.0.1:5432/db",
            ),
            (
                "/previews/prv_1/?preview_token=abc123&x=1",
                "/previews/prv_1/?preview_token=[REDACTED]&x=1",
            ),
            (
                "/p?limit=5&page_token=zzz",
                "/p?limit=5&page_token=[REDACTED]",
            ),
            ("key sk-abcdefghijklmnopqrstuvwx end", "key [REDACTED] end"),
            ("ghp_abcdefghijklmnopqrstuvwxyz0123", "[REDACTED]"),
            ("AKIAABCDEFGHIJKLMNOP", "[REDACTED]"),
            ("https://host/path?limit=3", "https://host/path?limit=3"),
            (
                r#"steps[6]: /next_page_token: "MTc5.QxKJ", expected null"#,
                r#"steps[6]: /next_page_token: "[REDACTED]", expected null"#,
            ),
            (
                r#"/data/0/id: "sbx_1", expected "sbx_2""#,
                r#"/data/0/id: "sbx_1", expected "sbx_2""#,
            ),
            (
                r#"expected {"client_secret": "abc", "name": "n"}"#,
                r#"expected {"client_secret": "[REDACTED]", "name": "n"}"#,
            ),
            (
                r#"headers [["cookie", "a=b"], ["accept", "*/*"]]"#,
                r#"headers [["cookie", "[REDACTED]"], ["accept", "*/*"]]"#,
            ),
        ];
        for (input, want) in cases {
            assert_eq!(s.text(input), want, "input {input:?}");
            assert!(s.leaks(&s.text(input)).is_empty(), "leak left in {input:?}");
        }
    }

    #[test]
    fn headers_are_redacted_by_name() {
        let s = Sanitizer::new();
        assert_eq!(s.header("Authorization", "Bearer x"), REDACTED);
        assert_eq!(s.header("set-cookie", "a=b"), REDACTED);
        assert_eq!(s.header("X-Preview-Token", "t"), REDACTED);
        assert_eq!(
            s.header("content-type", "application/json"),
            "application/json"
        );
    }

    #[test]
    fn json_keys_and_nested_strings() {
        let s = with_secret("canary-value-xyz");
        let v = json!({
            "token": "abc",
            "nested": {"note": "has canary-value-xyz inside", "admin_token": "q"},
            "list": ["Bearer abcdefghijk", 3, null],
            "page_token": null
        });
        let out = s.json(&v);
        assert_eq!(
            out,
            json!({
                "token": REDACTED,
                "nested": {"note": "has [REDACTED] inside", "admin_token": REDACTED},
                "list": [REDACTED, 3, null],
                "page_token": null
            })
        );
    }

    #[test]
    fn leaks_name_what_survived() {
        let s = with_secret("canary-value-xyz");
        let leaks = s.leaks("ok ... canary-value-xyz ... postgres://a:b@h/");
        let what: Vec<_> = leaks.iter().map(|l| l.what.as_str()).collect();
        assert_eq!(what, ["owner-token", "url-password"]);
        assert!(s.leaks("nothing to see").is_empty());
    }

    #[test]
    fn header_lines_are_redacted() {
        let s = Sanitizer::new();
        let input = "GET / HTTP/1.1\r\nCookie: sid=abc\r\nx-preview-token: t1\r\nAccept: */*";
        let out = s.text(input);
        assert_eq!(
            out,
            "GET / HTTP/1.1\r\nCookie: [REDACTED]\r\nx-preview-token: [REDACTED]\r\nAccept: */*"
        );
        assert!(s.leaks(&out).is_empty());
        assert_eq!(s.leaks(input).len(), 2);
    }

    #[test]
    fn structural_leaks_in_rendered_json() {
        let s = Sanitizer::new();
        let what = |text: &str| {
            s.leaks(text)
                .into_iter()
                .map(|l| l.what)
                .collect::<Vec<_>>()
        };
        // What the sanitizer leaves behind is clean...
        let clean = r#"{"target": "/p/?preview_token=[REDACTED]&x=1", "h": [["set-cookie", "[REDACTED]"]], "admin_token": "[REDACTED]", "page_token": null}"#;
        assert!(what(clean).is_empty(), "{:?}", what(clean));
        // ...while the same places holding values are leaks.
        assert_eq!(
            what(r#"{"target": "/p/?preview_token=abc"}"#),
            ["credential-parameter"]
        );
        assert_eq!(what(r#"[["Authorization", "xyz"]]"#), ["credential-header"]);
        assert_eq!(what(r#"{"client_secret": "xyz"}"#), ["credential-field"]);
        // Lists of ordinary words are not header pairs.
        assert!(what(r#"{"tags": ["token", "sse", "x"]}"#).is_empty());
    }

    #[test]
    fn the_canary_header_is_a_credential_header() {
        assert_eq!(
            Sanitizer::new().header("X-Sandspec-Canary", "sandspec-canary-00"),
            REDACTED
        );
    }

    #[test]
    fn knows_reports_registered_values_only() {
        let s = with_secret("tok-alice-0123456789");
        assert!(s.knows("tok-alice-0123456789"));
        assert!(!s.knows("tok-alice"));
    }

    #[test]
    fn short_secrets_are_refused() {
        let mut s = Sanitizer::new();
        assert_eq!(
            s.add_secret("abc", "x"),
            Err(SecretError::TooShort("x".into()))
        );
        assert_eq!(s.secret_count(), 0);
    }

    #[test]
    fn longest_secret_wins_on_overlap() {
        let mut s = Sanitizer::new();
        s.add_secret("abcdefgh", "short").unwrap();
        s.add_secret("abcdefgh-and-more", "long").unwrap();
        assert_eq!(s.text("[abcdefgh-and-more]"), "[[REDACTED]]");
    }

    #[test]
    fn canaries_are_fresh_and_caught() {
        let a = new_canary();
        assert_ne!(a, new_canary());
        let mut s = Sanitizer::new();
        s.add_secret(&a, "canary").unwrap();
        assert_eq!(s.leaks(&format!("echo: {a}")).len(), 1);
    }
}
