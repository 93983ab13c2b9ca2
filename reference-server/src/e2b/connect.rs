//! The Connect protocol with its JSON codec, as envd speaks it: unary calls are a plain POST
//! with an `application/json` body, server streams carry `application/connect+json`
//! envelopes (one flags byte, a 4-byte big-endian length, the JSON message) and end with an
//! end-of-stream envelope (flag `0x02`) holding `{}` or `{"error": {...}}`.
//!
//! Hand-written rather than taken from a crate: the kept Rust Connect implementations bring
//! prost, code generation from `.proto` files and their own HTTP stack, while envd's surface
//! here is a dozen messages whose JSON mapping serde states directly; the framing is the
//! five-byte prefix above.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::ApiError;
use crate::sandbox::{FileError, ProviderError};

/// The envelope flag of the end-of-stream message.
const END_STREAM: u8 = 0x02;
/// The envelope flag of a compressed message (never sent by this server, refused inbound).
const COMPRESSED: u8 = 0x01;
/// Largest request message accepted.
const MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// A Connect error: a code from the protocol's fixed set and a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

/// The Connect error codes this server sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (the Connect protocol's table).
    pub fn status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }

    fn body(&self) -> Value {
        json!({"code": self.code.as_str(), "message": self.message})
    }
}

impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        let mut response = (self.code.status(), axum::Json(self.body())).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }
}

impl From<ApiError> for ConnectError {
    fn from(e: ApiError) -> Self {
        match e {
            ApiError::NotFound | ApiError::PathNotFound => ConnectError::not_found(e.to_string()),
            ApiError::InvalidArgument { .. } | ApiError::InvalidPath => {
                ConnectError::invalid(e.to_string())
            }
            ApiError::ProcessExited => ConnectError::not_found("process not found"),
            ApiError::InvalidState(_) => ConnectError::new(Code::FailedPrecondition, e.to_string()),
            ApiError::Unauthenticated => ConnectError::new(Code::Unauthenticated, e.to_string()),
            ApiError::PermissionDenied => ConnectError::new(Code::PermissionDenied, e.to_string()),
            ApiError::QuotaExceeded(_) | ApiError::TooManyStreams { .. } => {
                ConnectError::new(Code::ResourceExhausted, e.to_string())
            }
            ApiError::Unavailable => ConnectError::new(Code::Unavailable, e.to_string()),
            ApiError::Internal(details) => {
                tracing::error!(error = %details, "internal error");
                ConnectError::new(Code::Internal, "internal error")
            }
            other => ConnectError::new(Code::Internal, other.to_string()),
        }
    }
}

impl From<ProviderError> for ConnectError {
    fn from(e: ProviderError) -> Self {
        ApiError::from(e).into()
    }
}

impl From<FileError> for ConnectError {
    fn from(e: FileError) -> Self {
        match e {
            FileError::NotFound => ConnectError::not_found("no such file or directory"),
            FileError::InvalidPath => {
                ConnectError::invalid("the path is outside the sandbox's filesystem")
            }
            FileError::WrongKind => ConnectError::invalid("the path names the wrong kind of entry"),
            FileError::Io(e) => ApiError::internal(format!("files: {e}")).into(),
        }
    }
}

/// The media type of a request, without parameters.
fn media_type(headers: &HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

fn decode_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ConnectError> {
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        bytes
    };
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ConnectError::invalid(format!("invalid message: {inner}"))
        } else {
            ConnectError::invalid(format!("invalid message at {path}: {inner}"))
        }
    })
}

/// The message of a unary request (`application/json`).
pub fn unary_request<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<T, ConnectError> {
    match media_type(headers).as_str() {
        "application/json" => {}
        "application/proto" => {
            return Err(ConnectError::new(
                Code::Unimplemented,
                "only the JSON codec is served (application/json)",
            ));
        }
        _ => {
            return Err(ConnectError::invalid(
                "unary calls take Content-Type application/json",
            ));
        }
    }
    let encoding = headers
        .get("content-encoding")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("identity");
    if !encoding.trim().eq_ignore_ascii_case("identity") {
        return Err(ConnectError::new(
            Code::Unimplemented,
            "request compression is not supported",
        ));
    }
    decode_json(body)
}

/// The one message of a server-stream request (one `application/connect+json` envelope).
pub fn stream_request<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<T, ConnectError> {
    if media_type(headers) != "application/connect+json" {
        return Err(ConnectError::invalid(
            "streaming calls take Content-Type application/connect+json",
        ));
    }
    let (flags, message, rest) = split_envelope(body)?;
    if flags & COMPRESSED != 0 {
        return Err(ConnectError::new(
            Code::Unimplemented,
            "compressed messages are not supported",
        ));
    }
    if flags != 0 {
        return Err(ConnectError::invalid(format!(
            "unexpected envelope flags {flags:#04x}"
        )));
    }
    if !rest.is_empty() {
        return Err(ConnectError::invalid(
            "a server-stream request carries exactly one message",
        ));
    }
    decode_json(message)
}

