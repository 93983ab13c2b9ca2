//! What the gateway's handlers need from HTTP: the gateway's own problem codes, and (shared
//! with `api`, rule for rule) the caller, the admin, strict JSON, idempotent creation and pages.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

use crate::api::{ApiError, AppState, Problem};
use crate::store::StoreError;
use crate::stream::sse::SseError;

/// A failure of a gateway request: one of the shared codes, or one only the gateway uses.
#[derive(Debug, thiserror::Error)]
pub enum GwError {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("{detail}")]
    Coded {
        status: StatusCode,
        code: &'static str,
        detail: String,
        retry_after_s: Option<u64>,
    },
}

impl GwError {
    pub fn coded(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Self {
        GwError::Coded {
            status,
            code,
            detail: detail.into(),
            retry_after_s: None,
        }
    }

    pub fn session_not_active() -> Self {
        Self::coded(
            StatusCode::CONFLICT,
            "session_not_active",
            "the session is being deleted",
        )
    }

    pub fn lease_lost() -> Self {
        Self::coded(
            StatusCode::CONFLICT,
            "lease_lost",
            "the lease generation is not current",
        )
    }

    pub fn invalid(param: &str, detail: impl Into<String>) -> Self {
        GwError::Api(ApiError::invalid(param, detail))
    }

    pub fn internal(e: impl std::fmt::Display) -> Self {
        GwError::Api(ApiError::internal(e))
    }
}

impl From<StoreError> for GwError {
    fn from(e: StoreError) -> Self {
        GwError::Api(e.into())
    }
}

impl From<SseError> for GwError {
    fn from(e: SseError) -> Self {
        GwError::Api(e.into())
    }
}

impl IntoResponse for GwError {
    fn into_response(self) -> Response {
        let (status, code, detail, retry_after_s) = match self {
            GwError::Api(e) => return e.into_response(),
            GwError::Coded {
                status,
                code,
                detail,
                retry_after_s,
            } => (status, code, detail, retry_after_s),
        };
        let problem = Problem {
            type_: format!("https://sandspec.dev/problems/{code}"),
            title: status.canonical_reason().unwrap_or("Error"),
            status: status.as_u16(),
            detail,
            code,
            request_id: String::new(),
            retryable: retry_after_s.map(|_| true),
            param: None,
        };
        let mut response = problem.clone().render("");
        if let Some(s) = retry_after_s {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response.extensions_mut().insert(problem);
        response
    }
}

pub type GwResult<T> = Result<T, GwError>;

pub(crate) use crate::api::extract::{Admin, Caller, idempotency_key, parse_json};
pub(crate) use crate::api::idempotency::{Created, IdemRequest, run as idempotent};
pub(crate) use crate::api::pagination::PageRequest;

/// Checks the content type and size of a JSON body and parses it strictly.
pub fn json_body<T: DeserializeOwned>(
    state: &AppState,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<T, ApiError> {
    if !crate::api::extract::is_json(headers) {
        return Err(ApiError::UnsupportedMediaType);
    }
    if raw.len() as u64 > state.config.limits.max_body_bytes {
        return Err(ApiError::PayloadTooLarge);
    }
    parse_json(raw)
}
