//! Sandboxes: create, list, get, kill, timeout, pause, resume, and borrowed connections.
//!
//! The store record is the sandbox's truth (`domain::Sandbox` as its body, plus the `env` and
//! `timeout_s` it was created with, which are never returned); the provider does the work.
//! A running sandbox's `due_at` is its `expires_at`, which is how the reaper finds it.

use std::collections::BTreeMap;

use axum::extract::{OriginalUri, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::Value;
use time::Duration;

use crate::clock::now;
use crate::defects::Defect;
use crate::domain::{
    Connection, IdKind, OnTimeout, Owner, QualifiedId, Resources, Sandbox, SandboxState,
    new_local_id,
};
use crate::store::{Kind, ListQuery, Record, Scope, StoreError};
use crate::stream::process_stream;

use super::error::ApiError;
use super::extract::{Caller, IdempotencyKey, OptionalJson, Path, QueryPairs};
use super::idempotency::{self, IdemRequest};
use super::lookup;
use super::pagination::{Page, PageRequest};
use super::state::AppState;

const DEFAULT_CPU: f64 = 1.0;
const DEFAULT_MEMORY_MB: u64 = 512;
const TEMPLATE: &str = "base";
const MAX_METADATA_KEYS: usize = 32;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    provider: Option<String>,
    template: Option<String>,
    resources: Option<ResourceRequest>,
    timeout_s: Option<u64>,
    on_timeout: Option<OnTimeout>,
    metadata: Option<BTreeMap<String, String>>,
    env: Option<BTreeMap<String, String>>,
    from_snapshot: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResourceRequest {
    cpu: Option<f64>,
    memory_mb: Option<u64>,
}

/// A body that must be empty or `{}`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Empty {}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetTimeout {
    timeout_s: u64,
}

/// The sandbox as stored (the record body also holds `env` and `timeout_s`).
pub fn sandbox_of(rec: &Record) -> Result<Sandbox, ApiError> {
    serde_json::from_value(rec.body.clone())
        .map_err(|e| ApiError::internal(format!("sandbox body {}: {e}", rec.id)))
}

/// The sandbox `id` as stored now, refused unless it is in one of `states`: a creation runs in a
/// task of its own, after the caller's lookup, and the sandbox may have changed meanwhile.
pub async fn sandbox_now(
    state: &AppState,
    id: &str,
    states: &[SandboxState],
) -> Result<Record, ApiError> {
    let current = state
        .store
        .get(Kind::Sandbox, Scope::System, id)
        .await?
        .ok_or(ApiError::NotFound)?;
    let sbx = sandbox_of(&current)?;
    if !states.contains(&sbx.state) {
        return Err(ApiError::InvalidState(format!(
            "the sandbox is {}",
            sbx.state.as_str()
        )));
    }
    Ok(current)
}

/// The environment every process of the sandbox gets.
pub fn env_of(rec: &Record) -> BTreeMap<String, String> {
    rec.body
        .get("env")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default()
}

fn view(rec: &Record) -> Result<Value, ApiError> {
    serde_json::to_value(sandbox_of(rec)?).map_err(ApiError::internal)
}

/// Writes `sandbox` into the record body, keeping the extra stored fields, and sets the
/// indexed state and due time.
pub(crate) fn store_into(rec: &mut Record, sandbox: &Sandbox) -> Result<(), ApiError> {
    let mut body = serde_json::to_value(sandbox).map_err(ApiError::internal)?;
    if let (Value::Object(new), Value::Object(old)) = (&mut body, &rec.body) {
        // `e2b`: what the E2B surface keeps about a sandbox it created (crate::e2b).
        for key in ["env", "timeout_s", "e2b"] {
            if let Some(v) = old.get(key) {
                new.insert(key.into(), v.clone());
            }
        }
    }
    rec.body = body;
    rec.state = sandbox.state.as_str().to_owned();
    rec.due_at = (sandbox.state == SandboxState::Running).then_some(sandbox.expires_at);
    Ok(())
}

