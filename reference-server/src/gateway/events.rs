//! The session event log as an SSE stream (§7) and as JSON pages, and one submission's view
//! of it as an SSE stream.

use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::api::{ApiError, AppState};
use crate::defects::Defect;
use crate::store::{Kind, Scope, StoreError};
use crate::stream::sse::{self, EventTest, Finished, Options, Subject};

use super::core::Gateway;
use super::http::{ApiResult, Caller, Path, QueryPairs};
use super::lookup::{owned_session, owned_submission};
use super::model::{SUBMISSION_TERMINAL, session_stream};

pub async fn session_events(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(sid): Path<String>,
    q: QueryPairs,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let stream = session_stream(&sid);
    if q.get("format") == Some("json") {
        owned_session(&gw, &caller.principal, &sid).await?;
        // The JSON form takes the same cursor as the stream (SSE-7.10): a `Last-Event-ID`
        // header, checked alike, wins over `after`.
        let resume = match headers.get("last-event-id") {
            Some(_) => sse::parse_cursor(&headers, None)?,
            None => None,
        };
        return json_page(&state, &stream, resume, q.get("after"), q.get("limit")).await;
    }
    // The stream's first read of the log does not depend on the session lookup: the two run
    // at once, and the read is dropped unless the lookup finds the caller's session. A cursor
    // that does not parse is refused after the lookup, as any other bad request.
    let (found, head) = match sse::parse_cursor(&headers, q.get("after")) {
        Ok(cursor) => {
            let (found, head) = tokio::join!(
                owned_session(&gw, &caller.principal, &sid),
                sse::Head::read(&state.log, &stream, cursor)
            );
            (found, Some(head))
        }
        Err(_) => (owned_session(&gw, &caller.principal, &sid).await, None),
    };
    found?;
    let subject = Subject {
        stream,
        is_terminal: Box::new(|e| e.kind == "session.deleted"),
        finished: session_gone(&state, &sid),
        // The lookup above found the session: it is not gone.
        known_live: true,
        filter: None,
        on_delivered: None,
        head,
    };
    sse_response(&state, &caller, &headers, &q, subject).await
}

/// The events of the owning session's log that carry this submission's ID, with the log's
/// own `seq` numbers (so a cursor is valid here and on the session stream); the stream ends
/// after the submission's terminal event (SES-8.23).
pub async fn submission_events(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    q: QueryPairs,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let (_, doc) = owned_submission(&gw, &caller.principal, &id).await?;
    let sid = doc.session_id;
    let defects = &state.config.defects;
    let subject = if defects.has(Defect::SubmissionStreamNeverEnds) {
        // The bug: the session stream's end conditions, with the submission's filter.
        Subject {
            stream: session_stream(&sid),
            is_terminal: Box::new(|e| e.kind == "session.deleted"),
            finished: session_gone(&state, &sid),
            known_live: false,
            filter: Some(of_submission(&id)),
            on_delivered: None,
            head: None,
        }
    } else {
        let own = of_submission(&id);
        Subject {
            stream: session_stream(&sid),
            is_terminal: Box::new(move |e| own(e) && is_submission_end(&e.kind)),
            finished: submission_finished(&gw, &sid, &id),
            known_live: false,
            filter: (!defects.has(Defect::SubmissionStreamLeaksOtherEvents))
                .then(|| of_submission(&id)),
            on_delivered: None,
            head: None,
        }
    };
    sse_response(&state, &caller, &headers, &q, subject).await
}

/// Events of the submission `id`: those whose data carries its `submission_id`.
fn of_submission(id: &str) -> EventTest {
    let id = id.to_owned();
    Box::new(move |e| e.data.get("submission_id").and_then(Value::as_str) == Some(id.as_str()))
}

/// `submission.<terminal state>`.
fn is_submission_end(kind: &str) -> bool {
    kind.strip_prefix("submission.")
        .is_some_and(|state| SUBMISSION_TERMINAL.contains(&state))
}

/// Whether the session is gone (its log ends with `session.deleted`, appended before the
/// record is removed).
fn session_gone(state: &AppState, sid: &str) -> Finished {
    let store = state.store.clone();
    let sid = sid.to_owned();
    Box::new(move || {
        let store = store.clone();
        let sid = sid.clone();
        Box::pin(async move {
            Ok(store
                .get(Kind::Session, Scope::System, &sid)
                .await?
                .is_none())
        })
    })
}

