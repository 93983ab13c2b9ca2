//! The Agent Sandbox service as the runner launches it itself (`--launch`).
//!
//! A launched service gets what a deployment would give it: a policy file naming two
//! principals whose tokens are fresh for the run and reach it only through environment
//! variables (the policy's `token_env`, never the command line), a free loopback port and a
//! base directory of its own. The runner waits for `GET /health`, and stops the service's
//! whole process group at the end, so that nothing it started outlives the run.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::target::{Capabilities, Service, TargetError, Tokens, build_client, random_token};

/// The environment variable the stand-in reads its defect from.
pub const DEFECT_ENV: &str = "SANDSPEC_ASB_DEFECT";

/// Environment of a launched command: the port to listen on, the policy file, the base
/// directory, and the two principals' tokens (named by the policy file, read by the service).
pub const PORT_ENV: &str = "SANDSPEC_PORT";
pub const POLICY_ENV: &str = "SANDSPEC_POLICY";
pub const BASE_DIR_ENV: &str = "SANDSPEC_BASE_DIR";
pub const OWNER_TOKEN_ENV: &str = "SANDSPEC_OWNER_TOKEN";
pub const OTHER_TOKEN_ENV: &str = "SANDSPEC_OTHER_TOKEN";
/// A directory for the service's own state, empty at the start of the run and kept across
/// restarts (the package keeps agent sessions in `ABX_AGENTS_STATE_DIR`).
pub const STATE_DIR_ENV: &str = "SANDSPEC_STATE_DIR";

/// A principal's token, as the service takes it.
pub(super) fn bearer(token: &str) -> (&'static str, String) {
    ("Authorization", format!("Bearer {token}"))
}

/// The policy file of a launched service: two principals with every scope, their tokens
/// in the named environment variables, and the opt-in Agents API switched on.
pub fn policy_json() -> String {
    serde_json::json!({
        "version": 1,
        "description": "sandspec run: two principals with fresh tokens",
        "groups": ["agents"],
        "auth": {"tokens": [
            {"id": "alice", "scopes": ["*"], "token_env": OWNER_TOKEN_ENV},
            {"id": "bob", "scopes": ["*"], "token_env": OTHER_TOKEN_ENV},
        ]},
    })
    .to_string()
}

/// A service the runner started with `--launch`; its process group is stopped on drop.
pub struct LaunchedService {
    pub url: String,
    pub tokens: Tokens,
    /// The command, run again as it was by a restart.
    command: String,
    port: u16,
    /// `sh -c <command>`, leader of its own process group: stopping the group reaches the
    /// service and every process it started, however the command wraps it.
    child: tokio::process::Child,
    /// The service's recent output, for the message when it will not start.
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// The tasks reading its stdout and stderr into `log`; they end at the pipes' EOF.
    readers: Vec<tokio::task::JoinHandle<()>>,
    /// Holds the policy file, the base directory and the state directory; removed on drop.
    dir: tempfile::TempDir,
}

impl LaunchedService {
    /// Runs `command` with `sh -c`, then waits until `GET /health` answers 200.
    pub async fn start(command: &str) -> Result<LaunchedService, TargetError> {
        let spawn_err = |reason: String| TargetError::Spawn {
            binary: format!("--launch `{command}`"),
            reason,
        };
        let dir =
            tempfile::tempdir().map_err(|e| spawn_err(format!("temporary directory: {e}")))?;
        std::fs::write(dir.path().join("policy.json"), policy_json())
            .map_err(|e| spawn_err(format!("policy: {e}")))?;
        for sub in ["base", "state"] {
            std::fs::create_dir(dir.path().join(sub))
                .map_err(|e| spawn_err(format!("{sub} directory: {e}")))?;
        }
        let port = free_port().map_err(|e| spawn_err(format!("no free port: {e}")))?;
        let tokens = Tokens {
            owner: random_token(),
            other: random_token(),
            admin: None,
        };
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (child, readers) = spawn(command, dir.path(), port, &tokens, &log)?;
        let mut service = LaunchedService {
            url: format!("http://127.0.0.1:{port}"),
            tokens,
            command: command.to_owned(),
            port,
            child,
            log,
            readers,
            dir,
        };
        service.wait_healthy().await?;
        Ok(service)
    }

