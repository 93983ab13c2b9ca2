//! Tests of the local provider against the real machine: directories in a tempdir, real
//! processes, real cgroups where the machine has them, and the SQLite store in memory.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt as _, BufReader};

use super::*;
use crate::clock::now;
use crate::config::Config;
use crate::domain::{Process, ProcessState};
use crate::sandbox::FileError;
use crate::store::{Event, Kind, Scope, SqliteStore, Store};
use crate::stream::process_stream;

/// One provider (`local`, or `local-b` where the capacity matters) over a fresh data dir.
struct Fixture {
    // Dropped first: kills whatever a failing test left running, before the tempdir goes.
    provider: LocalProvider,
    store: Arc<dyn Store>,
    _tmp: tempfile::TempDir,
}

async fn fixture_with(
    defects: Defects,
    real_cgroups: bool,
    tweak: impl FnOnce(&mut Config),
) -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let mut config = Config::for_tests(tmp.path().to_owned());
    config.defects = defects;
    tweak(&mut config);
    let store: Arc<dyn Store> = Arc::new(SqliteStore::open(None).await.unwrap());
    let log = EventLog::new(store.clone());
    let provider = if real_cgroups {
        LocalProvider::new(&config.providers[0], &config, log).unwrap()
    } else {
        LocalProvider::with_cgroups(&config.providers[0], &config, log, Cgroups::none()).unwrap()
    };
    Fixture {
        provider,
        store,
        _tmp: tmp,
    }
}

/// A provider over a fresh data dir with the given cgroups.
async fn fixture_with_cgroups(cgroups: Cgroups) -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let config = Config::for_tests(tmp.path().to_owned());
    let store: Arc<dyn Store> = Arc::new(SqliteStore::open(None).await.unwrap());
    let log = EventLog::new(store.clone());
    let provider =
        LocalProvider::with_cgroups(&config.providers[0], &config, log, cgroups).unwrap();
    Fixture {
        provider,
        store,
        _tmp: tmp,
    }
}

async fn fixture() -> Fixture {
    fixture_with(Defects::none(), true, |_| {}).await
}

fn res(cpu: f64, memory_mb: u64) -> Resources {
    Resources { cpu, memory_mb }
}

fn spec(cmd: &[&str]) -> ProcessSpec {
    ProcessSpec {
        cmd: cmd.iter().map(|s| s.to_string()).collect(),
        cwd: None,
        env: BTreeMap::new(),
        stdin: false,
        timeout_ms: None,
        tag: None,
    }
}

fn sh(script: &str) -> ProcessSpec {
    spec(&["sh", "-c", script])
}

impl Fixture {
    async fn sandbox(&self) -> String {
        let local = self.provider.allocate_local_id(IdKind::Sandbox);
        self.provider
            .create(&local, &res(1.0, 512), None)
            .await
            .unwrap();
        local
    }

    fn root(&self, local: &str) -> PathBuf {
        self.provider.sandbox_dir(local).unwrap().join("root")
    }

    /// Inserts a process record the way the API does and starts it.
    async fn start(&self, sandbox: &str, spec: ProcessSpec) -> String {
        self.try_start(sandbox, spec, &BTreeMap::new())
            .await
            .unwrap()
    }

    async fn try_start(
        &self,
        sandbox: &str,
        spec: ProcessSpec,
        env: &BTreeMap<String, String>,
    ) -> Result<String, ProviderError> {
        self.try_start_as(sandbox, spec, env, SandboxUser::User)
            .await
    }

    /// [`Self::try_start`] as `user` of the sandbox.
    async fn try_start_as(
        &self,
        sandbox: &str,
        spec: ProcessSpec,
        env: &BTreeMap<String, String>,
        user: SandboxUser,
    ) -> Result<String, ProviderError> {
        let local = self.provider.allocate_local_id(IdKind::Process);
        let id = format!("local:{local}");
        let process = Process {
            id: id.clone(),
            sandbox_id: format!("local:{sandbox}"),
            state: ProcessState::Running,
            cmd: spec.cmd.clone(),
            tag: spec.tag.clone(),
            exit_code: None,
            signal: None,
            started_at: now(),
            ended_at: None,
            output_expires_at: None,
            output_expired: false,
        };
        let record = Record {
            kind: Kind::Process,
            id: id.clone(),
            owner: "alice".into(),
            parent: Some(process.sandbox_id.clone()),
            state: "running".into(),
            body: serde_json::to_value(&process).unwrap(),
            version: 1,
            created_at: now(),
            due_at: None,
        };
        self.store.insert(&record).await.unwrap();
        self.provider
            .spawn_as(sandbox, record, &spec, env, user)
            .await?;
        Ok(id)
    }

    async fn events(&self, id: &str) -> Vec<Event> {
        self.store
            .events_after(&process_stream(id), 0, 100_000)
            .await
            .unwrap()
    }

    /// Waits for the `exit` event; returns every event and the record as updated.
    async fn wait_exit(&self, id: &str) -> (Vec<Event>, Record) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let events = self.events(id).await;
            if events.iter().any(|e| e.kind == "exit") {
                let record = self
                    .store
                    .get(Kind::Process, Scope::System, id)
                    .await
                    .unwrap()
                    .unwrap();
                return (events, record);
            }
            assert!(Instant::now() < deadline, "process {id} did not exit");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The host PID of what a sandbox's processes see as `pid` (the same PID without
    /// namespaces); `None` when no such process exists.
    fn host_pid(&self, local: &str, pid: i32) -> Option<i32> {
        let view = lock(&self.provider.sandboxes)[local].view.clone();
        let Some(view) = view else {
            return Some(pid);
        };
        let ns = view.pid_namespace();
        std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
            let host: i32 = e.file_name().to_str()?.parse().ok()?;
            if std::fs::read_link(e.path().join("ns/pid")).ok()? != ns {
                return None;
            }
            let status = std::fs::read_to_string(e.path().join("status")).ok()?;
            let inner = status
                .lines()
                .find_map(|l| l.strip_prefix("NSpid:"))?
                .split_whitespace()
                .last()?
                .parse::<i32>()
                .ok()?;
            (inner == pid).then_some(host)
        })
    }

    fn pgid(&self, id: &str) -> i32 {
        self.provider.process(id).unwrap().pgid()
    }

    fn cgroup_paths(&self, local: &str) -> Vec<PathBuf> {
        let sandboxes = lock(&self.provider.sandboxes);
        sandboxes[local]
            .cgroup
            .as_ref()
            .map(|cg| cg.paths())
            .unwrap_or_default()
    }
}

