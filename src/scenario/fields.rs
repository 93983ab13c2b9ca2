//! The parts of the scenario file model that several step kinds share: who a request
//! authenticates as and where it goes, what a response must look like, what to capture from
//! it, and numbers that may be expressions over advertised limits. Every struct denies
//! unknown fields, so a misspelt key is an error at its line.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use serde_saphyr::Spanned;

use super::pos::{Located, Pos};
use super::template::{Expr, Template};

/// Who a request authenticates as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Principal {
    /// The principal that owns what the scenario creates.
    #[default]
    Owner,
    /// A second, unrelated principal.
    Other,
    /// The test-controls admin token.
    Admin,
    /// No Authorization header at all (unless `headers` sets one).
    Anonymous,
    /// A principal the target knows that holds none of the rights the operations need
    /// (needs `requires: [unscoped_token]`).
    Unscoped,
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Principal::Owner => "owner",
            Principal::Other => "other",
            Principal::Admin => "admin",
            Principal::Anonymous => "anonymous",
            Principal::Unscoped => "unscoped",
        })
    }
}

/// Which endpoint of the deployment a step talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// The target's base URL.
    #[default]
    Primary,
    /// The target's peer: another server process of the same deployment (needs
    /// `requires: [peer]`).
    Peer,
}

impl Via {
    /// What a step's label adds when it goes to the peer.
    pub fn label_suffix(self) -> &'static str {
        match self {
            Via::Peer => " (via peer)",
            Via::Primary => "",
        }
    }
}

/// HTTP methods a scenario may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Method {
    #[serde(rename = "GET")]
    Get,
    #[serde(rename = "POST")]
    Post,
    #[serde(rename = "PUT")]
    Put,
    #[serde(rename = "PATCH")]
    Patch,
    #[serde(rename = "DELETE")]
    Delete,
    #[serde(rename = "HEAD")]
    Head,
    #[serde(rename = "OPTIONS")]
    Options,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Post => "POST",
            Method::Put => "PUT",
            Method::Patch => "PATCH",
            Method::Delete => "DELETE",
            Method::Head => "HEAD",
            Method::Options => "OPTIONS",
        }
    }
}

/// Where a captured value comes from: exactly one of `json` (a JSON pointer into the body),
/// `header` (a response header, case-insensitive) and `body: true` (the raw body as text),
/// optionally narrowed by `regex`
/// (the first capture group, or the whole match when the regex has no group).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capture {
    #[serde(default)]
    pub json: Option<String>,
    #[serde(default)]
    pub header: Option<String>,
    /// `true`: the whole response body, as text.
    #[serde(default)]
    pub body: Option<bool>,
    #[serde(default)]
    pub regex: Option<String>,
    /// The value is a credential (a preview token, an API key): the evidence writer redacts
    /// it everywhere.
    #[serde(default)]
    pub secret: bool,
}

/// What a response must look like. With no `status`, any 2xx is required.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    #[serde(default)]
    pub status: Option<u16>,
    /// Any of these statuses.
    #[serde(default)]
    pub status_in: Vec<u16>,
    /// The problem `code`; also requires `application/problem+json` and a matching `status`
    /// field in the body.
    #[serde(default)]
    pub code: Option<String>,
    /// Prefix of the response Content-Type (parameters ignored).
    #[serde(default)]
    pub content_type: Option<String>,
    #[serde(default)]
    pub json: Vec<JsonCheck>,
    /// Checks on the body read as JSON lines (one value per non-empty line, as an array),
    /// such as a stream of newline-delimited JSON.
    #[serde(default)]
    pub json_lines: Vec<JsonCheck>,
    #[serde(default)]
    pub headers: Vec<HeaderCheck>,
    /// The exact raw body, as text.
    #[serde(default)]
    pub body_text: Option<Template>,
    /// The exact raw body, base64-encoded in the file.
    #[serde(default)]
    pub body_base64: Option<Located<String>>,
}

/// One assertion on a JSON pointer. Exactly one of the checks must be given.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonCheck {
    pub pointer: Template,
    /// Equal to this JSON value (strings may hold `{{var}}`).
    #[serde(default, deserialize_with = "present")]
    pub equals: Option<Located<serde_json::Value>>,
    #[serde(default, deserialize_with = "present")]
    pub not_equals: Option<Located<serde_json::Value>>,
    /// `true`: the pointer resolves (to anything, `null` included).
    #[serde(default)]
    pub exists: Option<bool>,
    /// `true`: the pointer does not resolve.
    #[serde(default)]
    pub absent: Option<bool>,
    /// The value is a string matching this regular expression.
    #[serde(default)]
    pub matches: Option<Located<String>>,
    /// The value is an array (or string, or object) of this length.
    #[serde(default)]
    pub length: Option<NumExpr>,
    /// The value is a number >= this.
    #[serde(default)]
    pub gte: Option<NumExpr>,
    /// The value is a number <= this.
    #[serde(default)]
    pub lte: Option<NumExpr>,
    /// The value is an array with an element that contains this value (objects match when
    /// every key given matches; other values must be equal).
    #[serde(default, deserialize_with = "present")]
    pub includes: Option<Located<serde_json::Value>>,
    /// The value is an array with no element that contains this value.
    #[serde(default, deserialize_with = "present")]
    pub excludes: Option<Located<serde_json::Value>>,
}

/// One assertion on a response header. Exactly one check must be given.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderCheck {
    pub name: Located<String>,
    #[serde(default)]
    pub present: Option<bool>,
    #[serde(default)]
    pub absent: Option<bool>,
    #[serde(default)]
    pub equals: Option<Template>,
    #[serde(default)]
    pub matches: Option<Located<String>>,
}

/// Compare against an earlier `digest` or `snapshot`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinceName {
    /// A short name for messages, the transcript and `fails_at`.
    #[serde(default)]
    pub name: Option<String>,
    pub since: Located<String>,
}

/// A JSON value that was written, `null` included (plain `Option` would read `null` as absent).
pub fn present<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Located<serde_json::Value>>, D::Error> {
    Located::<serde_json::Value>::deserialize(deserializer).map(Some)
}

/// A number, or an expression over advertised limits: `5`, `"limits.heartbeat_interval_s * 2"`,
/// `"retention.process_output_s + 2"`.
#[derive(Debug, Clone)]
pub struct NumExpr {
    pub expr: Expr,
    pub pos: Pos,
}

impl<'de> Deserialize<'de> for NumExpr {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = Spanned::<NumLit>::deserialize(deserializer)?;
        let pos = Pos::of(&raw);
        let expr = match raw.value {
            NumLit::Int(n) => Expr::int(n),
            NumLit::Text(text) => Expr::parse(&text).map_err(de::Error::custom)?,
        };
        Ok(NumExpr { expr, pos })
    }
}

/// A literal number or expression text, before parsing.
enum NumLit {
    Int(i64),
    Text(String),
}

impl<'de> Deserialize<'de> for NumLit {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = NumLit;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "an integer or an expression such as \"limits.heartbeat_interval_s * 2\"",
                )
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<NumLit, E> {
                Ok(NumLit::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<NumLit, E> {
                i64::try_from(v)
                    .map(NumLit::Int)
                    .map_err(|_| E::custom("number too large"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<NumLit, E> {
                Ok(NumLit::Text(v.to_owned()))
            }
        }
        deserializer.deserialize_any(V)
    }
}
