//! Step kinds. Each kind is one module: its model (what a scenario file may say for it), its
//! checks, its waits and deadline, and its run ([`StepKind`]). The registry below names every
//! kind once, by the key a scenario file writes (`- request: {...}`); the [`Step`] enum and
//! the dispatch to each kind are generated from it. A new kind is a new module (with its `mod`
//! line) and one line in the registry; nothing else in the parser or the engine changes.

use std::time::Duration;

use serde::Deserialize;

use super::context::{Ctx, StepError};
use super::vars::Vars;
use crate::scenario::{CheckCtx, Checker, Scope};

mod absent;
mod clock;
mod connect;
mod digest;
mod fault;
mod kind;
mod mcp;
mod parallel;
mod poll;
mod request;
mod restart;
mod sleep;
mod snapshot;
mod sse;

pub use absent::Absent;
pub use clock::AdvanceClock;
pub use connect::Connect;
pub use digest::{Digest, ExpectDigestUnchanged};
pub use fault::{Fault, KillServer, RestartServer, StartDatabase, StopDatabase};
pub use kind::StepKind;
pub use mcp::Mcp;
pub use parallel::{Parallel, Tally};
pub use poll::Poll;
pub use request::{BridgeSignature, Request};
pub use restart::Restart;
pub use sleep::Sleep;
pub use snapshot::{ExpectSnapshotUnchanged, Snapshot};
pub use sse::{EventCheck, Sse, Until};

/// Generates [`Step`] from the registry, and its dispatch to each kind's [`StepKind`].
macro_rules! step_kinds {
    ($($(#[$doc:meta])* $key:literal => $variant:ident($kind:ty),)*) => {
        /// One step. The key names the kind: `- request: {...}`.
        #[derive(Debug, Clone, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub enum Step {
            $($(#[$doc])* #[serde(rename = $key)] $variant($kind),)*
        }

        impl Step {
            /// The key that names the kind in a scenario file.
            pub fn kind(&self) -> &'static str {
                match self { $(Step::$variant(_) => $key,)* }
            }

            /// What messages call the step; negative controls name steps by it.
            pub fn label(&self) -> String {
                match self { $(Step::$variant(k) => k.label(),)* }
            }

            /// The kind's checks of the step (see [`StepKind::check`]).
            pub fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
                match self { $(Step::$variant(k) => k.check(c, scope, ctx),)* }
            }

            /// The step's own deadline, for the steps that wait for something to happen.
            pub fn deadline(&self) -> Option<&crate::scenario::NumExpr> {
                match self { $(Step::$variant(k) => k.deadline(),)* }
            }

            /// What the step waits for by the target's settings (see
            /// [`StepKind::advertised_wait`]).
            pub fn advertised_wait(
                &self,
                vars: &Vars<'_>,
                clock_movable: bool,
            ) -> Option<(String, u64)> {
                match self { $(Step::$variant(k) => k.advertised_wait(vars, clock_movable),)* }
            }

            /// Whether the step expects a 2xx answer from the target.
            pub fn expects_success(&self) -> bool {
                match self { $(Step::$variant(k) => k.expects_success(),)* }
            }

            /// Whether the step authenticates as the admin principal.
            pub fn uses_admin(&self) -> bool {
                match self { $(Step::$variant(k) => k.uses_admin(),)* }
            }

            /// How many sandboxes the step may create (see [`StepKind::sandboxes`]).
            pub fn sandboxes(&self, vars: &Vars<'_>, profile: &dyn crate::profile::Profile) -> u64 {
                match self { $(Step::$variant(k) => k.sandboxes(vars, profile),)* }
            }

            /// The statuses the step's expectations name (see [`StepKind::names_statuses`]).
            pub fn names_statuses(&self) -> Vec<u16> {
                match self { $(Step::$variant(k) => k.names_statuses(),)* }
            }

            /// How long the step may wait by its own declaration.
            pub(in crate::engine) fn waits(&self, ctx: &Ctx<'_>) -> Duration {
                match self { $(Step::$variant(k) => k.waits(ctx),)* }
            }

            /// Runs the step; `label` names it in what it records.
            pub(in crate::engine) async fn run(
                &self,
                ctx: &mut Ctx<'_>,
                label: &str,
            ) -> Result<(), StepError> {
                match self { $(Step::$variant(k) => k.run(ctx, label).await,)* }
            }
        }
    };
}

step_kinds! {
    "request" => Request(request::Request),
    "sse" => Sse(sse::Sse),
    "poll" => Poll(poll::Poll),
    "digest" => Digest(digest::Digest),
    "expect_digest_unchanged" => ExpectDigestUnchanged(digest::ExpectDigestUnchanged),
    "snapshot" => Snapshot(snapshot::Snapshot),
    "expect_snapshot_unchanged" => ExpectSnapshotUnchanged(snapshot::ExpectSnapshotUnchanged),
    "parallel" => Parallel(parallel::Parallel),
    "sleep" => Sleep(sleep::Sleep),
    /// Lets time pass on the target: moves its test clock (TC-9.12) on a deployment of the
    /// scenario's own, else waits it out.
    "advance_clock" => AdvanceClock(clock::AdvanceClock),
    "absent" => Absent(absent::Absent),
    "connect" => Connect(connect::Connect),
    "mcp" => Mcp(mcp::Mcp),
    /// SIGKILL to a server process of a deployment the runner controls.
    "kill_server" => KillServer(fault::KillServer),
    /// Starts a server process again on its data directory, database and port.
    "restart_server" => RestartServer(fault::RestartServer),
    /// Stops the deployment's database server abruptly.
    "stop_database" => StopDatabase(fault::StopDatabase),
    /// Starts the deployment's database server again.
    "start_database" => StartDatabase(fault::StartDatabase),
    "restart" => Restart(restart::Restart),
}
