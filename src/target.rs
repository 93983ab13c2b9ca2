//! Where scenarios run: the reference server started as a child process (`reference`), or a
//! base URL with tokens read from environment variables.
//!
//! Tokens never travel in command-line arguments: the reference target writes them into a
//! mode-0600 config file in its temporary directory; the URL target reads them from named
//! environment variables.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Once;
use std::time::Duration;

use tokio::io::AsyncBufReadExt as _;

/// Why a target could not be set up. These are harness errors (exit code 3), except where
/// the user's flags are wrong (exit code 2, [`TargetError::is_usage`]).
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("environment variable `{0}` (named by a --*-token-env flag) is not set")]
    MissingTokenEnv(String),
    #[error("cannot read CA file {path}: {source}")]
    CaFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("CA file {0} holds no usable PEM certificate")]
    BadCa(PathBuf),
    #[error("invalid target URL `{0}`")]
    BadUrl(String),
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    #[error("cannot start the reference server ({binary}): {reason}")]
    Spawn { binary: String, reason: String },
    #[error("{url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{url}: capabilities are not usable: {reason}")]
    BadCapabilities { url: String, reason: String },
}

impl TargetError {
    /// A mistake in the flags rather than a broken target.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            TargetError::MissingTokenEnv(_)
                | TargetError::BadUrl(_)
                | TargetError::CaFile { .. }
                | TargetError::BadCa(_)
        )
    }
}

/// One provider as advertised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provider {
    pub name: String,
    pub default: bool,
}

/// What the target says it supports (`GET /v1/capabilities`).
#[derive(Debug, Clone, Default)]
pub struct Capabilities {
    pub features: Vec<String>,
    pub providers: Vec<Provider>,
    pub limits: BTreeMap<String, i64>,
    pub retention: BTreeMap<String, i64>,
    pub server_name: Option<String>,
    pub server_version: Option<String>,
    /// The directory a profile without `/v1/capabilities` confines files to, as scenarios
    /// see it (`{{base_dir}}`): the launched service's, or `--base-dir`.
    pub base_dir: Option<String>,
    /// The document as received, for the report.
    pub raw: serde_json::Value,
}

impl Capabilities {
    /// Reads the capability document; a body that is not the documented shape is an error.
    pub fn from_json(raw: serde_json::Value) -> Result<Self, String> {
        let features = raw
            .get("features")
            .and_then(|f| f.as_array())
            .ok_or("`features` is missing or not an array")?
            .iter()
            .map(|f| {
                f.as_str()
                    .map(str::to_owned)
                    .ok_or("a feature is not a string")
            })
            .collect::<Result<Vec<_>, _>>()?;
        let providers = raw
            .get("providers")
            .and_then(|p| p.as_array())
            .ok_or("`providers` is missing or not an array")?
            .iter()
            .map(|p| {
                let name = p
                    .get("name")
                    .and_then(|n| n.as_str())
                    .ok_or("a provider has no name")?;
                Ok(Provider {
                    name: name.to_owned(),
                    default: p.get("default").and_then(|d| d.as_bool()).unwrap_or(false),
                })
            })
            .collect::<Result<Vec<_>, &str>>()?;
        if providers.is_empty() {
            return Err("no providers advertised".into());
        }
        let numbers = |key: &str| -> BTreeMap<String, i64> {
            raw.get(key)
                .and_then(|m| m.as_object())
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, v)| v.as_i64().map(|n| (k.clone(), n)))
                        .collect()
                })
                .unwrap_or_default()
        };
        let server = raw.get("server");
        Ok(Capabilities {
            features,
            providers,
            limits: numbers("limits"),
            retention: numbers("retention"),
            server_name: server
                .and_then(|s| s.get("name"))
                .and_then(|n| n.as_str())
                .map(str::to_owned),
            server_version: server
                .and_then(|s| s.get("version"))
                .and_then(|n| n.as_str())
                .map(str::to_owned),
            base_dir: None,
            raw,
        })
    }

    /// Applies command-line overrides: features to treat as advertised, and features to
    /// treat as missing (their scenarios are skipped). Only feature names are accepted.
    pub fn override_features(&mut self, assume: &[String], drop: &[String]) -> Result<(), String> {
        use crate::scenario::FEATURES;
        for name in assume.iter().chain(drop) {
            if !FEATURES.contains(&name.as_str()) {
                return Err(format!(
                    "unknown capability `{name}` (known: {})",
                    FEATURES.join(", ")
                ));
            }
        }
        for name in assume {
            if !self.features.contains(name) {
                self.features.push(name.clone());
            }
        }
        self.features.retain(|f| !drop.contains(f));
        Ok(())
    }

    pub fn has(&self, capability: &str) -> bool {
        match capability {
            "two_providers" => self.providers.len() >= 2,
            "isolation" => ["user", "mount", "pid", "network"]
                .iter()
                .all(|ns| self.isolation_lists("namespaces", ns)),
            "memory_limit" => self.isolation_lists("enforced", "memory"),
            feature => self.features.iter().any(|f| f == feature),
        }
    }

    /// Whether the advertised `isolation.<key>` array holds `item`.
    fn isolation_lists(&self, key: &str, item: &str) -> bool {
        self.raw
            .get("isolation")
            .and_then(|i| i.get(key))
            .and_then(|v| v.as_array())
            .is_some_and(|a| a.iter().any(|v| v.as_str() == Some(item)))
    }

    pub fn default_provider(&self) -> &str {
        self.providers
            .iter()
            .find(|p| p.default)
            .unwrap_or(&self.providers[0])
            .name
            .as_str()
    }

    /// A provider other than the default one, if there is one.
    pub fn other_provider(&self) -> Option<&str> {
        let default = self.default_provider();
        self.providers
            .iter()
            .map(|p| p.name.as_str())
            .find(|n| *n != default)
    }
}

