//! What a scenario run observed, kept structured so the evidence writer can sanitize it.
//!
//! **Invariant:** no entry holds an Authorization value. A request records *which* principal
//! authenticated it (or that the scenario supplied a literal header), never the token.

use serde::Serialize;

use crate::scenario::Principal;

/// Bodies longer than this are cut in the transcript (the full length is recorded).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// One transcript entry.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Entry {
    Http(HttpExchange),
    Sse(SseExchange),
    Note(Note),
}

/// Where a request's credential came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Credential {
    /// No Authorization header.
    None,
    /// The named principal's bearer token.
    Principal(Principal),
    /// An Authorization header written in the scenario (its value is not kept).
    ScenarioLiteral,
}

/// A recorded body.
#[derive(Debug, Clone, Serialize)]
pub struct Body {
    pub len: usize,
    /// UTF-8 text, when the body is text.
    pub text: Option<String>,
    /// Base64, when the body is not UTF-8.
    pub base64: Option<String>,
    pub truncated: bool,
}

impl Body {
    pub fn of(bytes: &[u8]) -> Body {
        use base64::Engine as _;
        let truncated = bytes.len() > MAX_BODY_BYTES;
        let kept = &bytes[..bytes.len().min(MAX_BODY_BYTES)];
        match std::str::from_utf8(kept) {
            Ok(text) => Body {
                len: bytes.len(),
                text: Some(text.to_owned()),
                base64: None,
                truncated,
            },
            Err(_) => Body {
                len: bytes.len(),
                text: None,
                base64: Some(base64::engine::general_purpose::STANDARD.encode(kept)),
                truncated,
            },
        }
    }
}

/// One HTTP request and its response (or the transport error).
#[derive(Debug, Clone, Serialize)]
pub struct HttpExchange {
    /// The step that sent it, e.g. `steps[2]` or `cleanup[0]`.
    pub step: String,
    /// Milliseconds since the scenario started.
    pub at_ms: u64,
    pub credential: Credential,
    pub method: String,
    /// Path and query, without scheme and host.
    pub target: String,
    /// Request headers other than Authorization.
    pub request_headers: Vec<(String, String)>,
    pub request_body: Option<Body>,
    pub status: Option<u16>,
    pub response_headers: Vec<(String, String)>,
    pub response_body: Option<Body>,
    pub duration_ms: u64,
    pub error: Option<String>,
}

/// One SSE stream: the response head and every frame with its arrival time.
#[derive(Debug, Clone, Serialize)]
pub struct SseExchange {
    pub step: String,
    pub at_ms: u64,
    pub credential: Credential,
    pub target: String,
    /// Whether a Last-Event-ID header was sent (its value is in `last_event_id`).
    pub last_event_id: Option<String>,
    pub status: Option<u16>,
    pub response_headers: Vec<(String, String)>,
    pub frames: Vec<Frame>,
    pub first_frame_ms: Option<u64>,
    pub eof_ms: Option<u64>,
    pub end: String,
}

/// One SSE item as observed.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Frame {
    Event {
        at_ms: u64,
        event: String,
        id: Option<String>,
        data: String,
    },
    Comment {
        at_ms: u64,
        text: String,
    },
    Retry {
        at_ms: u64,
        ms: u64,
    },
    Fault {
        at_ms: u64,
        fault: String,
    },
}

/// A free-text note (a skipped cleanup step, a swept resource).
#[derive(Debug, Clone, Serialize)]
pub struct Note {
    pub at_ms: u64,
    pub text: String,
}

/// Response headers worth keeping, minus cookies (they can be credentials).
pub fn record_headers(headers: &reqwest::header::HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(name, _)| {
            *name != reqwest::header::SET_COOKIE && *name != reqwest::header::AUTHORIZATION
        })
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect()
}
