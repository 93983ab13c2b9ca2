//! E2B's snapshots and forks over this server's snapshots: `POST /sandboxes/{id}/snapshots`,
//! `GET /snapshots`, `DELETE /templates/{id}` (a snapshot is a template upstream, so it is
//! deleted as one and a sandbox starts from it by naming it as its `templateID`), and
//! `POST /sandboxes/{id}/fork` (one snapshot, then `count` sandboxes started from it).
//!
//! The snapshots are the `/v1` ones (`Kind::Snapshot` records owned by the team); a name
//! given through E2B is kept in the record's body beside them.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::error::ApiError;
use crate::api::extract::{Path, QueryPairs};
use crate::api::lookup::split;
use crate::api::pagination::PageRequest;
use crate::api::sandboxes::{list_matching, sandbox_of};
use crate::api::state::AppState;
use crate::clock::now;
use crate::domain::{IdKind, OnTimeout, QualifiedId, SandboxState, Snapshot};
use crate::store::{Kind, ListQuery, Record, Scope};

use super::control::{
    E2bError, Spec, Team, body, create_sandbox, e2b_state_name, owned, sandbox_view,
};
use super::ids;
use super::records::{e2b_state, name_of, provider_names, snapshot_named};

/// E2B's list page size for snapshots: default and maximum.
const PAGE_LIMIT: u32 = 100;
/// The longest name a snapshot may have.
const MAX_NAME: usize = 128;
/// Most forks of one request (`SandboxForkRequest.count`, maximum 100 upstream).
const MAX_FORKS: i64 = 100;

/// The full name E2B gives a named snapshot template: `<team>/<name>:default`.
fn full_name(team: &str, name: &str) -> String {
    format!("{team}/{name}:default")
}

/// E2B's `SnapshotInfo`.
fn snapshot_view(state: &AppState, rec: &Record) -> Value {
    let id = ids::snapshot_to_e2b(&provider_names(state), &rec.id).unwrap_or_default();
    let names: Vec<String> = name_of(rec)
        .map(|n| full_name(&rec.owner, n))
        .into_iter()
        .collect();
    json!({"snapshotID": id, "names": names})
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    name: Option<String>,
}

/// Copies a sandbox's files into a new snapshot owned by the team; `name` is kept with it.
async fn take_snapshot(
    state: &AppState,
    team: &Team,
    sandbox: &Record,
    name: Option<String>,
) -> Result<Record, E2bError> {
    let current = sandbox_of(sandbox)?;
    if !matches!(current.state, SandboxState::Running | SandboxState::Paused) {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("the sandbox is {}", current.state.as_str()),
        ));
    }
    let (provider_name, sandbox_local) = split(&sandbox.id)?;
    let provider = state
        .providers
        .get(provider_name)
        .ok_or_else(|| ApiError::internal("unknown provider"))?;
    let local = provider.allocate_local_id(IdKind::Snapshot);
    provider.snapshot(sandbox_local, &local).await?;
    let snapshot = Snapshot {
        id: QualifiedId::new(provider_name, &local).to_string(),
        sandbox_id: sandbox.id.clone(),
        created_at: now(),
    };
    let mut body = serde_json::to_value(&snapshot).map_err(ApiError::internal)?;
    if let Some(name) = name {
        body["e2b_name"] = Value::String(name);
    }
    if e2b_state(sandbox).code_interpreter {
        body["e2b_code_interpreter"] = Value::Bool(true);
    }
    let rec = Record {
        kind: Kind::Snapshot,
        id: snapshot.id.clone(),
        owner: team.principal.clone(),
        parent: Some(sandbox.id.clone()),
        state: "ready".into(),
        body,
        version: 1,
        created_at: snapshot.created_at,
        due_at: None,
    };
    if let Err(e) = state.store.insert(&rec).await {
        let _ = provider.delete_snapshot(&local).await;
        return Err(e.into());
    }
    Ok(rec)
}

/// `POST /sandboxes/{id}/snapshots`: 201 `SnapshotInfo`. A name already used by another of
/// the team's snapshots is a conflict (upstream moves the name to the new build instead).
pub async fn create_snapshot(
    State(state): State<AppState>,
    team: Team,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, E2bError> {
    let req: SnapshotRequest = body(&headers, &raw)?;
    if let Some(name) = &req.name {
        let valid = !name.is_empty()
            && name.len() <= MAX_NAME
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !valid {
            return Err(E2bError::new(
                StatusCode::BAD_REQUEST,
                format!("name is 1 to {MAX_NAME} letters, digits, '-', '_' or '.'"),
            ));
        }
    }
    let sandbox = owned(&state, &team, &id).await?;
    if let Some(name) = &req.name
        && snapshot_named(&state, &team.principal, name)
            .await?
            .is_some()
    {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("a snapshot named \"{name}\" already exists"),
        ));
    }
    let rec = take_snapshot(&state, &team, &sandbox, req.name).await?;
    Ok((StatusCode::CREATED, Json(snapshot_view(&state, &rec))).into_response())
}

