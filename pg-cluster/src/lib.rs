//! A private PostgreSQL cluster started from the `initdb`, `pg_ctl` and `postgres` binaries on
//! `PATH`: for the tests of the reference server and of the runner, and for the runner itself,
//! which starts one for each fault scenario that stops and starts a reference server's database.
//!
//! ```no_run
//! # use pg_cluster::PgCluster;
//! # async fn a_test() {
//! let Some(pg) = PgCluster::shared_or_skip() else { return };
//! let url = pg.fresh_database().await;
//! // connect to `url` with any PostgreSQL client
//! # }
//! ```
//!
//! Tests that stop the database (outage tests) start a cluster of their own with
//! [`PgCluster::start_or_skip`] and use [`PgCluster::stop`] and [`PgCluster::start`] on it,
//! rather than stopping the shared one under other tests.

use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// Set to `1` to make a missing PostgreSQL installation a test failure instead of a skip.
pub const REQUIRE_POSTGRES_ENV: &str = "SANDSPEC_REQUIRE_POSTGRES";

/// Why a cluster could not be started.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error("PostgreSQL is not installed: {0} not found on PATH")]
    NotInstalled(&'static str),
    #[error("failed to set up the PostgreSQL cluster: {0}")]
    Setup(String),
}

/// A PostgreSQL cluster in a temporary directory, listening on a free loopback port, with a
/// Unix socket in the same directory. Trust authentication as user `postgres`; durability
/// settings are off, which is safe for a cluster that lives as long as one test run.
///
/// Dropping it stops the server and removes the directory. A watchdog process does the same
/// if the test process dies without cleaning up (a panic that aborts, SIGKILL).
pub struct PgCluster {
    pg_ctl: PathBuf,
    /// The client that creates databases, from the same installation as `pg_ctl`.
    createdb: PathBuf,
    /// The temporary directory: `data/`, the log and the socket.
    dir: PathBuf,
    port: u16,
    /// As root, `initdb` and `pg_ctl` refuse to run, so they run as the `postgres` user.
    as_postgres: bool,
    /// Serializes `stop`/`start`/cleanup.
    running: Mutex<bool>,
    /// Cleans up if this process dies first; killed when we clean up ourselves.
    watchdog: Mutex<Option<Child>>,
    cleaned: AtomicBool,
    next_database: AtomicU64,
}

static SHARED: OnceLock<Option<PgCluster>> = OnceLock::new();

extern "C" fn cleanup_shared_at_exit() {
    if let Some(Some(cluster)) = SHARED.get() {
        cluster.cleanup();
    }
}

/// The programs a private cluster needs: `initdb`, `pg_ctl` and `createdb` (and `postgres`,
/// which `pg_ctl` starts).
fn programs() -> Result<(PathBuf, PathBuf, PathBuf), PgError> {
    let initdb = find_on_path("initdb").ok_or(PgError::NotInstalled("initdb"))?;
    let pg_ctl = find_on_path("pg_ctl").ok_or(PgError::NotInstalled("pg_ctl"))?;
    find_on_path("postgres").ok_or(PgError::NotInstalled("postgres"))?;
    // `pg_ctl` on PATH is often a link into the installation's own directory, which holds
    // the client programs of the same version.
    let createdb = std::fs::canonicalize(&pg_ctl)
        .ok()
        .and_then(|p| Some(p.parent()?.join("createdb")))
        .filter(|p| is_executable(p))
        .or_else(|| find_on_path("createdb"))
        .ok_or(PgError::NotInstalled("createdb"))?;
    Ok((initdb, pg_ctl, createdb))
}

impl PgCluster {
    /// Whether the programs a private cluster needs are installed, so that [`Self::launch`]
    /// gets past looking for them.
    pub fn installed() -> bool {
        programs().is_ok()
    }

