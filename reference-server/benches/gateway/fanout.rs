//! Event delivery to many concurrent subscribers of one stream: latency and memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::client::{SseReader, created_at, frame_data};
use crate::servers::ServerProcess;

/// Delivery to many subscribers of one stream.
pub struct Fanout {
    /// Per event and subscriber: receipt minus the event's `created_at`, in microseconds.
    pub latencies_us: Vec<u64>,
    /// Events each subscriber received, the warm-up round's included (all received as many).
    pub events_per_subscriber: usize,
    /// The server's RSS (KiB) before the subscribers connect, with all of them open and
    /// idle, and after the rounds.
    pub rss_idle: u64,
    pub rss_open: u64,
    pub rss_after: u64,
}

/// Shared between the subscribers and the orchestrator.
#[derive(Default)]
struct Progress {
    /// Subscribers that have their first frame.
    opened: AtomicUsize,
    /// Round ends seen, summed over subscribers.
    round_ends: AtomicUsize,
}

/// Opens `settings.subscribers` streams on `path`, then runs one warm-up round and
/// `settings.rounds` measured rounds: `trigger(round)` makes the server append events, and
/// the round is over when every subscriber has seen an event of type `round_end`.
pub async fn fan_out(
    server: &ServerProcess,
    path: &str,
    last_event_id: Option<i64>,
    round_end: &'static str,
    settings: &Settings,
    mut trigger: impl AsyncFnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<Fanout> {
    let n = settings.subscribers;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_idle = server.rss_kib()?;
    let progress = Arc::new(Progress::default());
    let stop = CancellationToken::new();
    // Connections are opened a few at a time so as not to overflow the listen backlog.
    let opening = Arc::new(tokio::sync::Semaphore::new(64));
    let mut subscribers = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (progress, stop, opening) = (progress.clone(), stop.clone(), opening.clone());
        let path = path.to_owned();
        let addr = server.addr;
        subscribers.spawn(async move {
            let permit = opening.acquire_owned().await?;
            let reader = SseReader::open(addr, &path, last_event_id).await?;
            subscribe(reader, round_end, progress, stop, permit).await
        });
    }
    wait_for(
        || progress.opened.load(Ordering::SeqCst) >= n,
        "subscribers to open",
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_open = server.rss_kib()?;
    for round in 0..=settings.rounds {
        trigger(round).await?;
        wait_for(
            || progress.round_ends.load(Ordering::SeqCst) >= n * (round + 1),
            "every subscriber to see the round end",
        )
        .await
        .with_context(|| format!("round {round}"))?;
    }
    let rss_after = server.rss_kib()?;
    stop.cancel();
    let mut latencies_us = Vec::new();
    let mut received = Vec::new();
    while let Some(joined) = subscribers.join_next().await {
        let (samples, events) = joined??;
        latencies_us.extend(samples);
        received.push(events);
    }
    let events_per_subscriber = received.iter().copied().max().unwrap_or(0);
    ensure!(
        received.iter().all(|&e| e == events_per_subscriber),
        "subscribers received different numbers of events (most {events_per_subscriber}, \
         fewest {})",
        received.iter().min().unwrap_or(&0)
    );
    Ok(Fanout {
        latencies_us,
        events_per_subscriber,
        rss_idle,
        rss_open,
        rss_after,
    })
}

/// One subscriber: reads until stopped; returns its latency samples (the warm-up round's
/// left out) and how many events it received.
async fn subscribe(
    mut reader: SseReader,
    round_end: &str,
    progress: Arc<Progress>,
    stop: CancellationToken,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> anyhow::Result<(Vec<u64>, usize)> {
    let mut permit = Some(permit);
    let (mut samples, mut events, mut ends) = (Vec::new(), 0, 0);
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok((samples, events)),
            filled = reader.fill() => filled?,
        }
        let received = OffsetDateTime::now_utc();
        while let Some(frame) = reader.frame()? {
            if permit.take().is_some() {
                progress.opened.fetch_add(1, Ordering::SeqCst);
            }
            let Some(data) = frame_data(&frame)? else {
                continue;
            };
            events += 1;
            if ends > 0 {
                let micros = (received - created_at(&data)?).whole_microseconds();
                samples.push(u64::try_from(micros).unwrap_or(0));
            }
            if data["type"] == round_end {
                ends += 1;
                progress.round_ends.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

/// Waits up to two minutes for `done`.
async fn wait_for(done: impl Fn() -> bool, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !done() {
        ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}
