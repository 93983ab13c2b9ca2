//! The gateway's routes: `/v1/sessions…`, `/v1/submissions…`, `/v1/operations…`, the test
//! controls of §9 that concern sessions, and the private bridge under `/bridge/v1/`.

use std::sync::Arc;

use axum::routing::{get, post};
use axum::{Extension, Router};

use crate::api::AppState;

use super::artifacts::ArtifactDoc;
use super::core::Gateway;
use super::model::{OperationDoc, SubmissionDoc};
use super::{bridge, events, sessions, submissions};

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
            post(submissions::submit).get(submissions::list::<SubmissionDoc>),
        )
        .route(
            "/v1/sessions/{id}/operations",
            get(submissions::list::<OperationDoc>),
        )
        .route("/v1/sessions/{id}/events", get(events::session_events))
        .route(
            "/v1/sessions/{id}/artifacts",
            get(submissions::list::<ArtifactDoc>),
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
