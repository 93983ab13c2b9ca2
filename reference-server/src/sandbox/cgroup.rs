//! cgroup v1 control of sandboxes: limits that the kernel enforces and that are read back as
//! the grant, membership of every sandbox process, the freezer for pause, and removal.
//!
//! Each provider instance gets `sandspec/<instance>/<provider>` below the server's own cgroup
//! in every controller (so sandboxes stay inside whatever limits the server itself runs
//! under), and each sandbox a `<local>` directory below that.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::domain::Resources;

/// CFS period written for every sandbox; the quota is `cpu * period`.
pub(super) const CPU_PERIOD_US: u64 = 100_000;
/// Upper bound on tasks per sandbox, so a fork bomb stays inside its sandbox.
pub(super) const PIDS_MAX: u32 = 4096;
const MIB: u64 = 1024 * 1024;
const MOUNT_ROOT: &str = "/sys/fs/cgroup";

/// The controllers a provider uses, each a directory `.../sandspec/<instance>/<provider>`.
pub(super) struct Cgroups {
    /// memory, cpu and pids together: limits are only enforced when all three are writable.
    limits: Option<[PathBuf; 3]>,
    /// Pause freezes the sandbox's cgroup when this is writable.
    freezer: Option<PathBuf>,
}

impl Cgroups {
    /// No cgroups at all: tests of the fallback path on machines that have them.
    #[cfg(test)]
    pub(super) fn none() -> Self {
        Self {
            limits: None,
            freezer: None,
        }
    }

    /// Finds writable cgroup v1 controllers and creates this provider's directories in them,
    /// below a directory of its own: `<pid>-<pid namespace>-<ulid>`.
    pub(super) fn detect(provider: &str) -> Self {
        let namespace = own_pid_namespace();
        let instance = format!(
            "{}-{namespace}-{}",
            std::process::id(),
            ulid::Ulid::new().to_string().to_lowercase()
        );
        let own = own_cgroups();
        let prepare = |controller: &str, probe_file: &str| -> Option<PathBuf> {
            let mount = Path::new(MOUNT_ROOT).join(controller);
            // cgroup v1 hierarchies have a `tasks` file; cgroup v2 does not.
            if !mount.join("tasks").is_file() {
                return None;
            }
            let own_path = own
                .iter()
                .find(|(controllers, _)| controllers.split(',').any(|c| c == controller))
                .map(|(_, path)| path.trim_start_matches('/').to_owned())
                .unwrap_or_default();
            // Inside a container without a cgroup namespace the path may not be visible
            // below the mount; the mount root is then the closest thing we can use.
            let base = Some(mount.join(&own_path))
                .filter(|p| p.is_dir())
                .unwrap_or(mount);
            reap_stale(&base.join("sandspec"), namespace);
            let dir = base.join("sandspec").join(&instance).join(provider);
            std::fs::create_dir_all(&dir).ok()?;
            if dir.join(probe_file).is_file() {
                Some(dir)
            } else {
                remove_provider_dir(&dir);
                None
            }
        };
        let memory = prepare("memory", "memory.limit_in_bytes");
        let cpu = prepare("cpu", "cpu.cfs_quota_us");
        let pids = prepare("pids", "pids.max");
        let freezer = prepare("freezer", "freezer.state");
        let limits = match (memory, cpu, pids) {
            (Some(m), Some(c), Some(p)) => Some([m, c, p]),
            (m, c, p) => {
                for dir in [m, c, p].into_iter().flatten() {
                    remove_provider_dir(&dir);
                }
                None
            }
        };
        Self { limits, freezer }
    }

    pub(super) fn enforces_limits(&self) -> bool {
        self.limits.is_some()
    }

    pub(super) fn has_freezer(&self) -> bool {
        self.freezer.is_some()
    }

    /// Creates the sandbox's cgroups and writes its limits. Returns `None` when this provider
    /// has no cgroups at all. On error, whatever was created is removed again.
    pub(super) fn create(
        &self,
        local: &str,
        grant: &Resources,
    ) -> io::Result<Option<SandboxCgroup>> {
        if self.limits.is_none() && self.freezer.is_none() {
            return Ok(None);
        }
        let mut cg = SandboxCgroup {
            memory: None,
            cpu: None,
            pids: None,
            freezer: None,
        };
        let result = (|| {
            if let Some([memory, cpu, pids]) = &self.limits {
                cg.memory = Some(make_dir(&memory.join(local))?);
                cg.cpu = Some(make_dir(&cpu.join(local))?);
                cg.pids = Some(make_dir(&pids.join(local))?);
                cg.write_limits(grant)?;
            }
            if let Some(freezer) = &self.freezer {
                cg.freezer = Some(make_dir(&freezer.join(local))?);
            }
            Ok(())
        })();
        match result {
            Ok(()) => Ok(Some(cg)),
            Err(e) => {
                cg.remove_now();
                Err(e)
            }
        }
    }

