//! The holder of one sandbox's namespaces: a program the server runs from its own binary, in a
//! fresh process, before `main` (a hook in `.init_array` looks for [`ENV`]).
//!
//! The server starts `/proc/self/exe` with [`ENV`] set and one end of a `SOCK_SEQPACKET`
//! socket pair at descriptor 0, and sends the [`Plan`]. The holder (unprivileged: after making
//! a user namespace that maps uid and gid 0 to its own) makes new mount, UTS, IPC, network and
//! PID namespaces and forks. The child is the PID namespace's PID 1:
//!
//! 1. it makes itself non-dumpable (nothing inside can trace it or read its memory or
//!    descriptors through `/proc`) and calls itself `sandbox-init`;
//! 2. builds the root filesystem on a tmpfs: the host's `/usr` and `/etc` (and the `/bin`,
//!    `/lib` links or directories) bound read-only, an `/etc/passwd` and `/etc/group` naming
//!    `root` and `user`, a private `/proc`, a `/dev` of bound device nodes and its own
//!    `devpts`, a private `/tmp`, the sandbox's files at `/home/user` and again at
//!    `/workspace` (checked by device and inode), a `/root` of its own, and the files the
//!    server exposes read-only at their host paths; the root itself is then made read-only
//!    and becomes `/` by pivot_root, with the host's tree detached;
//! 3. names the host `sandbox` and brings the loopback interface up (nothing else exists);
//! 4. makes the user namespaces the sandbox's processes run in: as root one mapping uid and
//!    gid 1000 to the sandbox's host uid and 0 to the next one; unprivileged two, one mapping
//!    1000 and one mapping 0 to the holder's own uid 0 (the server's host uid);
//! 5. sends the server descriptors of every namespace, of its root, and a pidfd of itself;
//! 6. then ignores SIGCHLD, so that the kernel reaps every orphan it inherits, and answers
//!    requests for a TCP socket made in its network namespace (previews and forwarders
//!    connect and listen through them) until the server's end of the socket closes: the
//!    server's end, whatever ends the server. PID 1 then exits and the kernel kills every
//!    process left in its PID namespace.
//!
//! This runs in a single-threaded process of its own, so it allocates and uses std freely;
//! errors are sent to the server as text and end the holder.

use std::convert::Infallible;
use std::io::{self, Write as _};
use std::os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd};
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::sys;

/// Set in the environment of a process the server starts as a holder.
pub(super) const ENV: &str = "SANDSPEC_SANDBOX_HOLDER";
/// `argv[0]` of a holder: all that `/proc/1/cmdline` shows inside a sandbox.
pub(super) const ARG0: &str = "sandbox-init";
/// The most bytes a plan may have.
pub(super) const MAX_PLAN: usize = 64 * 1024;
/// A request for a TCP socket made in the sandbox's network namespace.
pub(super) const SOCKET_REQUEST: &[u8] = b"S";
/// The answer that carries it.
pub(super) const SOCKET_ANSWER: &[u8] = b"s";
/// Where the server's socket is in the holder.
const CONTROL: i32 = 0;
/// Mount attributes of everything bound read-only from the host.
const READ_ONLY: u64 = libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;

/// Runs the holder instead of `main` when this process was started as one. Referenced by
/// [`super::Namespacer::start`] so that the linker keeps it wherever sandboxes are started.
#[used]
#[unsafe(link_section = ".init_array")]
pub(super) static HOOK: extern "C" fn() = hook;

extern "C" fn hook() {
    // SAFETY: getenv(3) with a NUL-terminated name, before main, when nothing else runs.
    if unsafe { libc::getenv(c"SANDSPEC_SANDBOX_HOLDER".as_ptr()) }.is_null() {
        return;
    }
    let code = match holder() {
        Ok(code) => code,
        Err(failure) => {
            report(&failure);
            1
        }
    };
    // SAFETY: _exit(2) ends the process without running anything of the program it is in.
    unsafe { libc::_exit(code) }
}

/// How the server makes its sandboxes' namespaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(in crate::sandbox) enum Privilege {
    /// The server runs as root in the host's user namespace: the namespaces belong to the
    /// host's user namespace and each sandbox has host uids of its own.
    Root,
    /// The server runs as an ordinary user (or as root inside a user namespace): a user
    /// namespace mapping its uid to 0 owns the namespaces, and every sandbox runs as the
    /// server's host uid.
    Unprivileged,
}

