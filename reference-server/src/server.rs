//! `run(listener, config, shutdown)`: the server, its TLS, and its background reapers.
//!
//! Tests bind `127.0.0.1:0`, read the address, and talk to it; the CLI does the same and then
//! prints the address. One accept loop serves plain HTTP and HTTPS alike; each connection
//! is served by hyper with the axum router as its service.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use crate::api::{self, AppState};
use crate::clock::now;
use crate::config::Config;
use crate::defects::Defect;
use crate::domain::{OnTimeout, Sandbox};
use crate::sandbox::Providers;
use crate::store::{self, Kind};
use crate::stream::{EventLog, process_stream};
use crate::{e2b, gateway};

/// The server's whole route table, put together from its areas: API v1 and the previews
/// (`api`), the Agents Sessions gateway with its private bridge (`gateway`) and E2B's protocol
/// (`e2b`), answering as one server (`api::shared_handling`). Starts the gateway's supervisor.
pub fn router(state: AppState) -> Router {
    let routes = api::routes()
        .merge(gateway::routes(&state))
        .merge(e2b::routes());
    // Around everything, so that any path reaches a sandbox's port when a request is routed
    // to one (E2B's proxy); every other request goes on to the routes.
    let proxy = axum::middleware::from_fn_with_state(state.clone(), e2b::port_proxy);
    api::shared_handling(routes, state).layer(proxy)
}

/// How long shutdown waits for open connections to finish their current response.
const DRAIN: Duration = Duration::from_secs(5);
/// How long a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Records each reaper pass handles per kind; the rest wait for the next pass.
const REAP_BATCH: u32 = 100;

/// A server that is bound and ready: its store is open and its providers exist.
pub struct Server {
    listener: TcpListener,
    state: AppState,
    tls: Option<TlsAcceptor>,
    /// Held while the server runs: a second server on the same data directory would share
    /// its SQLite file and sandbox tree, and the two would reap each other's sandboxes.
    _lock: DataDirLock,
}

/// An exclusive `flock(2)` on `<data_dir>/server.lock`, which names its holder. The kernel
/// releases it when the process ends, however it ends.
struct DataDirLock {
    _file: std::fs::File,
}

impl DataDirLock {
    const FILE: &'static str = "server.lock";

    fn acquire(data_dir: &Path, local_addr: SocketAddr) -> anyhow::Result<Self> {
        use std::io::{Read as _, Seek as _, Write as _};
        use std::os::fd::AsRawFd as _;
        let path = data_dir.join(Self::FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("failed to open {}", path.display()))?;
        // SAFETY: flock(2) on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(err).with_context(|| format!("failed to lock {}", path.display()));
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let holder = if holder.is_empty() {
                "another server".to_owned()
            } else {
                format!("another server ({holder})")
            };
            anyhow::bail!(
                "the data directory {} is in use by {holder}; stop it or give this server its own --data-dir",
                data_dir.display()
            );
        }
        file.set_len(0)?;
        file.rewind()?;
        write!(
            file,
            "pid {}, listening on {local_addr}",
            std::process::id()
        )?;
        file.flush()?;
        Ok(Self { _file: file })
    }
}

impl Server {
    /// Opens the store, builds the providers and the TLS configuration.
    pub async fn build(listener: TcpListener, config: Config) -> anyhow::Result<Server> {
        let local_addr = listener
            .local_addr()
            .context("failed to read the listening address")?;
        let tls = match &config.tls {
            Some(tls) => Some(load_tls(&tls.cert, &tls.key)?),
            None => None,
        };
        std::fs::create_dir_all(&config.data_dir).with_context(|| {
            format!(
                "failed to create the data directory {}",
                config.data_dir.display()
            )
        })?;
        let lock = DataDirLock::acquire(&config.data_dir, local_addr)?;
        let store = store::open(&config.database)
            .await
            .context("failed to open the store")?;
        let page_key = if config.defects.has(Defect::PageKeyPerProcess) {
            // The defect: a key of this process's own, whatever the database holds.
            rand::random()
        } else {
            store
                .shared_key("page_token", rand::random())
                .await
                .context("failed to read the page-token key")?
        };
        let log = if config.defects.has(Defect::ForeignAppendsIgnored) {
            EventLog::ignoring_foreign_appends(Arc::clone(&store))
        } else {
            EventLog::new(Arc::clone(&store))
        };
        let providers =
            Providers::new(&config, log.clone()).context("failed to set up the providers")?;
        // A server process that died without shutting down (a crash, SIGKILL) left its
        // sandbox processes running: this one, on the same data directory, ends them and
        // records their end before it accepts a request.
        for provider in providers.iter() {
            let ended = provider.end_leftovers().await;
            if ended > 0 {
                tracing::warn!(provider = %provider.name(), ended, "ended processes left by a server that did not shut down");
            }
        }
        let state = AppState::new(
            config,
            store,
            log,
            providers,
            local_addr,
            CancellationToken::new(),
            page_key,
        );
        Ok(Server {
            listener,
            state,
            tls,
            _lock: lock,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.state.local_addr
    }

    /// `http://ADDR` or `https://ADDR`.
    pub fn url(&self) -> String {
        format!("{}://{}", self.state.scheme(), self.local_addr())
    }

    /// Serves until `shutdown` resolves, then stops accepting, ends open streams, lets open
    /// connections finish, and ends every sandbox process.
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let Server {
            listener,
            state,
            tls,
            _lock,
        } = self;
        let router = router(state.clone());
        let stop = state.shutdown.clone();
        let reaper = tokio::spawn(reap_forever(state.clone()));
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            let (stream, peer) = tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: wait rather than spin.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            };
            let _ = stream.set_nodelay(true);
            let router = router.clone();
            let stop = stop.clone();
            match &tls {
                None => {
                    connections.spawn(serve_connection(stream, router, stop));
                }
                Some(acceptor) => {
                    let acceptor = acceptor.clone();
                    connections.spawn(async move {
                        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await
                        {
                            Ok(Ok(tls)) => serve_connection(tls, router, stop).await,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed")
                            }
                            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                        }
                    });
                }
            }
        }
        tracing::info!("shutting down");
        drop(listener);
        stop.cancel();
        reaper.abort();
        let drained = tokio::time::timeout(DRAIN, async {
            while connections.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            connections.abort_all();
        }
        state.providers.shutdown().await;
        Ok(())
    }
}

