//! Namespaces and an unprivileged uid for the processes of a sandbox.
//!
//! Each sandbox has a holder: bubblewrap (`bwrap`, run by the server as root) creates new
//! mount, PID, IPC, UTS and network namespaces with a root filesystem of its own (the host's
//! `/usr` and `/etc` read-only, a private `/proc`, `/dev` and `/tmp`, and the sandbox's files
//! at `/workspace`), and runs, as its PID 1's only child, a shell in a new user namespace
//! that waits on a pipe from the server. The server maps uid and gid 1000 of that user
//! namespace to a host uid of the sandbox's own. Every process of the sandbox then enters all
//! six namespaces through `nsenter` and runs as uid 1000 there, unprivileged on the host.
//!
//! The holder's pipe makes a kill total: when the server ends, however it ends, the pipe
//! closes, the holder's shell exits, bubblewrap's PID 1 exits with it and the kernel kills
//! every process left in the PID namespace. Destroy kills PID 1 directly.
//!
//! Both tools are used as they come from Debian (`bubblewrap`, `util-linux`): the mount setup,
//! pivot_root and PID 1 reaping are bubblewrap's well-trodden code rather than unsafe code
//! between fork and exec here.

use std::ffi::OsString;
use std::io::{self, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

/// The uid (and gid) every sandbox process has inside its user namespace.
pub(super) const INSIDE_UID: u32 = 1000;
/// Where a sandbox's files are inside its mount namespace (its processes' `HOME`).
pub(super) const WORKSPACE: &str = "/workspace";
/// Host uids of sandboxes are drawn from `[UID_BASE, UID_BASE + UID_RANGE)`: far above the
/// ranges that distributions give to users, services and container subordinate ids.
const UID_BASE: u32 = 3_000_000_000;
const UID_RANGE: u32 = 1_000_000_000;
/// How long a new holder may take to reach its user namespace.
const HOLDER_READY_WAIT: Duration = Duration::from_secs(10);
/// The namespaces every sandbox process is in, by their `nsenter` and `/proc/<pid>/ns` names.
pub const NAMESPACES: [&str; 6] = ["user", "mount", "pid", "ipc", "uts", "network"];
/// Environment variable that turns a missing isolation facility into a start failure.
pub const REQUIRE_ENV: &str = "SANDSPEC_REQUIRE_ISOLATION";

/// Which parts of the namespace setup a defect weakens (reference-server/src/defects.rs).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Weakened {
    /// The host's whole filesystem is mounted read-only at `/host` inside the sandbox.
    pub(super) host_visible: bool,
    /// The host's `/tmp` is shared, writable, instead of a private one.
    pub(super) host_tmp_shared: bool,
    /// No PID namespace: the sandbox sees (and `/proc` lists) every process of the host.
    pub(super) host_pids_visible: bool,
}

/// The tools found at start and what every holder mounts besides the system.
#[derive(Debug, Clone)]
pub(super) struct Namespacer {
    bwrap: PathBuf,
    nsenter: PathBuf,
    /// Host files (the worker binary, the server's TLS certificate) bound read-only at their
    /// own path, so that a session's worker can run inside the sandbox.
    exposed: Vec<PathBuf>,
    weakened: Weakened,
}

