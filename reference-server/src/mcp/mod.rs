//! `sandspec mcp`: the reference sandbox MCP server, over stdio or MCP's streamable HTTP
//! transport (`--listen`), in front of an E2B-style control plane (the reference server's E2B
//! surface, or any other).
//!
//! It is the reference implementation of what the runner's MCP profile checks:
//!
//! - at shutdown it kills the sandboxes it created and never the ones it only connected to;
//! - every handle it returns is provider-qualified (`e2b:<sandboxID>`);
//! - an explicit `cpu` / `memory_mb` requirement is checked against the control plane's
//!   readback, and a sandbox that falls short is killed and the create refused;
//! - a create still in flight when the session ends is awaited and its sandbox, and only it,
//!   killed.
//!
//! The control plane is named by `E2B_API_URL` and its key by `E2B_API_KEY`, as for E2B's own
//! SDK. On stdio the one session ends when stdin closes or on SIGTERM; cleanup runs before the
//! process exits. Over HTTP each session ends with its `DELETE` or when it expires (`http`),
//! and every open one at SIGTERM or SIGINT.

mod control;
mod http;
mod replay;
mod tools;

use std::process::ExitCode;

use clap::Args;
use rmcp::ServiceExt as _;

use crate::defects::Defects;

pub use control::ControlPlane;
pub use http::{HttpOptions, PATH};
pub use tools::{PROVIDER, SandboxTools};

/// Arguments of `sandspec mcp`.
#[derive(Debug, Clone, Args)]
pub struct McpArgs {
    /// Switch on a deliberate bug (repeatable; only in builds with the `defects` feature).
    #[arg(long = "defect", value_name = "NAME")]
    pub defects: Vec<String>,
    /// Serve MCP's streamable HTTP transport at `http://ADDR/mcp` instead of stdio (port 0
    /// for any free port); prints `listening on http://ADDR/mcp` once bound.
    #[arg(long, value_name = "ADDR", requires = "token_env")]
    pub listen: Option<std::net::SocketAddr>,
    /// With --listen: the environment variable holding the bearer token every request must
    /// carry (`Authorization: Bearer ...`; without it, or with another, 401).
    #[arg(long, value_name = "NAME", requires = "listen")]
    pub token_env: Option<String>,
    /// With --listen: a session idle this long expires, and what it owned is disposed of as
    /// at its `DELETE` (`300`, in seconds).
    #[arg(long, value_name = "SECONDS", default_value_t = 300, requires = "listen",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub session_idle_s: u64,
}

/// Environment variable naming the control plane's base URL.
pub const URL_ENV: &str = "E2B_API_URL";
/// Environment variable holding the control plane's API key.
pub const KEY_ENV: &str = "E2B_API_KEY";

/// Runs `sandspec mcp` to the end of its session. Exit 2: bad flags or environment; 1: the
/// session failed.
pub fn run_blocking(args: McpArgs) -> ExitCode {
    let defects = match Defects::parse(args.defects.iter().map(String::as_str)) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let (url, key) = match (std::env::var(URL_ENV), std::env::var(KEY_ENV)) {
        (Ok(url), Ok(key)) if !url.is_empty() && !key.is_empty() => (url, key),
        _ => {
            eprintln!("error: set {URL_ENV} (control-plane base URL) and {KEY_ENV} (its API key)");
            return ExitCode::from(2);
        }
    };
    // reqwest is built without a TLS provider of its own; this is the workspace's one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let control = match ControlPlane::new(&url, key) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let http = match (&args.listen, &args.token_env) {
        (Some(addr), Some(name)) => match std::env::var(name) {
            Ok(token) if !token.is_empty() => Some((
                *addr,
                HttpOptions {
                    token,
                    idle: std::time::Duration::from_secs(args.session_idle_s),
                },
            )),
            _ => {
                eprintln!("error: --token-env names {name}, which is not set or empty");
                return ExitCode::from(2);
            }
        },
        _ => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let served = match http {
        Some((addr, options)) => runtime.block_on(serve_http(addr, control, defects, options)),
        None => runtime.block_on(serve_stdio(control, defects)),
    };
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Binds `addr`, says where it serves (one line on stdout), and serves MCP over streamable
/// HTTP until SIGTERM or SIGINT, when every open session ends as its `DELETE` would.
pub async fn serve_http(
    addr: std::net::SocketAddr,
    control: ControlPlane,
    defects: Defects,
    options: HttpOptions,
) -> anyhow::Result<()> {
    use std::io::Write as _;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("bind {addr}: {e}"))?;
    let local = listener.local_addr()?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening on http://{local}{PATH}")?;
    out.flush()?;
    drop(out);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let stop = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    };
    http::serve(listener, control, defects, options, stop).await?;
    Ok(())
}

/// Serves one MCP session on stdin/stdout, then disposes of what the session owns.
///
/// The session ends when stdin reaches EOF, and that is when it is marked ended: rmcp's serve
/// loop, on EOF, first lets the requests it is serving finish (for up to a few seconds) before
/// `waiting()` returns, and a create completing in that window must already count as late.
pub async fn serve_stdio(control: ControlPlane, defects: Defects) -> anyhow::Result<()> {
    let tools = SandboxTools::new(control, defects);
    let (eof_tx, eof_rx) = tokio::sync::oneshot::channel();
    let stdin = EofSignal {
        inner: tokio::io::stdin(),
        eof: Some(eof_tx),
    };
    let service = tools
        .clone()
        .serve((stdin, tokio::io::stdout()))
        .await
        .map_err(|e| anyhow::anyhow!("initialize the MCP session: {e}"))?;
    let ender = tools.clone();
    tokio::spawn(async move {
        if eof_rx.await.is_ok() {
            ender.end_session();
        }
    });
    let token = service.cancellation_token();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = service.waiting() => {}
        _ = term.recv() => {
            tools.end_session();
            token.cancel();
        }
    }
    tools.shutdown().await;
    Ok(())
}

/// A reader that says once when it reaches EOF (a read that returns no bytes into a buffer
/// with room for some).
struct EofSignal<R> {
    inner: R,
    /// Fired at the first EOF.
    eof: Option<tokio::sync::oneshot::Sender<()>>,
}

impl<R: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for EofSignal<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let room = buf.remaining() > 0;
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if let std::task::Poll::Ready(Ok(())) = &polled
            && room
            && buf.filled().len() == before
            && let Some(tx) = self.eof.take()
        {
            let _ = tx.send(());
        }
        polled
    }
}
