//! A transparent HTTP/1.1 proxy for tests, in front of a real server, with the faults a live
//! target can have: it can drop the `metadata.*` filters from every query (a target whose
//! lists ignore them), accept chosen requests without ever answering them, accept session
//! deletes that never complete, and hold back one event-stream request of a burst.
//!
//! Also [`silent_target`]: a listener that answers `GET /v1/capabilities` and nothing else.

use super::listening;

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

type Body = BoxBody<Bytes, hyper::Error>;

/// Which requests to hold without an answer: `(method, path, headers)`.
pub type HangRule = dyn Fn(&hyper::Method, &str, &hyper::HeaderMap) -> bool + Send + Sync;

/// What the proxy does wrong.
#[derive(Default)]
pub struct Faults {
    /// Remove every `metadata.<k>` query parameter before forwarding.
    pub drop_metadata_filters: bool,
    /// Requests accepted and never answered (the connection stays open).
    pub hang: Option<Box<HangRule>>,
    /// `DELETE /v1/sessions/{id}` is answered 202 `deleting` and never reaches the server:
    /// from then on the session's `GET` answers the server's record in state `deleting`, a
    /// session whose cleanup never completes.
    pub stuck_session_deletes: bool,
    /// The `n`-th event-stream request (counting from 1) is held this long before it is
    /// forwarded: a request of a burst that a loaded machine sends late.
    pub late_stream: Option<(usize, std::time::Duration)>,
}

/// What the proxy remembers between requests.
#[derive(Default)]
struct Seen {
    /// Sessions whose delete it answered itself.
    deleting: Mutex<HashSet<String>>,
    /// Event-stream requests so far.
    streams: std::sync::atomic::AtomicUsize,
}

/// A running proxy; it stops when dropped.
pub type Proxy = listening::Listening;

/// Starts a proxy on port 0 that forwards to `upstream` (a base URL, `http://host:port`).
pub async fn start(upstream: &str, faults: Faults) -> Proxy {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let client: hyper_util::client::legacy::Client<_, Incoming> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http();
    let upstream: Arc<str> = upstream.trim_end_matches('/').into();
    let faults = Arc::new(faults);
    let seen = Arc::new(Seen::default());
    let task = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        while let Ok((socket, _)) = listener.accept().await {
            let (client, upstream, faults, seen) = (
                client.clone(),
                upstream.clone(),
                faults.clone(),
                seen.clone(),
            );
            let service = hyper::service::service_fn(move |req| {
                forward(
                    req,
                    client.clone(),
                    upstream.clone(),
                    faults.clone(),
                    seen.clone(),
                )
            });
            connections.spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            });
        }
    });
    Proxy::new(url, task)
}

async fn forward(
    req: Request<Incoming>,
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Incoming,
    >,
    upstream: Arc<str>,
    faults: Arc<Faults>,
    seen: Arc<Seen>,
) -> Result<Response<Body>, Infallible> {
    if let Some(hang) = &faults.hang
        && hang(req.method(), req.uri().path(), req.headers())
    {
        std::future::pending::<()>().await;
    }
    let asks_stream = req
        .headers()
        .get(hyper::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    if asks_stream {
        let n = seen
            .streams
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        if let Some((late, hold)) = faults.late_stream
            && late == n
        {
            tokio::time::sleep(hold).await;
        }
    }
    let session = faults
        .stuck_session_deletes
        .then(|| req.uri().path().strip_prefix("/v1/sessions/"))
        .flatten()
        .filter(|id| !id.is_empty() && !id.contains('/'))
        .map(str::to_owned);
    if let Some(id) = &session
        && req.method() == hyper::Method::DELETE
    {
        seen.deleting.lock().unwrap().insert(id.clone());
        let body = serde_json::json!({"id": id, "state": "deleting"}).to_string();
        return Ok(json_response(202, body));
    }
    let rewrite = session.is_some_and(|id| seen.deleting.lock().unwrap().contains(&id));
    let mut target = format!("{upstream}{}", req.uri().path());
    if let Some(query) = req.uri().query() {
        let kept: Vec<&str> = query
            .split('&')
            .filter(|pair| !(faults.drop_metadata_filters && pair.starts_with("metadata.")))
            .collect();
        if !kept.is_empty() {
            target.push('?');
            target.push_str(&kept.join("&"));
        }
    }
    let (mut parts, body) = req.into_parts();
    parts.uri = target.parse().expect("a valid upstream URI");
    match client.request(Request::from_parts(parts, body)).await {
        Ok(resp) if rewrite && resp.status() == 200 => {
            let bytes = resp.into_body().collect().await.map(|b| b.to_bytes());
            let mut record: serde_json::Value = bytes
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            record["state"] = "deleting".into();
            Ok(json_response(200, record.to_string()))
        }
        Ok(resp) => Ok(resp.map(|b| b.boxed())),
        Err(e) => Ok(Response::builder()
            .status(502)
            .body(
                Full::new(Bytes::from(format!("proxy: {e}")))
                    .map_err(|never| match never {})
                    .boxed(),
            )
            .expect("a valid response")),
    }
}

fn json_response(status: u16, body: String) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(
            Full::new(Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("a valid response")
}

/// A listener that answers `GET /v1/capabilities` with `capabilities` and accepts every
/// other request without ever answering it. Returns its base URL; it runs until the test
/// ends.
pub async fn silent_target(capabilities: serde_json::Value) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let body = capabilities.to_string();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                if head.starts_with(b"GET /v1/capabilities ") {
                    let response = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = socket.write_all(response.as_bytes()).await;
                    let _ = socket.shutdown().await;
                    return;
                }
                // Hold the connection open, silent, until the client gives up.
                while let Ok(n) = socket.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                }
            });
        }
    });
    url
}