    /// Stops the service (its whole process group) and starts the same command again, on
    /// the same port, with the same tokens and directories.
    pub async fn restart(&mut self) -> Result<(), TargetError> {
        self.stop();
        self.log.lock().expect("log lock").clear();
        (self.child, self.readers) = spawn(
            &self.command,
            self.dir.path(),
            self.port,
            &self.tokens,
            &self.log,
        )?;
        self.wait_healthy().await
    }

    /// SIGKILL to the service's whole process group, as a crash: nothing of its shutdown
    /// runs. Answers once the service's process has been reaped.
    pub async fn kill(&mut self) -> Result<(), TargetError> {
        if let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok()) {
            // SAFETY: killpg(2) on the process group our own unreaped child leads.
            unsafe { libc::killpg(pid, libc::SIGKILL) };
        }
        let _ = self.child.start_kill();
        self.child.wait().await.map_err(|e| TargetError::Spawn {
            binary: format!("--launch `{}`", self.command),
            reason: format!("waiting for the killed service: {e}"),
        })?;
        Ok(())
    }

    /// Starts the command again after a kill, on the same port, tokens and directories,
    /// and waits until it is healthy; `Ok(false)` when the service is running (nothing to
    /// start).
    pub async fn start_again(&mut self) -> Result<bool, TargetError> {
        if matches!(self.child.try_wait(), Ok(None)) {
            return Ok(false);
        }
        self.log.lock().expect("log lock").clear();
        (self.child, self.readers) = spawn(
            &self.command,
            self.dir.path(),
            self.port,
            &self.tokens,
            &self.log,
        )?;
        self.wait_healthy().await?;
        Ok(true)
    }

    /// The base directory as scenarios see it (`{{base_dir}}`).
    pub fn base_dir(&self) -> PathBuf {
        self.dir.path().join("base")
    }

    async fn wait_healthy(&mut self) -> Result<(), TargetError> {
        let spawn_err = |reason: String| TargetError::Spawn {
            binary: format!("--launch `{}`", self.command),
            reason,
        };
        let client = build_client(None)?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                // Its output up to the pipes' end, however long its last line.
                for reader in self.readers.drain(..) {
                    let _ = tokio::time::timeout(Duration::from_secs(5), reader).await;
                }
                let tail = self.log.lock().expect("log lock").join("\n");
                return Err(spawn_err(format!(
                    "exited ({status}) before it was healthy; its output:\n{tail}"
                )));
            }
            let healthy = client
                .get(format!("{}/health", self.url))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status() == reqwest::StatusCode::OK);
            if healthy {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(spawn_err(format!(
                    "{}/health did not answer 200 within 30 s",
                    self.url
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGTERM to the process group, SIGKILL to what is left after a grace period.
    fn stop(&mut self) {
        const GRACE: Duration = Duration::from_secs(5);
        let Some(pid) = self.child.id() else { return };
        let Ok(pgid) = i32::try_from(pid) else { return };
        // SAFETY: killpg(2) on the process group our own unreaped child leads.
        if unsafe { libc::killpg(pgid, libc::SIGTERM) } != 0 {
            return;
        }
        let deadline = std::time::Instant::now() + GRACE;
        while std::time::Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Whatever the service started and left behind is in the group too.
        // SAFETY: as above; the group may already be empty, which is fine.
        unsafe { libc::killpg(pgid, libc::SIGKILL) };
        let _ = self.child.start_kill();
    }
}

/// Starts `sh -c command` in its own process group, with the launch environment, its
/// output collected into `log`.
fn spawn(
    command: &str,
    dir: &Path,
    port: u16,
    tokens: &Tokens,
    log: &std::sync::Arc<std::sync::Mutex<Vec<String>>>,
) -> Result<(tokio::process::Child, Vec<tokio::task::JoinHandle<()>>), TargetError> {
    let base_dir = dir.join("base");
    let mut cmd = tokio::process::Command::new("sh");
    cmd.arg("-c")
        .arg(command)
        .env(PORT_ENV, port.to_string())
        .env(POLICY_ENV, dir.join("policy.json"))
        .env(BASE_DIR_ENV, &base_dir)
        .env(STATE_DIR_ENV, dir.join("state"))
        .env(OWNER_TOKEN_ENV, &tokens.owner)
        .env(OTHER_TOKEN_ENV, &tokens.other)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|e| TargetError::Spawn {
        binary: format!("--launch `{command}`"),
        reason: e.to_string(),
    })?;
    let mut readers = Vec::new();
    for pipe in [
        child.stdout.take().map(Pipe::Out),
        child.stderr.take().map(Pipe::Err),
    ]
    .into_iter()
    .flatten()
    {
        let log = log.clone();
        readers.push(tokio::spawn(async move {
            let reader: Box<dyn tokio::io::AsyncRead + Send + Unpin> = match pipe {
                Pipe::Out(p) => Box::new(p),
                Pipe::Err(p) => Box::new(p),
            };
            // Each line is kept up to the output line cap; a longer one is read and cut.
            let mut reader = tokio::io::BufReader::new(reader);
            while let Ok(Some(line)) = crate::target::next_output_line(&mut reader).await {
                let mut log = log.lock().expect("log lock");
                if log.len() < 200 {
                    log.push(line.shown());
                }
            }
        }));
    }
    Ok((child, readers))
}

enum Pipe {
    Out(tokio::process::ChildStdout),
    Err(tokio::process::ChildStderr),
}

/// A loopback port nothing listens on now (the service binds it a moment later).
fn free_port() -> std::io::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

impl Service for LaunchedService {
    fn kill(&mut self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { LaunchedService::kill(self).await.map_err(|e| e.to_string()) })
    }

    fn start_again(&mut self) -> BoxFuture<'_, Result<bool, String>> {
        Box::pin(async {
            LaunchedService::start_again(self)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn restart(&mut self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async {
            LaunchedService::restart(self)
                .await
                .map_err(|e| e.to_string())
        })
    }
}

/// What the run knows of a launched service: the directory it confines files to (scenarios
/// see it as `{{base_dir}}`), and its `GET /capabilities` document when it serves one, kept
/// for the report (and its `server_version`), never read for features.
pub(super) async fn capabilities_of(
    service: &LaunchedService,
) -> Result<Capabilities, TargetError> {
    let client = build_client(None)?;
    let (name, value) = bearer(&service.tokens.owner);
    let document = match client
        .get(format!("{}/capabilities", service.url))
        .header(name, value)
        .timeout(crate::target::DEFAULT_REQUEST_TIMEOUT)
        .send()
        .await
    {
        Ok(r) if r.status().is_success() => {
            crate::target::read_body(r, crate::target::ReadLimits::default(), None)
                .await
                .ok()
                .and_then(|body| serde_json::from_slice::<serde_json::Value>(&body).ok())
        }
        _ => None,
    };
    Ok(Capabilities {
        base_dir: Some(service.base_dir().display().to_string()),
        server_version: document
            .as_ref()
            .and_then(|d| d.get("server_version"))
            .and_then(|v| v.as_str())
            .map(str::to_owned),
        raw: document.unwrap_or_default(),
        ..Capabilities::default()
    })
}

impl Drop for LaunchedService {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_names_two_principals_by_environment_variable() {
        let policy: serde_json::Value = serde_json::from_str(&policy_json()).unwrap();
        let tokens = policy["auth"]["tokens"].as_array().unwrap();
        assert_eq!(tokens.len(), 2);
        assert_eq!(tokens[0]["token_env"], OWNER_TOKEN_ENV);
        assert_eq!(tokens[1]["token_env"], OTHER_TOKEN_ENV);
        assert!(!policy_json().contains("sst_"));
    }
}
