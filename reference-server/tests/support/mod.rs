//! Shared helpers of the API integration tests: a server per test on a loopback port with
//! its own data directory and in-memory SQLite, a typed client, and a raw SSE reader.

use std::path::PathBuf;
use std::sync::Once;
use std::time::Duration;

use reference_server::config::Config;
use reqwest::{Method, RequestBuilder, Response, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

pub const ALICE: &str = "alice-token";
pub const BOB: &str = "bob-token";
pub const READER: &str = "reader-token";
pub const ADMIN: &str = "admin-token";

/// A running server. Dropping it shuts the server down (ending every sandbox process) and
/// removes its data directory.
pub struct TestApp {
    pub base: String,
    pub addr: std::net::SocketAddr,
    pub data_dir: PathBuf,
    pub client: reqwest::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

fn install_crypto() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// A self-signed certificate for `localhost` and `127.0.0.1`, made at run time and written
/// with its key under `dir`: the server's TLS settings, and the root a client trusts.
pub fn self_signed_tls(
    dir: &std::path::Path,
) -> (reference_server::config::Tls, reqwest::Certificate) {
    let cert =
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .unwrap();
    let cert_path = dir.join("cert.pem");
    let key_path = dir.join("key.pem");
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let root = reqwest::Certificate::from_pem(cert.cert.pem().as_bytes()).unwrap();
    let tls = reference_server::config::Tls {
        cert: cert_path,
        key: key_path,
    };
    (tls, root)
}

/// A configuration for one test: `Config::for_tests` with quick reapers.
pub fn test_config(data_dir: PathBuf) -> Config {
    let mut config = Config::for_tests(data_dir);
    config.limits.reaper_interval_ms = 50;
    config
}

/// Starts a server with `tweak` applied to the test configuration.
pub async fn spawn_app(tweak: impl FnOnce(&mut Config)) -> TestApp {
    spawn_app_with_client(tweak, reqwest::Client::builder()).await
}

pub async fn spawn_app_with_client(
    tweak: impl FnOnce(&mut Config),
    client: reqwest::ClientBuilder,
) -> TestApp {
    install_crypto();
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let mut config = test_config(data_dir.clone());
    tweak(&mut config);
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    // The server gets its own runtime so that it shuts down cleanly (ending its sandbox
    // processes) when the test's runtime is already gone or the test panicked.
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let server = reference_server::server::Server::build(listener, config)
                .await
                .expect("build server");
            addr_tx.send(server.local_addr()).expect("send addr");
            server
                .serve(async move {
                    let _ = stop_rx.await;
                })
                .await
                .expect("serve");
        });
    });
    let addr = tokio::task::spawn_blocking(move || addr_rx.recv_timeout(Duration::from_secs(30)))
        .await
        .expect("join")
        .expect("server did not start");
    TestApp {
        base: format!("{scheme}://{addr}"),
        addr,
        data_dir,
        client: client
            .timeout(Duration::from_secs(30))
            .build()
            .expect("client"),
        stop: Some(stop_tx),
        thread: Some(thread),
        _dir: dir,
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A response read whole: status, headers and body.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: reqwest::header::HeaderMap,
    pub body: bytes::Bytes,
}

impl Reply {
    pub async fn read(response: Response) -> Reply {
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.bytes().await.expect("body");
        Reply {
            status,
            headers,
            body,
        }
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Asserts a problem response with `status` and `code`, and returns its body.
    #[track_caller]
    pub fn problem(&self, status: u16, code: &str) -> Value {
        assert_eq!(
            self.status.as_u16(),
            status,
            "body: {}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let body = self.json();
        assert_eq!(body["code"], code, "body: {body}");
        assert_eq!(body["status"], status);
        assert_eq!(
            body["type"],
            format!("https://sandspec.dev/problems/{code}")
        );
        let rid = self.header("x-request-id").expect("x-request-id");
        assert_eq!(body["request_id"], rid);
        body
    }

    #[track_caller]
    pub fn ok(&self, status: u16) -> Value {
        assert_eq!(
            self.status.as_u16(),
            status,
            "body: {}",
            String::from_utf8_lossy(&self.body)
        );
        if self.body.is_empty() {
            Value::Null
        } else {
            self.json()
        }
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub fn request(&self, token: Option<&str>, method: Method, path: &str) -> RequestBuilder {
        let rb = self.client.request(method, self.url(path));
        match token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    pub async fn send(&self, rb: RequestBuilder) -> Reply {
        Reply::read(rb.send().await.expect("request")).await
    }

    pub async fn get(&self, token: &str, path: &str) -> Reply {
        self.send(self.request(Some(token), Method::GET, path))
            .await
    }

    pub async fn delete(&self, token: &str, path: &str) -> Reply {
        self.send(self.request(Some(token), Method::DELETE, path))
            .await
    }

    pub async fn post(&self, token: &str, path: &str, body: Value) -> Reply {
        self.send(self.request(Some(token), Method::POST, path).json(&body))
            .await
    }

    pub async fn post_idem(&self, token: &str, path: &str, key: &str, body: Value) -> Reply {
        self.send(
            self.request(Some(token), Method::POST, path)
                .header("Idempotency-Key", key)
                .json(&body),
        )
        .await
    }

    /// Creates a sandbox as `token` and returns its body.
    pub async fn create_sandbox(&self, token: &str, body: Value) -> Value {
        self.post(token, "/v1/sandboxes", body).await.ok(201)
    }

    /// Starts `cmd` in `sandbox` and returns the process body.
    pub async fn start(&self, token: &str, sandbox: &str, cmd: &[&str]) -> Value {
        self.post(
            token,
            &format!("/v1/sandboxes/{sandbox}/processes"),
            json!({ "cmd": cmd }),
        )
        .await
        .ok(201)
    }

    /// Polls the process until it is no longer running.
    pub async fn wait_process(&self, token: &str, pid: &str) -> Value {
        poll(|| async {
            let p = self
                .get(token, &format!("/v1/processes/{pid}"))
                .await
                .ok(200);
            (p["state"] != "running").then_some(p)
        })
        .await
    }

    pub async fn digest(&self) -> String {
        let body = self.get(ADMIN, "/v1/test/digest").await.ok(200);
        body["digest"].as_str().expect("digest").to_owned()
    }

    /// The directory of sandbox `id` (`provider:local`) on disk.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        let (provider, local) = id.split_once(':').expect("qualified id");
        self.data_dir
            .join("providers")
            .join(provider)
            .join("sandboxes")
            .join(local)
    }
}

/// The string `field` of every element of the array `list`, in order.
#[allow(dead_code, reason = "not every test binary reads lists")]
pub fn strings<'a>(list: &'a Value, field: &str) -> Vec<&'a str> {
    list.as_array()
        .unwrap_or_else(|| panic!("not an array: {list}"))
        .iter()
        .map(|e| {
            e[field]
                .as_str()
                .unwrap_or_else(|| panic!("no string {field} in {e}"))
        })
        .collect()
}

/// Polls `f` every 25 ms until it yields a value, for at most 15 s.
pub async fn poll<T, F, Fut>(mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not reached in time"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// One SSE frame as read off the wire.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    /// Every line of the frame, without the trailing blank line.
    pub lines: Vec<String>,
}

impl Frame {
    pub fn field(&self, name: &str) -> Option<&str> {
        self.lines
            .iter()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(": ")))
    }

    pub fn is_comment(&self) -> bool {
        self.lines.iter().all(|l| l.starts_with(':'))
    }

    pub fn data(&self) -> Value {
        serde_json::from_str(self.field("data").expect("data line")).expect("data is JSON")
    }
}