impl Namespacer {
    /// Finds bubblewrap and nsenter and proves with a probe sandbox that the kernel lets
    /// them work; the error says what is missing.
    pub(super) fn detect(exposed: Vec<PathBuf>, weakened: Weakened) -> Result<Self, String> {
        // SAFETY: geteuid(2) has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(
                "the server does not run as root, so it cannot give sandboxes a uid of their own"
                    .into(),
            );
        }
        let bwrap = find_program("bwrap").ok_or("bubblewrap (`bwrap`) is not installed")?;
        let nsenter = find_program("nsenter").ok_or("`nsenter` (util-linux) is not installed")?;
        let namespacer = Self {
            bwrap,
            nsenter,
            exposed: exposed.into_iter().filter(|p| p.is_file()).collect(),
            weakened,
        };
        namespacer
            .probe()
            .map_err(|e| format!("a probe sandbox failed: {e}"))?;
        Ok(namespacer)
    }

    /// Starts a holder on a scratch directory and runs `true` inside it.
    fn probe(&self) -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let uid = allocate_uid();
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(uid))?;
        let holder = self.start(dir.path(), uid)?;
        let mut cmd = Command::new(&self.nsenter);
        cmd.args(holder.view().enter_args(WORKSPACE))
            .arg("--")
            .arg("true")
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let out = cmd.output()?;
        if out.status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "nsenter: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )))
        }
    }

    /// Creates the namespaces of one sandbox whose files are `root` (owned by `host_uid`).
    pub(super) fn start(&self, root: &Path, host_uid: u32) -> io::Result<Holder> {
        let root_dir = std::fs::File::open(root)?;
        let mut args: Vec<OsString> = Vec::new();
        for flag in [
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-net",
            "--hostname",
            "sandbox",
        ] {
            args.push(flag.into());
        }
        if !self.weakened.host_pids_visible {
            args.push(OsString::from("--unshare-pid"));
        }
        args.push(OsString::from("--ro-bind"));
        args.push(OsString::from("/usr"));
        args.push(OsString::from("/usr"));
        for dir in ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"] {
            let path = Path::new(dir);
            match std::fs::read_link(path) {
                Ok(target) => {
                    args.push(OsString::from("--symlink"));
                    args.push(target.into_os_string());
                    args.push(OsString::from(dir));
                }
                Err(_) if path.is_dir() => {
                    args.push(OsString::from("--ro-bind"));
                    args.push(OsString::from(dir));
                    args.push(OsString::from(dir));
                }
                Err(_) => {}
            }
        }
        args.push(OsString::from("--ro-bind"));
        args.push(OsString::from("/etc"));
        args.push(OsString::from("/etc"));
        if self.weakened.host_pids_visible {
            args.push(OsString::from("--ro-bind"));
            args.push(OsString::from("/proc"));
            args.push(OsString::from("/proc"));
        } else {
            args.push(OsString::from("--proc"));
            args.push(OsString::from("/proc"));
        }
        args.push(OsString::from("--dev"));
        args.push(OsString::from("/dev"));
        if self.weakened.host_tmp_shared {
            args.push(OsString::from("--bind"));
            args.push(OsString::from("/tmp"));
            args.push(OsString::from("/tmp"));
        } else {
            args.push(OsString::from("--perms"));
            args.push(OsString::from("1777"));
            args.push(OsString::from("--tmpfs"));
            args.push(OsString::from("/tmp"));
        }
        if self.weakened.host_visible {
            args.push(OsString::from("--ro-bind"));
            args.push(OsString::from("/"));
            args.push(OsString::from("/host"));
        }
        // bubblewrap makes the missing parents of a bind's destination private to root
        // (0700), which the sandbox's uid could not pass through: they are made first, 0755.
        let mut parents: Vec<&Path> = Vec::new();
        for path in &self.exposed {
            let mut chain: Vec<&Path> = path
                .ancestors()
                .skip(1)
                .filter(|p| p.parent().is_some())
                .collect();
            chain.reverse();
            for dir in chain {
                if !parents.contains(&dir) {
                    parents.push(dir);
                }
            }
        }
        for dir in parents {
            for a in ["--perms", "0755", "--dir"] {
                args.push(a.into());
            }
            args.push(dir.as_os_str().to_owned());
        }
        for path in &self.exposed {
            args.push("--ro-bind".into());
            args.push(path.clone().into_os_string());
            args.push(path.clone().into_os_string());
        }
        // The sandbox's directory goes in by descriptor: its host path stays out of the
        // command line that the sandbox can read in /proc/1/cmdline.
        args.push(OsString::from("--bind-fd"));
        args.push(OsString::from("3"));
        args.push(OsString::from(WORKSPACE));
        args.push(OsString::from("--chdir"));
        args.push(OsString::from("/"));
        args.push(OsString::from("--"));
        for a in ["unshare", "--user", "--", "sh", "-c", "read _"] {
            args.push(a.into());
        }

        let mut cmd = Command::new(&self.bwrap);
        cmd.args(&args)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let fd = root_dir.as_raw_fd();
        // SAFETY: runs in the child between fork and exec and only calls dup2(2) and
        // fcntl(2), which are async-signal-safe; `fd` stays open in the parent until after
        // the spawn.
        unsafe {
            cmd.pre_exec(move || inherit_as_fd3(fd));
        }
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take();
        let mut holder = Holder {
            child,
            _keepalive: stdin,
            pidfds: Vec::new(),
            view: SandboxView {
                target: 0,
                nsenter: self.nsenter.clone(),
            },
        };
        holder.wait_ready(host_uid)?;
        check_same_dir(&root_dir, &holder.view.view_path(WORKSPACE))?;
        drop(root_dir);
        Ok(holder)
    }
}

