//! The cgroup module: its parsing, formatting and decisions over fake cgroup trees in a
//! temporary directory (plain files standing in for the kernel's), and the v2 core files
//! (membership, freezer, `cgroup.kill`, removal) on this machine's real unified hierarchy.

use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::*;

pub(in crate::sandbox) const INSTANCE: &str = "fake-instance";

fn grant(cpu: f64, memory_mb: u64) -> Resources {
    Resources { cpu, memory_mb }
}

/// Makes `dir` a fake cgroup: `cgroup.procs` and each `(file, content)`.
fn fake_cgroup(dir: &Path, files: &[(&str, &str)]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("cgroup.procs"), "").unwrap();
    for (file, content) in files {
        std::fs::write(dir.join(file), content).unwrap();
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap().trim().to_owned()
}

/// A fake unified hierarchy at `mount` whose cgroups from the mount down to the provider
/// directory `local` offer `controllers`, each with the v2 core and limit files.
pub(in crate::sandbox) fn fake_v2_chain(mount: &Path, own: &str, controllers: &str) -> PathBuf {
    let own_dir = mount.join(own);
    let provider = own_dir.join("sandspec").join(INSTANCE).join("local");
    let v2_files = [
        ("cgroup.controllers", controllers),
        ("cgroup.subtree_control", ""),
        ("cgroup.freeze", "0"),
        ("cgroup.events", "populated 0\nfrozen 0\n"),
        ("memory.max", "max"),
        ("cpu.max", "max 100000"),
        ("pids.max", "max"),
    ];
    for dir in provider.ancestors().take_while(|p| p.starts_with(mount)) {
        fake_cgroup(dir, &v2_files);
    }
    provider
}

#[test]
fn the_layout_is_pure_v2_hybrid_or_v1() {
    let tmp = tempfile::tempdir().unwrap();

    let pure = tmp.path().join("pure");
    fake_cgroup(&pure, &[("cgroup.controllers", "cpu memory pids")]);
    let layout = Layout::at(&pure);
    assert_eq!(layout.kind(), "v2");
    assert_eq!(layout.v1, None);
    assert_eq!(layout.v2.as_deref(), Some(pure.as_path()));
    assert!(layout.v2_offers("memory") && layout.v2_offers("cpu") && layout.v2_offers("pids"));

    let hybrid = tmp.path().join("hybrid");
    fake_cgroup(&hybrid.join("memory"), &[("tasks", "")]);
    fake_cgroup(
        &hybrid.join("unified"),
        &[("cgroup.controllers", "hugetlb")],
    );
    let layout = Layout::at(&hybrid);
    assert_eq!(layout.kind(), "hybrid");
    assert_eq!(layout.v1.as_deref(), Some(hybrid.as_path()));
    assert_eq!(layout.v2.as_deref(), Some(hybrid.join("unified").as_path()));
    assert!(!layout.v2_offers("memory"), "memory is bound to v1 there");
    assert_eq!(layout.v1_hierarchy("memory"), Some(hybrid.join("memory")));
    assert_eq!(layout.v1_hierarchy("cpu"), None, "no cpu hierarchy there");

    let v1 = tmp.path().join("v1");
    fake_cgroup(&v1.join("memory"), &[("tasks", "")]);
    let layout = Layout::at(&v1);
    assert_eq!(layout.kind(), "v1");
    assert_eq!(layout.v2, None);

    // A v1 hierarchy (it has `tasks`) is never taken for the unified one.
    let odd = tmp.path().join("odd");
    fake_cgroup(&odd, &[("cgroup.controllers", "cpu"), ("tasks", "")]);
    assert_eq!(Layout::at(&odd).kind(), "v1");
}

