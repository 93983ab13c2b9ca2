//! The gateway's routes: `/v1/sessions…`, `/v1/submissions…`, `/v1/operations…`, the test
//! controls of §9 that concern sessions, and the private bridge under `/bridge/v1/`.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::routing::{get, post};
use axum::{Extension, Router};

use crate::api::{ApiError, AppState};

use super::core::Gateway;
use super::{bridge, events, sessions, submissions};

/// One path parameter; undecodable is 404 like any unknown ID.
pub struct PathId(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<String>::from_request_parts(parts, state)
            .await
            .map(|p| PathId(p.0))
            .map_err(|_| ApiError::NotFound)
    }
}

/// Two path parameters.
pub struct PathIds(pub (String, String));

impl<S: Send + Sync> FromRequestParts<S> for PathIds {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<(String, String)>::from_request_parts(parts, state)
            .await
            .map(|p| PathIds(p.0))
            .map_err(|_| ApiError::NotFound)
    }
}

/// The decoded query string; the first value of each key wins.
pub fn query_pairs(raw: Option<&str>) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    for (k, v) in url_pairs(raw.unwrap_or("")) {
        out.entry(k).or_insert(v);
    }
    out
}

fn url_pairs(raw: &str) -> Vec<(String, String)> {
    raw.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = |b: u8| (b as char).to_digit(16);
                match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
                        i += 3;
                        continue;
                    }
                    _ => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The gateway's routes, carrying the gateway itself as an extension. Starts the supervisor
/// (when called inside a runtime); it stops at the server's shutdown.
pub fn routes(state: &AppState) -> Router<AppState> {
    let gw = Arc::new(Gateway::new(state.clone(), state.config.gateway.clone()));
    if tokio::runtime::Handle::try_current().is_ok() {
        tokio::spawn(Arc::clone(&gw).supervise_forever());
    }
    Router::new()
        .route("/v1/sessions", post(sessions::create).get(sessions::list))
        .route(
            "/v1/sessions/{id}",
            get(sessions::get).delete(sessions::delete),
        )
        .route("/v1/sessions/{id}/resume", post(sessions::resume))
        .route("/v1/sessions/{id}/files", post(sessions::upload))
        .route(
            "/v1/sessions/{id}/submissions",
            post(submissions::submit).get(submissions::list),
        )
        .route(
            "/v1/sessions/{id}/operations",
            get(submissions::list_operations),
        )
        .route("/v1/sessions/{id}/events", get(events::session_events))
        .route(
            "/v1/sessions/{id}/artifacts",
            get(submissions::list_artifacts),
        )
        .route(
            "/v1/artifacts/{id}/content",
            get(submissions::artifact_content),
        )
        .route("/v1/submissions/{id}", get(submissions::get))
        .route("/v1/submissions/{id}/cancel", post(submissions::cancel))
        .route("/v1/submissions/{id}/result", get(submissions::result))
        .route(
            "/v1/submissions/{id}/events",
            get(events::submission_events),
        )
        .route("/v1/operations/{id}", get(submissions::get_operation))
        .route(
            "/v1/operations/{id}/cancel",
            post(submissions::cancel_operation),
        )
        .route(
            "/v1/test/sessions/{id}/kill_worker",
            post(bridge::kill_worker),
        )
        .route(
            "/v1/test/sessions/{id}/bridge",
            get(bridge::bridge_credentials),
        )
        .route("/bridge/v1/sessions/{id}/lease", post(bridge::take_lease))
        .route(
            "/bridge/v1/sessions/{id}/heartbeat",
            post(bridge::heartbeat),
        )
        .route("/bridge/v1/sessions/{id}/next", post(bridge::next))
        .route(
            "/bridge/v1/sessions/{id}/operations",
            post(bridge::start_operation),
        )
        .route(
            "/bridge/v1/sessions/{id}/operations/{op}/complete",
            post(bridge::complete_operation),
        )
        .route("/bridge/v1/sessions/{id}/output", post(bridge::output))
        .route(
            "/bridge/v1/sessions/{id}/submissions/{sub}/complete",
            post(bridge::complete_submission),
        )
        .layer(Extension(gw))
}
