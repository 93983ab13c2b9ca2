//! Namespaces and unprivileged uids for the processes of a sandbox, made by the server itself.
//!
//! Each sandbox has a holder ([`holder`]): a process of the server's own binary that makes
//! the sandbox's mount, PID, IPC, UTS and network namespaces, builds its root filesystem and,
//! as PID 1 of its PID namespace, hands the server a descriptor of each namespace (and of the
//! user namespaces its processes run in), then waits on a socket the server holds. Every
//! process of the sandbox joins those namespaces itself, between fork and exec
//! ([`Entry::enter`]), and runs as `user` (uid 1000) or `root` (uid 0) there, unprivileged on
//! the host.
//!
//! Two ways, chosen at start ([`Privilege`]):
//! - the server runs as root in the host's user namespace: the namespaces belong to the
//!   host's, and a sandbox's processes run in a user namespace of their own that maps 1000 to
//!   a host uid of the sandbox's own (and 0 to the next one);
//! - otherwise (an ordinary user, or root inside a user namespace): a user namespace mapping
//!   the server's uid to 0 owns the sandbox's namespaces, and the sandbox's processes run in
//!   two nested ones that map 1000 (`user`) and 0 (`root`) to it: the server's host uid.
//!
//! Kill is total: when the server ends, however it ends, its end of the holder's socket
//! closes, PID 1 exits and the kernel kills every process left in the PID namespace. Destroy
//! SIGKILLs PID 1 through its pidfd.
//!
//! What runs between fork and exec here is short: setns, chroot, setuid and one fork, whose
//! parent only waits (a wrapper program in between, such as util-linux `nsenter`, would itself
//! be ended by the signals meant for the process).

mod holder;
mod sys;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub(super) use holder::{Privilege, Weakened};

/// The uid (and gid) of a sandbox's `user` inside its user namespace.
pub(super) const INSIDE_UID: u32 = 1000;
/// Where a sandbox's files are inside its mount namespace: `user`'s home, as E2B's envd has it.
pub(super) const HOME: &str = "/home/user";
/// The same directory again, where the first versions of this server put it.
pub(super) const WORKSPACE: &str = "/workspace";
/// `root`'s home inside a sandbox (a tmpfs of its own).
pub(super) const ROOT_HOME: &str = "/root";
/// Host uids of sandboxes (as root) are drawn from `[UID_BASE, UID_BASE + UID_RANGE)`, in
/// pairs (`user`, then `root`): far above the ranges that distributions give to users,
/// services and container subordinate ids.
const UID_BASE: u32 = 3_000_000_000;
const UID_RANGE: u32 = 1_000_000_000;
/// How long a new holder may take to hand its namespaces over, and to answer a request.
const HOLDER_WAIT: Duration = Duration::from_secs(10);
/// The namespaces every sandbox process is in, as `GET /v1/capabilities` names them.
pub const NAMESPACES: [&str; 6] = ["user", "mount", "pid", "ipc", "uts", "network"];
/// Environment variable that turns a missing isolation facility into a start failure.
pub const REQUIRE_ENV: &str = "SANDSPEC_REQUIRE_ISOLATION";

/// Which user of the sandbox a process runs as (E2B's `user`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SandboxUser {
    /// `user`, uid 1000, home `/home/user`: every process unless asked otherwise.
    #[default]
    User,
    /// `root`, uid 0 inside the sandbox's own user namespace, home `/root`: root over the
    /// sandbox's files and its user namespace, nothing on the host, and no power over the
    /// sandbox's mounts, network or PID namespace (they belong to another user namespace).
    Root,
}

impl SandboxUser {
    /// The uid and gid inside the sandbox.
    fn id(self) -> u32 {
        match self {
            SandboxUser::User => INSIDE_UID,
            SandboxUser::Root => 0,
        }
    }

    /// `HOME` of its processes.
    pub fn home(self) -> &'static str {
        match self {
            SandboxUser::User => HOME,
            SandboxUser::Root => ROOT_HOME,
        }
    }
}