/// Whether the submission is terminal (or gone with its session). Its state is saved a moment
/// before its terminal event is appended, both under the session's lock: once the state reads
/// terminal, taking that lock (and letting it go) makes sure the event is in the log, so that
/// "finished with nothing after the cursor" never hides a terminal event about to be appended.
fn submission_finished(gw: &Arc<Gateway>, sid: &str, id: &str) -> Finished {
    let gw = Arc::clone(gw);
    let sid = sid.to_owned();
    let id = id.to_owned();
    Box::new(move || {
        let (gw, sid, id) = (Arc::clone(&gw), sid.clone(), id.clone());
        Box::pin(async move {
            let Some(rec) = gw
                .state
                .store
                .get(Kind::Submission, Scope::System, &id)
                .await?
            else {
                return Ok(true);
            };
            if !SUBMISSION_TERMINAL.contains(&rec.state.as_str()) {
                return Ok(false);
            }
            let rt = gw.rt(&sid);
            drop(
                gw.lock(&rt, &sid)
                    .await
                    .map_err(|e| StoreError::Unavailable(e.to_string()))?,
            );
            Ok(true)
        })
    })
}

/// The SSE response for `subject` (§7): Accept, cursor, the principal's stream slot, limits.
async fn sse_response(
    state: &AppState,
    caller: &Caller,
    headers: &HeaderMap,
    q: &QueryPairs,
    subject: Subject,
) -> ApiResult<Response> {
    sse::check_accept(headers)?;
    let cursor = sse::parse_cursor(headers, q.get("after"))?;
    let limits = &state.config.limits;
    let slot = state
        .streams
        .acquire(
            &state.store,
            &caller.principal,
            limits.max_streams_per_principal,
        )
        .await?;
    let options = Options {
        heartbeat: Duration::from_secs(limits.heartbeat_interval_s),
        max_duration: if state.config.defects.has(Defect::StreamEndsEarly) {
            // The defect: seconds taken for milliseconds.
            Duration::from_millis(limits.max_stream_duration_s)
        } else {
            Duration::from_secs(limits.max_stream_duration_s)
        },
        shutdown: state.shutdown.clone(),
        skip_first_on_resume: state.config.defects.has(Defect::SessionStreamDropsOnResume),
        expired_cursor_skips: state.config.defects.has(Defect::ExpiredCursorSkips),
        leak_slot_on_close: state.config.defects.has(Defect::StreamSlotLeakedOnClose),
        heartbeats_stop: state.config.defects.has(Defect::HeartbeatsStop),
        outage_stalls: state.config.defects.has(Defect::OutageStallsStream),
    };
    Ok(sse::respond(&state.log, subject, cursor, slot, options).await?)
}

/// `{data, has_more, last_seq}`: events after `after`, each as its SSE `data:` object.
async fn json_page(
    state: &AppState,
    stream: &str,
    resume: Option<i64>,
    after: Option<&str>,
    limit: Option<&str>,
) -> ApiResult<Response> {
    let after =
        match (resume, after) {
            (Some(cursor), _) => cursor,
            (None, None) => 0,
            (None, Some(raw)) => raw.parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| {
                ApiError::invalid("after", "after must be a non-negative integer")
            })?,
        };
    let limits = &state.config.limits;
    let limit = match limit {
        None => limits.default_page_size,
        Some(raw) => raw
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=limits.max_page_size).contains(n))
            .ok_or_else(|| {
                ApiError::invalid(
                    "limit",
                    format!("limit must be between 1 and {}", limits.max_page_size),
                )
            })?,
    };
    let bounds = state.store.stream_bounds(stream).await?;
    let mut after = after;
    if after < bounds.purged_through {
        if !state.config.defects.has(Defect::ExpiredCursorSkips) {
            return Err(ApiError::CursorExpired);
        }
        // The defect: the page silently starts at the oldest retained event.
        after = bounds.purged_through;
    }
    let mut events = state.store.events_after(stream, after, limit + 1).await?;
    let has_more = events.len() > limit as usize;
    events.truncate(limit as usize);
    let last_seq = events.last().map_or(after, |e| e.seq);
    let data: Vec<Value> = events
        .iter()
        .map(|e| {
            let mut data = e.data.clone();
            if let Value::Object(map) = &mut data {
                map.insert("seq".into(), Value::from(e.seq));
            }
            data
        })
        .collect();
    Ok(
        axum::Json(json!({"data": data, "has_more": has_more, "last_seq": last_seq}))
            .into_response(),
    )
}