/// Applies `change` to the stored sandbox, retrying when a concurrent writer got there first.
/// `change` sees the current sandbox and the full record; an error leaves the record as is.
pub async fn update_sandbox<F>(
    state: &AppState,
    mut rec: Record,
    mut change: F,
) -> Result<Record, ApiError>
where
    F: FnMut(&mut Sandbox, &Record) -> Result<(), ApiError>,
{
    for _ in 0..16 {
        let mut sandbox = sandbox_of(&rec)?;
        change(&mut sandbox, &rec)?;
        store_into(&mut rec, &sandbox)?;
        match state.store.update(&rec).await {
            Ok(stored) => return Ok(stored),
            Err(StoreError::Conflict) => {
                rec = state
                    .store
                    .get(Kind::Sandbox, Scope::System, &rec.id)
                    .await?
                    .ok_or(ApiError::NotFound)?;
            }
            Err(StoreError::NotFound) => return Err(ApiError::NotFound),
            Err(e) => return Err(e.into()),
        }
    }
    Err(ApiError::internal(format!(
        "sandbox {} kept changing under an update",
        rec.id
    )))
}

fn timeout_of(rec: &Record, default: u64) -> u64 {
    rec.body
        .get("timeout_s")
        .and_then(Value::as_u64)
        .unwrap_or(default)
}

pub(crate) fn secs(s: u64) -> Duration {
    Duration::seconds(i64::try_from(s).unwrap_or(i64::MAX / 4))
}

pub(crate) fn validate_metadata(metadata: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if metadata.len() > MAX_METADATA_KEYS {
        return Err(ApiError::invalid(
            "metadata",
            format!("at most {MAX_METADATA_KEYS} metadata keys"),
        ));
    }
    for (k, v) in metadata {
        let key_ok = (1..=64).contains(&k.len())
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !key_ok {
            return Err(ApiError::invalid(
                "metadata",
                "metadata keys are 1 to 64 characters of [A-Za-z0-9_.-]",
            ));
        }
        if v.chars().count() > 256 {
            return Err(ApiError::invalid(
                "metadata",
                "metadata values are at most 256 characters",
            ));
        }
    }
    Ok(())
}

pub(crate) fn validate_env(env: &BTreeMap<String, String>) -> Result<(), ApiError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ApiError::invalid(
                "env",
                "environment names must be non-empty without `=` or NUL, values without NUL",
            ));
        }
    }
    Ok(())
}

fn validate_timeout(state: &AppState, timeout_s: u64, param: &str) -> Result<(), ApiError> {
    let max = state.config.limits.max_timeout_s;
    if !(1..=max).contains(&timeout_s) {
        return Err(ApiError::invalid(
            param,
            format!("timeout_s must be between 1 and {max}"),
        ));
    }
    Ok(())
}

pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    OriginalUri(uri): OriginalUri,
    IdempotencyKey(key): IdempotencyKey,
    body: OptionalJson<CreateSandbox>,
) -> Result<Response, ApiError> {
    let req = body.value;
    let provider_name = req
        .provider
        .clone()
        .unwrap_or_else(|| state.providers.default_name().to_owned());
    let provider = state
        .providers
        .get(&provider_name)
        .cloned()
        .ok_or_else(|| ApiError::invalid("provider", "unknown provider"))?;
    let template = req.template.clone().unwrap_or_else(|| TEMPLATE.to_owned());
    if template != TEMPLATE {
        return Err(ApiError::invalid("template", "unknown template"));
    }
    let res = req.resources.unwrap_or_default();
    let requested = Resources {
        cpu: res.cpu.unwrap_or(DEFAULT_CPU),
        memory_mb: res.memory_mb.unwrap_or(DEFAULT_MEMORY_MB),
    };
    if !(requested.cpu.is_finite() && requested.cpu > 0.0) {
        return Err(ApiError::invalid(
            "resources.cpu",
            "cpu must be greater than 0",
        ));
    }
    if requested.memory_mb == 0 {
        return Err(ApiError::invalid(
            "resources.memory_mb",
            "memory_mb must be greater than 0",
        ));
    }
    let snapshot_local = match &req.from_snapshot {
        None => None,
        Some(raw) => {
            let snapshot =
                lookup::qualified(&state, Kind::Snapshot, &caller.principal, raw).await?;
            let (snapshot_provider, local) = lookup::split(&snapshot.id)?;
            if snapshot_provider != provider_name {
                return Err(ApiError::invalid(
                    "from_snapshot",
                    "the snapshot belongs to another provider",
                ));
            }
            Some(local.to_owned())
        }
    };

    let local = provider.allocate_local_id(IdKind::Sandbox);
    let created_at = now();
    let timeout_s = req
        .timeout_s
        .unwrap_or(state.config.limits.default_timeout_s);
    let sandbox = Sandbox {
        id: QualifiedId::new(&provider_name, &local).to_string(),
        provider: provider_name.clone(),
        state: SandboxState::Starting,
        template,
        requested,
        resources: requested,
        metadata: req.metadata.clone().unwrap_or_default(),
        created_at,
        expires_at: created_at + secs(timeout_s.min(state.config.limits.max_timeout_s)),
        on_timeout: req.on_timeout.unwrap_or_default(),
        owner: Owner {
            principal: caller.principal.clone(),
            session_id: None,
        },
    };
    let mut record = Record {
        kind: Kind::Sandbox,
        id: sandbox.id.clone(),
        owner: caller.principal.clone(),
        parent: None,
        state: String::new(),
        body: serde_json::json!({
            "env": req.env.clone().unwrap_or_default(),
            "timeout_s": timeout_s,
        }),
        version: 1,
        created_at,
        due_at: None,
    };
    store_into(&mut record, &sandbox)?;
    let mut inserted = false;
    if state.config.defects.has(Defect::RejectedRequestWritesState) {
        state.store.insert(&record).await?;
        inserted = true;
    }
    validate_metadata(&sandbox.metadata)?;
    validate_env(req.env.as_ref().unwrap_or(&BTreeMap::new()))?;
    validate_timeout(&state, timeout_s, "timeout_s")?;

    // With `quota-checked-outside-lock` the quota is counted here, before the create lock:
    // concurrent creates all count the same live sandboxes and all see room.
    let racy_quota = state.config.defects.has(Defect::QuotaCheckedOutsideLock);
    if racy_quota {
        check_quota(&state, &caller.principal, &record.id).await?;
    }
    let create = move |state: AppState, principal: String| async move {
        {
            let _serial = state.create_lock.lock().await;
            if !racy_quota {
                check_quota(&state, &principal, &record.id).await?;
            }
            if state.config.defects.has(Defect::UnsatisfiableLeaks) && !inserted {
                state.store.insert(&record).await?;
                inserted = true;
            }
            if !provider.capacity().covers(&requested) {
                return Err(ApiError::ResourcesUnsatisfiable(format!(
                    "provider {} grants at most {} cpu and {} MiB",
                    provider.name(),
                    provider.capacity().cpu,
                    provider.capacity().memory_mb
                )));
            }
            if !inserted {
                state.store.insert(&record).await?;
            }
        }
        let granted = match provider
            .create(&local, &requested, snapshot_local.as_deref())
            .await
        {
            Ok(granted) => granted,
            Err(e) => {
                if let Err(e) = state.store.delete(Kind::Sandbox, &record.id).await {
                    tracing::warn!(error = %e, "could not remove the record of a failed create");
                }
                return Err(e.into());
            }
        };
        let started = now();
        let rec = state
            .store
            .get(Kind::Sandbox, Scope::System, &record.id)
            .await?;
        let Some(rec) = rec else {
            // Killed while starting: the kill could not reach the provider yet.
            let _ = provider.destroy(&local).await;
            return Err(ApiError::NotFound);
        };
        let rec = update_sandbox(&state, rec, |sbx, rec| {
            sbx.state = SandboxState::Running;
            sbx.resources = granted;
            sbx.expires_at = started + secs(timeout_of(rec, timeout_s));
            Ok(())
        })
        .await?;
        Ok(rec)
    };
    let idem = IdemRequest::post(&caller.principal, uri.path(), key, &body.raw);
    idempotency::run_create(&state, idem, Kind::Sandbox, view, create).await
}

pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let state_filter = match query.get("state") {
        None => None,
        Some(s @ ("starting" | "running" | "paused")) => Some(s.to_owned()),
        Some(_) => {
            return Err(ApiError::invalid(
                "state",
                "state must be starting, running or paused",
            ));
        }
    };
    // `metadata.<k>=<v>`, or the OpenAPI deepObject spelling `metadata[<k>]=<v>`; a filter is
    // held to the rules of the metadata it matches, since one beyond them matches nothing.
    let mut metadata: Vec<(String, String)> = query
        .0
        .iter()
        .filter_map(|(k, v)| {
            let key = k.strip_prefix("metadata.").or_else(|| {
                k.strip_prefix("metadata[")
                    .and_then(|rest| rest.strip_suffix(']'))
            })?;
            Some((key.to_owned(), v.clone()))
        })
        .collect();
    metadata.sort();
    validate_metadata(&metadata.iter().cloned().collect())?;
    let filters = {
        let mut f = format!("state={}", state_filter.as_deref().unwrap_or(""));
        for (k, v) in &metadata {
            f.push_str(&format!("&metadata.{k}={v}"));
        }
        f
    };
    let page = PageRequest::parse(&state, &query, &caller.principal, filters)?;
    let scope = if state.config.defects.has(Defect::ForeignObjectVisible) {
        Scope::System
    } else {
        Scope::Owner(&caller.principal)
    };
    let mut q = ListQuery::new(Kind::Sandbox, scope);
    q.state = state_filter.as_deref();
    q.after = page.after.clone();
    let want = page.limit as usize + 1;
    let matches = |rec: &Record| {
        metadata.iter().all(|(k, v)| {
            rec.body
                .get("metadata")
                .and_then(|m| m.get(k))
                .and_then(Value::as_str)
                == Some(v)
        })
    };
    let records = list_matching(&state, q, want, matches).await?;
    let page: Page<Value> = page.page(&state, records, view)?;
    Ok(axum::Json(page).into_response())
}

/// Up to `want` records of the query that also satisfy `keep`, reading the store in batches.
pub async fn list_matching(
    state: &AppState,
    mut q: ListQuery<'_>,
    want: usize,
    keep: impl Fn(&Record) -> bool,
) -> Result<Vec<Record>, ApiError> {
    const BATCH: u32 = 200;
    let mut out = Vec::new();
    loop {
        q.limit = Some(BATCH);
        let batch = state.store.list(&q).await?;
        let full = batch.len() == BATCH as usize;
        q.after = batch.last().map(|r| (r.created_at, r.id.clone()));
        for rec in batch {
            if keep(&rec) {
                out.push(rec);
                if out.len() == want {
                    return Ok(out);
                }
            }
        }
        if !full {
            return Ok(out);
        }
    }
}

pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let scope = if state.config.defects.has(Defect::ForeignObjectVisible) {
        Scope::System
    } else {
        Scope::Owner(&caller.principal)
    };
    let rec = lookup::qualified_in(&state, Kind::Sandbox, scope, &id).await?;
    Ok(axum::Json(view(&rec)?).into_response())
}

