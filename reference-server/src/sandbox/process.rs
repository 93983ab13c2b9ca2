//! Process groups inside a sandbox: spawn, output capture into the event log, stdin, signals, timeouts.
//!
//! Every process leads its own process group, so a signal or a timeout reaches everything it
//! started. Its output is appended to the process's durable event log as it arrives, and the
//! `exit` event is appended only after the last output event: a reader that sees `exit` has
//! seen everything.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::unix::process::ExitStatusExt as _;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::watch;

use crate::clock::now;
use crate::domain::{ProcessSpec, ProcessState};
use crate::store::{Record, Scope, StoreError};
use crate::stream::{EventLog, process_stream};

use super::ProviderError;
use super::isolation::Entry;

/// `PATH` of every sandbox process unless the sandbox or the process sets its own.
pub(super) const DEFAULT_PATH: &str =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Bytes read from a pipe at once; one read becomes at most one event.
const READ_CHUNK: usize = 64 * 1024;
/// After the process itself exits, how long its output pipes may stay open (held by
/// something it left running in the background) before the exit is recorded without them.
const OUTPUT_DRAIN_GRACE: Duration = Duration::from_secs(1);
/// Attempts at a compare-and-swap update of the process record before giving up.
const CAS_ATTEMPTS: usize = 50;

/// What a process needs from its provider and sandbox.
pub(super) struct Launch {
    /// The working directory: a host path, or a path inside the sandbox when `enter` is set.
    pub(super) cwd: PathBuf,
    /// `HOME` of the process: the sandbox root, as the process sees it.
    pub(super) home: PathBuf,
    /// The sandbox's namespaces when it has its own: the child joins them itself before it
    /// execs, and `cwd` was already given to them.
    pub(super) enter: Option<Entry>,
    /// `cgroup.procs` files the child writes itself into before it execs.
    pub(super) cgroup_procs: Vec<CString>,
    /// Where no memory cgroup enforces the sandbox's grant: its size in bytes, which the
    /// child sets as its `RLIMIT_DATA` (soft and hard) before it execs.
    pub(super) memory_limit: Option<u64>,
    pub(super) log: EventLog,
    pub(super) max_output_bytes: u64,
    pub(super) output_retention: Duration,
    /// A pseudo-terminal of this size for the process's stdin, stdout and stderr (its output
    /// is then one stream, `stdout`), instead of pipes.
    pub(super) terminal: Option<TerminalSize>,
    /// Where the running process's group is written down (`<sandbox>/procs/<record id>`),
    /// so that a server that starts again after a crash finds and ends it.
    pub(super) pid_file: PathBuf,
}

/// The size of a pseudo-terminal, in characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TerminalSize {
    pub rows: u16,
    pub cols: u16,
}

impl TerminalSize {
    fn winsize(self) -> libc::winsize {
        libc::winsize {
            ws_row: self.rows,
            ws_col: self.cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        }
    }
}

/// A new pseudo-terminal of `size`: (controlling side, the process's side). The controlling
/// side is close-on-exec, so that only the server holds it.
fn open_terminal(size: TerminalSize) -> io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use std::os::fd::FromRawFd as _;
    let (mut master, mut slave) = (-1, -1);
    let winsize = size.winsize();
    // SAFETY: openpty writes two descriptors into the integers given; no name buffer and no
    // termios are passed.
    let done = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &winsize,
        )
    };
    if done != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just opened by openpty and are owned by nobody else.
    let (master, slave) = unsafe {
        (
            std::os::fd::OwnedFd::from_raw_fd(master),
            std::os::fd::OwnedFd::from_raw_fd(slave),
        )
    };
    // SAFETY: fcntl on a descriptor owned here.
    if unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&master),
            libc::F_SETFD,
            libc::FD_CLOEXEC,
        )
    } < 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok((master, slave))
}

/// A live (or recently ended) process, kept in memory by its provider.
pub(super) struct ProcessHandle {
    /// The record ID (`<provider>:prc_...`), also the key of its event log.
    id: String,
    /// The process's PID, which is also its process group ID.
    pgid: i32,
    /// `None` when started without `stdin: true`; the inner `None` once closed.
    stdin: Option<tokio::sync::Mutex<Option<ChildStdin>>>,
    /// The controlling side of its pseudo-terminal, when it has one: input is written to it
    /// and its size set on it.
    terminal: Option<std::fs::File>,
    /// Set as soon as the process has been reaped.
    exited: AtomicBool,
    /// Becomes true once the exit has been recorded and the `exit` event appended.
    done: watch::Receiver<bool>,
}

