//! Files in a sandbox: raw bytes in and out, confined to the sandbox's root by the provider.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::sandbox::SandboxFiles;
use crate::store::Kind;

use super::error::ApiError;
use super::extract::{Caller, Path, QueryPairs, read_body};
use super::lookup;
use super::state::AppState;

/// The files of the caller's sandbox `id`.
async fn files_of(state: &AppState, principal: &str, id: &str) -> Result<SandboxFiles, ApiError> {
    let rec = lookup::qualified(state, Kind::Sandbox, principal, id).await?;
    let (provider, local) = lookup::split(&rec.id)?;
    let provider = state
        .providers
        .get(provider)
        .ok_or_else(|| ApiError::internal("unknown provider"))?;
    Ok(provider.files(local)?)
}

/// Runs blocking file I/O off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(ApiError::internal)?
}

pub async fn write(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    query: QueryPairs,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let path = query.get("path").unwrap_or("").to_owned();
    if path.is_empty() {
        return Err(ApiError::InvalidPath);
    }
    let files = files_of(&state, &caller.principal, &id).await?;
    let bytes = read_body(&headers, body, state.config.limits.max_file_bytes).await?;
    let outcome = blocking(move || Ok(files.write(&path, &bytes)?)).await?;
    let status = if outcome.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let body = json!({"path": outcome.path, "size": outcome.size, "sha256": outcome.sha256});
    Ok((status, axum::Json(body)).into_response())
}

pub async fn read(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let path = query.get("path").unwrap_or("").to_owned();
    let files = files_of(&state, &caller.principal, &id).await?;
    let bytes = blocking(move || Ok(files.read(&path)?)).await?;
    let mut response = Response::new(Body::from(bytes));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    Ok(response)
}

pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let path = query.get("path").unwrap_or("").to_owned();
    let files = files_of(&state, &caller.principal, &id).await?;
    let mut entries = blocking(move || Ok(files.list(&path)?)).await?;
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(axum::Json(json!({ "entries": entries })).into_response())
}

pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let path = query.get("path").unwrap_or("").to_owned();
    if path.is_empty() {
        return Err(ApiError::InvalidPath);
    }
    let files = files_of(&state, &caller.principal, &id).await?;
    blocking(move || Ok(files.delete(&path)?)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
