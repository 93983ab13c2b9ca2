//! A router in front of an E2B target for SDKs that address a deployment only by E2B's host
//! names (`https://api.<domain>`, `https://<port>-<sandbox>.<domain>`), such as the 1.x
//! releases, which read no `E2B_API_URL` or `E2B_SANDBOX_URL`. The SDK is given the router as
//! its HTTP proxy: each `CONNECT` to one of those names, for whatever domain the target reports,
//! is answered with a TLS endpoint whose certificate, for that name, a CA made for this run
//! signs (the SDK trusts it through `SSL_CERT_FILE`), and
//! every request inside is sent on to the target's own URL, to envd with the routing headers
//! `E2b-Sandbox-Id` and `E2b-Sandbox-Port`, responses streamed back as they come. Nothing is
//! changed in between: the SDK's requests reach the target as it sent them.
//!
//! It listens on loopback only, for the one run; its CA's key never leaves memory.

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{StreamExt as _, TryStreamExt as _};
use http_body_util::{BodyExt as _, BodyStream, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// The domain the SDK is told (`E2B_DOMAIN`): it never resolves, the router answers for it.
pub const DOMAIN: &str = "sandspec.test";

/// Longest `CONNECT` request the router reads.
const MAX_CONNECT: usize = 8 * 1024;

/// Most host names the router makes a certificate for in one run.
const MAX_NAMES: usize = 4096;

/// A running router; stopped when dropped.
pub struct Router {
    /// `http://127.0.0.1:<port>`, the SDK's proxy.
    pub proxy_url: String,
    /// The CA's certificate (PEM), for `SSL_CERT_FILE`.
    pub ca_file: PathBuf,
    _dir: tempfile::TempDir,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Router {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Where the router sends what it receives.
#[derive(Clone)]
struct Upstream {
    base_url: String,
    client: reqwest::Client,
}

impl Router {
    /// Starts a router that sends requests to `base_url` with `client`.
    pub async fn start(base_url: &str, client: reqwest::Client) -> Result<Router, String> {
        crate::target::install_crypto_provider();
        let certificates = Arc::new(Certificates::new()?);
        let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
        let ca_file = dir.path().join("router-ca.pem");
        std::fs::write(&ca_file, certificates.ca_pem())
            .map_err(|e| format!("{}: {e}", ca_file.display()))?;
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("cannot listen: {e}"))?;
        let port = listener
            .local_addr()
            .map_err(|e| format!("cannot listen: {e}"))?
            .port();
        let upstream = Upstream {
            base_url: base_url.trim_end_matches('/').to_owned(),
            client,
        };
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let certificates = certificates.clone();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let _ = tunnel(stream, &certificates, upstream).await;
                });
            }
        });
        Ok(Router {
            proxy_url: format!("http://127.0.0.1:{port}"),
            ca_file,
            _dir: dir,
            task,
        })
    }

    /// The CA file's path.
    pub fn ca_file(&self) -> &Path {
        &self.ca_file
    }
}

/// The run's CA, and the TLS configuration of each name it has been asked for.
struct Certificates {
    ca: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    made: Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
}

fn rcgen_error(e: rcgen::Error) -> String {
    format!("cannot make the router's certificate: {e}")
}

fn named(name: &str) -> rcgen::DistinguishedName {
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(rcgen::DnType::CommonName, name);
    dn
}

impl Certificates {
    /// A CA made now; its key stays in memory.
    fn new() -> Result<Certificates, String> {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(rcgen_error)?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // Names of its own: a client that finds the issuer's name on the leaf takes the leaf for
        // self-signed.
        params.distinguished_name = named("sandspec router CA");
        let key = KeyPair::generate().map_err(rcgen_error)?;
        Ok(Certificates {
            ca: CertifiedIssuer::self_signed(params, key).map_err(rcgen_error)?,
            made: Mutex::new(HashMap::new()),
        })
    }

    fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// The TLS configuration of a leaf for `host`, made the first time it is asked for: the
    /// names an SDK builds follow the domain the target reports, which may be any.
    fn for_host(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, String> {
        let mut made = self.made.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(config) = made.get(host) {
            return Ok(config.clone());
        }
        if made.len() >= MAX_NAMES {
            return Err(format!("more than {MAX_NAMES} host names asked for"));
        }
        let key = rcgen::KeyPair::generate().map_err(rcgen_error)?;
        let mut params =
            rcgen::CertificateParams::new(vec![host.to_owned()]).map_err(rcgen_error)?;
        params.distinguished_name = named(host);
        let leaf = params.signed_by(&key, &self.ca).map_err(rcgen_error)?;
        let key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der())
            .map_err(|e| format!("the router's key: {e}"))?;
        let mut config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![leaf.der().clone()], key)
            .map_err(|e| format!("the router's TLS configuration: {e}"))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let config = Arc::new(config);
        made.insert(host.to_owned(), config.clone());
        Ok(config)
    }
}