/// Fails unless `inside` (the holder's `/workspace`, seen from the host) is the directory
/// `root` is open on: what the sandbox works in must be its own files and nothing else.
fn check_same_dir(root: &std::fs::File, inside: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let want = root.metadata()?;
    let got = std::fs::metadata(inside)?;
    if (want.dev(), want.ino()) == (got.dev(), got.ino()) {
        Ok(())
    } else {
        Err(io::Error::other(
            "the sandbox's /workspace is not its own directory",
        ))
    }
}

/// The namespaces of one running sandbox. Dropping it kills everything inside.
pub(super) struct Holder {
    /// bubblewrap's own process (outside the namespaces).
    child: Child,
    /// The write end of the holder's stdin: closed when the server ends, which ends the
    /// sandbox.
    _keepalive: Option<ChildStdin>,
    /// pidfds of the PID namespace's PID 1 (bubblewrap's init) and of the holder's shell,
    /// taken while they are known to run: a kill through them can reach no other process,
    /// even when they ended and their PIDs were given to something else.
    pidfds: Vec<OwnedFd>,
    view: SandboxView,
}

/// How to reach into a running sandbox's namespaces.
#[derive(Debug, Clone)]
pub(super) struct SandboxView {
    /// Host PID of the holder's shell, the process whose namespaces every process enters.
    target: i32,
    nsenter: PathBuf,
}

impl Holder {
    /// Waits until the holder's shell is in its user namespace, then maps the sandbox's uid.
    fn wait_ready(&mut self, host_uid: u32) -> io::Result<()> {
        let own_userns = std::fs::read_link("/proc/self/ns/user")?;
        let bwrap = self.child.id() as i32;
        let deadline = std::time::Instant::now() + HOLDER_READY_WAIT;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Err(io::Error::other(format!(
                    "bubblewrap exited with {status} before the sandbox was ready"
                )));
            }
            // bwrap -> its PID 1 -> the shell (first in `unshare`, which then execs it);
            // without a PID namespace bwrap runs the shell itself.
            let init = first_child(bwrap);
            let candidates = [init, init.and_then(first_child)];
            let target = candidates.into_iter().flatten().find(|pid| {
                std::fs::read_link(format!("/proc/{pid}/ns/user")).is_ok_and(|ns| ns != own_userns)
            });
            if let (Some(init), Some(target)) = (init, target) {
                self.pidfds = vec![pidfd_open(init)?, pidfd_open(target)?];
                self.view.target = target;
                break;
            }
            if std::time::Instant::now() > deadline {
                return Err(io::Error::other("the sandbox's namespaces did not come up"));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let map = format!("{INSIDE_UID} {host_uid} 1\n");
        for file in ["uid_map", "gid_map"] {
            std::fs::OpenOptions::new()
                .write(true)
                .open(format!("/proc/{}/{file}", self.view.target))?
                .write_all(map.as_bytes())?;
        }
        Ok(())
    }

    pub(super) fn view(&self) -> SandboxView {
        self.view.clone()
    }

