//! Where scenarios run: the reference server started as a child process, a base URL with
//! tokens read from environment variables, or a service the runner launches itself. A
//! [`TargetSpec`] says which; [`Target::open`] starts or connects to it, with the run's
//! profile deciding what is learned of it and how.
//!
//! Tokens never travel in command-line arguments: the reference target writes them into a
//! mode-0600 config file in its temporary directory; the URL target reads them from named
//! environment variables; a launched service gets them in its environment.

mod capabilities;
mod conn;
mod error;
mod read;
mod reference;
mod service;
mod spec;
mod throttle;
mod usage;

use std::time::Duration;

pub use capabilities::{CAPABILITIES, Capabilities, FEATURES, Provider, fetch_capabilities};
pub use conn::{
    Conn, DEFAULT_REQUEST_TIMEOUT, Tokens, build_client, checked_base_url, describe_reqwest,
    install_crypto_provider, random_token, read_ca,
};
pub use error::TargetError;
pub use read::{
    BoundedBody, CappedReader, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_EVENT_BYTES, Framing,
    MAX_OUTPUT_LINE_BYTES, Meter, OutputLine, ReadError, ReadLimits, TooLarge, Tripped, Unit,
    next_output_line, next_short_output_line, parse_size, read_body,
};
pub use reference::{
    Control, NO_DATABASE_CONTROL, NO_SERVER_CONTROL, REFERENCE_FAST_SETTINGS, ReferenceOptions,
    ReferenceServer,
};
pub use service::Service;
use spec::Opening;
pub use spec::{CheckedSpec, Endpoint, TargetSpec, UrlEndpoint};
pub use throttle::{
    DEFAULT_WAIT, MAX_ATTEMPTS, MIN_WAIT, OWN_REQUEST_PATIENCE, Throttle, send_patiently,
    throttle_of,
};
pub use usage::{AccountLimits, Consumption, Throttles, Usage};

use crate::profile::{Api, CapabilitySource, Profile};

/// A target ready to run scenarios against.
pub struct Target {
    /// Base URL without a trailing slash, e.g. `http://127.0.0.1:4321`.
    pub base_url: String,
    pub client: reqwest::Client,
    pub tokens: Tokens,
    pub capabilities: Capabilities,
    /// The protocol profile the run speaks (`--api`): where credentials go, how
    /// capabilities were learned, what a scenario's requests create and how a run is swept.
    pub api: Api,
    /// How the runner came to this target, as the report names it: `reference`, `url` or
    /// `launched`.
    pub kind: &'static str,
    /// E2B's envd domain (`--envd-domain`): envd is then reached at
    /// `https://49983-<sandboxID>.<domain>`; without it, on the base URL with the routing
    /// headers.
    pub envd_domain: Option<String>,
    /// The run's canary secret: sent with every request (header `X-Sandspec-Canary`) and in
    /// request bodies through `{{canary}}`. Evidence in which it survives is never written.
    pub canary: String,
    /// Extra root certificates, so that fresh clients (absence checks) trust the same CA.
    ca: Option<reqwest::Certificate>,
    /// A second endpoint of the same deployment (another server process on the same
    /// database), for scenarios that `require: [peer]`.
    pub peer: Option<Peer>,
    /// The run's wait budget (`--max-wait`): a scenario whose advertised waits exceed it is
    /// skipped. `None` waits everything out.
    pub wait_budget: Option<Duration>,
    /// How long a plain request may wait for its response headers, and then for each read of
    /// its body (`--request-timeout`); streams are bounded by their steps' deadlines.
    pub request_timeout: Duration,
    /// The caps on what the target sends (`--max-body-bytes`, `--max-event-bytes`).
    pub limits: ReadLimits,
    /// What the run consumed of the target's account; shared with every deployment started
    /// for one of its scenarios.
    pub usage: std::sync::Arc<Usage>,
    /// The sandbox MCP server the MCP profile drives, and its tool map (`--api mcp`).
    pub mcp: Option<crate::mcp::McpServer>,
    /// The reference server, when this target started it; killed on drop.
    _server: Option<ReferenceServer>,
    /// How this target was started, when the runner started it: a scenario that injects
    /// faults (`requires: [server_control]` or `[database_control]`) gets a deployment of
    /// its own started the same way, so that its faults reach no other scenario.
    pub launcher: Option<ReferenceOptions>,
    /// The server processes (and the database) the runner may kill, restart, stop and start:
    /// present only on a deployment started for one fault-injecting scenario.
    pub control: Option<Control>,
    /// A service the runner launched (`--launch`); stopped on drop.
    service: Option<tokio::sync::Mutex<Box<dyn Service>>>,
    /// On PostgreSQL, the private cluster in which each deployment started for an exclusive
    /// or clock-moving scenario gets a database of its own ([`OwnDatabase::Fresh`]):
    /// launched on first use, stopped when this target is dropped, after those deployments.
    fresh_databases: tokio::sync::OnceCell<std::sync::Arc<pg_cluster::PgCluster>>,
}