/// How this server makes namespaces, and what every holder mounts besides the system.
#[derive(Debug, Clone)]
pub(super) struct Namespacer {
    privilege: Privilege,
    /// Host files (the worker binary, the server's TLS certificate), canonical, bound
    /// read-only at their own path, so that a session's worker can run inside the sandbox.
    exposed: Vec<PathBuf>,
    weakened: Weakened,
}

impl Namespacer {
    /// Chooses how to make namespaces here and proves with a probe sandbox that the kernel
    /// lets the server make and enter them; the error says what is missing and how to fix it.
    pub(super) fn detect(exposed: Vec<PathBuf>, weakened: Weakened) -> Result<Self, String> {
        // SAFETY: geteuid(2) has no preconditions.
        let privilege = if unsafe { libc::geteuid() } == 0 && in_initial_user_namespace() {
            Privilege::Root
        } else {
            Privilege::Unprivileged
        };
        let namespacer = Self {
            privilege,
            exposed: exposed
                .iter()
                .filter(|p| p.is_file())
                .filter_map(|p| std::fs::canonicalize(p).ok())
                .collect(),
            weakened,
        };
        namespacer.probe().map_err(|e| match privilege {
            Privilege::Root => format!("a probe sandbox failed (as root): {e}"),
            Privilege::Unprivileged => unprivileged_failure(&e),
        })?;
        Ok(namespacer)
    }

    /// How namespaces are made: `root` or `unprivileged` (capabilities).
    pub(super) fn privilege(&self) -> Privilege {
        self.privilege
    }

    /// Starts a holder on a scratch directory and runs `true` inside it.
    fn probe(&self) -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let holder = self.start(dir.path())?;
        let entry = holder.view().entry(HOME, SandboxUser::User)?;
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

