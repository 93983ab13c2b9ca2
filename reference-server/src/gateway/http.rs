//! What the gateway's handlers need from HTTP: the caller, the admin, strict JSON, the
//! gateway's own problem codes, idempotent creation and pages.
//!
//! These follow `api::extract`, `api::idempotency` and `api::pagination` rule for rule; they
//! are kept here because those modules are private to `api`.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use serde::de::DeserializeOwned;
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use time::OffsetDateTime;

use crate::api::{ApiError, AppState, Problem};
use crate::config::Scope;
use crate::defects::Defect;
use crate::domain::now;
use crate::store::{IdemClaim, Record, StoreError};
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

fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or(ApiError::Unauthenticated)?
        .to_str()
        .map_err(|_| ApiError::Unauthenticated)?;
    let (scheme, token) = value.split_once(' ').ok_or(ApiError::Unauthenticated)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() || token.contains(' ') {
        return Err(ApiError::Unauthenticated);
    }
    Ok(token)
}

/// The authenticated principal, with `read` (GET) or `write` (everything else) checked.
#[derive(Debug, Clone)]
pub struct Caller {
    pub principal: String,
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = bearer(&parts.headers)?;
        let principal = state
            .config
            .principal_by_token(token)
            .ok_or(ApiError::Unauthenticated)?;
        let needed = if parts.method == Method::GET || parts.method == Method::HEAD {
            Scope::Read
        } else {
            Scope::Write
        };
        if !principal.has_scope(needed) {
            return Err(ApiError::PermissionDenied);
        }
        Ok(Caller {
            principal: principal.name.clone(),
        })
    }
}

/// The test-control administrator (404 when test controls are off).
#[derive(Debug, Clone, Copy)]
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        if !state.config.test_controls || state.config.admin_token.is_none() {
            return Err(ApiError::NotFound);
        }
        let token = bearer(&parts.headers)?;
        if state.config.is_admin_token(token) {
            Ok(Admin)
        } else if state.config.principal_by_token(token).is_some() {
            Err(ApiError::PermissionDenied)
        } else {
            Err(ApiError::Unauthenticated)
        }
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let mime = value
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

/// Checks the content type and size of a JSON body and parses it strictly.
pub fn json_body<T: DeserializeOwned>(
    state: &AppState,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<T, ApiError> {
    if !is_json(headers) {
        return Err(ApiError::UnsupportedMediaType);
    }
    if raw.len() as u64 > state.config.limits.max_body_bytes {
        return Err(ApiError::PayloadTooLarge);
    }
    parse_json(raw)
}

/// Parses JSON strictly; errors name the field (as `param`) and never quote the body.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let bad_json = || ApiError::InvalidArgument {
        detail: "the request body is not valid JSON".into(),
        param: None,
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(&mut de);
    if parsed.is_ok() && de.end().is_err() {
        return Err(bad_json());
    }
    parsed.map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return bad_json();
        }
        let message = inner.to_string();
        let quoted = message.split('`').nth(1).map(str::to_owned);
        let (detail, param) = if message.starts_with("unknown field") {
            let field = quoted.unwrap_or_default();
            let param = match path.as_str() {
                "." | "" => field.clone(),
                p if p.ends_with(&field) => p.to_owned(),
                p => format!("{p}.{field}"),
            };
            (format!("unknown field `{field}`"), param)
        } else if message.starts_with("missing field") {
            let field = quoted.unwrap_or_default();
            let param = if path == "." {
                field.clone()
            } else {
                format!("{path}.{field}")
            };
            (format!("missing field `{field}`"), param)
        } else {
            ("a field has the wrong type or value".to_owned(), path)
        };
        let param = (!param.is_empty() && param != ".").then_some(param);
        ApiError::InvalidArgument { detail, param }
    })
}

/// The `Idempotency-Key` header, validated (1 to 255 visible ASCII characters).
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let bad = || {
        ApiError::invalid(
            "Idempotency-Key",
            "the idempotency key must be 1 to 255 visible ASCII characters",
        )
    };
    let key = value.to_str().map_err(|_| bad())?;
    if key.is_empty() || key.len() > 255 || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad());
    }
    Ok(Some(key.to_owned()))
}

/// What a creating request produced.
pub struct Created {
    pub status: StatusCode,
    pub resource_id: String,
    pub body: Value,
    pub headers: Vec<(header::HeaderName, String)>,
}

impl IntoResponse for Created {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body)).into_response();
        for (name, value) in self.headers {
            if let Ok(value) = HeaderValue::from_str(&value) {
                response.headers_mut().insert(name, value);
            }
        }
        response
    }
}

