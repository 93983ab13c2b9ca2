//! The one mapping from failures to RFC 9457 problem bodies.
//!
//! Handlers and extractors return [`ApiError`]; its `IntoResponse` builds the status, headers
//! and body without the request id, and parks the [`Problem`] in the response extensions so
//! that the request-id middleware can render the final body with the id it assigned. Nothing
//! here ever includes a request body, a header value or a token.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::sandbox::{FileError, ProviderError};
use crate::store::StoreError;
use crate::stream::sse::SseError;

/// Seconds a client should wait before retrying a request that met an unreachable store.
const STORE_RETRY_AFTER_S: u64 = 1;

/// Every way a request can fail, with the stable `code` it is reported as.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("authentication required")]
    Unauthenticated,
    #[error("permission denied")]
    PermissionDenied,
    #[error("not found")]
    NotFound,
    #[error("{detail}")]
    InvalidArgument {
        detail: String,
        param: Option<String>,
    },
    #[error("request body too large")]
    PayloadTooLarge,
    #[error("unsupported media type")]
    UnsupportedMediaType,
    #[error("not acceptable")]
    NotAcceptable,
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("idempotency key reused with a different request")]
    IdempotencyKeyReused,
    #[error("idempotency key in use by a request in flight")]
    IdempotencyKeyInUse,
    #[error("invalid page token")]
    InvalidPageToken,
    #[error("{0}")]
    ResourcesUnsatisfiable(String),
    #[error("{0}")]
    QuotaExceeded(String),
    #[error("{0}")]
    InvalidState(String),
    #[error("process has exited")]
    ProcessExited,
    #[error("process output has expired")]
    OutputExpired,
    #[error("invalid path")]
    InvalidPath,
    #[error("path not found")]
    PathNotFound,
    #[error("nothing is listening on the preview's port")]
    UpstreamUnavailable,
    #[error("the cursor is older than the stream's retention")]
    CursorExpired,
    #[error("too many concurrent streams")]
    TooManyStreams { retry_after_s: u64 },
    #[error("the service is temporarily unavailable")]
    Unavailable,
    #[error("the session is being deleted")]
    SessionNotActive,
    #[error("the session is not paused")]
    SessionNotPaused,
    #[error("the lease generation is not current")]
    LeaseLost,
    #[error("the session's queue is full")]
    QueueFull,
    #[error("the submission has not finished")]
    NotTerminal,
    #[error("the result is past its retention")]
    ResultExpired,
    #[error("the artifact is past its retention")]
    ArtifactExpired,
    /// Details go to the log, never to the client.
    #[error("internal error")]
    Internal(String),
}

impl ApiError {
    pub fn invalid(param: &str, detail: impl Into<String>) -> Self {
        ApiError::InvalidArgument {
            detail: detail.into(),
            param: Some(param.to_owned()),
        }
    }

    pub fn internal(err: impl std::fmt::Display) -> Self {
        ApiError::Internal(err.to_string())
    }