    /// Creates the namespaces of one sandbox whose files are `root`. As root the files get a
    /// host uid of the sandbox's own first (the one they have when they have one already).
    pub(super) fn start(&self, root: &Path) -> io::Result<Holder> {
        use std::os::unix::fs::MetadataExt as _;
        let root_dir = std::fs::File::open(root)?;
        let host_uid = match self.privilege {
            Privilege::Root => {
                let owner = root_dir.metadata()?.uid();
                if is_sandbox_uid(owner) {
                    owner
                } else {
                    let uid = allocate_uid();
                    chown_tree(root, uid)?;
                    uid
                }
            }
            // SAFETY: geteuid(2) has no preconditions.
            Privilege::Unprivileged => unsafe { libc::geteuid() },
        };
        let meta = root_dir.metadata()?;
        let plan = holder::Plan {
            privilege: self.privilege,
            host_uid,
            // The sandbox's files by a path with no link in it, resolved here once: the
            // holder checks that what it finds there is this very directory.
            workspace: std::fs::canonicalize(root)?,
            workspace_id: [meta.dev(), meta.ino()],
            exposed: self.exposed.clone(),
            weakened: self.weakened,
        };
        let (ours, theirs) = sys::seqpacket_pair()?;
        // The hook runs in whatever binary the server is (`sandspec`, a test): keep it linked.
        std::hint::black_box(&holder::HOOK);
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg0(holder::ARG0)
            .env_clear()
            .env(holder::ENV, "1")
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // A terminal's Ctrl-C for the server is not for the holder: it ends when the
            // server's end of the socket closes.
            .process_group(0);
        let mut child = cmd.spawn()?;
        drop(cmd);
        match self.hand_over(&plan, ours, &root_dir) {
            Ok((init, view)) => Ok(Holder {
                child,
                init: Some(init),
                view,
            }),
            Err(e) => {
                // PID 1, if there is one, exits as `ours` closed.
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    /// Sends a holder its plan over `ours` and takes the sandbox it made: PID 1's pidfd and
    /// the view, checked to hold the sandbox's own files (`root_dir`).
    fn hand_over(
        &self,
        plan: &holder::Plan,
        ours: OwnedFd,
        root_dir: &std::fs::File,
    ) -> io::Result<(OwnedFd, SandboxView)> {
        let plan = serde_json::to_vec(plan).map_err(io::Error::other)?;
        sys::send(ours.as_fd(), &plan, &[])?;
        if !sys::wait_readable(ours.as_fd(), HOLDER_WAIT)? {
            return Err(io::Error::other(
                "the sandbox's namespaces did not come up in time",
            ));
        }
        let (answer, fds) = sys::recv(ours.as_fd(), 4096).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => io::Error::other("the sandbox's holder exited"),
            _ => e,
        })?;
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let Some(names) = answer.strip_prefix("ok ") else {
            let reason = answer.strip_prefix("error ").unwrap_or(&answer);
            return Err(io::Error::other(reason.to_owned()));
        };
        let mut named: Vec<(String, OwnedFd)> =
            names.split(' ').map(str::to_owned).zip(fds).collect();
        let mut take = |name: &str| -> io::Result<OwnedFd> {
            let i = named
                .iter()
                .position(|(n, _)| n == name)
                .ok_or_else(|| io::Error::other(format!("the holder sent no `{name}`")))?;
            Ok(named.swap_remove(i).1)
        };
        let mut joins = Vec::new();
        if self.privilege == Privilege::Unprivileged {
            // First the user namespace that owns the others: joining them takes its
            // capabilities.
            joins.push((take("user")?, libc::CLONE_NEWUSER));
        }
        for (name, kind) in [
            ("ipc", libc::CLONE_NEWIPC),
            ("uts", libc::CLONE_NEWUTS),
            ("net", libc::CLONE_NEWNET),
        ] {
            joins.push((take(name)?, kind));
        }
        if !self.weakened.host_pids_visible {
            joins.push((take("pid")?, libc::CLONE_NEWPID));
        }
        // The mount namespace last: until then the child still sees the host's `/proc`.
        let mnt = take("mnt")?;
        joins.push((mnt, libc::CLONE_NEWNS));
        let init = take("init")?;
        let view = SandboxView {
            inner: Arc::new(ViewInner {
                privilege: self.privilege,
                control: Mutex::new(ours),
                joins,
                root: take("root")?,
                as_user: take("as_user")?,
                as_root: take("as_root")?,
            }),
        };
        for inside in [HOME, WORKSPACE] {
            check_same_dir(root_dir, &view, inside)?;
        }
        Ok((init, view))
    }
}

/// Whether this process is in the host's (initial) user namespace, where root is root.
fn in_initial_user_namespace() -> bool {
    std::fs::read_to_string("/proc/self/uid_map")
        .is_ok_and(|map| map.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"])
}

/// Why unprivileged namespaces failed here, with the fix where the kernel's settings say it.
fn unprivileged_failure(error: &io::Error) -> String {
    let setting = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_owned())
    };
    let fix = if setting("/proc/sys/kernel/unprivileged_userns_clone").as_deref() == Some("0") {
        "sysctl -w kernel.unprivileged_userns_clone=1"
    } else if setting("/proc/sys/user/max_user_namespaces").as_deref() == Some("0") {
        "sysctl -w user.max_user_namespaces=15000"
    } else if setting("/proc/sys/kernel/apparmor_restrict_unprivileged_userns").as_deref()
        == Some("1")
    {
        "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile \
         that lets this binary use user namespaces"
    } else {
        "allow unprivileged user namespaces (user.max_user_namespaces > 0; no seccomp or LSM \
         policy denying unshare(CLONE_NEWUSER)), or run the server as root"
    };
    format!("the kernel refused unprivileged user namespaces ({error}); fix: {fix}")
}

/// Fails unless `inside` (the sandbox's `/home/user` or `/workspace`, seen through the
/// holder's root) is the directory `root` is open on: what the sandbox works in must be its
/// own files and nothing else.
fn check_same_dir(root: &std::fs::File, view: &SandboxView, inside: &str) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let want = root.metadata()?;
    let got = view.metadata(inside)?;
    if (want.dev(), want.ino()) == (got.dev(), got.ino()) {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "the sandbox's {inside} is not its own directory"
        )))
    }
}

/// The namespaces of one running sandbox. Dropping it kills everything inside.
pub(super) struct Holder {
    /// The holder's first process (outside the namespaces), which waits for PID 1.
    child: Child,
    /// A pidfd of PID 1: a kill through it can reach no other process, even once PID 1
    /// ended and its PID was given to something else.
    init: Option<OwnedFd>,
    view: SandboxView,
}

