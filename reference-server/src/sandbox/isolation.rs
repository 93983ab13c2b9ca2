//! Namespaces and an unprivileged uid for the processes of a sandbox.
//!
//! Each sandbox has a holder: bubblewrap (`bwrap`, run by the server as root) creates new
//! mount, PID, IPC, UTS and network namespaces with a root filesystem of its own (the host's
//! `/usr` and `/etc` read-only, a private `/proc`, `/dev` and `/tmp`, and the sandbox's files
//! at `/workspace`), and runs, as its PID 1's only child, a shell in a new user namespace
//! that waits on a pipe from the server. The server maps uid and gid 1000 of that user
//! namespace to a host uid of the sandbox's own. Every process of the sandbox then joins all
//! six namespaces itself, between fork and exec ([`Entry::enter`]), and runs as uid 1000
//! there, unprivileged on the host.
//!
//! The holder's pipe makes a kill total: when the server ends, however it ends, the pipe
//! closes, the holder's shell exits, bubblewrap's PID 1 exits with it and the kernel kills
//! every process left in the PID namespace. Destroy kills PID 1 directly.
//!
//! bubblewrap is used as it comes from Debian: the mount setup, pivot_root and PID 1 reaping
//! are its well-trodden code. What runs between fork and exec here is short: setns, chroot,
//! setuid and one fork, whose parent only waits (a wrapper program in between, such as
//! util-linux `nsenter`, would itself be ended by the signals meant for the process).

use std::ffi::{CString, OsString};
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
/// The namespaces every sandbox process is in, as `GET /v1/capabilities` names them.
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
    /// Host files (the worker binary, the server's TLS certificate) bound read-only at their
    /// own path, so that a session's worker can run inside the sandbox.
    exposed: Vec<PathBuf>,
    weakened: Weakened,
}

