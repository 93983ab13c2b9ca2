//! Submissions (turns) and operations: submit, list, get, cancel, result.

use std::sync::Arc;

use axum::Extension;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::{ApiError, AppState};
use crate::clock::now;
use crate::defects::Defect;
use crate::store::{Kind, ListQuery, Record, Scope};

use super::artifacts::ArtifactDoc;
use super::core::{Gateway, decode};
use super::http::{
    ApiResult, Caller, Created, IdemRequest, PageRequest, Path, QueryPairs, idempotency_key,
    idempotent, json_body, read_body,
};
use super::lookup::{owned_artifact, owned_operation, owned_session, owned_submission};
use super::model::{OperationDoc, SubmissionDoc, new_id};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Submit {
    input: Option<Value>,
}

pub async fn submit(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(sid): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    owned_session(&gw, &caller.principal, &sid).await?;
    let key = idempotency_key(&headers)?.ok_or_else(|| {
        ApiError::invalid("Idempotency-Key", "submit requires an Idempotency-Key")
    })?;
    let raw = read_body(&headers, body, state.config.limits.max_body_bytes).await?;
    let req: Submit = json_body(&state, &headers, &raw)?;
    let input = match req.input {
        Some(Value::String(s)) if !s.is_empty() => s,
        _ => {
            return Err(ApiError::invalid(
                "input",
                "input must be a non-empty string",
            ));
        }
    };
    let task_gw = Arc::clone(&gw);
    let task_sid = sid.clone();
    let creating = async move { enqueue(task_gw, task_sid, input).await };
    let replay_gw = Arc::clone(&gw);
    let replay_principal = caller.principal.clone();
    let replay = move |id: String| async move {
        let Some(rec) = replay_gw
            .state
            .store
            .get(Kind::Submission, Scope::Owner(&replay_principal), &id)
            .await?
        else {
            return Ok(None);
        };
        let doc: SubmissionDoc = decode(&rec)?;
        Ok(Some(Created {
            status: StatusCode::ACCEPTED,
            resource_id: id.clone(),
            body: replay_gw.submission_view(&doc).await?,
            headers: vec![(header::LOCATION, format!("/v1/submissions/{id}"))],
        }))
    };
    let path = format!("/v1/sessions/{sid}/submissions");
    let req = IdemRequest::post(&caller.principal, &path, Some(key), &raw);
    idempotent(&state, req, || creating, replay).await
}

async fn enqueue(gw: Arc<Gateway>, sid: String, input: String) -> ApiResult<Created> {
    let rt = gw.rt(&sid);
    let created = {
        let _guard = gw.lock(&rt, &sid).await?;
        let loaded = gw
            .session(Scope::System, &sid)
            .await?
            .ok_or(ApiError::NotFound)?;
        let defects = &gw.state.config.defects;
        if loaded.doc.state == "deleting" && !defects.has(Defect::SubmitToDeletingAccepted) {
            return Err(ApiError::SessionNotActive);
        }
        let queued = gw.submissions(&sid, Some("queued")).await?.len();
        if queued >= gw.state.config.limits.max_queue_depth as usize
            && !defects.has(Defect::QueueLimitUnenforced)
        {
            return Err(ApiError::QueueFull);
        }
        let doc = SubmissionDoc {
            id: new_id("sub_"),
            session_id: sid.clone(),
            state: "queued".into(),
            input,
            lease_generation: None,
            error: None,
            outcome: None,
            usage: None,
            created_at: now(),
            started_at: None,
            ended_at: None,
            result_expires_at: None,
            output: None,
            stop_reason: None,
        };
        let rec = Record {
            kind: Kind::Submission,
            id: doc.id.clone(),
            owner: loaded.rec.owner.clone(),
            parent: Some(sid.clone()),
            state: doc.state.clone(),
            body: serde_json::to_value(&doc).map_err(ApiError::internal)?,
            version: 1,
            created_at: doc.created_at,
            due_at: None,
        };
        gw.state.store.insert(&rec).await?;
        let position = queued + 1;
        gw.append(
            &sid,
            "submission.queued",
            json!({"submission_id": doc.id, "queue_position": position}),
        )
        .await?;
        Created {
            status: StatusCode::ACCEPTED,
            resource_id: doc.id.clone(),
            body: doc.view(Some(position)),
            headers: vec![(header::LOCATION, format!("/v1/submissions/{}", doc.id))],
        }
    };
    // Start a worker now rather than at the next supervision pass.
    let again = Arc::clone(&gw);
    tokio::spawn(async move {
        if let Err(e) = again.supervise(&sid).await {
            tracing::warn!(error = %e, "supervision after submit failed");
        }
    });
    Ok(created)
}