fn output_of(events: &[Event], kind: &str) -> String {
    events
        .iter()
        .filter(|e| e.kind == kind)
        .map(|e| e.data["data"].as_str().unwrap().to_owned())
        .collect()
}

/// Whether `pid` is a live process (a zombie counts as gone: it runs nothing).
fn alive(pid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks for existence.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return false;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, Some(Some('Z')) | None)
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn create_and_destroy_leave_nothing_behind() {
    let f = fixture().await;
    let local = f.sandbox().await;
    let dir = f.provider.sandbox_dir(&local).unwrap();
    assert!(f.root(&local).is_dir());
    assert!(f.provider.exists(&local));
    let cgroups = f.cgroup_paths(&local);
    assert_eq!(
        !cgroups.is_empty(),
        f.provider.isolation().cgroups || f.provider.isolation().freezer
    );
    for path in &cgroups {
        assert!(path.is_dir(), "{} missing", path.display());
    }

    // A process that leaves a background child in its group, and one that escapes its group.
    // Each PID file is written under another name and renamed, so that no read sees it empty.
    let id = f
        .start(
            &local,
            sh("sleep 1000 & echo $! > bg.tmp && mv bg.tmp bg.pid; exec sleep 1000"),
        )
        .await;
    let escaped = f
        .start(
            &local,
            sh("setsid sleep 1000 & echo $! > esc.tmp && mv esc.tmp esc.pid; wait"),
        )
        .await;
    let root = f.root(&local);
    eventually("pid files", || {
        root.join("bg.pid").is_file() && root.join("esc.pid").is_file()
    })
    .await;
    let read_pid = |name: &str| -> i32 {
        std::fs::read_to_string(root.join(name))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let host = |name: &str| f.host_pid(&local, read_pid(name)).unwrap();
    let mut pids = vec![f.pgid(&id), f.pgid(&escaped), host("bg.pid")];
    if f.provider.isolation().cgroups || f.provider.isolation_report().uid.is_some() {
        // With cgroups or a PID namespace even a process that left its group is killed.
        pids.push(host("esc.pid"));
        for path in &cgroups {
            let procs = std::fs::read_to_string(path.join("cgroup.procs")).unwrap();
            assert!(
                procs.lines().any(|l| l.trim() == f.pgid(&id).to_string()),
                "not in {}",
                path.display()
            );
        }
    }
    for pid in &pids {
        assert!(alive(*pid), "pid {pid} should run");
    }

    f.provider.destroy(&local).await.unwrap();
    assert!(!dir.exists());
    assert!(!f.provider.exists(&local));
    for path in &cgroups {
        assert!(!path.exists(), "cgroup {} left behind", path.display());
    }
    for pid in &pids {
        assert!(!alive(*pid), "pid {pid} survived destroy");
    }
    // Exits were recorded before destroy returned.
    let events = f.events(&id).await;
    let exit = events.last().unwrap();
    assert_eq!(exit.kind, "exit");
    assert_eq!(exit.data["state"], "killed");
    assert_eq!(exit.data["signal"], "KILL");

    // Idempotent, and the sandbox is gone for every other operation.
    f.provider.destroy(&local).await.unwrap();
    assert!(matches!(
        f.provider.read_resources(&local).await,
        Err(ProviderError::NotFound)
    ));
    assert!(matches!(
        f.provider.files(&local),
        Err(ProviderError::NotFound)
    ));
    assert!(matches!(
        f.try_start(&local, sh("true"), &BTreeMap::new()).await,
        Err(ProviderError::NotFound)
    ));
}

#[tokio::test]
async fn grant_is_rounded_up_and_read_back_from_the_platform() {
    let f = fixture().await;
    let local = f.provider.allocate_local_id(IdKind::Sandbox);
    let requested = res(0.3, 100);
    let granted = f.provider.create(&local, &requested, None).await.unwrap();
    assert_eq!(granted, res(0.5, 128));
    assert!(granted.covers(&requested));
    assert_eq!(f.provider.read_resources(&local).await.unwrap(), granted);

    if f.provider.isolation().cgroups {
        let paths = f.cgroup_paths(&local);
        let read = |suffix: &str, file: &str| -> String {
            let dir = paths
                .iter()
                .find(|p| p.to_string_lossy().contains(suffix))
                .unwrap();
            std::fs::read_to_string(dir.join(file))
                .unwrap()
                .trim()
                .to_owned()
        };
        assert_eq!(
            read("/memory/", "memory.limit_in_bytes"),
            (128u64 * 1024 * 1024).to_string()
        );
        assert_eq!(read("/cpu/", "cpu.cfs_quota_us"), "50000");
        // The readback follows the kernel, not a copy of the request.
        let memory = paths
            .iter()
            .find(|p| p.to_string_lossy().contains("/memory/"))
            .unwrap();
        std::fs::write(
            memory.join("memory.limit_in_bytes"),
            (256u64 * 1024 * 1024).to_string(),
        )
        .unwrap();
        assert_eq!(
            f.provider.read_resources(&local).await.unwrap(),
            res(0.5, 256)
        );
    }

    // Exact multiples stay as they are; the capacity itself is grantable.
    let exact = f.provider.allocate_local_id(IdKind::Sandbox);
    assert_eq!(
        f.provider
            .create(&exact, &res(4.0, 8192), None)
            .await
            .unwrap(),
        res(4.0, 8192)
    );
    f.provider.destroy(&local).await.unwrap();
    f.provider.destroy(&exact).await.unwrap();
}

#[tokio::test]
async fn the_memory_grant_is_enforced() {
    let f = fixture().await;
    let local = f.provider.allocate_local_id(IdKind::Sandbox);
    f.provider
        .create(&local, &res(0.25, 64), None)
        .await
        .unwrap();
    // 128 MiB in a 64 MiB sandbox; 16 MiB fits. One after the other: run together, the
    // two would share the grant, and the kernel could pick either to end.
    let big = f
        .start(
            &local,
            spec(&[
                "perl",
                "-e",
                "$x = 'a' x (128 * 1024 * 1024); print 'survived'",
            ]),
        )
        .await;
    let (big_events, big_record) = f.wait_exit(&big).await;
    let small = f
        .start(
            &local,
            spec(&[
                "perl",
                "-e",
                "$x = 'a' x (16 * 1024 * 1024); print 'survived'",
            ]),
        )
        .await;
    let (small_events, _) = f.wait_exit(&small).await;
    assert_eq!(output_of(&small_events, "stdout"), "survived");
    if f.provider.isolation().cgroups {
        assert_eq!(output_of(&big_events, "stdout"), "");
        assert_eq!(big_record.state, "killed");
        assert_eq!(big_record.body["signal"], "KILL");
    }
    f.provider.destroy(&local).await.unwrap();
}

/// On cgroup v2 (a fake unified hierarchy: plain files standing in for the kernel's) the
/// provider writes the grant to `memory.max` and `cpu.max`, reads back what those files hold
/// rather than what it granted, and advertises `cgroup: v2` with what is enforced.
#[tokio::test]
async fn on_v2_the_grant_is_read_back_from_the_kernel_files_and_advertised() {
    use super::super::cgroup::Layout;
    use super::super::cgroup::tests::{INSTANCE, fake_v2_chain};
    let mount = tempfile::tempdir().unwrap();
    let provider_dir = fake_v2_chain(mount.path(), "srv", "cpu memory pids");
    let cgroups = Cgroups::detect_in(&Layout::at(mount.path()), "0::/srv\n", "local", INSTANCE);
    let f = fixture_with_cgroups(cgroups).await;
    let report = f.provider.isolation_report();
    assert_eq!(report.cgroup, Some("v2"));
    assert_eq!(report.enforced, ["memory", "cpu", "pids", "freezer"]);
    assert_eq!(report.pids_max, Some(4096));

    let local = f.provider.allocate_local_id(IdKind::Sandbox);
    let granted = f
        .provider
        .create(&local, &res(0.3, 100), None)
        .await
        .unwrap();
    assert_eq!(granted, res(0.5, 128));
    let dir = provider_dir.join(&local);
    let read = |file: &str| std::fs::read_to_string(dir.join(file)).unwrap();
    assert_eq!(read("memory.max"), "134217728");
    assert_eq!(read("cpu.max"), "50000 100000");
    assert_eq!(read("pids.max"), "4096");
    assert_eq!(f.provider.read_resources(&local).await.unwrap(), granted);
    // The kernel's files, not the grant file, are the truth.
    std::fs::write(dir.join("memory.max"), "268435456\n").unwrap();
    std::fs::write(dir.join("cpu.max"), "200000 100000\n").unwrap();
    assert_eq!(
        f.provider.read_resources(&local).await.unwrap(),
        res(2.0, 256)
    );
    std::fs::write(dir.join("memory.max"), "max\n").unwrap();
    assert!(
        f.provider.read_resources(&local).await.is_err(),
        "no limit is no grant"
    );
}

#[tokio::test]
async fn without_cgroups_the_grant_file_is_read_back() {
    let f = fixture_with(Defects::none(), false, |_| {}).await;
    assert_eq!(
        f.provider.isolation(),
        Isolation {
            cgroups: false,
            freezer: false
        }
    );
    let local = f.provider.allocate_local_id(IdKind::Sandbox);
    assert_eq!(
        f.provider
            .create(&local, &res(1.1, 500), None)
            .await
            .unwrap(),
        res(1.25, 512)
    );
    let dir = f.provider.sandbox_dir(&local).unwrap();
    std::fs::write(dir.join("grant.json"), r#"{"cpu":2.0,"memory_mb":1024}"#).unwrap();
    assert_eq!(
        f.provider.read_resources(&local).await.unwrap(),
        res(2.0, 1024)
    );
    f.provider.destroy(&local).await.unwrap();
    assert!(!dir.exists());
}

#[tokio::test]
async fn unsatisfiable_requests_leave_nothing() {
    let f = fixture().await;
    let sandboxes = f.provider.base.join("sandboxes");
    for requested in [res(4.5, 512), res(1.0, 8193), res(100.0, 100_000)] {
        let local = f.provider.allocate_local_id(IdKind::Sandbox);
        let err = f
            .provider
            .create(&local, &requested, None)
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::Unsatisfiable(_)), "{err:?}");
        assert!(!f.provider.exists(&local));
        assert!(!lock(&f.provider.sandboxes).contains_key(&local));
    }
    assert_eq!(std::fs::read_dir(&sandboxes).unwrap().count(), 0);
}