/// An SSE response read over a plain TCP connection, bytes exactly as sent.
pub struct RawSse {
    stream: TcpStream,
    pub status: u16,
    pub head: String,
    /// Decoded body bytes not yet split into frames.
    body: Vec<u8>,
    /// Raw bytes not yet de-chunked.
    raw: Vec<u8>,
    pub eof: bool,
}

impl RawSse {
    /// Sends a GET with `headers` and reads the response head.
    pub async fn open(app: &TestApp, path: &str, token: &str, headers: &[(&str, &str)]) -> RawSse {
        let mut stream = TcpStream::connect(app.addr).await.expect("connect");
        let mut req = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n",
            app.addr
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        stream.write_all(req.as_bytes()).await.expect("write");
        let mut raw = Vec::new();
        let head_end = loop {
            if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                break i;
            }
            let mut buf = [0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
                .await
                .expect("head in time")
                .expect("read");
            assert!(n > 0, "connection closed before the head");
            raw.extend_from_slice(&buf[..n]);
        };
        let head = String::from_utf8_lossy(&raw[..head_end]).into_owned();
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("status");
        let rest = raw[head_end + 4..].to_vec();
        RawSse {
            stream,
            status,
            head,
            body: Vec::new(),
            raw: rest,
            eof: false,
        }
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    }

    /// Moves complete chunks from `raw` to `body`.
    fn dechunk(&mut self) {
        loop {
            let Some(line_end) = self.raw.windows(2).position(|w| w == b"\r\n") else {
                return;
            };
            let size_line = String::from_utf8_lossy(&self.raw[..line_end]).into_owned();
            let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16)
                .expect("chunk size");
            if size == 0 {
                self.eof = true;
                self.raw.clear();
                return;
            }
            let start = line_end + 2;
            if self.raw.len() < start + size + 2 {
                return;
            }
            self.body.extend_from_slice(&self.raw[start..start + size]);
            self.raw.drain(..start + size + 2);
        }
    }

    /// The next frame (event or comment), or `None` at the end of the stream.
    pub async fn next(&mut self, within: Duration) -> Option<Frame> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            self.dechunk();
            if let Some(i) = self.body.windows(2).position(|w| w == b"\n\n") {
                let text = String::from_utf8(self.body[..i].to_vec()).expect("utf-8 frame");
                self.body.drain(..i + 2);
                return Some(Frame {
                    lines: text.lines().map(str::to_owned).collect(),
                });
            }
            if self.eof {
                assert!(
                    self.body.is_empty(),
                    "trailing bytes after the last frame: {:?}",
                    String::from_utf8_lossy(&self.body)
                );
                return None;
            }
            let mut buf = [0u8; 4096];
            let n = tokio::time::timeout_at(deadline, self.stream.read(&mut buf))
                .await
                .expect("frame in time")
                .expect("read");
            if n == 0 {
                self.eof = true;
                continue;
            }
            self.raw.extend_from_slice(&buf[..n]);
        }
    }

    /// Every remaining event frame (comments skipped) up to the end of the stream.
    pub async fn events_until_end(&mut self, within: Duration) -> Vec<Frame> {
        let mut out = Vec::new();
        while let Some(f) = self.next(within).await {
            if !f.is_comment() {
                out.push(f);
            }
        }
        out
    }
}
