//! Submissions through the queue, and plain requests to the same server as their baseline.

use std::sync::Arc;
use std::time::Instant;

use crate::Settings;
use crate::client::{Api, completions};
use crate::servers::ServerProcess;

/// Throughput of one server: submissions through the queue and plain requests.
pub struct Queue {
    /// Submissions per second, one figure per repetition.
    pub submissions: Vec<f64>,
    /// `GET /v1/sessions/{id}` per second, one figure per repetition.
    pub gets: Vec<f64>,
    /// Per turn, from `submission.started` to `submission.completed`, in microseconds.
    pub turn_us: Vec<f64>,
    /// Per turn that was queued behind another of its session, from the other's
    /// `submission.completed` to its own `submission.started`, in microseconds.
    pub handoff_us: Vec<f64>,
}

/// Creates `queue_sessions` sessions and starts their workers with one turn each; then, per
/// repetition, submits `queue_turns` turns to every session at once and times from the first
/// submit to the last `submission.completed` seen on the sessions' event streams, followed by
/// the plain-request baseline on the same server.
pub async fn queue(
    server: &ServerProcess,
    api: &Api,
    settings: &Settings,
) -> anyhow::Result<Queue> {
    let mut sessions = Vec::new();
    for _ in 0..settings.queue_sessions {
        let sid = api.create_session().await?;
        // Starts the session's worker, which then stays.
        api.run_turns(server, &sid, 1).await?;
        sessions.push(sid);
    }
    let api = Arc::new(api.clone());
    let (mut submissions, mut gets) = (Vec::new(), Vec::new());
    let (mut turn_us, mut handoff_us) = (Vec::new(), Vec::new());
    for _ in 0..settings.reps {
        let mut watchers = Vec::new();
        for sid in &sessions {
            let after = api.last_seq(sid).await?;
            watchers.push(tokio::spawn(completions(
                server.addr,
                sid.clone(),
                after,
                settings.queue_turns,
            )));
        }
        let started = Instant::now();
        let mut submitters = tokio::task::JoinSet::new();
        for sid in &sessions {
            let (api, sid, turns) = (api.clone(), sid.clone(), settings.queue_turns);
            submitters.spawn(async move {
                for _ in 0..turns {
                    api.submit(&sid, &ulid::Ulid::new().to_string()).await?;
                }
                anyhow::Ok(())
            });
        }
        while let Some(done) = submitters.join_next().await {
            done??;
        }
        let mut last = started;
        for watcher in watchers {
            let seen = watcher.await??;
            last = last.max(seen.last);
            let micros = |d: time::Duration| d.whole_microseconds() as f64;
            for (start, end) in &seen.turns {
                turn_us.push(micros(*end - *start));
            }
            for pair in seen.turns.windows(2) {
                handoff_us.push(micros(pair[1].0 - pair[0].1));
            }
        }
        let total = settings.queue_sessions * settings.queue_turns;
        submissions.push(total as f64 / (last - started).as_secs_f64());

        gets.push(plain_requests(&api, &sessions[0], settings).await?);
    }
    Ok(Queue {
        submissions,
        gets,
        turn_us,
        handoff_us,
    })
}

/// `GET /v1/sessions/{sid}` per second from a few concurrent keep-alive clients.
async fn plain_requests(api: &Arc<Api>, sid: &str, settings: &Settings) -> anyhow::Result<f64> {
    let per_client = settings.get_requests / settings.get_concurrency;
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..settings.get_concurrency {
        let (api, sid) = (api.clone(), sid.to_owned());
        clients.spawn(async move {
            for _ in 0..per_client {
                api.session(&sid).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(done) = clients.join_next().await {
        done??;
    }
    Ok((per_client * settings.get_concurrency) as f64 / started.elapsed().as_secs_f64())
}