impl ProcessHandle {
    pub(super) fn id(&self) -> &str {
        &self.id
    }

    pub(super) fn pgid(&self) -> i32 {
        self.pgid
    }

    pub(super) fn has_exited(&self) -> bool {
        self.exited.load(Ordering::SeqCst)
    }

    /// Whether the exit has been recorded (the record updated and the `exit` event appended).
    pub(super) fn is_done(&self) -> bool {
        *self.done.borrow()
    }

    pub(super) async fn write_stdin(&self, data: &[u8], eof: bool) -> Result<(), ProviderError> {
        let Some(stdin) = &self.stdin else {
            return Err(ProviderError::NoStdin);
        };
        if self.has_exited() {
            return Err(ProviderError::ProcessExited);
        }
        let mut guard = stdin.lock().await;
        let Some(pipe) = guard.as_mut() else {
            // Closed earlier by `eof`, or by the exit that raced with this call.
            return Err(if self.has_exited() {
                ProviderError::ProcessExited
            } else {
                ProviderError::NoStdin
            });
        };
        let written = async {
            pipe.write_all(data).await?;
            pipe.flush().await
        }
        .await;
        match written {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
                return Err(ProviderError::ProcessExited);
            }
            Err(e) => return Err(ProviderError::Io(e)),
        }
        if eof {
            guard.take();
        }
        Ok(())
    }

    /// Writes `data` to the process's pseudo-terminal, as typed input.
    pub(super) async fn write_terminal(&self, data: &[u8]) -> Result<(), ProviderError> {
        let Some(terminal) = &self.terminal else {
            return Err(ProviderError::NoStdin);
        };
        if self.has_exited() {
            return Err(ProviderError::ProcessExited);
        }
        let mut master = terminal.try_clone()?;
        let data = data.to_vec();
        tokio::task::spawn_blocking(move || std::io::Write::write_all(&mut master, &data))
            .await
            .map_err(|e| ProviderError::Io(io::Error::other(e)))?
            .map_err(|e| match e.raw_os_error() {
                Some(libc::EIO) => ProviderError::ProcessExited,
                _ => ProviderError::Io(e),
            })
    }

    /// Sets the size of the process's pseudo-terminal (its processes get SIGWINCH).
    pub(super) fn resize_terminal(&self, size: TerminalSize) -> Result<(), ProviderError> {
        let Some(terminal) = &self.terminal else {
            return Err(ProviderError::NoStdin);
        };
        if self.has_exited() {
            return Err(ProviderError::ProcessExited);
        }
        let winsize = size.winsize();
        // SAFETY: TIOCSWINSZ reads one winsize from the pointer, on a descriptor owned here.
        let done = unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(terminal),
                libc::TIOCSWINSZ,
                &winsize,
            )
        };
        if done == 0 {
            Ok(())
        } else {
            Err(ProviderError::Io(io::Error::last_os_error()))
        }
    }

    /// Sends `sig` to the whole process group.
    pub(super) fn signal(&self, sig: libc::c_int) -> Result<(), ProviderError> {
        if self.has_exited() {
            return Err(ProviderError::ProcessExited);
        }
        match kill_group(self.pgid, sig) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Err(ProviderError::ProcessExited),
            Err(e) => Err(ProviderError::Io(e)),
        }
    }

    /// Waits until the exit is recorded; false when `limit` passed first.
    pub(super) async fn wait_done(&self, limit: Duration) -> bool {
        let mut done = self.done.clone();
        tokio::time::timeout(limit, done.wait_for(|d| *d))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

/// `killpg(pgid, sig)`.
pub(super) fn kill_group(pgid: i32, sig: libc::c_int) -> io::Result<()> {
    if pgid <= 1 {
        // Never signal "every process" or init by accident.
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
    if unsafe { libc::kill(-pgid, sig) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Gives every signal its default action in a child about to exec. An exec keeps what is
/// ignored: a server started in the background by a shell ignores SIGINT and SIGQUIT (under
/// `nohup`, SIGHUP), and a sandbox's processes would ignore them too, so a signal sent to a
/// process would do nothing. Every signal up to `last` (the last real-time one); those that
/// cannot be caught (KILL, STOP) or that the C library keeps are refused and left alone.
fn default_signal_actions(last: libc::c_int) -> io::Result<()> {
    // SAFETY: sigaction(2) is async-signal-safe; the struct lives on this stack.
    unsafe {
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        for sig in 1..=last {
            libc::sigaction(sig, &default, std::ptr::null_mut());
        }
    }
    Ok(())
}

/// Starts the process of `record` and the task that captures its output and records its end.
pub(super) fn spawn(
    launch: Launch,
    record: &Record,
    spec: &ProcessSpec,
    sandbox_env: &BTreeMap<String, String>,
) -> Result<Arc<ProcessHandle>, ProviderError> {
    let (program, args) = spec.cmd.split_first().ok_or_else(|| {
        ProviderError::Io(io::Error::new(io::ErrorKind::InvalidInput, "empty command"))
    })?;
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("PATH".into(), DEFAULT_PATH.into());
    env.insert("HOME".into(), launch.home.to_string_lossy().into_owned());
    env.extend(sandbox_env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.extend(spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));

    let mut cmd = Command::new(program);
    cmd.args(args);
    // The last real-time signal, asked of the C library before the fork.
    let last_signal = libc::SIGRTMAX();
    // SAFETY: the closure runs in the child between fork and exec and makes system calls
    // only (sigaction). It is the first closure, so what the later ones fork (a sandbox's
    // PID namespace init) starts with the default actions too.
    unsafe {
        cmd.pre_exec(move || default_signal_actions(last_signal));
    }
    if launch.enter.is_none() {
        cmd.current_dir(&launch.cwd);
    }
    cmd.env_clear().envs(&env);
    let master = match launch.terminal {
        Some(size) => {
            let (master, slave) = open_terminal(size)?;
            cmd.stdin(Stdio::from(slave.try_clone()?))
                .stdout(Stdio::from(slave.try_clone()?))
                .stderr(Stdio::from(slave));
            // SAFETY: the closure runs in the child between fork and exec and makes system
            // calls only. It runs after the signals' reset: the child leads a new session (and so its
            // own process group, as `process_group(0)` makes the others) whose controlling
            // terminal is the one on its stdin.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            Some(std::fs::File::from(master))
        }
        None => {
            cmd.stdin(if spec.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
            None
        }
    };
    let procs = launch.cgroup_procs;
    if !procs.is_empty() {
        // SAFETY: the closure runs in the child between fork and exec, and only makes
        // async-signal-safe calls (open, write, close) on paths allocated before the fork.
        unsafe {
            cmd.pre_exec(move || {
                for path in &procs {
                    join_cgroup(path)?;
                }
                Ok(())
            });
        }
    }
    if let Some(bytes) = launch.memory_limit {
        let limit = libc::rlimit {
            rlim_cur: bytes,
            rlim_max: bytes,
        };
        // SAFETY: setrlimit(2) is async-signal-safe and reads a struct copied into the
        // closure before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setrlimit(libc::RLIMIT_DATA, &limit) == 0 {
                    Ok(())
                } else {
                    Err(io::Error::last_os_error())
                }
            });
        }
    }
    if let Some(entry) = launch.enter {
        // SAFETY: `Entry::enter` is made for this place: system calls only, on what it
        // opened before the fork. It runs after the cgroups are joined (closures run in
        // order) and after std made the child its group's leader (`process_group(0)`).
        unsafe {
            cmd.pre_exec(move || entry.enter());
        }
    }
    let capture = Arc::new(Capture {
        log: launch.log,
        stream: process_stream(&record.id),
        record: record.clone(),
        remaining: AtomicU64::new(launch.max_output_bytes),
        truncated: AtomicBool::new(false),
        retention: launch.output_retention,
    });
    let (done_tx, done_rx) = watch::channel(false);
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        // Nothing started and nothing recorded: the caller removes the record and answers
        // 400 (PRC-4.9).
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::PermissionDenied
            ) =>
        {
            return Err(ProviderError::InvalidArgument {
                param: "cmd",
                detail: format!("cannot run `{program}`: {e}"),
            });
        }
        Err(e) => return Err(ProviderError::Io(e)),
    };
    let pgid = child
        .id()
        .and_then(|p| i32::try_from(p).ok())
        .ok_or_else(|| io::Error::other("no pid"))?;
    // Written before anything else can fail: a group the server loses track of must be
    // findable after a crash. Its start time tells it apart from a later one with the
    // same number.
    if let Err(e) = write_pid_file(&launch.pid_file, pgid, &record.id) {
        let _ = kill_group(pgid, libc::SIGKILL);
        return Err(ProviderError::Io(e));
    }
    // The process's side of its terminal lives only in the child from now on, so that the
    // controlling side reads end of file (EIO) once the child and what it started are gone.
    drop(cmd);
    let pid_file = launch.pid_file.clone();
    let (stdout, stderr): (Output, Option<Output>) = match &master {
        Some(master) => (
            Box::new(tokio::fs::File::from_std(master.try_clone()?)),
            None,
        ),
        None => (
            Box::new(
                child
                    .stdout
                    .take()
                    .ok_or_else(|| io::Error::other("stdout not piped"))?,
            ),
            Some(Box::new(
                child
                    .stderr
                    .take()
                    .ok_or_else(|| io::Error::other("stderr not piped"))?,
            )),
        ),
    };
    let stdin = child.stdin.take().map(|s| tokio::sync::Mutex::new(Some(s)));

    let handle = Arc::new(ProcessHandle {
        id: record.id.clone(),
        pgid,
        stdin,
        terminal: master,
        exited: AtomicBool::new(false),
        done: done_rx,
    });
    let timeout = spec.timeout_ms.map(Duration::from_millis);
    let supervisor = Supervisor {
        handle: handle.clone(),
        capture,
        timeout,
    };
    tokio::spawn(async move {
        supervisor.run(child, stdout, stderr).await;
        // The exit is recorded: nothing is left for a restarted server to end.
        let _ = std::fs::remove_file(&pid_file);
        let _ = done_tx.send(true);
    });
    Ok(handle)
}