    /// Removes this provider's (empty) directories: at shutdown, after every sandbox cgroup.
    pub(super) fn remove_provider_dirs(&self) {
        let dirs = self.limits.iter().flatten().chain(self.freezer.iter());
        for dir in dirs {
            remove_provider_dir(dir);
        }
    }
}

/// Removes `<instance>/<provider>` and then `<instance>` if empty. `sandspec/` itself stays:
/// other server instances may be creating their directories in it right now.
fn remove_provider_dir(dir: &Path) {
    let _ = std::fs::remove_dir(dir);
    if let Some(instance) = dir.parent() {
        let _ = std::fs::remove_dir(instance);
    }
}

/// Removes what crashed server instances left below `sandspec/`: the processes of their
/// sandboxes are killed and their cgroups removed. An instance is stale when it ran in this
/// PID namespace and no process has its PID any more. Instances of other PID namespaces
/// (other containers sharing the hierarchy) are never touched; a reused PID only delays
/// the cleanup.
fn reap_stale(sandspec: &Path, namespace: u64) {
    let Ok(entries) = std::fs::read_dir(sandspec) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let mut parts = name.splitn(3, '-');
        let pid = parts
            .next()
            .and_then(|p| p.parse::<i32>().ok())
            .filter(|p| *p > 0);
        let ns = parts.next().and_then(|n| n.parse::<u64>().ok());
        let (Some(pid), Some(ns)) = (pid, ns) else {
            continue;
        };
        if namespace == 0 || ns != namespace || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        // SAFETY: kill(2) with signal 0 only checks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            tracing::info!(instance = %name, "removing cgroups of a server instance that is gone");
            remove_tree(&entry.path());
        }
    }
}

/// The inode of this process's PID namespace (`pid:[4026531836]`), or 0 when unknown.
pub(super) fn own_pid_namespace() -> u64 {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|link| {
            let text = link.to_string_lossy().into_owned();
            text.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
        })
        .unwrap_or(0)
}

/// Kills every task in a cgroup tree and removes it, deepest first.
fn remove_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&entry.path());
            }
        }
    }
    for _ in 0..100 {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            // SAFETY: kill(2) on a task of a cgroup that only sandbox processes join.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        if dir.join("freezer.state").is_file() {
            let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
        }
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    tracing::warn!(cgroup = %dir.display(), "could not remove a stale cgroup");
}

/// Creates one cgroup directory; an existing one is refused (it would belong to someone else).
fn make_dir(path: &Path) -> io::Result<PathBuf> {
    std::fs::create_dir(path)?;
    Ok(path.to_owned())
}

/// `(controllers, path)` for every line of `/proc/self/cgroup`.
fn own_cgroups() -> Vec<(String, String)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let _id = parts.next()?;
            let controllers = parts.next()?;
            let path = parts.next()?;
            Some((controllers.to_owned(), path.to_owned()))
        })
        .collect()
}

/// The cgroups of one sandbox.
pub(super) struct SandboxCgroup {
    memory: Option<PathBuf>,
    cpu: Option<PathBuf>,
    pids: Option<PathBuf>,
    freezer: Option<PathBuf>,
}

impl SandboxCgroup {
    fn dirs(&self) -> impl Iterator<Item = &PathBuf> {
        [&self.memory, &self.cpu, &self.pids, &self.freezer]
            .into_iter()
            .flatten()
    }

    fn write_limits(&self, grant: &Resources) -> io::Result<()> {
        if let Some(memory) = &self.memory {
            std::fs::write(
                memory.join("memory.limit_in_bytes"),
                (grant.memory_mb * MIB).to_string(),
            )?;
        }
        if let Some(cpu) = &self.cpu {
            let quota = (grant.cpu * CPU_PERIOD_US as f64).round() as u64;
            std::fs::write(cpu.join("cpu.cfs_period_us"), CPU_PERIOD_US.to_string())?;
            std::fs::write(cpu.join("cpu.cfs_quota_us"), quota.to_string())?;
        }
        if let Some(pids) = &self.pids {
            std::fs::write(pids.join("pids.max"), PIDS_MAX.to_string())?;
        }
        Ok(())
    }

