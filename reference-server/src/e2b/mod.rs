//! The E2B protocol over this server's own sandboxes: E2B's control plane (`/sandboxes`,
//! `/v2/sandboxes`, `X-API-Key`) and envd (the Connect services `process.Process` and
//! `filesystem.Filesystem`, `/files`, `/health`) on the same process, store, sandboxes and
//! port as `/v1`. A principal's token is also its E2B API key.
//!
//! # Layout
//!
//! - [`ids`]: E2B sandbox IDs and the provider-qualified IDs they stand for.
//! - [`records`]: what the E2B surface keeps in sandbox and snapshot records, and the
//!   lookups by it; below every other file here but `ids`.
//! - [`control`]: the control plane, its authentication and its `{code, message}` errors.
//! - [`connect`]: the Connect protocol with the JSON codec: unary calls, server-stream
//!   envelopes, error codes.
//! - [`envd`]: routing envd requests to a sandbox (headers or host), the access token of
//!   secure sandboxes, path mapping, and the plain HTTP endpoints.
//! - [`templates`]: snapshots (templates upstream) and forks.
//! - [`process`] and [`filesystem`]: the two Connect services.
//! - [`interpreter`]: the code interpreter's service (port 49999) of sandboxes made from its
//!   template, with a Python kernel per context.
//!
//! This file puts them together: the routes, and [`port_proxy`], the layer before them that
//! hands a request for another sandbox port than envd's to the code interpreter or to the
//! sandbox.
//!
//! What the upstream contract is and which parts are served is in `docs/profiles/e2b.md`.

pub mod connect;
pub mod control;
pub mod envd;
pub mod filesystem;
pub mod ids;
pub mod interpreter;
pub mod process;
pub mod records;
pub mod templates;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};

use crate::api::AppState;
use crate::defects::Defect;

/// The E2B routes, merged into the server's router beside `/v1`.
pub fn routes() -> Router<AppState> {
    Router::new()
        // Control plane (upstream spec/openapi.yml).
        .route("/sandboxes", post(control::create_v1).get(control::list_v1))
        .route(
            "/v2/sandboxes",
            post(control::create_v2).get(control::list_v2),
        )
        .route("/sandboxes/metrics", get(control::metrics_many))
        .route("/sandboxes/{id}", get(control::get).delete(control::kill))
        .route("/sandboxes/{id}/metrics", get(control::metrics))
        .route(
            "/sandboxes/{id}/snapshots",
            post(templates::create_snapshot),
        )
        .route("/sandboxes/{id}/fork", post(templates::fork))
        .route("/sandboxes/{id}/network", put(control::update_network))
        .route("/snapshots", get(templates::list_snapshots))
        .route("/templates/{id}", delete(templates::delete_template))
        .route("/sandboxes/{id}/timeout", post(control::set_timeout))
        .route("/sandboxes/{id}/refreshes", post(control::refresh))
        .route("/sandboxes/{id}/pause", post(control::pause))
        .route("/sandboxes/{id}/resume", post(control::resume))
        .route("/sandboxes/{id}/connect", post(control::connect))
        .route("/v2/sandboxes/{id}/connect", post(control::connect))
        // envd (packages/envd/spec), routed to a sandbox by E2b-Sandbox-Id / E2b-Sandbox-Port.
        .route("/health", get(envd::health))
        .route("/envs", get(envd::envs))
        .route("/files", get(envd::read_file).post(envd::write_file))
        .route("/process.Process/Start", post(process::start))
        .route("/process.Process/Connect", post(process::connect_process))
        .route("/process.Process/List", post(process::list))
        .route("/process.Process/SendInput", post(process::send_input))
        .route("/process.Process/SendSignal", post(process::send_signal))
        .route("/process.Process/CloseStdin", post(process::close_stdin))
        .route("/process.Process/Update", post(process::update))
        .route("/process.Process/StreamInput", post(process::stream_input))
        .route("/filesystem.Filesystem/Stat", post(filesystem::stat))
        .route("/filesystem.Filesystem/ListDir", post(filesystem::list_dir))
        .route("/filesystem.Filesystem/MakeDir", post(filesystem::make_dir))
        .route("/filesystem.Filesystem/Move", post(filesystem::move_entry))
        .route("/filesystem.Filesystem/Remove", post(filesystem::remove))
        .route(
            "/filesystem.Filesystem/WatchDir",
            post(filesystem::watch_dir),
        )
        .route(
            "/filesystem.Filesystem/CreateWatcher",
            post(filesystem::create_watcher),
        )
        .route(
            "/filesystem.Filesystem/GetWatcherEvents",
            post(filesystem::get_watcher_events),
        )
        .route(
            "/filesystem.Filesystem/RemoveWatcher",
            post(filesystem::remove_watcher),
        )
}

/// Requests routed to a sandbox port other than envd's (`envd::port_target`) are answered by
/// the code interpreter when the port is its own and the sandbox serves it, else forwarded to
/// that port as the sandbox's own processes reach it, as E2B's proxy forwards them; every
/// other request goes on to the routes. A port nothing listens on is the proxy's 502.
pub async fn port_proxy(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some((id, port)) = envd::port_target(request.headers()) else {
        return next.run(request).await;
    };
    if state.config.defects.has(Defect::E2bPortProxyMissing) {
        return envd::port_not_open(&id).into_response();
    }
    let sbx = match envd::port_sandbox(&state, &id).await {
        Ok(sbx) => sbx,
        Err(e) => return e.into_response(),
    };
    if port == interpreter::PORT && records::e2b_state(&sbx.rec).code_interpreter {
        return interpreter::serve(state, sbx, request).await;
    }
    match envd::forward_to_port(&sbx, &id, port, request).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}
