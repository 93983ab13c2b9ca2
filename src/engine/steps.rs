//! Step kinds. Each kind lives in its own module and implements [`StepKind`] (its name in
//! the transcript and in failures is the scenario model's `Step::label`): what it waits for (the scenario's deadline
//! grows by that), whether it expects a success (the vacuity rule), whether it needs the
//! admin token, and how it runs against the shared [`Ctx`].
//!
//! A new kind is a new module, a variant of [`Step`] in the scenario model, and one arm in
//! [`dispatch!`]; nothing else in the engine changes.

use std::time::Duration;

pub(super) use mcp::Session as McpSession;

use super::context::{Ctx, StepError};
use crate::scenario::{Expect, Step};

mod absent;
mod clock;
mod connect;
mod digest;
mod fault;
mod mcp;
mod parallel;
mod poll;
mod request;
mod restart;
mod sleep;
mod snapshot;
mod sse;

pub(super) use connect::ENVD_PORT;

/// One kind of step.
pub(super) trait StepKind {
    /// How long the step may wait by its own declaration (a poll's window, a stream's
    /// deadline, a sleep), beyond the moment any request takes.
    fn waits(&self, _ctx: &Ctx<'_>) -> Duration {
        Duration::ZERO
    }

    /// Whether the step expects a 2xx answer from the target.
    fn expects_success(&self) -> bool {
        false
    }

    /// Whether the step authenticates as the admin principal.
    fn uses_admin(&self) -> bool {
        false
    }

    /// Runs the step; `label` names it in what it records.
    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError>;
}

/// Binds `$k` to the [`StepKind`] behind `$step` and evaluates `$body`.
macro_rules! dispatch {
    ($step:expr, $k:ident => $body:expr) => {
        match $step {
            Step::Request($k) => $body,
            Step::Sse($k) => $body,
            Step::Poll($k) => $body,
            Step::Digest($k) => $body,
            Step::ExpectDigestUnchanged(s) => {
                let $k = &digest::Unchanged(s);
                $body
            }
            Step::Snapshot($k) => $body,
            Step::ExpectSnapshotUnchanged(s) => {
                let $k = &snapshot::Unchanged(s);
                $body
            }
            Step::Parallel($k) => $body,
            Step::Sleep($k) => $body,
            Step::AdvanceClock($k) => $body,
            Step::Absent($k) => $body,
            Step::Connect($k) => $body,
            Step::Mcp($k) => $body,
            Step::KillServer(f) => {
                let $k = &fault::Inject(fault::FaultKind::KillServer, &f.value);
                $body
            }
            Step::RestartServer(f) => {
                let $k = &fault::Inject(fault::FaultKind::RestartServer, &f.value);
                $body
            }
            Step::StopDatabase(f) => {
                let $k = &fault::Inject(fault::FaultKind::StopDatabase, &f.value);
                $body
            }
            Step::StartDatabase(f) => {
                let $k = &fault::Inject(fault::FaultKind::StartDatabase, &f.value);
                $body
            }
            Step::Restart($k) => $body,
        }
    };
}

pub(super) fn waits(step: &Step, ctx: &Ctx<'_>) -> Duration {
    dispatch!(step, k => k.waits(ctx))
}

pub(super) fn expects_success(step: &Step) -> bool {
    dispatch!(step, k => k.expects_success())
}

pub(super) fn uses_admin(step: &Step) -> bool {
    dispatch!(step, k => k.uses_admin())
}

pub(super) async fn run(step: &Step, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
    dispatch!(step, k => k.run(ctx, label).await)
}

/// Whether `e` allows a 2xx (an expectation without a status expects one).
fn expects_2xx(e: &Expect) -> bool {
    match (e.status, e.status_in.as_slice()) {
        (Some(st), _) => (200..300).contains(&st),
        (None, []) => true,
        (None, list) => list.iter().any(|st| (200..300).contains(st)),
    }
}

/// Seconds from a number a step declares; one that cannot be worked out yet counts as none.
fn secs(n: Result<i64, super::vars::VarError>) -> Duration {
    Duration::from_secs(n.ok().and_then(|n| u64::try_from(n).ok()).unwrap_or(0))
}
