//! Gives every request an id (`X-Request-Id: req_<ulid>` on every response), a tracing span
//! carrying it, and renders problem bodies with it.

use axum::extract::Request;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

use super::error::Problem;

/// The id of the current request, available to handlers as an extension.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

pub async fn middleware(mut request: Request, next: Next) -> Response {
    let id = format!("req_{}", ulid::Ulid::new().to_string().to_lowercase());
    request.extensions_mut().insert(RequestId(id.clone()));
    // Only the method and path: queries may carry preview tokens.
    let span = tracing::info_span!("request", id = %id, method = %request.method(), path = %request.uri().path());
    let mut response = next.run(request).instrument(span.clone()).await;
    if let Some(problem) = response.extensions_mut().remove::<Problem>() {
        let headers = std::mem::take(response.headers_mut());
        let mut rendered = problem.render(&id);
        for (name, value) in headers.iter() {
            if name != axum::http::header::CONTENT_LENGTH {
                rendered.headers_mut().insert(name, value.clone());
            }
        }
        response = rendered;
    }
    span.in_scope(|| tracing::debug!(status = response.status().as_u16(), "response"));
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}
