//! A transparent HTTP/1.1 proxy for tests, in front of a real server, with the faults a live
//! target can have: it can drop the `metadata.*` filters from every query (a target whose
//! lists ignore them), accept chosen requests without ever answering them, accept session
//! deletes that never complete, hold back one event-stream request of a burst, and end an
//! event stream after its first events (a stream closed mid-answer, to be resumed). It can
//! also add a header to every request, as a gateway in front of a server adds credentials.
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
    /// `(text, n)`: the answer to the first request whose body contains `text`, when it is an
    /// event stream, ends cleanly after its first `n` events.
    pub cut_stream: Option<(String, usize)>,
    /// Set on every request forwarded.
    pub add_header: Option<(hyper::header::HeaderName, hyper::header::HeaderValue)>,
    /// Where the `Last-Event-ID` of every request that carries one is written down.
    pub resumed: Option<Arc<Mutex<Vec<String>>>>,
}

/// What the proxy remembers between requests.
#[derive(Default)]
struct Seen {
    /// Sessions whose delete it answered itself.
    deleting: Mutex<HashSet<String>>,
    /// Event-stream requests so far.
    streams: std::sync::atomic::AtomicUsize,
    /// Whether a stream was cut already.
    cut: std::sync::atomic::AtomicBool,
}

/// A running proxy; it stops when dropped.
pub type Proxy = listening::Listening;

/// Starts a proxy on port 0 that forwards to `upstream` (a base URL, `http://host:port`).
pub async fn start(upstream: &str, faults: Faults) -> Proxy {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let client: hyper_util::client::legacy::Client<_, Body> =
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
        Body,
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
    if let Some((name, value)) = &faults.add_header {
        parts.headers.insert(name.clone(), value.clone());
    }
    if let (Some(resumed), Some(id)) = (&faults.resumed, parts.headers.get("last-event-id")) {
        resumed
            .lock()
            .unwrap()
            .push(id.to_str().unwrap_or_default().to_owned());
    }
    // The body is read whole only where a rule looks into it.
    let (body, cut_after) = match &faults.cut_stream {
        Some((text, n)) if !seen.cut.load(std::sync::atomic::Ordering::SeqCst) => {
            let bytes = match body.collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return Ok(json_response(400, format!("\"proxy: {e}\""))),
            };
            let hit = String::from_utf8_lossy(&bytes).contains(text.as_str())
                && !seen.cut.swap(true, std::sync::atomic::Ordering::SeqCst);
            let body = Full::new(bytes).map_err(|never| match never {}).boxed();
            (body, hit.then_some(*n))
        }
        _ => (body.boxed(), None),
    };
    match client.request(Request::from_parts(parts, body)).await {
        Ok(resp)
            if cut_after.is_some()
                && resp
                    .headers()
                    .get(hyper::header::CONTENT_TYPE)
                    .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream")) =>
        {
            let n = cut_after.expect("checked above");
            Ok(resp.map(|body| first_events(body, n)))
        }
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

/// An event stream's first `n` events (each ends with a blank line), then its clean end.
fn first_events(mut body: Incoming, n: usize) -> Body {
    let (tx, rx) =
        tokio::sync::mpsc::channel::<Result<hyper::body::Frame<Bytes>, hyper::Error>>(16);
    tokio::spawn(async move {
        let mut events = 0;
        let mut tail = Vec::new();
        while events < n {
            let Some(Ok(frame)) = body.frame().await else {
                return;
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let mut keep = data.len();
            for (i, byte) in data.iter().enumerate() {
                tail.push(*byte);
                if tail.ends_with(b"\n\n") || tail.ends_with(b"\r\n\r\n") {
                    tail.clear();
                    events += 1;
                    if events == n {
                        keep = i + 1;
                        break;
                    }
                }
            }
            if tx
                .send(Ok(hyper::body::Frame::data(data.slice(..keep))))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    http_body_util::StreamBody::new(stream).boxed()
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
