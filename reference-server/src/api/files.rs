//! Files in a sandbox: raw bytes in and out, confined to the sandbox's root by the provider.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::defects::Defect;
use crate::sandbox::SandboxFiles;
use crate::store::{Kind, Scope};

use super::error::ApiError;
use super::extract::{Caller, Path, QueryPairs, read_body};
use super::lookup;
use super::state::AppState;

/// The files of the caller's sandbox `id`.
async fn files_of(state: &AppState, principal: &str, id: &str) -> Result<SandboxFiles, ApiError> {
    files_in(state, Scope::Owner(principal), id).await
}

/// The files of the sandbox `id` visible in `scope` (the caller's, but for a defect).
async fn files_in(state: &AppState, scope: Scope<'_>, id: &str) -> Result<SandboxFiles, ApiError> {
    let rec = lookup::qualified_in(state, Kind::Sandbox, scope, id).await?;
    let (provider, local) = lookup::split(&rec.id)?;
    let provider = state
        .providers
        .get(provider)
        .ok_or_else(|| ApiError::internal("unknown provider"))?;
    Ok(provider.files(local)?)
}

/// The client's path, as the handlers pass it on. With `dotdot-clamped-at-root` it is first
/// cleaned the way a URL path is: `..` above the root and a leading `/` are dropped, so a path
/// that should be refused names something inside the root instead.
fn client_path(state: &AppState, raw: &str) -> String {
    if !state.config.defects.has(Defect::DotDotClampedAtRoot) {
        return raw.to_owned();
    }
    let mut parts: Vec<&str> = Vec::new();
    for segment in raw.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            s => parts.push(s),
        }
    }
    parts.join("/")
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
    let path = client_path(&state, query.get("path").unwrap_or(""));
    if path.is_empty() {
        return Err(ApiError::InvalidPath);
    }
    let files = files_of(&state, &caller.principal, &id).await?;
    let mut bytes = read_body(&headers, body, state.config.limits.max_file_bytes).await?;
    if state.config.defects.has(Defect::UploadReadAsText) {
        // The defect: the body is taken for text, and what is not UTF-8 becomes U+FFFD.
        bytes = String::from_utf8_lossy(&bytes)
            .into_owned()
            .into_bytes()
            .into();
    }
    let stage = state.config.defects.has(Defect::RejectedWriteLeavesUpload);
    let outcome = blocking(move || {
        if stage {
            // The defect: the upload is staged beside its target before the target is
            // checked, and only a write that succeeds removes it.
            let staged = format!("{path}.upload");
            let _ = files.write(&staged, &bytes);
            let outcome = files.write(&path, &bytes)?;
            let _ = files.delete(&staged);
            return Ok(outcome);
        }
        Ok(files.write(&path, &bytes)?)
    })
    .await?;
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
    let path = client_path(&state, query.get("path").unwrap_or(""));
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
    caller: Result<Caller, ApiError>,
    Path(id): Path<String>,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let path = client_path(&state, query.get("path").unwrap_or(""));
    let files = match caller {
        Ok(caller) => files_of(&state, &caller.principal, &id).await?,
        // The defect: a route that never asks who is calling.
        Err(ApiError::Unauthenticated) if state.config.defects.has(Defect::FileListSkipsAuth) => {
            files_in(&state, Scope::System, &id).await?
        }
        Err(e) => return Err(e),
    };
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
    let path = client_path(&state, query.get("path").unwrap_or(""));
    if path.is_empty() {
        return Err(ApiError::InvalidPath);
    }
    let files = files_of(&state, &caller.principal, &id).await?;
    blocking(move || Ok(files.delete(&path)?)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
