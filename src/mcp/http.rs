//! The client side of MCP's streamable HTTP transport, as the runner drives a server under
//! test: rmcp's transport (sessions by `Mcp-Session-Id`, responses as JSON or SSE, SSE resumed
//! with `Last-Event-ID` where the server gives event IDs) over the runner's own HTTP client,
//! bounded against a server that misbehaves, and the session's end: a `DELETE` with the
//! session's ID, sent by the runner itself so that its answer can be judged.
//!
//! Bounds: every message (an SSE event or a JSON body) is read up to the run's cap on one
//! message (`--max-event-bytes`, as on stdio) and an error body up to [`MAX_ERROR_BODY`]; what
//! went over the cap is kept for the message of the call that failed ([`HttpLink::refused`]);
//! at most [`MAX_REQUESTS`] POSTs at once; a dropped
//! event stream is resumed at most [`MAX_RESUMES`] times, waiting no more than
//! [`MAX_RESUME_DELAY`] between tries; a session the server says has expired is not silently
//! replaced by a new one. How long each call, the `initialize` and the `DELETE` may take is the
//! caller's deadline.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt as _;
use futures_util::stream::BoxStream;
use http::{HeaderName, HeaderValue};
use rmcp::model::ClientJsonRpcMessage;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::common::client_side_sse::ExponentialBackoff;
use rmcp::transport::streamable_http_client::{
    SseError, StreamableHttpClient, StreamableHttpClientTransportConfig, StreamableHttpError,
    StreamableHttpPostResponse, StreamableHttpResponseLimits,
};
use sse_stream::Sse;

/// The most of an error response's body kept, for the message that names it.
pub const MAX_ERROR_BODY: usize = 16 * 1024;
/// POSTs in flight at once in one session.
pub const MAX_REQUESTS: usize = 4;
/// How often a dropped event stream is resumed before the call fails.
pub const MAX_RESUMES: usize = 3;
/// The longest wait between two attempts to resume an event stream.
pub const MAX_RESUME_DELAY: Duration = Duration::from_secs(5);

type Error = StreamableHttpError<reqwest::Error>;
type Events = BoxStream<'static, Result<Sse, SseError>>;

/// What the link has seen of its session.
#[derive(Default)]
struct Seen {
    /// The `Mcp-Session-Id` the server gave the session, from its first answer that had one.
    session: Option<String>,
    /// Set once the runner ends the session itself: rmcp then sends no `DELETE` of its own.
    ended: bool,
    /// The first message the transport refused for its size, as rmcp said it.
    refused: Option<String>,
}

/// Whether an error of rmcp's transport is its refusal of a message over the cap (rmcp's
/// own words: its limiter's error type is private).
fn over_the_cap(error: &dyn std::fmt::Display) -> bool {
    error.to_string().contains("exceeded the maximum size")
}

/// rmcp's HTTP client for one session: reqwest with the runner's settings, every read bounded
/// by [`HttpLink::limits`], and the session's ID kept for its end.
#[derive(Clone)]
pub struct HttpLink {
    http: reqwest::Client,
    /// The cap on one message: an SSE event or a JSON body.
    max_message: usize,
    seen: Arc<Mutex<Seen>>,
}

impl HttpLink {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The session's ID, once the server gave one.
    pub fn session(&self) -> Option<String> {
        self.seen().session.clone()
    }

    /// From here on the runner ends the session: rmcp's transport, when it stops, sends no
    /// `DELETE` of its own.
    pub fn take_over_end(&self) {
        self.seen().ended = true;
    }

    /// The first message refused for its size, if any: why the call that waited for it
    /// failed.
    pub fn refused(&self) -> Option<String> {
        self.seen().refused.clone()
    }

    fn note_refusal(&self, error: &dyn std::fmt::Display) {
        if over_the_cap(error) {
            self.seen().refused.get_or_insert_with(|| {
                format!(
                    "an MCP message exceeds --max-event-bytes ({} bytes): {error}",
                    self.max_message
                )
            });
        }
    }

    fn limits(&self) -> StreamableHttpResponseLimits {
        let mut limits = StreamableHttpResponseLimits::default();
        limits.max_sse_event_size = self.max_message;
        limits.max_json_response_size = self.max_message;
        limits.max_error_response_size = MAX_ERROR_BODY;
        limits
    }

    /// An event stream whose refusal of an event over the cap is noted.
    fn noting(&self, events: Events) -> Events {
        let link = self.clone();
        Box::pin(events.inspect(move |event| {
            if let Err(e) = event {
                link.note_refusal(e);
            }
        }))
    }
}