/// Bearer tokens for the principals a scenario can act as.
#[derive(Clone)]
pub struct Tokens {
    pub owner: String,
    pub other: String,
    pub admin: Option<String>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokens { .. }")
    }
}

/// A target ready to run scenarios against.
pub struct Target {
    /// Base URL without a trailing slash, e.g. `http://127.0.0.1:4321`.
    pub base_url: String,
    pub client: reqwest::Client,
    pub tokens: Tokens,
    pub capabilities: Capabilities,
    /// The protocol profile the run speaks: where credentials go, and whether capabilities
    /// were read from the target or only told (`--api`).
    pub api: crate::profile::Api,
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
    /// A service the runner launched for another profile (`--launch`); stopped on drop.
    service: Option<tokio::sync::Mutex<crate::agent_sandbox::LaunchedService>>,
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

/// The default of `--request-timeout`.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a scenario that requires a peer is skipped when the target has none.
pub const NO_PEER: &str = "the target has no peer: no second server process of the same deployment (--peer-url; the reference server has one only on PostgreSQL)";

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("base_url", &self.base_url)
            .finish_non_exhaustive()
    }
}

/// Installs the ring crypto provider for rustls once per process (reqwest is built with
/// `rustls-no-provider`).
pub fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Another part of the process may have installed one already; either is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Builds an HTTP client: TLS verification on; with `ca`, only that root is trusted.
pub fn build_client(ca: Option<&reqwest::Certificate>) -> Result<reqwest::Client, TargetError> {
    install_crypto_provider();
    let mut builder = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("sandspec/", env!("CARGO_PKG_VERSION")));
    if let Some(ca) = ca {
        builder = builder.tls_certs_only([ca.clone()]);
    }
    builder
        .build()
        .map_err(|e| TargetError::Client(e.to_string()))
}

impl Target {
    /// A target at `base_url` with nothing the runner started, no peer, no wait budget and
    /// the default request timeout; the constructors below add what they have.
    fn new(
        base_url: String,
        client: reqwest::Client,
        tokens: Tokens,
        capabilities: Capabilities,
        api: crate::profile::Api,
        ca: Option<reqwest::Certificate>,
    ) -> Target {
        Target {
            canary: crate::evidence::new_canary(),
            base_url,
            client,
            tokens,
            capabilities,
            api,
            envd_domain: None,
            ca,
            peer: None,
            wait_budget: None,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            mcp: None,
            _server: None,
            launcher: None,
            control: None,
            service: None,
            fresh_databases: tokio::sync::OnceCell::new(),
        }
    }