/// The database of a deployment the runner starts for one scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnDatabase {
    /// The database the target was started on (SQLite: the deployment's own data directory).
    Same,
    /// A fresh database in a private cluster that the deployments of one run share, so that
    /// nothing in it is anyone else's: what a digest covers, what the reapers expire.
    Fresh,
    /// A private cluster of its own, which the scenario may stop and start
    /// (`database_control`).
    Private,
}

/// A second base URL serving the same deployment as the target, with the same principals'
/// tokens: another server process on the same database.
pub struct Peer {
    /// Base URL without a trailing slash.
    pub base_url: String,
    /// The second reference server process, when the runner started it; stopped on drop.
    _server: Option<ReferenceServer>,
}

/// Why a scenario that requires a peer is skipped when the target has none.
pub const NO_PEER: &str = "the target has no peer: no second server process of the same deployment (--peer-url; the reference server has one only on PostgreSQL)";

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("base_url", &self.base_url)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// Starts or connects to the target a checked spec names, speaking its profile: the live
    /// guard for a URL, the reference server or the launched service started, the
    /// capabilities learned as the profile learns them, the peer, the MCP server to drive,
    /// and the run's overrides.
    pub async fn open(checked: CheckedSpec) -> Result<Target, TargetError> {
        let spec = checked;
        let live = matches!(&spec.opening, Opening::Url(url) if url.live);
        let mut target = match spec.opening {
            Opening::Launch(launch) => Target::launched(spec.api, launch.await?)?,
            Opening::Url(url) => Target::connect_url(spec.api, &url, spec.limits).await?,
            Opening::Reference(options) => {
                Target::start_reference(&options).await?.speaking(spec.api)
            }
        };
        if let Some(mcp) = spec.mcp {
            target = target.driving(mcp, live)?;
        }
        target.request_timeout = spec.request_timeout;
        target.limits = spec.limits;
        target.envd_domain.clone_from(&spec.envd_domain);
        target
            .capabilities
            .override_features(&spec.assume, &spec.drop)
            .map_err(TargetError::Usage)?;
        target.wait_budget = spec.wait_budget;
        Ok(target)
    }

    /// A target at `base_url` with nothing the runner started, no peer, no wait budget and
    /// the default request timeout; the constructors below add what they have.
    fn new(
        base_url: String,
        client: reqwest::Client,
        tokens: Tokens,
        capabilities: Capabilities,
        ca: Option<reqwest::Certificate>,
    ) -> Target {
        Target {
            canary: crate::evidence::new_canary(),
            base_url,
            client,
            tokens,
            capabilities,
            api: Api::V1,
            kind: "url",
            envd_domain: None,
            ca,
            peer: None,
            wait_budget: None,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            limits: ReadLimits::default(),
            usage: std::sync::Arc::default(),
            mcp: None,
            _server: None,
            launcher: None,
            control: None,
            service: None,
            fresh_databases: tokio::sync::OnceCell::new(),
        }
    }

    /// The same target, driving the MCP server `mcp`. A server over HTTP stays on the control
    /// plane it was started with, so this target no longer starts deployments of its own for
    /// single scenarios (`launcher`): an exclusive scenario runs alone after the others. Its
    /// URL is behind the live guard, as a target's is (`live` for `--live`).
    pub fn driving(
        mut self,
        mcp: crate::mcp::McpServer,
        live: bool,
    ) -> Result<Target, TargetError> {
        if let crate::mcp::McpTransport::Http(http) = &mcp.transport {
            crate::live::guard(&http.url, live).map_err(|e| TargetError::Usage(e.to_string()))?;
        }
        if !mcp.follows_deployment() {
            self.launcher = None;
        }
        self.mcp = Some(mcp);
        Ok(self)
    }

    /// The profile the target is spoken to in.
    pub fn profile(&self) -> &'static dyn Profile {
        self.api.profile()
    }

    /// What the profile's sweeps need to reach the target.
    pub fn conn(&self) -> Conn<'_> {
        Conn {
            base_url: &self.base_url,
            client: &self.client,
            request_timeout: self.request_timeout,
            limits: self.limits,
            usage: &self.usage,
        }
    }

    /// A fresh client with no shared connection pool (for independent checks).
    pub fn fresh_client(&self) -> Result<reqwest::Client, TargetError> {
        build_client(self.ca.as_ref())
    }

    /// A deployment at a URL, behind the live guard, with tokens from the named environment
    /// variables; its capabilities read as the profile reads them.
    async fn connect_url(
        api: Api,
        url: &UrlEndpoint,
        limits: ReadLimits,
    ) -> Result<Target, TargetError> {
        crate::live::guard(&url.url, url.live).map_err(|e| TargetError::Usage(e.to_string()))?;
        let read = |name: &str| {
            std::env::var(name).map_err(|_| TargetError::MissingTokenEnv(name.to_owned()))
        };
        let tokens = Tokens {
            owner: read(&url.owner_token_env)?,
            other: read(&url.other_token_env)?,
            admin: url.admin_token_env.as_deref().map(read).transpose()?,
            unscoped: url.unscoped_token_env.as_deref().map(read).transpose()?,
        };
        let ca = url.ca_file.as_deref().map(read_ca).transpose()?;
        let mut target = match api.profile().capability_source() {
            CapabilitySource::Advertised => {
                Target::connect_with(&url.url, tokens, ca, limits).await?
            }
            CapabilitySource::Told => {
                let base_url = checked_base_url(&url.url)?;
                let client = build_client(ca.as_ref())?;
                Target::new(base_url, client, tokens, Capabilities::default(), ca)
            }
        };
        if let Some(peer) = &url.peer_url {
            crate::live::guard(peer, url.live).map_err(|e| TargetError::Usage(e.to_string()))?;
            target = target.with_peer_url(peer).await?;
        }
        target.capabilities.base_dir.clone_from(&url.base_dir);
        target.api = api;
        Ok(target)
    }

    /// A service the runner launched, speaking `api`; stopped when the target is dropped.
    fn launched(api: Api, launched: crate::profile::Launched) -> Result<Target, TargetError> {
        let client = build_client(None)?;
        Ok(Target {
            api,
            kind: "launched",
            service: Some(tokio::sync::Mutex::new(launched.service)),
            ..Target::new(
                launched.url,
                client,
                launched.tokens,
                launched.capabilities,
                None,
            )
        })
    }

    /// Whether the runner started the target and so can restart it (`restart` steps).
    pub fn can_restart(&self) -> bool {
        self.service.is_some()
    }

    /// SIGKILL to the launched service (`kill_server` on a `--launch` target).
    pub async fn kill_service(&self) -> Result<(), String> {
        let service = self.service.as_ref().ok_or(NO_SERVER_CONTROL)?;
        service.lock().await.kill().await
    }

    /// Starts the launched service again after a kill (`restart_server` on a `--launch`
    /// target); `Ok(false)` when it is running.
    pub async fn start_service(&self) -> Result<bool, String> {
        let service = self.service.as_ref().ok_or(NO_SERVER_CONTROL)?;
        service.lock().await.start_again().await
    }

    /// Stops the launched service and starts it again on the same address, with the same
    /// principals and directories; answers once it is healthy.
    pub async fn restart(&self) -> Result<(), String> {
        let service = self
            .service
            .as_ref()
            .ok_or("the runner did not start the target, so it cannot restart it")?;
        service.lock().await.restart().await
    }

    /// The same target speaking `api`: what the reference server advertised at
    /// `/v1/capabilities` is kept as far as the profile keeps it, so that the reference is
    /// judged as any target of that profile is.
    pub fn speaking(mut self, api: Api) -> Target {
        self.capabilities = api.profile().reference_capabilities(self.capabilities);
        self.api = api;
        self
    }

    /// A `/v1` target at `base_url` with the given tokens, trusting only `ca` when given.
    pub async fn connect_with_tokens(
        base_url: &str,
        tokens: Tokens,
        ca: Option<reqwest::Certificate>,
    ) -> Result<Target, TargetError> {
        Target::connect_with(base_url, tokens, ca, ReadLimits::default()).await
    }

    /// [`Target::connect_with_tokens`], reading what the target sends under `limits`.
    async fn connect_with(
        base_url: &str,
        tokens: Tokens,
        ca: Option<reqwest::Certificate>,
        limits: ReadLimits,
    ) -> Result<Target, TargetError> {
        let base_url = checked_base_url(base_url)?;
        let client = build_client(ca.as_ref())?;
        let usage = std::sync::Arc::new(Usage::default());
        let capabilities =
            fetch_capabilities(&client, &base_url, &tokens.owner, limits, &usage).await?;
        Ok(Target {
            limits,
            usage,
            ..Target::new(base_url, client, tokens, capabilities, ca)
        })
    }

    /// Adds a peer: `peer_url` serves the same deployment and takes the same tokens. Its
    /// capabilities must be readable, as the target's are.
    pub async fn with_peer_url(mut self, peer_url: &str) -> Result<Target, TargetError> {
        let base_url = checked_base_url(peer_url)?;
        fetch_capabilities(
            &self.client,
            &base_url,
            &self.tokens.owner,
            self.limits,
            &self.usage,
        )
        .await?;
        self.peer = Some(Peer {
            base_url,
            _server: None,
        });
        Ok(self)
    }

    /// Starts the reference server (`binary serve ...`) and connects to it, speaking `/v1`.
    /// On PostgreSQL a second server process is started on the same database, with the same
    /// principals, as the target's peer.
    pub async fn start_reference(options: &ReferenceOptions) -> Result<Target, TargetError> {
        let server = ReferenceServer::start(options).await?;
        let tokens = server.tokens.clone();
        let client = build_client(None)?;
        let base_url = server.url.clone();
        let limits = ReadLimits::default();
        let usage = std::sync::Arc::new(Usage::default());
        let capabilities =
            fetch_capabilities(&client, &base_url, &tokens.owner, limits, &usage).await?;
        let peer = match &options.database_url {
            Some(_) => {
                let second = ReferenceServer::start_with_tokens(options, tokens.clone()).await?;
                fetch_capabilities(&client, &second.url, &tokens.owner, limits, &usage).await?;
                Some(Peer {
                    base_url: second.url.clone(),
                    _server: Some(second),
                })
            }
            None => None,
        };
        Ok(Target {
            kind: "reference",
            usage,
            peer,
            _server: Some(server),
            launcher: Some(options.clone()),
            ..Target::new(base_url, client, tokens, capabilities, None)
        })
    }

    /// Starts a deployment of its own for one scenario, the way this target was started
    /// (`launcher`), with the same tokens and canary: its primary server process, on
    /// PostgreSQL a peer on the same database, on the `database` chosen. `None` when the
    /// runner did not start this target.
    pub async fn start_controlled(
        &self,
        database: OwnDatabase,
    ) -> Option<Result<Target, TargetError>> {
        let launcher = self.launcher.as_ref()?;
        Some(self.start_controlled_from(launcher, database).await)
    }

    async fn start_controlled_from(
        &self,
        launcher: &ReferenceOptions,
        database: OwnDatabase,
    ) -> Result<Target, TargetError> {
        let mut options = launcher.clone();
        let launch = || async {
            tokio::task::spawn_blocking(pg_cluster::PgCluster::launch)
                .await
                .map_err(|e| reference::spawn_error(launcher, format!("starting PostgreSQL: {e}")))?
                .map(std::sync::Arc::new)
                .map_err(|e| reference::spawn_error(launcher, format!("starting PostgreSQL: {e}")))
        };
        let cluster = match database {
            OwnDatabase::Same => None,
            OwnDatabase::Fresh => {
                let shared = self.fresh_databases.get_or_try_init(launch).await?;
                options.database_url = Some(shared.fresh_database().await);
                None
            }
            OwnDatabase::Private => {
                let cluster = launch().await?;
                options.database_url = Some(cluster.create_database("sandspec").await);
                Some(cluster)
            }
        };
        let primary = ReferenceServer::start_with_tokens(&options, self.tokens.clone()).await?;
        let client = build_client(None)?;
        let capabilities = fetch_capabilities(
            &client,
            &primary.url,
            &self.tokens.owner,
            self.limits,
            &self.usage,
        )
        .await?;
        let base_url = primary.url.clone();
        let mut servers = vec![primary];
        let mut peer = None;
        if options.database_url.is_some() {
            let second = ReferenceServer::start_with_tokens(&options, self.tokens.clone()).await?;
            fetch_capabilities(
                &client,
                &second.url,
                &self.tokens.owner,
                self.limits,
                &self.usage,
            )
            .await?;
            peer = Some(Peer {
                base_url: second.url.clone(),
                _server: None,
            });
            servers.push(second);
        }
        let mut target = Target {
            kind: self.kind,
            canary: self.canary.clone(),
            envd_domain: self.envd_domain.clone(),
            mcp: self.mcp.clone(),
            peer,
            wait_budget: self.wait_budget,
            request_timeout: self.request_timeout,
            limits: self.limits,
            usage: self.usage.clone(),
            control: Some(Control {
                servers: tokio::sync::Mutex::new(servers),
                cluster,
            }),
            ..Target::new(base_url, client, self.tokens.clone(), capabilities, None)
        }
        .speaking(self.api);
        // What the run was told to assume or drop holds here too.
        match self.profile().capability_source() {
            CapabilitySource::Advertised => target
                .capabilities
                .features
                .clone_from(&self.capabilities.features),
            CapabilitySource::Told => target.capabilities = self.capabilities.clone(),
        }
        Ok(target)
    }
}