pub async fn get(
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let (_, doc) = owned_submission(&gw, &caller.principal, &id).await?;
    Ok(axum::Json(gw.submission_view(&doc).await?).into_response())
}

const SUBMISSION_STATES: &[&str] = &[
    "queued",
    "running",
    "cancelling",
    "completed",
    "failed",
    "cancelled",
    "expired",
    "uncertain",
];
const OPERATION_STATES: &[&str] = &["running", "succeeded", "failed", "cancelled", "uncertain"];

pub async fn list(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(sid): Path<String>,
    q: QueryPairs,
) -> ApiResult<Response> {
    owned_session(&gw, &caller.principal, &sid).await?;
    let filter = q.get("state").map(str::to_owned);
    if filter
        .as_deref()
        .is_some_and(|s| !SUBMISSION_STATES.contains(&s))
    {
        return Err(ApiError::invalid("state", "unknown submission state"));
    }
    let page = PageRequest::parse(
        &state,
        &q,
        &caller.principal,
        format!(
            "submissions session={sid} state={}",
            filter.as_deref().unwrap_or("")
        ),
    )?;
    let mut lq = ListQuery::new(Kind::Submission, Scope::Owner(&caller.principal));
    lq.parent = Some(&sid);
    lq.state = filter.as_deref();
    lq.after = page.after.clone();
    lq.limit = Some(page.limit + 1);
    let recs = state.store.list(&lq).await?;
    let mut views = Vec::new();
    for rec in &recs {
        let doc: SubmissionDoc = decode(rec)?;
        views.push(gw.submission_view(&doc).await?);
    }
    let mut views = views.into_iter();
    let body = page.page(&state, recs, |_| {
        Ok::<_, ApiError>(views.next().unwrap_or_default())
    })?;
    Ok(axum::Json(body).into_response())
}

pub async fn cancel(
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let (_, doc) = owned_submission(&gw, &caller.principal, &id).await?;
    let sid = doc.session_id.clone();
    let rt = gw.rt(&sid);
    let _guard = gw.lock(&rt, &sid).await?;
    let rec = gw
        .state
        .store
        .get(Kind::Submission, Scope::System, &id)
        .await?
        .ok_or(ApiError::NotFound)?;
    let mut rec = rec;
    let mut doc: SubmissionDoc = decode(&rec)?;
    let status = match doc.state.as_str() {
        "queued" => {
            gw.end_submission(&mut rec, &mut doc, "cancelled", json!({}))
                .await?;
            StatusCode::OK
        }
        "running" if gw.state.config.defects.has(Defect::CancelRunningIgnored) => {
            // The bug: the cancel is acknowledged and forgotten.
            doc.state = "cancelling".into();
            return Ok((
                StatusCode::ACCEPTED,
                axum::Json(gw.submission_view(&doc).await?),
            )
                .into_response());
        }
        "running" => {
            doc.state = "cancelling".into();
            gw.save_submission(&mut rec, &doc).await?;
            gw.append(
                &sid,
                "submission.cancelling",
                json!({"submission_id": doc.id}),
            )
            .await?;
            rt.live().cancel_deadline = Some(tokio::time::Instant::now() + gw.cfg.cancel_grace);
            StatusCode::ACCEPTED
        }
        "cancelling" => StatusCode::ACCEPTED,
        _ if gw.state.config.defects.has(Defect::CancelFinishedChangesIt)
            && doc.state != "cancelled" =>
        {
            // The bug: a finished turn is rewritten as cancelled.
            doc.state = "cancelled".into();
            doc.stop_reason = Some("cancelled".into());
            gw.save_submission(&mut rec, &doc).await?;
            StatusCode::OK
        }
        _ => StatusCode::OK,
    };
    Ok((status, axum::Json(gw.submission_view(&doc).await?)).into_response())
}

pub async fn result(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let (_, doc) = owned_submission(&gw, &caller.principal, &id).await?;
    if !doc.is_terminal() {
        return Err(ApiError::NotTerminal);
    }
    let expired = doc.result_expires_at.is_some_and(|t| now() >= t);
    if expired && !state.config.defects.has(Defect::ResultNeverExpires) {
        return Err(ApiError::ResultExpired);
    }
    let artifacts: Vec<Value> = gw
        .submission_artifacts(&doc.session_id, &doc.id)
        .await?
        .iter()
        .map(|a| a.view())
        .collect();
    let mut body = doc.result_view();
    body["artifacts"] = Value::Array(artifacts);
    Ok(axum::Json(body).into_response())
}