    /// A fresh client with no shared connection pool (for independent checks).
    pub fn fresh_client(&self) -> Result<reqwest::Client, TargetError> {
        build_client(self.ca.as_ref())
    }

    /// A `/v1` target at `base_url`, with tokens from the named environment variables.
    pub async fn connect_url(
        base_url: &str,
        owner_env: &str,
        other_env: &str,
        admin_env: Option<&str>,
        ca_file: Option<&Path>,
    ) -> Result<Target, TargetError> {
        Target::connect_url_for(
            crate::profile::Api::V1,
            base_url,
            owner_env,
            other_env,
            admin_env,
            ca_file,
        )
        .await
    }

    /// A target at `base_url` speaking `api`, with tokens from the named environment
    /// variables. An E2B target has no capabilities endpoint: it supports what the run is
    /// told (`--assume-capability`) and nothing else.
    pub async fn connect_url_for(
        api: crate::profile::Api,
        base_url: &str,
        owner_env: &str,
        other_env: &str,
        admin_env: Option<&str>,
        ca_file: Option<&Path>,
    ) -> Result<Target, TargetError> {
        let read = |name: &str| {
            std::env::var(name).map_err(|_| TargetError::MissingTokenEnv(name.to_owned()))
        };
        let tokens = Tokens {
            owner: read(owner_env)?,
            other: read(other_env)?,
            admin: admin_env.map(read).transpose()?,
        };
        let ca = match ca_file {
            Some(path) => {
                let pem = std::fs::read(path).map_err(|source| TargetError::CaFile {
                    path: path.to_owned(),
                    source,
                })?;
                Some(
                    reqwest::Certificate::from_pem(&pem)
                        .map_err(|_| TargetError::BadCa(path.to_owned()))?,
                )
            }
            None => None,
        };
        if api.has_capabilities_endpoint() {
            return Target::connect_with_tokens(base_url, tokens, ca).await;
        }
        let base_url = checked_base_url(base_url)?;
        let client = build_client(ca.as_ref())?;
        Ok(Target::new(
            base_url,
            client,
            tokens,
            Capabilities::default(),
            api,
            ca,
        ))
    }

