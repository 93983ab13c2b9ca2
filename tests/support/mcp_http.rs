//! `sandspec mcp --listen` as a child process, the reference MCP server over streamable HTTP
//! on a free loopback port, in front of a control plane, with a bearer token made at run time
//! and handed over in its environment. Shared by the test binaries that drive it (the
//! conformance harness includes it by path, with `serve.rs` beside it).

use super::serve;

use std::process::Stdio;

/// The variable `sandspec mcp --token-env` is told to read.
const TOKEN_ENV: &str = "SANDSPEC_MCP_TOKEN";

/// A running `sandspec mcp --listen`; killed when dropped.
pub struct McpHttp {
    /// The MCP endpoint: `http://127.0.0.1:<port>/mcp`.
    pub url: String,
    /// The bearer token it requires.
    pub token: String,
    child: tokio::process::Child,
}

impl McpHttp {
    /// Starts `binary mcp --listen 127.0.0.1:0` over the E2B control plane at `control` with
    /// the API key `key`, with the deliberate `defects` and `extra` arguments, and waits until
    /// it listens.
    pub async fn start(
        binary: &str,
        control: &str,
        key: &str,
        defects: &[&str],
        extra: &[&str],
    ) -> McpHttp {
        let token = sandspec::target::random_token();
        let mut command = tokio::process::Command::new(binary);
        command
            .args(["mcp", "--listen", "127.0.0.1:0", "--token-env", TOKEN_ENV])
            .args(extra)
            .env("E2B_API_URL", control)
            .env("E2B_API_KEY", key)
            .env(TOKEN_ENV, &token)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        for d in defects {
            command.args(["--defect", d]);
        }
        let mut child = command.spawn().expect("start sandspec mcp --listen");
        let url = serve::base_url(&mut child).await;
        McpHttp { url, token, child }
    }

    /// The server as the runner drives it.
    pub fn server(&self) -> sandspec::mcp::HttpServer {
        sandspec::mcp::HttpServer {
            url: self.url.clone(),
            token: Some(self.token.clone()),
        }
    }

    /// SIGTERM, as a service manager stops it, and how it exited.
    pub async fn stop(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().expect("the server is running");
        // SAFETY: kill(2) on our own child's pid; it has not been reaped yet.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
        tokio::time::timeout(serve::START_WITHIN, self.child.wait())
            .await
            .expect("sandspec mcp exits after SIGTERM")
            .expect("wait for sandspec mcp")
    }
}