impl Target {
    /// Whether a scenario requiring `server_control` can run here (on this target, or on a
    /// deployment of its own started like it).
    pub fn server_controllable(&self) -> bool {
        self.control.is_some() || self.launcher.is_some() || self.service.is_some()
    }

    /// Whether `advance_clock` moves this target's clock (TC-9.12) rather than waiting: on a
    /// deployment started for the one scenario, which advertises `test_clock`, with the
    /// admin token. A clock shared with other scenarios is never moved.
    pub fn clock_movable(&self) -> bool {
        self.control.is_some() && self.capabilities.has("test_clock") && self.tokens.admin.is_some()
    }

    /// Whether an `exclusive` scenario runs on a deployment of its own, started like this
    /// target, where nothing else is in flight: so it need not wait for the others, nor they
    /// for it. Only for a target the runner started from a launcher (the reference server),
    /// and on PostgreSQL only where it can start a private cluster for that deployment; on a
    /// URL target, on a launched service (which the runner cannot duplicate) and on a
    /// PostgreSQL database without the programs for a cluster of its own, it runs alone after
    /// the others.
    pub fn isolates_exclusive(&self) -> bool {
        self.control.is_none()
            && !self.can_restart()
            && self
                .launcher
                .as_ref()
                .is_some_and(|l| l.database_url.is_none() || pg_cluster::PgCluster::installed())
    }