    /// A target the runner launched itself (`--launch`), speaking `api`; the service is
    /// stopped when the target is dropped. Scenarios see its base directory as
    /// `{{base_dir}}`. Its `GET /capabilities` document, when it serves one, is kept for the
    /// report (and its `server_version`), never read for features.
    pub async fn launched(
        api: crate::profile::Api,
        service: crate::agent_sandbox::LaunchedService,
    ) -> Result<Target, TargetError> {
        let client = build_client(None)?;
        let (name, value) = api.credential(&service.tokens.owner);
        let document = match client
            .get(format!("{}/capabilities", service.url))
            .header(name, value)
            .timeout(DEFAULT_REQUEST_TIMEOUT)
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => r.json::<serde_json::Value>().await.ok(),
            _ => None,
        };
        let capabilities = Capabilities {
            base_dir: Some(service.base_dir().display().to_string()),
            server_version: document
                .as_ref()
                .and_then(|d| d.get("server_version"))
                .and_then(|v| v.as_str())
                .map(str::to_owned),
            raw: document.unwrap_or_default(),
            ..Capabilities::default()
        };
        let (base_url, tokens) = (service.url.clone(), service.tokens.clone());
        Ok(Target {
            service: Some(tokio::sync::Mutex::new(service)),
            ..Target::new(base_url, client, tokens, capabilities, api, None)
        })
    }

    /// Whether the runner started the target and so can restart it (`restart` steps).
    pub fn can_restart(&self) -> bool {
        self.service.is_some()
    }

    /// SIGKILL to the launched service (`kill_server` on a `--launch` target).
    pub async fn kill_service(&self) -> Result<(), String> {
        let service = self.service.as_ref().ok_or(NO_SERVER_CONTROL)?;
        service.lock().await.kill().await.map_err(|e| e.to_string())
    }

    /// Starts the launched service again after a kill (`restart_server` on a `--launch`
    /// target); `Ok(false)` when it is running.
    pub async fn start_service(&self) -> Result<bool, String> {
        let service = self.service.as_ref().ok_or(NO_SERVER_CONTROL)?;
        service
            .lock()
            .await
            .start_again()
            .await
            .map_err(|e| e.to_string())
    }

    /// Stops the launched service and starts it again on the same address, with the same
    /// principals and directories; answers once it is healthy.
    pub async fn restart(&self) -> Result<(), String> {
        let service = self
            .service
            .as_ref()
            .ok_or("the runner did not start the target, so it cannot restart it")?;
        service
            .lock()
            .await
            .restart()
            .await
            .map_err(|e| e.to_string())
    }

    /// The same target speaking `api`. For a profile without a capabilities endpoint what
    /// was read from `/v1/capabilities` is forgotten, so that the reference is judged as any
    /// target of that profile is.
    pub fn speaking(mut self, api: crate::profile::Api) -> Target {
        if !api.has_capabilities_endpoint() {
            // In the MCP profile the reference server is the control plane, a fixture and not
            // what is judged: its test controls stay usable (a create held in flight).
            let keep: Vec<String> = match api {
                crate::profile::Api::Mcp => self
                    .capabilities
                    .features
                    .iter()
                    .filter(|f| *f == "test_controls")
                    .cloned()
                    .collect(),
                _ => Vec::new(),
            };
            self.capabilities = Capabilities {
                features: keep,
                ..Capabilities::default()
            };
        }
        self.api = api;
        self
    }

    /// A target at `base_url` with the given tokens, trusting only `ca` when given.
    pub async fn connect_with_tokens(
        base_url: &str,
        tokens: Tokens,
        ca: Option<reqwest::Certificate>,
    ) -> Result<Target, TargetError> {
        let base_url = checked_base_url(base_url)?;
        let client = build_client(ca.as_ref())?;
        let capabilities = fetch_capabilities(&client, &base_url, &tokens.owner).await?;
        Ok(Target::new(
            base_url,
            client,
            tokens,
            capabilities,
            crate::profile::Api::V1,
            ca,
        ))
    }

    /// Adds a peer: `peer_url` serves the same deployment and takes the same tokens. Its
    /// capabilities must be readable, as the target's are.
    pub async fn with_peer_url(mut self, peer_url: &str) -> Result<Target, TargetError> {
        let base_url = checked_base_url(peer_url)?;
        fetch_capabilities(&self.client, &base_url, &self.tokens.owner).await?;
        self.peer = Some(Peer {
            base_url,
            _server: None,
        });
        Ok(self)
    }

    /// Starts the reference server (`binary serve ...`) and connects to it. On PostgreSQL
    /// a second server process is started on the same database, with the same principals,
    /// as the target's peer.
    pub async fn start_reference(options: &ReferenceOptions) -> Result<Target, TargetError> {
        let server = ReferenceServer::start(options).await?;
        let tokens = server.tokens.clone();
        let client = build_client(None)?;
        let base_url = server.url.clone();
        let capabilities = fetch_capabilities(&client, &base_url, &tokens.owner).await?;
        let peer = match &options.database_url {
            Some(_) => {
                let second = ReferenceServer::start_with_tokens(options, tokens.clone()).await?;
                fetch_capabilities(&client, &second.url, &tokens.owner).await?;
                Some(Peer {
                    base_url: second.url.clone(),
                    _server: Some(second),
                })
            }
            None => None,
        };
        Ok(Target {
            peer,
            _server: Some(server),
            launcher: Some(options.clone()),
            ..Target::new(
                base_url,
                client,
                tokens,
                capabilities,
                crate::profile::Api::V1,
                None,
            )
        })
    }
}