    /// Starts a private cluster.
    pub fn launch() -> Result<Self, PgError> {
        let (initdb, pg_ctl, createdb) = programs()?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let as_postgres = unsafe { libc::geteuid() } == 0;

        let dir = tempfile::Builder::new()
            .prefix("sandspec-pg-")
            .tempdir()
            .map_err(|e| PgError::Setup(format!("creating a temporary directory: {e}")))?
            .keep();
        let mut cluster = Self {
            pg_ctl,
            createdb,
            dir,
            port: 0,
            as_postgres,
            running: Mutex::new(false),
            watchdog: Mutex::new(None),
            cleaned: AtomicBool::new(false),
            next_database: AtomicU64::new(0),
        };
        // From here on, dropping `cluster` removes the directory whatever fails.
        if as_postgres {
            chown_to_postgres(&cluster.dir)?;
        }
        *cluster
            .watchdog
            .get_mut()
            .unwrap_or_else(|e| e.into_inner()) = cluster.spawn_watchdog().ok();

        let mut initdb_cmd = cluster.command(&initdb);
        initdb_cmd.arg("-D").arg(cluster.data_dir()).args([
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ]);
        run(initdb_cmd, "initdb")?;

        // A free port can be taken between probing and binding; try a few.
        let mut last_error = None;
        for _ in 0..5 {
            cluster.port = free_port()?;
            match cluster.pg_ctl_start() {
                Ok(()) => {
                    *cluster.running.get_mut().unwrap_or_else(|e| e.into_inner()) = true;
                    return Ok(cluster);
                }
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error.unwrap_or_else(|| PgError::Setup("no attempt to start".into())))
    }

    /// Starts a private cluster, or returns `None` (printing why) when PostgreSQL is not
    /// installed, unless `SANDSPEC_REQUIRE_POSTGRES=1`. Panics when an installed PostgreSQL
    /// fails to start.
    pub fn start_or_skip() -> Option<Self> {
        match Self::launch() {
            Ok(cluster) => Some(cluster),
            Err(PgError::NotInstalled(what)) if !postgres_required() => {
                eprintln!(
                    "skipping PostgreSQL tests: {what} not found on PATH (set {REQUIRE_POSTGRES_ENV}=1 \
                     to make this a failure)"
                );
                None
            }
            Err(e @ PgError::NotInstalled(_)) => {
                panic!("{e} and {REQUIRE_POSTGRES_ENV}=1 requires it")
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// One cluster for the whole test process, started on first use and removed when the
    /// process exits normally (statics are never dropped, so an `atexit` hook does it).
    /// `None` as for [`start_or_skip`](Self::start_or_skip). Give each test its own database
    /// with [`fresh_database`](Self::fresh_database); never stop this one.
    pub fn shared_or_skip() -> Option<&'static Self> {
        SHARED
            .get_or_init(|| {
                let cluster = Self::start_or_skip();
                if cluster.is_some() {
                    // SAFETY: registers a plain function that only touches a static.
                    let registered = unsafe { libc::atexit(cleanup_shared_at_exit) };
                    assert_eq!(
                        registered, 0,
                        "registering the PostgreSQL cleanup with atexit"
                    );
                }
                cluster
            })
            .as_ref()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `name` in this cluster.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// Creates database `name` (ASCII letters, digits and `_`) and returns its URL. Panics
    /// when that fails.
    pub async fn create_database(&self, name: &str) -> String {
        let out = tokio::process::Command::from(self.createdb_command(name))
            .output()
            .await;
        self.created(name, out)
    }

    /// A database of its own for one test: `test_<pid>_<n>`.
    pub async fn fresh_database(&self) -> String {
        self.create_database(&self.next_name()).await
    }

    /// [`create_database`](Self::create_database) for synchronous callers (a libtest-mimic
    /// harness).
    pub fn create_database_blocking(&self, name: &str) -> String {
        let out = self.createdb_command(name).output();
        self.created(name, out)
    }

    /// [`fresh_database`](Self::fresh_database) for callers without an async runtime.
    pub fn fresh_database_blocking(&self) -> String {
        self.create_database_blocking(&self.next_name())
    }

    fn next_name(&self) -> String {
        let n = self.next_database.fetch_add(1, Ordering::Relaxed);
        format!("test_{}_{n}", std::process::id())
    }

    fn createdb_command(&self, name: &str) -> Command {
        assert!(
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
            "database name {name:?}: use ASCII letters, digits and _"
        );
        let mut cmd = Command::new(&self.createdb);
        cmd.args([
            "-h",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-U",
            "postgres",
        ])
        .arg(name)
        .env_remove("PGPASSWORD")
        .stdin(Stdio::null());
        cmd
    }

    fn created(&self, name: &str, out: std::io::Result<std::process::Output>) -> String {
        match out {
            Ok(out) if out.status.success() => self.url(name),
            Ok(out) => panic!(
                "creating database {name} ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => panic!("running {}: {e}", self.createdb.display()),
        }
    }

    /// Stops the server abruptly (`pg_ctl stop -m immediate`), as an outage does. Data stays.
    pub fn stop(&self) {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if *running {
            self.pg_ctl_stop().unwrap_or_else(|e| panic!("{e}"));
            *running = false;
        }
    }

    /// Starts the server again after [`stop`](Self::stop), on the same port, and waits until
    /// it accepts connections.
    pub fn start(&self) {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if !*running {
            self.pg_ctl_start().unwrap_or_else(|e| panic!("{e}"));
            *running = true;
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// A command for a PostgreSQL binary, run as `postgres` when we are root.
    fn command(&self, program: &Path) -> Command {
        let mut cmd = if self.as_postgres {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(program);
            cmd
        } else {
            Command::new(program)
        };
        cmd.stdin(Stdio::null()).current_dir(&self.dir);
        cmd
    }

    fn pg_ctl_start(&self) -> Result<(), PgError> {
        // fsync=off only skips flushing what was written to the OS, which an abrupt stop of
        // the server (not of the machine) keeps. synchronous_commit stays on: without it,
        // an immediate stop loses acknowledged commits.
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k '{}' -c fsync=off -c full_page_writes=off \
             -c max_connections=200",
            self.port,
            self.dir.display()
        );
        let mut cmd = self.command(&self.pg_ctl);
        cmd.arg("-D")
            .arg(self.data_dir())
            .arg("-l")
            .arg(self.dir.join("postgres.log"))
            .args(["-w", "-t", "60", "-o"])
            .arg(options)
            .arg("start");
        run(cmd, "pg_ctl start").map_err(|e| {
            let log = std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default();
            PgError::Setup(format!("{e}\n--- postgres.log ---\n{log}"))
        })
    }

    fn pg_ctl_stop(&self) -> Result<(), PgError> {
        let mut cmd = self.command(&self.pg_ctl);
        cmd.arg("-D")
            .arg(self.data_dir())
            .args(["-m", "immediate", "-w", "stop"]);
        run(cmd, "pg_ctl stop")
    }

    /// A detached shell that stops the cluster and removes its directory once this process
    /// is gone, unless the directory is already gone.
    fn spawn_watchdog(&self) -> std::io::Result<Child> {
        const SCRIPT: &str = r#"
pid=$1 dir=$2 pg_ctl=$3 as_postgres=$4
while kill -0 "$pid" 2>/dev/null && [ -d "$dir" ]; do sleep 1; done
if [ -d "$dir" ]; then
    if [ "$as_postgres" = 1 ]; then
        runuser -u postgres -- "$pg_ctl" -D "$dir/data" -m immediate stop
    else
        "$pg_ctl" -D "$dir/data" -m immediate stop
    fi
    rm -rf "$dir"
fi
"#;
        Command::new("sh")
            .arg("-c")
            .arg(SCRIPT)
            .arg("sh")
            .arg(std::process::id().to_string())
            .arg(&self.dir)
            .arg(&self.pg_ctl)
            .arg(if self.as_postgres { "1" } else { "0" })
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Its own process group: a harness killing ours leaves it to clean up.
            .process_group(0)
            .spawn()
    }

    /// Stops the server and removes the directory; safe to call twice and never panics (it
    /// runs from `Drop` and from an `atexit` hook).
    fn cleanup(&self) {
        if self.cleaned.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        // Also after a start that reported failure but left a server behind.
        if *running || self.data_dir().join("postmaster.pid").exists() {
            // Best effort: the directory goes either way.
            let _ = self.pg_ctl_stop();
        }
        *running = false;
        let _ = std::fs::remove_dir_all(&self.dir);
        if let Some(mut watchdog) = self
            .watchdog
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let pgid = i32::try_from(watchdog.id()).unwrap_or(0);
            if pgid > 0 {
                // SAFETY: signals the watchdog's own process group (the shell and its sleep).
                unsafe { libc::kill(-pgid, libc::SIGKILL) };
            }
            let _ = watchdog.wait();
        }
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        self.cleanup();
    }
}

fn postgres_required() -> bool {
    std::env::var_os(REQUIRE_POSTGRES_ENV).is_some_and(|v| v == "1")
}

fn find_on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn chown_to_postgres(dir: &Path) -> Result<(), PgError> {
    let name = c"postgres";
    // SAFETY: getpwnam reads a static buffer; we copy the two ids out before anything else
    // can call it again on this thread.
    let ids = unsafe {
        let pw = libc::getpwnam(name.as_ptr());
        if pw.is_null() {
            None
        } else {
            Some(((*pw).pw_uid, (*pw).pw_gid))
        }
    };
    let (uid, gid) = ids.ok_or_else(|| {
        PgError::Setup(
            "running as root, but there is no `postgres` user to run PostgreSQL as".into(),
        )
    })?;
    std::os::unix::fs::chown(dir, Some(uid), Some(gid))
        .map_err(|e| PgError::Setup(format!("chown {} to postgres: {e}", dir.display())))
}

fn free_port() -> Result<u16, PgError> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| PgError::Setup(format!("finding a free port: {e}")))
}

/// Runs `cmd` to completion; an error carries its output.
fn run(mut cmd: Command, what: &str) -> Result<(), PgError> {
    let out = cmd
        .output()
        .map_err(|e| PgError::Setup(format!("running {what}: {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    Err(PgError::Setup(format!(
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )))
}
