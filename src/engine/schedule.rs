//! Runs many scenarios against one target: `jobs` at a time, the longest waits first, an
//! exclusive scenario on a deployment of its own where the runner can start one and otherwise
//! alone after the others, and no new scenario once the run is asked to stop.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::run::{ScenarioRun, run_with_retries};
use super::waits::{total_s, waits};
use crate::scenario::LoadedScenario;
use crate::target::Target;

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
        let target = target.clone();
        let scenario = s.scenario.clone();
        let run_id = run_id.to_owned();
        set.spawn(async move {
            let started_ms = since_epoch();
            let mut r = run_with_retries(&target, &scenario, &run_id, retries).await;
            r.started_ms = started_ms;
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
        let mut r = run_with_retries(target, &s.scenario, run_id, retries).await;
        r.started_ms = started_ms;
        done(s, &r);
        results[i] = Some(r);
    }
    results
}
