//! The Agent Sandbox profile (`--api agent-sandbox`): its clause document, the deliberate
//! defects of its stand-in, and the service the runner launches itself (`--launch`).
//!
//! A launched service gets what a deployment would give it: a policy file naming two
//! principals whose tokens are fresh for the run and reach it only through environment
//! variables (the policy's `token_env`, never the command line), a free loopback port and a
//! base directory of its own. The runner waits for `GET /health`, and stops the service's
//! whole process group at the end, so that nothing it started outlives the run.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncBufReadExt as _;

use crate::target::{TargetError, Tokens};

/// The profile's catalog: this folder of the catalog root.
pub const CATALOG_FOLDER: &str = "agent-sandbox";

/// The clause document; the profile's scenarios cite its clause IDs.
const CLAUSES_DOC: &str = include_str!("../docs/profiles/agent-sandbox.md");

/// The deliberate defects of the stand-in (`fixtures/agent-sandbox/defects.py`, loaded into
/// the real service with `--commands` and chosen with [`DEFECT_ENV`]). A MUST scenario of
/// this profile names the ones it catches; `tests/agent_sandbox.rs` proves each catch.
pub const DEFECTS: &[&str] = &[
    "asb-any-token-accepted",
    "asb-sessions-shared",
    "asb-paths-unconfined",
    "asb-bad-input-500",
    "asb-turns-concurrent",
    "asb-idempotency-ignored",
    "asb-cancel-ignored",
    "asb-no-heartbeat",
];

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

/// Whether `id` is a clause of the profile's document: a row `| \`ASB-...\` |` of its
/// "Clauses" table.
pub fn is_clause(id: &str) -> bool {
    clauses().any(|c| c == id)
}

/// Every clause ID the document defines.
pub fn clauses() -> impl Iterator<Item = &'static str> {
    CLAUSES_DOC
        .lines()
        .skip_while(|line| *line != "## Clauses")
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .filter_map(|line| {
            let rest = line.strip_prefix("| `")?;
            let (id, _) = rest.split_once('`')?;
            id.starts_with("ASB-").then_some(id)
        })
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
            owner: crate::target::random_token(),
            other: crate::target::random_token(),
            admin: None,
        };
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let child = spawn(command, dir.path(), port, &tokens, &log)?;
        let mut service = LaunchedService {
            url: format!("http://127.0.0.1:{port}"),
            tokens,
            command: command.to_owned(),
            port,
            child,
            log,
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
        self.child = spawn(
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
        self.child = spawn(
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
        let client = crate::target::build_client(None)?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                tokio::time::sleep(Duration::from_millis(100)).await;
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
) -> Result<tokio::process::Child, TargetError> {
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
    for pipe in [
        child.stdout.take().map(Pipe::Out),
        child.stderr.take().map(Pipe::Err),
    ]
    .into_iter()
    .flatten()
    {
        let log = log.clone();
        tokio::spawn(async move {
            let reader: Box<dyn tokio::io::AsyncRead + Send + Unpin> = match pipe {
                Pipe::Out(p) => Box::new(p),
                Pipe::Err(p) => Box::new(p),
            };
            let mut lines = tokio::io::BufReader::new(reader).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let mut log = log.lock().expect("log lock");
                if log.len() < 200 {
                    log.push(line);
                }
            }
        });
    }
    Ok(child)
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

impl Drop for LaunchedService {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The end-of-run sweep: for both principals, every agent session `GET /v1/agents/sessions`
/// lists whose own metadata carries this run's `sandspec_run` is deleted and confirmed gone
/// (each a cleanup failure of the run). Processes and files carry no metadata; scenarios
/// clean them up themselves, and a launched service's process group is stopped at the end.
pub async fn sweep_run(target: &crate::target::Target, run_id: &str) -> crate::live::RunSweep {
    const LIST: &str = "/v1/agents/sessions";
    let mut sweep = crate::live::RunSweep::default();
    let mut errors = Vec::new();
    for (principal, token) in [
        ("owner", target.tokens.owner.as_str()),
        ("other", target.tokens.other.as_str()),
    ] {
        let records = match list_sessions(target, token).await {
            Ok(r) => r,
            Err(e) => {
                errors.push(format!("{e} (as {principal})"));
                continue;
            }
        };
        let listed = crate::live::Listed {
            principal,
            token,
            list: LIST,
            filtered: false,
            id_field: "id",
            remove_prefix: LIST,
        };
        sweep.take(target, run_id, &listed, &records).await;
    }
    if !errors.is_empty() {
        sweep.error = Some(errors.join("; "));
    }
    sweep
}

/// Every page of `GET /v1/agents/sessions` (`limit`, `after`, `has_more`), as `token`.
async fn list_sessions(
    target: &crate::target::Target,
    token: &str,
) -> Result<Vec<serde_json::Value>, String> {
    const LIST: &str = "/v1/agents/sessions";
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    for _ in 0..1000 {
        let mut url = reqwest::Url::parse(&format!("{}{LIST}", target.base_url))
            .map_err(|e| format!("GET {LIST}: {e}"))?;
        url.query_pairs_mut().append_pair("limit", "100");
        if let Some(a) = &after {
            url.query_pairs_mut().append_pair("after", a);
        }
        let (name, value) = target.api.credential(token);
        let response = target
            .client
            .get(url)
            .header(name, value)
            .timeout(target.request_timeout)
            .send()
            .await
            .map_err(|e| format!("GET {LIST}: {}", crate::target::describe_reqwest(&e)))?;
        if !response.status().is_success() {
            return Err(format!("GET {LIST}: status {}", response.status()));
        }
        let page: serde_json::Value = response
            .json()
            .await
            .map_err(|e| format!("GET {LIST}: {e}"))?;
        let data = page
            .get("data")
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| format!("GET {LIST}: no `data` array"))?;
        out.extend(data.iter().cloned());
        let more = page.get("has_more").and_then(serde_json::Value::as_bool) == Some(true);
        match page.get("last_id").and_then(serde_json::Value::as_str) {
            Some(last) if more => after = Some(last.to_owned()),
            _ => return Ok(out),
        }
    }
    Err(format!("GET {LIST}: more than 1000 pages"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_defines_clauses_and_only_those_count() {
        assert!(clauses().count() >= 8);
        assert!(is_clause("ASB-AUTH-1"));
        assert!(!is_clause("ASB-AUTH-999"));
        assert!(!is_clause("E2B-AUTH-1"));
        // The catalog table names scenarios, not clauses.
        assert!(!is_clause("ASB-AUTH-001"));
    }

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