impl Target {
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
                .map_err(|e| spawn_error(launcher, format!("starting PostgreSQL: {e}")))?
                .map(std::sync::Arc::new)
                .map_err(|e| spawn_error(launcher, format!("starting PostgreSQL: {e}")))
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
        let capabilities = fetch_capabilities(&client, &primary.url, &self.tokens.owner).await?;
        let base_url = primary.url.clone();
        let mut servers = vec![primary];
        let mut peer = None;
        if options.database_url.is_some() {
            let second = ReferenceServer::start_with_tokens(&options, self.tokens.clone()).await?;
            fetch_capabilities(&client, &second.url, &self.tokens.owner).await?;
            peer = Some(Peer {
                base_url: second.url.clone(),
                _server: None,
            });
            servers.push(second);
        }
        let mut target = Target {
            canary: self.canary.clone(),
            envd_domain: self.envd_domain.clone(),
            mcp: self.mcp.clone(),
            peer,
            wait_budget: self.wait_budget,
            request_timeout: self.request_timeout,
            control: Some(Control {
                servers: tokio::sync::Mutex::new(servers),
                cluster,
            }),
            ..Target::new(
                base_url,
                client,
                self.tokens.clone(),
                capabilities,
                crate::profile::Api::V1,
                None,
            )
        }
        .speaking(self.api);
        // What the run was told to assume or drop holds here too.
        if self.api.has_capabilities_endpoint() {
            target
                .capabilities
                .features
                .clone_from(&self.capabilities.features);
        } else {
            target.capabilities = self.capabilities.clone();
        }
        Ok(target)
    }
}

/// The processes of a deployment the runner started for one fault-injecting scenario, which
/// its fault steps act on.
pub struct Control {
    /// The primary server process, then the peer's (on PostgreSQL). Dropped before the
    /// cluster, so the servers stop while their database is still there.
    servers: tokio::sync::Mutex<Vec<ReferenceServer>>,
    /// The private PostgreSQL cluster holding the deployment's database (`database_control`).
    cluster: Option<std::sync::Arc<pg_cluster::PgCluster>>,
}

impl Control {
    /// Whether the deployment's database is one the runner can stop and start.
    pub fn has_database(&self) -> bool {
        self.cluster.is_some()
    }

    /// SIGKILL to the primary server process, or to the peer's.
    pub async fn kill_server(&self, peer: bool) -> Result<(), String> {
        let mut servers = self.servers.lock().await;
        let server = servers
            .get_mut(usize::from(peer))
            .ok_or("the deployment has no peer process")?;
        server.kill().await
    }

    /// Starts the primary server process (or the peer's) again on its data directory,
    /// database and port; `Ok(false)` when it is running (nothing to restart).
    pub async fn restart_server(&self, peer: bool) -> Result<bool, String> {
        let mut servers = self.servers.lock().await;
        let server = servers
            .get_mut(usize::from(peer))
            .ok_or("the deployment has no peer process")?;
        server.restart().await
    }

    /// Stops the database server abruptly (as an outage does); its data stays.
    pub async fn stop_database(&self) -> Result<(), String> {
        self.on_cluster(|c| c.stop()).await
    }

    /// Starts the database server again on the same port, and waits until it accepts
    /// connections; nothing happens when it is running.
    pub async fn start_database(&self) -> Result<(), String> {
        self.on_cluster(|c| c.start()).await
    }

    async fn on_cluster(&self, f: fn(&pg_cluster::PgCluster)) -> Result<(), String> {
        let cluster = self
            .cluster
            .clone()
            .ok_or("the runner controls no database of this deployment")?;
        // `pg_ctl` blocks, and panics with its error output when it fails.
        tokio::task::spawn_blocking(move || f(&cluster))
            .await
            .map_err(|e| match e.try_into_panic() {
                Ok(panic) => panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_else(|| "pg_ctl failed".into()),
                Err(e) => e.to_string(),
            })
    }
}

/// Why a scenario that requires `server_control` is skipped on a target the runner did not
/// start.
pub const NO_SERVER_CONTROL: &str = "the runner does not control the target's server processes: it kills and restarts only a server it starts itself (the reference server, or a service it launched with --launch), never a --target URL";

/// Why a scenario that requires `database_control` is skipped.
pub const NO_DATABASE_CONTROL: &str = "the runner controls no database of the target: it stops and starts only a private PostgreSQL cluster it starts for a reference server on PostgreSQL (--database-url); SQLite has no database server to stop";

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