impl Holder {
    pub(super) fn view(&self) -> SandboxView {
        self.view.clone()
    }

    /// Kills PID 1 of the sandbox (the kernel then kills every other process in its PID
    /// namespace) and reaps the holder's first process.
    pub(super) fn kill(&mut self) {
        if let Some(init) = self.init.take() {
            sys::pidfd_kill(init.as_fd());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        self.kill();
    }
}

/// How to reach into a running sandbox's namespaces.
#[derive(Clone)]
pub(super) struct SandboxView {
    inner: Arc<ViewInner>,
}

impl std::fmt::Debug for SandboxView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxView")
            .field("privilege", &self.inner.privilege)
            .finish_non_exhaustive()
    }
}

struct ViewInner {
    privilege: Privilege,
    /// The server's end of PID 1's socket: requests for sockets go over it, and its closing
    /// ends the sandbox.
    control: Mutex<OwnedFd>,
    /// The namespaces a process joins, with their `CLONE_NEW*` kinds, in order.
    joins: Vec<(OwnedFd, libc::c_int)>,
    /// The sandbox's root directory (`O_PATH`).
    root: OwnedFd,
    /// The user namespaces of `user` and `root`.
    as_user: OwnedFd,
    as_root: OwnedFd,
}

impl SandboxView {
    /// What a process needs to enter this sandbox as `user` and start in `cwd` (a path
    /// inside it): everything is open already, so the child only makes system calls.
    pub(super) fn entry(&self, cwd: &str, user: SandboxUser) -> io::Result<Entry> {
        Ok(Entry {
            view: self.inner.clone(),
            user,
            cwd: CString::new(cwd).map_err(io::Error::other)?,
        })
    }

    /// `/proc/<pid>/ns/pid` of the sandbox, for tests that look its processes up.
    #[cfg(test)]
    pub(super) fn pid_namespace(&self) -> PathBuf {
        self.inner
            .joins
            .iter()
            .find(|(_, kind)| *kind == libc::CLONE_NEWPID)
            .and_then(|(fd, _)| {
                std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()
            })
            .unwrap_or_default()
    }

