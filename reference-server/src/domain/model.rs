//! The objects of the sandbox plane, as stored and (mostly) as sent on the wire.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

/// CPU (cores, may be fractional) and memory (MiB).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    pub cpu: f64,
    pub memory_mb: u64,
}

impl Resources {
    /// Whether `self` is at least `other` in every dimension.
    pub fn covers(&self, other: &Resources) -> bool {
        self.cpu + 1e-9 >= other.cpu && self.memory_mb >= other.memory_mb
    }
}

/// What happens when a sandbox's `expires_at` passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    #[default]
    Kill,
    Pause,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Starting,
    Running,
    Paused,
    Killed,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Killed => "killed",
        }
    }
}

/// Who created a sandbox: a principal, directly or through one of its sessions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub principal: String,
    pub session_id: Option<String>,
}

/// A sandbox. `resources` is what the provider granted, read back from the provider.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sandbox {
    /// `<provider>:<local-id>`.
    pub id: String,
    pub provider: String,
    pub state: SandboxState,
    pub template: String,
    pub requested: Resources,
    pub resources: Resources,
    pub metadata: BTreeMap<String, String>,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    pub expires_at: OffsetDateTime,
    pub on_timeout: OnTimeout,
    pub owner: Owner,
}

/// A borrowed connection to a sandbox. Closing it never ends the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Connection {
    /// `conn_...` (not provider-qualified: it lives under its sandbox's path).
    pub id: String,
    pub sandbox_id: String,
    pub principal: String,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
}

/// A point-in-time copy of a sandbox's files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// `<provider>:snp_...`.
    pub id: String,
    pub sandbox_id: String,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessState {
    Running,
    Exited,
    Killed,
}

impl ProcessState {
    pub fn as_str(self) -> &'static str {
        match self {
            ProcessState::Running => "running",
            ProcessState::Exited => "exited",
            ProcessState::Killed => "killed",
        }
    }
}

/// What a client asks to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessSpec {
    pub cmd: Vec<String>,
    pub cwd: Option<String>,
    pub env: BTreeMap<String, String>,
    pub stdin: bool,
    pub timeout_ms: Option<u64>,
    pub tag: Option<String>,
}

/// A process in a sandbox. Output and exit status stay readable after it ends, until
/// `output_expires_at`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Process {
    /// `<provider>:prc_...`.
    pub id: String,
    pub sandbox_id: String,
    pub state: ProcessState,
    pub cmd: Vec<String>,
    pub tag: Option<String>,
    pub exit_code: Option<i32>,
    /// The signal that ended it, as a name (`TERM`, `KILL`, ...).
    pub signal: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    pub started_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    pub ended_at: Option<OffsetDateTime>,
    /// When the retained output is dropped (set when the process ends).
    #[serde(with = "time::serde::rfc3339::option")]
    pub output_expires_at: Option<OffsetDateTime>,
    /// Set once retained output has been dropped: output reads are 410 from then on.
    pub output_expired: bool,
}

impl Process {
    /// A process that starts now: `Running`, with nothing of its end yet.
    pub fn running(
        id: String,
        sandbox_id: String,
        cmd: Vec<String>,
        tag: Option<String>,
        started_at: OffsetDateTime,
    ) -> Process {
        Process {
            id,
            sandbox_id,
            state: ProcessState::Running,
            cmd,
            tag,
            exit_code: None,
            signal: None,
            started_at,
            ended_at: None,
            output_expires_at: None,
            output_expired: false,
        }
    }
}

/// A token-guarded URL proxying to a port inside a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Preview {
    pub id: String,
    pub sandbox_id: String,
    pub port: u16,
    /// Secret; only ever returned inside `url` to the creator.
    pub token: String,
    #[serde(with = "time::serde::rfc3339")]
    pub expires_at: OffsetDateTime,
}