/// The messages of a client stream (`application/connect+json` envelopes, one after another
/// in the request body), read as they arrive: a request whose messages are acted on one by
/// one while the client is still sending.
pub struct ClientStream {
    body: axum::body::BodyDataStream,
    buffer: Vec<u8>,
}

impl ClientStream {
    pub fn new(headers: &HeaderMap, body: Body) -> Result<Self, ConnectError> {
        if media_type(headers) != "application/connect+json" {
            return Err(ConnectError::invalid(
                "streaming calls take Content-Type application/connect+json",
            ));
        }
        Ok(Self {
            body: body.into_data_stream(),
            buffer: Vec::new(),
        })
    }

    /// The next message, or `None` once the body has ended between two envelopes.
    pub async fn next<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ConnectError> {
        use futures_util::StreamExt as _;
        loop {
            if self.buffer.len() >= 5 {
                let len = u32::from_be_bytes([
                    self.buffer[1],
                    self.buffer[2],
                    self.buffer[3],
                    self.buffer[4],
                ]) as usize;
                if len > MAX_MESSAGE {
                    return Err(ConnectError::new(
                        Code::ResourceExhausted,
                        format!("message of {len} bytes exceeds {MAX_MESSAGE}"),
                    ));
                }
                if self.buffer.len() >= 5 + len {
                    let flags = self.buffer[0];
                    if flags & COMPRESSED != 0 {
                        return Err(ConnectError::new(
                            Code::Unimplemented,
                            "compressed messages are not supported",
                        ));
                    }
                    if flags != 0 {
                        return Err(ConnectError::invalid(format!(
                            "unexpected envelope flags {flags:#04x}"
                        )));
                    }
                    let message: Vec<u8> = self.buffer.drain(..5 + len).skip(5).collect();
                    return decode_json(&message).map(Some);
                }
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buffer.extend_from_slice(&chunk),
                Some(Err(e)) => {
                    return Err(ConnectError::invalid(format!(
                        "the request body broke off: {e}"
                    )));
                }
                None if self.buffer.is_empty() => return Ok(None),
                None => {
                    return Err(ConnectError::invalid(
                        "the request body ends inside an envelope",
                    ));
                }
            }
        }
    }
}

/// The answer of a client stream: its one message, then the end of the stream.
pub fn client_stream_response<T: Serialize>(message: &T) -> Response {
    let body = serde_json::to_vec(message).unwrap_or_else(|_| b"{}".to_vec());
    let mut bytes = envelope(0, &body).to_vec();
    bytes.extend_from_slice(&envelope(END_STREAM, b"{}"));
    let mut response = Response::new(Body::from(bytes));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    response
}

/// Splits the first envelope off `bytes`: (flags, message, the rest).
pub fn split_envelope(bytes: &[u8]) -> Result<(u8, &[u8], &[u8]), ConnectError> {
    if bytes.len() < 5 {
        return Err(ConnectError::invalid(
            "the request body is shorter than an envelope prefix (5 bytes)",
        ));
    }
    let flags = bytes[0];
    let len = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(ConnectError::new(
            Code::ResourceExhausted,
            format!("message of {len} bytes exceeds {MAX_MESSAGE}"),
        ));
    }
    let rest = &bytes[5..];
    if rest.len() < len {
        return Err(ConnectError::invalid(format!(
            "envelope announces {len} bytes but the body holds {}",
            rest.len()
        )));
    }
    Ok((flags, &rest[..len], &rest[len..]))
}

/// One envelope around `message`.
pub fn envelope(flags: u8, message: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(flags);
    out.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(message);
    Bytes::from(out)
}

