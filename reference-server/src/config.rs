//! Everything the server is started with. Built by [`crate::cli`] from flags or a TOML file,
//! and by tests directly.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::defects::Defects;
use crate::domain::Resources;

/// What a principal may do. A token whose principal lacks the scope for an operation gets
/// 403 `permission_denied`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// GET on sandboxes, processes, files, sessions and everything below them.
    Read,
    /// Every state-changing operation.
    Write,
}

/// A named identity with its bearer token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Principal {
    pub name: String,
    pub token: String,
    #[serde(default = "Principal::all_scopes")]
    pub scopes: Vec<Scope>,
}

impl Principal {
    pub fn all_scopes() -> Vec<Scope> {
        vec![Scope::Read, Scope::Write]
    }

    pub fn has_scope(&self, scope: Scope) -> bool {
        self.scopes.contains(&scope)
    }
}

/// One provider: a named place where sandboxes run, with the capacity of one sandbox host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    pub name: String,
    /// The largest sandbox this provider can grant.
    pub capacity: Resources,
}

/// Every number a scenario needs, advertised in `GET /v1/capabilities` under `limits`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest JSON request body, in bytes.
    pub max_body_bytes: u64,
    /// Largest file body for file writes and uploads, in bytes.
    pub max_file_bytes: u64,
    pub default_page_size: u32,
    pub max_page_size: u32,
    pub max_streams_per_principal: u32,
    pub heartbeat_interval_s: u64,
    pub max_stream_duration_s: u64,
    pub max_sandboxes_per_principal: u32,
    pub max_timeout_s: u64,
    pub default_timeout_s: u64,
    pub max_queue_depth: u32,
    /// Retained output per process; beyond it output is dropped and reported `truncated`.
    pub max_process_output_bytes: u64,
    /// How often the reapers look for expired sandboxes and retained data, in milliseconds.
    pub reaper_interval_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 1024 * 1024,
            max_file_bytes: 16 * 1024 * 1024,
            default_page_size: 20,
            max_page_size: 100,
            max_streams_per_principal: 8,
            heartbeat_interval_s: 15,
            max_stream_duration_s: 300,
            max_sandboxes_per_principal: 50,
            max_timeout_s: 24 * 3600,
            default_timeout_s: 3600,
            max_queue_depth: 16,
            max_process_output_bytes: 4 * 1024 * 1024,
            reaper_interval_ms: 250,
        }
    }
}

/// How long finished things stay readable, advertised under `retention`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Retention {
    /// Process output and exit status after the process ends.
    pub process_output_s: u64,
    /// Submission results after the submission ends.
    pub result_s: u64,
    /// Events in a stream's durable log; older cursors are 410 `cursor_expired`.
    pub events_s: u64,
    /// Idempotency records.
    pub idempotency_s: u64,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            process_output_s: 3600,
            result_s: 3600,
            events_s: 3600,
            idempotency_s: 24 * 3600,
        }
    }
}

impl Retention {
    pub fn process_output(&self) -> Duration {
        Duration::from_secs(self.process_output_s)
    }
}

/// Where durable state lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Database {
    /// SQLite in a file (the default, `<data_dir>/sandspec.db`), or in memory when `None`.
    Sqlite(Option<PathBuf>),
    /// PostgreSQL, shareable by several server processes.
    Postgres(String),
}

/// TLS material for serving HTTPS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tls {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Gateway settings. The defaults suit local runs: workers find the fixture model server
/// that the gateway starts itself over the scripts in `fixtures_dir`.
#[derive(Clone)]
pub struct GatewayConfig {
    /// The worker executable. `None`: `sandspec-worker` next to the running executable.
    pub worker_bin: Option<PathBuf>,
    /// An OpenAI-compatible base URL (ending before `/chat/completions`). `None`: the gateway
    /// starts the fixture model server on a loopback port and points workers at it.
    pub model_base_url: Option<String>,
    /// Sent as a bearer token to the model endpoint; never logged.
    pub model_api_key: Option<String>,
    /// When set, workers send this model name instead of each session's `agent.model`
    /// (a live run against a real provider, whose models the fixture names do not match).
    pub model_override: Option<String>,
    /// Scripts of the fixture model server (`<model>.json` or `<model>.toml`); by default the
    /// workspace's `fixtures/models`, so the server finds them from any working directory.
    pub fixtures_dir: PathBuf,
    /// A lease not renewed for this long expires.
    pub lease_ttl: Duration,
    /// How often a worker renews its lease and asks about cancellation.
    pub heartbeat_interval: Duration,
    /// After a cancel, how long a worker may take to stop on its own before it is killed.
    pub cancel_grace: Duration,
    /// How often the supervisor looks at workers, leases and pending cleanups.
    pub supervise_interval: Duration,
    /// Model calls per submission before it fails with `step_budget_exceeded`.
    pub max_steps: u32,
    /// Bytes of a tool's output kept in its operation and given back to the model.
    pub max_tool_output_bytes: usize,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            worker_bin: None,
            model_base_url: None,
            model_api_key: None,
            model_override: None,
            fixtures_dir: default_fixtures_dir(),
            lease_ttl: Duration::from_secs(10),
            heartbeat_interval: Duration::from_millis(1000),
            cancel_grace: Duration::from_secs(3),
            supervise_interval: Duration::from_millis(200),
            max_steps: 16,
            max_tool_output_bytes: 64 * 1024,
        }
    }
}