#[test]
fn v2_files_are_parsed_and_formatted() {
    assert_eq!(parse_max("134217728\n"), Ok(Some(134_217_728)));
    assert_eq!(parse_max("max\n"), Ok(None));
    assert!(parse_max("lots").is_err());
    assert_eq!(parse_cpu_max("50000 100000\n"), Ok((Some(50_000), 100_000)));
    assert_eq!(parse_cpu_max("max 100000\n"), Ok((None, 100_000)));
    assert!(parse_cpu_max("50000").is_err());
    assert!(parse_cpu_max("50000 100000 7").is_err());
    assert!(parse_cpu_max("50000 often").is_err());
    assert_eq!(cpu_quota(0.5), 50_000);
    assert_eq!(cpu_quota(1.25), 125_000);
    assert_eq!(events_frozen("populated 1\nfrozen 1\n"), Some(true));
    assert_eq!(events_frozen("populated 1\nfrozen 0\n"), Some(false));
    assert_eq!(events_frozen("populated 1\n"), None);
    assert_eq!(
        parse_controllers("cpuset cpu io memory hugetlb pids rdma\n"),
        ["cpu", "memory", "pids"]
    );
    assert_eq!(parse_controllers("+pids +cpu"), ["cpu", "pids"]);
    assert!(parse_controllers("hugetlb\n").is_empty());
    assert_eq!(subtree_control_line(&["cpu", "pids"]), "+cpu +pids");
    assert_eq!(
        parse_own_cgroups("4:memory:/a/b\n0::/srv/server\n"),
        [
            ("memory".to_owned(), "/a/b".to_owned()),
            (String::new(), "/srv/server".to_owned())
        ]
    );
}

#[tokio::test]
async fn on_pure_v2_limits_are_written_enabled_and_read_back_from_one_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let mount = tmp.path();
    let provider = fake_v2_chain(mount, "srv/server", "cpu io memory pids");
    std::fs::write(provider.parent().unwrap().join("unrelated"), "").unwrap();
    let layout = Layout::at(mount);
    let cgroups = Cgroups::detect_in(&layout, "0::/srv/server\n", "local", INSTANCE);

    assert!(cgroups.enforces_limits() && cgroups.has_freezer());
    assert_eq!(cgroups.version(), Some("v2"));
    assert_eq!(cgroups.enforced(), ["memory", "cpu", "pids", "freezer"]);
    // Enabled from the server's own cgroup down to the provider's (the parent of sandboxes).
    for dir in provider.ancestors().take(4) {
        assert_eq!(
            read(&dir.join("cgroup.subtree_control")),
            "+cpu +memory +pids",
            "{}",
            dir.display()
        );
    }
    assert_eq!(read(&mount.join("srv/cgroup.subtree_control")), "");

    // `create` makes the sandbox's directory, which the kernel would fill with its files;
    // here the optional swap file appears only when the test writes it.
    let sandbox = provider.join("sbx_1");
    let swap = sandbox.join("memory.swap.max");
    let cg = cgroups.create("sbx_1", &grant(0.5, 128)).unwrap().unwrap();
    assert_eq!(
        cg.paths(),
        vec![sandbox.clone()],
        "one directory for every controller"
    );
    assert!(
        !swap.exists(),
        "memory.swap.max is written only where the kernel has it"
    );
    std::fs::write(&swap, "max").unwrap();
    cg.write_limits(&grant(0.5, 128)).unwrap();
    assert_eq!(read(&sandbox.join("memory.max")), "134217728");
    assert_eq!(read(&swap), "0");
    assert_eq!(read(&sandbox.join("cpu.max")), "50000 100000");
    assert_eq!(read(&sandbox.join("pids.max")), "4096");
    assert_eq!(cg.read_resources().unwrap(), Some(grant(0.5, 128)));
    assert_eq!(
        cg.procs_files(false),
        [CString::new(sandbox.join("cgroup.procs").as_os_str().as_bytes()).unwrap()]
    );

    // What the kernel holds is what is read back, not what was granted.
    std::fs::write(sandbox.join("cpu.max"), "150000 100000\n").unwrap();
    std::fs::write(sandbox.join("memory.max"), "268435456\n").unwrap();
    assert_eq!(cg.read_resources().unwrap(), Some(grant(1.5, 256)));
    std::fs::write(sandbox.join("memory.max"), "max\n").unwrap();
    let e = cg.read_resources().unwrap_err();
    assert!(e.to_string().contains("memory is not limited"), "{e}");
    std::fs::write(sandbox.join("memory.max"), "268435456\n").unwrap();
    std::fs::write(sandbox.join("cpu.max"), "max 100000\n").unwrap();
    let e = cg.read_resources().unwrap_err();
    assert!(e.to_string().contains("cpu quota is not limited"), "{e}");

    // A second sandbox of the same local ID is refused: the directory is someone else's.
    assert!(cgroups.create("sbx_1", &grant(0.5, 128)).is_err());
    assert!(
        sandbox.is_dir(),
        "a refused create leaves the existing directory alone"
    );
}