/// Which parts of the namespace setup a defect weakens (reference-server/src/defects.rs).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub(in crate::sandbox) struct Weakened {
    /// The host's whole filesystem is mounted read-only at `/host` inside the sandbox.
    pub(in crate::sandbox) host_visible: bool,
    /// The host's `/tmp` is shared, writable, instead of a private one.
    pub(in crate::sandbox) host_tmp_shared: bool,
    /// No PID namespace: the sandbox sees (and `/proc` lists) every process of the host.
    pub(in crate::sandbox) host_pids_visible: bool,
}

/// What the server asks a holder to build.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Plan {
    pub(super) privilege: Privilege,
    /// As root: the host uid (and gid) of the sandbox's `user`; its `root` is the next one.
    pub(super) host_uid: u32,
    /// The sandbox's files on the host (canonical).
    pub(super) workspace: PathBuf,
    /// Their device and inode, as the server opened them.
    pub(super) workspace_id: [u64; 2],
    /// Host files bound read-only at their own (canonical) path.
    pub(super) exposed: Vec<PathBuf>,
    pub(super) weakened: Weakened,
}

/// A failed step, sent to the server as text.
struct Failure(String);

/// Names the step an I/O error happened in.
fn at(step: &str) -> impl FnOnce(io::Error) -> Failure + '_ {
    move |e| Failure(format!("{step}: {e}"))
}

/// Tells the server why the holder gave up (it may be gone already).
fn report(failure: &Failure) {
    // SAFETY: descriptor 0 is the holder's end of the server's socket for its whole life.
    let control = unsafe { BorrowedFd::borrow_raw(CONTROL) };
    let _ = sys::send(control, format!("error {}", failure.0).as_bytes(), &[]);
}

/// The holder's first process: reads the plan, makes the namespaces, forks PID 1 and waits
/// for it. Returns the exit code.
fn holder() -> Result<i32, Failure> {
    // Nothing of the server's but the socket is needed.
    // SAFETY: close_range(2) on descriptors this process does not use (by its system call
    // number: glibc has a wrapper only since 2.34).
    if unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) } != 0 {
        for fd in 3..1024 {
            // SAFETY: as above, one by one on kernels before 5.9.
            unsafe { libc::close(fd) };
        }
    }
    // SAFETY: as in `report`.
    let control = unsafe { BorrowedFd::borrow_raw(CONTROL) };
    let (bytes, _) = sys::recv(control, MAX_PLAN).map_err(at("read the plan"))?;
    let plan: Plan =
        serde_json::from_slice(&bytes).map_err(|e| Failure(format!("read the plan: {e}")))?;
    if plan.privilege == Privilege::Unprivileged {
        own_user_namespace()?;
    }
    let mut flags =
        libc::CLONE_NEWNS | libc::CLONE_NEWUTS | libc::CLONE_NEWIPC | libc::CLONE_NEWNET;
    if !plan.weakened.host_pids_visible {
        flags |= libc::CLONE_NEWPID;
    }
    // SAFETY: unshare(2) with namespace flags only.
    sys::check(unsafe { libc::unshare(flags) }).map_err(at("unshare the namespaces"))?;
    // SAFETY: this process is single-threaded, so the child may do anything.
    match unsafe { libc::fork() } {
        -1 => Err(at("fork PID 1")(io::Error::last_os_error())),
        0 => {
            let failure = match init(&plan) {
                Ok(never) => match never {},
                Err(failure) => failure,
            };
            report(&failure);
            // SAFETY: as in `hook`.
            unsafe { libc::_exit(1) }
        }
        child => {
            // SAFETY: the socket is PID 1's from here on.
            unsafe { libc::close(CONTROL) };
            Ok(wait_for(child))
        }
    }
}

/// Waits for `child` and returns an exit code that says how it ended.
fn wait_for(child: libc::pid_t) -> i32 {
    let mut status = 0;
    loop {
        // SAFETY: waitpid(2) on this process's own child.
        if unsafe { libc::waitpid(child, &mut status, 0) } == child {
            break;
        }
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return 127;
        }
    }
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    }
}

