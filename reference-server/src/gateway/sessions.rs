//! Session handlers: create (owned or borrowed sandbox), list, get, delete, resume.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Extension;
use axum::body::Body;
use axum::extract::{OriginalUri, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use crate::api::{ApiError, AppState};
use crate::clock::now;
use crate::defects::Defect;
use crate::domain::{
    Connection, IdKind, OnTimeout, Owner, QualifiedId, Resources, Sandbox, SandboxState,
    new_local_id,
};
use crate::store::{Kind, ListQuery, Record, Scope};

use super::core::{Gateway, Loaded};
use super::http::{
    ApiResult, Caller, Created, IdemRequest, PageRequest, Path, QueryPairs, idempotency_key,
    idempotent, json_body, read_body,
};
use super::lookup::owned_session;
use super::model::{Agent, Cleanup, SessionDoc, new_id};
use super::signing::new_secret;

const TEMPLATE: &str = "base";
const MAX_METADATA_KEYS: usize = 32;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    agent: Option<AgentReq>,
    sandbox: Option<SandboxChoice>,
    on_uncertain: Option<String>,
    metadata: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AgentReq {
    model: Option<String>,
    instructions: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SandboxChoice {
    create: Option<CreateSandboxReq>,
    attach: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateSandboxReq {
    provider: Option<String>,
    template: Option<String>,
    resources: Option<ResourceReq>,
    timeout_s: Option<u64>,
    on_timeout: Option<OnTimeout>,
    metadata: Option<BTreeMap<String, String>>,
    env: Option<BTreeMap<String, String>>,
    from_snapshot: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResourceReq {
    cpu: Option<f64>,
    memory_mb: Option<u64>,
}

fn validate_metadata(metadata: &BTreeMap<String, String>, param: &str) -> ApiResult<()> {
    if metadata.len() > MAX_METADATA_KEYS {
        return Err(ApiError::invalid(
            param,
            format!("at most {MAX_METADATA_KEYS} metadata keys"),
        ));
    }
    for (k, v) in metadata {
        let key_ok = (1..=64).contains(&k.len())
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !key_ok || v.chars().count() > 256 {
            return Err(ApiError::invalid(
                param,
                "metadata keys are 1 to 64 characters of [A-Za-z0-9_.-], values at most 256",
            ));
        }
    }
    Ok(())
}

/// An owned sandbox, validated (SBX rules, `param` prefixed `sandbox.create.`).
struct OwnedPlan {
    provider: String,
    requested: Resources,
    timeout_s: u64,
    on_timeout: OnTimeout,
    metadata: BTreeMap<String, String>,
    env: BTreeMap<String, String>,
    /// A snapshot of the caller's to start from (resolved when the session is created).
    from_snapshot: Option<String>,
}

fn plan_owned(state: &AppState, req: CreateSandboxReq) -> ApiResult<OwnedPlan> {
    const P: &str = "sandbox.create.";
    let provider = req
        .provider
        .unwrap_or_else(|| state.providers.default_name().to_owned());
    if state.providers.get(&provider).is_none() {
        return Err(ApiError::invalid(
            &format!("{P}provider"),
            "unknown provider",
        ));
    }
    if req.template.as_deref().is_some_and(|t| t != TEMPLATE) {
        return Err(ApiError::invalid(
            &format!("{P}template"),
            "unknown template",
        ));
    }
    let res = req.resources.unwrap_or_default();
    let requested = Resources {
        cpu: res.cpu.unwrap_or(1.0),
        memory_mb: res.memory_mb.unwrap_or(512),
    };
    if !(requested.cpu.is_finite() && requested.cpu > 0.0) {
        return Err(ApiError::invalid(
            &format!("{P}resources.cpu"),
            "cpu must be greater than 0",
        ));
    }
    if requested.memory_mb == 0 {
        return Err(ApiError::invalid(
            &format!("{P}resources.memory_mb"),
            "memory_mb must be greater than 0",
        ));
    }
    let limits = &state.config.limits;
    let timeout_s = req.timeout_s.unwrap_or(limits.default_timeout_s);
    if !(1..=limits.max_timeout_s).contains(&timeout_s) {
        return Err(ApiError::invalid(
            &format!("{P}timeout_s"),
            format!("timeout_s must be between 1 and {}", limits.max_timeout_s),
        ));
    }
    let metadata = req.metadata.unwrap_or_default();
    validate_metadata(&metadata, &format!("{P}metadata"))?;
    let env = req.env.unwrap_or_default();
    for (k, v) in &env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ApiError::invalid(
                &format!("{P}env"),
                "invalid environment variable",
            ));
        }
    }
    Ok(OwnedPlan {
        provider,
        requested,
        timeout_s,
        on_timeout: req.on_timeout.unwrap_or_default(),
        metadata,
        env,
        from_snapshot: req.from_snapshot,
    })
}

enum Plan {
    Owned(OwnedPlan),
    Attach(String),
}

pub async fn create(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let key = idempotency_key(&headers)?;
    let raw = read_body(&headers, body, state.config.limits.max_body_bytes).await?;
    if state.config.defects.has(Defect::RejectedRequestWritesState) {
        // The bug: a placeholder session is stored before the request is validated.
        let placeholder = SessionDoc {
            id: new_id("ses_"),
            state: "active".into(),
            pause_reason: None,
            agent: Agent {
                model: "placeholder".into(),
                instructions: None,
            },
            sandbox_id: String::new(),
            sandbox_ownership: "borrowed".into(),
            on_uncertain: "pause".into(),
            metadata: BTreeMap::new(),
            created_at: now(),
            bridge_secret: new_secret(),
            control_revision: "rev_placeholder".into(),
            lease_generation: None,
            lease_revoked: false,
            connection_id: None,
            cleanup: None,
            home: Some(state.store.instance().to_owned()),
        };
        state
            .store
            .insert(&Record {
                kind: Kind::Session,
                id: placeholder.id.clone(),
                owner: caller.principal.clone(),
                parent: None,
                state: placeholder.state.clone(),
                body: serde_json::to_value(&placeholder).map_err(ApiError::internal)?,
                version: 1,
                created_at: placeholder.created_at,
                due_at: None,
            })
            .await?;
    }
    let req: CreateSession = json_body(&state, &headers, &raw)?;
    let agent = req.agent.unwrap_or(AgentReq {
        model: None,
        instructions: None,
    });
    let model = agent.model.unwrap_or_default();
    if model.is_empty() || model.chars().count() > 256 {
        return Err(ApiError::invalid(
            "agent.model",
            "agent.model must be 1 to 256 characters",
        ));
    }
    if agent
        .instructions
        .as_ref()
        .is_some_and(|i| i.chars().count() > 65536)
    {
        return Err(ApiError::invalid(
            "agent.instructions",
            "instructions are at most 65536 characters",
        ));
    }
    let on_uncertain = req.on_uncertain.unwrap_or_else(|| "pause".into());
    if on_uncertain != "pause" && on_uncertain != "continue" {
        return Err(ApiError::invalid(
            "on_uncertain",
            "on_uncertain must be pause or continue",
        ));
    }
    let metadata = req.metadata.unwrap_or_default();
    validate_metadata(&metadata, "metadata")?;
    let plan = match req.sandbox {
        Some(SandboxChoice {
            create: Some(c),
            attach: None,
        }) => Plan::Owned(plan_owned(&state, c)?),
        Some(SandboxChoice {
            create: None,
            attach: Some(a),
        }) => Plan::Attach(a),
        _ => {
            return Err(ApiError::invalid(
                "sandbox",
                "exactly one of sandbox.create and sandbox.attach",
            ));
        }
    };
    let doc = SessionDoc {
        id: new_id("ses_"),
        state: "active".into(),
        pause_reason: None,
        agent: Agent {
            model,
            instructions: agent.instructions,
        },
        sandbox_id: String::new(),
        sandbox_ownership: String::new(),
        on_uncertain,
        metadata,
        created_at: now(),
        bridge_secret: new_secret(),
        control_revision: format!("rev_{}", &new_secret()[..16]),
        lease_generation: None,
        lease_revoked: false,
        connection_id: None,
        cleanup: None,
        home: Some(gw.instance().to_owned()),
    };
    let principal = caller.principal.clone();
    let task_gw = Arc::clone(&gw);
    let creating = async move { create_session(task_gw, principal, doc, plan).await };
    let replay_gw = Arc::clone(&gw);
    let replay_principal = caller.principal.clone();
    let replay = move |id: String| async move {
        match replay_gw
            .session(Scope::Owner(&replay_principal), &id)
            .await?
        {
            None => Ok(None),
            Some(loaded) => Ok(Some(Created {
                status: StatusCode::CREATED,
                resource_id: id,
                body: replay_gw.session_view(&loaded).await?,
                headers: Vec::new(),
            })),
        }
    };
    let req = IdemRequest::post(&caller.principal, uri.path(), key, &raw);
    idempotent(&state, req, || creating, replay).await
}

async fn create_session(
    gw: Arc<Gateway>,
    principal: String,
    mut doc: SessionDoc,
    plan: Plan,
) -> ApiResult<Created> {
    let state = gw.state.clone();
    let mut owned = None;
    match plan {
        Plan::Attach(raw) => {
            let (id, _) = QualifiedId::parse(&raw, state.providers.default_name())
                .map_err(|_| ApiError::NotFound)?;
            if state.providers.get(&id.provider).is_none() {
                return Err(ApiError::NotFound);
            }
            let sandbox = state
                .store
                .get(Kind::Sandbox, Scope::Owner(&principal), &id.to_string())
                .await?
                .ok_or(ApiError::NotFound)?;
            if sandbox.state == SandboxState::Paused.as_str() {
                return Err(ApiError::InvalidState("the sandbox is paused".into()));
            }
            let conn = Connection {
                id: new_local_id(IdKind::Connection),
                sandbox_id: sandbox.id.clone(),
                principal: principal.clone(),
                created_at: now(),
            };
            state
                .store
                .insert(&Record {
                    kind: Kind::Connection,
                    id: conn.id.clone(),
                    owner: principal.clone(),
                    parent: Some(sandbox.id.clone()),
                    state: "open".into(),
                    body: serde_json::to_value(&conn).map_err(ApiError::internal)?,
                    version: 1,
                    created_at: conn.created_at,
                    due_at: None,
                })
                .await?;
            doc.sandbox_id = sandbox.id;
            doc.sandbox_ownership = "borrowed".into();
            doc.connection_id = Some(conn.id);
        }
        Plan::Owned(plan) => {
            let provider = state
                .providers
                .get(&plan.provider)
                .cloned()
                .ok_or_else(|| ApiError::invalid("sandbox.create.provider", "unknown provider"))?;
            let _serial = state.create_lock.lock().await;
            let live = state
                .store
                .list(&ListQuery::new(Kind::Sandbox, Scope::Owner(&principal)))
                .await?;
            if live.len() >= state.config.limits.max_sandboxes_per_principal as usize {
                return Err(ApiError::QuotaExceeded("too many live sandboxes".into()));
            }
            if !provider.capacity().covers(&plan.requested) {
                return Err(ApiError::ResourcesUnsatisfiable(format!(
                    "provider {} grants at most {} cpu and {} MiB",
                    provider.name(),
                    provider.capacity().cpu,
                    provider.capacity().memory_mb
                )));
            }
            let snapshot_local = match &plan.from_snapshot {
                None => None,
                Some(raw) => {
                    let not_found = || ApiError::NotFound;
                    let (id, _) = QualifiedId::parse(raw, state.providers.default_name())
                        .map_err(|_| not_found())?;
                    state
                        .store
                        .get(Kind::Snapshot, Scope::Owner(&principal), &id.to_string())
                        .await?
                        .ok_or_else(not_found)?;
                    if id.provider != plan.provider {
                        return Err(ApiError::invalid(
                            "sandbox.create.from_snapshot",
                            "the snapshot belongs to another provider",
                        ));
                    }
                    Some(id.local)
                }
            };
            let local = provider.allocate_local_id(IdKind::Sandbox);
            let created_at = now();
            let sandbox = Sandbox {
                id: QualifiedId::new(&plan.provider, &local).to_string(),
                provider: plan.provider.clone(),
                state: SandboxState::Starting,
                template: TEMPLATE.into(),
                requested: plan.requested,
                resources: plan.requested,
                metadata: plan.metadata,
                created_at,
                expires_at: created_at
                    + time::Duration::seconds(
                        i64::try_from(plan.timeout_s).unwrap_or(i64::MAX / 4),
                    ),
                on_timeout: plan.on_timeout,
                owner: Owner {
                    principal: principal.clone(),
                    session_id: Some(doc.id.clone()),
                },
            };
            let mut body = serde_json::to_value(&sandbox).map_err(ApiError::internal)?;
            if let serde_json::Value::Object(map) = &mut body {
                map.insert("env".into(), json!(plan.env));
                map.insert("timeout_s".into(), json!(plan.timeout_s));
            }
            let rec = Record {
                kind: Kind::Sandbox,
                id: sandbox.id.clone(),
                owner: principal.clone(),
                parent: None,
                state: SandboxState::Starting.as_str().into(),
                body,
                version: 1,
                created_at,
                due_at: None,
            };
            state.store.insert(&rec).await?;
            doc.sandbox_id = sandbox.id.clone();
            doc.sandbox_ownership = "owned".into();
            owned = Some((rec, plan.requested, plan.timeout_s, snapshot_local));
        }
    }
    let sid = doc.id.clone();
    let rt = gw.rt(&sid);
    let _guard = gw.lock(&rt, &sid).await?;
    let rec = Record {
        kind: Kind::Session,
        id: sid.clone(),
        owner: principal,
        parent: None,
        state: doc.state.clone(),
        body: serde_json::to_value(&doc).map_err(ApiError::internal)?,
        version: 1,
        created_at: doc.created_at,
        due_at: None,
    };
    gw.state.store.insert(&rec).await?;
    gw.append(
        &sid,
        "session.created",
        json!({"sandbox_id": doc.sandbox_id, "sandbox_ownership": doc.sandbox_ownership}),
    )
    .await?;
    if let Some((sandbox, requested, timeout_s, snapshot)) = owned {
        gw.spawn_create(sid.clone(), sandbox, requested, timeout_s, snapshot);
    }
    let loaded = Loaded { rec, doc };
    Ok(Created {
        status: StatusCode::CREATED,
        resource_id: sid,
        body: gw.session_view(&loaded).await?,
        headers: Vec::new(),
    })
}

pub async fn get(
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(sid): Path<String>,
) -> ApiResult<Response> {
    let loaded = owned_session(&gw, &caller.principal, &sid).await?;
    Ok(axum::Json(gw.session_view(&loaded).await?).into_response())
}

pub async fn list(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    q: QueryPairs,
) -> ApiResult<Response> {
    let filter = match q.get("state") {
        None => None,
        Some(s @ ("active" | "paused" | "deleting")) => Some(s.to_owned()),
        Some(_) => {
            return Err(ApiError::invalid(
                "state",
                "state must be active, paused or deleting",
            ));
        }
    };
    let page = PageRequest::parse(
        &state,
        &q,
        &caller.principal,
        format!("sessions state={}", filter.as_deref().unwrap_or("")),
    )?;
    let mut lq = ListQuery::new(Kind::Session, Scope::Owner(&caller.principal));
    lq.state = filter
        .as_deref()
        .filter(|_| !state.config.defects.has(Defect::SessionListIgnoresState));
    lq.after = page.after.clone();
    lq.limit = Some(page.limit + 1);
    let recs = state.store.list(&lq).await?;
    let mut views = Vec::with_capacity(recs.len());
    for rec in &recs {
        let doc: SessionDoc = super::core::decode(rec)?;
        views.push(
            gw.session_view(&Loaded {
                rec: rec.clone(),
                doc,
            })
            .await?,
        );
    }
    Ok(axum::Json(page.page_of(&state, recs, views)).into_response())
}

pub async fn delete(
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(sid): Path<String>,
) -> ApiResult<Response> {
    let loaded = owned_session(&gw, &caller.principal, &sid).await?;
    let rt = gw.rt(&sid);
    let view = {
        let _guard = gw.lock(&rt, &sid).await?;
        let mut loaded = gw
            .session(Scope::System, &loaded.doc.id)
            .await?
            .ok_or(ApiError::NotFound)?;
        if loaded.doc.state != "deleting" {
            loaded.doc.state = "deleting".into();
            loaded.doc.pause_reason = None;
            loaded.doc.cleanup = Some(Cleanup {
                sandbox: "pending".into(),
                attempts: 0,
                last_error: None,
            });
            loaded.doc.lease_revoked = loaded.doc.lease_generation.is_some();
            gw.save_session(&mut loaded).await?;
            rt.live().lease_expires = None;
            for (mut rec, mut sub) in gw.submissions(&sid, Some("queued")).await? {
                gw.end_submission(&mut rec, &mut sub, "cancelled", json!({}))
                    .await?;
            }
            if let Some((mut rec, mut sub)) = gw.active_submission(&sid).await? {
                gw.end_running_operations(&sid, &sub.id, "cancelled")
                    .await?;
                gw.end_submission(&mut rec, &mut sub, "cancelled", json!({}))
                    .await?;
            }
        }
        gw.session_view(&loaded).await?
    };
    let again = Arc::clone(&gw);
    tokio::spawn(async move {
        if let Err(e) = again.supervise(&sid).await {
            tracing::warn!(error = %e, "cleanup pass failed");
        }
    });
    Ok((StatusCode::ACCEPTED, axum::Json(view)).into_response())
}

pub async fn resume(
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(sid): Path<String>,
) -> ApiResult<Response> {
    owned_session(&gw, &caller.principal, &sid).await?;
    let rt = gw.rt(&sid);
    let _guard = gw.lock(&rt, &sid).await?;
    let mut loaded = gw
        .session(Scope::System, &sid)
        .await?
        .ok_or(ApiError::NotFound)?;
    match loaded.doc.state.as_str() {
        "paused" => {}
        "deleting" => return Err(ApiError::SessionNotActive),
        _ => {
            return Err(ApiError::SessionNotPaused);
        }
    }
    loaded.doc.state = "active".into();
    loaded.doc.pause_reason = None;
    gw.save_session(&mut loaded).await?;
    gw.append(&sid, "session.resumed", json!({})).await?;
    Ok(axum::Json(gw.session_view(&loaded).await?).into_response())
}

/// `POST /v1/sessions/{sid}/files?path=`: writes the raw body into the session's sandbox.
pub async fn upload(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(sid): Path<String>,
    q: QueryPairs,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let loaded = owned_session(&gw, &caller.principal, &sid).await?;
    let path = q.get("path").unwrap_or_default().to_owned();
    if path.is_empty() {
        return Err(ApiError::invalid("path", "path is required"));
    }
    if loaded.doc.state == "deleting" && !state.config.defects.has(Defect::UploadToDeletingAccepted)
    {
        return Err(ApiError::SessionNotActive);
    }
    let bytes = read_body(&headers, body, state.config.limits.max_file_bytes).await?;
    let sandbox = state
        .store
        .get(Kind::Sandbox, Scope::System, &loaded.doc.sandbox_id)
        .await?;
    if sandbox
        .as_ref()
        .is_none_or(|s| s.state != SandboxState::Running.as_str())
    {
        return Err(ApiError::InvalidState(
            "the session's sandbox is not running".into(),
        ));
    }
    let (provider, local) = gw.provider(&loaded.doc.sandbox_id)?;
    let files = provider.files(&local).map_err(ApiError::from)?;
    let outcome = tokio::task::spawn_blocking(move || files.write(&path, &bytes))
        .await
        .map_err(ApiError::internal)?
        .map_err(ApiError::from)?;
    let body = json!({"path": outcome.path, "size": outcome.size, "sha256": outcome.sha256});
    Ok((StatusCode::CREATED, axum::Json(body)).into_response())
}
