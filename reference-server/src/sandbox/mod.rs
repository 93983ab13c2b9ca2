//! Providers that run real sandboxes: a working directory per sandbox, processes in their own
//! process groups (and cgroups where the machine has them), files confined to the root with
//! capability-based I/O, and the snapshots that clones start from.
//!
//! Architecture invariant: nothing here knows HTTP. The API resolves IDs and ownership
//! through the store first, then calls a provider with local IDs.

mod cgroup;
mod files;
mod isolation;
mod local;
mod process;
mod provider;

pub use files::{
    DirWatch, EntryStat, FileEntry, FileError, SandboxFiles, WatchEvent, WriteOutcome,
};
pub use isolation::{REQUIRE_ENV as REQUIRE_ISOLATION_ENV, SandboxUser};
pub use local::{Isolation, IsolationReport, LocalProvider, Usage};
pub use process::TerminalSize;
pub use provider::{ProviderError, Signal};

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::config::Config;
use crate::domain::Process;
use crate::store::{Kind, Record};
use crate::stream::EventLog;

/// The record of a process about to be spawned, as a provider takes it: owned by `owner`,
/// under its sandbox, in the process's state, with `body` (the process, with what a protocol
/// keeps beside it).
pub fn process_record(process: &Process, owner: String, body: serde_json::Value) -> Record {
    Record {
        kind: Kind::Process,
        id: process.id.clone(),
        owner,
        parent: Some(process.sandbox_id.clone()),
        state: process.state.as_str().to_owned(),
        body,
        version: 1,
        created_at: process.started_at,
        due_at: None,
    }
}

/// Every provider of this server, by name; the first is the default.
pub struct Providers {
    providers: BTreeMap<String, Arc<LocalProvider>>,
    default: String,
}

impl Providers {
    /// Builds the configured providers below `config.data_dir`.
    pub fn new(config: &Config, log: EventLog) -> std::io::Result<Self> {
        let mut providers = BTreeMap::new();
        for p in &config.providers {
            providers.insert(
                p.name.clone(),
                Arc::new(LocalProvider::new(p, config, log.clone())?),
            );
        }
        Ok(Self {
            providers,
            default: config.default_provider().to_owned(),
        })
    }

    pub fn get(&self, name: &str) -> Option<&Arc<LocalProvider>> {
        self.providers.get(name)
    }

    pub fn default_name(&self) -> &str {
        &self.default
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<LocalProvider>> {
        self.providers.values()
    }

    /// Ends every process of every provider (server shutdown).
    pub async fn shutdown(&self) {
        for p in self.providers.values() {
            p.shutdown().await;
        }
    }
}
