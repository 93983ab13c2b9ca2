//! The private bridge (§8.8): signed requests from workers, fenced by lease generation.
//!
//! Every request is authenticated before anything else: the signature (403) and then the
//! control revision (400) are decided having read only the session's bridge secret.

use std::sync::Arc;

use axum::Extension;
use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, OriginalUri, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::api::{ApiError, AppState};
use crate::clock::now;
use crate::defects::Defect;
use crate::store::{Kind, Record, Scope};

use super::core::{Gateway, Loaded, SessionGuard, SessionRt, decode};
use super::http::{Admin, ApiResult, Path, parse_json, read_body};
use super::model::{
    ErrorBody, OperationDoc, SubmissionDoc, Usage, new_id, plausible_id, rfc3339, session_stream,
};
use super::signing::{REVISION_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, verify};

/// An authenticated bridge request: the raw body, not yet parsed.
struct Authed {
    body: bytes::Bytes,
}

async fn authenticate(
    state: &AppState,
    gw: &Gateway,
    sid: &str,
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    body: Body,
) -> ApiResult<Authed> {
    let body = read_body(headers, body, state.config.limits.max_body_bytes).await?;
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if !state.config.defects.has(Defect::BridgeSignatureUnchecked) {
        let (Some(ts), Some(sig)) = (header(TIMESTAMP_HEADER), header(SIGNATURE_HEADER)) else {
            return Err(ApiError::PermissionDenied);
        };
        if !plausible_id(sid, "ses_") {
            return Err(ApiError::PermissionDenied);
        }
        // The secret never changes: once a request has been verified with the store's copy,
        // this process keeps it (see `SessionRt::bridge_secret`).
        let known = gw
            .rt_if_known(sid)
            .and_then(|rt| rt.bridge_secret.get().cloned());
        let from_store = known.is_none();
        let secret = match known {
            Some(secret) => Some(secret),
            None => match gw
                .state
                .store
                .get(Kind::Session, Scope::System, sid)
                .await?
            {
                Some(rec) => rec
                    .body
                    .get("bridge_secret")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                None => None,
            },
        };
        let Some(secret) = secret else {
            return Err(ApiError::PermissionDenied);
        };
        let now_s = time::OffsetDateTime::now_utc().unix_timestamp();
        if !verify(&secret, method.as_str(), target, &body, ts, sig, now_s) {
            return Err(ApiError::PermissionDenied);
        }
        if from_store {
            gw.rt(sid).bridge_secret.get_or_init(|| secret);
        }
    }
    let revision = header(REVISION_HEADER).unwrap_or("");
    if revision.trim().is_empty() && !state.config.defects.has(Defect::EmptyRevisionAccepted) {
        return Err(ApiError::invalid(
            "control_revision",
            "the control revision must not be empty",
        ));
    }
    Ok(Authed { body })
}

/// A bridge request's body parsed as `T`, taken only after [`authenticate`] passed. As the
/// last extractor of a handler, after its path parameters (404 for a bad path comes first).
pub struct Signed<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for Signed<T> {
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &AppState) -> ApiResult<Self> {
        let (mut parts, body) = req.into_parts();
        let params =
            axum::extract::Path::<Vec<(String, String)>>::from_request_parts(&mut parts, state)
                .await
                .map_err(|_| ApiError::NotFound)?;
        let sid = params
            .0
            .into_iter()
            .find(|(name, _)| name == "id")
            .map(|(_, value)| value)
            .ok_or(ApiError::NotFound)?;
        let gw = parts
            .extensions
            .get::<Arc<Gateway>>()
            .cloned()
            .ok_or_else(|| ApiError::internal("the gateway is not installed"))?;
        let uri = parts
            .extensions
            .get::<OriginalUri>()
            .map_or_else(|| parts.uri.clone(), |u| u.0.clone());
        let authed = authenticate(
            state,
            &gw,
            &sid,
            &parts.method,
            &target(&uri),
            &parts.headers,
            body,
        )
        .await?;
        Ok(Signed(parse_json(&authed.body)?))
    }
}

