//! The servers under test, each a child process of this binary: the reference server
//! (`sandspec serve`) and the baseline (a bare axum SSE handler).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use clap::Parser as _;
use futures_util::{Stream, StreamExt as _};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::json;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::io::AsyncBufReadExt as _;
use tokio::sync::broadcast;

use crate::{BASELINE_ROUND_END, SERVE_BASELINE, SERVE_REFERENCE, TOKEN, raise_fd_limit};

/// A server under test, running as a child process of this binary.
pub struct ServerProcess {
    child: tokio::process::Child,
    pid: i32,
    pub addr: SocketAddr,
    pub base: String,
    /// The data directory (sandboxes, the SQLite file); removed after the server stops.
    _data: Option<tempfile::TempDir>,
}

impl ServerProcess {
    /// `sandspec serve` on a fresh data directory; SQLite in it unless `database_url` is given.
    pub async fn reference(database_url: Option<&str>) -> anyhow::Result<Self> {
        let data = tempfile::Builder::new()
            .prefix("sandspec-bench-")
            .tempdir()
            .context("failed to create a data directory")?;
        let mut args: Vec<String> = vec![
            SERVE_REFERENCE.into(),
            "--principal".into(),
            format!("bench:{TOKEN}"),
            "--data-dir".into(),
            data.path().join("data").display().to_string(),
        ];
        for limit in [
            "max_streams_per_principal=100000",
            "max_stream_duration_s=3600",
            "max_queue_depth=100000",
        ] {
            args.extend(["--limit".into(), limit.into()]);
        }
        if let Some(url) = database_url {
            args.extend(["--database-url".into(), url.into()]);
        }
        Self::spawn(args, Some(data)).await
    }

    /// The baseline server.
    pub async fn baseline() -> anyhow::Result<Self> {
        Self::spawn(vec![SERVE_BASELINE.into()], None).await
    }

    async fn spawn(args: Vec<String>, data: Option<tempfile::TempDir>) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("failed to find this executable")?;
        let mut command = tokio::process::Command::new(exe);
        command
            .args(&args)
            .env("RUST_LOG", "warn")
            .env("SANDSPEC_WORKER_BIN", env!("CARGO_BIN_EXE_sandspec-worker"))
            .env(
                "SANDSPEC_FIXTURES_DIR",
                concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/models"),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // Always the fixture model, never a live provider configured in the environment.
        for var in [
            "SANDSPEC_MODEL_BASE_URL",
            "SANDSPEC_MODEL_API_KEY",
            "SANDSPEC_MODEL",
        ] {
            command.env_remove(var);
        }
        let mut child = command.spawn().context("failed to start a server")?;
        let pid = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .context("the server has no pid")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .context("the server did not start within 60 s")??
            .context("the server exited before listening")?;
        let base = line
            .strip_prefix("listening on ")
            .with_context(|| format!("unexpected first line from the server: {line}"))?
            .to_owned();
        let addr = base
            .strip_prefix("http://")
            .and_then(|a| a.parse().ok())
            .with_context(|| format!("not a plain HTTP address: {base}"))?;
        Ok(Self {
            child,
            pid,
            addr,
            base,
            _data: data,
        })
    }

    /// The resident set size, in KiB.
    pub fn rss_kib(&self) -> anyhow::Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))
            .context("failed to read the server's /proc status")?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .context("no VmRSS in the server's /proc status")
    }

    /// SIGTERM (the server ends its streams and its sandbox processes), then waits.
    pub async fn stop(mut self) {
        // SAFETY: signals our own child, which has not been reaped yet (we hold it).
        unsafe { libc::kill(self.pid, libc::SIGTERM) };
        if tokio::time::timeout(Duration::from_secs(20), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // After an error: let the server end its sandbox processes on its way out.
            // SAFETY: as in `stop`.
            unsafe { libc::kill(self.pid, libc::SIGTERM) };
        }
    }
}

/// `sandspec serve` with the arguments after `--serve-reference`.
pub fn serve_reference(args: &[String]) -> ExitCode {
    #[derive(clap::Parser)]
    struct Serve {
        #[command(flatten)]
        args: reference_server::cli::ServeArgs,
    }
    let serve = Serve::parse_from(std::iter::once("serve").chain(args.iter().map(String::as_str)));
    if let Err(e) = raise_fd_limit() {
        eprintln!("{e:#}");
        return ExitCode::FAILURE;
    }
    reference_server::cli::main(serve.args)
}

/// The baseline: a bare axum SSE handler that sends a comment at once, then every message of
/// a tokio broadcast channel; `POST /publish?n=N` sends N messages stamped with the time.
pub fn serve_baseline() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("baseline: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(baseline_server()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("baseline: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn baseline_server() -> anyhow::Result<()> {
    use axum::routing::{get, post};
    use tower::ServiceExt as _;
    raise_fd_limit()?;
    let (tx, _) = broadcast::channel::<String>(1024);
    let app = axum::Router::new()
        .route("/events", get(baseline_events))
        .route("/publish", post(baseline_publish))
        .with_state(tx);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening on http://{}", listener.local_addr()?);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // Connections are served as the reference server serves them (`server::serve_connection`:
    // one task each, hyper's HTTP/1 with the same timer settings), so that the comparison is
    // of what happens above the connection.
    loop {
        let (stream, _) = tokio::select! {
            _ = term.recv() => return Ok(()),
            accepted = listener.accept() => accepted?,
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                app.clone().oneshot(req.map(axum::body::Body::new))
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(30))
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn baseline_events(
    State(tx): State<broadcast::Sender<String>>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let opening = futures_util::stream::once(async { Ok(Event::default().comment("ping")) });
    let live = tokio_stream::wrappers::BroadcastStream::new(tx.subscribe())
        .filter_map(|m| async move { m.ok().map(|data| Ok(Event::default().data(data))) });
    Sse::new(opening.chain(live))
}

async fn baseline_publish(
    State(tx): State<broadcast::Sender<String>>,
    Query(q): Query<std::collections::HashMap<String, usize>>,
) -> StatusCode {
    let n = q.get("n").copied().unwrap_or(1);
    for i in 0..n {
        let kind = if i + 1 == n {
            BASELINE_ROUND_END
        } else {
            "tick"
        };
        let data = json!({"type": kind, "created_at": timestamp()});
        // No subscriber is not an error for a broadcast.
        let _ = tx.send(data.to_string());
    }
    StatusCode::NO_CONTENT
}

/// Now, as the reference server stamps events (`created_at`, microseconds, RFC 3339).
fn timestamp() -> String {
    let t = OffsetDateTime::now_utc();
    t.replace_nanosecond(t.nanosecond() / 1000 * 1000)
        .unwrap_or(t)
        .format(&Rfc3339)
        .unwrap_or_default()
}
