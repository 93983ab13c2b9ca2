//! The reference server as the runner starts it: `sandspec serve` as a child process with
//! fresh tokens in a mode-0600 config file, on SQLite in its own temporary directory or on a
//! PostgreSQL database, and the processes of a deployment the runner started for one scenario
//! (killed, restarted, its database stopped and started by fault steps).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use super::conn::{Tokens, random_token};
use super::error::TargetError;
use super::read::{next_output_line, next_short_output_line};

/// How to start the reference server.
#[derive(Debug, Clone, Default)]
pub struct ReferenceOptions {
    /// The `sandspec` binary (`std::env::current_exe()` when running as it).
    pub binary: PathBuf,
    pub defects: Vec<String>,
    pub database_url: Option<String>,
    /// Extra flags for `sandspec serve` (e.g. `--tls-cert`).
    pub extra_args: Vec<String>,
    /// Start with `sandspec serve`'s own limits and retentions (what a deployment runs)
    /// instead of [`REFERENCE_FAST_SETTINGS`].
    pub serve_defaults: bool,
}

/// Limits and retention the runner gives the reference server it starts, so that heartbeat,
/// stream-duration and quota scenarios finish in seconds. Scenarios read the advertised
/// values, so they hold for any setting. The retentions are a minute: the retention scenarios
/// move the clock of a deployment of their own past them (TC-9.12), and a scenario that reads
/// what it made a few seconds earlier (output across a server's restart, a session's log from
/// its start, two digests around a session) must not see it expire under load.
pub const REFERENCE_FAST_SETTINGS: &[&str] = &[
    "--retention",
    "process_output_s=60",
    "--limit",
    "heartbeat_interval_s=1",
    "--limit",
    "max_stream_duration_s=6",
    "--limit",
    "max_sandboxes_per_principal=20",
    "--retention",
    "result_s=60",
    "--retention",
    "events_s=60",
];

/// A running reference server child process; stopped when dropped.
pub struct ReferenceServer {
    pub url: String,
    pub tokens: Tokens,
    /// Stopped on drop: SIGTERM first, so that the server ends its sandboxes' processes, then
    /// SIGKILL (`kill_on_drop`) if it has not exited after a grace period. `None` after a
    /// `kill_server` step, until `restart_server`.
    child: Option<tokio::process::Child>,
    /// How it was started, to start it again the same way after a kill.
    options: ReferenceOptions,
    /// Holds the config file and the SQLite data (kept across a restart); removed on drop.
    dir: tempfile::TempDir,
}

impl ReferenceServer {
    pub async fn start(options: &ReferenceOptions) -> Result<ReferenceServer, TargetError> {
        let tokens = Tokens {
            owner: random_token(),
            other: random_token(),
            admin: Some(random_token()),
        };
        Self::start_with_tokens(options, tokens).await
    }

    /// Starts a server whose principals have these tokens, with a data directory of its own
    /// (a second process on the same database takes the first one's tokens).
    pub async fn start_with_tokens(
        options: &ReferenceOptions,
        tokens: Tokens,
    ) -> Result<ReferenceServer, TargetError> {
        let dir = tempfile::tempdir()
            .map_err(|e| spawn_error(options, format!("temporary directory: {e}")))?;
        write_private(&dir.path().join("serve.toml"), &config_toml(&tokens))
            .map_err(|e| spawn_error(options, format!("config file: {e}")))?;
        let (child, url) = spawn_serve(options, dir.path(), "127.0.0.1:0").await?;
        Ok(ReferenceServer {
            url,
            tokens,
            child: Some(child),
            options: options.clone(),
            dir,
        })
    }