/// Writes `<pgid> <start time> <record id>` to `path` (creating its directory).
fn write_pid_file(path: &std::path::Path, pgid: i32, record_id: &str) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let started = start_time(pgid).unwrap_or(0);
    std::fs::write(path, format!("{pgid} {started} {record_id}\n"))
}

/// The start time of process `pid` in clock ticks since boot (field 22 of
/// `/proc/<pid>/stat`), or `None` when there is no such process.
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count from after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Ends the process group a pid file names, if that group's leader is still the process
/// that was started (same start time), and removes the file. Returns whether it was running,
/// and the process's record ID.
pub(super) fn end_leftover(path: &std::path::Path) -> (bool, Option<String>) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut words = text.split_whitespace();
    let (pgid, started) = (words.next(), words.next());
    let record_id = words.next().map(str::to_owned);
    let running = match (pgid.map(str::parse::<u64>), started.map(str::parse::<u64>)) {
        (Some(Ok(pgid)), Some(Ok(started))) => i32::try_from(pgid).is_ok_and(|pgid| {
            let same = start_time(pgid) == Some(started);
            if same {
                let _ = kill_group(pgid, libc::SIGKILL);
            }
            same
        }),
        _ => false,
    };
    let _ = std::fs::remove_file(path);
    (running, record_id)
}

