//! Snapshots: point-in-time copies of a sandbox's files that new sandboxes start from.
//! They outlive their sandbox.

use axum::extract::{OriginalUri, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use crate::clock::now;
use crate::domain::{IdKind, QualifiedId, SandboxState, Snapshot};
use crate::store::{Kind, ListQuery, Record, Scope};

use super::error::ApiError;
use super::extract::{Caller, IdempotencyKey, OptionalJson, Path, QueryPairs};
use super::idempotency::{self, IdemRequest};
use super::lookup;
use super::pagination::PageRequest;
use super::sandboxes::{Empty, sandbox_now};
use super::state::AppState;

fn view(rec: &Record) -> Result<Value, ApiError> {
    let snapshot: Snapshot =
        serde_json::from_value(rec.body.clone()).map_err(ApiError::internal)?;
    serde_json::to_value(snapshot).map_err(ApiError::internal)
}

pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    OriginalUri(uri): OriginalUri,
    Path(id): Path<String>,
    IdempotencyKey(key): IdempotencyKey,
    body: OptionalJson<Empty>,
) -> Result<Response, ApiError> {
    let sandbox = lookup::qualified(&state, Kind::Sandbox, &caller.principal, &id).await?;
    let create = move |state: AppState, principal: String| async move {
        let current = sandbox_now(
            &state,
            &sandbox.id,
            &[SandboxState::Running, SandboxState::Paused],
        )
        .await?;
        let (provider_name, sandbox_local) = lookup::split(&current.id)?;
        let provider = state
            .providers
            .get(provider_name)
            .ok_or_else(|| ApiError::internal("unknown provider"))?;
        let local = provider.allocate_local_id(IdKind::Snapshot);
        provider.snapshot(sandbox_local, &local).await?;
        let snapshot = Snapshot {
            id: QualifiedId::new(provider_name, &local).to_string(),
            sandbox_id: current.id.clone(),
            created_at: now(),
        };
        let rec = Record {
            kind: Kind::Snapshot,
            id: snapshot.id.clone(),
            owner: principal,
            parent: Some(current.id.clone()),
            state: "ready".into(),
            body: serde_json::to_value(&snapshot).map_err(ApiError::internal)?,
            version: 1,
            created_at: snapshot.created_at,
            due_at: None,
        };
        if let Err(e) = state.store.insert(&rec).await {
            let _ = provider.delete_snapshot(&local).await;
            return Err(e.into());
        }
        Ok(rec)
    };
    let idem = IdemRequest::post(&caller.principal, uri.path(), key, &body.raw);
    idempotency::run_create(&state, idem, Kind::Snapshot, view, create).await
}

pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let rec = lookup::qualified(&state, Kind::Snapshot, &caller.principal, &id).await?;
    Ok(axum::Json(view(&rec)?).into_response())
}

pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let page = PageRequest::parse(&state, &query, &caller.principal, String::new())?;
    let mut q = ListQuery::new(Kind::Snapshot, Scope::Owner(&caller.principal));
    q.after = page.after.clone();
    q.limit = Some(page.limit + 1);
    let records = state.store.list(&q).await?;
    Ok(axum::Json(page.page(&state, records, view)?).into_response())
}

pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let rec = lookup::qualified(&state, Kind::Snapshot, &caller.principal, &id).await?;
    let (provider, local) = lookup::split(&rec.id)?;
    let provider = state
        .providers
        .get(provider)
        .ok_or_else(|| ApiError::internal("unknown provider"))?;
    provider.delete_snapshot(local).await?;
    state.store.delete(Kind::Snapshot, &rec.id).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