/// Unprivileged: a user namespace in which the server's uid and gid are 0, with every
/// capability over the namespaces made after it. `setgroups` must be denied first for an
/// unprivileged gid map; sandbox processes keep the server's supplementary groups.
fn own_user_namespace() -> Result<(), Failure> {
    // SAFETY: geteuid(2) and getegid(2) have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    // SAFETY: unshare(2) with a namespace flag only.
    sys::check(unsafe { libc::unshare(libc::CLONE_NEWUSER) })
        .map_err(at("unshare the user namespace"))?;
    match std::fs::write("/proc/self/setgroups", "deny") {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(at("deny setgroups")(e)),
        _ => {}
    }
    std::fs::write("/proc/self/uid_map", format!("0 {uid} 1\n")).map_err(at("map the uid"))?;
    std::fs::write("/proc/self/gid_map", format!("0 {gid} 1\n")).map_err(at("map the gid"))?;
    Ok(())
}

/// PID 1: builds the sandbox, hands it to the server, and serves it.
fn init(plan: &Plan) -> Result<Infallible, Failure> {
    // SAFETY: prctl(2) on this process's own attributes, with a NUL-terminated name.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        libc::prctl(libc::PR_SET_NAME, c"sandbox-init".as_ptr(), 0, 0, 0);
    }
    build_root(plan)?;
    let name = b"sandbox";
    // SAFETY: sethostname(2) with a buffer and its length.
    sys::check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) })
        .map_err(at("set the host name"))?;
    loopback_up().map_err(at("bring the loopback interface up"))?;

    let mut names: Vec<&str> = Vec::new();
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut namespaces = vec!["ipc", "uts", "net", "mnt"];
    if !plan.weakened.host_pids_visible {
        namespaces.push("pid");
    }
    if plan.privilege == Privilege::Unprivileged {
        namespaces.push("user");
    }
    for ns in namespaces {
        fds.push(
            open(&format!("/proc/self/ns/{ns}"), libc::O_RDONLY).map_err(at("open a namespace"))?,
        );
        names.push(ns);
    }
    fds.push(open("/", libc::O_PATH | libc::O_DIRECTORY).map_err(at("open the root"))?);
    names.push("root");
    // SAFETY: getpid(2) has no preconditions.
    fds.push(sys::pidfd_open(unsafe { libc::getpid() }).map_err(at("open a pidfd of PID 1"))?);
    names.push("init");
    let (as_user, as_root) = user_namespaces(plan)?;
    fds.push(as_user);
    names.push("as_user");
    fds.push(as_root);
    names.push("as_root");

    // SAFETY: as in `report`.
    let control = unsafe { BorrowedFd::borrow_raw(CONTROL) };
    let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
    sys::send(
        control,
        format!("ok {}", names.join(" ")).as_bytes(),
        &borrowed,
    )
    .map_err(at("hand the namespaces over"))?;
    drop(borrowed);
    drop(fds);
    // SAFETY: signal(2) setting SIGCHLD to SIG_IGN: children (and orphans this process
    // inherits) are reaped by the kernel as they exit.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_IGN) };
    serve(control)
}

/// Answers the server's requests until its end of the socket closes, then exits.
fn serve(control: BorrowedFd<'_>) -> ! {
    loop {
        let request = match sys::recv(control, 16) {
            Ok((bytes, _)) => bytes,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // The server is gone: so is the sandbox.
            Err(_) => break,
        };
        if request == SOCKET_REQUEST {
            // SAFETY: socket(2) returns a new descriptor or -1.
            let made = sys::check(unsafe {
                libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0)
            })
            // SAFETY: the descriptor was just made and nothing else owns it.
            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) });
            let sent = match made {
                Ok(socket) => sys::send(control, SOCKET_ANSWER, &[socket.as_fd()]),
                Err(e) => sys::send(control, format!("error socket: {e}").as_bytes(), &[]),
            };
            if sent.is_err() {
                break;
            }
        }
    }
    // SAFETY: as in `hook`.
    unsafe { libc::_exit(0) }
}

/// Opens `path` close-on-exec with `flags`.
fn open(path: &str, flags: libc::c_int) -> io::Result<OwnedFd> {
    let path = sys::cpath(Path::new(path))?;
    // SAFETY: open(2) on a NUL-terminated path; the descriptor is owned at once.
    let fd = sys::check(unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) })?;
    // SAFETY: the descriptor was just returned and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// mount(2).
fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let source = source.map(sys::cpath).transpose()?;
    let target = sys::cpath(target)?;
    let fstype = fstype.map(|t| sys::cpath(Path::new(t))).transpose()?;
    let data = data.map(|d| sys::cpath(Path::new(d))).transpose()?;
    let ptr = |s: &Option<std::ffi::CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: mount(2) with NUL-terminated strings (or null) that outlive the call.
    sys::check(unsafe {
        libc::mount(
            ptr(&source),
            target.as_ptr(),
            ptr(&fstype),
            flags,
            ptr(&data).cast(),
        )
    })
    .map(drop)
}

/// A tmpfs at `target` with mount options `data` (`mode=...`).
fn tmpfs(target: &Path, flags: libc::c_ulong, data: &str) -> Result<(), Failure> {
    mount(
        Some(Path::new("tmpfs")),
        target,
        Some("tmpfs"),
        flags,
        Some(data),
    )
    .map_err(|e| Failure(format!("mount a tmpfs at {}: {e}", target.display())))
}

/// Binds `source` at `target` (with everything mounted below it when `recursive`).
fn bind(source: &Path, target: &Path, recursive: bool) -> Result<(), Failure> {
    let flags = libc::MS_BIND | if recursive { libc::MS_REC } else { 0 };
    mount(Some(source), target, None, flags, None).map_err(|e| {
        Failure(format!(
            "bind {} at {}: {e}",
            source.display(),
            target.display()
        ))
    })
}

/// Binds `source` at `target` read-only, without setuid programs or devices.
fn bind_read_only(source: &Path, target: &Path, recursive: bool) -> Result<(), Failure> {
    bind(source, target, recursive)?;
    make_read_only(target, recursive)
        .map_err(|e| Failure(format!("make {} read-only: {e}", target.display())))
}

/// Makes the mount at `target` (and those below it when `recursive`) read-only, nosuid and
/// nodev: with mount_setattr(2) where the kernel has it (5.12 and later), else by remounting
/// each mount, keeping the flags the kernel may have locked.
fn make_read_only(target: &Path, recursive: bool) -> io::Result<()> {
    let path = sys::cpath(target)?;
    // SAFETY: mount_attr is plain data.
    let mut attr: libc::mount_attr = unsafe { std::mem::zeroed() };
    attr.attr_set = READ_ONLY;
    let flags = if recursive { libc::AT_RECURSIVE } else { 0 };
    // SAFETY: mount_setattr(2) with a NUL-terminated path and a mount_attr of the size given.
    let done = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            flags,
            &raw mut attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if done == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::ENOSYS) {
        return Err(err);
    }
    let mut targets = vec![target.to_owned()];
    if recursive {
        targets.extend(mounts_below(target)?);
    }
    for target in targets {
        remount_read_only(&target)?;
    }
    Ok(())
}

/// Remounts the mount at `target` read-only, nosuid and nodev with its other flags kept (in
/// a user namespace the kernel refuses a remount that would drop a flag it locked).
fn remount_read_only(target: &Path) -> io::Result<()> {
    let path = sys::cpath(target)?;
    // SAFETY: statvfs is plain data that statvfs(3) fills.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs(3) on a NUL-terminated path into a struct on this stack frame.
    sys::check(unsafe { libc::statvfs(path.as_ptr(), &mut stat) })?;
    let f = stat.f_flag;
    let mut flags =
        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
    for (st, ms) in [
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ] {
        if f & st != 0 {
            flags |= ms;
        }
    }
    if f & (libc::ST_NOATIME | libc::ST_RELATIME) == 0 {
        flags |= libc::MS_STRICTATIME;
    }
    mount(None, target, None, flags, None)
}

/// The mount points strictly below `dir`, from `/proc/self/mountinfo`.
fn mounts_below(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(text
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_mountinfo(p)))
        .filter(|p| p != dir && p.starts_with(dir))
        .collect())
}

/// A mountinfo path with its octal escapes (`\040` for a space) decoded.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && let Ok(n) = u8::from_str_radix(&field[i + 1..i + 4], 8)
        {
            out.push(n);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// An empty file to bind a file over, made without opening it: where the path is already a
/// file (a host directory the sandbox shares holds the very file), it is left as it is, not
/// truncated, and one that some process is running cannot make this fail with ETXTBSY.
fn mount_point_file(path: &Path) -> io::Result<()> {
    let c = sys::cpath(path)?;
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    match sys::check(unsafe { libc::mknod(c.as_ptr(), libc::S_IFREG | 0o644, 0) }) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        other => other.map(drop),
    }
}

