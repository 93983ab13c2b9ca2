//! The local provider: sandboxes as directories on this machine, processes as process groups.
//!
//! On disk, below `<data_dir>/providers/<provider>/`:
//! - `sandboxes/<local>/root/`: the sandbox's files (the processes' working directory);
//! - `sandboxes/<local>/grant.json`: the resources granted, outside the root (and outside
//!   the sandbox's mount namespace where it has one) so that processes cannot change it;
//!   read back when there are no cgroups;
//! - `snapshots/<local>/root/` and `snapshots/<local>/source`: a snapshot's files and the
//!   sandbox it was taken from.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::config::{Config, ProviderConfig};
use crate::defects::{Defect, Defects};
use crate::domain::{IdKind, LocalId, ProcessSpec, ProcessState, Resources, new_local_id};
use crate::store::{Kind, Record, Scope};
use crate::stream::EventLog;

use super::cgroup::{Cgroups, SandboxCgroup};
use super::files::{SandboxFiles, normalize};
use super::isolation::{self, Holder, Namespacer, Privilege, SandboxUser, SandboxView, Weakened};
use super::process::{self, Launch, ProcessHandle, TerminalSize, kill_group};
use super::{ProviderError, Signal};

/// Grants are whole multiples of these.
const CPU_STEP: f64 = 0.25;
const MEMORY_STEP_MB: u64 = 64;
/// How long destroy and shutdown wait for a killed process's exit to be recorded.
const EXIT_RECORD_WAIT: Duration = Duration::from_secs(10);

/// What this machine lets a provider enforce, detected at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Isolation {
    /// memory/cpu/pids controllers (cgroup v1 or v2) are writable: limits are enforced and
    /// read back.
    pub cgroups: bool,
    /// A freezer (cgroup v1 `freezer.state` or v2 `cgroup.freeze`) is writable: pause freezes
    /// the cgroup (else SIGSTOP the groups).
    pub freezer: bool,
}

/// What `GET /v1/capabilities` says about a provider's isolation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct IsolationReport {
    /// The namespaces every sandbox process runs in (empty: none of its own).
    pub namespaces: Vec<&'static str>,
    /// How the server makes them: `root` (the server is root; each sandbox has host uids of
    /// its own) or `unprivileged` (user namespaces of an ordinary user; every sandbox runs
    /// as the server's host uid); `None` without namespaces.
    pub privilege: Option<&'static str>,
    /// The uid of sandbox processes inside their user namespace, or `None` when they run as
    /// the server's user.
    pub uid: Option<u32>,
    /// The users a process may run as inside (`user`, the default, and `root`).
    pub users: Vec<&'static str>,
    /// Where the sandbox's files are inside, `user`'s home (`/home/user`; `/workspace` is the
    /// same directory); `None` without namespaces (processes see the host path).
    pub home: Option<&'static str>,
    /// `loopback`: a network namespace with only a loopback interface; `host`: none.
    pub network: &'static str,
    /// The cgroup hierarchy the kernel enforces the cgroup limits through: `v1`, `v2`, or
    /// `hybrid` (some controllers on each), else `None`.
    pub cgroup: Option<&'static str>,
    /// What the kernel enforces per sandbox: `memory`, `cpu`, `pids`, `freezer`.
    pub enforced: Vec<&'static str>,
    /// The mechanism behind each of `enforced`: `cgroup_v1`, `cgroup_v2`, or (memory only)
    /// `rlimit_data`, a per-process limit.
    pub enforced_by: BTreeMap<&'static str, &'static str>,
    /// The most tasks a sandbox may have when `pids` is enforced.
    pub pids_max: Option<u32>,
    /// Why there are no namespaces, with the fix, when there are none.
    pub unavailable: Option<String>,
}

/// One provider.
pub struct LocalProvider {
    name: String,
    capacity: Resources,
    /// `<data_dir>/providers/<name>`.
    base: PathBuf,
    defects: Defects,
    /// Where process output and exits go (and the store holding process records).
    log: EventLog,
    max_output_bytes: u64,
    output_retention: Duration,
    cgroups: Cgroups,
    /// Namespaces for every sandbox, or why this machine cannot give them.
    namespacer: Result<Namespacer, String>,
    /// Test control: how long every create waits before it completes.
    create_delay: Mutex<Duration>,
    /// Test control: local IDs to hand out next, per kind.
    next_ids: Mutex<Vec<(IdKind, LocalId)>>,
    /// Sandboxes this server instance runs, by local ID. A sandbox whose directory exists
    /// but that is not here (created before a restart) is adopted on first use.
    sandboxes: Mutex<HashMap<String, Arc<Runtime>>>,
    /// Every process started since its sandbox was created, by record ID, so that stdin and
    /// signals find it and calls after its exit answer `ProcessExited`.
    processes: Mutex<HashMap<String, Arc<ProcessHandle>>>,
}

/// The in-memory side of one sandbox.
struct Runtime {
    root: PathBuf,
    cgroup: Option<SandboxCgroup>,
    /// The sandbox's namespaces (killed with it), when the machine has them.
    holder: Mutex<Option<Holder>>,
    view: Option<SandboxView>,
    /// Loopback ports inside the sandbox forwarded to the server's own (bridge, model).
    forwards: Mutex<Vec<(u16, tokio::task::AbortHandle)>>,
    inner: Mutex<RuntimeInner>,
}