    /// Metadata of `inside` (an absolute path in the sandbox), resolved as the sandbox
    /// resolves it: symlinks and `..` stay below the sandbox's root (openat2(2)
    /// `RESOLVE_IN_ROOT`), so that nothing of the host is looked at.
    pub(super) fn metadata(&self, inside: &str) -> io::Result<std::fs::Metadata> {
        let rel = CString::new(inside.trim_start_matches('/')).map_err(io::Error::other)?;
        // SAFETY: open_how is plain data.
        let mut how: libc::open_how = unsafe { std::mem::zeroed() };
        how.flags = (libc::O_PATH | libc::O_CLOEXEC) as u64;
        how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
        // SAFETY: openat2(2) relative to a directory this view holds, with a NUL-terminated
        // path and an open_how of the size given.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                self.inner.root.as_raw_fd(),
                rel.as_ptr(),
                &raw const how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        let fd = sys::check(libc::c_int::try_from(fd).map_err(io::Error::other)?)?;
        // SAFETY: the descriptor was just returned and nothing else owns it.
        let file =
            std::fs::File::from(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        file.metadata()
    }

    /// A TCP socket made by PID 1 in the sandbox's network namespace: a socket stays in the
    /// namespace it was made in, so connecting or listening on it reaches the sandbox's own
    /// loopback (the server cannot join the namespace itself when unprivileged).
    fn socket(&self) -> io::Result<OwnedFd> {
        let control = self.inner.control.lock().unwrap_or_else(|e| e.into_inner());
        sys::send(control.as_fd(), holder::SOCKET_REQUEST, &[])?;
        if !sys::wait_readable(control.as_fd(), HOLDER_WAIT)? {
            return Err(io::Error::other("the sandbox's holder did not answer"));
        }
        let (answer, mut fds) = sys::recv(control.as_fd(), 256)?;
        match (answer.as_slice(), fds.pop()) {
            (holder::SOCKET_ANSWER, Some(fd)) if fds.is_empty() => Ok(fd),
            _ => Err(io::Error::other(format!(
                "the sandbox's holder answered {}",
                String::from_utf8_lossy(&answer)
            ))),
        }
    }

    /// Opens a TCP connection to `127.0.0.1:port` inside the sandbox's network namespace.
    pub(super) async fn connect(&self, port: u16) -> io::Result<tokio::net::TcpStream> {
        let view = self.clone();
        let stream =
            tokio::task::spawn_blocking(move || sys::connect_loopback(view.socket()?, port))
                .await
                .map_err(io::Error::other)??;
        stream.set_nonblocking(true)?;
        tokio::net::TcpStream::from_std(stream)
    }

    /// Listens on `127.0.0.1:port` inside the sandbox's network namespace.
    pub(super) async fn listen(&self, port: u16) -> io::Result<tokio::net::TcpListener> {
        let view = self.clone();
        let listener =
            tokio::task::spawn_blocking(move || sys::listen_loopback(view.socket()?, port))
                .await
                .map_err(io::Error::other)??;
        listener.set_nonblocking(true)?;
        tokio::net::TcpListener::from_std(listener)
    }
}

/// Everything a child needs to enter one sandbox, opened (close-on-exec) before the spawn.
pub(super) struct Entry {
    view: Arc<ViewInner>,
    user: SandboxUser,
    /// The working directory inside the sandbox.
    cwd: CString,
}

impl Entry {
    /// Moves the calling child into the sandbox and returns in a grandchild that is the
    /// sandbox's process; the child itself never returns. Call it only between fork and exec
    /// (a `pre_exec` closure), after the child has made itself a process group leader.
    ///
    /// The child joins the namespaces (unprivileged: first the user namespace that owns
    /// them), takes the sandbox's root and working directory, then joins the user namespace
    /// of its user and becomes that user (as root the host's root gives up every capability
    /// there; the supplementary groups go too, where the kernel allows it).
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
        let view = &*self.view;
        let user_ns = match self.user {
            SandboxUser::User => &view.as_user,
            SandboxUser::Root => &view.as_root,
        };
        let id = self.user.id();
        // SAFETY: system calls on descriptors and NUL-terminated strings this entry owns;
        // the calling process is single-threaded (it was just forked).
        unsafe {
            for (fd, kind) in &view.joins {
                sys::check(libc::setns(fd.as_raw_fd(), *kind))?;
            }
            sys::check(libc::fchdir(view.root.as_raw_fd()))?;
            sys::check(libc::chroot(c".".as_ptr()))?;
            sys::check(libc::chdir(self.cwd.as_ptr()))?;
            sys::check(libc::setns(user_ns.as_raw_fd(), libc::CLONE_NEWUSER))?;
            if view.privilege == Privilege::Root {
                // Unprivileged, setgroups is denied in every namespace below the first.
                sys::check(libc::setgroups(0, std::ptr::null()))?;
            }
            sys::check(libc::setgid(id))?;
            sys::check(libc::setuid(id))?;
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

/// A fresh host uid for a sandbox's `user` (even; its `root` is the next one).
pub(super) fn allocate_uid() -> u32 {
    let random = ulid::Ulid::new().random() as u32;
    UID_BASE + (random % (UID_RANGE / 2)) * 2
}

/// Whether `uid` is one this module hands out (a sandbox root owned by it is isolated).
pub(super) fn is_sandbox_uid(uid: u32) -> bool {
    (UID_BASE..UID_BASE + UID_RANGE).contains(&uid)
}

/// Gives `root` and everything below it (symlinks themselves, not their targets) to `uid`.
fn chown_tree(root: &Path, uid: u32) -> io::Result<()> {
    std::os::unix::fs::lchown(root, Some(uid), Some(uid))?;
    if !std::fs::symlink_metadata(root)?.is_dir() {
        return Ok(());
    }
    for entry in std::fs::read_dir(root)? {
        chown_tree(&entry?.path(), uid)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