#[tokio::test]
async fn v2_freeze_waits_for_the_kernel_to_report_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sbx");
    fake_cgroup(
        &dir,
        &[("cgroup.freeze", "0"), ("cgroup.events", "frozen 1\n")],
    );
    let ctl = Ctl {
        version: Version::V2,
        dir: dir.clone(),
    };
    let cg = SandboxCgroup {
        memory: None,
        cpu: None,
        pids: None,
        freezer: Some(ctl.clone()),
        dirs: vec![ctl],
    };
    assert!(cg.freeze().await.unwrap());
    assert_eq!(read(&dir.join("cgroup.freeze")), "1");
    // Thawing writes 0 but the (fake) kernel never reports `frozen 0`: an error, in time.
    let start = Instant::now();
    let e = cg.thaw().await.unwrap_err();
    assert!(e.to_string().contains("did not reach frozen 0"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(10));
    assert_eq!(read(&dir.join("cgroup.freeze")), "0");
    std::fs::write(dir.join("cgroup.events"), "populated 1\nfrozen 0\n").unwrap();
    assert!(cg.thaw().await.unwrap());
}

#[test]
fn where_the_server_cgroup_refuses_to_delegate_only_the_freezer_is_used() {
    let tmp = tempfile::tempdir().unwrap();
    let mount = tmp.path();
    fake_v2_chain(mount, "srv", "cpu memory pids");
    // A write the kernel refuses (EBUSY: the server's own cgroup has processes), here made
    // to fail by a directory in the file's place.
    let control = mount.join("srv/cgroup.subtree_control");
    std::fs::remove_file(&control).unwrap();
    std::fs::create_dir(&control).unwrap();
    let cgroups = Cgroups::detect_in(&Layout::at(mount), "0::/srv\n", "local", INSTANCE);
    assert!(!cgroups.enforces_limits());
    assert!(cgroups.has_freezer());
    assert_eq!(cgroups.version(), Some("v2"));
    assert_eq!(cgroups.enforced(), ["freezer"]);
    let cg = cgroups.create("sbx_1", &grant(0.5, 128)).unwrap().unwrap();
    assert_eq!(cg.read_resources().unwrap(), None, "no limit is read back");
    let sandbox = mount
        .join("srv/sandspec")
        .join(INSTANCE)
        .join("local/sbx_1");
    assert!(!sandbox.join("memory.max").exists(), "no limit is written");
}

/// An ordinary user's server alone in its v2 cgroup (a delegated scope) moves into a leaf
/// below it, so that its cgroup can delegate the controllers; a later provider of the same
/// server, which then finds itself in that leaf, works from the same cgroup.
#[test]
fn a_server_alone_in_its_delegated_cgroup_moves_into_a_leaf() {
    let tmp = tempfile::tempdir().unwrap();
    let mount = tmp.path();
    let scope = "user.slice/user@1000.service/app.slice/run.scope";
    fake_v2_chain(mount, scope, "cpu memory pids");
    let pid = std::process::id();
    std::fs::write(mount.join(scope).join("cgroup.procs"), format!("{pid}\n")).unwrap();
    let own = format!("0::/{scope}\n");
    let layout = Layout::at(mount);
    let cgroups = Cgroups::detect_moving(&layout, &own, "local", INSTANCE, Some(pid));
    let leaf = mount
        .join(scope)
        .join("sandspec")
        .join(server_leaf(pid, own_pid_namespace()));
    assert_eq!(read(&leaf.join("cgroup.procs")), pid.to_string());
    assert!(cgroups.enforces_limits());
    assert_eq!(
        cgroups.enforced_by().get("memory").copied(),
        Some("cgroup_v2")
    );

    let second = mount
        .join(scope)
        .join("sandspec")
        .join(INSTANCE)
        .join("local-b");
    fake_cgroup(
        &second,
        &[
            ("cgroup.controllers", "cpu memory pids"),
            ("cgroup.subtree_control", ""),
            ("cgroup.freeze", "0"),
            ("memory.max", "max"),
            ("cpu.max", "max 100000"),
            ("pids.max", "max"),
        ],
    );
    let in_leaf = format!(
        "0::/{scope}/sandspec/{}\n",
        server_leaf(pid, own_pid_namespace())
    );
    let b = Cgroups::detect_moving(&layout, &in_leaf, "local-b", INSTANCE, Some(pid));
    assert!(b.enforces_limits());
    assert_eq!(b.provider_dirs(), [&second]);
}