/// Builds the server on `listener` and serves until `shutdown` resolves.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    Server::build(listener, config).await?.serve(shutdown).await
}

async fn serve_connection<I>(io: I, router: Router, stop: CancellationToken)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        router.clone().oneshot(req.map(axum::body::Body::new))
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let result = tokio::select! {
        result = conn.as_mut() => result,
        () = stop.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

fn load_tls(cert: &Path, key: &Path) -> anyhow::Result<TlsAcceptor> {
    let certs = {
        let pem = std::fs::read(cert)
            .with_context(|| format!("failed to read the TLS certificate {}", cert.display()))?;
        rustls_pemfile::certs(&mut pem.as_slice())
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("failed to parse the TLS certificate {}", cert.display()))?
    };
    anyhow::ensure!(!certs.is_empty(), "no certificate in {}", cert.display());
    let key = {
        let pem = std::fs::read(key)
            .with_context(|| format!("failed to read the TLS key {}", key.display()))?;
        rustls_pemfile::private_key(&mut pem.as_slice())
            .with_context(|| format!("failed to parse the TLS key {}", key.display()))?
            .with_context(|| format!("no private key in {}", key.display()))?
    };
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .context("failed to set up TLS")?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .context("the TLS certificate and key do not form a usable pair")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Runs the reapers every `limits.reaper_interval_ms`, and at once when the test clock moves
/// (TC-9.12), until aborted.
async fn reap_forever(state: AppState) {
    let mut moved = crate::clock::subscribe();
    let mut tick = tokio::time::interval(Duration::from_millis(
        state.config.limits.reaper_interval_ms.max(10),
    ));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Warn once when passes start failing (an unreachable store), not on every tick.
    let mut failing = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            Ok(()) = moved.changed() => {}
        }
        match reap_once(&state).await {
            Ok(()) if failing => {
                failing = false;
                tracing::info!("reaper passes succeed again");
            }
            Ok(()) => {}
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "reaper pass failed");
            }
            Err(e) => tracing::debug!(error = %e, "reaper pass failed"),
        }
    }
}

/// One pass: expired sandboxes, expired process output, expired previews (none while the
/// test control holds expiry).
async fn reap_once(state: &AppState) -> anyhow::Result<()> {
    // A held expiry (TC-9.11) waits; what came due meanwhile goes on the first pass after.
    let Some(_pass) = state.expiry_hold.pass().await else {
        return Ok(());
    };
    if !state.config.defects.has(Defect::TtlNotEnforced) {
        for rec in state.store.due(Kind::Sandbox, now(), REAP_BATCH).await? {
            let sandbox: Sandbox = serde_json::from_value(rec.body.clone())?;
            let outcome = match sandbox.on_timeout {
                OnTimeout::Kill => api::destroy_sandbox(state, &rec).await,
                OnTimeout::Pause => api::pause_sandbox(state, rec.clone()).await.map(drop),
            };
            match outcome {
                Ok(()) => {
                    tracing::info!(sandbox = %rec.id, action = ?sandbox.on_timeout, "sandbox timed out")
                }
                Err(e) => {
                    tracing::warn!(sandbox = %rec.id, error = %e, "could not end an expired sandbox")
                }
            }
        }
    }
    if !state.config.defects.has(Defect::OutputNeverExpires) {
        for mut rec in state.store.due(Kind::Process, now(), REAP_BATCH).await? {
            if rec.state == "running" {
                continue;
            }
            if let Value::Object(body) = &mut rec.body {
                body.insert("output_expired".into(), Value::Bool(true));
            }
            rec.due_at = None;
            let id = rec.id.clone();
            match state.store.update(&rec).await {
                Ok(_) => {
                    state.store.drop_stream(&process_stream(&id)).await?;
                    state
                        .delivered
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&id);
                }
                // Changed meanwhile: the next pass sees the new version.
                Err(store::StoreError::Conflict | store::StoreError::NotFound) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    for rec in state.store.due(Kind::Preview, now(), REAP_BATCH).await? {
        state.store.delete(Kind::Preview, &rec.id).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::defects::Defects;

    /// The page-token keys of two servers opened on one database file.
    async fn page_keys(defects: &[&str]) -> ([u8; 32], [u8; 32]) {
        let dir = tempfile::tempdir().unwrap();
        let mut keys = Vec::new();
        for name in ["a", "b"] {
            let mut config = Config::for_tests(dir.path().join(name));
            config.database = crate::config::Database::Sqlite(Some(dir.path().join("one.db")));
            config.defects = Defects::parse(defects.iter().copied()).unwrap();
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let server = Server::build(listener, config).await.unwrap();
            keys.push(server.state.page_key);
        }
        (keys[0], keys[1])
    }

    #[tokio::test]
    async fn servers_on_one_database_share_the_page_token_key() {
        let (a, b) = page_keys(&[]).await;
        assert_eq!(a, b);
    }

    #[cfg(feature = "defects")]
    #[tokio::test]
    async fn page_key_per_process_makes_up_a_key_of_its_own() {
        let (a, b) = page_keys(&["page-key-per-process"]).await;
        assert_ne!(a, b);
    }
}