    /// Whether a scenario that moves the clock gets a movable clock: here, or on a
    /// deployment of its own that the runner starts like this one.
    pub fn clock_movable_here_or_own(&self) -> bool {
        self.clock_movable()
            || (self.launcher.is_some()
                && self.capabilities.has("test_clock")
                && self.tokens.admin.is_some())
    }

    /// Whether a scenario requiring `database_control` can run here.
    pub fn database_controllable(&self) -> bool {
        self.control.as_ref().is_some_and(Control::has_database)
            || self
                .launcher
                .as_ref()
                .is_some_and(|l| l.database_url.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serves one canned HTTP response to every connection.
    async fn canned(response: &'static str) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut buf = vec![0u8; 4096];
                let _ = socket.read(&mut buf).await;
                let _ = socket.write_all(response.as_bytes()).await;
                let _ = socket.shutdown().await;
            }
        });
        url
    }

    fn tokens() -> Tokens {
        Tokens {
            owner: "o".into(),
            other: "b".into(),
            admin: None,
            unscoped: None,
        }
    }

    #[tokio::test]
    async fn html_instead_of_json_is_a_clear_error() {
        let url = canned("HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 13\r\nConnection: close\r\n\r\n<html></html>").await;
        let err = Target::connect_with_tokens(&url, tokens(), None)
            .await
            .unwrap_err();
        assert!(matches!(err, TargetError::BadCapabilities { .. }) && !err.is_usage());
        let msg = err.to_string();
        assert!(
            msg.starts_with(&url) && msg.contains("not JSON (content-type `text/html`)"),
            "{msg}"
        );
        assert!(!msg.contains('\n'), "one line: {msg}");
    }

    #[tokio::test]
    async fn unreachable_and_bad_urls() {
        // Bind and drop a listener to get a port nothing listens on.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}");
        let err = Target::connect_with_tokens(&url, tokens(), None)
            .await
            .unwrap_err();
        assert!(
            matches!(err, TargetError::Unreachable { .. }) && !err.is_usage(),
            "{err}"
        );
        assert!(err.to_string().contains("cannot connect"), "{err}");
        for bad in ["ftp://x", "not a url", "http://user:pw@127.0.0.1:1"] {
            let err = Target::connect_with_tokens(bad, tokens(), None)
                .await
                .unwrap_err();
            assert!(err.is_usage(), "{bad}: {err}");
        }
    }

    #[tokio::test]
    async fn a_peer_is_checked_like_the_target() {
        let caps = r#"{"providers":[{"name":"local","default":true}],"features":["sessions"]}"#;
        let response: &'static str = Box::leak(
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{caps}",
                caps.len()
            )
            .into_boxed_str(),
        );
        let url = canned(response).await;
        let peer = canned(response).await;
        let target = Target::connect_with_tokens(&url, tokens(), None)
            .await
            .unwrap();
        assert!(target.peer.is_none());
        let target = target.with_peer_url(&format!("{peer}/")).await.unwrap();
        assert_eq!(target.peer.as_ref().unwrap().base_url, peer);
        let err = match target.with_peer_url("http://user:pw@127.0.0.1:1").await {
            Err(e) => e,
            Ok(_) => panic!("a peer URL with credentials is refused"),
        };
        assert!(err.is_usage(), "{err}");
        let html = canned("HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi").await;
        let target = Target::connect_with_tokens(&url, tokens(), None)
            .await
            .unwrap();
        match target.with_peer_url(&html).await {
            Err(TargetError::BadCapabilities { .. }) => {}
            Err(e) => panic!("unexpected error: {e}"),
            Ok(_) => panic!("a peer without usable capabilities is refused"),
        }
    }
}
