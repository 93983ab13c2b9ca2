//! The local provider: sandboxes as directories on this machine, processes as process groups.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::config::{Config, ProviderConfig};
use crate::domain::{IdKind, LocalId, ProcessSpec, Resources};
use crate::store::Record;
use crate::stream::EventLog;

use super::files::SandboxFiles;
use super::{ProviderError, Signal};

/// What this machine lets a provider enforce, detected at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Isolation {
    /// cgroup v1 memory/cpu/pids controllers are writable: limits are enforced and read back.
    pub cgroups: bool,
    /// The cgroup v1 freezer is writable: pause freezes the cgroup (else SIGSTOP the groups).
    pub freezer: bool,
}

/// One provider.
pub struct LocalProvider {
    // Fields are private to this module's implementation.
}

impl LocalProvider {
    pub fn new(_config: &ProviderConfig, _server: &Config, _log: EventLog) -> std::io::Result<Self> {
        todo!()
    }

    pub fn name(&self) -> &str {
        todo!()
    }

    pub fn capacity(&self) -> Resources {
        todo!()
    }

    pub fn isolation(&self) -> Isolation {
        todo!()
    }

    /// Test control: every create waits this long before it completes.
    pub fn set_create_delay(&self, _delay: Duration) {
        todo!()
    }

    /// Test control: the next local ID of `kind` this provider allocates (to force the same
    /// local ID in two providers).
    pub fn set_next_local_id(&self, _kind: IdKind, _local: LocalId) {
        todo!()
    }

    /// A fresh local ID (or the one a test control queued).
    pub fn allocate_local_id(&self, _kind: IdKind) -> LocalId {
        todo!()
    }

    /// Creates the sandbox's root (a copy of the snapshot's files when `from_snapshot` is a
    /// snapshot local ID) and its resource limits. Returns the resources granted, read back
    /// from the platform. `Unsatisfiable` (and nothing left behind) when `requested` exceeds
    /// the capacity.
    pub async fn create(
        &self,
        _local: &str,
        _requested: &Resources,
        _from_snapshot: Option<&str>,
    ) -> Result<Resources, ProviderError> {
        todo!()
    }

    /// The resources the platform grants the sandbox right now.
    pub async fn read_resources(&self, _local: &str) -> Result<Resources, ProviderError> {
        todo!()
    }

    /// Ends every process of the sandbox and removes its root and limits. Idempotent.
    pub async fn destroy(&self, _local: &str) -> Result<(), ProviderError> {
        todo!()
    }

    /// Stops every process of the sandbox, keeping memory and files.
    pub async fn pause(&self, _local: &str) -> Result<(), ProviderError> {
        todo!()
    }

    /// Continues every process stopped by `pause`.
    pub async fn resume(&self, _local: &str) -> Result<(), ProviderError> {
        todo!()
    }

    /// Copies the sandbox's files into a snapshot.
    pub async fn snapshot(&self, _sandbox_local: &str, _snapshot_local: &str) -> Result<(), ProviderError> {
        todo!()
    }

    pub async fn delete_snapshot(&self, _snapshot_local: &str) -> Result<(), ProviderError> {
        todo!()
    }

    /// Starts a process described by `record` (a stored [`crate::domain::Process`], already
    /// inserted). Output goes to the process's event log; on exit (or timeout, or signal)
    /// the provider updates the record (state, exit code, signal, `ended_at`,
    /// `output_expires_at`, `due_at`) and appends the `exit` event.
    pub async fn spawn(
        &self,
        _sandbox_local: &str,
        _record: Record,
        _spec: &ProcessSpec,
        _sandbox_env: &BTreeMap<String, String>,
    ) -> Result<(), ProviderError> {
        todo!()
    }

    pub async fn write_stdin(&self, _process_id: &str, _data: &[u8], _eof: bool) -> Result<(), ProviderError> {
        todo!()
    }

    pub fn signal(&self, _process_id: &str, _signal: Signal) -> Result<(), ProviderError> {
        todo!()
    }

    /// Files of one sandbox, confined to its root.
    pub fn files(&self, _local: &str) -> Result<SandboxFiles, ProviderError> {
        todo!()
    }

    /// Whether the sandbox's root exists on disk (used by absence checks and digests).
    pub fn exists(&self, _local: &str) -> bool {
        todo!()
    }

    /// Ends every process (server shutdown).
    pub async fn shutdown(&self) {
        todo!()
    }
}