    /// Sends SIGKILL to the server process (nothing of it runs its shutdown: its sandbox
    /// processes stay as a crash leaves them) and waits until it is gone.
    pub async fn kill(&mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Err("the server is not running".into());
        };
        child
            .start_kill()
            .map_err(|e| format!("cannot send SIGKILL: {e}"))?;
        child
            .wait()
            .await
            .map_err(|e| format!("cannot wait for the killed server: {e}"))?;
        Ok(())
    }

    /// Starts the server again on the same data directory, database, tokens and port (its
    /// URL does not change). A server that is running is left alone: `Ok(false)`.
    pub async fn restart(&mut self) -> Result<bool, String> {
        if self.child.is_some() {
            return Ok(false);
        }
        let listen = self
            .url
            .strip_prefix("http://")
            .or_else(|| self.url.strip_prefix("https://"))
            .unwrap_or(&self.url)
            .to_owned();
        // The port was just freed; another process could take it in between, so a few tries.
        let mut last = String::new();
        for _ in 0..5 {
            match spawn_serve(&self.options, self.dir.path(), &listen).await {
                Ok((child, url)) if url == self.url => {
                    self.child = Some(child);
                    return Ok(true);
                }
                Ok((_, url)) => return Err(format!("restarted on {url}, not {}", self.url)),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(last)
    }

    /// Whether the server process is running (it was not killed, or was restarted since).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

pub(super) fn spawn_error(options: &ReferenceOptions, reason: String) -> TargetError {
    TargetError::Spawn {
        binary: options.binary.display().to_string(),
        reason,
    }
}

/// Starts `sandspec serve` on `listen` with the config file and data directory in `dir`,
/// and reads the URL it listens on.
async fn spawn_serve(
    options: &ReferenceOptions,
    dir: &Path,
    listen: &str,
) -> Result<(tokio::process::Child, String), TargetError> {
    let spawn_err = |reason: String| spawn_error(options, reason);
    let mut cmd = tokio::process::Command::new(&options.binary);
    cmd.arg("serve")
        .arg("--listen")
        .arg(listen)
        .arg("--config")
        .arg(dir.join("serve.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--enable-test-controls");
    for defect in &options.defects {
        cmd.arg("--defect").arg(defect);
    }
    if let Some(url) = &options.database_url {
        cmd.arg("--database-url").arg(url);
    }
    if !options.serve_defaults {
        cmd.args(REFERENCE_FAST_SETTINGS);
    }
    cmd.args(&options.extra_args);
    // Its own process group: a Ctrl-C at the terminal reaches the runner, which finishes
    // the running scenarios against a server that is still there.
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|e| spawn_err(e.to_string()))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    // Keep the server's log available for failure messages without letting the pipe fill.
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let log_writer = log.clone();
    // Each line is kept up to the output line cap; a longer one is read and cut.
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(stderr);
        while let Ok(Some(line)) = next_output_line(&mut lines).await {
            let mut log = log_writer.lock().expect("log lock");
            if log.len() < 200 {
                log.push(line.shown());
            }
        }
    });
    let mut lines = tokio::io::BufReader::new(stdout);
    let first =
        tokio::time::timeout(Duration::from_secs(30), next_short_output_line(&mut lines)).await;
    let url = match first {
        Ok(Ok(Some(line))) => match line.text.strip_prefix("listening on ") {
            Some(url) if line.cut_from.is_none() => url.trim().to_owned(),
            _ => {
                return Err(spawn_err(format!(
                    "unexpected first line on stdout: {:?}",
                    line.shown()
                )));
            }
        },
        Ok(Ok(None)) | Ok(Err(_)) => {
            let _ = tokio::time::timeout(Duration::from_secs(2), child.wait()).await;
            let tail = log.lock().expect("log lock").join("\n");
            return Err(spawn_err(format!(
                "exited before listening; its log:\n{tail}"
            )));
        }
        Err(_) => return Err(spawn_err("no `listening on` line within 30 s".into())),
    };
    // Drain the rest of stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = next_output_line(&mut lines).await {} });
    Ok((child, url))
}

/// The `--config` file: principals and the admin token. The principal names are fixed
/// (`alice` owns, `bob` is the other one); the tokens are fresh for every run.
fn config_toml(tokens: &Tokens) -> String {
    let admin = tokens.admin.as_deref().unwrap_or_default();
    format!(
        "admin_token = \"{admin}\"\n\n[[principals]]\nname = \"alice\"\ntoken = \"{}\"\n\n[[principals]]\nname = \"bob\"\ntoken = \"{}\"\n",
        tokens.owner, tokens.other
    )
}

/// Writes a file readable only by its owner.
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    file.write_all(text.as_bytes())
}

impl Drop for ReferenceServer {
    fn drop(&mut self) {
        const GRACE: std::time::Duration = std::time::Duration::from_secs(10);
        let Some(child) = &mut self.child else { return };
        let Some(pid) = child.id() else { return };
        let Ok(pid) = i32::try_from(pid) else { return };
        // SAFETY: kill(2) on our own child's pid, which has not been reaped (we still hold it).
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            return;
        }
        let deadline = std::time::Instant::now() + GRACE;
        while std::time::Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // Still running: `kill_on_drop` sends SIGKILL when the child handle drops.
    }
}