/// One client connection: its `CONNECT`, then TLS, then HTTP/1.1 requests sent on.
async fn tunnel(
    mut stream: TcpStream,
    certificates: &Certificates,
    upstream: Upstream,
) -> Result<(), String> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut buf))
            .await
            .map_err(|_| "no CONNECT within 30 s".to_owned())?
            .map_err(|e| e.to_string())?;
        if n == 0 || head.len() + n > MAX_CONNECT {
            return Err("not a CONNECT request".into());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&head);
    let authority = text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("CONNECT "))
        .and_then(|l| l.split_whitespace().next())
        .map(str::to_owned);
    let Some(authority) = authority else {
        let _ = stream
            .write_all(b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n")
            .await;
        return Err("only CONNECT is served".into());
    };
    let host = authority.split(':').next().unwrap_or_default().to_owned();
    let Some(route) = route_of(&host) else {
        let _ = stream
            .write_all(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
            .await;
        return Err(format!(
            "{host} is neither api.<domain> nor <port>-<sandbox>.<domain>"
        ));
    };
    let tls = match certificates.for_host(&host) {
        Ok(tls) => tls,
        Err(why) => {
            let _ = stream
                .write_all(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
                .await;
            return Err(why);
        }
    };
    stream
        .write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsAcceptor::from(tls)
        .accept(stream)
        .await
        .map_err(|e| e.to_string())?;
    let service = hyper::service::service_fn(move |request| {
        let upstream = upstream.clone();
        let route = route.clone();
        async move { Ok::<_, Infallible>(forward(request, &upstream, &route).await) }
    });
    hyper::server::conn::http1::Builder::new()
        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
        .await
        .map_err(|e| e.to_string())
}

/// Where a host name of the domain leads: the control plane, or a sandbox's port.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    Api,
    Sandbox { id: String, port: String },
}

/// `api.<domain>` is the control plane and `<port>-<sandbox>.<domain>` a sandbox's port, for
/// any domain: the SDK builds sandbox host names from the domain the target reports, which
/// need not be the one it was given.
fn route_of(host: &str) -> Option<Route> {
    let (label, domain) = host.split_once('.')?;
    if domain.is_empty() || host.len() > 253 {
        return None;
    }
    if label == "api" {
        return Some(Route::Api);
    }
    let (port, id) = label.split_once('-')?;
    let ok = !port.is_empty()
        && port.bytes().all(|b| b.is_ascii_digit())
        && !id.is_empty()
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    ok.then(|| Route::Sandbox {
        id: id.to_owned(),
        port: port.to_owned(),
    })
}

type Reply = hyper::Response<BoxBody<Bytes, std::io::Error>>;

/// Sends one request on to the target and streams its response back.
async fn forward(request: hyper::Request<Incoming>, upstream: &Upstream, route: &Route) -> Reply {
    let (parts, body) = request.into_parts();
    let target = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let mut builder = upstream.client.request(
        parts.method.clone(),
        format!("{}{target}", upstream.base_url),
    );
    for (name, value) in &parts.headers {
        if !hop_by_hop(name.as_str()) {
            builder = builder.header(name, value);
        }
    }
    if let Route::Sandbox { id, port } = route {
        builder = builder
            .header("E2b-Sandbox-Id", id.as_str())
            .header("E2b-Sandbox-Port", port.as_str());
    }
    let frames = BodyStream::new(body)
        .try_filter_map(|frame| async move { Ok(frame.into_data().ok()) })
        .map_err(std::io::Error::other);
    let sent = builder
        .body(reqwest::Body::wrap_stream(frames))
        .send()
        .await;
    match sent {
        Ok(response) => {
            let mut reply = hyper::Response::builder().status(response.status());
            for (name, value) in response.headers() {
                if !hop_by_hop(name.as_str()) {
                    reply = reply.header(name, value);
                }
            }
            let stream = response
                .bytes_stream()
                .map(|chunk| chunk.map(Frame::data).map_err(std::io::Error::other));
            reply
                .body(http_body_util::BodyExt::boxed(StreamBody::new(stream)))
                .unwrap_or_else(|_| bad_gateway("the target's answer cannot be passed on"))
        }
        Err(e) => bad_gateway(&crate::target::describe_reqwest(&e)),
    }
}

fn bad_gateway(why: &str) -> Reply {
    let body = http_body_util::Full::new(Bytes::from(why.to_owned()))
        .map_err(|never| match never {})
        .boxed();
    let mut reply = hyper::Response::new(body);
    *reply.status_mut() = hyper::StatusCode::BAD_GATEWAY;
    reply
}

/// Headers that belong to one connection and are not passed on.
fn hop_by_hop(name: &str) -> bool {
    matches!(
        name.to_ascii_lowercase().as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authorization"
            | "proxy-authenticate"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_route_to_the_api_or_a_sandbox() {
        assert_eq!(route_of("api.sandspec.test"), Some(Route::Api));
        assert_eq!(
            route_of("49983-abc123.sandspec.test"),
            Some(Route::Sandbox {
                id: "abc123".into(),
                port: "49983".into()
            })
        );
        assert_eq!(route_of("api.e2b.app"), Some(Route::Api));
        assert_eq!(
            route_of("49983-abc-client1.127.0.0.1"),
            Some(Route::Sandbox {
                id: "abc-client1".into(),
                port: "49983".into()
            })
        );
        for other in [
            "sandspec.test",
            "x-abc.sandspec.test",
            "49983-.sandspec.test",
            "49983-a_b.sandspec.test",
            "apisandspec",
            "api.",
        ] {
            assert_eq!(route_of(other), None, "{other}");
        }
    }
}
