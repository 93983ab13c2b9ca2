//! What every step kind is to the parser and the engine ([`StepKind`]): its name in messages,
//! its checks beyond what serde makes, what it waits for (the scenario's deadline and the wait
//! budget grow by that), whether it expects a success (the vacuity rule) or needs the admin
//! token, and how it runs against the scenario run's shared state.

use std::time::Duration;

use crate::engine::context::{Ctx, StepError};
use crate::engine::vars::Vars;
use crate::profile::Profile;
use crate::scenario::{CheckCtx, Checker, Expect, NumExpr, Scope};

/// One kind of step: a module of `crate::engine::steps` with its model, registered in one
/// line of the registry.
pub trait StepKind {
    /// What messages call the step, and what a negative control's `fails_at` names: its
    /// `name`, else what the kind calls it.
    fn label(&self) -> String;

    /// The checks serde cannot make: variables defined before use, what the scenario must
    /// require for what the step does, the shape of its parts. `scope` gains what it defines.
    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>);

    /// The step's own deadline, for the steps that wait for something to happen: a poll's,
    /// a stream's or a parallel step's `within_s`.
    fn deadline(&self) -> Option<&NumExpr> {
        None
    }

    /// What the step waits for by the target's own settings, as the wait budget judges it:
    /// what it is, with the numbers, and how many seconds. A deadline is such a wait when it
    /// grows with an advertised limit or retention (a plain number bounds something that
    /// should happen at once); one over a number the target does not advertise counts as
    /// none (the step fails when it runs). With `clock_movable`, the runner moves the
    /// target's clock instead of waiting (TC-9.12).
    fn advertised_wait(&self, vars: &Vars<'_>, _clock_movable: bool) -> Option<(String, u64)> {
        let deadline = self.deadline().filter(|n| {
            n.expr
                .var()
                .is_some_and(|v| v.starts_with("limits.") || v.starts_with("retention."))
        })?;
        let seconds = u64::try_from(vars.num(deadline).ok()?).unwrap_or(0);
        Some((format!("within_s {} = {seconds} s", deadline.expr), seconds))
    }

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

    /// How many sandboxes the step may create, at most, by its model (before it runs): what
    /// `--max-sandboxes` weighs a scenario by.
    fn sandboxes(&self, _vars: &Vars<'_>, _profile: &dyn Profile) -> u64 {
        0
    }

    /// The HTTP statuses the step's expectations name. A throttling answer (429, or 503 with
    /// `Retry-After`) with one of them is the step's to judge as it is, never waited out and
    /// sent again: a quota or stream-limit check sees its limit.
    fn names_statuses(&self) -> Vec<u16> {
        Vec::new()
    }

    /// Runs the step; `label` names it in what it records.
    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError>;
}

/// `name`, when the step was given one, else `default`.
pub fn named(name: Option<&str>, default: impl FnOnce() -> String) -> String {
    name.map_or_else(default, str::to_owned)
}

/// Whether `e` allows a 2xx (an expectation without a status expects one).
pub fn expects_2xx(e: &Expect) -> bool {
    match (e.status, e.status_in.as_slice()) {
        (Some(st), _) => (200..300).contains(&st),
        (None, []) => true,
        (None, list) => list.iter().any(|st| (200..300).contains(st)),
    }
}

/// The statuses an expectation names.
pub fn named_statuses(e: &Expect) -> Vec<u16> {
    e.status
        .into_iter()
        .chain(e.status_in.iter().copied())
        .collect()
}

/// Seconds from a number a step declares; one that cannot be worked out yet counts as none.
pub fn secs(n: Result<i64, crate::engine::vars::VarError>) -> Duration {
    Duration::from_secs(n.ok().and_then(|n| u64::try_from(n).ok()).unwrap_or(0))
}