/// Records that a process a crashed server started has been ended by the server that started
/// after it: `killed` by `KILL`, like any process killed with SIGKILL, then its `exit` event.
pub(super) async fn record_lost(log: &EventLog, record: &Record, retention: Duration) {
    let capture = Capture {
        log: log.clone(),
        stream: process_stream(&record.id),
        record: record.clone(),
        remaining: AtomicU64::new(0),
        truncated: AtomicBool::new(
            record.body.get("truncated").and_then(Value::as_bool) == Some(true),
        ),
        retention,
    };
    record_exit(
        &capture,
        ProcessState::Killed,
        None,
        Some(signal_name(libc::SIGKILL)),
    )
    .await;
}

/// Moves the calling process into the cgroup whose `cgroup.procs` is `path` (`0` = itself).
pub(super) fn join_cgroup(path: &CString) -> io::Result<()> {
    // SAFETY: plain syscalls on a NUL-terminated path and a static buffer.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = libc::write(fd, b"0".as_ptr().cast(), 1);
        let err = io::Error::last_os_error();
        libc::close(fd);
        if n == 1 { Ok(()) } else { Err(err) }
    }
}

/// Output capture of one process, shared by its stdout and stderr readers.
struct Capture {
    log: EventLog,
    stream: String,
    /// The record as inserted; the latest version is fetched again for every update.
    record: Record,
    /// Output bytes that may still be retained (stdout and stderr together).
    remaining: AtomicU64,
    truncated: AtomicBool,
    /// How long output stays readable after the end (`output_expires_at - ended_at`).
    retention: Duration,
}