impl StreamableHttpClient for HttpLink {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<StreamableHttpPostResponse, Error> {
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            self.limits(),
        )
        .await
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        _max_sse_event_size: usize,
    ) -> Result<StreamableHttpPostResponse, Error> {
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            self.limits(),
        )
        .await
    }

    /// Always with the runner's limits, whatever the transport passes.
    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        _limits: StreamableHttpResponseLimits,
    ) -> Result<StreamableHttpPostResponse, Error> {
        let response = self
            .http
            .post_message_with_response_limits(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                self.limits(),
            )
            .await
            .inspect_err(|e| self.note_refusal(e))?;
        if let StreamableHttpPostResponse::Json(_, Some(id))
        | StreamableHttpPostResponse::Sse(_, Some(id)) = &response
        {
            let mut seen = self.seen();
            if seen.session.is_none() {
                seen.session = Some(id.clone());
            }
        }
        Ok(match response {
            StreamableHttpPostResponse::Sse(events, id) => {
                StreamableHttpPostResponse::Sse(self.noting(events), id)
            }
            other => other,
        })
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<(), Error> {
        if self.seen().ended {
            return Ok(());
        }
        self.http
            .delete_session(uri, session_id, auth_header, custom_headers)
            .await
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<Events, Error> {
        let events = self
            .http
            .get_stream_with_max_sse_event_size(
                uri,
                session_id,
                last_event_id,
                auth_header,
                custom_headers,
                self.max_message,
            )
            .await?;
        Ok(self.noting(events))
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        _max_sse_event_size: usize,
    ) -> Result<Events, Error> {
        self.get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
            .await
    }
}

/// rmcp's streamable HTTP transport to `url` over `http` (the runner's client: its TLS
/// settings, no redirects), with the bearer `token` when given, reading no message over
/// `max_message` bytes, and the link that knows the session's ID.
pub fn transport(
    url: &str,
    token: Option<&str>,
    http: reqwest::Client,
    max_message: u64,
) -> (StreamableHttpClientTransport<HttpLink>, HttpLink) {
    let max_message = usize::try_from(max_message).unwrap_or(usize::MAX);
    let link = HttpLink {
        http,
        max_message,
        seen: Arc::default(),
    };
    let mut config = StreamableHttpClientTransportConfig::with_uri(url)
        .max_concurrent_requests(MAX_REQUESTS)
        .max_sse_event_size(max_message)
        .max_json_response_size(max_message)
        .max_error_response_size(MAX_ERROR_BODY)
        // An expired session is the end the scenarios judge; a fresh one in its place would
        // hide it, and own nothing of what the first created.
        .reinit_on_expired_session(false);
    if let Some(token) = token {
        config = config.auth_header(token);
    }
    let mut resume = ExponentialBackoff::default();
    resume.max_times = Some(MAX_RESUMES);
    resume.max_delay = Some(MAX_RESUME_DELAY);
    config.retry_config = Arc::new(resume);
    (
        StreamableHttpClientTransport::with_client(link.clone(), config),
        link,
    )
}

/// How the server answered the `DELETE` that ends a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// 2xx: the server ended the session.
    Ended,
    /// 404: the session was gone already (it had expired, or the server ended it).
    AlreadyGone,
    /// 405: the server does not let a client end its sessions; they end only by expiring.
    NotAllowed,
    /// Any other status.
    Refused(u16),
}

/// Ends the session `session` at `url` with a `DELETE`, as the transport says a client ends
/// one; the caller bounds how long it may take.
pub async fn delete(
    http: &reqwest::Client,
    url: &str,
    token: Option<&str>,
    session: &str,
    protocol_version: Option<&str>,
) -> Result<Deleted, String> {
    let mut request = http.delete(url).header("Mcp-Session-Id", session);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(version) = protocol_version {
        request = request.header("MCP-Protocol-Version", version);
    }
    let response = request.send().await.map_err(|e| describe(&e))?;
    Ok(match response.status().as_u16() {
        200..=299 => Deleted::Ended,
        404 => Deleted::AlreadyGone,
        405 => Deleted::NotAllowed,
        other => Deleted::Refused(other),
    })
}

/// A transport error in one line, with its innermost cause.
fn describe(e: &reqwest::Error) -> String {
    let mut source: &dyn std::error::Error = e;
    while let Some(next) = source.source() {
        source = next;
    }
    if e.is_timeout() {
        format!("timed out: {source}")
    } else {
        source.to_string()
    }
}