#[tokio::test]
async fn output_is_captured_in_order_and_the_exit_comes_last() {
    let f = fixture().await;
    let local = f.sandbox().await;
    let script = "i=1; while [ $i -le 300 ]; do echo line$i; i=$((i+1)); done; echo oops >&2; printf 'caf\\303\\251'; exit 3";
    let id = f.start(&local, sh(script)).await;
    let (events, record) = f.wait_exit(&id).await;

    let expected: String = (1..=300).map(|i| format!("line{i}\n")).collect::<String>() + "café";
    assert_eq!(output_of(&events, "stdout"), expected);
    assert_eq!(output_of(&events, "stderr"), "oops\n");
    let last = events.last().unwrap();
    assert_eq!(last.kind, "exit");
    assert_eq!(events.iter().filter(|e| e.kind == "exit").count(), 1);
    assert_eq!(
        last.data,
        serde_json::json!({"state": "exited", "exit_code": 3, "signal": null})
    );
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as i64).collect::<Vec<_>>());

    assert_eq!(record.state, "exited");
    assert!(record.version > 1);
    let process: Process = serde_json::from_value(record.body.clone()).unwrap();
    assert_eq!(process.state, ProcessState::Exited);
    assert_eq!(process.exit_code, Some(3));
    assert_eq!(process.signal, None);
    let ended = process.ended_at.unwrap();
    assert_eq!(
        process.output_expires_at,
        Some(ended + Duration::from_secs(3600))
    );
    assert_eq!(record.due_at, process.output_expires_at);
    assert_eq!(record.body.get("truncated"), None);
    f.provider.destroy(&local).await.unwrap();
}