impl Namespacer {
    /// Finds bubblewrap and `unshare` and proves with a probe sandbox that the kernel lets
    /// them and [`Entry::enter`] work; the error says what is missing.
    pub(super) fn detect(exposed: Vec<PathBuf>, weakened: Weakened) -> Result<Self, String> {
        // SAFETY: geteuid(2) has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(
                "the server does not run as root, so it cannot give sandboxes a uid of their own"
                    .into(),
            );
        }
        let bwrap = find_program("bwrap").ok_or("bubblewrap (`bwrap`) is not installed")?;
        // The holder's user namespace is made by `unshare` (util-linux) inside bubblewrap's.
        find_program("unshare").ok_or("`unshare` (util-linux) is not installed")?;
        let namespacer = Self {
            bwrap,
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
        let entry = holder.view().entry(WORKSPACE)?;
        let mut cmd = Command::new("true");
        cmd.env_clear()
            .env("PATH", "/usr/bin:/bin")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        // SAFETY: `Entry::enter` is made for a pre_exec closure (system calls only).
        unsafe {
            cmd.pre_exec(move || entry.enter());
        }
        let status = cmd.status()?;
        if status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "`true` inside it ended with {status}"
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
            view: SandboxView { target: 0 },
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
    /// Opens what a process needs to enter this sandbox and start in `cwd` (a path inside
    /// it): the holder's namespaces and root, taken before the spawn so that the child has
    /// only system calls to make between fork and exec.
    pub(super) fn entry(&self, cwd: &str) -> io::Result<Entry> {
        let t = self.target;
        let open = |path: String, flags: libc::c_int| -> io::Result<OwnedFd> {
            let path = CString::new(path).map_err(io::Error::other)?;
            // SAFETY: open(2) on a NUL-terminated path; the descriptor is owned at once.
            let fd = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` was just returned by the kernel and nothing else owns it.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        };
        let mut namespaces = Vec::with_capacity(ENTRY_ORDER.len());
        for (name, kind) in ENTRY_ORDER {
            namespaces.push((open(format!("/proc/{t}/ns/{name}"), libc::O_RDONLY)?, kind));
        }
        Ok(Entry {
            namespaces,
            root: open(format!("/proc/{t}/root"), libc::O_PATH | libc::O_DIRECTORY)?,
            cwd: CString::new(cwd).map_err(io::Error::other)?,
        })
    }

    /// `/proc/<pid>/ns/pid` of the sandbox, for tests that look its processes up.
    #[cfg(test)]
    pub(super) fn pid_namespace(&self) -> PathBuf {
        std::fs::read_link(format!("/proc/{}/ns/pid", self.target)).unwrap_or_default()
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

/// The holder's namespaces in the order a process joins them. The user namespace comes
/// last: bubblewrap, run as root, makes the other five in the host's user namespace, so
/// joining them takes the host root's capabilities, which joining the sandbox's user
/// namespace gives up.
const ENTRY_ORDER: [(&str, libc::c_int); 6] = [
    ("ipc", libc::CLONE_NEWIPC),
    ("uts", libc::CLONE_NEWUTS),
    ("net", libc::CLONE_NEWNET),
    ("pid", libc::CLONE_NEWPID),
    ("mnt", libc::CLONE_NEWNS),
    ("user", libc::CLONE_NEWUSER),
];

/// Everything a child needs to enter one sandbox, opened (close-on-exec) before the spawn.
pub(super) struct Entry {
    /// The holder's `/proc/<pid>/ns/*`, with their `CLONE_NEW*` kinds, in [`ENTRY_ORDER`].
    namespaces: Vec<(OwnedFd, libc::c_int)>,
    /// The holder's root directory (`/proc/<pid>/root`), opened from the host's view: after
    /// joining the mount namespace the child makes it its root.
    root: OwnedFd,
    /// The working directory inside the sandbox.
    cwd: CString,
}

impl Entry {
    /// Moves the calling child into the sandbox and returns in a grandchild that is the
    /// sandbox's process; the child itself never returns. Call it only between fork and exec
    /// (a `pre_exec` closure), after the child has made itself a process group leader.
    ///
    /// Joining a PID namespace places only the caller's later children in it, so the child
    /// forks once more. The grandchild returns and std execs the command in it (a failed
    /// exec reaches the spawner through std's close-on-exec pipe, as without a sandbox).
    /// The child stays the group leader the server waits for: it ignores every signal it
    /// can, so that a signal sent to the group acts on the grandchild alone, and ends the way
    /// the grandchild ended (see [`mirror`]).
    ///
    /// Only async-signal-safe system calls; nothing is allocated.
    pub(super) fn enter(&self) -> io::Result<()> {
        // SAFETY: system calls on descriptors and NUL-terminated strings this entry owns;
        // the calling process is single-threaded (it was just forked).
        unsafe {
            for (fd, kind) in &self.namespaces {
                check(libc::setns(fd.as_raw_fd(), *kind))?;
            }
            check(libc::fchdir(self.root.as_raw_fd()))?;
            check(libc::chroot(c".".as_ptr()))?;
            check(libc::chdir(self.cwd.as_ptr()))?;
            check(libc::setgroups(0, std::ptr::null()))?;
            check(libc::setgid(INSIDE_UID))?;
            check(libc::setuid(INSIDE_UID))?;
            match libc::fork() {
                -1 => Err(io::Error::last_os_error()),
                0 => Ok(()),
                child => mirror(child),
            }
        }
    }
}

/// The part of [`Entry::enter`] that stays outside: waits for `child` and ends as it ended.
///
/// Every catchable signal is ignored before anything else, and std's pipe (which tells the
/// spawner the exec succeeded only once every copy of it is closed) is closed after that, so
/// by the time the server can send a signal, none of them can end this process. Every other
/// descriptor goes too: the output pipes end when the sandbox's process closes them.
///
/// # Safety
///
/// Only between fork and exec, in the process that forked `child`.
unsafe fn mirror(child: libc::pid_t) -> ! {
    // SAFETY: sigaction(2), close_range(2), waitpid(2), setrlimit(2), kill(2) and _exit(2)
    // are async-signal-safe and take no memory of the parent's.
    unsafe {
        let mut ignore: libc::sigaction = std::mem::zeroed();
        ignore.sa_sigaction = libc::SIG_IGN;
        for sig in 1..=libc::SIGRTMAX() {
            // SIGCHLD stays as it is: ignoring it would reap the child before waitpid.
            // SIGKILL and SIGSTOP cannot be ignored; sigaction refuses them.
            if sig != libc::SIGCHLD {
                libc::sigaction(sig, &ignore, std::ptr::null_mut());
            }
        }
        if libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) != 0 {
            for fd in 0..1024 {
                libc::close(fd);
            }
        }
        let mut status = 0;
        loop {
            if libc::waitpid(child, &mut status, 0) == child {
                break;
            }
            if io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                libc::_exit(127);
            }
        }
        if libc::WIFEXITED(status) {
            libc::_exit(libc::WEXITSTATUS(status));
        }
        if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            // The same signal ends this process, without a second core dump.
            let no_core = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::setrlimit(libc::RLIMIT_CORE, &no_core);
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &default, std::ptr::null_mut());
            let mut unblock: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut unblock);
            libc::sigaddset(&mut unblock, sig);
            libc::sigprocmask(libc::SIG_UNBLOCK, &unblock, std::ptr::null_mut());
            libc::kill(libc::getpid(), sig);
            libc::_exit(128 + sig);
        }
        libc::_exit(127)
    }
}

/// `Ok` for a system call's non-negative result, the error in `errno` otherwise.
fn check(result: libc::c_int) -> io::Result<()> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
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
    use std::os::unix::process::ExitStatusExt as _;

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

    /// A namespacer, or `None` (the test is skipped) where the machine has no isolation and
    /// it is not required.
    fn namespacer() -> Option<Namespacer> {
        match Namespacer::detect(Vec::new(), Weakened::default()) {
            Ok(n) => Some(n),
            Err(reason) if std::env::var(REQUIRE_ENV).as_deref() != Ok("1") => {
                eprintln!("skipped: no sandbox isolation here: {reason}");
                None
            }
            Err(reason) => panic!("isolation is required: {reason}"),
        }
    }

    /// A holder on a fresh directory (kept alive by the returned guard).
    fn holder(namespacer: &Namespacer) -> (Holder, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let uid = allocate_uid();
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(uid)).unwrap();
        (namespacer.start(dir.path(), uid).unwrap(), dir)
    }

    /// `argv` to run inside `view`'s sandbox in its own process group, as the provider
    /// starts processes.
    fn entered<const N: usize>(view: &SandboxView, argv: [&str; N]) -> Command {
        let entry = view.entry(WORKSPACE).unwrap();
        let mut cmd = Command::new(argv[0]);
        cmd.args(&argv[1..])
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .stdin(Stdio::null())
            .process_group(0);
        // SAFETY: `Entry::enter` is made for a pre_exec closure.
        unsafe {
            cmd.pre_exec(move || entry.enter());
        }
        cmd
    }

    /// Host PIDs of the processes in the sandbox's PID namespace other than its PID 1 and
    /// the holder's shell.
    fn sandbox_processes(view: &SandboxView, holder: &Holder) -> Vec<i32> {
        let ns = view.pid_namespace();
        let init = first_child(holder.child.id() as i32);
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| {
                Some(pid) != init
                    && pid != view.target
                    && runs(pid)
                    && std::fs::read_link(format!("/proc/{pid}/ns/pid")).is_ok_and(|n| n == ns)
            })
            .collect()
    }

    #[test]
    fn an_entered_process_is_in_every_namespace_of_the_holder_as_uid_1000() {
        let Some(namespacer) = namespacer() else {
            return;
        };
        let (holder, _dir) = holder(&namespacer);
        let view = holder.view();
        let script = "id -u; id -g; pwd; for n in user mnt pid ipc uts net; do \
                      readlink /proc/self/ns/$n; done; hostname";
        let out = entered(&view, ["sh", "-c", script]).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        let mut want = vec!["1000".to_owned(), "1000".to_owned(), WORKSPACE.to_owned()];
        for n in ["user", "mnt", "pid", "ipc", "uts", "net"] {
            let link = std::fs::read_link(format!("/proc/{}/ns/{n}", view.target)).unwrap();
            want.push(link.to_string_lossy().into_owned());
        }
        want.push("sandbox".to_owned());
        let got: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_missing_program_fails_the_spawn_and_leaves_nothing() {
        let Some(namespacer) = namespacer() else {
            return;
        };
        let (holder, _dir) = holder(&namespacer);
        let view = holder.view();
        // `sh` is on the host, `/workspace/nothing-here` is not inside: the lookup and the
        // exec happen inside the sandbox, and std's error pipe carries the failure back.
        for program in ["/workspace/nothing-here", "no-such-program-anywhere"] {
            let err = entered(&view, [program]).spawn().unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::NotFound, "{program}: {err}");
        }
        let host_only = std::env::current_exe().unwrap();
        let err = entered(&view, [host_only.to_str().unwrap()])
            .spawn()
            .unwrap_err();
        assert_eq!(
            err.kind(),
            io::ErrorKind::NotFound,
            "the host's files are out of view"
        );
        assert_eq!(sandbox_processes(&view, &holder), Vec::<i32>::new());
    }

    #[test]
    fn the_waited_for_process_ends_as_the_sandboxed_one_ended() {
        let Some(namespacer) = namespacer() else {
            return;
        };
        let (holder, _dir) = holder(&namespacer);
        let view = holder.view();
        let status = entered(&view, ["sh", "-c", "exit 7"]).status().unwrap();
        assert_eq!(status.code(), Some(7));
        let status = entered(&view, ["sh", "-c", "kill -TERM $$"])
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(libc::SIGTERM));
        let status = entered(&view, ["sh", "-c", "kill -SEGV $$"])
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(libc::SIGSEGV));
    }

    #[test]
    fn a_signal_to_the_group_reaches_the_sandboxed_process_alone() {
        let Some(namespacer) = namespacer() else {
            return;
        };
        let (holder, _dir) = holder(&namespacer);
        let view = holder.view();
        // The process says when its trap is set; TERM then only writes a line.
        let mut child = entered(
            &view,
            [
                "sh",
                "-c",
                "trap 'echo got TERM' TERM; echo ready; while :; do sleep 0.1; done",
            ],
        )
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
        let pgid = child.id() as i32;
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert_eq!(line, "ready\n");
        // SAFETY: kill(2) to the group this test started.
        assert_eq!(unsafe { libc::kill(-pgid, libc::SIGTERM) }, 0);
        line.clear();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert_eq!(line, "got TERM\n", "the trap ran");
        assert_eq!(
            child.try_wait().unwrap(),
            None,
            "TERM ended the waited-for process"
        );
        assert!(!sandbox_processes(&view, &holder).is_empty());
        // SAFETY: as above.
        assert_eq!(unsafe { libc::kill(-pgid, libc::SIGKILL) }, 0);
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        // Bounded, not timed: the kernel reaps the sandboxed process asynchronously.
        for _ in 0..500 {
            if sandbox_processes(&view, &holder).is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(sandbox_processes(&view, &holder), Vec::<i32>::new());
    }

    /// Whether host PID `pid` runs (a zombie runs nothing).
    fn runs(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|stat| !stat.contains(") Z "))
    }

    #[test]
    fn kill_ends_every_process_of_the_sandbox_while_the_holder_lives() {
        let Some(namespacer) = namespacer() else {
            return;
        };
        let (mut holder, _dir) = holder(&namespacer);
        let view = holder.view();
        let shell = view.target;
        let mut sleeper = entered(&view, ["sh", "-c", "sleep 1000 & echo $!; wait"]);
        let mut sleeper = sleeper.stdout(Stdio::piped()).spawn().unwrap();
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
        // The process the server would wait for ends with the sandbox's.
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
