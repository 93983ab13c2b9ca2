//! cgroup control of sandboxes, on cgroup v1 and v2: limits that the kernel enforces and that
//! are read back as the grant, membership of every sandbox process, the freezer for pause,
//! and removal.
//!
//! Each controller is taken from the hierarchy that actually holds it: a v1 hierarchy of its
//! own (`<mount root>/<controller>` with a `tasks` file) when there is one, else the unified
//! (v2) hierarchy when its root offers it (`cgroup.controllers`). The v2 freezer is part of
//! every non-root v2 cgroup (`cgroup.freeze`), so a machine with a v2 mount has one even
//! without v2 controllers. The unified hierarchy is `<mount root>` itself when that is a
//! cgroup2 mount (pure v2), else `<mount root>/unified` when that is one (hybrid).
//!
//! Each provider instance gets `sandspec/<instance>/<provider>` below the server's own cgroup
//! in every hierarchy it uses (so sandboxes stay inside whatever limits the server itself runs
//! under), and each sandbox a `<local>` directory below that. On v2 the sandboxes are leaves
//! and their parents (`sandspec`, `<instance>`, `<provider>`) hold no process, so the "no
//! internal processes" rule lets each delegate memory, cpu and pids to its children through
//! `cgroup.subtree_control`. The server's own cgroup holds the server: unless it is the root
//! (exempt from the rule) or already delegates the controllers, the kernel refuses to enable
//! them there (EBUSY) and those limits are then not enforced, which the capabilities say. An
//! ordinary user's server alone in its cgroup first moves itself into a leaf below it.

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
/// The v2 controllers sandboxes use, in the order they are enabled.
const V2_CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];

/// Which cgroup hierarchy a controller of a sandbox is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Version {
    V1,
    V2,
}

/// Where this machine's cgroup hierarchies are mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Layout {
    /// The directory holding one v1 hierarchy per controller (`<root>/memory`, ...), unless
    /// the mount root is itself the unified hierarchy.
    pub(super) v1: Option<PathBuf>,
    /// The unified (cgroup2) hierarchy, when there is one.
    pub(super) v2: Option<PathBuf>,
}

impl Layout {
    /// This machine's layout below `/sys/fs/cgroup`.
    pub(super) fn detect() -> Self {
        Self::at(Path::new(MOUNT_ROOT))
    }

    /// The layout below `root`: pure v2 when `root` is a cgroup2 hierarchy, else v1
    /// hierarchies below it, with a unified one at `root/unified` on a hybrid machine.
    pub(super) fn at(root: &Path) -> Self {
        if is_v2_hierarchy(root) {
            return Self {
                v1: None,
                v2: Some(root.to_owned()),
            };
        }
        Self {
            v1: Some(root.to_owned()),
            v2: Some(root.join("unified")).filter(|p| is_v2_hierarchy(p)),
        }
    }

    /// `v2`, `hybrid` or `v1`, for the log.
    pub(super) fn kind(&self) -> &'static str {
        match (&self.v1, &self.v2) {
            (None, Some(_)) => "v2",
            (Some(_), Some(_)) => "hybrid",
            _ => "v1",
        }
    }

    /// The v1 hierarchy of `controller`, when the machine mounts one.
    fn v1_hierarchy(&self, controller: &str) -> Option<PathBuf> {
        let mount = self.v1.as_ref()?.join(controller);
        // cgroup v1 hierarchies have a `tasks` file; cgroup v2 does not.
        mount.join("tasks").is_file().then_some(mount)
    }

    /// Whether the unified hierarchy's root offers `controller` (is not bound to v1).
    fn v2_offers(&self, controller: &str) -> bool {
        self.v2
            .as_ref()
            .is_some_and(|v2| controller_list(&v2.join("cgroup.controllers")).contains(&controller))
    }
}

/// A cgroup2 hierarchy's directories have `cgroup.controllers`; v1 ones never have it.
fn is_v2_hierarchy(dir: &Path) -> bool {
    dir.join("cgroup.controllers").is_file() && !dir.join("tasks").exists()
}

