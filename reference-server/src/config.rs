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
    pub gateway: crate::gateway::GatewayConfig,
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