#[tokio::test]
async fn output_beyond_the_cap_is_dropped_and_marked() {
    let f = fixture_with(Defects::none(), true, |c| {
        c.limits.max_process_output_bytes = 1000
    })
    .await;
    let local = f.sandbox().await;
    // 5000 bytes on stdout and more on stderr; the process must still run to its end.
    let id = f.start(&local, sh("head -c 5000 /dev/zero | tr '\\0' a; head -c 3000 /dev/zero >&2; echo done > finished")).await;
    let (events, record) = f.wait_exit(&id).await;
    let kept = output_of(&events, "stdout").len() + output_of(&events, "stderr").len();
    assert_eq!(kept, 1000);
    assert_eq!(record.body["truncated"], Value::Bool(true));
    assert_eq!(record.state, "exited");
    assert!(f.root(&local).join("finished").is_file());
    f.provider.destroy(&local).await.unwrap();
}

#[tokio::test]
async fn stdin_round_trip_and_errors() {
    let f = fixture().await;
    let local = f.sandbox().await;
    let mut cat = spec(&["cat"]);
    cat.stdin = true;
    let id = f.start(&local, cat).await;
    f.provider.write_stdin(&id, b"hello ", false).await.unwrap();
    f.provider
        .write_stdin(&id, "wörld\n".as_bytes(), true)
        .await
        .unwrap();
    let (events, record) = f.wait_exit(&id).await;
    assert_eq!(output_of(&events, "stdout"), "hello wörld\n");
    assert_eq!(record.body["exit_code"], 0);
    assert!(matches!(
        f.provider.write_stdin(&id, b"late", false).await,
        Err(ProviderError::ProcessExited)
    ));

    let no_stdin = f.start(&local, spec(&["sleep", "1000"])).await;
    assert!(matches!(
        f.provider.write_stdin(&no_stdin, b"x", false).await,
        Err(ProviderError::NoStdin)
    ));
    assert!(matches!(
        f.provider
            .write_stdin("local:prc_unknown", b"x", false)
            .await,
        Err(ProviderError::NotFound)
    ));
    f.provider.destroy(&local).await.unwrap();
}

#[tokio::test]
async fn signals_reach_the_group_and_exited_processes_refuse_them() {
    let f = fixture().await;
    let local = f.sandbox().await;
    let id = f.start(&local, spec(&["sleep", "1000"])).await;
    // The bare local ID is accepted too.
    let bare = id.split_once(':').unwrap().1.to_owned();
    f.provider.signal(&bare, Signal::Term).unwrap();
    let (events, record) = f.wait_exit(&id).await;
    assert_eq!(
        events.last().unwrap().data,
        serde_json::json!({"state": "killed", "exit_code": null, "signal": "TERM"})
    );
    assert_eq!(record.state, "killed");
    assert_eq!(record.body["signal"], "TERM");
    assert_eq!(record.body["exit_code"], Value::Null);
    assert!(matches!(
        f.provider.signal(&id, Signal::Kill),
        Err(ProviderError::ProcessExited)
    ));

    let int = f.start(&local, spec(&["sleep", "1000"])).await;
    f.provider.signal(&int, Signal::Int).unwrap();
    assert_eq!(f.wait_exit(&int).await.1.body["signal"], "INT");
    f.provider.destroy(&local).await.unwrap();
}

/// A signal the server ignores (as one started in the background by a shell ignores SIGINT)
/// is not ignored by what a sandbox runs: its processes start with every default action.
/// SIGUSR2 stands in, since no test sends it.
#[tokio::test]
async fn processes_start_with_default_signal_actions_whatever_the_server_ignores() {
    let ignored = |status: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with("SigIgn:")).unwrap();
        u64::from_str_radix(line["SigIgn:".len()..].trim(), 16).unwrap()
    };
    let usr2 = 1u64 << (libc::SIGUSR2 - 1);
    /// Gives SIGUSR2 its default action back when the test ends, however it ends.
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: setting a disposition of this process, as the test did.
            unsafe { libc::signal(libc::SIGUSR2, libc::SIG_DFL) };
        }
    }
    // SAFETY: setting a disposition of this process; nothing here handles SIGUSR2.
    unsafe { libc::signal(libc::SIGUSR2, libc::SIG_IGN) };
    let _restore = Restore;
    let own = std::fs::read_to_string("/proc/self/status").unwrap();
    assert_ne!(ignored(&own) & usr2, 0, "the test ignores SIGUSR2");
    let f = fixture().await;
    let local = f.sandbox().await;
    let id = f.start(&local, spec(&["cat", "/proc/self/status"])).await;
    let (events, _) = f.wait_exit(&id).await;
    let theirs = output_of(&events, "stdout");
    // Signals 32 and 33 are the C library's own, which a program cannot change.
    assert_eq!(ignored(&theirs) & !(0b11 << 31), 0, "{theirs}");
    f.provider.destroy(&local).await.unwrap();
}

#[tokio::test]
async fn programs_that_cannot_run_are_refused_and_leave_nothing() {
    let f = fixture().await;
    let local = f.sandbox().await;
    std::fs::write(f.root(&local).join("not-executable"), "#!/bin/sh\n").unwrap();
    for program in ["no-such-program-anywhere", "./not-executable"] {
        let result = f
            .try_start(&local, spec(&[program]), &BTreeMap::new())
            .await;
        match result {
            Err(ProviderError::InvalidArgument { param, detail }) => {
                assert_eq!(param, "cmd");
                assert!(detail.contains(program), "{detail}");
            }
            other => panic!("{program}: {other:?}"),
        }
    }
    f.provider.destroy(&local).await.unwrap();
}

#[tokio::test]
async fn timeout_kills_the_whole_group() {
    let f = fixture().await;
    let local = f.sandbox().await;
    let mut slow = sh("sleep 1000 & echo $! > child.tmp && mv child.tmp child.pid; wait");
    slow.timeout_ms = Some(300);
    let started = Instant::now();
    let id = f.start(&local, slow).await;
    let (events, record) = f.wait_exit(&id).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(record.state, "killed");
    assert_eq!(events.last().unwrap().data["signal"], "KILL");
    let child: i32 = std::fs::read_to_string(f.root(&local).join("child.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    eventually("the background child to die", || {
        !f.host_pid(&local, child).is_some_and(alive)
    })
    .await;
    f.provider.destroy(&local).await.unwrap();
}