/// Runs `create` at most once per (principal, method, path, key); a repeat with the same body
/// answers the original status with the current state (`replay`), with another body 422, while
/// the first runs 409. The creation runs in its own task so a disconnect cannot cut it short.
pub async fn idempotent<CF, R, RF>(
    state: &AppState,
    principal: &str,
    scope: String,
    key: Option<String>,
    body: &[u8],
    create: CF,
    replay: R,
) -> GwResult<Response>
where
    CF: std::future::Future<Output = GwResult<Created>> + Send + 'static,
    R: FnOnce(String) -> RF,
    RF: std::future::Future<Output = GwResult<Option<Created>>>,
{
    let key = match key {
        Some(key) if !state.config.defects.has(Defect::IdempotencyIgnored) => key,
        _ => {
            let created = tokio::spawn(create).await.map_err(GwError::internal)??;
            return Ok(created.into_response());
        }
    };
    let scoped = format!("{scope} {key}");
    let hash = hex::encode(Sha256::digest(body));
    let expire_before = now()
        - time::Duration::seconds(
            i64::try_from(state.config.retention.idempotency_s).unwrap_or(i64::MAX / 2),
        );
    match state
        .store
        .idem_claim(principal, &scoped, &hash, expire_before)
        .await?
    {
        IdemClaim::Claimed => {}
        IdemClaim::InFlight { .. } => return Err(ApiError::IdempotencyKeyInUse.into()),
        IdemClaim::Done { request_hash, .. } if request_hash != hash => {
            return Err(ApiError::IdempotencyKeyReused.into());
        }
        IdemClaim::Done {
            status,
            resource_id,
            ..
        } => {
            let mut created = replay(resource_id).await?.ok_or(ApiError::NotFound)?;
            created.status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            let mut response = created.into_response();
            response
                .headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            return Ok(response);
        }
    }
    let store = state.store.clone();
    let principal = principal.to_owned();
    let outcome = tokio::spawn(async move {
        let outcome = create.await;
        let recorded = match &outcome {
            Ok(c) => {
                store
                    .idem_complete(&principal, &scoped, c.status.as_u16(), &c.resource_id)
                    .await
            }
            Err(_) => store.idem_release(&principal, &scoped).await,
        };
        if let Err(e) = recorded {
            tracing::warn!(error = %e, "could not record the idempotency outcome");
        }
        outcome
    })
    .await
    .map_err(GwError::internal)??;
    Ok(outcome.into_response())
}

/// One list request: `limit` and an opaque page token bound to principal and filters.
pub struct PageRequest {
    pub limit: u32,
    pub after: Option<(OffsetDateTime, String)>,
    principal: String,
    filters: String,
}

impl PageRequest {
    pub fn parse(
        state: &AppState,
        limit: Option<&str>,
        page_token: Option<&str>,
        principal: &str,
        filters: String,
    ) -> Result<Self, ApiError> {
        let limits = &state.config.limits;
        let limit = match limit {
            None => limits.default_page_size,
            Some(raw) => match raw.parse::<u32>() {
                Ok(n) if (1..=limits.max_page_size).contains(&n) => n,
                _ => {
                    return Err(ApiError::invalid(
                        "limit",
                        format!("limit must be between 1 and {}", limits.max_page_size),
                    ));
                }
            },
        };
        let mut page = PageRequest {
            limit,
            after: None,
            principal: principal.to_owned(),
            filters,
        };
        if let Some(token) = page_token {
            page.after = Some(
                page.verify(state, token)
                    .ok_or(ApiError::InvalidPageToken)?,
            );
        }
        Ok(page)
    }

    fn mac(&self, state: &AppState, payload: &str) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&state.page_key).expect("HMAC takes any key length");
        if !state.config.defects.has(Defect::PageTokenUnbound) {
            mac.update(self.principal.as_bytes());
            mac.update(b"\0gateway\0");
            mac.update(self.filters.as_bytes());
            mac.update(b"\0");
        }
        mac.update(payload.as_bytes());
        mac
    }

    fn verify(&self, state: &AppState, token: &str) -> Option<(OffsetDateTime, String)> {
        let (payload, tag) = token.split_once('.')?;
        let tag = URL_SAFE_NO_PAD.decode(tag).ok()?;
        self.mac(state, payload).verify_slice(&tag).ok()?;
        let decoded = String::from_utf8(URL_SAFE_NO_PAD.decode(payload).ok()?).ok()?;
        let (nanos, id) = decoded.split_once('.')?;
        let at = OffsetDateTime::from_unix_timestamp_nanos(nanos.parse().ok()?).ok()?;
        Some((at, id.to_owned()))
    }

    /// The page from up to `limit + 1` records (the extra one only says there is more).
    pub fn page(
        &self,
        state: &AppState,
        mut records: Vec<Record>,
        mut view: impl FnMut(&Record) -> GwResult<Value>,
    ) -> GwResult<Value> {
        let has_more = records.len() > self.limit as usize;
        records.truncate(self.limit as usize);
        let next = if has_more {
            records.last().map(|last| {
                let payload = URL_SAFE_NO_PAD.encode(format!(
                    "{}.{}",
                    last.created_at.unix_timestamp_nanos(),
                    last.id
                ));
                let tag = URL_SAFE_NO_PAD.encode(self.mac(state, &payload).finalize().into_bytes());
                format!("{payload}.{tag}")
            })
        } else {
            None
        };
        let data = records
            .iter()
            .map(&mut view)
            .collect::<GwResult<Vec<_>>>()?;
        Ok(serde_json::json!({"data": data, "has_more": has_more, "next_page_token": next}))
    }
}