impl Capture {
    /// How much of `n` new bytes may be kept; marks the process truncated when not all.
    async fn admit(&self, n: usize) -> usize {
        let n = n as u64;
        let mut granted = 0;
        let _ = self
            .remaining
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |rem| {
                granted = rem.min(n);
                Some(rem - granted)
            });
        if granted < n && !self.truncated.swap(true, Ordering::SeqCst) {
            // Readers of the output see `truncated` while the process still runs.
            let result = update_record(&self.log, &self.record, |rec| {
                if let Some(body) = rec.body.as_object_mut() {
                    body.insert("truncated".into(), Value::Bool(true));
                }
            })
            .await;
            if let Err(e) = result {
                tracing::warn!(process = %self.record.id, error = %e, "could not mark output truncated");
            }
        }
        granted as usize
    }

    async fn append(&self, kind: &str, text: String) {
        if text.is_empty() {
            return;
        }
        // Output waits for a busy or stopped store as the process's end does (the pipe fills
        // meanwhile, and the process waits to write): none is lost to a passing lock.
        let data = json!({ "data": text });
        let appended = patiently("output", &self.record.id, || async {
            self.log.append(&self.stream, kind, &data).await.map(drop)
        });
        if let Err(e) = appended.await {
            tracing::warn!(process = %self.record.id, error = %e, "could not append output");
        }
    }
}

/// What a process's output is read from: a pipe, or its terminal's controlling side.
type Output = Box<dyn AsyncRead + Send + Unpin>;

struct Supervisor {
    handle: Arc<ProcessHandle>,
    capture: Arc<Capture>,
    timeout: Option<Duration>,
}

impl Supervisor {
    async fn run(self, mut child: Child, stdout: Output, stderr: Option<Output>) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let out = tokio::spawn(pump(
            stdout,
            "stdout",
            self.capture.clone(),
            stop_rx.clone(),
        ));
        let err = stderr
            .map(|stderr| tokio::spawn(pump(stderr, "stderr", self.capture.clone(), stop_rx)));

        let status = self.wait(&mut child).await;
        self.handle.exited.store(true, Ordering::SeqCst);
        if let Some(stdin) = &self.handle.stdin {
            stdin.lock().await.take();
        }

        // Output first, then the exit: wait for both pipes to reach EOF, but not forever.
        let readers = async {
            let _ = out.await;
            if let Some(err) = err {
                let _ = err.await;
            }
        };
        tokio::pin!(readers);
        if tokio::time::timeout(OUTPUT_DRAIN_GRACE, &mut readers)
            .await
            .is_err()
        {
            let _ = stop_tx.send(true);
            readers.await;
        }

        let (state, exit_code, signal) = match &status {
            Ok(status) => describe(status),
            Err(e) => {
                tracing::warn!(process = %self.handle.id, error = %e, "waiting for the process failed");
                (ProcessState::Killed, None, Some("KILL".to_owned()))
            }
        };
        record_exit(&self.capture, state, exit_code, signal).await;
    }

    /// Waits for the process; past its timeout the whole group is killed first.
    async fn wait(&self, child: &mut Child) -> io::Result<ExitStatus> {
        let Some(limit) = self.timeout else {
            return child.wait().await;
        };
        // `Child::wait` is cancel safe, so it can be raced against the deadline and resumed.
        match tokio::time::timeout(limit, child.wait()).await {
            Ok(status) => status,
            Err(_) => {
                let _ = kill_group(self.handle.pgid, libc::SIGKILL);
                child.wait().await
            }
        }
    }
}