#[tokio::test]
async fn cwd_and_env() {
    let f = fixture().await;
    let local = f.sandbox().await;
    std::fs::create_dir_all(f.root(&local).join("sub/dir")).unwrap();
    std::os::unix::fs::symlink("/etc", f.root(&local).join("etc-link")).unwrap();
    let mut pwd = sh("pwd; echo $HOME; echo $A $B; echo $PATH");
    pwd.cwd = Some("sub/./dir".into());
    pwd.env = BTreeMap::from([("B".to_owned(), "from-process".to_owned())]);
    let sandbox_env = BTreeMap::from([
        ("A".to_owned(), "from-sandbox".to_owned()),
        ("B".to_owned(), "overridden".to_owned()),
    ]);
    let id = f.try_start(&local, pwd, &sandbox_env).await.unwrap();
    let (events, _) = f.wait_exit(&id).await;
    let root = if f.provider.isolation_report().uid.is_some() {
        PathBuf::from(super::isolation::HOME)
    } else {
        std::fs::canonicalize(f.root(&local)).unwrap()
    };
    let lines: Vec<String> = output_of(&events, "stdout")
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(lines[0], root.join("sub/dir").to_string_lossy());
    assert_eq!(lines[1], root.to_string_lossy());
    assert_eq!(lines[2], "from-sandbox from-process");
    assert!(lines[3].contains("/usr/bin"));

    for cwd in ["..", "../..", "/tmp", "etc-link"] {
        let mut escape = spec(&["true"]);
        escape.cwd = Some(cwd.into());
        let result = f.try_start(&local, escape, &BTreeMap::new()).await;
        assert!(
            matches!(result, Err(ProviderError::InvalidPath)),
            "cwd {cwd}: {result:?}"
        );
    }
    std::fs::write(f.root(&local).join("a-file"), "x").unwrap();
    for cwd in ["missing", "a-file", "sub/missing"] {
        let mut absent = spec(&["true"]);
        absent.cwd = Some(cwd.into());
        let result = f.try_start(&local, absent, &BTreeMap::new()).await;
        assert!(
            matches!(
                result,
                Err(ProviderError::InvalidArgument { param: "cwd", .. })
            ),
            "cwd {cwd}: {result:?}"
        );
    }
    f.provider.destroy(&local).await.unwrap();
}

