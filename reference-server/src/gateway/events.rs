//! The session event log as an SSE stream (§7) and as JSON pages.

use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::extract::{RawQuery, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::api::{ApiError, AppState};
use crate::defects::Defect;
use crate::store::{Kind, Scope};
use crate::stream::sse::{self, Options, SseError, Subject};

use super::core::Gateway;
use super::http::{Caller, GwError, GwResult};
use super::model::session_stream;
use super::routes::{PathId, query_pairs};
use super::sessions::owned_session;

pub async fn session_events(
    State(state): State<AppState>,
    Extension(gw): Extension<Arc<Gateway>>,
    caller: Caller,
    PathId(sid): PathId,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> GwResult<Response> {
    owned_session(&gw, &caller.principal, &sid).await?;
    let q = query_pairs(query.as_deref());
    let stream = session_stream(&sid);
    if q.get("format").map(String::as_str) == Some("json") {
        return json_page(
            &state,
            &stream,
            q.get("after").map(String::as_str),
            q.get("limit").map(String::as_str),
        )
        .await;
    }
    sse::check_accept(&headers)?;
    let cursor = sse::parse_cursor(&headers, q.get("after").map(String::as_str))?;
    let limits = &state.config.limits;
    let slot = state
        .streams
        .try_acquire(&caller.principal, limits.max_streams_per_principal)
        .ok_or(SseError::TooManyStreams { retry_after_s: 1 })?;
    let store = state.store.clone();
    let finished_sid = sid.clone();
    let subject = Subject {
        stream,
        is_terminal: Box::new(|e| e.kind == "session.deleted"),
        finished: Box::new(move || {
            let store = store.clone();
            let sid = finished_sid.clone();
            Box::pin(async move {
                Ok(store
                    .get(Kind::Session, Scope::System, &sid)
                    .await?
                    .is_none())
            })
        }),
        on_delivered: None,
    };
    let options = Options {
        heartbeat: Duration::from_secs(limits.heartbeat_interval_s),
        max_duration: Duration::from_secs(limits.max_stream_duration_s),
        shutdown: state.shutdown.clone(),
        skip_first_on_resume: state.config.defects.has(Defect::SessionStreamDropsOnResume),
    };
    Ok(sse::respond(&state.log, subject, cursor, slot, options).await?)
}

/// `{data, has_more, last_seq}`: events after `after`, each as its SSE `data:` object.
async fn json_page(
    state: &AppState,
    stream: &str,
    after: Option<&str>,
    limit: Option<&str>,
) -> GwResult<Response> {
    let after = match after {
        None => 0,
        Some(raw) => raw
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= 0)
            .ok_or_else(|| GwError::invalid("after", "after must be a non-negative integer"))?,
    };
    let limits = &state.config.limits;
    let limit = match limit {
        None => limits.default_page_size,
        Some(raw) => raw
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=limits.max_page_size).contains(n))
            .ok_or_else(|| {
                GwError::invalid(
                    "limit",
                    format!("limit must be between 1 and {}", limits.max_page_size),
                )
            })?,
    };
    let bounds = state.store.stream_bounds(stream).await?;
    if after < bounds.purged_through {
        return Err(ApiError::CursorExpired.into());
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