    /// The limits the kernel holds for this sandbox, or `None` without limit controllers.
    pub(super) fn read_resources(&self) -> io::Result<Option<Resources>> {
        let (Some(memory), Some(cpu)) = (&self.memory, &self.cpu) else {
            return Ok(None);
        };
        let limit: u64 = read_number(&memory.join("memory.limit_in_bytes"))?;
        let quota: i64 = read_number(&cpu.join("cpu.cfs_quota_us"))?;
        let period: u64 = read_number(&cpu.join("cpu.cfs_period_us"))?;
        if quota <= 0 || period == 0 {
            return Err(io::Error::other("cpu quota is not limited"));
        }
        Ok(Some(Resources {
            cpu: quota as f64 / period as f64,
            memory_mb: limit / MIB,
        }))
    }

    /// The `cgroup.procs` files a new process writes itself into before it execs (all but
    /// the memory controller's with defect `sandbox-memory-unenforced`).
    pub(super) fn procs_files(&self, without_memory: bool) -> Vec<CString> {
        self.dirs()
            .filter(|d| !(without_memory && Some(*d) == self.memory.as_ref()))
            .filter_map(|d| CString::new(d.join("cgroup.procs").as_os_str().as_bytes()).ok())
            .collect()
    }

    /// Every process in the sandbox's cgroups right now.
    pub(super) fn tasks(&self) -> Vec<i32> {
        let mut pids: Vec<i32> = self
            .dirs()
            .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
            .flat_map(|text| {
                text.lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect::<Vec<_>>()
            })
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Freezes every task; false when there is no freezer.
    pub(super) async fn freeze(&self) -> io::Result<bool> {
        self.set_freezer("FROZEN").await
    }

    pub(super) async fn thaw(&self) -> io::Result<bool> {
        self.set_freezer("THAWED").await
    }

    async fn set_freezer(&self, target: &str) -> io::Result<bool> {
        let Some(freezer) = &self.freezer else {
            return Ok(false);
        };
        let state = freezer.join("freezer.state");
        // FREEZING is transient: tasks in uninterruptible sleep are frozen when they leave it.
        // The write is repeated because the kernel only retries freezing on a new write.
        for _ in 0..200 {
            std::fs::write(&state, target)?;
            if std::fs::read_to_string(&state)?.trim() == target {
                return Ok(true);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(io::Error::other(format!("cgroup did not reach {target}")))
    }

    /// SIGKILLs every task until the cgroups are empty (a task may fork while it is killed).
    pub(super) async fn kill_all(&self) {
        for _ in 0..500 {
            let tasks = self.tasks();
            if tasks.is_empty() {
                return;
            }
            for pid in tasks {
                // SAFETY: kill(2) with a pid read from our own cgroup; no memory is involved.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            // A frozen task only dies once thawed.
            let _ = self.thaw().await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tracing::warn!(tasks = ?self.tasks(), "sandbox cgroup still has tasks after SIGKILL");
    }

    /// Removes the sandbox's cgroup directories. rmdir fails while exiting tasks are still
    /// being torn down by the kernel, so it is retried for a while.
    pub(super) async fn remove(&self) -> io::Result<()> {
        for dir in self.dirs() {
            let mut attempt = 0;
            loop {
                match std::fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e) if attempt >= 200 => return Err(e),
                    Err(_) => {
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        }
        Ok(())
    }

    /// Best-effort synchronous teardown (error paths and `Drop`): kill, thaw, remove.
    pub(super) fn remove_now(&self) {
        for _ in 0..100 {
            let tasks = self.tasks();
            for pid in &tasks {
                // SAFETY: as in `kill_all`.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
            }
            if let Some(freezer) = &self.freezer {
                let _ = std::fs::write(freezer.join("freezer.state"), "THAWED");
            }
            let removed = self.dirs().all(|d| match std::fs::remove_dir(d) {
                Ok(()) => true,
                Err(e) => e.kind() == io::ErrorKind::NotFound,
            });
            if removed {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The directories, for tests that check them against the files and their removal.
    #[cfg(test)]
    pub(super) fn paths(&self) -> Vec<PathBuf> {
        self.dirs().cloned().collect()
    }
}

fn read_number<T: std::str::FromStr>(path: &Path) -> io::Result<T> {
    let text = std::fs::read_to_string(path)?;
    text.trim()
        .parse()
        .map_err(|_| io::Error::other(format!("unexpected content in {}", path.display())))
}