/// A shell loop appending to a file, and a TCP service whose answer counts its connections.
async fn check_pause(f: &Fixture, expect_stopped: bool) {
    let local = f.sandbox().await;
    let root = f.root(&local);
    f.start(
        &local,
        sh("while :; do echo x >> counter; sleep 0.02; done"),
    )
    .await;
    let service = concat!(
        "use IO::Socket::INET; $s = IO::Socket::INET->new(Listen => 5, LocalAddr => '127.0.0.1', ",
        "LocalPort => 0, ReuseAddr => 1) or die $!; open(F, '>port.tmp'); print F $s->sockport; ",
        "close F; rename 'port.tmp', 'port'; $n = 0; ",
        "while ($c = $s->accept) { $n++; print $c \"$n\\n\"; close $c }"
    );
    f.start(&local, spec(&["perl", "-e", service])).await;
    eventually("the service port", || root.join("port").is_file()).await;
    let port: u16 = std::fs::read_to_string(root.join("port"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let ask = |conn: tokio::net::TcpStream| async move {
        let mut line = String::new();
        BufReader::new(conn)
            .read_line(&mut line)
            .await
            .map(|_| line)
    };
    let connect = || async {
        f.provider
            .connect(&local, port)
            .await
            .map_err(io::Error::other)
    };
    assert_eq!(ask(connect().await.unwrap()).await.unwrap(), "1\n");
    let size = || {
        std::fs::metadata(root.join("counter"))
            .map(|m| m.len())
            .unwrap_or(0)
    };
    eventually("the counter to start", || size() > 0).await;

    f.provider.pause(&local).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let paused_size = size();
    let waiting = connect().await.unwrap(); // the kernel completes the handshake
    let answer = tokio::time::timeout(Duration::from_millis(500), ask(waiting)).await;
    // At least as long as the counter needs for several appends, whatever the service did.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after_wait = size();
    if expect_stopped {
        assert_eq!(after_wait, paused_size, "the counter advanced while paused");
        assert!(answer.is_err(), "the paused service answered");
    } else {
        assert!(
            after_wait > paused_size,
            "the counter stopped although pause does nothing"
        );
        assert_eq!(answer.unwrap().unwrap(), "2\n");
    }

    f.provider.resume(&local).await.unwrap();
    eventually("the counter to continue", || size() > after_wait).await;
    let next = ask(connect().await.unwrap()).await.unwrap();
    // The service kept its memory: the connection made while paused was counted too.
    assert_eq!(next, "3\n");
    f.provider.destroy(&local).await.unwrap();
}

#[tokio::test]
async fn pause_stops_processes_and_resume_continues_them() {
    let f = fixture().await;
    check_pause(&f, true).await;
}

#[tokio::test]
async fn pause_without_cgroups_stops_the_process_groups() {
    let f = fixture_with(Defects::none(), false, |_| {}).await;
    check_pause(&f, true).await;
}

#[tokio::test]
async fn destroy_of_a_paused_sandbox_ends_its_processes() {
    for real_cgroups in [true, false] {
        let f = fixture_with(Defects::none(), real_cgroups, |_| {}).await;
        let local = f.sandbox().await;
        let id = f.start(&local, sh("sleep 1000 & exec sleep 1000")).await;
        let pid = f.pgid(&id);
        f.provider.pause(&local).await.unwrap();
        f.provider.destroy(&local).await.unwrap();
        assert!(!alive(pid), "cgroups {real_cgroups}");
        assert_eq!(f.events(&id).await.last().unwrap().data["signal"], "KILL");
        assert!(!f.provider.exists(&local));
    }
}

#[tokio::test]
async fn snapshot_clones_are_isolated_both_ways() {
    let f = fixture().await;
    let source = f.sandbox().await;
    let files = f.provider.files(&source).unwrap();
    files.write("shared.txt", b"original").unwrap();
    files.write("dir/nested.bin", &[0, 1, 2, 255]).unwrap();
    std::os::unix::fs::symlink("shared.txt", f.root(&source).join("link")).unwrap();
    let snap = f.provider.allocate_local_id(IdKind::Snapshot);
    f.provider.snapshot(&source, &snap).await.unwrap();

    let clone = f.provider.allocate_local_id(IdKind::Sandbox);
    f.provider
        .create(&clone, &res(1.0, 512), Some(&snap))
        .await
        .unwrap();
    let clone_files = f.provider.files(&clone).unwrap();
    assert_eq!(clone_files.read("shared.txt").unwrap(), b"original");
    assert_eq!(clone_files.read("dir/nested.bin").unwrap(), [0, 1, 2, 255]);
    assert_eq!(
        clone_files
            .list("")
            .unwrap()
            .iter()
            .find(|e| e.name == "link")
            .unwrap()
            .kind,
        "symlink"
    );

    // Writes through the files API and by processes stay on their side.
    clone_files
        .write("shared.txt", b"changed in clone")
        .unwrap();
    files.write("dir/nested.bin", b"changed in source").unwrap();
    let id = f
        .start(
            &clone,
            sh("echo appended >> shared.txt; echo new > only-clone.txt"),
        )
        .await;
    f.wait_exit(&id).await;
    assert_eq!(files.read("shared.txt").unwrap(), b"original");
    assert!(matches!(
        files.read("only-clone.txt"),
        Err(FileError::NotFound)
    ));
    assert_eq!(clone_files.read("dir/nested.bin").unwrap(), [0, 1, 2, 255]);

    // The snapshot outlives its source and can be deleted (idempotently).
    f.provider.destroy(&source).await.unwrap();
    let second = f.provider.allocate_local_id(IdKind::Sandbox);
    f.provider
        .create(&second, &res(1.0, 512), Some(&snap))
        .await
        .unwrap();
    assert_eq!(
        f.provider
            .files(&second)
            .unwrap()
            .read("shared.txt")
            .unwrap(),
        b"original"
    );
    f.provider.delete_snapshot(&snap).await.unwrap();
    f.provider.delete_snapshot(&snap).await.unwrap();
    let third = f.provider.allocate_local_id(IdKind::Sandbox);
    assert!(matches!(
        f.provider.create(&third, &res(1.0, 512), Some(&snap)).await,
        Err(ProviderError::NotFound)
    ));
    assert!(!f.provider.exists(&third));
    assert!(matches!(
        f.provider.snapshot("sbx_missing", "snp_x").await,
        Err(ProviderError::NotFound)
    ));
    f.provider.destroy(&clone).await.unwrap();
    f.provider.destroy(&second).await.unwrap();
}

#[tokio::test]
async fn files_of_a_sandbox_are_confined() {
    let f = fixture().await;
    let local = f.sandbox().await;
    let root = f.root(&local);
    std::os::unix::fs::symlink("/etc", root.join("etc-link")).unwrap();
    std::os::unix::fs::symlink("..", root.join("up")).unwrap();
    let files = f.provider.files(&local).unwrap();
    for path in [
        "../x",
        "/etc/passwd",
        "etc-link/passwd",
        "up/x",
        "up/grant.json",
    ] {
        assert!(
            matches!(files.read(path), Err(FileError::InvalidPath)),
            "read {path}"
        );
        assert!(
            matches!(files.write(path, b"x"), Err(FileError::InvalidPath)),
            "write {path}"
        );
    }
    let dir = f.provider.sandbox_dir(&local).unwrap();
    assert!(!dir.join("x").exists());
    assert!(!root.parent().unwrap().parent().unwrap().join("x").exists());
    assert!(matches!(
        f.provider.files("sbx_missing"),
        Err(ProviderError::NotFound)
    ));
    assert!(matches!(
        f.provider.files("../sandboxes"),
        Err(ProviderError::NotFound)
    ));
    f.provider.destroy(&local).await.unwrap();
}

#[tokio::test]
async fn queued_local_ids_come_first() {
    let f = fixture().await;
    f.provider
        .set_next_local_id(IdKind::Sandbox, "sbx_forced".into());
    assert!(
        f.provider
            .allocate_local_id(IdKind::Process)
            .starts_with("prc_")
    );
    assert_eq!(f.provider.allocate_local_id(IdKind::Sandbox), "sbx_forced");
    let fresh = f.provider.allocate_local_id(IdKind::Sandbox);
    assert!(fresh.starts_with("sbx_") && fresh != "sbx_forced" && fresh == fresh.to_lowercase());
}

#[tokio::test]
async fn create_delay_delays_create() {
    let f = fixture().await;
    f.provider.set_create_delay(Duration::from_millis(300));
    let started = Instant::now();
    let local = f.sandbox().await;
    assert!(started.elapsed() >= Duration::from_millis(300));
    f.provider.destroy(&local).await.unwrap();
}

#[tokio::test]
async fn shutdown_ends_every_process_and_cgroup() {
    let f = fixture().await;
    let a = f.sandbox().await;
    let b = f.sandbox().await;
    let pa = f.start(&a, spec(&["sleep", "1000"])).await;
    let pb = f.start(&b, spec(&["sleep", "1000"])).await;
    let pids = [f.pgid(&pa), f.pgid(&pb)];
    let cgroups: Vec<PathBuf> = [f.cgroup_paths(&a), f.cgroup_paths(&b)].concat();
    f.provider.shutdown().await;
    for pid in pids {
        assert!(!alive(pid));
    }
    for path in &cgroups {
        assert!(!path.exists());
        // The provider's and the instance's directories are gone too.
        assert!(!path.parent().unwrap().exists());
    }
    assert_eq!(f.events(&pa).await.last().unwrap().kind, "exit");
}

#[tokio::test]
async fn cgroups_of_a_crashed_instance_are_reaped_at_start() {
    let f = fixture().await;
    if !f.provider.isolation().cgroups {
        return;
    }
    let local = f.sandbox().await;
    // `.../sandspec/<instance>/local/<sandbox>` in each controller.
    let memory = f
        .cgroup_paths(&local)
        .into_iter()
        .find(|p| p.to_string_lossy().contains("/memory/"))
        .unwrap();
    let sandspec = memory.ancestors().nth(3).unwrap().to_owned();
    // PIDs are at most 2^22 on Linux, so this instance's server cannot exist.
    let namespace = super::super::cgroup::own_pid_namespace();
    assert_ne!(namespace, 0);
    // The test process's PID in the names keeps two runs of this binary at once apart.
    let run = std::process::id();
    let stale_instance = format!("99999999-{namespace}-crashed-{run}");
    let stale = sandspec
        .join(&stale_instance)
        .join("local")
        .join("sbx_left");
    // An instance of another PID namespace is not this server's to judge.
    let foreign = sandspec.join(format!("99999999-{}-elsewhere-{run}", namespace + 1));
    std::fs::create_dir_all(&foreign).unwrap();
    let orphan = std::process::Command::new("sleep")
        .arg("1000")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut orphan = KillOnDrop(orphan);
    // Providers that other tests start at the same time reap it too, even between the
    // creation of its parent and its own; set it up again until the process is in the stale
    // cgroup.
    let mut placed = false;
    for _ in 0..10_000 {
        if std::fs::create_dir_all(&stale).is_ok()
            && std::fs::write(stale.join("cgroup.procs"), orphan.0.id().to_string()).is_ok()
        {
            placed = true;
            break;
        }
        std::thread::yield_now();
    }
    assert!(
        placed,
        "the orphan could not be placed in {}",
        stale.display()
    );

    let other = fixture().await;
    assert!(other.provider.isolation().cgroups);
    let mut status = None;
    eventually("the orphan to be killed", || {
        status = orphan.0.try_wait().unwrap();
        status.is_some()
    })
    .await;
    let status = status.unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
    assert!(!sandspec.join(&stale_instance).exists());
    let foreign_kept = foreign.is_dir();
    let _ = std::fs::remove_dir(&foreign);
    assert!(foreign_kept);
    // The live instance was left alone.
    assert!(memory.is_dir());
    f.provider.destroy(&local).await.unwrap();
}

/// A child of the test process that must not outlive a failing test.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A process runs as the sandbox's `user` unless asked to run as its `root`, each with its
/// home; without namespaces of its own a sandbox has no root to run as.
#[tokio::test]
async fn a_process_runs_as_the_sandbox_user_or_as_its_root() {
    let f = fixture().await;
    let local = f.sandbox().await;
    let script = sh("echo $(id -u) $(whoami) $HOME $PWD");
    if f.provider.isolation_report().uid.is_none() {
        let refused = f
            .try_start_as(&local, script, &BTreeMap::new(), SandboxUser::Root)
            .await;
        assert!(
            matches!(
                refused,
                Err(ProviderError::InvalidArgument { param: "user", .. })
            ),
            "{refused:?}"
        );
        return;
    }
    for (user, want) in [
        (SandboxUser::User, "1000 user /home/user /home/user"),
        (SandboxUser::Root, "0 root /root /home/user"),
    ] {
        let id = f
            .try_start_as(&local, script.clone(), &BTreeMap::new(), user)
            .await
            .unwrap();
        let (events, record) = f.wait_exit(&id).await;
        assert_eq!(output_of(&events, "stdout").trim(), want, "{user:?}");
        assert_eq!(record.state, "exited");
    }
    f.provider.destroy(&local).await.unwrap();
}

/// Directories the server makes for the sandbox (a write's parents, `make_dir`, a move's
/// new parents) belong to the sandbox's user, as if it had made them: its processes can
/// create files in them. Those that were there keep their owner.
#[tokio::test]
async fn directories_the_server_makes_are_the_sandbox_users() {
    let f = fixture().await;
    let local = f.sandbox().await;
    let files = f.provider.files(&local).unwrap();
    assert!(files.make_dir("made/by/make_dir").unwrap());
    files.write("made/by/write/file.txt", b"x").unwrap();
    files.write("moved.txt", b"y").unwrap();
    files
        .rename("moved.txt", "made/by/rename/moved.txt")
        .unwrap();
    let script = sh(
        "for d in made/by/make_dir made/by/write made/by/rename made; do touch $d/mine || exit 1; done; echo ok",
    );
    let id = f
        .try_start_as(&local, script, &BTreeMap::new(), SandboxUser::User)
        .await
        .unwrap();
    let (events, record) = f.wait_exit(&id).await;
    assert_eq!(
        output_of(&events, "stdout").trim(),
        "ok",
        "stderr: {}",
        output_of(&events, "stderr")
    );
    assert_eq!(record.body["exit_code"], 0);
    f.provider.destroy(&local).await.unwrap();
}

/// Without a memory cgroup every process gets the sandbox's grant as its data limit (soft
/// and hard, so it cannot raise it): an allocation beyond it fails.
#[tokio::test]
async fn without_a_memory_cgroup_the_grant_is_each_processs_data_limit() {
    let f = fixture_with(Defects::none(), false, |_| {}).await;
    let report = f.provider.isolation_report();
    assert_eq!(report.enforced_by.get("memory"), Some(&"rlimit_data"));
    assert!(report.enforced.contains(&"memory"));
    let local = f.provider.allocate_local_id(IdKind::Sandbox);
    f.provider
        .create(&local, &res(1.0, 128), None)
        .await
        .unwrap();
    let id = f
        .start(
            &local,
            sh("ulimit -d; ulimit -H -d; ulimit -d unlimited 2>/dev/null || echo kept"),
        )
        .await;
    let (events, _) = f.wait_exit(&id).await;
    assert_eq!(output_of(&events, "stdout"), "131072\n131072\nkept\n");
    let id = f
        .start(
            &local,
            spec(&[
                "python3",
                "-c",
                "b = bytearray(256 * 1024 * 1024); print(len(b))",
            ]),
        )
        .await;
    let (events, record) = f.wait_exit(&id).await;
    assert_eq!(output_of(&events, "stdout"), "");
    assert!(output_of(&events, "stderr").contains("MemoryError"));
    assert_eq!(record.body["exit_code"], 1);
    f.provider.destroy(&local).await.unwrap();
}

#[cfg(feature = "defects")]
mod defects {
    use super::*;

    fn with(name: &str) -> Defects {
        Defects::parse([name]).unwrap()
    }

    #[tokio::test]
    async fn sandbox_memory_unenforced_leaves_the_data_limit_out() {
        let f = fixture_with(with("sandbox-memory-unenforced"), false, |_| {}).await;
        let local = f.sandbox().await;
        let id = f.start(&local, sh("ulimit -d")).await;
        let (events, _) = f.wait_exit(&id).await;
        assert_eq!(output_of(&events, "stdout"), "unlimited\n");
        f.provider.destroy(&local).await.unwrap();
    }

    #[tokio::test]
    async fn undersized_grant_halves_memory_in_the_readback() {
        let f = fixture_with(with("undersized-grant"), true, |_| {}).await;
        let local = f.provider.allocate_local_id(IdKind::Sandbox);
        let requested = res(1.0, 512);
        let granted = f.provider.create(&local, &requested, None).await.unwrap();
        assert_eq!(granted.memory_mb, 256);
        assert!(!granted.covers(&requested));
        assert_eq!(f.provider.read_resources(&local).await.unwrap(), granted);
        f.provider.destroy(&local).await.unwrap();
    }

    #[tokio::test]
    async fn pause_noop_keeps_processes_running() {
        let f = fixture_with(with("pause-noop"), true, |_| {}).await;
        check_pause(&f, false).await;
    }

    #[tokio::test]
    async fn clone_shares_files_leaks_writes_both_ways() {
        let f = fixture_with(with("clone-shares-files"), true, |_| {}).await;
        let source = f.sandbox().await;
        f.provider
            .files(&source)
            .unwrap()
            .write("shared.txt", b"original")
            .unwrap();
        let snap = f.provider.allocate_local_id(IdKind::Snapshot);
        f.provider.snapshot(&source, &snap).await.unwrap();
        let clone = f.provider.allocate_local_id(IdKind::Sandbox);
        f.provider
            .create(&clone, &res(1.0, 512), Some(&snap))
            .await
            .unwrap();
        f.provider
            .files(&clone)
            .unwrap()
            .write("shared.txt", b"from clone")
            .unwrap();
        assert_eq!(
            f.provider
                .files(&source)
                .unwrap()
                .read("shared.txt")
                .unwrap(),
            b"from clone"
        );
        f.provider
            .files(&source)
            .unwrap()
            .write("new.txt", b"from source")
            .unwrap();
        assert_eq!(
            f.provider.files(&clone).unwrap().read("new.txt").unwrap(),
            b"from source"
        );
        // Destroying the clone removes only its link, not the source's files.
        f.provider.destroy(&clone).await.unwrap();
        assert_eq!(
            f.provider.files(&source).unwrap().read("new.txt").unwrap(),
            b"from source"
        );
        f.provider.destroy(&source).await.unwrap();
    }

    #[tokio::test]
    async fn symlink_escape_follows_links_out_of_the_root() {
        let f = fixture_with(with("symlink-escape"), true, |_| {}).await;
        let local = f.sandbox().await;
        std::os::unix::fs::symlink("..", f.root(&local).join("up")).unwrap();
        let files = f.provider.files(&local).unwrap();
        // The grant file lives next to the root, outside it.
        assert!(files.read("up/grant.json").is_ok());
        assert!(matches!(
            files.read("../grant.json"),
            Err(FileError::InvalidPath)
        ));
        f.provider.destroy(&local).await.unwrap();
    }
}

/// The server's own bookkeeping beside a sandbox's root is in place before the first process
/// runs: what that process sees of its parent is what the parent holds once it has been
/// recorded, so a check from inside the sandbox that nothing changed there can rely on it.
/// With namespaces the parent is the sandbox's own root, where none of it shows.
#[tokio::test]
async fn the_first_process_sees_the_parent_as_it_stays() {
    let f = fixture_with(Defects::none(), false, |_| {}).await;
    let local = f.sandbox().await;
    let dir = f.provider.sandbox_dir(&local).unwrap();
    assert!(dir.join("procs").is_dir(), "made with the sandbox");
    let id = f.start(&local, sh("ls -A ..")).await;
    let (events, _) = f.wait_exit(&id).await;
    let seen: Vec<String> = output_of(&events, "stdout")
        .lines()
        .map(str::to_owned)
        .collect();
    let mut held: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    held.sort();
    if f.provider.isolation_report().uid.is_some() {
        // In namespaces of its own the sandbox's `..` is its own `/home`: the bookkeeping
        // is not in view at all.
        assert_eq!(seen, ["user"]);
    } else {
        assert!(seen.contains(&"procs".to_owned()), "seen: {seen:?}");
        assert_eq!(seen, held);
    }
    f.provider.destroy(&local).await.unwrap();
}

/// The output and the end of a process reach a store that was locked when they came: a SQLite
/// file whose write lock another connection holds for longer than the store's busy timeout
/// (10 s) twice over, so that the first writes give up. Once the lock is let go, the output is
/// in the log, the process is recorded exited and its log ends with `exit`.
#[tokio::test]
async fn a_process_that_ends_while_the_store_is_locked_is_recorded_once_it_is_free() {
    use sqlx::Connection as _;
    let tmp = tempfile::tempdir().unwrap();
    let config = Config::for_tests(tmp.path().join("data"));
    let file = tmp.path().join("store.db");
    let store: Arc<dyn Store> = Arc::new(SqliteStore::open(Some(&file)).await.unwrap());
    let log = EventLog::new(store.clone());
    let provider =
        LocalProvider::with_cgroups(&config.providers[0], &config, log, Cgroups::none()).unwrap();
    let f = Fixture {
        provider,
        store,
        _tmp: tmp,
    };
    let local = f.sandbox().await;
    let id = f.start(&local, sh("sleep 1; echo late")).await;
    let mut other = sqlx::SqliteConnection::connect(&format!("sqlite://{}", file.display()))
        .await
        .unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut other)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(23)).await;
    sqlx::query("COMMIT").execute(&mut other).await.unwrap();
    let (events, record) = f.wait_exit(&id).await;
    assert_eq!(output_of(&events, "stdout"), "late\n");
    assert_eq!(events.last().unwrap().kind, "exit");
    assert_eq!(record.state, "exited");
    f.provider.destroy(&local).await.unwrap();
}