/// The processes of a deployment the runner started for one fault-injecting scenario, which
/// its fault steps act on.
pub struct Control {
    /// The primary server process, then the peer's (on PostgreSQL). Dropped before the
    /// cluster, so the servers stop while their database is still there.
    pub(super) servers: tokio::sync::Mutex<Vec<ReferenceServer>>,
    /// The private PostgreSQL cluster holding the deployment's database (`database_control`).
    pub(super) cluster: Option<std::sync::Arc<pg_cluster::PgCluster>>,
}

impl Control {
    /// Whether the deployment's database is one the runner can stop and start.
    pub fn has_database(&self) -> bool {
        self.cluster.is_some()
    }

    /// SIGKILL to the primary server process, or to the peer's.
    pub async fn kill_server(&self, peer: bool) -> Result<(), String> {
        let mut servers = self.servers.lock().await;
        let server = servers
            .get_mut(usize::from(peer))
            .ok_or("the deployment has no peer process")?;
        server.kill().await
    }

    /// Starts the primary server process (or the peer's) again on its data directory,
    /// database and port; `Ok(false)` when it is running (nothing to restart).
    pub async fn restart_server(&self, peer: bool) -> Result<bool, String> {
        let mut servers = self.servers.lock().await;
        let server = servers
            .get_mut(usize::from(peer))
            .ok_or("the deployment has no peer process")?;
        server.restart().await
    }

    /// Stops the database server abruptly (as an outage does); its data stays.
    pub async fn stop_database(&self) -> Result<(), String> {
        self.on_cluster(|c| c.stop()).await
    }

    /// Starts the database server again on the same port, and waits until it accepts
    /// connections; nothing happens when it is running.
    pub async fn start_database(&self) -> Result<(), String> {
        self.on_cluster(|c| c.start()).await
    }

    async fn on_cluster(&self, f: fn(&pg_cluster::PgCluster)) -> Result<(), String> {
        let cluster = self
            .cluster
            .clone()
            .ok_or("the runner controls no database of this deployment")?;
        // `pg_ctl` blocks, and panics with its error output when it fails.
        tokio::task::spawn_blocking(move || f(&cluster))
            .await
            .map_err(|e| match e.try_into_panic() {
                Ok(panic) => panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_else(|| "pg_ctl failed".into()),
                Err(e) => e.to_string(),
            })
    }
}

/// Why a scenario that requires `server_control` is skipped on a target the runner did not
/// start.
pub const NO_SERVER_CONTROL: &str = "the runner does not control the target's server processes: it kills and restarts only a server it starts itself (the reference server, or a service it launched with --launch), never a --target URL";

/// Why a scenario that requires `database_control` is skipped.
pub const NO_DATABASE_CONTROL: &str = "the runner controls no database of the target: it stops and starts only a private PostgreSQL cluster it starts for a reference server on PostgreSQL (--database-url); SQLite has no database server to stop";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_holds_the_tokens() {
        let tokens = Tokens {
            owner: "o".into(),
            other: "b".into(),
            admin: Some("a".into()),
        };
        let text = config_toml(&tokens);
        assert!(text.contains("token = \"o\"") && text.contains("admin_token = \"a\""));
    }

    #[test]
    fn private_files_are_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        write_private(&path, "secret").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            assert_eq!(
                std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
                0o600
            );
        }
    }

    /// A server binary whose first line of output never ends fails the start at once, the
    /// line kept cut to the output line cap.
    #[tokio::test]
    async fn an_endless_first_line_fails_the_start_with_the_line_cut() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let binary = dir.path().join("serve");
        std::fs::write(
            &binary,
            "#!/bin/sh\nhead -c 200000000 /dev/zero | tr '\\0' x\nsleep 60\n",
        )
        .unwrap();
        std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
        let options = ReferenceOptions {
            binary,
            ..ReferenceOptions::default()
        };
        let started = std::time::Instant::now();
        let err = match ReferenceServer::start(&options).await {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a server that never says where it listens is not started"),
        };
        assert!(
            err.contains("unexpected first line") && err.contains("(a line of more than "),
            "{}",
            &err[err.len().saturating_sub(300)..]
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
    }
}