impl Runtime {
    fn new(root: PathBuf, cgroup: Option<SandboxCgroup>, holder: Option<Holder>) -> Self {
        let view = holder.as_ref().map(Holder::view);
        Self {
            root,
            cgroup,
            holder: Mutex::new(holder),
            view,
            forwards: Mutex::new(Vec::new()),
            inner: Mutex::default(),
        }
    }

    /// Kills everything in the sandbox's namespaces and stops its forwarders.
    fn kill_namespaces(&self) {
        if let Some(holder) = lock(&self.holder).as_mut() {
            holder.kill();
        }
        for (_, task) in lock(&self.forwards).drain(..) {
            task.abort();
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.kill_namespaces();
    }
}

#[derive(Default)]
struct RuntimeInner {
    /// Processes whose group may still have members or whose exit is not yet recorded
    /// (pruned once both are over).
    processes: Vec<Tracked>,
    /// Every process ever started in the sandbox, to forget them all when it is destroyed.
    process_ids: Vec<String>,
    /// Set when destroy starts: no process may start from then on.
    destroyed: bool,
}

/// A process of a sandbox and whether its process group is known to be empty.
struct Tracked {
    handle: Arc<ProcessHandle>,
    /// Once the group has no members its ID may be reused by an unrelated process, so it is
    /// never signalled again.
    group_gone: AtomicBool,
}

impl Tracked {
    /// Signals the group unless it is known to be gone; notices when it is.
    fn signal_group(&self, sig: libc::c_int) {
        if self.group_gone.load(Ordering::SeqCst) {
            return;
        }
        if let Err(e) = kill_group(self.handle.pgid(), sig)
            && e.raw_os_error() == Some(libc::ESRCH)
        {
            self.group_gone.store(true, Ordering::SeqCst);
        }
    }

