//! How the gateway runs its workers and where they find a model.

use std::path::PathBuf;
use std::time::Duration;

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

/// The binary a session's worker runs: `worker_bin`; else `sandspec-worker` beside the
/// running executable; else the running executable itself (its `worker` subcommand).
pub fn worker_binary(cfg: &GatewayConfig) -> Option<std::path::PathBuf> {
    if let Some(p) = &cfg.worker_bin {
        return Some(p.clone());
    }
    let exe = std::env::current_exe().ok()?;
    let sibling = exe.with_file_name("sandspec-worker");
    Some(if sibling.is_file() { sibling } else { exe })
}