/// A unary success.
pub fn unary_response<T: Serialize>(message: &T) -> Response {
    let body = serde_json::to_vec(message).unwrap_or_else(|_| b"{}".to_vec());
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// The sending half of a server stream: messages, then [`StreamSender::finish`]. A clone
/// keeps the stream open; the stream ends when its end-of-stream message is sent or every
/// clone is dropped.
#[derive(Clone)]
pub struct StreamSender {
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
}

impl StreamSender {
    /// Sends one message; false once the client has gone.
    pub async fn send<T: Serialize>(&self, message: &T) -> bool {
        let json = serde_json::to_vec(message).unwrap_or_else(|_| b"{}".to_vec());
        self.tx.send(Ok(envelope(0, &json))).await.is_ok()
    }

    /// Ends the stream with the end-of-stream message: `{}` or the error.
    pub async fn finish(self, error: Option<ConnectError>) {
        let end = match error {
            None => json!({}),
            Some(e) => json!({"error": e.body()}),
        };
        let _ = self
            .tx
            .send(Ok(envelope(END_STREAM, end.to_string().as_bytes())))
            .await;
    }

    /// Resolves when the client has gone.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }
}

/// A server-stream response and the sender that feeds it.
pub fn stream_response() -> (Response, StreamSender) {
    let (tx, rx) = mpsc::channel(64);
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut response = Response::new(body);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    (response, StreamSender { tx })
}

/// A stream that fails before its first message: HTTP 200 with only the end-of-stream error,
/// as the Connect protocol has streams report every error.
pub fn stream_error(error: ConnectError) -> Response {
    let end = json!({"error": error.body()});
    let mut response = Response::new(Body::from(envelope(END_STREAM, end.to_string().as_bytes())));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    response
}

/// The keepalive interval a client asked for (`Keepalive-Ping-Interval`, seconds), if any.
pub fn keepalive_interval(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
}

/// The request's deadline, `Connect-Timeout-Ms` (the Connect protocol's timeout header,
/// which the SDKs send for a command's `timeout`): `None` without it or at 0, which envd
/// takes as no deadline; anything but a number of milliseconds is `invalid_argument`.
pub fn request_timeout(headers: &HeaderMap) -> Result<Option<Duration>, ConnectError> {
    let Some(value) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let ms: u64 = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| {
            ConnectError::invalid("connect-timeout-ms must be a number of milliseconds")
        })?;
    Ok((ms > 0).then(|| Duration::from_millis(ms)))
}

/// Protobuf JSON `bytes`: standard base64 with padding out, either alphabet in.
pub fn encode_bytes(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub fn decode_bytes(text: &str) -> Result<Vec<u8>, ConnectError> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(text).ok())
        .ok_or_else(|| ConnectError::invalid("bytes fields are base64"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_client_stream_yields_messages_split_anywhere_and_names_a_cut() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/connect+json"),
        );
        let mut bytes = envelope(0, br#"{"a":1}"#).to_vec();
        bytes.extend_from_slice(&envelope(0, br#"{"a":2}"#));
        // Chunks that cut the prefix and the message of both envelopes.
        let chunks: Vec<Result<Bytes, std::io::Error>> = [&bytes[..3], &bytes[3..9], &bytes[9..]]
            .into_iter()
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let body = Body::from_stream(futures_util::stream::iter(chunks));
        let mut stream = ClientStream::new(&headers, body).unwrap();
        let first: serde_json::Value = stream.next().await.unwrap().unwrap();
        let second: serde_json::Value = stream.next().await.unwrap().unwrap();
        assert_eq!(
            (first["a"].clone(), second["a"].clone()),
            (1.into(), 2.into())
        );
        assert!(stream.next::<serde_json::Value>().await.unwrap().is_none());

        let cut = Body::from(bytes[..8].to_vec());
        let mut stream = ClientStream::new(&headers, cut).unwrap();
        let err = stream.next::<serde_json::Value>().await.unwrap_err();
        assert!(
            err.message.contains("ends inside an envelope"),
            "{}",
            err.message
        );
    }

    #[test]
    fn envelopes_round_trip_and_framing_faults_are_named() {
        let framed = envelope(0, br#"{"a":1}"#);
        assert_eq!(&framed[..5], &[0, 0, 0, 0, 7]);
        let (flags, message, rest) = split_envelope(&framed).unwrap();
        assert_eq!(
            (flags, message, rest),
            (0, br#"{"a":1}"#.as_slice(), b"".as_slice())
        );

        let short = split_envelope(&[0, 0, 0]).unwrap_err();
        assert!(short.message.contains("shorter"), "{short:?}");
        let truncated = split_envelope(&[0, 0, 0, 0, 9, b'{']).unwrap_err();
        assert!(truncated.message.contains("announces 9"), "{truncated:?}");
    }

    #[test]
    fn stream_requests_take_exactly_one_uncompressed_message() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/connect+json"),
        );
        let one = envelope(0, br#"{"path":"x"}"#);
        let v: Value = stream_request(&headers, &one).unwrap();
        assert_eq!(v, json!({"path": "x"}));

        let mut two = one.to_vec();
        two.extend_from_slice(&one);
        let err = stream_request::<Value>(&headers, &Bytes::from(two)).unwrap_err();
        assert_eq!(err.code, Code::InvalidArgument);

        let compressed = envelope(COMPRESSED, b"{}");
        let err = stream_request::<Value>(&headers, &compressed).unwrap_err();
        assert_eq!(err.code, Code::Unimplemented);

        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let err = stream_request::<Value>(&headers, &one).unwrap_err();
        assert_eq!(err.code, Code::InvalidArgument);
    }

    #[test]
    fn bytes_accept_both_alphabets() {
        assert_eq!(decode_bytes("/w==").unwrap(), vec![0xff]);
        assert_eq!(decode_bytes("_w").unwrap(), vec![0xff]);
        assert_eq!(encode_bytes(&[0xff]), "/w==");
        assert!(decode_bytes("!!").is_err());
    }
}