    fn status_and_code(&self) -> (StatusCode, &'static str) {
        use ApiError::*;
        match self {
            Unauthenticated => (StatusCode::UNAUTHORIZED, "unauthenticated"),
            PermissionDenied => (StatusCode::FORBIDDEN, "permission_denied"),
            NotFound => (StatusCode::NOT_FOUND, "not_found"),
            InvalidArgument { .. } => (StatusCode::BAD_REQUEST, "invalid_argument"),
            PayloadTooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
            UnsupportedMediaType => (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type"),
            NotAcceptable => (StatusCode::NOT_ACCEPTABLE, "not_acceptable"),
            MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            IdempotencyKeyReused => (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused"),
            IdempotencyKeyInUse => (StatusCode::CONFLICT, "idempotency_key_in_use"),
            InvalidPageToken => (StatusCode::BAD_REQUEST, "invalid_page_token"),
            ResourcesUnsatisfiable(_) => {
                (StatusCode::UNPROCESSABLE_ENTITY, "resources_unsatisfiable")
            }
            QuotaExceeded(_) => (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded"),
            InvalidState(_) => (StatusCode::CONFLICT, "invalid_state"),
            ProcessExited => (StatusCode::CONFLICT, "process_exited"),
            OutputExpired => (StatusCode::GONE, "output_expired"),
            InvalidPath => (StatusCode::BAD_REQUEST, "invalid_path"),
            PathNotFound => (StatusCode::NOT_FOUND, "path_not_found"),
            UpstreamUnavailable => (StatusCode::BAD_GATEWAY, "upstream_unavailable"),
            CursorExpired => (StatusCode::GONE, "cursor_expired"),
            TooManyStreams { .. } => (StatusCode::TOO_MANY_REQUESTS, "too_many_streams"),
            Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            SessionNotActive => (StatusCode::CONFLICT, "session_not_active"),
            SessionNotPaused => (StatusCode::CONFLICT, "session_not_paused"),
            LeaseLost => (StatusCode::CONFLICT, "lease_lost"),
            QueueFull => (StatusCode::TOO_MANY_REQUESTS, "queue_full"),
            NotTerminal => (StatusCode::CONFLICT, "not_terminal"),
            ResultExpired => (StatusCode::GONE, "result_expired"),
            ArtifactExpired => (StatusCode::GONE, "artifact_expired"),
            Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }

    fn retry_after_s(&self) -> Option<u64> {
        match self {
            ApiError::TooManyStreams { retry_after_s } => Some(*retry_after_s),
            ApiError::Unavailable => Some(STORE_RETRY_AFTER_S),
            ApiError::IdempotencyKeyInUse | ApiError::QueueFull => Some(1),
            _ => None,
        }
    }

    /// Whether the same request may succeed later without any change by the client.
    fn retryable(&self) -> Option<bool> {
        match self {
            ApiError::QuotaExceeded(_) | ApiError::UpstreamUnavailable => Some(true),
            _ => self.retry_after_s().map(|_| true),
        }
    }
}

/// What a handler of `api`, `gateway` or `e2b`'s `/v1`-shaped routes returns.
pub type ApiResult<T> = Result<T, ApiError>;

/// A problem body. `request_id` is filled in by the request-id middleware.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    pub type_: String,
    pub title: &'static str,
    pub status: u16,
    pub detail: String,
    pub code: &'static str,
    pub request_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub param: Option<String>,
}

impl Problem {
    /// The final response body, now that the request id is known.
    pub fn render(mut self, request_id: &str) -> Response {
        self.request_id = request_id.to_owned();
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, Json(self)).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        response
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        if let ApiError::Internal(details) = &self {
            tracing::error!(error = %details, "internal error");
        }
        let param = match &self {
            ApiError::InvalidArgument { param, .. } => param.clone(),
            _ => None,
        };
        let retry_after = self.retry_after_s();
        let problem = Problem {
            type_: format!("https://sandspec.dev/problems/{code}"),
            title: status.canonical_reason().unwrap_or("Error"),
            status: status.as_u16(),
            detail: self.to_string(),
            code,
            request_id: String::new(),
            retryable: self.retryable(),
            param,
        };
        let mut response = problem.clone().render("");
        if matches!(self, ApiError::Unauthenticated) {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(s) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response.extensions_mut().insert(problem);
        response
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(details) => {
                tracing::warn!(error = %details, "store unavailable");
                ApiError::Unavailable
            }
            other => ApiError::internal(format!("store: {other}")),
        }
    }
}

impl From<ProviderError> for ApiError {
    fn from(e: ProviderError) -> Self {
        match e {
            ProviderError::Unsatisfiable(why) => ApiError::ResourcesUnsatisfiable(why),
            ProviderError::NotFound => ApiError::NotFound,
            ProviderError::ProcessExited => ApiError::ProcessExited,
            ProviderError::NoStdin => {
                ApiError::InvalidState("the process was started without stdin".into())
            }
            ProviderError::InvalidPath => ApiError::InvalidPath,
            ProviderError::InvalidArgument { param, detail } => ApiError::invalid(param, detail),
            ProviderError::Store(e) => e.into(),
            ProviderError::Io(e) => ApiError::internal(format!("provider: {e}")),
        }
    }
}

impl From<FileError> for ApiError {
    fn from(e: FileError) -> Self {
        match e {
            FileError::InvalidPath => ApiError::InvalidPath,
            FileError::NotFound => ApiError::PathNotFound,
            FileError::WrongKind => {
                ApiError::invalid("path", "the path names the wrong kind of entry")
            }
            FileError::Io(e) => ApiError::internal(format!("files: {e}")),
        }
    }
}

impl From<SseError> for ApiError {
    fn from(e: SseError) -> Self {
        match e {
            SseError::NotAcceptable => ApiError::NotAcceptable,
            SseError::BadCursor => {
                ApiError::invalid("Last-Event-ID", "the cursor is not a sequence number")
            }
            SseError::CursorExpired => ApiError::CursorExpired,
            SseError::TooManyStreams { retry_after_s } => {
                ApiError::TooManyStreams { retry_after_s }
            }
            SseError::Store(e) => e.into(),
        }
    }
}
