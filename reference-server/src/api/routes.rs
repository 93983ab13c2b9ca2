//! The route table of API v1 and the preview proxy, and the handling every route of the server
//! shares: request IDs, panics, unknown routes and methods. `server::router` puts the server's
//! areas together inside it.

use axum::Router;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use tower_http::catch_panic::CatchPanicLayer;

use super::error::ApiError;
use super::state::AppState;
use super::{files, meta, previews, processes, request_id, sandboxes, snapshots};

/// Every operation of API v1 under `/v1`, and the preview proxy.
pub fn routes() -> Router<AppState> {
    let v1 = Router::new()
        .route("/health", get(meta::health))
        .route("/capabilities", get(meta::capabilities))
        .route("/sandboxes", post(sandboxes::create).get(sandboxes::list))
        .route(
            "/sandboxes/{id}",
            get(sandboxes::get).delete(sandboxes::kill),
        )
        .route(
            "/sandboxes/{id}/connections",
            post(sandboxes::connect).get(sandboxes::list_connections),
        )
        .route(
            "/sandboxes/{id}/connections/{conn}",
            axum::routing::delete(sandboxes::close_connection),
        )
        .route("/sandboxes/{id}/timeout", post(sandboxes::set_timeout))
        .route("/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/sandboxes/{id}/snapshots", post(snapshots::create))
        .route("/snapshots", get(snapshots::list))
        .route(
            "/snapshots/{id}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route(
            "/sandboxes/{id}/processes",
            post(processes::start).get(processes::list),
        )
        .route("/processes/{id}", get(processes::get))
        .route("/processes/{id}/output", get(processes::output))
        .route("/processes/{id}/events", get(processes::events))
        .route("/processes/{id}/stdin", post(processes::stdin))
        .route("/processes/{id}/signal", post(processes::signal))
        .route(
            "/sandboxes/{id}/files",
            get(files::read).put(files::write).delete(files::delete),
        )
        .route("/sandboxes/{id}/files/list", get(files::list))
        .route("/sandboxes/{id}/previews", post(previews::create))
        .route("/test/digest", get(meta::digest))
        .route("/test/expiry_hold", post(meta::expiry_hold))
        .route("/test/clock", post(meta::advance_clock))
        .route(
            "/test/providers/{name}/create_delay",
            post(meta::create_delay),
        )
        .route(
            "/test/providers/{name}/next_local_id",
            post(meta::next_local_id),
        );
    Router::new()
        .nest("/v1", v1)
        .route("/previews/{id}", any(previews::proxy_root))
        .route("/previews/{id}/", any(previews::proxy_root))
        .route("/previews/{id}/{*rest}", any(previews::proxy))
}

/// `routes` answering as one server: a problem body for an unknown route or method and for a
/// handler that panics, an `X-Request-Id` on every response.
pub fn shared_handling(routes: Router<AppState>, state: AppState) -> Router {
    let outage_is_500 = state
        .config
        .defects
        .has(crate::defects::Defect::StoreOutageIs500);
    let router = routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
        .layer(CatchPanicLayer::custom(|_| {
            ApiError::internal("a handler panicked").into_response()
        }))
        .layer(middleware::from_fn(request_id::middleware));
    if outage_is_500 {
        router.layer(middleware::map_response(store_outage_is_500))
    } else {
        router
    }
}

/// The `store-outage-is-500` defect: a 503 of an unreachable store goes out as a 500 without
/// `Retry-After`, as a server that does not tell an outage from a bug answers.
async fn store_outage_is_500(response: Response) -> Response {
    if response.status() != axum::http::StatusCode::SERVICE_UNAVAILABLE {
        return response;
    }
    let mut response = response;
    response
        .headers_mut()
        .remove(axum::http::header::RETRY_AFTER);
    *response.status_mut() = axum::http::StatusCode::INTERNAL_SERVER_ERROR;
    response
}

async fn not_found() -> Response {
    ApiError::NotFound.into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::MethodNotAllowed.into_response()
}