fn mkdir(path: &Path, mode: u32) -> Result<(), Failure> {
    std::fs::DirBuilder::new()
        .mode(mode)
        .create(path)
        .map_err(|e| Failure(format!("make {}: {e}", path.display())))
}

/// `/oldroot` followed by the host path `path`.
fn host(old: &Path, path: &Path) -> PathBuf {
    old.join(path.strip_prefix("/").unwrap_or(path))
}

/// The `/etc/passwd` of every sandbox.
const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
    user:x:1000:1000:user:/home/user:/bin/sh\n\
    nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";
/// The `/etc/group` of every sandbox.
const GROUP: &str = "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n";

/// Builds the sandbox's root filesystem and makes it `/`. The host's tree stays reachable
/// at `/oldroot` (on a staging tmpfs over `/tmp`) until the end, so that no host path is
/// hidden by what is mounted on the way; then it is detached.
fn build_root(plan: &Plan) -> Result<(), Failure> {
    // Nothing mounted here reaches the host, and nothing the host mounts reaches here.
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )
    .map_err(at("make the mounts private"))?;
    tmpfs(
        Path::new("/tmp"),
        libc::MS_NOSUID | libc::MS_NODEV,
        "mode=0755",
    )?;
    std::env::set_current_dir("/tmp").map_err(at("enter the staging tmpfs"))?;
    mkdir(Path::new("oldroot"), 0o755)?;
    pivot_root(Path::new("."), Path::new("oldroot")).map_err(at("pivot to the staging tmpfs"))?;
    std::env::set_current_dir("/").map_err(at("enter the staging root"))?;
    let old = Path::new("/oldroot");
    let new = Path::new("/newroot");
    mkdir(new, 0o755)?;
    tmpfs(new, libc::MS_NOSUID | libc::MS_NODEV, "mode=0755")?;

    mkdir(&new.join("usr"), 0o755)?;
    bind_read_only(&old.join("usr"), &new.join("usr"), true)?;
    for dir in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"] {
        let source = old.join(dir);
        match std::fs::read_link(&source) {
            Ok(target) => std::os::unix::fs::symlink(target, new.join(dir))
                .map_err(|e| Failure(format!("link /{dir}: {e}")))?,
            Err(_) if source.is_dir() => {
                mkdir(&new.join(dir), 0o755)?;
                bind_read_only(&source, &new.join(dir), true)?;
            }
            Err(_) => {}
        }
    }
    mkdir(&new.join("etc"), 0o755)?;
    bind_read_only(&old.join("etc"), &new.join("etc"), true)?;
    for (name, text) in [("passwd", PASSWD), ("group", GROUP)] {
        let target = new.join("etc").join(name);
        if !target.is_file() {
            continue;
        }
        let staged = Path::new("/").join(name);
        std::fs::write(&staged, text).map_err(|e| Failure(format!("write {name}: {e}")))?;
        bind_read_only(&staged, &target, false)?;
    }

    mkdir(&new.join("proc"), 0o555)?;
    if plan.weakened.host_pids_visible {
        // Writable, as a `/proc` is: PID 1 writes its user namespaces' maps through it.
        bind(&old.join("proc"), &new.join("proc"), true)?;
    } else {
        mount(
            Some(Path::new("proc")),
            &new.join("proc"),
            Some("proc"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            None,
        )
        .map_err(at("mount /proc"))?;
    }
    build_dev(old, &new.join("dev"))?;
    mkdir(&new.join("tmp"), 0o1777)?;
    if plan.weakened.host_tmp_shared {
        bind(&old.join("tmp"), &new.join("tmp"), true)?;
    } else {
        tmpfs(
            &new.join("tmp"),
            libc::MS_NOSUID | libc::MS_NODEV,
            "mode=1777",
        )?;
    }

    let files = host(old, &plan.workspace);
    mkdir(&new.join("home"), 0o755)?;
    for inside in ["home/user", "workspace"] {
        let target = new.join(inside);
        mkdir(&target, 0o755)?;
        bind(&files, &target, false)?;
        let meta = std::fs::metadata(&target).map_err(at("look at the sandbox's files"))?;
        if [meta.dev(), meta.ino()] != plan.workspace_id {
            return Err(Failure(format!(
                "/{inside} is not the sandbox's own directory"
            )));
        }
    }
    // `root`'s home: as root its host uid is the one after `user`'s; unprivileged it is the
    // holder's own uid 0.
    let root_uid = match plan.privilege {
        Privilege::Root => plan.host_uid.saturating_add(1),
        Privilege::Unprivileged => 0,
    };
    mkdir(&new.join("root"), 0o700)?;
    tmpfs(
        &new.join("root"),
        libc::MS_NOSUID | libc::MS_NODEV,
        &format!("mode=0700,uid={root_uid},gid={root_uid}"),
    )?;

    for path in &plan.exposed {
        let target = host(new, path);
        if let Some(parent) = target.parent() {
            // Parents made here are 0755, so that every uid of the sandbox can pass them.
            std::fs::DirBuilder::new()
                .mode(0o755)
                .recursive(true)
                .create(parent)
                .map_err(|e| Failure(format!("make {}: {e}", parent.display())))?;
        }
        mount_point_file(&target)
            .map_err(|e| Failure(format!("make {}: {e}", target.display())))?;
        bind_read_only(&host(old, path), &target, false)?;
    }
    if plan.weakened.host_visible {
        mkdir(&new.join("host"), 0o755)?;
        bind_read_only(old, &new.join("host"), true)?;
    }

    make_read_only(new, false).map_err(at("make the root read-only"))?;
    std::env::set_current_dir(new).map_err(at("enter the new root"))?;
    pivot_root(Path::new("."), Path::new(".")).map_err(at("pivot to the new root"))?;
    // The staging root, with the host's tree below it, is stacked on the new one: detach it.
    // SAFETY: umount2(2) with a NUL-terminated path.
    sys::check(unsafe { libc::umount2(c".".as_ptr(), libc::MNT_DETACH) })
        .map_err(at("detach the host's tree"))?;
    std::env::set_current_dir("/").map_err(at("enter /"))?;
    Ok(())
}