    /// Whether this process still needs watching: it runs, its exit is not recorded yet, or
    /// its group may still have members.
    fn still_needed(&self) -> bool {
        if !self.handle.is_done() {
            return true;
        }
        self.signal_group(0);
        !self.group_gone.load(Ordering::SeqCst)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl LocalProvider {
    pub fn new(config: &ProviderConfig, server: &Config, log: EventLog) -> std::io::Result<Self> {
        let cgroups = Cgroups::detect(&config.name);
        Self::with_cgroups(config, server, log, cgroups)
    }

    /// Namespaces for the sandboxes of a server with `server`'s configuration, or why not.
    fn detect_namespaces(server: &Config) -> Result<Namespacer, String> {
        let mut exposed = Vec::new();
        if let Some(tls) = &server.tls {
            exposed.push(tls.cert.clone());
        }
        if let Some(bin) = server.gateway.worker_binary() {
            exposed.push(bin);
        }
        let weakened = Weakened {
            host_visible: server.defects.has(Defect::SandboxSeesHostFiles),
            host_tmp_shared: server.defects.has(Defect::SandboxSharesHostTmp),
            host_pids_visible: server.defects.has(Defect::SandboxSeesHostProcesses),
        };
        Namespacer::detect(exposed, weakened)
    }

    fn with_cgroups(
        config: &ProviderConfig,
        server: &Config,
        log: EventLog,
        cgroups: Cgroups,
    ) -> io::Result<Self> {
        let base = server.data_dir.join("providers").join(&config.name);
        std::fs::create_dir_all(base.join("sandboxes"))?;
        std::fs::create_dir_all(base.join("snapshots"))?;
        let namespacer = Self::detect_namespaces(server);
        if let Err(reason) = &namespacer {
            if std::env::var(isolation::REQUIRE_ENV).is_ok_and(|v| v == "1") {
                return Err(io::Error::other(format!(
                    "sandbox isolation is required ({}=1) but unavailable: {reason}",
                    isolation::REQUIRE_ENV
                )));
            }
            // Once per server, however many providers it has: the reason names the fix.
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!("sandboxes run without namespaces of their own: {reason}");
            });
        }
        tracing::info!(
            provider = %config.name,
            cgroups = cgroups.enforces_limits(),
            freezer = cgroups.has_freezer(),
            namespaces = namespacer.as_ref().map_or("none", |n| match n.privilege() {
                Privilege::Root => "root",
                Privilege::Unprivileged => "unprivileged",
            }),
            "provider ready"
        );
        Ok(Self {
            name: config.name.clone(),
            capacity: config.capacity,
            base,
            defects: server.defects.clone(),
            log,
            max_output_bytes: server.limits.max_process_output_bytes,
            output_retention: server.retention.process_output(),
            cgroups,
            namespacer,
            create_delay: Mutex::new(Duration::ZERO),
            next_ids: Mutex::new(Vec::new()),
            sandboxes: Mutex::new(HashMap::new()),
            processes: Mutex::new(HashMap::new()),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn capacity(&self) -> Resources {
        self.capacity
    }

    pub fn isolation(&self) -> Isolation {
        Isolation {
            cgroups: self.cgroups.enforces_limits(),
            freezer: self.cgroups.has_freezer(),
        }
    }

    /// The isolation of this provider's sandboxes, as the capabilities advertise it.
    pub fn isolation_report(&self) -> IsolationReport {
        let limits = self.cgroups.enforces_limits();
        let mut enforced = self.cgroups.enforced();
        let mut enforced_by = self.cgroups.enforced_by();
        if !limits {
            // Without a memory cgroup every process gets the grant as its RLIMIT_DATA.
            enforced.insert(0, "memory");
            enforced_by.insert("memory", "rlimit_data");
        }
        let report = IsolationReport {
            namespaces: Vec::new(),
            privilege: None,
            uid: None,
            users: Vec::new(),
            home: None,
            network: "host",
            cgroup: self.cgroups.version(),
            enforced,
            enforced_by,
            pids_max: limits.then_some(super::cgroup::PIDS_MAX),
            unavailable: None,
        };
        match &self.namespacer {
            Ok(namespacer) => IsolationReport {
                namespaces: isolation::NAMESPACES.to_vec(),
                privilege: Some(match namespacer.privilege() {
                    Privilege::Root => "root",
                    Privilege::Unprivileged => "unprivileged",
                }),
                uid: Some(isolation::INSIDE_UID),
                users: vec!["user", "root"],
                home: Some(isolation::HOME),
                network: "loopback",
                ..report
            },
            Err(reason) => IsolationReport {
                unavailable: Some(reason.clone()),
                ..report
            },
        }
    }

    /// The size of a process's `RLIMIT_DATA`: the sandbox's memory grant, where no memory
    /// cgroup enforces it (and no defect leaves it out).
    fn memory_rlimit(&self, runtime: &Runtime, dir: &Path) -> io::Result<Option<u64>> {
        if self.cgroups.enforces_limits() || self.defects.has(Defect::SandboxMemoryUnenforced) {
            return Ok(None);
        }
        let grant = read_back(runtime, dir, None)?;
        Ok(Some(grant.memory_mb.saturating_mul(1024 * 1024)))
    }

    /// Test control: every create waits this long before it completes.
    pub fn set_create_delay(&self, delay: Duration) {
        *lock(&self.create_delay) = delay;
    }

    /// Test control: the next local ID of `kind` this provider allocates (to force the same
    /// local ID in two providers).
    pub fn set_next_local_id(&self, kind: IdKind, local: LocalId) {
        let mut next = lock(&self.next_ids);
        next.retain(|(k, _)| *k != kind);
        next.push((kind, local));
    }

    /// A fresh local ID (or the one a test control queued).
    pub fn allocate_local_id(&self, kind: IdKind) -> LocalId {
        let mut next = lock(&self.next_ids);
        match next.iter().position(|(k, _)| *k == kind) {
            Some(i) => next.remove(i).1,
            None => new_local_id(kind),
        }
    }

    /// Creates the sandbox's root (a copy of the snapshot's files when `from_snapshot` is a
    /// snapshot local ID) and its resource limits. Returns the resources granted, read back
    /// from the platform. `Unsatisfiable` (and nothing left behind) when `requested` exceeds
    /// the capacity.
    pub async fn create(
        &self,
        local: &str,
        requested: &Resources,
        from_snapshot: Option<&str>,
    ) -> Result<Resources, ProviderError> {
        if !self.capacity.covers(requested) {
            return Err(ProviderError::Unsatisfiable(format!(
                "requested cpu {} and memory_mb {}, but provider `{}` grants at most cpu {} and memory_mb {}",
                requested.cpu,
                requested.memory_mb,
                self.name,
                self.capacity.cpu,
                self.capacity.memory_mb
            )));
        }
        let delay = *lock(&self.create_delay);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let snapshot_root = match from_snapshot {
            Some(snap) => {
                let path = self.snapshot_dir(snap)?.join("root");
                if !path.is_dir() {
                    return Err(ProviderError::NotFound);
                }
                Some((snap.to_owned(), path))
            }
            None => None,
        };
        let dir = self.sandbox_dir(local)?;
        // Claims the local ID on disk: an existing directory is someone else's sandbox.
        std::fs::create_dir(&dir)?;
        match self.populate(local, &dir, requested, snapshot_root).await {
            Ok(granted) => Ok(granted),
            Err(e) => {
                let _ = tokio::fs::remove_dir_all(&dir).await;
                Err(e)
            }
        }
    }

    /// Fills a freshly claimed sandbox directory, sets its limits and registers it.
    async fn populate(
        &self,
        local: &str,
        dir: &Path,
        requested: &Resources,
        snapshot: Option<(String, PathBuf)>,
    ) -> Result<Resources, ProviderError> {
        let root = dir.join("root");
        match snapshot {
            Some((snap, source)) if self.defects.has(Defect::CloneSharesFiles) => {
                // The bug: the clone's root is the source sandbox's root (or the snapshot's
                // files when the source is gone), so writes leak both ways.
                let source_sandbox = std::fs::read_to_string(source.with_file_name("source"))
                    .ok()
                    .and_then(|s| self.sandbox_dir(s.trim()).ok())
                    .map(|d| d.join("root"))
                    .filter(|p| p.is_dir());
                let target = source_sandbox.unwrap_or(source);
                tracing::debug!(snapshot = %snap, "clone shares its files");
                std::os::unix::fs::symlink(target, &root)?;
            }
            Some((_, source)) => {
                let root = root.clone();
                tokio::task::spawn_blocking(move || copy_tree(&source, &root))
                    .await
                    .map_err(io::Error::other)??;
            }
            None => std::fs::create_dir(&root)?,
        }
        // Made with the sandbox rather than by its first process, so that what a process sees
        // beside its root does not change when the server records it.
        std::fs::create_dir_all(dir.join("procs"))?;

        let grant = self.grant_for(requested);
        let holder = self.start_namespaces(&root).await?;
        let cgroup = self.cgroups.create(local, &grant)?;
        let runtime = Arc::new(Runtime::new(root, cgroup, holder));
        let granted = match read_back(&runtime, dir, Some(&grant)) {
            Ok(granted) => granted,
            Err(e) => {
                if let Some(cg) = &runtime.cgroup {
                    cg.remove_now();
                }
                return Err(e.into());
            }
        };
        // The grant file is written last and under the registry lock: a sandbox with a grant
        // file but no runtime is one to adopt, and this one must not be adopted twice.
        let mut sandboxes = lock(&self.sandboxes);
        if let Err(e) = write_grant(dir, &granted) {
            if let Some(cg) = &runtime.cgroup {
                cg.remove_now();
            }
            return Err(e.into());
        }
        sandboxes.insert(local.to_owned(), runtime);
        Ok(granted)
    }

    /// Gives the sandbox whose files are `root` its namespaces (and, as root, its host uid:
    /// that of its files when they have one, else a fresh one for the whole tree); `None` on
    /// a machine without them.
    async fn start_namespaces(&self, root: &Path) -> io::Result<Option<Holder>> {
        let Ok(namespacer) = &self.namespacer else {
            return Ok(None);
        };
        let namespacer = namespacer.clone();
        let root = root.to_owned();
        tokio::task::spawn_blocking(move || namespacer.start(&root).map(Some))
            .await
            .map_err(io::Error::other)?
    }

    /// The request rounded up to whole steps, never above the capacity (which covers it).
    fn grant_for(&self, requested: &Resources) -> Resources {
        let steps = (requested.cpu / CPU_STEP - 1e-9).ceil().max(1.0);
        let cpu = (steps * CPU_STEP).min(self.capacity.cpu.max(CPU_STEP));
        let mut memory_mb = requested.memory_mb.div_ceil(MEMORY_STEP_MB).max(1) * MEMORY_STEP_MB;
        memory_mb = memory_mb.min(self.capacity.memory_mb.max(MEMORY_STEP_MB));
        if self.defects.has(Defect::UndersizedGrant) {
            memory_mb = (requested.memory_mb / 2).max(1);
        }
        Resources { cpu, memory_mb }
    }

    /// The resources the platform grants the sandbox right now.
    pub async fn read_resources(&self, local: &str) -> Result<Resources, ProviderError> {
        let runtime = self.runtime(local).await?;
        let dir = self.sandbox_dir(local)?;
        Ok(read_back(&runtime, &dir, None)?)
    }

    /// Ends every process of the sandbox and removes its root and limits. Idempotent.
    pub async fn destroy(&self, local: &str) -> Result<(), ProviderError> {
        let dir = self.sandbox_dir(local)?;
        let runtime = lock(&self.sandboxes).get(local).cloned();
        if let Some(runtime) = &runtime {
            self.end_processes(runtime).await;
            if let Some(cg) = &runtime.cgroup {
                cg.remove().await?;
            }
        }
        match tokio::fs::remove_dir_all(&dir).await {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        if let Some(runtime) = runtime {
            lock(&self.sandboxes).remove(local);
            let ids = std::mem::take(&mut lock(&runtime.inner).process_ids);
            let mut processes = lock(&self.processes);
            for id in ids {
                processes.remove(&id);
            }
        }
        Ok(())
    }

    /// Whether the sandbox is being destroyed, or is gone: the processes that end then end
    /// because their sandbox does.
    pub fn is_ending(&self, local: &str) -> bool {
        match lock(&self.sandboxes).get(local) {
            Some(runtime) => lock(&runtime.inner).destroyed,
            None => true,
        }
    }

    /// Kills every process of the sandbox and waits until each exit is recorded. New
    /// processes are refused from here on.
    async fn end_processes(&self, runtime: &Runtime) {
        let handles: Vec<Arc<ProcessHandle>> = {
            let mut inner = lock(&runtime.inner);
            inner.destroyed = true;
            for tracked in &inner.processes {
                tracked.signal_group(libc::SIGKILL);
            }
            inner.processes.iter().map(|t| t.handle.clone()).collect()
        };
        // Also whatever left its process group and cgroup: nothing outlives the PID namespace.
        runtime.kill_namespaces();
        if let Some(cg) = &runtime.cgroup {
            // Also whatever left its process group (setsid) but not its cgroup.
            cg.kill_all().await;
        }
        for handle in handles {
            if !handle.wait_done(EXIT_RECORD_WAIT).await {
                tracing::warn!(process = %handle.id(), "exit not recorded in time");
            }
        }
    }

    /// Stops every process of the sandbox, keeping memory and files.
    pub async fn pause(&self, local: &str) -> Result<(), ProviderError> {
        let runtime = self.runtime(local).await?;
        if self.defects.has(Defect::PauseNoop) {
            return Ok(());
        }
        if let Some(cg) = &runtime.cgroup
            && cg.freeze().await?
        {
            return Ok(());
        }
        signal_all(&runtime, libc::SIGSTOP);
        Ok(())
    }

    /// Continues every process stopped by `pause`.
    pub async fn resume(&self, local: &str) -> Result<(), ProviderError> {
        let runtime = self.runtime(local).await?;
        if let Some(cg) = &runtime.cgroup
            && cg.thaw().await?
        {
            return Ok(());
        }
        signal_all(&runtime, libc::SIGCONT);
        Ok(())
    }

    /// Copies the sandbox's files into a snapshot.
    pub async fn snapshot(
        &self,
        sandbox_local: &str,
        snapshot_local: &str,
    ) -> Result<(), ProviderError> {
        let root = self.sandbox_dir(sandbox_local)?.join("root");
        if !root.is_dir() {
            return Err(ProviderError::NotFound);
        }
        let target = self.snapshot_dir(snapshot_local)?;
        let staging = self
            .base
            .join("snapshots")
            .join(format!(".staging-{snapshot_local}"));
        let source = sandbox_local.to_owned();
        let result = tokio::task::spawn_blocking(move || -> io::Result<()> {
            match std::fs::remove_dir_all(&staging) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
            std::fs::create_dir(&staging)?;
            let copied = copy_tree(&root, &staging.join("root"))
                .and_then(|()| std::fs::write(staging.join("source"), source))
                .and_then(|()| {
                    if target.exists() {
                        return Err(io::Error::from(io::ErrorKind::AlreadyExists));
                    }
                    // A snapshot appears whole or not at all.
                    std::fs::rename(&staging, &target)
                });
            if copied.is_err() {
                let _ = std::fs::remove_dir_all(&staging);
            }
            copied
        })
        .await
        .map_err(io::Error::other)?;
        Ok(result?)
    }

    pub async fn delete_snapshot(&self, snapshot_local: &str) -> Result<(), ProviderError> {
        match tokio::fs::remove_dir_all(self.snapshot_dir(snapshot_local)?).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Starts a process described by `record` (a stored [`crate::domain::Process`], already
    /// inserted). Output goes to the process's event log; on exit (or timeout, or signal)
    /// the provider updates the record (state, exit code, signal, `ended_at`,
    /// `output_expires_at`, `due_at`) and appends the `exit` event.
    ///
    /// The event log is `process_stream(&record.id)`; the record's body also gets
    /// `"truncated": true` once output beyond `limits.max_process_output_bytes` is dropped.
    pub async fn spawn(
        &self,
        sandbox_local: &str,
        record: Record,
        spec: &ProcessSpec,
        sandbox_env: &BTreeMap<String, String>,
    ) -> Result<(), ProviderError> {
        self.spawn_with(
            sandbox_local,
            record,
            spec,
            sandbox_env,
            None,
            SandboxUser::User,
        )
        .await
    }

    /// Starts a process as [`LocalProvider::spawn`] does, but on a pseudo-terminal of `size`
    /// (E2B's PTY processes): its output is one stream (`stdout` events) and its input is
    /// written with [`LocalProvider::write_terminal`], not to stdin.
    pub async fn spawn_terminal(
        &self,
        sandbox_local: &str,
        record: Record,
        spec: &ProcessSpec,
        sandbox_env: &BTreeMap<String, String>,
        size: TerminalSize,
    ) -> Result<(), ProviderError> {
        self.spawn_with(
            sandbox_local,
            record,
            spec,
            sandbox_env,
            Some(size),
            SandboxUser::User,
        )
        .await
    }

    /// [`Self::spawn`] as `user` inside the sandbox (`root` needs namespaces: without them
    /// every process runs as the server's user, and asking for root is refused).
    pub async fn spawn_as(
        &self,
        sandbox_local: &str,
        record: Record,
        spec: &ProcessSpec,
        sandbox_env: &BTreeMap<String, String>,
        user: SandboxUser,
    ) -> Result<(), ProviderError> {
        self.spawn_with(sandbox_local, record, spec, sandbox_env, None, user)
            .await
    }

    /// The general start: on a pseudo-terminal of that size when `terminal` is given, as
    /// `user` inside the sandbox.
    pub async fn spawn_with(
        &self,
        sandbox_local: &str,
        record: Record,
        spec: &ProcessSpec,
        sandbox_env: &BTreeMap<String, String>,
        terminal: Option<TerminalSize>,
        user: SandboxUser,
    ) -> Result<(), ProviderError> {
        let runtime = self.runtime(sandbox_local).await?;
        let cwd = resolve_cwd(&runtime.root, spec.cwd.as_deref())?;
        let (home, cwd, enter) = match &runtime.view {
            Some(view) => {
                let root = std::fs::canonicalize(&runtime.root)?;
                let rel = cwd
                    .strip_prefix(&root)
                    .map_err(|_| ProviderError::InvalidPath)?;
                let inside = Path::new(isolation::HOME).join(rel);
                let inside = inside.to_string_lossy().into_owned();
                check_program(view, spec, sandbox_env, &inside)?;
                let enter = view.entry(&inside, user)?;
                (
                    PathBuf::from(user.home()),
                    PathBuf::from(inside),
                    Some(enter),
                )
            }
            None if user == SandboxUser::Root => {
                return Err(ProviderError::InvalidArgument {
                    param: "user",
                    detail: "this server's sandboxes have no namespaces of their own, so no \
                             process can run as their root"
                        .into(),
                });
            }
            None => (std::fs::canonicalize(&runtime.root)?, cwd, None),
        };
        let memory_limit = self.memory_rlimit(&runtime, &self.sandbox_dir(sandbox_local)?)?;
        let launch = Launch {
            home,
            cwd,
            enter,
            cgroup_procs: runtime
                .cgroup
                .as_ref()
                .map(|cg| cg.procs_files(self.defects.has(Defect::SandboxMemoryUnenforced)))
                .unwrap_or_default(),
            memory_limit,
            log: self.log.clone(),
            max_output_bytes: self.max_output_bytes,
            output_retention: self.output_retention,
            terminal,
            pid_file: self
                .sandbox_dir(sandbox_local)?
                .join("procs")
                .join(checked_local(&record.id.replace(':', "_"))?),
        };
        let handle = {
            let mut inner = lock(&runtime.inner);
            if inner.destroyed {
                return Err(ProviderError::NotFound);
            }
            inner.processes.retain(Tracked::still_needed);
            // Started under the lock so that a concurrent destroy either sees it or refuses it.
            let handle = process::spawn(launch, &record, spec, sandbox_env)?;
            inner.processes.push(Tracked {
                handle: handle.clone(),
                group_gone: AtomicBool::new(false),
            });
            inner.process_ids.push(record.id.clone());
            handle
        };
        lock(&self.processes).insert(record.id.clone(), handle);
        Ok(())
    }

    pub async fn write_stdin(
        &self,
        process_id: &str,
        data: &[u8],
        eof: bool,
    ) -> Result<(), ProviderError> {
        self.process(process_id)?.write_stdin(data, eof).await
    }

    /// Types `data` into the pseudo-terminal of a process started by `spawn_terminal`.
    pub async fn write_terminal(&self, process_id: &str, data: &[u8]) -> Result<(), ProviderError> {
        self.process(process_id)?.write_terminal(data).await
    }

    /// Resizes the pseudo-terminal of a process started by `spawn_terminal`.
    pub fn resize_terminal(
        &self,
        process_id: &str,
        size: TerminalSize,
    ) -> Result<(), ProviderError> {
        self.process(process_id)?.resize_terminal(size)
    }

    pub fn signal(&self, process_id: &str, signal: Signal) -> Result<(), ProviderError> {
        let sig = match signal {
            Signal::Term => libc::SIGTERM,
            Signal::Kill => libc::SIGKILL,
            Signal::Int => libc::SIGINT,
        };
        self.process(process_id)?.signal(sig)
    }

    /// What the sandbox uses right now: the resident memory and the CPU time of the
    /// processes in its cgroups (none are counted on a machine without cgroups), and the
    /// bytes of its files.
    pub async fn usage(&self, local: &str) -> Result<Usage, ProviderError> {
        let runtime = self.runtime(local).await?;
        let root = runtime.root.clone();
        let pids = runtime
            .cgroup
            .as_ref()
            .map(|cg| cg.tasks())
            .unwrap_or_default();
        tokio::task::spawn_blocking(move || {
            // SAFETY: sysconf has no preconditions.
            let (page, ticks) = unsafe {
                (
                    libc::sysconf(libc::_SC_PAGESIZE).max(1) as u64,
                    libc::sysconf(libc::_SC_CLK_TCK).max(1) as f64,
                )
            };
            let mut usage = Usage {
                memory_bytes: 0,
                cpu_seconds: 0.0,
                disk_bytes: tree_bytes(&root),
            };
            for pid in pids {
                let proc = PathBuf::from(format!("/proc/{pid}"));
                if let Ok(statm) = std::fs::read_to_string(proc.join("statm"))
                    && let Some(rss) = statm
                        .split_whitespace()
                        .nth(1)
                        .and_then(|n| n.parse::<u64>().ok())
                {
                    usage.memory_bytes += rss * page;
                }
                // utime and stime are fields 14 and 15; the command name before them may hold
                // spaces, so fields are counted after its closing parenthesis.
                if let Ok(stat) = std::fs::read_to_string(proc.join("stat"))
                    && let Some((_, rest)) = stat.rsplit_once(')')
                {
                    let fields: Vec<&str> = rest.split_whitespace().collect();
                    let time = |i: usize| {
                        fields
                            .get(i)
                            .and_then(|n| n.parse::<u64>().ok())
                            .unwrap_or(0)
                    };
                    usage.cpu_seconds += (time(11) + time(12)) as f64 / ticks;
                }
            }
            usage
        })
        .await
        .map_err(|e| ProviderError::Io(io::Error::other(e)))
    }

    /// Files of one sandbox, confined to its root. What they create belongs to the
    /// sandbox's uid when it has one of its own.
    pub fn files(&self, local: &str) -> Result<SandboxFiles, ProviderError> {
        let root = self.sandbox_dir(local)?.join("root");
        let files = SandboxFiles::open(&root, self.defects.has(Defect::SymlinkEscape)).map_err(
            |e| match e.kind() {
                io::ErrorKind::NotFound => ProviderError::NotFound,
                _ => ProviderError::Io(e),
            },
        )?;
        Ok(if self.defects.has(Defect::ReadFollowsSymlinks) {
            files.reading_through_symlinks()
        } else {
            files
        })
    }

    /// Whether the sandbox's root exists on disk (used by absence checks and digests).
    pub fn exists(&self, local: &str) -> bool {
        self.sandbox_dir(local)
            .is_ok_and(|d| d.join("root").symlink_metadata().is_ok())
    }

    /// Ends every process (server shutdown).
    pub async fn shutdown(&self) {
        let runtimes: Vec<Arc<Runtime>> = lock(&self.sandboxes).drain().map(|(_, r)| r).collect();
        for runtime in runtimes {
            self.end_processes(&runtime).await;
            if let Some(cg) = &runtime.cgroup
                && let Err(e) = cg.remove().await
            {
                tracing::warn!(error = %e, "could not remove a sandbox cgroup");
            }
        }
        lock(&self.processes).clear();
        self.cgroups.remove_provider_dirs();
    }

    /// Ends the process groups that a server process which died without shutting down (a
    /// crash, SIGKILL) left running in this provider's sandboxes, and records their end.
    /// Called once at startup, before the server accepts requests; returns how many groups
    /// were still running.
    pub async fn end_leftovers(&self) -> usize {
        if self.defects.has(Defect::RestartLeavesProcesses) {
            // The bug: processes of the dead server run on, unowned, and stay `running`.
            return 0;
        }
        let Ok(sandboxes) = std::fs::read_dir(self.base.join("sandboxes")) else {
            return 0;
        };
        let mut ended = 0;
        for sandbox in sandboxes.flatten() {
            let Ok(files) = std::fs::read_dir(sandbox.path().join("procs")) else {
                continue;
            };
            for file in files.flatten() {
                let (running, record_id) = process::end_leftover(&file.path());
                ended += usize::from(running);
                let Some(id) = record_id else { continue };
                match self
                    .log
                    .store()
                    .get(Kind::Process, Scope::System, &id)
                    .await
                {
                    Ok(Some(rec)) if rec.state == ProcessState::Running.as_str() => {
                        process::record_lost(&self.log, &rec, self.output_retention).await;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(process = %id, error = %e, "could not record a leftover process's end")
                    }
                }
            }
        }
        ended
    }

    /// The in-memory side of a sandbox, adopting one created before a restart.
    async fn runtime(&self, local: &str) -> Result<Arc<Runtime>, ProviderError> {
        let dir = self.sandbox_dir(local)?;
        if let Some(runtime) = self.registered(local)? {
            return Ok(runtime);
        }
        let grant = read_grant(&dir).map_err(|_| ProviderError::NotFound)?;
        let root = dir.join("root");
        let holder = self.start_namespaces(&root).await?;
        let mut sandboxes = lock(&self.sandboxes);
        if let Some(runtime) = sandboxes.get(local) {
            // Adopted concurrently; this holder is dropped (and killed) unused.
            return Ok(runtime.clone());
        }
        let cgroup = self.cgroups.create(local, &grant)?;
        let runtime = Arc::new(Runtime::new(root, cgroup, holder));
        sandboxes.insert(local.to_owned(), runtime.clone());
        Ok(runtime)
    }

    /// The registered runtime of a sandbox; `NotFound` once its destroy started.
    fn registered(&self, local: &str) -> Result<Option<Arc<Runtime>>, ProviderError> {
        let sandboxes = lock(&self.sandboxes);
        match sandboxes.get(local) {
            Some(runtime) if lock(&runtime.inner).destroyed => Err(ProviderError::NotFound),
            Some(runtime) => Ok(Some(runtime.clone())),
            None => Ok(None),
        }
    }

    /// A TCP connection to `127.0.0.1:port` as the sandbox's own processes reach it: inside
    /// its network namespace when it has one.
    pub async fn connect(
        &self,
        local: &str,
        port: u16,
    ) -> Result<tokio::net::TcpStream, ProviderError> {
        let runtime = self.runtime(local).await?;
        match &runtime.view {
            Some(view) => Ok(view.connect(port).await?),
            None => {
                Ok(tokio::net::TcpStream::connect((std::net::Ipv4Addr::LOCALHOST, port)).await?)
            }
        }
    }

    /// Makes `addr`, a loopback address of the server (its own listener, the model
    /// endpoint), reachable at the same address inside the sandbox, so that a session's
    /// worker can use it. Nothing else on the host is reachable from a sandbox. A no-op
    /// without namespaces (the sandbox shares the host's network) and for other addresses.
    pub async fn forward_loopback(
        &self,
        local: &str,
        addr: std::net::SocketAddr,
    ) -> Result<(), ProviderError> {
        let runtime = self.runtime(local).await?;
        let Some(view) = &runtime.view else {
            return Ok(());
        };
        if !addr.ip().is_loopback() {
            return Ok(());
        }
        if lock(&runtime.forwards)
            .iter()
            .any(|(p, _)| *p == addr.port())
        {
            return Ok(());
        }
        let listener = match view.listen(addr.port()).await {
            Ok(listener) => listener,
            // Another call forwarded it meanwhile.
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inside, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    if let Ok(mut outside) = tokio::net::TcpStream::connect(addr).await {
                        let _ = tokio::io::copy_bidirectional(&mut inside, &mut outside).await;
                    }
                });
            }
        });
        lock(&runtime.forwards).push((addr.port(), task.abort_handle()));
        Ok(())
    }

    /// The handle of a process by record ID (`<provider>:prc_...`, or the bare local ID).
    fn process(&self, process_id: &str) -> Result<Arc<ProcessHandle>, ProviderError> {
        let processes = lock(&self.processes);
        processes
            .get(process_id)
            .or_else(|| processes.get(&format!("{}:{process_id}", self.name)))
            .cloned()
            .ok_or(ProviderError::NotFound)
    }

    fn sandbox_dir(&self, local: &str) -> Result<PathBuf, ProviderError> {
        Ok(self.base.join("sandboxes").join(checked_local(local)?))
    }

    fn snapshot_dir(&self, local: &str) -> Result<PathBuf, ProviderError> {
        Ok(self.base.join("snapshots").join(checked_local(local)?))
    }
}

impl Drop for LocalProvider {
    /// A provider dropped without `shutdown` (a test that panicked) still leaves no process
    /// and no cgroup behind.
    fn drop(&mut self) {
        let runtimes: Vec<Arc<Runtime>> = lock(&self.sandboxes).drain().map(|(_, r)| r).collect();
        for runtime in runtimes {
            for tracked in &lock(&runtime.inner).processes {
                tracked.signal_group(libc::SIGKILL);
            }
            if let Some(cg) = &runtime.cgroup {
                cg.remove_now();
            }
        }
        self.cgroups.remove_provider_dirs();
    }
}

/// A local ID used as a directory name: one plain path component.
fn checked_local(local: &str) -> Result<&str, ProviderError> {
    let plain = !local.is_empty()
        && local != "."
        && local != ".."
        && !local.starts_with('.')
        && local
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if plain {
        Ok(local)
    } else {
        Err(ProviderError::NotFound)
    }
}

/// Signals every process group of the sandbox that may still have members.
fn signal_all(runtime: &Runtime, sig: libc::c_int) {
    let inner = lock(&runtime.inner);
    for tracked in &inner.processes {
        tracked.signal_group(sig);
    }
}

/// The grant as the platform holds it: the cgroup limits, else the grant file (or the
/// grant just computed, during create).
fn read_back(runtime: &Runtime, dir: &Path, fresh: Option<&Resources>) -> io::Result<Resources> {
    if let Some(cg) = &runtime.cgroup
        && let Some(resources) = cg.read_resources()?
    {
        return Ok(resources);
    }
    match fresh {
        Some(grant) => Ok(*grant),
        None => read_grant(dir),
    }
}

fn write_grant(dir: &Path, grant: &Resources) -> io::Result<()> {
    let text = serde_json::to_vec(grant).map_err(io::Error::other)?;
    let tmp = dir.join("grant.json.tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(tmp, dir.join("grant.json"))
}

fn read_grant(dir: &Path) -> io::Result<Resources> {
    let text = std::fs::read(dir.join("grant.json"))?;
    serde_json::from_slice(&text).map_err(io::Error::other)
}

/// The working directory of a process: inside the root after resolving symlinks
/// (`InvalidPath` when it leads outside, `InvalidArgument` when it is not a directory).
fn resolve_cwd(root: &Path, cwd: Option<&str>) -> Result<PathBuf, ProviderError> {
    let rel = normalize(cwd.unwrap_or("")).map_err(|_| ProviderError::InvalidPath)?;
    let root = std::fs::canonicalize(root).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => ProviderError::NotFound,
        _ => ProviderError::Io(e),
    })?;
    let not_a_dir = || ProviderError::InvalidArgument {
        param: "cwd",
        detail: "cwd must be an existing directory inside the sandbox".into(),
    };
    let full = std::fs::canonicalize(root.join(&rel)).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory => not_a_dir(),
        _ => ProviderError::InvalidPath,
    })?;
    if !full.starts_with(&root) {
        return Err(ProviderError::InvalidPath);
    }
    if !full.is_dir() {
        return Err(not_a_dir());
    }
    Ok(full)
}

