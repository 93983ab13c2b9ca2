//! `Idempotency-Key` on creating POSTs: the first request with a key runs; a repeat with the
//! same body gets the original status and the resource's current state; a repeat with a
//! different body is 422; a repeat while the first runs is 409.
//!
//! The key's scope is (principal, method, route path, key) and the request hash is SHA-256 of
//! the body bytes. Validation happens before the claim, so a rejected request records nothing;
//! a claimed request that fails releases its key.

use std::future::Future;

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use sha2::{Digest, Sha256};
use time::Duration;

use crate::defects::Defect;
use crate::domain::now;
use crate::store::{IdemClaim, Kind, Record, Scope};

use super::error::ApiError;
use super::state::AppState;

/// What a creating operation produced: its status, the ID of the resource, and the body.
pub struct Created {
    pub status: StatusCode,
    pub resource_id: String,
    pub body: Value,
}

/// Identifies one idempotent request.
pub struct IdemRequest<'a> {
    pub principal: &'a str,
    pub method: &'a str,
    pub path: &'a str,
    pub key: Option<String>,
    pub body: &'a [u8],
}

/// An idempotent `POST` to `path` that creates one record of `kind`: [`run`], with a replay
/// that answers the record's current state as the caller sees it, rendered by `view`.
pub async fn run_create<C, CF, V>(
    state: &AppState,
    req: IdemRequest<'_>,
    kind: Kind,
    view: V,
    create: C,
) -> Result<Response, ApiError>
where
    C: FnOnce() -> CF,
    CF: Future<Output = Result<Created, ApiError>> + Send + 'static,
    V: Fn(&Record) -> Result<Value, ApiError>,
{
    let replay_state = state.clone();
    let principal = req.principal.to_owned();
    let replay = move |id: String| async move {
        let rec = replay_state
            .store
            .get(kind, Scope::Owner(&principal), &id)
            .await?;
        rec.as_ref().map(view).transpose()
    };
    run(state, req, create, replay).await
}

/// Runs `create` at most once per key. `replay` renders the resource's current state for a
/// repeated request (`None` when it is gone). The creation runs in its own task so that a
/// client that disconnects cannot leave a half-made resource or a claimed key behind.
pub async fn run<C, CF, R, RF>(
    state: &AppState,
    req: IdemRequest<'_>,
    create: C,
    replay: R,
) -> Result<Response, ApiError>
where
    C: FnOnce() -> CF,
    CF: Future<Output = Result<Created, ApiError>> + Send + 'static,
    R: FnOnce(String) -> RF,
    RF: Future<Output = Result<Option<Value>, ApiError>>,
{
    let key = match req.key {
        Some(key) if !state.config.defects.has(Defect::IdempotencyIgnored) => key,
        _ => return spawn(create()).await.map(respond),
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
        .await?
    {
        IdemClaim::Claimed => {}
        IdemClaim::InFlight { .. } => return Err(ApiError::IdempotencyKeyInUse),
        IdemClaim::Done { request_hash, .. } if request_hash != hash => {
            return Err(ApiError::IdempotencyKeyReused);
        }
        IdemClaim::Done {
            status,
            resource_id,
            ..
        } => {
            let body = replay(resource_id).await?.ok_or(ApiError::NotFound)?;
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            let mut response = (status, axum::Json(body)).into_response();
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
    Ok(respond(outcome))
}

async fn spawn<F>(fut: F) -> Result<Created, ApiError>
where
    F: Future<Output = Result<Created, ApiError>> + Send + 'static,
{
    tokio::spawn(fut).await.map_err(ApiError::internal)?
}

fn respond(created: Created) -> Response {
    (created.status, axum::Json(created.body)).into_response()
}