    /// Kills PID 1 of the sandbox (the kernel then kills every other process in its PID
    /// namespace) and bubblewrap, and reaps bubblewrap.
    pub(super) fn kill(&mut self) {
        for fd in self.pidfds.drain(..) {
            // SAFETY: pidfd_send_signal(2) on a pidfd this holder owns, with no siginfo.
            unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    fd.as_raw_fd(),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.view.target = 0;
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        self.kill();
    }
}

impl SandboxView {
    /// `nsenter` arguments (before `--` and the command) that enter every namespace, run
    /// as uid 1000 and start in `cwd` (a path inside the sandbox).
    pub(super) fn enter_args(&self, cwd: &str) -> Vec<OsString> {
        let t = self.target;
        vec![
            format!("--target={t}").into(),
            "--user".into(),
            "--mount".into(),
            "--pid".into(),
            "--ipc".into(),
            "--uts".into(),
            "--net".into(),
            // Both are opened before nsenter enters the mount namespace, so they go through
            // the holder's root as the host sees it.
            format!("--root=/proc/{t}/root").into(),
            format!("--wd=/proc/{t}/root{cwd}").into(),
            format!("--setuid={INSIDE_UID}").into(),
            format!("--setgid={INSIDE_UID}").into(),
        ]
    }

    /// `/proc/<pid>/ns/pid` of the sandbox, for tests that look its processes up.
    #[cfg(test)]
    pub(super) fn pid_namespace(&self) -> PathBuf {
        std::fs::read_link(format!("/proc/{}/ns/pid", self.target)).unwrap_or_default()
    }

    pub(super) fn nsenter(&self) -> &Path {
        &self.nsenter
    }

    /// The host path under which the sandbox's own view of `inside` can be read.
    pub(super) fn view_path(&self, inside: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{inside}", self.target))
    }

    /// Opens a TCP connection to `127.0.0.1:port` inside the sandbox's network namespace.
    pub(super) async fn connect(&self, port: u16) -> io::Result<tokio::net::TcpStream> {
        let stream = self
            .in_netns(move || TcpStream::connect((Ipv4Addr::LOCALHOST, port)))
            .await?;
        stream.set_nonblocking(true)?;
        tokio::net::TcpStream::from_std(stream)
    }

    /// Listens on `127.0.0.1:port` inside the sandbox's network namespace.
    pub(super) async fn listen(&self, port: u16) -> io::Result<tokio::net::TcpListener> {
        let listener = self
            .in_netns(move || TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port))))
            .await?;
        listener.set_nonblocking(true)?;
        tokio::net::TcpListener::from_std(listener)
    }

    /// Runs `f` on a thread of its own that first joins the sandbox's network namespace; the
    /// thread ends afterwards, so no thread of the server stays in a sandbox's namespace.
    /// A socket keeps the namespace it was created in.
    async fn in_netns<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        let ns = std::fs::File::open(format!("/proc/{}/ns/net", self.target))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            // SAFETY: setns(2) on an open namespace descriptor changes only this thread.
            let joined = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            let result = if joined == 0 {
                f()
            } else {
                Err(io::Error::last_os_error())
            };
            let _ = tx.send(result);
        });
        rx.await
            .map_err(|_| io::Error::other("network namespace thread failed"))?
    }
}