/// Refuses, before anything starts, a command whose program the sandbox does not have, as
/// spawning it directly would (the process's `PATH` is searched in the sandbox's view).
fn check_program(
    view: &SandboxView,
    spec: &ProcessSpec,
    sandbox_env: &BTreeMap<String, String>,
    cwd_inside: &str,
) -> Result<(), ProviderError> {
    use std::os::unix::fs::PermissionsExt as _;
    let Some(program) = spec.cmd.first() else {
        return Ok(());
    };
    let runnable = |inside: &Path| {
        view.metadata(&inside.to_string_lossy())
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let found = if program.contains('/') {
        runnable(&Path::new(cwd_inside).join(program))
    } else {
        let path = spec
            .env
            .get("PATH")
            .or_else(|| sandbox_env.get("PATH"))
            .map(String::as_str)
            .unwrap_or(process::DEFAULT_PATH);
        std::env::split_paths(path)
            .filter(|d| d.is_absolute())
            .any(|d| runnable(&d.join(program)))
    };
    if found {
        Ok(())
    } else {
        Err(ProviderError::InvalidArgument {
            param: "cmd",
            detail: format!("cannot run `{program}`: not found in the sandbox"),
        })
    }
}

/// Copies a directory tree: files, directories and symlinks (as links); a real copy, so the
/// two trees are independent. Sockets, FIFOs and devices are not carried over, and entries
/// that vanish while copying (a running sandbox) are skipped.
fn copy_tree(src: &Path, dst: &Path) -> io::Result<()> {
    std::fs::create_dir(dst)?;
    for entry in std::fs::read_dir(src)? {
        let entry = entry?;
        let from = entry.path();
        let to = dst.join(entry.file_name());
        let meta = match std::fs::symlink_metadata(&from) {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let kind = meta.file_type();
        let copied = if kind.is_symlink() {
            std::fs::read_link(&from).and_then(|target| std::os::unix::fs::symlink(target, &to))
        } else if kind.is_dir() {
            copy_tree(&from, &to).and_then(|()| std::fs::set_permissions(&to, meta.permissions()))
        } else if kind.is_file() {
            std::fs::copy(&from, &to).map(drop)
        } else {
            Ok(())
        };
        match copied {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    std::fs::set_permissions(dst, std::fs::metadata(src)?.permissions())
}

/// What a sandbox uses at one moment ([`LocalProvider::usage`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    pub memory_bytes: u64,
    /// CPU time its live processes have used since they started.
    pub cpu_seconds: f64,
    pub disk_bytes: u64,
}

/// The bytes of the files below `dir` (symlinks not followed); what cannot be read counts 0.
fn tree_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut pending = vec![dir.to_owned()];
    while let Some(d) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            match entry.metadata() {
                Ok(m) if m.is_dir() => pending.push(entry.path()),
                Ok(m) if m.is_file() => total += m.len(),
                _ => {}
            }
        }
    }
    total
}

#[cfg(test)]
mod tests;
