//! Gateway benchmarks, each figure against a baseline measured in the same run: time to the
//! first SSE frame on an idle session, event delivery latency and memory with many concurrent
//! subscribers, and submissions per second through the queue on SQLite and PostgreSQL.
//! `docs/performance.md` says what each figure means and how it was measured.
//!
//! ```text
//! cargo bench -p reference-server --bench gateway               # the full run
//! cargo bench -p reference-server --bench gateway -- --quick    # fewer samples
//! ```
//!
//! The servers under test are child processes, so that each one's memory is its own
//! `/proc/<pid>/status`: this binary started with `--serve-reference` is `sandspec serve` (the
//! same `reference_server::cli` code, real worker processes, the fixture model), and with
//! `--serve-baseline` a bare axum SSE handler fed by a tokio broadcast channel, its
//! connections served the way the reference server serves its own. The client runs here and
//! is the same code for both: plain TCP with the HTTP/1.1 request written by hand.
//!
//! With `--smoke`, or without `--bench` (as `cargo test --benches` starts it), it makes a
//! smoke pass with a handful of samples. The result is a Markdown table on stdout; progress
//! goes to stderr.

mod client;
mod fanout;
mod queue;
mod report;
mod servers;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use pg_cluster::PgCluster;

use client::{Api, first_frame};
use fanout::{Fanout, fan_out};
use queue::{Queue, queue};
use servers::{ServerProcess, serve_baseline, serve_reference};

