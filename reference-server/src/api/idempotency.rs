//! `Idempotency-Key` on creating POSTs: the first request with a key runs; a repeat with the
//! same body gets the original status and the resource's current state; a repeat with a
//! different body is 422; a repeat while the first runs is 409.
//!
//! The key's scope is (principal, method, route path, key) and the request hash is SHA-256 of
//! the body bytes. Validation happens before the claim, so a rejected request records nothing;
//! a claimed request that fails releases its key.

use std::future::Future;

use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use sha2::{Digest, Sha256};
use time::Duration;

use crate::clock::now;
use crate::defects::Defect;
use crate::store::{IdemClaim, Kind, Record, Scope};

use super::error::ApiError;
use super::state::AppState;

/// What a creating operation produced: its status, the ID of the resource, the body, and any
/// headers (such as `Location`).
pub struct Created {
    pub status: StatusCode,
    pub resource_id: String,
    pub body: Value,
    pub headers: Vec<(HeaderName, String)>,
}

impl Created {
    /// A created resource answered with its body and no extra headers.
    pub fn new(status: StatusCode, resource_id: String, body: Value) -> Self {
        Self {
            status,
            resource_id,
            body,
            headers: Vec::new(),
        }
    }
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

/// Identifies one idempotent request.
pub struct IdemRequest<'a> {
    pub principal: &'a str,
    pub method: &'a str,
    pub path: &'a str,
    pub key: Option<String>,
    pub body: &'a [u8],
}

impl<'a> IdemRequest<'a> {
    /// A `POST` to `path` by `principal`, with its `Idempotency-Key` (if any) and body.
    pub fn post(principal: &'a str, path: &'a str, key: Option<String>, body: &'a [u8]) -> Self {
        Self {
            principal,
            method: "POST",
            path,
            key,
            body,
        }
    }
}

/// An idempotent `POST` that creates one record of `kind`: [`run`] with `create` (given the
/// state and the caller's principal, for the task it runs in), whose record is answered 201
/// with `view` of it, and a replay that answers `view` of the record as the caller sees it now.
pub async fn run_create<C, CF, V>(
    state: &AppState,
    req: IdemRequest<'_>,
    kind: Kind,
    view: V,
    create: C,
) -> Result<Response, ApiError>
where
    C: FnOnce(AppState, String) -> CF,
    CF: Future<Output = Result<Record, ApiError>> + Send + 'static,
    V: Fn(&Record) -> Result<Value, ApiError> + Clone + Send + 'static,
{
    let created_view = view.clone();
    let (task_state, principal) = (state.clone(), req.principal.to_owned());
    let create = move || {
        let creating = create(task_state, principal);
        async move {
            let rec = creating.await?;
            let body = created_view(&rec)?;
            Ok(Created::new(StatusCode::CREATED, rec.id, body))
        }
    };
    let replay_state = state.clone();
    let principal = req.principal.to_owned();
    let replay = move |id: String| async move {
        let rec = replay_state
            .store
            .get(kind, Scope::Owner(&principal), &id)
            .await?;
        let body = rec.as_ref().map(view).transpose()?;
        Ok(body.map(|body| Created::new(StatusCode::OK, id, body)))
    };
    run(state, req, create, replay).await
}

/// Runs `create` at most once per key. `replay` renders the resource's current state for a
/// repeated request (`None` when it is gone); it is answered with the original status. The
/// creation runs in its own task so that a client that disconnects cannot leave a half-made
/// resource or a claimed key behind. Generic over the error so that the gateway, whose
/// errors include codes of its own, shares it.
pub async fn run<C, CF, R, RF, E>(
    state: &AppState,
    req: IdemRequest<'_>,
    create: C,
    replay: R,
) -> Result<Response, E>
where
    C: FnOnce() -> CF,
    CF: Future<Output = Result<Created, E>> + Send + 'static,
    R: FnOnce(String) -> RF,
    RF: Future<Output = Result<Option<Created>, E>>,
    E: From<ApiError> + Send + 'static,
{
    let key = match req.key {
        Some(key) if !state.config.defects.has(Defect::IdempotencyIgnored) => key,
        _ => return spawn(create()).await.map(IntoResponse::into_response),
    };
    let scoped = format!("{} {} {}", req.method, req.path, key);
    let hash = hex::encode(Sha256::digest(req.body));
    let expire_before = now()
        - Duration::seconds(
            i64::try_from(state.config.retention.idempotency_s).unwrap_or(i64::MAX / 2),
        );
    match state
        .store
        .idem_claim(req.principal, &scoped, &hash, expire_before)
        .await
        .map_err(ApiError::from)?
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
    let principal = req.principal.to_owned();
    let creating = create();
    let outcome = spawn(async move {
        let outcome = creating.await;
        let recorded = match &outcome {
            Ok(created) => {
                store
                    .idem_complete(
                        &principal,
                        &scoped,
                        created.status.as_u16(),
                        &created.resource_id,
                    )
                    .await
            }
            Err(_) => store.idem_release(&principal, &scoped).await,
        };
        if let Err(e) = recorded {
            tracing::warn!(error = %e, "could not record the idempotency outcome");
        }
        outcome
    })
    .await?;
    Ok(outcome.into_response())
}

async fn spawn<F, E>(fut: F) -> Result<Created, E>
where
    F: Future<Output = Result<Created, E>> + Send + 'static,
    E: From<ApiError> + Send + 'static,
{
    tokio::spawn(fut)
        .await
        .map_err(|e| E::from(ApiError::internal(e)))?
}
