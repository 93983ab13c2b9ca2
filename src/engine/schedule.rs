//! Runs many scenarios against one target: `jobs` at a time, the longest waits first, an
//! exclusive scenario on a deployment of its own where the runner can start one and otherwise
//! alone after the others, no more sandboxes held at once than `--max-sandboxes` allows (a
//! scenario weighs what its steps may create, [`sandboxes_of`]; the next one waits for room),
//! and no new scenario once the run is asked to stop.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::run::{ScenarioRun, run_with_retries};
use super::vars::Vars;
use super::waits::{total_s, waits};
use crate::scenario::{LoadedScenario, Scenario};
use crate::target::Target;

/// How many sandboxes a scenario may hold at once, by its model: every sandbox its steps and
/// cleanup may create (a create request, each request of a `parallel` group of creates, an
/// MCP create), as if none were removed before the scenario ends. A count that depends on
/// what the scenario captures counts as none.
pub fn sandboxes_of(scenario: &Scenario, target: &Target) -> u64 {
    let vars = Vars::new("weight", &target.capabilities, &target.canary);
    scenario
        .steps
        .iter()
        .chain(&scenario.cleanup)
        .map(|s| s.sandboxes(&vars, target.profile()))
        .sum()
}

/// How many scenarios run at once without `--jobs`: the reference server the runner started
/// waits far more than it computes, so eight; a deployment of someone else's, four, to stay
/// gentle on a live platform's rate limits.
pub fn default_jobs(target: &Target) -> usize {
    if target.launcher.is_some() { 8 } else { 4 }
}

/// Runs scenarios `jobs` at a time, exclusive ones among them where each gets a deployment of
/// its own ([`Target::isolates_exclusive`]), otherwise after the others, one at a time;
/// results come back in the order of `scenarios`.
pub async fn run_all(
    target: &Arc<Target>,
    scenarios: &[LoadedScenario],
    run_id: &str,
    jobs: usize,
    retries: u32,
) -> Vec<ScenarioRun> {
    let never = AtomicBool::new(false);
    run_until_stopped(
        target,
        scenarios,
        run_id,
        Pace {
            jobs,
            retries,
            stop: &never,
            epoch: Instant::now(),
            max_sandboxes: None,
        },
        |_, _| {},
    )
    .await
    .into_iter()
    .map(|r| r.expect("every scenario ran"))
    .collect()
}

/// How a run paces its scenarios.
#[derive(Clone, Copy)]
pub struct Pace<'a> {
    /// Scenarios at once.
    pub jobs: usize,
    /// Extra attempts after a FAIL; a later pass is FLAKY.
    pub retries: u32,
    /// Once set, no further scenario starts; those already running finish, cleanup included.
    pub stop: &'a AtomicBool,
    /// The run's start: each result's `started_ms` is measured from it.
    pub epoch: Instant,
    /// Sandboxes the run may hold at once (`--max-sandboxes`): a scenario starts only when
    /// its weight fits beside those running; one that weighs more is skipped.
    pub max_sandboxes: Option<u64>,
}

/// Like [`run_all`], but paced by `pace`, and `done` is told of each scenario as it ends.
/// `None` marks a scenario that never ran.
pub async fn run_until_stopped(
    target: &Arc<Target>,
    scenarios: &[LoadedScenario],
    run_id: &str,
    pace: Pace<'_>,
    mut done: impl FnMut(&LoadedScenario, &ScenarioRun),
) -> Vec<Option<ScenarioRun>> {
    let epoch = pace.epoch;
    let since_epoch = move || u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
    let retries = pace.retries;
    let mut results: Vec<Option<ScenarioRun>> = vec![None; scenarios.len()];
    let semaphore = Arc::new(tokio::sync::Semaphore::new(pace.jobs.max(1)));
    let room = pace.max_sandboxes.map(|n| {
        Arc::new(tokio::sync::Semaphore::new(
            usize::try_from(n).unwrap_or(tokio::sync::Semaphore::MAX_PERMITS),
        ))
    });
    // A scenario that may hold more sandboxes than the run may is skipped, with the numbers.
    let too_big = |s: &LoadedScenario| -> Option<ScenarioRun> {
        let max = pace.max_sandboxes?;
        let weight = sandboxes_of(&s.scenario, target);
        (weight > max).then(|| {
            ScenarioRun::skipped(format!(
                "may hold {weight} sandboxes at once, more than --max-sandboxes {max} allows"
            ))
        })
    };
    let mut set = tokio::task::JoinSet::new();
    let isolated = target.isolates_exclusive();
    let alone = |s: &LoadedScenario| s.scenario.exclusive && !isolated;
    // The scenarios that wait longest (a retention or a stream's bound waited out in real
    // time) start first, so that their waits overlap the others instead of ending the run.
    let mut pool: Vec<(usize, &LoadedScenario)> = scenarios
        .iter()
        .enumerate()
        .filter(|(_, s)| !alone(s))
        .collect();
    let clock_movable = target.clock_movable_here_or_own();
    pool.sort_by_cached_key(|(_, s)| {
        std::cmp::Reverse(total_s(&waits(
            &s.scenario,
            &target.capabilities,
            clock_movable,
        )))
    });
    for (i, s) in pool {
        let permit = semaphore
            .clone()
            .acquire_owned()
            .await
            .expect("semaphore is never closed");
        if pace.stop.load(Ordering::SeqCst) {
            break;
        }
        if let Some(mut skipped) = too_big(s) {
            skipped.started_ms = since_epoch();
            done(s, &skipped);
            results[i] = Some(skipped);
            continue;
        }
        let weight = u32::try_from(sandboxes_of(&s.scenario, target)).unwrap_or(u32::MAX);
        let held = match &room {
            Some(room) if weight > 0 => Some(
                room.clone()
                    .acquire_many_owned(weight)
                    .await
                    .expect("semaphore is never closed"),
            ),
            _ => None,
        };
        if pace.stop.load(Ordering::SeqCst) {
            break;
        }
        let target = target.clone();
        let scenario = s.scenario.clone();
        let run_id = run_id.to_owned();
        set.spawn(async move {
            let started_ms = since_epoch();
            let mut r = run_with_retries(&target, &scenario, &run_id, retries).await;
            r.started_ms = started_ms;
            drop(held);
            drop(permit);
            (i, r)
        });
        while let Some(finished) = set.try_join_next() {
            let (i, r) = finished.expect("scenario task panicked");
            done(&scenarios[i], &r);
            results[i] = Some(r);
        }
    }
    while let Some(finished) = set.join_next().await {
        let (i, r) = finished.expect("scenario task panicked");
        done(&scenarios[i], &r);
        results[i] = Some(r);
    }
    for (i, s) in scenarios.iter().enumerate().filter(|(_, s)| alone(s)) {
        if pace.stop.load(Ordering::SeqCst) {
            break;
        }
        let started_ms = since_epoch();
        // Alone, it has every sandbox the run may hold.
        let mut r = match too_big(s) {
            Some(skipped) => skipped,
            None => run_with_retries(target, &s.scenario, run_id, retries).await,
        };
        r.started_ms = started_ms;
        done(s, &r);
        results[i] = Some(r);
    }
    results
}