/// The controllers named in a `cgroup.controllers` or `cgroup.subtree_control` file (which
/// the kernel lists space-separated; a leading `+` is tolerated), of those sandboxes use.
fn controller_list(path: &Path) -> Vec<&'static str> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    parse_controllers(&text)
}

fn parse_controllers(text: &str) -> Vec<&'static str> {
    let named: Vec<&str> = text
        .split_whitespace()
        .map(|c| c.trim_start_matches('+'))
        .collect();
    V2_CONTROLLERS
        .into_iter()
        .filter(|c| named.contains(c))
        .collect()
}

/// One controller of a provider or sandbox: its hierarchy and directory.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Ctl {
    version: Version,
    dir: PathBuf,
}

/// The controllers a provider uses, each a directory `.../sandspec/<instance>/<provider>`.
pub(super) struct Cgroups {
    /// memory, cpu and pids together: limits are only enforced when all three are writable.
    limits: Option<[Ctl; 3]>,
    /// Pause freezes the sandbox's cgroup when this is writable.
    freezer: Option<Ctl>,
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

    /// Finds writable controllers and creates this provider's directories in them, below a
    /// directory of its own: `<pid>-<pid namespace>-<ulid>`.
    pub(super) fn detect(provider: &str) -> Self {
        let instance = format!(
            "{}-{}-{}",
            std::process::id(),
            own_pid_namespace(),
            ulid::Ulid::new().to_string().to_lowercase()
        );
        let layout = Layout::detect();
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        // An ordinary user's server moves itself into a leaf of its own cgroup when that is
        // what lets the cgroup (delegated to the user) delegate the controllers; root's
        // never does (its cgroup may be a service manager's to arrange).
        // SAFETY: geteuid(2) has no preconditions.
        let leaf_for = (unsafe { libc::geteuid() } != 0).then(std::process::id);
        let cgroups = Self::detect_moving(&layout, &own, provider, &instance, leaf_for);
        tracing::debug!(
            layout = layout.kind(),
            version = cgroups.version(),
            enforced = ?cgroups.enforced(),
            "cgroups detected"
        );
        cgroups
    }

    /// `detect` on a given layout, with the server's `/proc/self/cgroup` text and the name of
    /// its instance directory.
    #[cfg(test)]
    pub(super) fn detect_in(layout: &Layout, own: &str, provider: &str, instance: &str) -> Self {
        Self::detect_moving(layout, own, provider, instance, None)
    }