/// Makes `fd` the child's descriptor 3, open across exec. When `fd` already is 3, dup2(2)
/// changes nothing and its close-on-exec flag would stay: bubblewrap would then find 3 free,
/// open its own `/proc` there and bind that at `/workspace`. So that case clears the flag.
///
/// Called only between fork and exec.
fn inherit_as_fd3(fd: i32) -> io::Result<()> {
    const TARGET: i32 = 3;
    // SAFETY: dup2(2) and fcntl(2) on descriptors of this process; no memory is involved.
    let done = unsafe {
        if fd == TARGET {
            libc::fcntl(TARGET, libc::F_SETFD, 0)
        } else {
            libc::dup2(fd, TARGET)
        }
    };
    if done < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A pidfd of `pid` (pidfd_open(2)).
fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a PID and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(io::Error::other)?;
    // SAFETY: `fd` was just returned by the kernel and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A fresh host uid for a sandbox.
pub(super) fn allocate_uid() -> u32 {
    let random = ulid::Ulid::new().random() as u32;
    UID_BASE + random % UID_RANGE
}

/// Whether `uid` is one this module hands out (a sandbox root owned by it is isolated).
pub(super) fn is_sandbox_uid(uid: u32) -> bool {
    (UID_BASE..UID_BASE + UID_RANGE).contains(&uid)
}

/// The first child of `pid` (`/proc/<pid>/task/<pid>/children`).
fn first_child(pid: i32) -> Option<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `name` in the directories of `PATH` (or the usual system ones).
fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin:/usr/sbin:/sbin".into());
    std::env::split_paths(&path)
        .chain(["/usr/bin", "/bin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The child's descriptor 3 after `inherit_as_fd3`, as `readlink /proc/self/fd/3` shows
    /// it; `planted` first puts `dir` at 3 with close-on-exec, as when the parent's own
    /// descriptor for it happens to be 3.
    fn fd3_of_child(dir: &Path, planted: bool) -> String {
        let file = std::fs::File::open(dir).unwrap();
        let fd = file.as_raw_fd();
        let mut cmd = Command::new("readlink");
        cmd.arg("/proc/self/fd/3");
        // SAFETY: only dup2(2) and fcntl(2) between fork and exec; `file` outlives the spawn.
        unsafe {
            cmd.pre_exec(move || {
                if !planted {
                    return inherit_as_fd3(fd);
                }
                if libc::dup2(fd, 3) < 0 || libc::fcntl(3, libc::F_SETFD, libc::FD_CLOEXEC) < 0 {
                    return Err(io::Error::last_os_error());
                }
                inherit_as_fd3(3)
            });
        }
        let out = cmd.output().unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }

    /// Whether host PID `pid` runs (a zombie runs nothing).
    fn runs(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|stat| !stat.contains(") Z "))
    }

    #[test]
    fn kill_ends_every_process_of_the_sandbox_while_the_holder_lives() {
        let namespacer = match Namespacer::detect(Vec::new(), Weakened::default()) {
            Ok(n) => n,
            Err(reason) if std::env::var(REQUIRE_ENV).as_deref() != Ok("1") => {
                eprintln!("skipped: no sandbox isolation here: {reason}");
                return;
            }
            Err(reason) => panic!("isolation is required: {reason}"),
        };
        let dir = tempfile::tempdir().unwrap();
        let uid = allocate_uid();
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(uid)).unwrap();
        let mut holder = namespacer.start(dir.path(), uid).unwrap();
        let view = holder.view();
        let shell = view.target;
        let mut sleeper = Command::new(view.nsenter())
            .args(view.enter_args(WORKSPACE))
            .args(["--", "sh", "-c", "sleep 1000 & echo $!; wait"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(sleeper.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let inner: i32 = line.trim().parse().unwrap();
        // The sleeper's host PID: the process in the sandbox's PID namespace whose
        // innermost PID is `inner`.
        let ns = view.pid_namespace();
        let host = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .find_map(|e| {
                let pid: i32 = e.file_name().to_str()?.parse().ok()?;
                (std::fs::read_link(e.path().join("ns/pid")).ok()? == ns).then_some(())?;
                let status = std::fs::read_to_string(e.path().join("status")).ok()?;
                let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
                (nspid.split_whitespace().last()?.parse::<i32>().ok()? == inner).then_some(pid)
            })
            .expect("the sleeper on the host");
        assert!(runs(host) && runs(shell));
        holder.kill();
        // Bounded, not timed: the kernel tears the namespace down asynchronously.
        for _ in 0..500 {
            if !runs(host) && !runs(shell) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!runs(host), "the sandbox's process outlived kill");
        assert!(!runs(shell), "the holder's shell outlived kill");
        // nsenter has its exit now that its child is gone.
        let _ = sleeper.wait();
        drop(holder);
    }

    #[test]
    fn the_sandbox_directory_reaches_bubblewrap_as_fd_3_whatever_its_number() {
        let dir = tempfile::tempdir().unwrap();
        let want = std::fs::canonicalize(dir.path()).unwrap();
        for planted in [false, true] {
            assert_eq!(
                fd3_of_child(dir.path(), planted),
                want.to_string_lossy(),
                "planted at 3: {planted}"
            );
        }
    }
}
