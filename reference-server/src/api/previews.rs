//! Previews: token-guarded URLs that proxy to a port inside a sandbox.
//!
//! The proxy is not under `/v1` and takes no bearer token: the preview token (query
//! `preview_token` or header `X-Preview-Token`) is the whole of its authorization. Bodies are
//! streamed both ways; the token never reaches the upstream.

use axum::body::Body;
use axum::extract::{OriginalUri, Request, State};
use axum::http::{HeaderMap, HeaderName, Uri, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use time::Duration;

use crate::clock::now;
use crate::config::constant_time_eq;
use crate::defects::Defect;
use crate::domain::{IdKind, Preview, new_local_id, new_token};
use crate::store::{Kind, Record, Scope};

use super::error::ApiError;
use super::extract::{Caller, IdempotencyKey, Json, Path, QueryPairs, percent_decode};
use super::idempotency::{self, IdemRequest};
use super::lookup;
use super::state::AppState;

const DEFAULT_EXPIRES_IN_S: u64 = 3600;
const MAX_EXPIRES_IN_S: u64 = 86_400;
const TOKEN_PARAM: &str = "preview_token";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreatePreview {
    port: u32,
    expires_in_s: Option<u64>,
}

/// `scheme://host` this request reached us at.
fn base_url(state: &AppState, headers: &HeaderMap) -> String {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(|| state.local_addr.to_string());
    format!("{}://{}", state.scheme(), host)
}

fn view(base: &str, rec: &Record) -> Result<Value, ApiError> {
    let p: Preview = serde_json::from_value(rec.body.clone()).map_err(ApiError::internal)?;
    let expires_at = p
        .expires_at
        .format(&time::format_description::well_known::Rfc3339)
        .map_err(ApiError::internal)?;
    Ok(json!({
        "id": p.id,
        "url": format!("{base}/previews/{}/?{TOKEN_PARAM}={}", p.id, p.token),
        "port": p.port,
        "expires_at": expires_at,
    }))
}

pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    Path(id): Path<String>,
    IdempotencyKey(key): IdempotencyKey,
    body: Json<CreatePreview>,
) -> Result<Response, ApiError> {
    let port = u16::try_from(body.value.port)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::invalid("port", "port must be between 1 and 65535"))?;
    let expires_in_s = body.value.expires_in_s.unwrap_or(DEFAULT_EXPIRES_IN_S);
    if !(1..=MAX_EXPIRES_IN_S).contains(&expires_in_s) {
        return Err(ApiError::invalid(
            "expires_in_s",
            format!("expires_in_s must be between 1 and {MAX_EXPIRES_IN_S}"),
        ));
    }
    let sandbox = lookup::qualified(&state, Kind::Sandbox, &caller.principal, &id).await?;
    let base = base_url(&state, &headers);
    let create = move |state: AppState, principal: String| async move {
        let created_at = now();
        let preview = Preview {
            id: new_local_id(IdKind::Preview),
            sandbox_id: sandbox.id.clone(),
            port,
            token: new_token(),
            expires_at: created_at + Duration::seconds(expires_in_s as i64),
        };
        let rec = Record {
            kind: Kind::Preview,
            id: preview.id.clone(),
            owner: principal,
            parent: Some(sandbox.id.clone()),
            state: "active".into(),
            body: serde_json::to_value(&preview).map_err(ApiError::internal)?,
            version: 1,
            created_at,
            due_at: Some(preview.expires_at),
        };
        state.store.insert(&rec).await?;
        Ok(rec)
    };
    let idem = IdemRequest::post(&caller.principal, uri.path(), key, &body.raw);
    idempotency::run_create(&state, idem, Kind::Preview, move |r| view(&base, r), create).await
}

/// `/previews/{id}` and everything below it.
pub async fn proxy_root(
    State(state): State<AppState>,
    Path(id): Path<String>,
    req: Request,
) -> Result<Response, ApiError> {
    forward(state, id, String::new(), req).await
}