/// The session, locked, after authentication (403 if it vanished meanwhile).
async fn locked<'a>(
    gw: &Gateway,
    rt: &'a SessionRt,
    sid: &str,
) -> ApiResult<(SessionGuard<'a>, Loaded)> {
    let guard = gw.lock(rt, sid).await?;
    let loaded = gw
        .session(Scope::System, sid)
        .await?
        .ok_or(ApiError::PermissionDenied)?;
    Ok((guard, loaded))
}

/// [`locked`], for a write under lease `generation`: 409 `lease_lost` unless it is current.
async fn fenced<'a>(
    gw: &Gateway,
    rt: &'a SessionRt,
    sid: &str,
    generation: i64,
) -> ApiResult<(SessionGuard<'a>, Loaded)> {
    let (guard, loaded) = locked(gw, rt, sid).await?;
    if loaded.doc.lease_is_current(generation)
        || gw.state.config.defects.has(Defect::StaleLeaseWriteAccepted)
    {
        Ok((guard, loaded))
    } else {
        Err(ApiError::LeaseLost)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TakeLease {
    worker_id: String,
}

pub async fn take_lease(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    Path(sid): Path<String>,
    Signed(req): Signed<TakeLease>,
) -> ApiResult<Response> {
    let rt = gw.rt(&sid);
    let (_guard, mut loaded) = locked(&gw, &rt, &sid).await?;
    if loaded.doc.state == "deleting" {
        return Err(ApiError::SessionNotActive);
    }
    // A new generation: a turn running under an older one has an unknown outcome.
    if gw.active_submission(&sid).await?.is_some()
        && !state.config.defects.has(Defect::NewLeaseKeepsRunningTurn)
    {
        gw.make_uncertain(&mut loaded, "worker_lost").await?;
    }
    let generation = loaded.doc.lease_generation.unwrap_or(0) + 1;
    loaded.doc.lease_generation = Some(generation);
    loaded.doc.lease_revoked = false;
    gw.save_session(&mut loaded).await?;
    {
        let mut live = rt.live();
        live.lease_expires = Some(crate::clock::instant() + gw.cfg.lease_ttl);
        live.starts_without_lease = 0;
    }
    tracing::debug!(session = %sid, worker = %req.worker_id, generation, "lease taken");
    let expires = now() + gw.cfg.lease_ttl;
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({
            "lease_generation": generation,
            "lease_expires_at": rfc3339(expires),
            "lease_ttl_s": gw.cfg.lease_ttl.as_secs_f64(),
        })),
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Generation {
    lease_generation: i64,
}

pub async fn heartbeat(
    Extension(gw): Extension<Arc<Gateway>>,
    Path(sid): Path<String>,
    Signed(req): Signed<Generation>,
) -> ApiResult<Response> {
    let rt = gw.rt(&sid);
    let (_guard, _) = fenced(&gw, &rt, &sid, req.lease_generation).await?;
    rt.live().lease_expires = Some(crate::clock::instant() + gw.cfg.lease_ttl);
    let active = gw.active_submission(&sid).await?;
    let cancel_submission = active
        .as_ref()
        .is_some_and(|(_, s)| s.state == "cancelling");
    let cancel_operations: Vec<String> = gw
        .operations(&sid, Some("running"))
        .await?
        .into_iter()
        .filter(|(_, op)| op.cancel_requested)
        .map(|(_, op)| op.id)
        .collect();
    Ok(axum::Json(json!({
        "lease_expires_at": rfc3339(now() + gw.cfg.lease_ttl),
        "cancel_submission": cancel_submission,
        "cancel_operations": cancel_operations,
    }))
    .into_response())
}

/// The longest a worker may ask `POST /next` to wait for work (`wait_ms`).
const MAX_NEXT_WAIT_MS: u64 = 1_000;

/// How often a waiting `POST /next` looks at the queue again without a wake-up: a submission
/// accepted by another server process wakes it only through the store's feed of appends.
const NEXT_RECHECK: std::time::Duration = std::time::Duration::from_millis(150);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NextRequest {
    lease_generation: i64,
    /// How long to wait for work before answering 204; absent means not at all.
    #[serde(default)]
    wait_ms: Option<u64>,
}

pub async fn next(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    Path(sid): Path<String>,
    Signed(req): Signed<NextRequest>,
) -> ApiResult<Response> {
    let wait = match req.wait_ms {
        None => 0,
        Some(ms) if ms <= MAX_NEXT_WAIT_MS => ms,
        Some(_) => {
            return Err(ApiError::invalid(
                "wait_ms",
                format!("wait_ms is at most {MAX_NEXT_WAIT_MS}"),
            ));
        }
    };
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(wait);
    // Every change of the queue appends to the session's log, so following it wakes the wait;
    // an ask that does not wait follows nothing. Followed before the first look, so that a
    // submission between the look and the wait still wakes it.
    let mut wake = (wait > 0).then(|| state.log.follow(&session_stream(&sid)));
    loop {
        if let Some(work) = take_next(&state, &gw, &sid, req.lease_generation).await? {
            return Ok(work);
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let Some(wake) = wake.as_mut().filter(|_| !left.is_zero()) else {
            return Ok(StatusCode::NO_CONTENT.into_response());
        };
        tokio::select! {
            _ = wake.changed() => {}
            () = tokio::time::sleep(NEXT_RECHECK.min(left)) => {}
            () = state.shutdown.cancelled() => return Ok(StatusCode::NO_CONTENT.into_response()),
        }
    }
}

/// Starts the session's next queued submission under `generation` and answers with it;
/// `None` when there is none to start now (the session is not active, a turn is running, or
/// the queue is empty).
async fn take_next(
    state: &AppState,
    gw: &Gateway,
    sid: &str,
    generation: i64,
) -> ApiResult<Option<Response>> {
    let rt = gw.rt(sid);
    let (_guard, loaded) = fenced(gw, &rt, sid, generation).await?;
    if loaded.doc.state != "active" {
        return Ok(None);
    }
    if gw.active_submission(sid).await?.is_some()
        && !state.config.defects.has(Defect::QueueRunsConcurrently)
    {
        return Ok(None);
    }
    let Some((mut rec, mut sub)) = gw.next_queued(sid).await? else {
        return Ok(None);
    };
    let manifest = gw.artifact_manifest(&loaded.doc.sandbox_id).await;
    rt.live().artifact_baseline = Some((sub.id.clone(), manifest));
    sub.state = "running".into();
    sub.started_at = Some(now());
    sub.lease_generation = Some(generation);
    gw.save_submission(&mut rec, &sub).await?;
    gw.append(
        sid,
        "submission.started",
        json!({"submission_id": sub.id, "lease_generation": generation}),
    )
    .await?;
    Ok(Some(
        axum::Json(json!({
            "submission_id": sub.id,
            "input": sub.input,
            "agent": {"model": loaded.doc.agent.model, "instructions": loaded.doc.agent.instructions},
        }))
        .into_response(),
    ))
}

/// The submission a bridge write names: of this session, and running or cancelling.
async fn running_submission(
    gw: &Gateway,
    sid: &str,
    id: &str,
) -> ApiResult<(Record, SubmissionDoc)> {
    let rec = gw
        .state
        .store
        .get(Kind::Submission, Scope::System, id)
        .await?
        .filter(|r| r.parent.as_deref() == Some(sid))
        .ok_or(ApiError::NotFound)?;
    let doc: SubmissionDoc = decode(&rec)?;
    if doc.state != "running" && doc.state != "cancelling" {
        return Err(ApiError::InvalidState(
            "the submission is not running".into(),
        ));
    }
    Ok((rec, doc))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartOperation {
    lease_generation: i64,
    submission_id: String,
    kind: String,
    name: String,
    effect_class: String,
    input: Option<Value>,
}

pub async fn start_operation(
    Extension(gw): Extension<Arc<Gateway>>,
    Path(sid): Path<String>,
    Signed(req): Signed<StartOperation>,
) -> ApiResult<Response> {
    if req.kind != "model_call" && req.kind != "tool_call" {
        return Err(ApiError::invalid(
            "kind",
            "kind must be model_call or tool_call",
        ));
    }
    if req.effect_class != "read" && req.effect_class != "write" {
        return Err(ApiError::invalid(
            "effect_class",
            "effect_class must be read or write",
        ));
    }
    let rt = gw.rt(&sid);
    let (_guard, loaded) = fenced(&gw, &rt, &sid, req.lease_generation).await?;
    running_submission(&gw, &sid, &req.submission_id).await?;
    let op = OperationDoc {
        id: new_id("op_"),
        session_id: sid.clone(),
        submission_id: req.submission_id.clone(),
        kind: req.kind,
        name: req.name,
        effect_class: req.effect_class,
        state: "running".into(),
        input: req.input,
        output: None,
        exit_code: None,
        lease_generation: req.lease_generation,
        cancel_requested: false,
        started_at: now(),
        ended_at: None,
    };
    let rec = Record {
        kind: Kind::Operation,
        id: op.id.clone(),
        owner: loaded.rec.owner.clone(),
        parent: Some(sid.clone()),
        state: op.state.clone(),
        body: serde_json::to_value(&op).map_err(ApiError::internal)?,
        version: 1,
        created_at: op.started_at,
        due_at: None,
    };
    gw.state.store.insert(&rec).await?;
    gw.append(
        &sid,
        "operation.started",
        json!({"submission_id": op.submission_id, "operation_id": op.id, "kind": op.kind, "name": op.name}),
    )
    .await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({"operation_id": op.id})),
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteOperation {
    lease_generation: i64,
    state: String,
    output: Option<String>,
    exit_code: Option<i32>,
}

pub async fn complete_operation(
    Extension(gw): Extension<Arc<Gateway>>,
    Path((sid, op_id)): Path<(String, String)>,
    Signed(req): Signed<CompleteOperation>,
) -> ApiResult<Response> {
    if !["succeeded", "failed", "cancelled"].contains(&req.state.as_str()) {
        return Err(ApiError::invalid(
            "state",
            "state must be succeeded, failed or cancelled",
        ));
    }
    let rt = gw.rt(&sid);
    let (_guard, _) = fenced(&gw, &rt, &sid, req.lease_generation).await?;
    let mut rec = gw
        .state
        .store
        .get(Kind::Operation, Scope::System, &op_id)
        .await?
        .filter(|r| r.parent.as_deref() == Some(sid.as_str()))
        .ok_or(ApiError::NotFound)?;
    let mut op: OperationDoc = decode(&rec)?;
    if op.state != "running" {
        return Err(ApiError::InvalidState("the operation has ended".into()));
    }
    op.state = req.state;
    op.output = req.output.map(|mut o| {
        truncate_utf8(&mut o, gw.cfg.max_tool_output_bytes);
        o
    });
    op.exit_code = req.exit_code;
    op.ended_at = Some(now());
    op.cancel_requested = false;
    gw.save_operation(&mut rec, &op).await?;
    gw.append(
        &sid,
        "operation.completed",
        json!({"submission_id": op.submission_id, "operation_id": op.id, "state": op.state}),
    )
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Output {
    lease_generation: i64,
    submission_id: String,
    operation_id: Option<String>,
    stream: String,
    text: String,
}

pub async fn output(
    Extension(gw): Extension<Arc<Gateway>>,
    Path(sid): Path<String>,
    Signed(req): Signed<Output>,
) -> ApiResult<Response> {
    if !["assistant", "stdout", "stderr"].contains(&req.stream.as_str()) {
        return Err(ApiError::invalid(
            "stream",
            "stream must be assistant, stdout or stderr",
        ));
    }
    let rt = gw.rt(&sid);
    let (_guard, _) = fenced(&gw, &rt, &sid, req.lease_generation).await?;
    running_submission(&gw, &sid, &req.submission_id).await?;
    gw.append(
        &sid,
        "output.delta",
        json!({
            "submission_id": req.submission_id,
            "operation_id": req.operation_id,
            "stream": req.stream,
            "text": req.text,
        }),
    )
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteSubmission {
    lease_generation: i64,
    state: String,
    output: Option<String>,
    stop_reason: Option<String>,
    usage: Option<Usage>,
    error: Option<ErrorBody>,
}

pub async fn complete_submission(
    Extension(gw): Extension<Arc<Gateway>>,
    Path((sid, sub_id)): Path<(String, String)>,
    Signed(req): Signed<CompleteSubmission>,
) -> ApiResult<Response> {
    if !["completed", "failed", "cancelled"].contains(&req.state.as_str()) {
        return Err(ApiError::invalid(
            "state",
            "state must be completed, failed or cancelled",
        ));
    }
    let rt = gw.rt(&sid);
    let (_guard, _) = fenced(&gw, &rt, &sid, req.lease_generation).await?;
    let (mut rec, mut sub) = running_submission(&gw, &sid, &sub_id).await?;
    gw.end_running_operations(&sid, &sub.id, "failed").await?;
    sub.output = req.output;
    sub.usage = Some(req.usage.unwrap_or_default());
    sub.stop_reason = req.stop_reason;
    let extra = match req.state.as_str() {
        "completed" => {
            json!({"stop_reason": sub.stop_reason.clone().unwrap_or_else(|| "end_turn".into()), "usage": sub.usage})
        }
        "failed" => {
            let error = req.error.unwrap_or(ErrorBody {
                code: "agent_error".into(),
                message: "the agent failed".into(),
            });
            sub.error = Some(error.clone());
            json!({"error": error})
        }
        _ => json!({}),
    };
    gw.end_submission(&mut rec, &mut sub, &req.state, extra)
        .await?;
    rt.live().cancel_deadline = None;
    Ok(StatusCode::NO_CONTENT.into_response())
}

fn target(uri: &axum::http::Uri) -> String {
    uri.path_and_query()
        .map(|pq| pq.as_str().to_owned())
        .unwrap_or_else(|| uri.path().to_owned())
}

fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}

// ----- test controls -----

pub async fn kill_worker(
    Extension(gw): Extension<Arc<Gateway>>,
    _admin: Admin,
    Path(sid): Path<String>,
) -> ApiResult<Response> {
    if !plausible_id(&sid, "ses_") || gw.session(Scope::System, &sid).await?.is_none() {
        return Err(ApiError::NotFound);
    }
    let rt = gw.rt(&sid);
    let worker = rt.worker();
    let Some(pid) = worker else {
        return Err(ApiError::InvalidState(
            "the session has no running worker".into(),
        ));
    };
    gw.kill_worker(&pid).await?;
    // Record the outcome now rather than at the next supervision pass.
    gw.supervise(&sid).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub async fn bridge_credentials(
    Extension(gw): Extension<Arc<Gateway>>,
    _admin: Admin,
    Path(sid): Path<String>,
) -> ApiResult<Response> {
    if !plausible_id(&sid, "ses_") {
        return Err(ApiError::NotFound);
    }
    let loaded = gw
        .session(Scope::System, &sid)
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok(axum::Json(json!({
        "session_id": loaded.doc.id,
        "secret": loaded.doc.bridge_secret,
        "control_revision": loaded.doc.control_revision,
        "lease_generation": loaded.doc.lease_generation,
    }))
    .into_response())
}