/// First argument that makes this process the reference server.
const SERVE_REFERENCE: &str = "--serve-reference";
/// First argument that makes this process the baseline server.
const SERVE_BASELINE: &str = "--serve-baseline";
/// The one principal of the reference server.
const TOKEN: &str = "bench-token";
/// The fixture model script every benchmark session runs: one model call that answers at once.
const MODEL: &str = "echo";
/// What a subscriber of the reference server waits for at the end of each round.
const REFERENCE_ROUND_END: &str = "submission.completed";
/// What a subscriber of the baseline waits for at the end of each round.
const BASELINE_ROUND_END: &str = "round.end";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some(SERVE_REFERENCE) => return serve_reference(&args[1..]),
        Some(SERVE_BASELINE) => return serve_baseline(),
        _ => {}
    }
    match orchestrate(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gateway bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// How many samples each benchmark takes.
#[derive(Debug, Clone)]
struct Settings {
    mode: &'static str,
    /// Time-to-first-frame samples per variant.
    ttfb_samples: usize,
    /// Concurrent SSE subscribers of one stream.
    subscribers: usize,
    /// Measured rounds of events delivered to every subscriber (one warm-up round more).
    rounds: usize,
    /// Sessions submitted to in parallel.
    queue_sessions: usize,
    /// Submissions per session per repetition.
    queue_turns: usize,
    /// Repetitions of the queue and plain-request measurements.
    reps: usize,
    /// Plain requests per repetition of the request-throughput baseline.
    get_requests: usize,
    /// Concurrent clients of the request-throughput baseline.
    get_concurrency: usize,
}

impl Settings {
    const USAGE: &str = "usage: gateway [--bench] [--quick | --smoke] [--samples N] \
                         [--subscribers N] [--rounds N] [--sessions N] [--turns N] [--reps N]";

    fn full() -> Self {
        Self {
            mode: "full",
            ttfb_samples: 500,
            subscribers: 1000,
            rounds: 30,
            queue_sessions: 4,
            queue_turns: 16,
            reps: 5,
            get_requests: 4000,
            get_concurrency: 8,
        }
    }

    fn quick() -> Self {
        Self {
            mode: "quick",
            ttfb_samples: 100,
            subscribers: 1000,
            rounds: 5,
            queue_sessions: 2,
            queue_turns: 8,
            reps: 3,
            get_requests: 1000,
            get_concurrency: 8,
        }
    }

    fn smoke() -> Self {
        Self {
            mode: "smoke",
            ttfb_samples: 5,
            subscribers: 20,
            rounds: 2,
            queue_sessions: 1,
            queue_turns: 2,
            reps: 1,
            get_requests: 100,
            get_concurrency: 2,
        }
    }

    fn parse(args: &[String]) -> anyhow::Result<Self> {
        let mut settings = if args.iter().any(|a| a == "--smoke") {
            Self::smoke()
        } else if args.iter().any(|a| a == "--quick") {
            Self::quick()
        } else if args.iter().any(|a| a == "--bench") {
            Self::full()
        } else {
            Self::smoke()
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let field = match arg.as_str() {
                "--bench" | "--quick" | "--smoke" => continue,
                "--samples" => &mut settings.ttfb_samples,
                "--subscribers" => &mut settings.subscribers,
                "--rounds" => &mut settings.rounds,
                "--sessions" => &mut settings.queue_sessions,
                "--turns" => &mut settings.queue_turns,
                "--reps" => &mut settings.reps,
                other => bail!("unknown argument `{other}`\n{}", Self::USAGE),
            };
            *field = it
                .next()
                .and_then(|v| v.parse().ok())
                .filter(|n| *n > 0)
                .with_context(|| format!("{arg} needs a positive number\n{}", Self::USAGE))?;
        }
        Ok(settings)
    }
}

fn orchestrate(args: &[String]) -> anyhow::Result<()> {
    let settings = Settings::parse(args)?;
    raise_fd_limit()?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("failed to start the runtime")?;
    let started = Instant::now();
    let results = runtime.block_on(run_all(&settings))?;
    print!("{}", results.table(&settings));
    eprintln!(
        "gateway bench ({} run) took {:.0} s",
        settings.mode,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Everything one run measured.
struct Results {
    /// Events in the idle session's log, replayed by a new stream.
    idle_events: i64,
    ttfb_fresh: Vec<Duration>,
    ttfb_resumed: Vec<Duration>,
    ttfb_baseline: Vec<Duration>,
    fanout: Fanout,
    fanout_baseline: Fanout,
    sqlite: Queue,
    postgres: Result<Queue, String>,
}

async fn run_all(settings: &Settings) -> anyhow::Result<Results> {
    let baseline = ServerProcess::baseline().await?;
    let reference = ServerProcess::reference(None).await?;
    let api = Api::new(&reference)?;

    eprintln!(
        "time to first frame: {} samples per variant",
        settings.ttfb_samples
    );
    let idle = api.create_session().await?;
    let idle_path = format!("/v1/sessions/{idle}/events");
    let idle_end = api.last_seq(&idle).await?;
    let (mut ttfb_fresh, mut ttfb_resumed, mut ttfb_baseline) = (vec![], vec![], vec![]);
    // Interleaved, so that drift in the machine's load touches all three alike.
    for _ in 0..settings.ttfb_samples {
        ttfb_fresh.push(first_frame(reference.addr, &idle_path, None).await?);
        ttfb_resumed.push(first_frame(reference.addr, &idle_path, Some(idle_end)).await?);
        ttfb_baseline.push(first_frame(baseline.addr, "/events", None).await?);
    }

    eprintln!(
        "fan-out: {} subscribers, {} rounds",
        settings.subscribers, settings.rounds
    );
    let busy = api.create_session().await?;
    api.run_turns(&reference, &busy, 1).await?;
    let busy_end = api.last_seq(&busy).await?;
    let fanout = fan_out(
        &reference,
        &format!("/v1/sessions/{busy}/events"),
        Some(busy_end),
        REFERENCE_ROUND_END,
        settings,
        async |round| api.submit(&busy, &format!("fan-{round}")).await,
    )
    .await?;
    // The baseline delivers as many events per round as the reference did.
    let per_round = fanout.events_per_subscriber / (settings.rounds + 1);
    let publish = reqwest::Client::new();
    let publish_url = format!("{}/publish?n={}", baseline.base, per_round.max(1));
    let fanout_baseline = fan_out(
        &baseline,
        "/events",
        None,
        BASELINE_ROUND_END,
        settings,
        async |_| {
            let status = publish.post(&publish_url).send().await?.status();
            ensure!(status.is_success(), "publish answered {status}");
            Ok(())
        },
    )
    .await?;
    baseline.stop().await;

    eprintln!(
        "queue on SQLite: {} sessions x {} turns, {} repetitions",
        settings.queue_sessions, settings.queue_turns, settings.reps
    );
    let sqlite = queue(&reference, &api, settings).await?;
    reference.stop().await;

    eprintln!("queue on PostgreSQL");
    let postgres = match tokio::task::spawn_blocking(PgCluster::launch).await? {
        Ok(cluster) => {
            let url = cluster.create_database("gateway_bench").await;
            let server = ServerProcess::reference(Some(&url)).await?;
            let api = Api::new(&server)?;
            let measured = queue(&server, &api, settings).await?;
            server.stop().await;
            drop(cluster);
            Ok(measured)
        }
        Err(e) => {
            let reason = e.to_string().lines().next().unwrap_or("").to_owned();
            eprintln!("PostgreSQL not measured: {reason}");
            Err(reason)
        }
    };
    Ok(Results {
        idle_events: idle_end,
        ttfb_fresh,
        ttfb_resumed,
        ttfb_baseline,
        fanout,
        fanout_baseline,
        sqlite,
        postgres,
    })
}

/// Raises the soft limit on open files to the hard one: a thousand streams take as many
/// sockets on each side.
fn raise_fd_limit() -> anyhow::Result<()> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass and nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        bail!(
            "failed to read RLIMIT_NOFILE: {}",
            std::io::Error::last_os_error()
        );
    }
    limit.rlim_cur = limit.rlim_max;
    // SAFETY: setrlimit reads the struct we pass; raising the soft limit to the hard one is
    // always allowed.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        bail!(
            "failed to raise RLIMIT_NOFILE: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}
