//! Runs one scenario against a target: steps in order until one fails, then every cleanup
//! step, then a sweep of anything the run created and did not remove. What each step does is
//! its kind's business ([`super::steps`]); this module only orders them and bounds them.
//!
//! FAIL versus ERROR: whatever the target answered (a wrong status, HTML where JSON was
//! required, a broken SSE frame, a connection it reset, a response that never came) is the
//! target's failure. ERROR is kept for what says nothing about the target: it could not be
//! connected to at all, or the harness itself could not carry out a step (a variable with no
//! value in a non-cleanup step).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::context::{Ctx, FaultRecord, StepError, ms};
use super::outcome::Outcome;
use super::throttle::Throttled;
use super::transcript::Entry;
use super::vars::{VarError, Vars};
use crate::live::Leftover;
use crate::profile::CapabilitySource;
use crate::scenario::{Scenario, Step, step_label};
use crate::target::{OwnDatabase, Target};

/// What a scenario's steps may take beyond their declared waits: a fixed part, and a part
/// per step (each request takes a moment even when the target is fast).
const STEPS_MARGIN: Duration = Duration::from_secs(60);
const CLEANUP_MARGIN: Duration = Duration::from_secs(30);
const MARGIN_PER_STEP: Duration = Duration::from_secs(2);

/// Everything one scenario run produced.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioRun {
    pub outcome: Outcome,
    /// Milliseconds from the run's start to this scenario's start, set by the scheduler
    /// (`cli::run_until_stopped`) so the evidence can draw the run as a timeline.
    pub started_ms: u64,
    pub duration_ms: u64,
    /// Named measurements in seconds (time to first SSE frame, time to EOF, ...).
    pub measurements: BTreeMap<String, f64>,
    /// What the leak check found after cleanup, and whether the sweep then removed it.
    pub swept: Vec<Leftover>,
    pub transcript: Vec<Entry>,
    pub attempts: u32,
    /// The faults the scenario injected, with what was checked after each.
    pub faults: Vec<FaultRecord>,
    /// The throttling answers it waited out (429, or 503 with `Retry-After`).
    pub throttled: Throttled,
    /// Values of captures marked `secret: true`, for the sanitizer. Never serialized.
    #[serde(skip)]
    pub secrets: Vec<String>,
}

impl ScenarioRun {
    /// A scenario that was not run, with why.
    pub fn skipped(reason: String) -> ScenarioRun {
        ScenarioRun {
            outcome: Outcome::Skip { reason },
            started_ms: 0,
            duration_ms: 0,
            measurements: BTreeMap::new(),
            swept: Vec::new(),
            transcript: Vec::new(),
            attempts: 1,
            faults: Vec::new(),
            throttled: Throttled::default(),
            secrets: Vec::new(),
        }
    }
}

/// Runs `scenario` with up to `retries` extra attempts after a FAIL; a later pass is FLAKY.
pub async fn run_with_retries(
    target: &Target,
    scenario: &Scenario,
    run_id: &str,
    retries: u32,
) -> ScenarioRun {
    let mut first = run_scenario(target, scenario, run_id).await;
    if !matches!(first.outcome, Outcome::Fail { .. }) {
        return first;
    }
    for attempt in 2..=retries + 1 {
        let mut again = run_scenario(target, scenario, run_id).await;
        if again.outcome == Outcome::Pass {
            again.outcome = Outcome::Flaky {
                attempts: attempt,
                first_failure: first.outcome.reason().unwrap_or_default(),
            };
            again.attempts = attempt;
            return again;
        }
        first.attempts = attempt;
    }
    first
}