/// pivot_root(2).
fn pivot_root(new_root: &Path, put_old: &Path) -> io::Result<()> {
    let new_root = sys::cpath(new_root)?;
    let put_old = sys::cpath(put_old)?;
    // SAFETY: pivot_root(2) with two NUL-terminated paths.
    let done = unsafe { libc::syscall(libc::SYS_pivot_root, new_root.as_ptr(), put_old.as_ptr()) };
    if done == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `/dev`: a tmpfs with the host's harmless device nodes bound in (no device node can be
/// made in a user namespace), a `devpts` of the sandbox's own for pseudo-terminals, a
/// `/dev/shm`, and the usual links; the tmpfs itself read-only.
fn build_dev(old: &Path, dev: &Path) -> Result<(), Failure> {
    mkdir(dev, 0o755)?;
    tmpfs(dev, libc::MS_NOSUID | libc::MS_NOEXEC, "mode=0755")?;
    for node in ["null", "zero", "full", "random", "urandom", "tty"] {
        let source = old.join("dev").join(node);
        if !source.exists() {
            continue;
        }
        let target = dev.join(node);
        std::fs::File::create(&target).map_err(|e| Failure(format!("make /dev/{node}: {e}")))?;
        bind(&source, &target, false)?;
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        std::os::unix::fs::symlink(target, dev.join(link))
            .map_err(|e| Failure(format!("link /dev/{link}: {e}")))?;
    }
    mkdir(&dev.join("pts"), 0o755)?;
    mount(
        Some(Path::new("devpts")),
        &dev.join("pts"),
        Some("devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )
    .map_err(at("mount /dev/pts"))?;
    mkdir(&dev.join("shm"), 0o1777)?;
    tmpfs(
        &dev.join("shm"),
        libc::MS_NOSUID | libc::MS_NODEV,
        "mode=1777",
    )?;
    make_read_only(dev, false).map_err(at("make /dev read-only"))
}

/// Brings `lo` up: a new network namespace has it, down.
fn loopback_up() -> io::Result<()> {
    // SAFETY: socket(2) returns a new descriptor or -1.
    let fd = sys::check(unsafe {
        libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0)
    })?;
    // SAFETY: the descriptor was just made and nothing else owns it.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain data; the two ioctl(2)s read and write the one on this frame.
    unsafe {
        let mut req: libc::ifreq = std::mem::zeroed();
        for (i, b) in b"lo".iter().enumerate() {
            req.ifr_name[i] = *b as libc::c_char;
        }
        sys::check(libc::ioctl(
            socket.as_raw_fd(),
            libc::SIOCGIFFLAGS,
            &mut req,
        ))?;
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        sys::check(libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &req))?;
    }
    Ok(())
}

/// The user namespaces of the sandbox's `user` and `root`.
fn user_namespaces(plan: &Plan) -> Result<(OwnedFd, OwnedFd), Failure> {
    match plan.privilege {
        Privilege::Root => {
            // One namespace: 1000 is the sandbox's host uid, 0 the next one, both unprivileged
            // on the host. It owns none of the other namespaces, so its root has no power
            // over the mounts, the network or the PID namespace.
            let h = plan.host_uid;
            let map = format!("0 {} 1\n1000 {h} 1\n", h + 1);
            let ns = user_namespace(&map, &map)?;
            let again = ns.try_clone().map_err(at("copy a user namespace"))?;
            Ok((ns, again))
        }
        Privilege::Unprivileged => {
            // There is one host uid: 1000 in one namespace and 0 in another both map to it.
            let user = user_namespace("1000 0 1\n", "1000 0 1\n")?;
            let root = user_namespace("0 0 1\n", "0 0 1\n")?;
            Ok((user, root))
        }
    }
}

/// A user namespace with these maps, made by a child that waits until its namespace is open
/// here and then exits (the descriptor keeps the namespace).
fn user_namespace(uid_map: &str, gid_map: &str) -> Result<OwnedFd, Failure> {
    let (ready_r, ready_w) = pipe().map_err(at("make a pipe"))?;
    let (release_r, release_w) = pipe().map_err(at("make a pipe"))?;
    // SAFETY: this process is single-threaded.
    let child = unsafe { libc::fork() };
    if child == 0 {
        drop(ready_r);
        drop(release_w);
        // SAFETY: prctl(2) and unshare(2) on this process; write(2) and read(2) on pipes it
        // owns; _exit(2) ends it.
        unsafe {
            // Dumpable again, so that PID 1 may write its maps and open its namespace.
            libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0);
            let answer: &[u8] = if libc::unshare(libc::CLONE_NEWUSER) == 0 {
                b"y"
            } else {
                b"n"
            };
            libc::write(ready_w.as_raw_fd(), answer.as_ptr().cast(), 1);
            let mut byte = 0u8;
            libc::read(release_r.as_raw_fd(), (&raw mut byte).cast(), 1);
            libc::_exit(0);
        }
    }
    if child < 0 {
        return Err(at("fork")(io::Error::last_os_error()));
    }
    drop(ready_w);
    drop(release_r);
    let made = (|| {
        let mut answer = [0u8; 1];
        let mut ready = std::fs::File::from(ready_r);
        io::Read::read_exact(&mut ready, &mut answer).map_err(at("wait for a user namespace"))?;
        if answer != *b"y" {
            return Err(Failure("unshare a user namespace: refused".into()));
        }
        let proc = PathBuf::from(format!("/proc/{child}"));
        for (file, map) in [("uid_map", uid_map), ("gid_map", gid_map)] {
            std::fs::OpenOptions::new()
                .write(true)
                .open(proc.join(file))
                .and_then(|mut f| f.write_all(map.as_bytes()))
                .map_err(|e| Failure(format!("write {file}: {e}")))?;
        }
        open(&format!("/proc/{child}/ns/user"), libc::O_RDONLY).map_err(at("open a user namespace"))
    })();
    drop(release_w);
    wait_for(child);
    made
}

/// A pipe, close-on-exec.
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2(2) writes two descriptors into the array.
    sys::check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: both were just returned and nothing else owns them.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(unescape_mountinfo(r"/a\040b/c"), "/a b/c");
        assert_eq!(unescape_mountinfo(r"/tab\011x"), "/tab\tx");
        assert_eq!(unescape_mountinfo(r"/plain"), "/plain");
        assert_eq!(unescape_mountinfo(r"/end\04"), r"/end\04");
    }
}