/// An `http`/`https` URL without credentials, without its trailing slash.
fn checked_base_url(base_url: &str) -> Result<String, TargetError> {
    let url =
        reqwest::Url::parse(base_url).map_err(|_| TargetError::BadUrl(base_url.to_owned()))?;
    if !matches!(url.scheme(), "http" | "https")
        || !url.username().is_empty()
        || url.password().is_some()
    {
        return Err(TargetError::BadUrl(base_url.to_owned()));
    }
    Ok(base_url.trim_end_matches('/').to_owned())
}

/// `GET /v1/capabilities` as the owner.
async fn fetch_capabilities(
    client: &reqwest::Client,
    base_url: &str,
    token: &str,
) -> Result<Capabilities, TargetError> {
    let url = format!("{base_url}/v1/capabilities");
    let response = client
        .get(&url)
        .bearer_auth(token)
        .timeout(Duration::from_secs(15))
        .send()
        .await
        .map_err(|e| TargetError::Unreachable {
            url: url.clone(),
            reason: describe_reqwest(&e),
        })?;
    let status = response.status();
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let body = response
        .bytes()
        .await
        .map_err(|e| TargetError::Unreachable {
            url: url.clone(),
            reason: describe_reqwest(&e),
        })?;
    if !status.is_success() {
        return Err(TargetError::BadCapabilities {
            url,
            reason: format!("status {status}"),
        });
    }
    let json: serde_json::Value =
        serde_json::from_slice(&body).map_err(|_| TargetError::BadCapabilities {
            url: url.clone(),
            reason: format!("body is not JSON (content-type `{content_type}`)"),
        })?;
    Capabilities::from_json(json).map_err(|reason| TargetError::BadCapabilities { url, reason })
}

/// A one-line description of a transport error, with its innermost cause.
pub fn describe_reqwest(e: &reqwest::Error) -> String {
    let mut source: &dyn std::error::Error = e;
    while let Some(next) = source.source() {
        source = next;
    }
    let kind = if e.is_connect() {
        "cannot connect"
    } else if e.is_timeout() {
        "timed out"
    } else {
        "request failed"
    };
    format!("{kind}: {source}")
}

/// How to start the reference server.
#[derive(Debug, Clone, Default)]
pub struct ReferenceOptions {
    /// The `sandspec` binary (`std::env::current_exe()` when running as it).
    pub binary: PathBuf,
    pub defects: Vec<String>,
    pub database_url: Option<String>,
    /// Extra flags for `sandspec serve` (e.g. `--tls-cert`).
    pub extra_args: Vec<String>,
    /// Start with `sandspec serve`'s own limits and retentions (what a deployment runs)
    /// instead of [`REFERENCE_FAST_SETTINGS`].
    pub serve_defaults: bool,
}

/// Limits and retention the runner gives the reference server it starts, so that heartbeat,
/// stream-duration and quota scenarios finish in seconds. Scenarios read the advertised
/// values, so they hold for any setting. The retentions are a minute: the retention scenarios
/// move the clock of a deployment of their own past them (TC-9.12), and a scenario that reads
/// what it made a few seconds earlier (output across a server's restart, a session's log from
/// its start, two digests around a session) must not see it expire under load.
pub const REFERENCE_FAST_SETTINGS: &[&str] = &[
    "--retention",
    "process_output_s=60",
    "--limit",
    "heartbeat_interval_s=1",
    "--limit",
    "max_stream_duration_s=6",
    "--limit",
    "max_sandboxes_per_principal=20",
    "--retention",
    "result_s=60",
    "--retention",
    "events_s=60",
];

/// A running reference server child process; stopped when dropped.
pub struct ReferenceServer {
    pub url: String,
    pub tokens: Tokens,
    /// Stopped on drop: SIGTERM first, so that the server ends its sandboxes' processes, then
    /// SIGKILL (`kill_on_drop`) if it has not exited after a grace period. `None` after a
    /// `kill_server` step, until `restart_server`.
    child: Option<tokio::process::Child>,
    /// How it was started, to start it again the same way after a kill.
    options: ReferenceOptions,
    /// Holds the config file and the SQLite data (kept across a restart); removed on drop.
    dir: tempfile::TempDir,
}