pub async fn list_artifacts(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(sid): Path<String>,
    q: QueryPairs,
) -> ApiResult<Response> {
    owned_session(&gw, &caller.principal, &sid).await?;
    let submission = q.get("submission_id").map(str::to_owned);
    let page = PageRequest::parse(
        &state,
        &q,
        &caller.principal,
        format!(
            "artifacts session={sid} submission={}",
            submission.as_deref().unwrap_or("")
        ),
    )?;
    let mut lq = ListQuery::new(Kind::Artifact, Scope::Owner(&caller.principal));
    lq.parent = Some(&sid);
    lq.after = page.after.clone();
    let mut recs = Vec::new();
    for rec in state.store.list(&lq).await? {
        let art: ArtifactDoc = decode(&rec)?;
        if submission.as_deref().is_none_or(|s| s == art.submission_id) {
            recs.push(rec);
        }
        if recs.len() > page.limit as usize {
            break;
        }
    }
    let body = page.page(&state, recs, |rec| {
        Ok::<_, ApiError>(decode::<ArtifactDoc>(rec)?.view())
    })?;
    Ok(axum::Json(body).into_response())
}

pub async fn artifact_content(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let (_, art) = owned_artifact(&gw, &caller.principal, &id).await?;
    if now() >= art.expires_at && !state.config.defects.has(Defect::ResultNeverExpires) {
        return Err(ApiError::ArtifactExpired);
    }
    let bytes = if state.config.defects.has(Defect::ArtifactTracksFile) {
        // The bug: the artifact is whatever the file in the sandbox holds now.
        let session = gw
            .session(Scope::System, &art.session_id)
            .await?
            .ok_or(ApiError::NotFound)?;
        let (provider, local) = gw.provider(&session.doc.sandbox_id)?;
        provider
            .files(&local)
            .map_err(ApiError::from)?
            .read(&art.path)
            .map_err(ApiError::from)?
    } else {
        tokio::fs::read(super::artifacts::content_path(
            &state.config.data_dir,
            &art.id,
        ))
        .await
        .map_err(ApiError::internal)?
    };
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/octet-stream")],
        bytes,
    )
        .into_response())
}

pub async fn list_operations(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(sid): Path<String>,
    q: QueryPairs,
) -> ApiResult<Response> {
    owned_session(&gw, &caller.principal, &sid).await?;
    let filter = q.get("state").map(str::to_owned);
    if filter
        .as_deref()
        .is_some_and(|s| !OPERATION_STATES.contains(&s))
    {
        return Err(ApiError::invalid("state", "unknown operation state"));
    }
    let submission = q.get("submission_id").map(str::to_owned);
    let page = PageRequest::parse(
        &state,
        &q,
        &caller.principal,
        format!(
            "operations session={sid} state={} submission={}",
            filter.as_deref().unwrap_or(""),
            submission.as_deref().unwrap_or("")
        ),
    )?;
    // Operations are few per session; filter by submission after the keyset query.
    let mut lq = ListQuery::new(Kind::Operation, Scope::Owner(&caller.principal));
    lq.parent = Some(&sid);
    lq.state = filter.as_deref();
    lq.after = page.after.clone();
    let mut recs = Vec::new();
    for rec in state.store.list(&lq).await? {
        let doc: OperationDoc = decode(&rec)?;
        if submission.as_deref().is_none_or(|s| s == doc.submission_id) {
            recs.push(rec);
        }
        if recs.len() > page.limit as usize {
            break;
        }
    }
    let body = page.page(&state, recs, |rec| {
        Ok::<_, ApiError>(decode::<OperationDoc>(rec)?.view())
    })?;
    Ok(axum::Json(body).into_response())
}

pub async fn get_operation(
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let (_, doc) = owned_operation(&gw, &caller.principal, &id).await?;
    Ok(axum::Json(doc.view()).into_response())
}

pub async fn cancel_operation(
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let (_, doc) = owned_operation(&gw, &caller.principal, &id).await?;
    let rt = gw.rt(&doc.session_id);
    let _guard = gw.lock(&rt, &doc.session_id).await?;
    let mut rec = gw
        .state
        .store
        .get(Kind::Operation, Scope::System, &id)
        .await?
        .ok_or(ApiError::NotFound)?;
    let mut doc: OperationDoc = decode(&rec)?;
    if doc.state == "running" {
        if doc.kind == "model_call" {
            return Err(ApiError::InvalidState(
                "a running model call cannot be cancelled".into(),
            ));
        }
        if gw.state.config.defects.has(Defect::OperationCancelIgnored) {
            // The bug: the cancel is acknowledged and forgotten.
            doc.cancel_requested = true;
        } else if !doc.cancel_requested {
            doc.cancel_requested = true;
            gw.save_operation(&mut rec, &doc).await?;
        }
    }
    Ok(axum::Json(doc.view()).into_response())
}