/// Records the end of a process: the record first (state, exit code, signal, `ended_at`,
/// `output_expires_at` and `due_at` for the reaper), then the `exit` event, which is the
/// last event of the process's log.
async fn record_exit(
    capture: &Capture,
    state: ProcessState,
    exit_code: Option<i32>,
    signal: Option<String>,
) {
    let ended_at = now();
    let expires_at = ended_at + capture.retention;
    let truncated = capture.truncated.load(Ordering::SeqCst);
    let id = &capture.record.id;
    // The end of a process must reach the store: the record's state, and then the `exit`
    // event, which ends every stream of the process and makes its output complete. A store
    // that is busy or down for a while (a locked SQLite file, a PostgreSQL restart) gets each
    // again once it answers, for up to `STORE_PATIENCE`.
    let recorded = patiently("the exit", id, || {
        update_record(&capture.log, &capture.record, |rec| {
            rec.state = state.as_str().to_owned();
            rec.due_at = Some(expires_at);
            if let Some(body) = rec.body.as_object_mut() {
                body.insert("state".into(), json!(state.as_str()));
                body.insert("exit_code".into(), json!(exit_code));
                body.insert("signal".into(), json!(signal));
                body.insert("ended_at".into(), json!(rfc3339(ended_at)));
                body.insert("output_expires_at".into(), json!(rfc3339(expires_at)));
                if truncated {
                    body.insert("truncated".into(), Value::Bool(true));
                }
            }
        })
    });
    if let Err(e) = recorded.await {
        tracing::warn!(process = %id, error = %e, "could not record the exit");
    }
    let exit = json!({ "state": state.as_str(), "exit_code": exit_code, "signal": signal });
    let appended = patiently("the exit event", id, || async {
        capture
            .log
            .append(&capture.stream, "exit", &exit)
            .await
            .map(drop)
    });
    if let Err(e) = appended.await {
        tracing::warn!(process = %id, error = %e, "could not append the exit event");
    }
}

/// Runs `write` until it is done, again while the store is unavailable, pausing longer each
/// time, for up to [`STORE_PATIENCE`].
async fn patiently<F, Fut>(what: &str, process: &str, write: F) -> Result<(), StoreError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(), StoreError>>,
{
    let give_up = tokio::time::Instant::now() + STORE_PATIENCE;
    let mut pause = Duration::from_millis(100);
    loop {
        match write().await {
            Err(StoreError::Unavailable(e)) if tokio::time::Instant::now() + pause < give_up => {
                tracing::warn!(process = %process, error = %e, "{what} waits for the store");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            done => return done,
        }
    }
}

/// How long a process's output and end wait for an unavailable store to take them.
const STORE_PATIENCE: Duration = Duration::from_secs(300);

/// Reads one pipe to its end (or until told to stop), appending each chunk as an event.
async fn pump(
    mut pipe: impl AsyncRead + Unpin,
    kind: &'static str,
    capture: Arc<Capture>,
    mut stop: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; READ_CHUNK];
    // Bytes of a UTF-8 sequence split across reads, kept for the next chunk.
    let mut carry: Vec<u8> = Vec::new();
    loop {
        let n = tokio::select! {
            read = pipe.read(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
            _ = stop.wait_for(|s| *s) => break,
        };
        let kept = capture.admit(n).await;
        if kept == 0 {
            // Over the cap: keep draining so the process is never blocked on a full pipe.
            continue;
        }
        carry.extend_from_slice(&buf[..kept]);
        let complete = complete_utf8_prefix(&carry);
        let rest = carry.split_off(complete);
        let text = String::from_utf8_lossy(&carry).into_owned();
        carry = rest;
        capture.append(kind, text).await;
    }
    if !carry.is_empty() {
        capture
            .append(kind, String::from_utf8_lossy(&carry).into_owned())
            .await;
    }
}

/// The length of `buf` without a trailing, still incomplete UTF-8 sequence.
fn complete_utf8_prefix(buf: &[u8]) -> usize {
    let start = buf.len().saturating_sub(3);
    for i in (start..buf.len()).rev() {
        let b = buf[i];
        if b & 0xC0 == 0x80 {
            continue; // a continuation byte: look further back for the lead byte
        }
        let needed = match b {
            0xF0..=0xF7 => 4,
            0xE0..=0xEF => 3,
            0xC0..=0xDF => 2,
            _ => 1,
        };
        return if buf.len() - i < needed { i } else { buf.len() };
    }
    buf.len()
}

/// State, exit code and signal name of an ended process.
fn describe(status: &ExitStatus) -> (ProcessState, Option<i32>, Option<String>) {
    match (status.code(), status.signal()) {
        (Some(code), _) => (ProcessState::Exited, Some(code), None),
        (None, Some(sig)) => (ProcessState::Killed, None, Some(signal_name(sig))),
        (None, None) => (ProcessState::Exited, None, None),
    }
}

/// `TERM`, `KILL`, ... (the name without `SIG`); unknown numbers as `SIG<n>`.
pub(super) fn signal_name(sig: libc::c_int) -> String {
    let name = match sig {
        libc::SIGHUP => "HUP",
        libc::SIGINT => "INT",
        libc::SIGQUIT => "QUIT",
        libc::SIGILL => "ILL",
        libc::SIGTRAP => "TRAP",
        libc::SIGABRT => "ABRT",
        libc::SIGBUS => "BUS",
        libc::SIGFPE => "FPE",
        libc::SIGKILL => "KILL",
        libc::SIGUSR1 => "USR1",
        libc::SIGSEGV => "SEGV",
        libc::SIGUSR2 => "USR2",
        libc::SIGPIPE => "PIPE",
        libc::SIGALRM => "ALRM",
        libc::SIGTERM => "TERM",
        libc::SIGXCPU => "XCPU",
        libc::SIGXFSZ => "XFSZ",
        libc::SIGSYS => "SYS",
        other => return format!("SIG{other}"),
    };
    name.to_owned()
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&Rfc3339).unwrap_or_default()
}