/// The workspace's `fixtures/models`, wherever the server is started from.
fn default_fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("fixtures"), |root| root.join("fixtures"))
        .join("models")
}

impl GatewayConfig {
    /// The defaults, with the model endpoint, its key, the worker binary and the scripts'
    /// directory taken from `SANDSPEC_MODEL_BASE_URL`, `SANDSPEC_MODEL_API_KEY`,
    /// `SANDSPEC_MODEL`, `SANDSPEC_WORKER_BIN` and `SANDSPEC_FIXTURES_DIR` when set: how an opt-in live run
    /// points the same workers at a real provider.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let defaults = Self::default();
        Self {
            model_base_url: var("SANDSPEC_MODEL_BASE_URL"),
            model_api_key: var("SANDSPEC_MODEL_API_KEY"),
            model_override: var("SANDSPEC_MODEL"),
            worker_bin: var("SANDSPEC_WORKER_BIN").map(PathBuf::from),
            fixtures_dir: var("SANDSPEC_FIXTURES_DIR")
                .map_or(defaults.fixtures_dir.clone(), PathBuf::from),
            ..defaults
        }
    }

    /// The binary a session's worker runs: `worker_bin`; else `sandspec-worker` beside the
    /// running executable; else the running executable itself (its `worker` subcommand).
    pub fn worker_binary(&self) -> Option<PathBuf> {
        if let Some(p) = &self.worker_bin {
            return Some(p.clone());
        }
        let exe = std::env::current_exe().ok()?;
        let sibling = exe.with_file_name("sandspec-worker");
        Some(if sibling.is_file() { sibling } else { exe })
    }
}

impl std::fmt::Debug for GatewayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayConfig")
            .field("worker_bin", &self.worker_bin)
            .field("model_base_url", &self.model_base_url)
            .field(
                "model_api_key",
                &self.model_api_key.as_ref().map(|_| "<redacted>"),
            )
            .field("fixtures_dir", &self.fixtures_dir)
            .field("lease_ttl", &self.lease_ttl)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("cancel_grace", &self.cancel_grace)
            .field("supervise_interval", &self.supervise_interval)
            .field("max_steps", &self.max_steps)
            .field("max_tool_output_bytes", &self.max_tool_output_bytes)
            .finish()
    }
}

/// The whole server configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub principals: Vec<Principal>,
    /// Guards the test controls. Test controls are off without it.
    pub admin_token: Option<String>,
    /// The first provider is the default: bare IDs resolve there and nowhere else.
    pub providers: Vec<ProviderConfig>,
    pub limits: Limits,
    pub retention: Retention,
    /// Sandbox roots and snapshots live below it (and the SQLite file, by default).
    pub data_dir: PathBuf,
    pub database: Database,
    pub test_controls: bool,
    pub defects: Defects,
    pub tls: Option<Tls>,
    /// How the sessions gateway runs its workers and reaches a model.
    pub gateway: GatewayConfig,
}

impl Config {
    /// A configuration for tests: loopback port 0, in-memory SQLite, two principals
    /// (`alice`, `bob`), an admin token, test controls on, and the two standard providers.
    pub fn for_tests(data_dir: PathBuf) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            principals: vec![
                Principal {
                    name: "alice".into(),
                    token: "alice-token".into(),
                    scopes: Principal::all_scopes(),
                },
                Principal {
                    name: "bob".into(),
                    token: "bob-token".into(),
                    scopes: Principal::all_scopes(),
                },
                Principal {
                    name: "reader".into(),
                    token: "reader-token".into(),
                    scopes: vec![Scope::Read],
                },
            ],
            admin_token: Some("admin-token".into()),
            providers: Self::standard_providers(),
            limits: Limits::default(),
            retention: Retention::default(),
            data_dir,
            database: Database::Sqlite(None),
            test_controls: true,
            defects: Defects::none(),
            tls: None,
            gateway: Default::default(),
        }
    }

    /// `local` (the default, larger) and `local-b` (smaller), so that provider-qualified IDs
    /// and cross-provider confusion are real.
    pub fn standard_providers() -> Vec<ProviderConfig> {
        vec![
            ProviderConfig {
                name: "local".into(),
                capacity: Resources {
                    cpu: 4.0,
                    memory_mb: 8192,
                },
            },
            ProviderConfig {
                name: "local-b".into(),
                capacity: Resources {
                    cpu: 2.0,
                    memory_mb: 2048,
                },
            },
        ]
    }

    pub fn default_provider(&self) -> &str {
        &self.providers[0].name
    }

    pub fn principal_by_token(&self, token: &str) -> Option<&Principal> {
        self.principals
            .iter()
            .find(|p| constant_time_eq(p.token.as_bytes(), token.as_bytes()))
    }

    pub fn is_admin_token(&self, token: &str) -> bool {
        self.admin_token
            .as_deref()
            .is_some_and(|t| constant_time_eq(t.as_bytes(), token.as_bytes()))
    }
}

/// Compares secrets without an early exit on the first differing byte.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