/// The server stays where it is when it shares its cgroup with another process, when its
/// cgroup is the hierarchy's root, and as root.
#[test]
fn a_server_with_company_or_at_the_root_does_not_move() {
    let tmp = tempfile::tempdir().unwrap();
    let mount = tmp.path();
    fake_v2_chain(mount, "session.scope", "cpu memory pids");
    let pid = std::process::id();
    std::fs::write(
        mount.join("session.scope/cgroup.procs"),
        format!("{pid}\n1\n"),
    )
    .unwrap();
    let leaves = |dir: &Path| -> Vec<String> {
        std::fs::read_dir(dir.join("sandspec"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.ends_with("-server"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let layout = Layout::at(mount);
    Cgroups::detect_moving(&layout, "0::/session.scope\n", "local", INSTANCE, Some(pid));
    assert_eq!(leaves(&mount.join("session.scope")), Vec::<String>::new());

    std::fs::write(mount.join("session.scope/cgroup.procs"), format!("{pid}\n")).unwrap();
    Cgroups::detect_moving(&layout, "0::/session.scope\n", "local", INSTANCE, None);
    assert_eq!(leaves(&mount.join("session.scope")), Vec::<String>::new());

    let root = tempfile::tempdir().unwrap();
    fake_v2_chain(root.path(), "", "cpu memory pids");
    std::fs::write(root.path().join("cgroup.procs"), format!("{pid}\n")).unwrap();
    Cgroups::detect_moving(
        &Layout::at(root.path()),
        "0::/\n",
        "local",
        INSTANCE,
        Some(pid),
    );
    assert_eq!(leaves(root.path()), Vec::<String>::new());
}

#[test]
fn on_hybrid_each_controller_comes_from_the_hierarchy_holding_it() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let v1_provider = |controller: &str, files: &[(&str, &str)]| {
        let mount = root.join(controller);
        fake_cgroup(&mount, &[("tasks", "")]);
        let dir = mount.join("sandspec").join(INSTANCE).join("local");
        for d in dir.ancestors().take(3) {
            fake_cgroup(d, files);
        }
    };
    v1_provider("memory", &[("memory.limit_in_bytes", "")]);
    v1_provider(
        "cpu",
        &[("cpu.cfs_quota_us", "-1"), ("cpu.cfs_period_us", "")],
    );
    v1_provider("pids", &[("pids.max", "max")]);
    v1_provider("freezer", &[("freezer.state", "THAWED")]);
    let unified = root.join("unified");
    fake_v2_chain(&unified, "", "hugetlb");
    let own = "4:memory:/\n1:cpu:/\n8:pids:/\n6:freezer:/\n0::/\n";

    // This machine's layout: every controller bound to v1, the unified hierarchy unused.
    let cgroups = Cgroups::detect_in(&Layout::at(root), own, "local", INSTANCE);
    assert_eq!(cgroups.version(), Some("v1"));
    assert_eq!(cgroups.enforced(), ["memory", "cpu", "pids", "freezer"]);
    assert_eq!(read(&unified.join("cgroup.subtree_control")), "");
    let cg = cgroups.create("sbx_1", &grant(0.25, 64)).unwrap().unwrap();
    assert_eq!(cg.paths().len(), 4);
    assert!(cg.paths().iter().all(|p| !p.starts_with(&unified)));
    assert_eq!(
        read(
            &root
                .join("memory/sandspec")
                .join(INSTANCE)
                .join("local/sbx_1/memory.limit_in_bytes")
        ),
        "67108864"
    );
    assert_eq!(cg.read_resources().unwrap(), Some(grant(0.25, 64)));

    // cpu and pids on v2 only, memory and the freezer on v1: limits from both.
    std::fs::remove_dir_all(root.join("cpu")).unwrap();
    std::fs::remove_dir_all(root.join("pids")).unwrap();
    std::fs::remove_dir_all(&unified).unwrap();
    fake_v2_chain(&unified, "", "cpu pids hugetlb");
    v1_provider("memory", &[("memory.limit_in_bytes", "")]);
    v1_provider("freezer", &[("freezer.state", "THAWED")]);
    let cgroups = Cgroups::detect_in(&Layout::at(root), own, "local", INSTANCE);
    assert_eq!(cgroups.version(), Some("hybrid"));
    assert_eq!(cgroups.enforced(), ["memory", "cpu", "pids", "freezer"]);
    assert_eq!(read(&unified.join("cgroup.subtree_control")), "+cpu +pids");
    let cg = cgroups.create("sbx_2", &grant(1.0, 128)).unwrap().unwrap();
    let v2_sandbox = unified.join("sandspec").join(INSTANCE).join("local/sbx_2");
    assert_eq!(read(&v2_sandbox.join("cpu.max")), "100000 100000");
    assert_eq!(read(&v2_sandbox.join("pids.max")), "4096");
    assert!(!v2_sandbox.join("memory.max").exists(), "memory is v1's");
    assert_eq!(cg.paths().len(), 3, "memory, the unified one, freezer");
    assert_eq!(cg.read_resources().unwrap(), Some(grant(1.0, 128)));
    // Without the memory controller's directory with the defect, the others are still joined.
    assert_eq!(cg.procs_files(true).len(), 2);
}

/// A sandbox cgroup whose processes are killed and directory removed however the test ends.
struct Teardown(SandboxCgroup);

impl std::ops::Deref for Teardown {
    type Target = SandboxCgroup;
    fn deref(&self) -> &SandboxCgroup {
        &self.0
    }
}

impl Drop for Teardown {
    fn drop(&mut self) {
        self.0.remove_now();
    }
}

/// A child process killed and reaped however the test ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `script` with `sh` inside the sandbox cgroup (joined between fork and exec, as the
/// provider's processes do).
fn spawn_in(cg: &SandboxCgroup, script: &str) -> std::process::Child {
    use std::os::unix::process::CommandExt as _;
    let procs = cg.procs_files(false);
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", script]).stdin(std::process::Stdio::null());
    // SAFETY: only open/write/close between fork and exec, on paths allocated before.
    unsafe {
        cmd.pre_exec(move || {
            for path in &procs {
                crate::sandbox::process::join_cgroup(path)?;
            }
            Ok(())
        });
    }
    cmd.spawn().unwrap()
}

/// How far a counting process got: the length of the file it appends to (which only grows,
/// so no read sees it half rewritten).
fn counter(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// Whether `pid` has ended (gone, or a zombie nobody reaped yet).
fn ended(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

/// The real unified hierarchy: a sandbox cgroup with real processes in it that freeze stops
/// and thaw continues, `cgroup.kill` ends them all (a child that left its process group too),
/// and the directories are removed. The v2 controllers themselves (memory, cpu, pids) are
/// used when the machine binds them to v2; where they are bound to v1 only the core files
/// are tested here.
#[tokio::test]
async fn the_unified_hierarchy_freezes_kills_and_removes_real_processes() {
    let Some(mount) = Layout::detect().v2 else {
        assert!(
            std::env::var("SANDSPEC_REQUIRE_ISOLATION").as_deref() != Ok("1"),
            "isolation is required but this machine has no cgroup2 mount"
        );
        eprintln!("skipped: no cgroup2 mount below /sys/fs/cgroup");
        return;
    };
    // The unified hierarchy alone, as on a pure v2 machine.
    let layout = Layout {
        v1: None,
        v2: Some(mount.clone()),
    };
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let instance = format!(
        "{}-{}-{}",
        std::process::id(),
        own_pid_namespace(),
        ulid::Ulid::new().to_string().to_lowercase()
    );
    let cgroups = Cgroups::detect_in(&layout, &own, "v2test", &instance);
    if !cgroups.has_freezer() {
        // Every non-root v2 cgroup has `cgroup.freeze`: none means none could be made.
        assert!(
            std::env::var("SANDSPEC_REQUIRE_ISOLATION").as_deref() != Ok("1"),
            "isolation is required but no cgroup could be made below {}",
            mount.display()
        );
        eprintln!("skipped: no cgroup could be made below {}", mount.display());
        return;
    }
    assert_eq!(cgroups.version(), Some("v2"));
    let offered = controller_list(&mount.join("cgroup.controllers"));
    if offered.len() < 3 {
        assert!(!cgroups.enforces_limits(), "offered only {offered:?}");
        eprintln!("v2 limits not tested: the unified hierarchy offers only {offered:?}");
    }
    let cg = cgroups.create("sbx_v2", &grant(0.5, 128)).unwrap().unwrap();
    let cg = Teardown(cg);
    let dir = cg.paths()[0].clone();
    assert!(
        dir.starts_with(&mount) && dir.ends_with("v2test/sbx_v2"),
        "{}",
        dir.display()
    );
    if cgroups.enforces_limits() {
        assert_eq!(read(&dir.join("memory.max")), "134217728");
        assert_eq!(read(&dir.join("cpu.max")), "50000 100000");
        assert_eq!(cg.read_resources().unwrap(), Some(grant(0.5, 128)));
    } else {
        assert_eq!(cg.read_resources().unwrap(), None);
    }

    let tmp = tempfile::tempdir().unwrap();
    let count = tmp.path().join("count");
    let script = format!(
        "setsid sleep 1000 & i=0; while :; do i=$((i+1)); echo $i >> {} || exit 1; done",
        count.display()
    );
    let mut child = spawn_in(&cg, &script);
    let deadline = Instant::now() + Duration::from_secs(10);
    while (cg.tasks().len() < 2 || counter(&count) == 0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let tasks = cg.tasks();
    assert!(tasks.contains(&(child.id() as i32)), "{tasks:?}");
    assert!(
        tasks.len() >= 2,
        "the shell and its setsid sleep: {tasks:?}"
    );
    assert!(counter(&count) > 0);

    assert!(cg.freeze().await.unwrap());
    assert_eq!(read(&dir.join("cgroup.freeze")), "1");
    let frozen_at = counter(&count);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        counter(&count),
        frozen_at,
        "a frozen process went on counting"
    );

    assert!(cg.thaw().await.unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while counter(&count) == frozen_at && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        counter(&count) > frozen_at,
        "a thawed process did not go on"
    );

    // Frozen again, then `cgroup.kill` alone (no kill(2) of listed tasks) ends every task.
    assert!(cg.freeze().await.unwrap());
    std::fs::write(dir.join("cgroup.kill"), "1").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cg.tasks().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(cg.tasks(), Vec::<i32>::new(), "cgroup.kill left tasks");
    let status = child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
    for pid in tasks {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ended(pid) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(ended(pid), "task {pid} outlived cgroup.kill");
    }

    cg.kill_all().await;
    cg.remove().await.unwrap();
    assert!(!dir.exists(), "{} left behind", dir.display());
    cgroups.remove_provider_dirs();
    assert!(
        !dir.parent().unwrap().exists(),
        "the provider directory left behind"
    );
    assert!(
        !dir.parent().unwrap().parent().unwrap().exists(),
        "the instance directory left behind"
    );
}

/// `kill_all` on v2 ends a frozen sandbox's processes, and `remove_now` removes its
/// directory, on the real unified hierarchy.
#[tokio::test]
async fn kill_all_ends_a_frozen_v2_sandbox() {
    let Some(mount) = Layout::detect().v2 else {
        assert!(
            std::env::var("SANDSPEC_REQUIRE_ISOLATION").as_deref() != Ok("1"),
            "isolation is required but this machine has no cgroup2 mount"
        );
        eprintln!("skipped: no cgroup2 mount below /sys/fs/cgroup");
        return;
    };
    let layout = Layout {
        v1: None,
        v2: Some(mount),
    };
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let instance = format!(
        "{}-{}-{}",
        std::process::id(),
        own_pid_namespace(),
        ulid::Ulid::new().to_string().to_lowercase()
    );
    let cgroups = Cgroups::detect_in(&layout, &own, "v2kill", &instance);
    if !cgroups.has_freezer() {
        assert!(
            std::env::var("SANDSPEC_REQUIRE_ISOLATION").as_deref() != Ok("1"),
            "isolation is required but no cgroup could be made below the unified hierarchy"
        );
        eprintln!("skipped: no cgroup could be made below the unified hierarchy");
        return;
    }
    let cg = cgroups.create("sbx_k", &grant(0.25, 64)).unwrap().unwrap();
    let cg = Teardown(cg);
    let dir = cg.paths()[0].clone();
    let mut child = spawn_in(&cg, "sleep 1000 & sleep 1000 & wait");
    let deadline = Instant::now() + Duration::from_secs(10);
    while cg.tasks().len() < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(cg.tasks().len(), 3, "{:?}", cg.tasks());
    assert!(cg.freeze().await.unwrap());
    cg.kill_all().await;
    assert!(cg.tasks().is_empty());
    assert!(child.wait().unwrap().code().is_none(), "killed by a signal");
    cg.remove_now();
    assert!(!dir.exists());
    cgroups.remove_provider_dirs();
}

/// What a crashed server instance left below the real unified hierarchy (a sandbox cgroup
/// with a live process in it) is killed and removed when a provider starts; an instance of
/// another PID namespace is left alone.
#[tokio::test]
async fn stale_v2_cgroups_of_a_crashed_instance_are_reaped_at_start() {
    let Some(mount) = Layout::detect().v2 else {
        assert!(
            std::env::var("SANDSPEC_REQUIRE_ISOLATION").as_deref() != Ok("1"),
            "isolation is required but this machine has no cgroup2 mount"
        );
        eprintln!("skipped: no cgroup2 mount below /sys/fs/cgroup");
        return;
    };
    let layout = Layout {
        v1: None,
        v2: Some(mount.clone()),
    };
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let own_v2 = parse_own_cgroups(&own)
        .into_iter()
        .find(|(controllers, _)| controllers.is_empty())
        .map(|(_, path)| path)
        .unwrap_or_default();
    let sandspec = own_base(&mount, &own_v2).join("sandspec");
    let namespace = own_pid_namespace();
    assert_ne!(namespace, 0);
    // PIDs are at most 2^22 on Linux, so this instance's server cannot exist.
    let unique = ulid::Ulid::new().to_string().to_lowercase();
    let stale = sandspec
        .join(format!("99999999-{namespace}-{unique}"))
        .join("local")
        .join("sbx_left");
    let foreign = sandspec.join(format!("99999999-{}-{unique}", namespace + 1));
    if std::fs::create_dir_all(&foreign).is_err() {
        assert!(
            std::env::var("SANDSPEC_REQUIRE_ISOLATION").as_deref() != Ok("1"),
            "isolation is required but no cgroup could be made below {}",
            mount.display()
        );
        eprintln!("skipped: no cgroup could be made below {}", mount.display());
        return;
    }
    let orphan = std::process::Command::new("sleep")
        .arg("1000")
        .stdin(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut orphan = KillOnDrop(orphan);
    // Providers that other tests start meanwhile reap it too, even between the creation of
    // its parent and its own: set it up again until the process is in it.
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

    let instance = format!("{}-{namespace}-{unique}", std::process::id());
    let cgroups = Cgroups::detect_in(&layout, &own, "v2reap", &instance);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut status = None;
    while status.is_none() && Instant::now() < deadline {
        status = orphan.0.try_wait().unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = status.expect("the orphan in the stale cgroup was not killed");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
    assert!(!stale.exists(), "{} left behind", stale.display());
    assert!(!stale.parent().unwrap().parent().unwrap().exists());
    assert!(
        foreign.is_dir(),
        "another PID namespace's instance was touched"
    );
    std::fs::remove_dir(&foreign).unwrap();
    cgroups.remove_provider_dirs();
}