impl ReferenceServer {
    pub async fn start(options: &ReferenceOptions) -> Result<ReferenceServer, TargetError> {
        let tokens = Tokens {
            owner: random_token(),
            other: random_token(),
            admin: Some(random_token()),
        };
        Self::start_with_tokens(options, tokens).await
    }

    /// Starts a server whose principals have these tokens, with a data directory of its own
    /// (a second process on the same database takes the first one's tokens).
    pub async fn start_with_tokens(
        options: &ReferenceOptions,
        tokens: Tokens,
    ) -> Result<ReferenceServer, TargetError> {
        let dir = tempfile::tempdir()
            .map_err(|e| spawn_error(options, format!("temporary directory: {e}")))?;
        write_private(&dir.path().join("serve.toml"), &config_toml(&tokens))
            .map_err(|e| spawn_error(options, format!("config file: {e}")))?;
        let (child, url) = spawn_serve(options, dir.path(), "127.0.0.1:0").await?;
        Ok(ReferenceServer {
            url,
            tokens,
            child: Some(child),
            options: options.clone(),
            dir,
        })
    }

    /// Sends SIGKILL to the server process (nothing of it runs its shutdown: its sandbox
    /// processes stay as a crash leaves them) and waits until it is gone.
    pub async fn kill(&mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Err("the server is not running".into());
        };
        child
            .start_kill()
            .map_err(|e| format!("cannot send SIGKILL: {e}"))?;
        child
            .wait()
            .await
            .map_err(|e| format!("cannot wait for the killed server: {e}"))?;
        Ok(())
    }

    /// Starts the server again on the same data directory, database, tokens and port (its
    /// URL does not change). A server that is running is left alone: `Ok(false)`.
    pub async fn restart(&mut self) -> Result<bool, String> {
        if self.child.is_some() {
            return Ok(false);
        }
        let listen = self
            .url
            .strip_prefix("http://")
            .or_else(|| self.url.strip_prefix("https://"))
            .unwrap_or(&self.url)
            .to_owned();
        // The port was just freed; another process could take it in between, so a few tries.
        let mut last = String::new();
        for _ in 0..5 {
            match spawn_serve(&self.options, self.dir.path(), &listen).await {
                Ok((child, url)) if url == self.url => {
                    self.child = Some(child);
                    return Ok(true);
                }
                Ok((_, url)) => return Err(format!("restarted on {url}, not {}", self.url)),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(last)
    }

    /// Whether the server process is running (it was not killed, or was restarted since).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

fn spawn_error(options: &ReferenceOptions, reason: String) -> TargetError {
    TargetError::Spawn {
        binary: options.binary.display().to_string(),
        reason,
    }
}

/// Starts `sandspec serve` on `listen` with the config file and data directory in `dir`,
/// and reads the URL it listens on.
async fn spawn_serve(
    options: &ReferenceOptions,
    dir: &Path,
    listen: &str,
) -> Result<(tokio::process::Child, String), TargetError> {
    let spawn_err = |reason: String| spawn_error(options, reason);
    let mut cmd = tokio::process::Command::new(&options.binary);
    cmd.arg("serve")
        .arg("--listen")
        .arg(listen)
        .arg("--config")
        .arg(dir.join("serve.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--enable-test-controls");
    for defect in &options.defects {
        cmd.arg("--defect").arg(defect);
    }
    if let Some(url) = &options.database_url {
        cmd.arg("--database-url").arg(url);
    }
    if !options.serve_defaults {
        cmd.args(REFERENCE_FAST_SETTINGS);
    }
    cmd.args(&options.extra_args);
    // Its own process group: a Ctrl-C at the terminal reaches the runner, which finishes
    // the running scenarios against a server that is still there.
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|e| spawn_err(e.to_string()))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    // Keep the server's log available for failure messages without letting the pipe fill.
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let log_writer = log.clone();
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let mut log = log_writer.lock().expect("log lock");
            if log.len() < 200 {
                log.push(line);
            }
        }
    });
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await;
    let url = match first {
        Ok(Ok(Some(line))) => match line.strip_prefix("listening on ") {
            Some(url) => url.trim().to_owned(),
            None => {
                return Err(spawn_err(format!(
                    "unexpected first line on stdout: {line:?}"
                )));
            }
        },
        Ok(Ok(None)) | Ok(Err(_)) => {
            let _ = tokio::time::timeout(Duration::from_secs(2), child.wait()).await;
            let tail = log.lock().expect("log lock").join("\n");
            return Err(spawn_err(format!(
                "exited before listening; its log:\n{tail}"
            )));
        }
        Err(_) => return Err(spawn_err("no `listening on` line within 30 s".into())),
    };
    // Drain the rest of stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, url))
}

