//! A transparent HTTP/1.1 reverse proxy for tests, behaving as ordinary proxies do where it
//! matters to a conformance verdict: it adds latency to every request, and it holds its
//! upstream connection a moment after its client has gone, so the server learns of a close
//! late.
//!
//! Each client connection gets one upstream connection of its own (opened on its first
//! request, and again when the server closed it), and requests are forwarded unchanged, Host
//! header included. Response bodies are relayed chunk by chunk; when the client closes in the
//! middle of one (a dropped event stream), the proxy keeps reading the upstream body for
//! [`HOLD`] before it lets the upstream connection go.

use super::listening;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, mpsc};

/// Added before every request is forwarded.
pub const LATENCY: Duration = Duration::from_millis(15);
/// How long the upstream connection outlives a client that went away.
pub const HOLD: Duration = Duration::from_millis(1000);

type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// A running proxy; it stops when dropped.
pub type Proxy = listening::Listening;

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream` (`http://host:port`).
    pub async fn start(upstream: &str) -> Proxy {
        let upstream: SocketAddr = upstream
            .strip_prefix("http://")
            .expect("a plain-HTTP upstream")
            .trim_end_matches('/')
            .parse()
            .expect("upstream is host:port");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("local addr"));
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(serve_client(client, upstream));
            }
        });
        Proxy::new(url, task)
    }
}

/// The upstream connection of one client connection.
type Upstream = Arc<Mutex<Option<hyper::client::conn::http1::SendRequest<Incoming>>>>;

async fn serve_client(client: TcpStream, upstream: SocketAddr) {
    let _ = client.set_nodelay(true);
    let conn: Upstream = Arc::default();
    let service = hyper::service::service_fn({
        let conn = conn.clone();
        move |request: Request<Incoming>| {
            let conn = conn.clone();
            async move { Ok::<_, Infallible>(forward(request, &conn, upstream).await) }
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(client), service)
        .await;
    // The client is gone; the upstream connection stays a moment longer.
    tokio::time::sleep(HOLD).await;
    drop(conn);
}

async fn forward(
    request: Request<Incoming>,
    conn: &Upstream,
    upstream: SocketAddr,
) -> Response<Body> {
    tokio::time::sleep(LATENCY).await;
    let mut guard = conn.lock().await;
    let usable = match guard.as_mut() {
        Some(sender) => sender.ready().await.is_ok(),
        None => false,
    };
    if !usable {
        match connect(upstream).await {
            Ok(sender) => *guard = Some(sender),
            Err(e) => return bad_gateway(&e.to_string()),
        }
    }
    let sender = guard.as_mut().expect("connected above");
    let response = match sender.send_request(request).await {
        Ok(r) => r,
        Err(e) => {
            *guard = None;
            return bad_gateway(&e.to_string());
        }
    };
    drop(guard);
    let (parts, body) = response.into_parts();
    Response::from_parts(parts, relay(body))
}

async fn connect(
    upstream: SocketAddr,
) -> Result<hyper::client::conn::http1::SendRequest<Incoming>, Box<dyn std::error::Error>> {
    let tcp = TcpStream::connect(upstream).await?;
    tcp.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// Relays an upstream body chunk by chunk. Once the client stops taking chunks, the upstream
/// body is still read (and thrown away) for [`HOLD`], then dropped, which ends its connection.
fn relay(mut body: Incoming) -> Body {
    let (tx, rx) =
        mpsc::channel::<Result<Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>>(16);
    tokio::spawn(async move {
        loop {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if tx.send(Ok(frame)).await.is_err() {
                        break;
                    }
                }
                Some(Err(e)) => {
                    let _ = tx.send(Err(Box::new(e))).await;
                    return;
                }
                None => return,
            }
        }
        let held = tokio::time::sleep(HOLD);
        tokio::pin!(held);
        loop {
            tokio::select! {
                () = &mut held => return,
                frame = body.frame() => if !matches!(frame, Some(Ok(_))) { return },
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    StreamBody::new(stream).boxed()
}

fn bad_gateway(reason: &str) -> Response<Body> {
    let body = http_body_util::Full::new(Bytes::from(format!("proxy: {reason}\n")))
        .map_err(|never| match never {})
        .boxed();
    Response::builder()
        .status(StatusCode::BAD_GATEWAY)
        .header("content-type", "text/plain")
        .body(body)
        .expect("a valid response")
}