/// Applies `change` to the latest stored version of `record`, retrying on version conflicts.
/// A record that is gone (its sandbox was deleted) is not an error.
async fn update_record(
    log: &EventLog,
    record: &Record,
    change: impl Fn(&mut Record),
) -> Result<(), StoreError> {
    let store = log.store();
    for _ in 0..CAS_ATTEMPTS {
        let Some(mut rec) = store.get(record.kind, Scope::System, &record.id).await? else {
            return Ok(());
        };
        change(&mut rec);
        match store.update(&rec).await {
            Ok(_) | Err(StoreError::NotFound) => return Ok(()),
            Err(StoreError::Conflict) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::Conflict)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_prefix_keeps_split_sequences_back() {
        let euro = "€".as_bytes(); // 3 bytes
        let cases: &[(&[u8], usize)] = &[
            (b"abc", 3),
            (&[b'a', euro[0]], 1),
            (&[b'a', euro[0], euro[1]], 1),
            (&[b'a', euro[0], euro[1], euro[2]], 4),
            (&[0xF0, 0x9F, 0x98], 0),
            (&[0xFF], 1),
            (b"", 0),
        ];
        for (input, expected) in cases {
            assert_eq!(complete_utf8_prefix(input), *expected, "input {input:?}");
        }
    }

    #[test]
    fn signal_names() {
        assert_eq!(signal_name(libc::SIGTERM), "TERM");
        assert_eq!(signal_name(libc::SIGKILL), "KILL");
        assert_eq!(signal_name(libc::SIGINT), "INT");
        assert_eq!(signal_name(64), "SIG64");
    }

    /// A group written down and still running is killed; a file whose start time does not
    /// match (the PID now belongs to another process) kills nothing; both files go.
    #[test]
    fn leftover_groups_are_ended_only_when_they_are_the_same_process() {
        use std::os::unix::process::CommandExt as _;
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        let pgid = i32::try_from(child.id()).unwrap();
        let live = dir.path().join("procs").join("local_prc_a");
        write_pid_file(&live, pgid, "local:prc_a").unwrap();
        let stale = dir.path().join("procs").join("local_prc_b");
        std::fs::write(&stale, format!("{pgid} 1 local:prc_b\n")).unwrap();

        assert_eq!(end_leftover(&stale), (false, Some("local:prc_b".into())));
        assert!(
            child.try_wait().unwrap().is_none(),
            "a mismatched file kills nothing"
        );
        assert!(!stale.exists());

        assert_eq!(end_leftover(&live), (true, Some("local:prc_a".into())));
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert!(!live.exists());
        assert_eq!(
            end_leftover(&live),
            (false, None),
            "a missing file is nothing to end"
        );
    }
}
