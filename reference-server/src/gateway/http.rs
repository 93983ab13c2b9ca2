//! What the gateway's handlers need from HTTP, shared with `api` rule for rule: its errors (one
//! mapping to problem bodies, in `api::error`), the caller, the admin, path parameters, query
//! strings, bodies, strict JSON, idempotent creation and pages.

use axum::body::Body;
use axum::http::HeaderMap;
use serde::de::DeserializeOwned;

use crate::api::{ApiError, AppState};

pub(crate) use crate::api::error::ApiResult;

pub(crate) use crate::api::extract::{
    Admin, Caller, Path, QueryPairs, idempotency_key, parse_json,
};
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

/// Reads a body of at most `limit` bytes: 413 beyond it, and for a body that cannot be read at
/// all (where `api::extract::read_body` answers 400).
pub async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: u64,
) -> Result<bytes::Bytes, ApiError> {
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::PayloadTooLarge);
    }
    axum::body::to_bytes(body, usize::try_from(limit).unwrap_or(usize::MAX))
        .await
        .map_err(|_| ApiError::PayloadTooLarge)
}