    /// [`Self::detect_in`], where the process `leaf_for` (the server) may move itself into a
    /// leaf cgroup below its own v2 cgroup, `sandspec/<pid>-<pid namespace>-server`, when it
    /// is alone there: the "no internal processes" rule keeps a cgroup that holds a process
    /// from delegating controllers to its children, and a cgroup delegated to an ordinary
    /// user (a systemd user scope, a container's) usually holds just the server.
    pub(super) fn detect_moving(
        layout: &Layout,
        own: &str,
        provider: &str,
        instance: &str,
        leaf_for: Option<u32>,
    ) -> Self {
        let namespace = own_pid_namespace();
        let own = parse_own_cgroups(own);
        let prepare_v1 = |controller: &str, probe_file: &str| -> Option<Ctl> {
            let mount = layout.v1_hierarchy(controller)?;
            let own_path = own
                .iter()
                .find(|(controllers, _)| controllers.split(',').any(|c| c == controller))
                .map(|(_, path)| path.as_str())
                .unwrap_or_default();
            let dir = provider_dir(&mount, own_path, namespace, instance, provider)?;
            if dir.join(probe_file).is_file() {
                Some(Ctl {
                    version: Version::V1,
                    dir,
                })
            } else {
                remove_provider_dir(&dir);
                None
            }
        };
        let memory_v1 = prepare_v1("memory", "memory.limit_in_bytes");
        let cpu_v1 = prepare_v1("cpu", "cpu.cfs_quota_us");
        let pids_v1 = prepare_v1("pids", "pids.max");
        let freezer_v1 = prepare_v1("freezer", "freezer.state");

        // What v1 does not hold is taken from v2 where its root offers it.
        let wanted: Vec<&'static str> = [
            ("cpu", cpu_v1.is_none()),
            ("memory", memory_v1.is_none()),
            ("pids", pids_v1.is_none()),
        ]
        .into_iter()
        .filter(|(c, missing)| *missing && layout.v2_offers(c))
        .map(|(c, _)| c)
        .collect();
        let needs_v2 = !wanted.is_empty() || freezer_v1.is_none();
        let v2 = match &layout.v2 {
            Some(mount) if needs_v2 => {
                let own_path = own
                    .iter()
                    .find(|(controllers, _)| controllers.is_empty())
                    .map(|(_, path)| path.as_str())
                    .unwrap_or_default();
                // A provider made before this one may have moved the server into its leaf.
                let own_path = leaf_for
                    .and_then(|pid| {
                        own_path.strip_suffix(&format!("/sandspec/{}", server_leaf(pid, namespace)))
                    })
                    .map_or(own_path, |base| if base.is_empty() { "/" } else { base });
                provider_dir(mount, own_path, namespace, instance, provider).map(|dir| {
                    if let Some(pid) = leaf_for
                        && !wanted.is_empty()
                    {
                        move_into_leaf(mount, own_path, namespace, pid, &wanted);
                    }
                    let enabled = enable_controllers(mount, own_path, &dir, &wanted);
                    (dir, enabled)
                })
            }
            _ => None,
        };
        let from_v2 = |controller: &str, probe_file: &str| -> Option<Ctl> {
            let (dir, enabled) = v2.as_ref()?;
            (enabled.contains(&controller) && dir.join(probe_file).is_file()).then(|| Ctl {
                version: Version::V2,
                dir: dir.clone(),
            })
        };
        let memory = memory_v1.or_else(|| from_v2("memory", "memory.max"));
        let cpu = cpu_v1.or_else(|| from_v2("cpu", "cpu.max"));
        let pids = pids_v1.or_else(|| from_v2("pids", "pids.max"));
        let freezer = freezer_v1.or_else(|| {
            let (dir, _) = v2.as_ref()?;
            dir.join("cgroup.freeze").is_file().then(|| Ctl {
                version: Version::V2,
                dir: dir.clone(),
            })
        });
        let limits = match (memory, cpu, pids) {
            (Some(m), Some(c), Some(p)) => Some([m, c, p]),
            (m, c, p) => {
                for ctl in [m, c, p].into_iter().flatten() {
                    if ctl.version == Version::V1 {
                        remove_provider_dir(&ctl.dir);
                    }
                }
                None
            }
        };
        let cgroups = Self { limits, freezer };
        if let Some((dir, _)) = &v2
            && !cgroups.provider_dirs().contains(&dir)
        {
            remove_provider_dir(dir);
        }
        cgroups
    }

    pub(super) fn enforces_limits(&self) -> bool {
        self.limits.is_some()
    }

    pub(super) fn has_freezer(&self) -> bool {
        self.freezer.is_some()
    }

    /// `v1`, `v2`, or `hybrid` (some of each) for the controllers in use; `None` without any.
    pub(super) fn version(&self) -> Option<&'static str> {
        let versions: Vec<Version> = self
            .limits
            .iter()
            .flatten()
            .chain(self.freezer.iter())
            .map(|c| c.version)
            .collect();
        let v1 = versions.contains(&Version::V1);
        let v2 = versions.contains(&Version::V2);
        match (v1, v2) {
            (true, true) => Some("hybrid"),
            (true, false) => Some("v1"),
            (false, true) => Some("v2"),
            (false, false) => None,
        }
    }

    /// What the kernel enforces per sandbox: `memory`, `cpu`, `pids`, `freezer`.
    pub(super) fn enforced(&self) -> Vec<&'static str> {
        let mut enforced = Vec::new();
        if self.enforces_limits() {
            enforced.extend(["memory", "cpu", "pids"]);
        }
        if self.has_freezer() {
            enforced.push("freezer");
        }
        enforced
    }

    /// The cgroup behind each of [`Self::enforced`]: `cgroup_v1` or `cgroup_v2`.
    pub(super) fn enforced_by(&self) -> std::collections::BTreeMap<&'static str, &'static str> {
        let name = |ctl: &Ctl| match ctl.version {
            Version::V1 => "cgroup_v1",
            Version::V2 => "cgroup_v2",
        };
        let mut by = std::collections::BTreeMap::new();
        if let Some([memory, cpu, pids]) = &self.limits {
            by.insert("memory", name(memory));
            by.insert("cpu", name(cpu));
            by.insert("pids", name(pids));
        }
        if let Some(freezer) = &self.freezer {
            by.insert("freezer", name(freezer));
        }
        by
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
            dirs: Vec::new(),
        };
        let result = (|| {
            if let Some([memory, cpu, pids]) = &self.limits {
                cg.memory = Some(cg.make(memory, local)?);
                cg.cpu = Some(cg.make(cpu, local)?);
                cg.pids = Some(cg.make(pids, local)?);
                cg.write_limits(grant)?;
            }
            if let Some(freezer) = &self.freezer {
                cg.freezer = Some(cg.make(freezer, local)?);
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

    /// The provider directories in use, each once (v2 controllers share one).
    fn provider_dirs(&self) -> Vec<&PathBuf> {
        let mut dirs: Vec<&PathBuf> = Vec::new();
        for ctl in self.limits.iter().flatten().chain(self.freezer.iter()) {
            if !dirs.contains(&&ctl.dir) {
                dirs.push(&ctl.dir);
            }
        }
        dirs
    }

    /// Removes this provider's (empty) directories: at shutdown, after every sandbox cgroup.
    pub(super) fn remove_provider_dirs(&self) {
        for dir in self.provider_dirs() {
            remove_provider_dir(dir);
        }
    }
}

/// Creates `sandspec/<instance>/<provider>` below the server's own cgroup `own_path` in the
/// hierarchy mounted at `mount`, after reaping what crashed instances left in `sandspec`.
fn provider_dir(
    mount: &Path,
    own_path: &str,
    namespace: u64,
    instance: &str,
    provider: &str,
) -> Option<PathBuf> {
    let base = own_base(mount, own_path);
    reap_stale(&base.join("sandspec"), namespace);
    let dir = base.join("sandspec").join(instance).join(provider);
    std::fs::create_dir_all(&dir).ok()?;
    // Every cgroup directory has `cgroup.procs`; without it this is no cgroup.
    if dir.join("cgroup.procs").is_file() {
        Some(dir)
    } else {
        remove_provider_dir(&dir);
        None
    }
}

/// The server's own cgroup below a mount. Inside a container without a cgroup namespace the
/// path may not be visible below the mount; the mount root is then the closest thing we can
/// use.
fn own_base(mount: &Path, own_path: &str) -> PathBuf {
    Some(mount.join(own_path.trim_start_matches('/')))
        .filter(|p| p.is_dir())
        .unwrap_or_else(|| mount.to_owned())
}

/// Enables `wanted` in `cgroup.subtree_control` of every cgroup from the server's own down to
/// the provider's directory `dir`, where each one's `cgroup.controllers` offers them, and
/// returns those the provider's directory then delegates to its sandboxes.
fn enable_controllers(
    mount: &Path,
    own_path: &str,
    dir: &Path,
    wanted: &[&'static str],
) -> Vec<&'static str> {
    if wanted.is_empty() {
        return Vec::new();
    }
    let base = own_base(mount, own_path);
    let mut chain: Vec<&Path> = dir
        .ancestors()
        .take_while(|p| p.starts_with(&base))
        .collect();
    chain.reverse();
    let mut enabled = wanted.to_vec();
    for cgroup in chain {
        let offered = controller_list(&cgroup.join("cgroup.controllers"));
        enabled.retain(|c| offered.contains(c));
        if enabled.is_empty() {
            break;
        }
        let control = cgroup.join("cgroup.subtree_control");
        let all = subtree_control_line(&enabled);
        if let Err(e) = std::fs::write(&control, &all) {
            // One refused controller fails the whole write; the others may still be enabled.
            for c in &enabled {
                if let Err(e) = std::fs::write(&control, format!("+{c}")) {
                    tracing::debug!(cgroup = %cgroup.display(), controller = %c, error = %e,
                        "cannot enable a cgroup v2 controller");
                }
            }
            tracing::debug!(cgroup = %cgroup.display(), error = %e, "cgroup.subtree_control");
        }
        let delegated = controller_list(&control);
        enabled.retain(|c| delegated.contains(c));
    }
    enabled
}

/// The name of the leaf cgroup a server moves itself into: `<pid>-<pid namespace>-server`, so
/// that the reaping of stale instances removes it once that server is gone.
fn server_leaf(pid: u32, namespace: u64) -> String {
    format!("{pid}-{namespace}-server")
}

/// Moves process `pid` (the server) from its own v2 cgroup into the leaf
/// `sandspec/<pid>-<ns>-server` below it, when its own cgroup does not delegate `wanted` yet,
/// is not the hierarchy's root (which the rule exempts), and holds no other process (moving
/// the server alone would not empty it). Returns whether it moved.
fn move_into_leaf(mount: &Path, own_path: &str, namespace: u64, pid: u32, wanted: &[&str]) -> bool {
    let base = own_base(mount, own_path);
    let delegated = controller_list(&base.join("cgroup.subtree_control"));
    if base == mount
        || wanted.iter().all(|c| delegated.contains(c))
        || members(&base) != [pid as i32]
    {
        return false;
    }
    let leaf = base.join("sandspec").join(server_leaf(pid, namespace));
    if std::fs::create_dir_all(&leaf).is_err() {
        return false;
    }
    match std::fs::write(leaf.join("cgroup.procs"), pid.to_string()) {
        Ok(()) => {
            tracing::info!(cgroup = %leaf.display(),
                "the server moved into a leaf cgroup so that its own can delegate controllers");
            true
        }
        Err(e) => {
            tracing::debug!(cgroup = %leaf.display(), error = %e, "cannot move the server");
            let _ = std::fs::remove_dir(&leaf);
            false
        }
    }
}

/// `+cpu +memory +pids` for `cgroup.subtree_control`.
fn subtree_control_line(controllers: &[&str]) -> String {
    controllers
        .iter()
        .map(|c| format!("+{c}"))
        .collect::<Vec<_>>()
        .join(" ")
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
        kill_members(dir);
        thaw_now(dir);
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    tracing::warn!(cgroup = %dir.display(), "could not remove a stale cgroup");
}

/// SIGKILLs every task of one cgroup directory: through `cgroup.kill` where the kernel has
/// it (v2, which also catches tasks forking meanwhile), and each listed task in any case.
fn kill_members(dir: &Path) {
    let kill = dir.join("cgroup.kill");
    if kill.is_file() {
        let _ = std::fs::write(kill, "1");
    }
    for pid in members(dir) {
        // SAFETY: kill(2) on a task of a cgroup that only sandbox processes join.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Thaws one cgroup directory without waiting (a frozen task only dies once thawed on v1).
fn thaw_now(dir: &Path) {
    if dir.join("freezer.state").is_file() {
        let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
    }
    if dir.join("cgroup.freeze").is_file() {
        let _ = std::fs::write(dir.join("cgroup.freeze"), "0");
    }
}

/// The processes listed in a cgroup directory's `cgroup.procs`.
fn members(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Creates one cgroup directory; an existing one is refused (it would belong to someone else).
fn make_dir(path: &Path) -> io::Result<PathBuf> {
    std::fs::create_dir(path)?;
    Ok(path.to_owned())
}

/// `(controllers, path)` for every line of a `/proc/<pid>/cgroup` text. The v2 line is
/// `0::<path>`, with no controllers.
fn parse_own_cgroups(text: &str) -> Vec<(String, String)> {
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
    memory: Option<Ctl>,
    cpu: Option<Ctl>,
    pids: Option<Ctl>,
    freezer: Option<Ctl>,
    /// Every directory, each once (on v2 the controllers share one).
    dirs: Vec<Ctl>,
}

impl SandboxCgroup {
    /// The sandbox's directory below a provider's controller, created unless another of its
    /// controllers (same hierarchy) made it already.
    fn make(&mut self, provider: &Ctl, local: &str) -> io::Result<Ctl> {
        let dir = provider.dir.join(local);
        if let Some(made) = self.dirs.iter().find(|c| c.dir == dir) {
            return Ok(made.clone());
        }
        let ctl = Ctl {
            version: provider.version,
            dir: make_dir(&dir)?,
        };
        self.dirs.push(ctl.clone());
        Ok(ctl)
    }

    fn dirs(&self) -> impl Iterator<Item = &PathBuf> {
        self.dirs.iter().map(|c| &c.dir)
    }

    fn write_limits(&self, grant: &Resources) -> io::Result<()> {
        if let Some(memory) = &self.memory {
            let bytes = (grant.memory_mb * MIB).to_string();
            match memory.version {
                Version::V1 => std::fs::write(memory.dir.join("memory.limit_in_bytes"), bytes)?,
                Version::V2 => {
                    std::fs::write(memory.dir.join("memory.max"), bytes)?;
                    // Without swap off, a sandbox over its limit would swap rather than be
                    // killed (the file is absent when the kernel has no swap accounting).
                    let swap = memory.dir.join("memory.swap.max");
                    if swap.is_file() {
                        std::fs::write(swap, "0")?;
                    }
                }
            }
        }
        if let Some(cpu) = &self.cpu {
            let quota = cpu_quota(grant.cpu);
            match cpu.version {
                Version::V1 => {
                    std::fs::write(cpu.dir.join("cpu.cfs_period_us"), CPU_PERIOD_US.to_string())?;
                    std::fs::write(cpu.dir.join("cpu.cfs_quota_us"), quota.to_string())?;
                }
                Version::V2 => {
                    std::fs::write(cpu.dir.join("cpu.max"), format!("{quota} {CPU_PERIOD_US}"))?
                }
            }
        }
        if let Some(pids) = &self.pids {
            std::fs::write(pids.dir.join("pids.max"), PIDS_MAX.to_string())?;
        }
        Ok(())
    }

    /// The limits the kernel holds for this sandbox, or `None` without limit controllers.
    pub(super) fn read_resources(&self) -> io::Result<Option<Resources>> {
        let (Some(memory), Some(cpu)) = (&self.memory, &self.cpu) else {
            return Ok(None);
        };
        let limit: u64 = match memory.version {
            Version::V1 => read_number(&memory.dir.join("memory.limit_in_bytes"))?,
            Version::V2 => {
                let path = memory.dir.join("memory.max");
                parse_max(&std::fs::read_to_string(&path)?)
                    .map_err(|e| io::Error::other(format!("{}: {e}", path.display())))?
                    .ok_or_else(|| io::Error::other("memory is not limited"))?
            }
        };
        let (quota, period) = match cpu.version {
            Version::V1 => {
                let quota: i64 = read_number(&cpu.dir.join("cpu.cfs_quota_us"))?;
                let period: u64 = read_number(&cpu.dir.join("cpu.cfs_period_us"))?;
                (u64::try_from(quota).ok(), period)
            }
            Version::V2 => {
                let path = cpu.dir.join("cpu.max");
                parse_cpu_max(&std::fs::read_to_string(&path)?)
                    .map_err(|e| io::Error::other(format!("{}: {e}", path.display())))?
            }
        };
        let Some(quota) = quota.filter(|q| *q > 0 && period > 0) else {
            return Err(io::Error::other("cpu quota is not limited"));
        };
        Ok(Some(Resources {
            cpu: quota as f64 / period as f64,
            memory_mb: limit / MIB,
        }))
    }

    /// The `cgroup.procs` files a new process writes itself into before it execs (all but
    /// the memory controller's with defect `sandbox-memory-unenforced`; on v2 that directory
    /// is also the one of cpu, pids and the freezer, which the process then leaves out too).
    pub(super) fn procs_files(&self, without_memory: bool) -> Vec<CString> {
        let memory = self.memory.as_ref().map(|c| &c.dir);
        self.dirs()
            .filter(|d| !(without_memory && Some(*d) == memory))
            .filter_map(|d| CString::new(d.join("cgroup.procs").as_os_str().as_bytes()).ok())
            .collect()
    }

    /// Every process in the sandbox's cgroups right now.
    pub(super) fn tasks(&self) -> Vec<i32> {
        let mut pids: Vec<i32> = self.dirs().flat_map(|d| members(d)).collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Freezes every task; false when there is no freezer.
    pub(super) async fn freeze(&self) -> io::Result<bool> {
        self.set_frozen(true).await
    }

    pub(super) async fn thaw(&self) -> io::Result<bool> {
        self.set_frozen(false).await
    }

    async fn set_frozen(&self, frozen: bool) -> io::Result<bool> {
        let Some(freezer) = &self.freezer else {
            return Ok(false);
        };
        match freezer.version {
            Version::V1 => {
                let target = if frozen { "FROZEN" } else { "THAWED" };
                let state = freezer.dir.join("freezer.state");
                // FREEZING is transient: tasks in uninterruptible sleep are frozen when they
                // leave it. The write is repeated because the kernel only retries freezing on
                // a new write.
                for _ in 0..200 {
                    std::fs::write(&state, target)?;
                    if std::fs::read_to_string(&state)?.trim() == target {
                        return Ok(true);
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(io::Error::other(format!("cgroup did not reach {target}")))
            }
            Version::V2 => {
                // The kernel reports the state reached in `cgroup.events` (`frozen 1`) once
                // every task has stopped.
                std::fs::write(
                    freezer.dir.join("cgroup.freeze"),
                    if frozen { "1" } else { "0" },
                )?;
                let events = freezer.dir.join("cgroup.events");
                for _ in 0..200 {
                    if events_frozen(&std::fs::read_to_string(&events)?) == Some(frozen) {
                        return Ok(true);
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(io::Error::other(format!(
                    "cgroup did not reach frozen {}",
                    u8::from(frozen)
                )))
            }
        }
    }

    /// SIGKILLs every task until the cgroups are empty (a task may fork while it is killed).
    pub(super) async fn kill_all(&self) {
        for _ in 0..500 {
            if self.tasks().is_empty() {
                return;
            }
            for dir in self.dirs() {
                kill_members(dir);
            }
            // A frozen task only dies once thawed (v1; v2 lets SIGKILL through).
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
            for dir in self.dirs() {
                kill_members(dir);
                thaw_now(dir);
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

/// The CFS quota of `cpu` cores per `CPU_PERIOD_US`.
fn cpu_quota(cpu: f64) -> u64 {
    (cpu * CPU_PERIOD_US as f64).round() as u64
}

/// A v2 limit file (`memory.max`, `pids.max`): a number, or `None` for `max` (no limit).
fn parse_max(text: &str) -> Result<Option<u64>, String> {
    match text.trim() {
        "max" => Ok(None),
        value => value
            .parse()
            .map(Some)
            .map_err(|_| format!("unexpected content {value:?}")),
    }
}

/// `cpu.max`: `<quota> <period>` in microseconds, the quota `max` when not limited.
fn parse_cpu_max(text: &str) -> Result<(Option<u64>, u64), String> {
    let mut fields = text.split_whitespace();
    let (Some(quota), Some(period), None) = (fields.next(), fields.next(), fields.next()) else {
        return Err(format!("unexpected content {:?}", text.trim()));
    };
    let quota = parse_max(quota)?;
    let period = period
        .parse()
        .map_err(|_| format!("unexpected period {period:?}"))?;
    Ok((quota, period))
}

/// The `frozen` line of `cgroup.events`, when there is one.
fn events_frozen(text: &str) -> Option<bool> {
    text.lines().find_map(|line| match line.trim() {
        "frozen 1" => Some(true),
        "frozen 0" => Some(false),
        _ => None,
    })
}

fn read_number<T: std::str::FromStr>(path: &Path) -> io::Result<T> {
    let text = std::fs::read_to_string(path)?;
    text.trim()
        .parse()
        .map_err(|_| io::Error::other(format!("unexpected content in {}", path.display())))
}

#[cfg(test)]
pub(super) mod tests;
