//! What a protocol profile is to the runner: the one trait ([`Profile`]) that the command
//! line, the target and the engine call, and the vocabulary it answers in. A profile owns what
//! makes its protocol: the clause document its scenarios cite, its catalog folder, where a
//! principal's credential goes, how a target's capabilities are learned, how the target is
//! set up (a launched service, an MCP server to drive), how a scenario's creations are
//! recognised and how a run's leftovers are listed and swept.

use std::time::Duration;

use futures_util::future::BoxFuture;
use serde_json::Value;

use super::api::Api;
use super::clauses::ClauseTable;
use crate::live::{RunSweep, Swept};
use crate::mcp::{McpServer, McpServerSpec};
use crate::sdk::{Journeys, SdkMatrix, SdkSpec, SdkTarget};
use crate::target::{Capabilities, Conn, Service, TargetError, Tokens};

/// A protocol profile (`--api`).
pub trait Profile: Send + Sync {
    /// The value of `--api` that selects it.
    fn api(&self) -> Api;

    /// The profile's catalog: this folder of the catalog root, or `None` for the root
    /// itself without the other profiles' folders.
    fn catalog_folder(&self) -> Option<&'static str>;

    /// The clause document its scenarios cite.
    fn clauses(&self) -> Clauses;

    /// The deliberate defects its scenarios' negative controls may name.
    fn defects(&self) -> Defects {
        Defects::Reference
    }

    /// The request header a principal's credential goes in, and its value for `token`.
    fn credential(&self, token: &str) -> (&'static str, String);

    /// How the runner learns what a target supports.
    fn capability_source(&self) -> CapabilitySource {
        CapabilitySource::Told
    }

    /// What of the reference server's `/v1` capabilities a run of this profile keeps when
    /// the runner started the reference server for it: a profile without a capabilities
    /// endpoint judges the reference as any target of its protocol, knowing nothing.
    fn reference_capabilities(&self, _advertised: Capabilities) -> Capabilities {
        Capabilities::default()
    }

    /// Whether the embedded reference server serves the protocol (`sandspec run` without
    /// `--target` or `--launch`).
    fn served_by_reference(&self) -> bool {
        true
    }

    /// Starts the service under test with `command` (`--launch`), where the profile's
    /// service is one the runner can start itself; `None` otherwise.
    fn launch(&self, _command: &str) -> Option<BoxFuture<'static, Result<Launched, TargetError>>> {
        None
    }

    /// The sandbox MCP server the run drives, from `--mcp-server` or `--mcp-url` and
    /// `--tool-map`; a profile that drives none refuses the flag.
    fn mcp_server(
        &self,
        spec: Option<&McpServerSpec>,
        _tool_map: &str,
    ) -> Result<Option<McpServer>, String> {
        match spec {
            Some(spec) => Err(format!("{} needs --api mcp", spec.flag())),
            None => Ok(None),
        }
    }

    /// What a successful request created, from the target's own answer: `method path`
    /// answered `status` with the JSON `body`. The scenario's leak check confirms each is gone.
    fn created(&self, method: &str, path: &str, status: u16, body: &Value) -> Vec<Creation>;

    /// Whether `method path` (as a scenario writes it, before its variables are rendered)
    /// may create a sandbox: what `--max-sandboxes` counts of a scenario before it runs.
    fn creates_sandbox(&self, _method: &str, _path: &str) -> bool {
        false
    }

    /// The end-of-run sweep: for every principal, the objects whose own record carries
    /// `metadata.sandspec_run = run_id`, each removed and confirmed gone.
    fn sweep_run<'a>(
        &'a self,
        conn: &'a Conn<'a>,
        tokens: &'a Tokens,
        run_id: &'a str,
    ) -> BoxFuture<'a, RunSweep>;

    /// `sandspec sweep`: the objects visible to `token` tagged by any run and created at
    /// least `older_than` ago, removed unless `dry_run`.
    fn sweep_older_than<'a>(
        &'a self,
        conn: &'a Conn<'a>,
        token: &'a str,
        older_than: Duration,
        dry_run: bool,
    ) -> BoxFuture<'a, Result<Vec<Swept>, String>>;

    /// The operations of the protocol (method and path template, in groups), which the
    /// evidence measures the run's requests against (`operations` of the receipt); empty
    /// where the profile lists none.
    fn operations(&self) -> Vec<super::operations::Operation> {
        Vec::new()
    }

    /// The profile's SDK journeys (`--sdk`), where its protocol has client SDKs to judge a
    /// target by.
    fn sdk_journeys(&self) -> Option<&'static Journeys> {
        None
    }

    /// Runs the SDK matrix of `specs` against `target` (reached with `client`), the SDKs
    /// installed into `cache`; an empty matrix where the profile has no SDK journeys.
    fn sdk_matrix<'a>(
        &'a self,
        _target: SdkTarget<'a>,
        _client: reqwest::Client,
        _specs: &'a [SdkSpec],
        _cache: &'a std::path::Path,
    ) -> BoxFuture<'a, SdkMatrix> {
        Box::pin(async { SdkMatrix::default() })
    }

    /// The MUST clauses `sandspec list` measures its selection's coverage against, with the
    /// document they are in; `None` where the profile's document has no such count.
    fn listed_coverage(&self) -> Option<(&'static str, Vec<&'static str>)> {
        None
    }
}

/// Where a profile's clauses are written.
#[derive(Debug, Clone, Copy)]
pub enum Clauses {
    /// `docs/protocol.md`, sandspec's own contract.
    Protocol,
    /// A table of the profile's own document.
    Table(ClauseTable),
}

/// The deliberate defects a profile's negative controls switch on.
#[derive(Debug, Clone, Copy)]
pub enum Defects {
    /// The reference server's (`sandspec-defects`): every MUST scenario names those it
    /// catches.
    Reference,
    /// A stand-in's for a service sandspec did not write, loaded into the real service. A
    /// MUST scenario may name none: one that fails against the real service shows by that
    /// that it can fail.
    StandIn(&'static [&'static str]),
}

/// How the runner learns what a target supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapabilitySource {
    /// The target says so at `GET /v1/capabilities`.
    Advertised,
    /// The protocol has no such endpoint: the target supports what the run is told
    /// (`--assume-capability`) and nothing else.
    Told,
}

/// What kind of object a scenario created, which says how the leak check sees and removes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreatedKind {
    Sandbox,
    Snapshot,
    Session,
    /// Removed with its sandbox.
    Process,
    /// Removed with its sandbox; seen through its proxy path (403 once it is gone).
    Preview,
}

/// One object a request created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Creation {
    pub kind: CreatedKind,
    /// `GET` of this path answers 404 once the object is gone (for a preview, the proxy
    /// path, which answers 403).
    pub path: String,
    /// For a process or a preview: the sandbox it lives in.
    pub sandbox: Option<String>,
    /// For a preview: its token (registered with the sanitizer).
    pub token: Option<String>,
}

impl Creation {
    /// An object at `path` that is removed by deleting it.
    pub fn at(kind: CreatedKind, path: String) -> Self {
        Creation {
            kind,
            path,
            sandbox: None,
            token: None,
        }
    }
}

/// A service the runner launched (`--launch`), as the target takes it over.
pub struct Launched {
    /// Base URL without a trailing slash.
    pub url: String,
    pub tokens: Tokens,
    /// What the run knows of it: the directory it confines files to, and whatever document
    /// it serves about itself (for the report).
    pub capabilities: Capabilities,
    /// Stopped when the target is dropped; killed and restarted by fault and restart steps.
    pub service: Box<dyn Service>,
}