pub async fn proxy(
    State(state): State<AppState>,
    Path((id, rest)): Path<(String, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    forward(state, id, rest, req).await
}

/// Hop-by-hop headers (RFC 9110 §7.6.1), our own token header and the caller's API
/// credentials never cross the proxy: code inside the sandbox must not see a bearer token.
fn strip_headers(headers: &mut HeaderMap) {
    const HOP: &[&str] = &[
        "authorization",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "x-preview-token",
    ];
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::try_from(n.trim()).ok())
        .collect();
    for name in listed {
        headers.remove(name);
    }
    for name in HOP {
        headers.remove(*name);
    }
}

async fn forward(
    state: AppState,
    id: String,
    rest: String,
    req: Request,
) -> Result<Response, ApiError> {
    let query = QueryPairs::parse(req.uri().query());
    let token = query.get(TOKEN_PARAM).map(str::to_owned).or_else(|| {
        req.headers()
            .get("x-preview-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
    // Looked up system-wide: the token, not a principal, authorizes.
    let well_formed = id.starts_with("prv_")
        && id.len() <= 128
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    let rec = if well_formed {
        state.store.get(Kind::Preview, Scope::System, &id).await?
    } else {
        None
    };
    let Some(rec) = rec else {
        return Err(ApiError::PermissionDenied);
    };
    let preview: Preview = serde_json::from_value(rec.body.clone()).map_err(ApiError::internal)?;
    if !state.config.defects.has(Defect::PreviewTokenUnchecked) {
        let valid = token.is_some_and(|t| constant_time_eq(t.as_bytes(), preview.token.as_bytes()));
        if !valid || preview.expires_at <= now() {
            return Err(ApiError::PermissionDenied);
        }
    }
    if state
        .store
        .get(Kind::Sandbox, Scope::System, &preview.sandbox_id)
        .await?
        .is_none()
    {
        return Err(ApiError::PermissionDenied);
    }

    // The upstream query is ours minus the token, re-encoded as it came.
    let upstream_query: Vec<&str> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| {
            !p.is_empty() && percent_decode(p.split('=').next().unwrap_or("")) != TOKEN_PARAM
        })
        .collect();
    // Origin form (`/path?query`): the request goes over a connection of its own, which
    // writes the target as given, and a server expects origin form from a client (RFC 9112
    // section 3.2.1); the `Host` header below names the authority.
    let mut target = format!("/{rest}");
    if !upstream_query.is_empty() {
        target.push('?');
        target.push_str(&upstream_query.join("&"));
    }
    let uri: Uri = target
        .parse()
        .map_err(|_| ApiError::invalid("path", "the preview path is not a valid URI"))?;
    let (mut parts, body) = req.into_parts();
    parts.uri = uri;
    parts.version = axum::http::Version::HTTP_11;
    strip_headers(&mut parts.headers);
    if let Ok(host) = format!("127.0.0.1:{}", preview.port).parse() {
        parts.headers.insert(header::HOST, host);
    }
    let upstream = axum::http::Request::from_parts(parts, body);
    let response = send_upstream(&state, &preview, upstream)
        .await
        .map_err(|e| {
            tracing::debug!(error = %e, port = preview.port, "preview upstream unavailable");
            ApiError::UpstreamUnavailable
        })?;
    let (mut parts, body) = response.into_parts();
    strip_headers(&mut parts.headers);
    Ok(Response::from_parts(parts, Body::new(body)).into_response())
}

/// Sends one request to the preview's port over a connection of its own, opened as the
/// sandbox's processes see `127.0.0.1` (inside its network namespace when it has one).
async fn send_upstream(
    state: &AppState,
    preview: &Preview,
    request: axum::http::Request<Body>,
) -> Result<axum::http::Response<hyper::body::Incoming>, Box<dyn std::error::Error + Send + Sync>> {
    let (provider, local) = preview
        .sandbox_id
        .split_once(':')
        .ok_or("stored sandbox id without provider")?;
    let provider = state.providers.get(provider).ok_or("unknown provider")?;
    let stream = provider.connect(local, preview.port).await?;
    stream.set_nodelay(true)?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "preview upstream connection ended");
        }
    });
    Ok(sender.send_request(request).await?)
}