/// The `--config` file: principals and the admin token. The principal names are fixed
/// (`alice` owns, `bob` is the other one); the tokens are fresh for every run.
fn config_toml(tokens: &Tokens) -> String {
    let admin = tokens.admin.as_deref().unwrap_or_default();
    format!(
        "admin_token = \"{admin}\"\n\n[[principals]]\nname = \"alice\"\ntoken = \"{}\"\n\n[[principals]]\nname = \"bob\"\ntoken = \"{}\"\n",
        tokens.owner, tokens.other
    )
}

/// Writes a file readable only by its owner.
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    file.write_all(text.as_bytes())
}

/// 32 random bytes, hex-encoded, with a recognisable prefix for the sanitizer.
pub fn random_token() -> String {
    use rand::Rng as _;
    let bytes: [u8; 32] = rand::rng().random();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("sst_{hex}")
}

impl Drop for ReferenceServer {
    fn drop(&mut self) {
        const GRACE: std::time::Duration = std::time::Duration::from_secs(10);
        let Some(child) = &mut self.child else { return };
        let Some(pid) = child.id() else { return };
        let Ok(pid) = i32::try_from(pid) else { return };
        // SAFETY: kill(2) on our own child's pid, which has not been reaped (we still hold it).
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            return;
        }
        let deadline = std::time::Instant::now() + GRACE;
        while std::time::Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // Still running: `kill_on_drop` sends SIGKILL when the child handle drops.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_parse_and_answer() {
        let caps = Capabilities::from_json(serde_json::json!({
            "api_version": "v1",
            "server": {"name": "sandspec-reference", "version": "0.1.0"},
            "providers": [{"name": "local", "default": true}, {"name": "local-b", "default": false}],
            "features": ["pause", "snapshots"],
            "limits": {"heartbeat_interval_s": 15},
            "retention": {"process_output_s": 3600}
        }))
        .unwrap();
        assert!(caps.has("pause") && caps.has("two_providers") && !caps.has("previews"));
        assert_eq!(caps.default_provider(), "local");
        assert_eq!(caps.other_provider(), Some("local-b"));
        assert_eq!(caps.limits["heartbeat_interval_s"], 15);
        assert!(Capabilities::from_json(serde_json::json!({"features": []})).is_err());
        let mut caps = caps;
        caps.override_features(&["previews".into()], &["pause".into()])
            .unwrap();
        assert!(caps.has("previews") && !caps.has("pause") && caps.has("snapshots"));
        assert!(
            caps.override_features(&["teleport".into()], &[])
                .unwrap_err()
                .contains("unknown capability")
        );
    }

    #[test]
    fn tokens_are_fresh_and_config_holds_them() {
        let a = random_token();
        assert_ne!(a, random_token());
        assert_eq!(a.len(), 4 + 64);
        let tokens = Tokens {
            owner: "o".into(),
            other: "b".into(),
            admin: Some("a".into()),
        };
        let text = config_toml(&tokens);
        assert!(text.contains("token = \"o\"") && text.contains("admin_token = \"a\""));
        assert_eq!(format!("{tokens:?}"), "Tokens { .. }");
    }

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

    #[test]
    fn private_files_are_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        write_private(&path, "secret").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            assert_eq!(
                std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
                0o600
            );
        }
    }
}
