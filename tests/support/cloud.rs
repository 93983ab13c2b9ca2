//! A cloud-like target for tests: a TLS reverse proxy with a private CA made at run time, in
//! front of a reference server, on a non-loopback address of a network namespace the test
//! makes (a veth pair; as root) or on loopback where namespaces cannot be made. It adds
//! latency, limits each key's request rate on each resource (a token bucket per credential,
//! method and path, as gateways limit per route) answered `429` with `Retry-After`, answers
//! every n-th request `503` with `Retry-After`, and can answer chosen
//! requests with a scripted status. None of these answers reaches the server: they are
//! answered before the target does anything, as a gateway's are. It counts the sandboxes
//! live behind it at once (created by a `201`, gone by a delete answered or a `404` for
//! them), so that a test can check an account limit was never exceeded.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

type Body = BoxBody<Bytes, hyper::Error>;

/// A private CA and a server certificate it signed for one address.
pub struct Certs {
    /// The CA certificate, PEM: what `--ca-file` trusts.
    pub ca_pem: String,
    leaf: rustls::pki_types::CertificateDer<'static>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
}

impl Certs {
    /// A fresh CA and a certificate for `ip`.
    pub fn for_ip(ip: IpAddr) -> Certs {
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec![ip.to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        Certs {
            ca_pem: ca.pem(),
            leaf: leaf.der().clone(),
            key: rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        }
    }
}

/// A network namespace with a veth pair to the test's own namespace: the test's side has
/// `10.<a>.<b>.1/30`, the namespace's side `10.<a>.<b>.2/30`. Removed when dropped.
pub struct Netns {
    name: String,
    /// The address inside the namespace.
    pub inner: IpAddr,
}

impl Netns {
    /// Makes one, or says why it cannot be made here (not root, no `ip`, no permission).
    pub fn make() -> Result<Netns, String> {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let pid = std::process::id();
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let name = format!("sandspec-{pid}-{n}");
        // Interface names are at most 15 bytes.
        let tag = (pid as usize * 7 + n) % 100_000;
        let (outer_if, inner_if) = (format!("ssa{tag}"), format!("ssb{tag}"));
        let slot = (pid as usize * 31 + n * 7) % (250 * 60);
        let (a, b) = (100 + slot / 250, slot % 250);
        let (outer, inner) = (format!("10.{a}.{b}.1"), format!("10.{a}.{b}.2"));
        let netns = Netns {
            name: name.clone(),
            inner: inner.parse().unwrap(),
        };
        let steps: Vec<Vec<String>> = [
            vec!["netns", "add", &name],
            vec![
                "link", "add", &outer_if, "type", "veth", "peer", "name", &inner_if,
            ],
            vec!["link", "set", &inner_if, "netns", &name],
            vec!["addr", "add", &format!("{outer}/30"), "dev", &outer_if],
            vec!["link", "set", &outer_if, "up"],
            vec![
                "netns",
                "exec",
                &name,
                "ip",
                "addr",
                "add",
                &format!("{inner}/30"),
                "dev",
                &inner_if,
            ],
            vec!["netns", "exec", &name, "ip", "link", "set", &inner_if, "up"],
            vec!["netns", "exec", &name, "ip", "link", "set", "lo", "up"],
        ]
        .into_iter()
        .map(|s| s.into_iter().map(str::to_owned).collect())
        .collect();
        for args in steps {
            let out = std::process::Command::new("ip")
                .args(&args)
                .output()
                .map_err(|e| format!("`ip` cannot run: {e}"))?;
            if !out.status.success() {
                // The namespace (and the veth pair, once moved) goes with the drop.
                let _ = std::process::Command::new("ip")
                    .args(["link", "del", &outer_if])
                    .output();
                return Err(format!(
                    "`ip {}` failed: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        Ok(netns)
    }

    /// A listener bound to `port` 0 of the namespace's address, made by a thread that joined
    /// the namespace: the socket belongs to it, and serves from any thread.
    pub fn listener(&self) -> std::net::TcpListener {
        let path = format!("/var/run/netns/{}", self.name);
        let inner = self.inner;
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).unwrap();
            use std::os::fd::AsRawFd as _;
            // SAFETY: setns(2) on a descriptor of a network namespace, in this thread only.
            let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
            let listener = std::net::TcpListener::bind((inner, 0)).unwrap();
            listener.set_nonblocking(true).unwrap();
            listener
        })
        .join()
        .unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// A token bucket per key and resource (credential, method, path): `burst` requests at once,
/// `per_second` more each second.
#[derive(Debug, Clone, Copy)]
pub struct RateLimit {
    pub burst: f64,
    pub per_second: f64,
}

/// A scripted answer: the first `times` requests with this method whose path starts with
/// `path` are answered `status` (with `retry_after` when given), never forwarded.
pub struct Scripted {
    pub method: &'static str,
    pub path: &'static str,
    pub times: usize,
    pub status: u16,
    pub retry_after: Option<&'static str>,
}

/// How the cloud behaves.
#[derive(Default)]
pub struct Options {
    /// Latency added before each request is handled: between this and twice this.
    pub latency: Duration,
    pub rate: Option<RateLimit>,
    /// Every n-th request is answered `503` with `Retry-After: 1`.
    pub unavailable_every: Option<u64>,
    pub scripted: Vec<Scripted>,
}

/// What the cloud saw.
#[derive(Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub forwarded: AtomicU64,
    pub throttled: AtomicU64,
    pub unavailable: AtomicU64,
    pub scripted: AtomicU64,
    live: Mutex<BTreeSet<String>>,
    pub peak: AtomicUsize,
    pub created: AtomicU64,
}

impl Stats {
    /// Sandboxes live behind the proxy now, by path.
    pub fn live(&self) -> Vec<String> {
        self.live.lock().unwrap().iter().cloned().collect()
    }
}

struct State {
    upstream: String,
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Incoming,
    >,
    options: Options,
    buckets: Mutex<BTreeMap<String, (f64, Instant)>>,
    scripted_used: Vec<AtomicUsize>,
    stats: Arc<Stats>,
}

/// A running cloud; it stops when dropped.
pub struct Cloud {
    /// `https://<address>:<port>`.
    pub url: String,
    pub ca_pem: String,
    pub stats: Arc<Stats>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Cloud {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Cloud {
    /// Serves TLS on `listener` (certificates for `ip`) and forwards to `upstream`
    /// (`http://host:port`).
    pub fn start(
        listener: std::net::TcpListener,
        ip: IpAddr,
        upstream: &str,
        options: Options,
    ) -> Cloud {
        sandspec::target::install_crypto_provider();
        let certs = Certs::for_ip(ip);
        let config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![certs.leaf.clone()], certs.key.clone_key())
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let port = listener.local_addr().unwrap().port();
        let url = match ip {
            IpAddr::V4(v4) => format!("https://{v4}:{port}"),
            IpAddr::V6(v6) => format!("https://[{v6}]:{port}"),
        };
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let stats = Arc::new(Stats::default());
        let state = Arc::new(State {
            upstream: upstream.trim_end_matches('/').to_owned(),
            client: hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http(),
            scripted_used: options
                .scripted
                .iter()
                .map(|_| AtomicUsize::new(0))
                .collect(),
            options,
            buckets: Mutex::new(BTreeMap::new()),
            stats: stats.clone(),
        });
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let (acceptor, state) = (acceptor.clone(), state.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(socket).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |req| handle(req, state.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        Cloud {
            url,
            ca_pem: certs.ca_pem,
            stats,
            task,
        }
    }
}

async fn handle(req: Request<Incoming>, st: Arc<State>) -> Result<Response<Body>, Infallible> {
    let n = st.stats.requests.fetch_add(1, Ordering::SeqCst);
    let latency = st.options.latency;
    if !latency.is_zero() {
        // Between the latency and twice it, spread by the request's number.
        let extra = latency.mul_f64(((n * 7919) % 100) as f64 / 100.0);
        tokio::time::sleep(latency + extra).await;
    }
    let method = req.method().as_str().to_owned();
    let path = req.uri().path().to_owned();
    for (i, s) in st.options.scripted.iter().enumerate() {
        if s.method == method
            && path.starts_with(s.path)
            && st.scripted_used[i].fetch_add(1, Ordering::SeqCst) < s.times
        {
            st.stats.scripted.fetch_add(1, Ordering::SeqCst);
            return Ok(problem(s.status, "scripted", s.retry_after));
        }
    }
    if let Some(rate) = st.options.rate {
        let credential = ["authorization", "x-api-key"]
            .iter()
            .find_map(|h| req.headers().get(*h))
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let key = format!("{credential} {method} {path}");
        if let Some(wait) = take_token(&st.buckets, &key, rate) {
            st.stats.throttled.fetch_add(1, Ordering::SeqCst);
            let after = wait.as_secs_f64().ceil().max(1.0).to_string();
            return Ok(problem(429, "rate_limited", Some(&after)));
        }
    }
    if let Some(every) = st.options.unavailable_every
        && n % every == every - 1
    {
        st.stats.unavailable.fetch_add(1, Ordering::SeqCst);
        return Ok(problem(503, "unavailable", Some("1")));
    }
    st.stats.forwarded.fetch_add(1, Ordering::SeqCst);
    let creates = method == "POST"
        && matches!(
            path.as_str(),
            "/v1/sandboxes" | "/v1/sessions" | "/sandboxes" | "/v2/sandboxes"
        );
    let (mut parts, body) = req.into_parts();
    let target = match parts.uri.query() {
        Some(q) => format!("{}{path}?{q}", st.upstream),
        None => format!("{}{path}", st.upstream),
    };
    parts.uri = target.parse().unwrap();
    let response = match st.client.request(Request::from_parts(parts, body)).await {
        Ok(r) => r,
        Err(e) => return Ok(problem(502, &format!("proxy: {e}"), None)),
    };
    let status = response.status().as_u16();
    if status == 404 || (method == "DELETE" && (200..300).contains(&status)) {
        st.stats.live.lock().unwrap().remove(&path);
    }
    if creates && status == 201 {
        let (parts, body) = response.into_parts();
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        let created = match path.as_str() {
            "/v1/sandboxes" => json["id"].as_str().map(|id| format!("/v1/sandboxes/{id}")),
            "/v1/sessions" if json["sandbox_ownership"] == "owned" => json["sandbox_id"]
                .as_str()
                .map(|id| format!("/v1/sandboxes/{id}")),
            "/sandboxes" | "/v2/sandboxes" => json["sandboxID"]
                .as_str()
                .map(|id| format!("/sandboxes/{id}")),
            _ => None,
        };
        if let Some(path) = created {
            let mut live = st.stats.live.lock().unwrap();
            if live.insert(path) {
                st.stats.created.fetch_add(1, Ordering::SeqCst);
            }
            st.stats.peak.fetch_max(live.len(), Ordering::SeqCst);
        }
        return Ok(Response::from_parts(
            parts,
            Full::new(bytes).map_err(|never| match never {}).boxed(),
        ));
    }
    Ok(response.map(|b| b.boxed()))
}

/// Takes a token from `key`'s bucket, or says how long until one is there.
fn take_token(
    buckets: &Mutex<BTreeMap<String, (f64, Instant)>>,
    key: &str,
    rate: RateLimit,
) -> Option<Duration> {
    let mut buckets = buckets.lock().unwrap();
    let now = Instant::now();
    let (tokens, at) = buckets.entry(key.to_owned()).or_insert((rate.burst, now));
    *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * rate.per_second).min(rate.burst);
    *at = now;
    if *tokens >= 1.0 {
        *tokens -= 1.0;
        None
    } else {
        Some(Duration::from_secs_f64((1.0 - *tokens) / rate.per_second))
    }
}

/// A problem answer of the gateway's own.
fn problem(status: u16, code: &str, retry_after: Option<&str>) -> Response<Body> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": code,
        "status": status,
        "code": code,
        "retryable": true,
    })
    .to_string();
    let mut builder = Response::builder()
        .status(status)
        .header("content-type", "application/problem+json");
    if let Some(after) = retry_after {
        builder = builder.header("retry-after", after);
    }
    builder
        .body(
            Full::new(Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        )
        .unwrap()
}

/// A loopback listener, for where namespaces cannot be made.
pub fn loopback_listener() -> std::net::TcpListener {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    listener
}
