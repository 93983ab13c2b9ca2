//! Submissions (turns) and operations: submit, list, get, cancel, result.

use std::future::Future;
use std::sync::Arc;

use axum::Extension;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::DeserializeOwned;
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

/// One of the lists of a session's children, `GET /v1/sessions/{id}/<list>`: its submissions,
/// operations or artifacts.
pub trait Child: DeserializeOwned + Send + Sync {
    const KIND: Kind;
    /// The list's name in its route, which its page tokens are bound to.
    const LIST: &'static str;
    /// The states `state=` may name and what they are states of; `None`: the list takes no
    /// `state=`.
    const STATES: Option<(&'static [&'static str], &'static str)>;
    /// The submission a child belongs to, for `submission_id=`; `None`: the list takes no
    /// `submission_id=`.
    const SUBMISSION_OF: Option<fn(&Self) -> &str>;

    /// The child as the list shows it.
    fn view(&self, gw: &Gateway) -> impl Future<Output = ApiResult<Value>> + Send;
}

impl Child for SubmissionDoc {
    const KIND: Kind = Kind::Submission;
    const LIST: &'static str = "submissions";
    const STATES: Option<(&'static [&'static str], &'static str)> = Some((
        &[
            "queued",
            "running",
            "cancelling",
            "completed",
            "failed",
            "cancelled",
            "expired",
            "uncertain",
        ],
        "submission",
    ));
    const SUBMISSION_OF: Option<fn(&Self) -> &str> = None;

    fn view(&self, gw: &Gateway) -> impl Future<Output = ApiResult<Value>> + Send {
        gw.submission_view(self)
    }
}

impl Child for OperationDoc {
    const KIND: Kind = Kind::Operation;
    const LIST: &'static str = "operations";
    const STATES: Option<(&'static [&'static str], &'static str)> = Some((
        &["running", "succeeded", "failed", "cancelled", "uncertain"],
        "operation",
    ));
    const SUBMISSION_OF: Option<fn(&Self) -> &str> = Some(|op| &op.submission_id);

    fn view(&self, _: &Gateway) -> impl Future<Output = ApiResult<Value>> + Send {
        std::future::ready(Ok(OperationDoc::view(self)))
    }
}

impl Child for ArtifactDoc {
    const KIND: Kind = Kind::Artifact;
    const LIST: &'static str = "artifacts";
    const STATES: Option<(&'static [&'static str], &'static str)> = None;
    const SUBMISSION_OF: Option<fn(&Self) -> &str> = Some(|art| &art.submission_id);

    fn view(&self, _: &Gateway) -> impl Future<Output = ApiResult<Value>> + Send {
        std::future::ready(Ok(ArtifactDoc::view(self)))
    }
}

/// `GET /v1/sessions/{id}/<list>`: a page of the caller's session's children of one kind, with
/// the list's filters (`state=`, `submission_id=`).
pub async fn list<T: Child>(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(sid): Path<String>,
    q: QueryPairs,
) -> ApiResult<Response> {
    owned_session(&gw, &caller.principal, &sid).await?;
    let mut filters = format!("{} session={sid}", T::LIST);
    let state_filter = match T::STATES {
        None => None,
        Some((states, of)) => {
            let filter = q.get("state");
            if filter.is_some_and(|s| !states.contains(&s)) {
                return Err(ApiError::invalid("state", format!("unknown {of} state")));
            }
            filters.push_str(&format!(" state={}", filter.unwrap_or("")));
            filter
        }
    };
    let submission = T::SUBMISSION_OF.and_then(|of| {
        let filter = q.get("submission_id");
        filters.push_str(&format!(" submission={}", filter.unwrap_or("")));
        Some((of, filter?))
    });
    let page = PageRequest::parse(&state, &q, &caller.principal, filters)?;
    let mut lq = ListQuery::new(T::KIND, Scope::Owner(&caller.principal));
    lq.parent = Some(&sid);
    lq.state = state_filter;
    lq.after = page.after.clone();
    // A session's children are few: filtered by submission, they are read until a page (and
    // one more, which says that there is more) matches.
    if submission.is_none() {
        lq.limit = Some(page.limit + 1);
    }
    let mut recs = Vec::new();
    let mut views = Vec::new();
    for rec in state.store.list(&lq).await? {
        let child: T = decode(&rec)?;
        if submission.is_some_and(|(of, id)| of(&child) != id) {
            continue;
        }
        views.push(child.view(&gw).await?);
        recs.push(rec);
        if recs.len() > page.limit as usize {
            break;
        }
    }
    Ok(axum::Json(page.page_of(&state, recs, views)).into_response())
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