pub async fn kill(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let rec = lookup::sandbox_for_kill(&state, &caller.principal, &id).await?;
    if state
        .config
        .defects
        .has(Defect::KillReportsSuccessWithoutRemoving)
    {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    destroy(&state, &rec).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Ends the sandbox for good: its processes and root through the provider, then its
/// processes, connections and previews in the store, then its own record. Snapshots stay.
pub async fn destroy(state: &AppState, rec: &Record) -> Result<(), ApiError> {
    let (provider, local) = lookup::split(&rec.id)?;
    let provider = state
        .providers
        .get(provider)
        .ok_or_else(|| ApiError::internal("stored sandbox of an unknown provider"))?;
    provider.destroy(local).await?;
    for kind in [Kind::Process, Kind::Connection, Kind::Preview] {
        let mut q = ListQuery::new(kind, Scope::System);
        q.parent = Some(&rec.id);
        for child in state.store.list(&q).await? {
            state.store.delete(kind, &child.id).await?;
            if kind == Kind::Process {
                state.store.drop_stream(&process_stream(&child.id)).await?;
                state
                    .delivered
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&child.id);
            }
        }
    }
    state.store.delete(Kind::Sandbox, &rec.id).await?;
    Ok(())
}

/// Refuses a create that would take `principal` past the sandbox quota (the sandbox `id`
/// being created is not counted). Honest callers hold the create lock from this check to
/// the insert.
async fn check_quota(state: &AppState, principal: &str, id: &str) -> Result<(), ApiError> {
    let live = state
        .store
        .list(&ListQuery::new(Kind::Sandbox, Scope::Owner(principal)))
        .await?;
    let live = live.iter().filter(|r| r.id != id).count();
    if live >= state.config.limits.max_sandboxes_per_principal as usize {
        return Err(ApiError::QuotaExceeded("too many live sandboxes".into()));
    }
    Ok(())
}

pub async fn set_timeout(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    body: super::extract::Json<SetTimeout>,
) -> Result<Response, ApiError> {
    let timeout_s = body.value.timeout_s;
    validate_timeout(&state, timeout_s, "timeout_s")?;
    let rec = lookup::qualified(&state, Kind::Sandbox, &caller.principal, &id).await?;
    let rec = update_sandbox(&state, rec, |sbx, _| {
        sbx.expires_at = now() + secs(timeout_s);
        Ok(())
    })
    .await?;
    let rec = set_stored_timeout(&state, rec, timeout_s).await?;
    Ok(axum::Json(view(&rec)?).into_response())
}

/// Remembers the latest timeout, used to extend `expires_at` when an expired sandbox resumes.
async fn set_stored_timeout(
    state: &AppState,
    mut rec: Record,
    timeout_s: u64,
) -> Result<Record, ApiError> {
    if let Value::Object(body) = &mut rec.body {
        body.insert("timeout_s".into(), Value::from(timeout_s));
    }
    match state.store.update(&rec).await {
        Ok(rec) => Ok(rec),
        // A concurrent change won; the new expiry is already stored and the remembered
        // timeout only matters for a later resume.
        Err(StoreError::Conflict) => Ok(state
            .store
            .get(Kind::Sandbox, Scope::System, &rec.id)
            .await?
            .ok_or(ApiError::NotFound)?),
        Err(e) => Err(e.into()),
    }
}

pub async fn pause(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _body: OptionalJson<Empty>,
) -> Result<Response, ApiError> {
    let rec = lookup::qualified(&state, Kind::Sandbox, &caller.principal, &id).await?;
    let rec = pause_sandbox(&state, rec).await?;
    Ok(axum::Json(view(&rec)?).into_response())
}

/// Pauses a running sandbox (a client's pause, or the reaper's for `on_timeout: pause`).
pub async fn pause_sandbox(state: &AppState, rec: Record) -> Result<Record, ApiError> {
    let sandbox = sandbox_of(&rec)?;
    if sandbox.state != SandboxState::Running {
        return Err(ApiError::InvalidState(format!(
            "the sandbox is {}",
            sandbox.state.as_str()
        )));
    }
    let (provider, local) = lookup::split(&rec.id)?;
    let provider = state
        .providers
        .get(provider)
        .ok_or_else(|| ApiError::internal("unknown provider"))?;
    provider.pause(local).await?;
    update_sandbox(state, rec, |sbx, _| {
        sbx.state = SandboxState::Paused;
        Ok(())
    })
    .await
}

pub async fn resume(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _body: OptionalJson<Empty>,
) -> Result<Response, ApiError> {
    let rec = lookup::qualified(&state, Kind::Sandbox, &caller.principal, &id).await?;
    let sandbox = sandbox_of(&rec)?;
    if sandbox.state != SandboxState::Paused {
        return Err(ApiError::InvalidState(format!(
            "the sandbox is {}",
            sandbox.state.as_str()
        )));
    }
    let (provider, local) = lookup::split(&rec.id)?;
    let provider = state
        .providers
        .get(provider)
        .ok_or_else(|| ApiError::internal("unknown provider"))?;
    provider.resume(local).await?;
    let default_timeout = state.config.limits.default_timeout_s;
    let rec = update_sandbox(&state, rec, |sbx, rec| {
        sbx.state = SandboxState::Running;
        let t = now();
        if sbx.expires_at <= t {
            // Paused by its timeout: running again starts a fresh period.
            sbx.expires_at = t + secs(timeout_of(rec, default_timeout));
        }
        Ok(())
    })
    .await?;
    Ok(axum::Json(view(&rec)?).into_response())
}

fn connection_view(rec: &Record) -> Result<Value, ApiError> {
    let conn: Connection = serde_json::from_value(rec.body.clone()).map_err(ApiError::internal)?;
    serde_json::to_value(conn).map_err(ApiError::internal)
}

pub async fn connect(
    State(state): State<AppState>,
    caller: Caller,
    OriginalUri(uri): OriginalUri,
    Path(id): Path<String>,
    IdempotencyKey(key): IdempotencyKey,
    body: OptionalJson<Empty>,
) -> Result<Response, ApiError> {
    let sandbox = lookup::qualified(&state, Kind::Sandbox, &caller.principal, &id).await?;
    let create = move |state: AppState, principal: String| async move {
        sandbox_now(&state, &sandbox.id, &[SandboxState::Running]).await?;
        let conn = Connection {
            id: new_local_id(IdKind::Connection),
            sandbox_id: sandbox.id.clone(),
            principal: principal.clone(),
            created_at: now(),
        };
        let rec = Record {
            kind: Kind::Connection,
            id: conn.id.clone(),
            owner: principal,
            parent: Some(sandbox.id.clone()),
            state: "open".into(),
            body: serde_json::to_value(&conn).map_err(ApiError::internal)?,
            version: 1,
            created_at: conn.created_at,
            due_at: None,
        };
        state.store.insert(&rec).await?;
        Ok(rec)
    };
    let idem = IdemRequest::post(&caller.principal, uri.path(), key, &body.raw);
    idempotency::run_create(&state, idem, Kind::Connection, connection_view, create).await
}

pub async fn list_connections(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let sandbox = lookup::qualified(&state, Kind::Sandbox, &caller.principal, &id).await?;
    let page = PageRequest::parse(
        &state,
        &query,
        &caller.principal,
        format!("sandbox={}", sandbox.id),
    )?;
    let mut q = ListQuery::new(Kind::Connection, Scope::Owner(&caller.principal));
    q.parent = Some(&sandbox.id);
    q.after = page.after.clone();
    q.limit = Some(page.limit + 1);
    let records = state.store.list(&q).await?;
    Ok(axum::Json(page.page(&state, records, connection_view)?).into_response())
}

pub async fn close_connection(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, conn)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let sandbox = lookup::qualified(&state, Kind::Sandbox, &caller.principal, &id).await?;
    let conn = lookup::plain(&state, Kind::Connection, &caller.principal, &conn).await?;
    if conn.parent.as_deref() != Some(sandbox.id.as_str()) {
        return Err(ApiError::NotFound);
    }
    state.store.delete(Kind::Connection, &conn.id).await?;
    if state.config.defects.has(Defect::BorrowerCloseKillsOwner) {
        destroy(&state, &sandbox).await?;
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}