/// Runs `scenario` once.
pub async fn run_scenario(target: &Target, scenario: &Scenario, run_id: &str) -> ScenarioRun {
    let started = Instant::now();
    let mut run = ScenarioRun {
        outcome: Outcome::Pass,
        ..ScenarioRun::skipped(String::new())
    };
    if let Some(reason) = skip_reason(target, scenario) {
        run.outcome = Outcome::Skip { reason };
        return run;
    }
    // A scenario that injects faults gets a deployment of its own, so that no other scenario
    // sees its server die or its database stop.
    let server_control = requires(scenario, "server_control");
    let database_control = requires(scenario, "database_control");
    // A launched service is the deployment the runner controls already (its scenarios are
    // `exclusive`).
    // So does one that moves the target's clock (TC-9.12): every scenario on that deployment
    // would see the time pass. On PostgreSQL its database is of its own too, so that its
    // reapers expire nothing of the shared database.
    let clock =
        moves_clock(scenario) && target.control.is_none() && target.clock_movable_here_or_own();
    // And so does an exclusive scenario where the runner can start one, so that it runs beside
    // the others instead of after them; on PostgreSQL with a database of its own, since what
    // it compares (a digest of all durable state) covers the whole database.
    let alone = scenario.exclusive && target.isolates_exclusive();
    if (server_control || database_control || clock || alone)
        && target.control.is_none()
        && !target.can_restart()
    {
        let database = if database_control {
            OwnDatabase::Private
        } else if (clock || alone) && target.database_controllable() {
            OwnDatabase::Fresh
        } else {
            OwnDatabase::Same
        };
        return match target.start_controlled(database).await {
            Some(Ok(own)) => {
                let mut run = Box::pin(run_scenario(&own, scenario, run_id)).await;
                run.duration_ms = ms(started.elapsed());
                run
            }
            Some(Err(e)) => {
                run.outcome = Outcome::Error {
                    reason: format!("cannot start a deployment for the scenario's faults: {e}"),
                };
                run
            }
            None => {
                run.outcome = Outcome::Skip {
                    reason: crate::target::NO_SERVER_CONTROL.into(),
                };
                run
            }
        };
    }
    let mut ctx = Ctx {
        target,
        vars: Vars::new(run_id, &target.capabilities, &target.canary),
        started,
        transcript: Vec::new(),
        measurements: BTreeMap::new(),
        digests: BTreeMap::new(),
        snapshots: BTreeMap::new(),
        ledger: Vec::new(),
        leftovers: Vec::new(),
        saw_success: false,
        secrets: Vec::new(),
        expiry_held: false,
        mcp_sessions: BTreeMap::new(),
        faults: Vec::new(),
        deadline: None,
        names: Vec::new(),
        throttle_waits: 0,
        throttled_for: Duration::ZERO,
    };
    // The steps, then the cleanup, each within a deadline derived from what they declare
    // they wait for: a target that stops answering cannot hold a scenario for longer.
    let steps_deadline = ctx.deadline(&scenario.steps, STEPS_MARGIN);
    ctx.deadline = Some(Instant::now() + steps_deadline);
    let mut current = String::new();
    let steps = async {
        for (i, step) in scenario.steps.iter().enumerate() {
            let label = step_label("steps", i, step);
            current.clone_from(&label);
            ctx.names = step.names_statuses();
            if let Err(e) = step.run(&mut ctx, &label).await {
                return e.into_outcome(label);
            }
            ctx.passed(&label);
        }
        Outcome::Pass
    };
    let mut outcome = match tokio::time::timeout(steps_deadline, steps).await {
        Ok(outcome) => outcome,
        Err(_) => deadline_passed(&mut ctx, current, "scenario", steps_deadline),
    };
    // An MCP server a failed step left running disposes of its sandboxes as its session
    // ends, before the cleanup and the leak check look.
    ctx.end_mcp_sessions().await;
    let cleanup_deadline = ctx.deadline(&scenario.cleanup, CLEANUP_MARGIN);
    ctx.deadline = Some(Instant::now() + cleanup_deadline);
    let mut current = String::new();
    let cleanup = async {
        let mut outcome = Outcome::Pass;
        for (i, step) in scenario.cleanup.iter().enumerate() {
            let label = step_label("cleanup", i, step);
            current.clone_from(&label);
            ctx.names = step.names_statuses();
            match step.run(&mut ctx, &label).await {
                Ok(()) => {}
                // A cleanup step for something that was never created has nothing to do.
                Err(StepError::Var(VarError::Missing(name))) => {
                    ctx.note(format!("{label}: skipped, `{name}` was never captured"))
                }
                Err(e) => outcome = outcome.combine(e.into_outcome(label)),
            }
        }
        outcome
    };
    outcome = outcome.combine(
        match tokio::time::timeout(cleanup_deadline, cleanup).await {
            Ok(outcome) => outcome,
            Err(_) => deadline_passed(&mut ctx, current, "cleanup", cleanup_deadline),
        },
    );
    // Each request of the leak check and the sweep is bounded by the request timeout; their
    // throttle waits by the cleanup's margin.
    ctx.names = Vec::new();
    ctx.deadline = Some(Instant::now() + CLEANUP_MARGIN);
    outcome = outcome.combine(ctx.leak_check().await);
    if ctx.expiry_held {
        let label = "release the expiry hold";
        if let Err(e) = ctx.hold_expiry(0, label).await {
            outcome = outcome.combine(e.into_outcome(label.to_owned()));
        }
    }
    // No vacuous passes: a scenario none of whose requests succeeded proves nothing, unless
    // that is its point (every step expected an error status).
    if outcome == Outcome::Pass
        && !ctx.saw_success
        && scenario.steps.iter().any(Step::expects_success)
    {
        outcome = Outcome::Fail {
            step: "scenario".into(),
            reason: "no request succeeded".into(),
        };
    }
    run.outcome = outcome;
    run.duration_ms = ms(started.elapsed());
    run.throttled = ctx.throttled();
    run.measurements = ctx.measurements;
    run.swept = ctx.leftovers;
    run.transcript = ctx.transcript;
    run.secrets = ctx.secrets;
    run.faults = ctx.faults;
    run
}