/// `GET /snapshots`: the team's snapshots, oldest first, filtered by `sandboxID` (the
/// sandbox it was taken of) and `name`; pages by `limit` and `nextToken` (`X-Next-Token`).
pub async fn list_snapshots(
    State(state): State<AppState>,
    team: Team,
    query: QueryPairs,
) -> Result<Response, E2bError> {
    let providers = provider_names(&state);
    // An ID that names no sandbox matches no snapshot.
    let sandbox = query
        .get("sandboxID")
        .map(|id| ids::from_e2b(&providers, id).unwrap_or_default());
    let name = query.get("name").map(str::to_owned);
    let limit = match query.get("limit") {
        None => PAGE_LIMIT,
        Some(raw) => raw
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=PAGE_LIMIT).contains(n))
            .ok_or_else(|| {
                E2bError::bad_request(format!("limit must be between 1 and {PAGE_LIMIT}"))
            })?,
    };
    let filters = format!(
        "e2b-snapshots&sandbox={}&name={}",
        sandbox.as_deref().unwrap_or(""),
        name.as_deref().unwrap_or("")
    );
    let page = PageRequest::from_parts(
        &state,
        Some(&limit.to_string()),
        query.get("nextToken"),
        &team.principal,
        filters,
    )
    .map_err(|e| match e {
        ApiError::InvalidPageToken => E2bError::bad_request("invalid nextToken"),
        other => other.into(),
    })?;
    let mut q = ListQuery::new(Kind::Snapshot, Scope::Owner(&team.principal));
    q.after = page.after.clone();
    let records = list_matching(&state, q, limit as usize + 1, |rec| {
        ids::snapshot_to_e2b(&providers, &rec.id).is_some()
            && sandbox
                .as_ref()
                .is_none_or(|s| rec.parent.as_ref() == Some(s))
            && name.as_deref().is_none_or(|n| {
                name_of(rec) == Some(n)
                    || name_of(rec).map(|m| full_name(&rec.owner, m)).as_deref() == Some(n)
            })
    })
    .await?;
    let page = page.page(&state, records, |r| {
        Ok::<_, E2bError>(snapshot_view(&state, r))
    })?;
    let mut response = Json(page.data).into_response();
    if let Some(token) = page.next_page_token
        && let Ok(value) = HeaderValue::from_str(&token)
    {
        response.headers_mut().insert("x-next-token", value);
    }
    Ok(response)
}

/// `DELETE /templates/{id}`: deletes the team's snapshot so named (204); anything else is
/// 404, which the SDK's `delete_snapshot` reads as "nothing was deleted".
pub async fn delete_template(
    State(state): State<AppState>,
    team: Team,
    Path(id): Path<String>,
) -> Result<Response, E2bError> {
    let not_found = || {
        E2bError::new(
            StatusCode::NOT_FOUND,
            format!("template \"{id}\" not found"),
        )
    };
    let qualified = snapshot_named(&state, &team.principal, &id)
        .await?
        .ok_or_else(not_found)?;
    let (provider, local) = split(&qualified)?;
    let provider = state
        .providers
        .get(provider)
        .ok_or_else(|| ApiError::internal("unknown provider"))?;
    provider.delete_snapshot(local).await?;
    state.store.delete(Kind::Snapshot, &qualified).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    count: Option<i64>,
    timeout: Option<i64>,
}

/// `POST /sandboxes/{id}/fork`: snapshots the sandbox once and starts `count` (1 to 100,
/// default 1) sandboxes from it, each running `timeout` seconds (default 15), with the
/// source's metadata, environment variables, security and timeout behaviour. 201 with one
/// `SandboxForkResult` per fork: its `Sandbox`, or the `Error` it failed with. The source
/// keeps running; the snapshot is removed once the forks have their own files.
pub async fn fork(
    State(state): State<AppState>,
    team: Team,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, E2bError> {
    let req: ForkRequest = body(&headers, &raw)?;
    let count = match req.count {
        None => 1,
        // The defect: the count is checked, then ignored.
        Some(n)
            if (1..=MAX_FORKS).contains(&n)
                && state
                    .config
                    .defects
                    .has(crate::defects::Defect::E2bForkCountIgnored) =>
        {
            1
        }
        Some(n) if (1..=MAX_FORKS).contains(&n) => n as usize,
        Some(_) => {
            return Err(E2bError::bad_request(format!(
                "count must be between 1 and {MAX_FORKS}"
            )));
        }
    };
    let max = state.config.limits.max_timeout_s;
    let timeout_s = match req.timeout {
        None => 15.min(max),
        Some(t) if t >= 0 && (t as u64) <= max => t as u64,
        Some(_) => {
            return Err(E2bError::bad_request(format!(
                "timeout must be between 0 and {max} seconds"
            )));
        }
    };
    let source = owned(&state, &team, &id).await?;
    let sandbox = sandbox_of(&source)?;
    if sandbox.state != SandboxState::Running {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox \"{id}\" is {}", e2b_state_name(&sandbox)),
        ));
    }
    let snapshot = take_snapshot(&state, &team, &source, None).await?;
    let env = crate::api::sandboxes::env_of(&source);
    let mut results = Vec::with_capacity(count);
    for _ in 0..count {
        let spec = Spec {
            template: sandbox.template.clone(),
            from_snapshot: Some(snapshot.id.clone()),
            timeout_s,
            metadata: sandbox.metadata.clone(),
            env: env.clone(),
            auto_pause: sandbox.on_timeout == OnTimeout::Pause,
            secure: e2b_state(&source).secure,
            allow_internet_access: e2b_state(&source).allow_internet_access,
            network: e2b_state(&source).network,
            code_interpreter: e2b_state(&source).code_interpreter,
        };
        results.push(match create_sandbox(&state, &team, spec).await {
            Ok(rec) => json!({ "sandbox": sandbox_view(&state, &rec, &headers)? }),
            Err(e) => json!({"error": {"code": e.status.as_u16(), "message": e.message}}),
        });
    }
    let (provider, local) = split(&snapshot.id)?;
    if let Some(provider) = state.providers.get(provider)
        && let Err(e) = provider.delete_snapshot(local).await
    {
        tracing::warn!(error = %e, "could not remove a fork's snapshot");
    }
    state.store.delete(Kind::Snapshot, &snapshot.id).await?;
    Ok((StatusCode::CREATED, Json(results)).into_response())
}
