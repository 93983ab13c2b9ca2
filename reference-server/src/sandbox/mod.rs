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

pub use files::{EntryStat, FileEntry, FileError, SandboxFiles, WriteOutcome};
pub use isolation::REQUIRE_ENV as REQUIRE_ISOLATION_ENV;
pub use local::{Isolation, IsolationReport, LocalProvider};

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::config::Config;
use crate::stream::EventLog;

/// Why a provider refused or failed an operation.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The request exceeds what the provider can grant; nothing was created.
    #[error("resources unsatisfiable: {0}")]
    Unsatisfiable(String),
    /// The sandbox, snapshot or process is not known to this provider.
    #[error("not found")]
    NotFound,
    /// The process has already ended.
    #[error("process has exited")]
    ProcessExited,
    /// The process was started without `stdin: true`.
    #[error("process has no stdin")]
    NoStdin,
    /// The working directory of a process is not inside the sandbox.
    #[error("invalid path")]
    InvalidPath,
    /// A request field names something the sandbox does not have (a program that cannot be
    /// run, a working directory that does not exist); nothing was started.
    #[error("{detail}")]
    InvalidArgument { param: &'static str, detail: String },
    /// The operating system refused (spawn failed, disk full, ...).
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

/// Signals a client may send to a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Term,
    Kill,
    Int,
}

impl Signal {
    pub fn parse(s: &str) -> Option<Signal> {
        match s {
            "TERM" => Some(Signal::Term),
            "KILL" => Some(Signal::Kill),
            "INT" => Some(Signal::Int),
            _ => None,
        }
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