/// Whether the scenario lets time pass with `advance_clock`.
fn moves_clock(scenario: &Scenario) -> bool {
    scenario
        .steps
        .iter()
        .chain(&scenario.cleanup)
        .any(|s| matches!(s, crate::scenario::Step::AdvanceClock(_)))
}

fn requires(scenario: &Scenario, capability: &str) -> bool {
    scenario.requires.iter().any(|r| r.value == capability)
}
/// Why a scenario cannot run against this target, if it cannot: a requirement the target
/// does not meet, or advertised waits over the run's wait budget.
pub fn skip_reason(target: &Target, scenario: &Scenario) -> Option<String> {
    for cap in &scenario.requires {
        match cap.value.as_str() {
            "peer" if target.peer.is_none() => return Some(crate::target::NO_PEER.to_owned()),
            "admin_token" if target.tokens.admin.is_none() => {
                return Some("no admin token (--admin-token-env)".into());
            }
            "server_control" if !target.server_controllable() => {
                return Some(crate::target::NO_SERVER_CONTROL.to_owned());
            }
            "database_control" if !target.database_controllable() => {
                return Some(crate::target::NO_DATABASE_CONTROL.to_owned());
            }
            "restart" if !target.can_restart() => {
                return Some(
                    "the runner did not start the target (--launch), so it cannot restart it"
                        .into(),
                );
            }
            "peer" | "admin_token" | "server_control" | "database_control" | "restart" => continue,
            _ => {}
        }
        if !target.capabilities.has(&cap.value) {
            let advertised = target.capabilities.raw["features"]
                .as_array()
                .is_some_and(|f| f.iter().any(|f| f.as_str() == Some(cap.value.as_str())));
            if target.profile().capability_source() == CapabilitySource::Told {
                return Some(format!(
                    "{} targets advertise no capabilities and `{}` was not assumed (--assume-capability)",
                    target.api.name(),
                    cap.value
                ));
            }
            // A target without isolation may say why (`isolation.unavailable`), with the fix.
            let why = target.capabilities.raw["isolation"]["unavailable"]
                .as_str()
                .filter(|_| matches!(cap.value.as_str(), "isolation" | "memory_limit"))
                .map(|why| format!(": {why}"))
                .unwrap_or_default();
            return Some(if advertised {
                format!("`{}` dropped by --drop-capability", cap.value)
            } else {
                format!("target does not advertise `{}`{why}", cap.value)
            });
        }
    }
    if scenario.builtins.contains("base_dir") && target.capabilities.base_dir.is_none() {
        return Some(
            "uses the directory the target confines files to, which the run was not given (--base-dir DIR with --target)"
                .into(),
        );
    }
    if target.tokens.admin.is_none()
        && scenario
            .steps
            .iter()
            .chain(&scenario.cleanup)
            .any(Step::uses_admin)
    {
        return Some("no admin token (--admin-token-env)".into());
    }
    if let Some(budget) = target.wait_budget {
        let clock_movable = moves_clock(scenario) && target.clock_movable_here_or_own();
        return super::waits::over_budget(scenario, &target.capabilities, clock_movable, budget);
    }
    None
}

/// The outcome when a deadline passed during `step` (of the `part`, `scenario` or
/// `cleanup`).
fn deadline_passed(ctx: &mut Ctx<'_>, step: String, part: &str, deadline: Duration) -> Outcome {
    let reason = format!(
        "the {part}'s deadline of {}s (its declared waits plus a margin) passed during this step",
        deadline.as_secs()
    );
    ctx.note(format!("{step}: {reason}"));
    Outcome::Fail { step, reason }
}

impl Ctx<'_> {
    /// The deadline of a part (the steps or the cleanup): the waits its steps declare (a
    /// poll's `within_s` plus one request, a stream's deadline, a sleep), a margin, and a
    /// little for every step. A wait that cannot be worked out yet counts as nothing (its
    /// step fails on its own then).
    fn deadline(&self, part: &[Step], margin: Duration) -> Duration {
        let mut total = margin;
        for step in part {
            total += MARGIN_PER_STEP;
            total += step.waits(self);
        }
        total
    }
}
