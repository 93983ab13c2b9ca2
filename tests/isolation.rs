//! Real `sandspec serve` processes: a data directory has one server (a second one refuses,
//! naming the first), and a SIGKILLed server leaves no sandbox process behind (the PID
//! namespace ends with the holder whose socket the server held). The main job (`sandspec
//! run` against the embedded reference server) is conformant, isolation included, run as
//! root and run by an ordinary user the test makes (no system package needed); a kernel
//! without user namespaces has the isolation rows skipped with the server's reason and fix.
//!
//! The tests that need sandbox isolation are skipped (with a message) on a machine without
//! it, unless `SANDSPEC_REQUIRE_ISOLATION=1`, which makes that a failure.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::process::{Child, Command};

use crate::support::http;
use crate::support::receipt;
use crate::support::serve;

const ALICE: &str = "alice-isolation-token";

fn serve(data_dir: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandspec"));
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .args(["--principal", &format!("alice:{ALICE}")])
        .kill_on_drop(true);
    cmd
}

/// Starts a server and returns it with its base URL.
async fn start(data_dir: &Path) -> (Child, String) {
    let mut child = serve(data_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start sandspec serve");
    let base = serve::base_url(&mut child).await;
    (child, base)
}

#[tokio::test]
async fn a_second_server_on_one_data_dir_refuses_naming_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (first, _) = start(&data).await;
    let pid = first.id().expect("pid");
    let second = serve(&data)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .await
        .expect("run the second server");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "the second server started");
    assert!(
        stderr.contains(&format!(
            "is in use by another server (pid {pid}, listening on 127.0.0.1:"
        )),
        "stderr: {stderr}"
    );
    assert!(
        stderr.contains(&data.display().to_string()),
        "stderr: {stderr}"
    );
}

/// Host PIDs of processes whose command line contains `marker`.
fn processes_with(marker: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            (String::from_utf8_lossy(&cmdline).contains(marker) && runs(pid)).then_some(pid)
        })
        .collect()
}

/// Field `n` (1-based, as proc(5) counts them) of `/proc/<pid>/stat`, from field 3 on.
fn stat_field(pid: i32, n: usize) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    rest.split_whitespace().nth(n - 3)?.parse().ok()
}

/// Whether `pid` runs (a zombie waiting for its reaper runs nothing).
fn runs(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .is_some_and(|(_, r)| !r.starts_with('Z'))
    })
}

#[tokio::test]
async fn a_sigkilled_server_leaves_no_sandbox_process() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, base) = start(&dir.path().join("data")).await;
    let client = sandspec::target::build_client(None).unwrap();
    let caps = http::get_json(&client, &format!("{base}/v1/capabilities"), ALICE).await;
    let isolated = caps["isolation"]["namespaces"]
        .as_array()
        .is_some_and(|n| n.iter().any(|v| v == "pid"));
    if !isolated {
        let required = std::env::var("SANDSPEC_REQUIRE_ISOLATION").is_ok_and(|v| v == "1");
        assert!(!required, "isolation is required but unavailable: {caps}");
        eprintln!("skipped: no sandbox isolation here ({})", caps["isolation"]);
        return;
    }
    let sandbox =
        http::post_json(&client, &format!("{base}/v1/sandboxes"), ALICE, &json!({})).await;
    let id = sandbox["id"].as_str().unwrap();
    let marker = format!("iso-survivor-{}", std::process::id());
    // The process escapes its process group and its parent: only the PID namespace ends it.
    let started = client
        .post(format!("{base}/v1/sandboxes/{id}/processes"))
        .bearer_auth(ALICE)
        .json(&json!({"cmd": ["sh", "-c", "setsid sh -c 'sleep 600; :' \"$0\" & sleep 600", &marker]}))
        .send()
        .await
        .unwrap();
    assert_eq!(started.status(), 201);
    let deadline = Instant::now() + Duration::from_secs(30);
    while processes_with(&marker).len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the sandbox's processes did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The group leaders too: the process the server waited for is outside the sandbox's PID
    // namespace and has the server's command line, not the marker.
    let marked = processes_with(&marker);
    let leaders: Vec<i32> = marked
        .iter()
        .filter_map(|pid| stat_field(*pid, 5))
        .collect();
    assert!(
        leaders.iter().any(|l| !marked.contains(l) && runs(*l)),
        "the group leader the server waits for: {leaders:?}"
    );

    server.start_kill().unwrap();
    server.wait().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut left = processes_with(&marker);
        left.extend(leaders.iter().filter(|l| runs(**l)));
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "sandbox processes outlived the server: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether `SANDSPEC_REQUIRE_ISOLATION=1`: a machine without isolation fails, never skips.
fn isolation_required() -> bool {
    std::env::var("SANDSPEC_REQUIRE_ISOLATION").is_ok_and(|v| v == "1")
}

/// This process's effective uid.
fn euid() -> u32 {
    // SAFETY: geteuid(2) has no preconditions.
    unsafe { libc::geteuid() }
}

/// The main job's selection here: the isolation family and scenarios that reach into
/// sandboxes the ways isolation changes (processes and their signals, files seen from inside,
/// pause, previews through the sandbox's network, a session's worker inside the sandbox).
const MAIN_JOB: [&str; 8] = [
    "isolation",
    "SBX-LIFE-001",
    "SBX-PAUSE-002",
    "FILE-RW-002",
    "PRC-SIGNAL",
    "AUTH-PREVIEW-001",
    "SES-ART-001",
    "SES-UPLOAD-001",
];

/// Copies a directory tree (files and directories), readable by everyone.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755)).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
    }
}

/// A copy of the `sandspec` binary and of the catalog in a directory every user can read
/// (the checkout may be in a home directory only its owner may enter).
fn readable_copy(dir: &Path) -> (PathBuf, PathBuf) {
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let binary = dir.join("sandspec");
    std::fs::copy(env!("CARGO_BIN_EXE_sandspec"), &binary).unwrap();
    std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
    let scenarios = dir.join("scenarios");
    copy_tree(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios"),
        &scenarios,
    );
    (binary, scenarios)
}

/// Runs the main job with `binary` over `scenarios` into `out`, as `user` (uid, gid) when
/// given; returns its exit code and output.
async fn main_job(
    binary: &Path,
    scenarios: &Path,
    out: &Path,
    home: &Path,
    user: Option<(u32, u32)>,
) -> (Option<i32>, String) {
    let mut cmd = Command::new(binary);
    cmd.arg("run")
        .arg("--scenarios")
        .arg(scenarios)
        .arg("--out")
        .arg(out)
        .current_dir(home)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", home)
        .kill_on_drop(true);
    for filter in MAIN_JOB {
        cmd.arg("--filter").arg(filter);
    }
    if isolation_required() {
        cmd.env("SANDSPEC_REQUIRE_ISOLATION", "1");
    }
    if let Some((uid, gid)) = user {
        // std drops root's supplementary groups before it changes the uid.
        cmd.uid(uid).gid(gid);
    }
    let output = tokio::time::timeout(Duration::from_secs(600), async {
        loop {
            match cmd.output().await {
                // The copy was just written: a process another test forked meanwhile may
                // still hold it open for writing until it execs (ETXTBSY).
                Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => break other,
            }
        }
    })
    .await
    .expect("the main job finished within 10 minutes")
    .expect("run sandspec");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.code(), text)
}

/// Asserts that a main job ended conformant with every isolation scenario run and passed.
fn assert_conformant(code: Option<i32>, text: &str, out: &Path) {
    assert_eq!(code, Some(0), "the main job:\n{text}");
    assert!(text.contains("all: conformant"), "{text}");
    let report = receipt::predicate(out);
    assert_eq!(receipt::verdict(&report), "conformant");
    let scenarios = receipt::scenarios(&report);
    let isolation: Vec<&Value> = scenarios
        .iter()
        .filter(|s| s["family"] == "isolation")
        .collect();
    assert_eq!(isolation.len(), 4, "{text}");
    for s in scenarios {
        assert_eq!(s["outcome"], "pass", "{}: {s}", s["id"]);
    }
    assert!(scenarios.len() > 8, "{} scenarios ran", scenarios.len());
}

#[tokio::test]
async fn the_main_job_as_root_is_conformant_with_isolation() {
    if euid() != 0 {
        eprintln!("skipped: the main job as root needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (binary, scenarios) = readable_copy(dir.path());
    let out = dir.path().join("out");
    let (code, text) = main_job(&binary, &scenarios, &out, dir.path(), None).await;
    assert_conformant(code, &text, &out);
}

/// The ordinary user the unprivileged main job runs as: made here when the test runs as root
/// (kept for the next run), else the user running the test.
fn ordinary_user() -> (u32, u32) {
    const NAME: &str = "sandspec-unpriv";
    if euid() != 0 {
        // SAFETY: getegid(2) has no preconditions.
        return (euid(), unsafe { libc::getegid() });
    }
    let id = |flag: &str| -> Option<u32> {
        let out = std::process::Command::new("id")
            .args([flag, NAME])
            .output()
            .ok()?;
        String::from_utf8(out.stdout).ok()?.trim().parse().ok()
    };
    if id("-u").is_none() {
        let made = std::process::Command::new("useradd")
            .args([
                "--no-create-home",
                "--shell",
                "/bin/sh",
                "--user-group",
                NAME,
            ])
            .status()
            .expect("useradd (the passwd package) makes the test's ordinary user");
        // Another test process may have made it meanwhile.
        assert!(
            made.success() || id("-u").is_some(),
            "useradd {NAME}: {made}"
        );
    }
    (id("-u").unwrap(), id("-g").unwrap())
}

/// Host PIDs of processes whose real uid is `uid`.
fn processes_of(uid: u32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let status = std::fs::read_to_string(e.path().join("status")).ok()?;
            let real = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
            (real.split_whitespace().next()?.parse::<u32>().ok()? == uid && runs(pid))
                .then_some(pid)
        })
        .collect()
}

#[tokio::test]
async fn the_main_job_as_an_ordinary_user_is_conformant_with_isolation() {
    let (uid, gid) = ordinary_user();
    let dir = tempfile::tempdir().unwrap();
    let (binary, scenarios) = readable_copy(dir.path());
    let home = dir.path().join("home");
    std::fs::create_dir(&home).unwrap();
    std::os::unix::fs::chown(&home, Some(uid), Some(gid)).unwrap();
    let out = home.join("out");
    let user = (euid() == 0).then_some((uid, gid));
    let (code, text) = main_job(&binary, &scenarios, &out, &home, user).await;
    if code != Some(0) && !isolation_required() && text.contains("SKIP  ISO-") {
        eprintln!("skipped: no unprivileged sandbox isolation here:\n{text}");
        return;
    }
    assert_conformant(code, &text, &out);
    if user.is_some() {
        // Everything the run started as that user has ended with it.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !processes_of(uid).is_empty() {
            assert!(
                Instant::now() < deadline,
                "processes of uid {uid} outlived the run: {:?}",
                processes_of(uid)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Starts `sandspec serve` in a user namespace of its own in which no further user namespace
/// may be made (`user.max_user_namespaces` = 0 there), as on a kernel that allows none; on a
/// machine that has no user namespaces at all, plainly.
fn serve_without_user_namespaces(data_dir: &Path, alice: &str, bob: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandspec"));
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .args(["--principal", &format!("alice:{alice}")])
        .args(["--principal", &format!("bob:{bob}")])
        .env_remove("SANDSPEC_REQUIRE_ISOLATION")
        .env("RUST_LOG", "warn")
        .kill_on_drop(true);
    let maps = [
        ("/proc/self/setgroups\0", "deny".to_owned()),
        ("/proc/self/uid_map\0", format!("0 {} 1\n", euid())),
        // SAFETY: getegid(2) has no preconditions.
        (
            "/proc/self/gid_map\0",
            format!("0 {} 1\n", unsafe { libc::getegid() }),
        ),
        ("/proc/sys/user/max_user_namespaces\0", "0".to_owned()),
    ];
    // SAFETY: between fork and exec the closure makes only unshare(2), open(2), write(2) and
    // close(2) calls, on strings made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::unshare(libc::CLONE_NEWUSER) != 0 {
                // No user namespaces here at all: the server finds the same.
                return Ok(());
            }
            for (path, text) in &maps {
                let fd = libc::open(path.as_ptr().cast(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let written = libc::write(fd, text.as_ptr().cast(), text.len());
                libc::close(fd);
                if written < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    cmd
}

#[tokio::test]
async fn without_user_namespaces_the_isolation_rows_say_why_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let (alice, bob) = (
        format!("alice-nouserns-{}", std::process::id()),
        format!("bob-nouserns-{}", std::process::id()),
    );
    let mut server = serve_without_user_namespaces(&dir.path().join("data"), &alice, &bob)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sandspec serve");
    let stderr = server.stderr.take().unwrap();
    let base = serve::base_url(&mut server).await;
    let client = sandspec::target::build_client(None).unwrap();
    let caps = http::get_json(&client, &format!("{base}/v1/capabilities"), &alice).await;
    let iso = &caps["isolation"];
    assert_eq!(iso["namespaces"], json!([]), "{iso}");
    let why = iso["unavailable"].as_str().expect("the reason").to_owned();
    assert!(
        why.contains("fix: sysctl -w user.max_user_namespaces="),
        "{why}"
    );
    // The memory grant is still enforced, by a cgroup where one is writable, else per process.
    assert!(
        matches!(
            iso["enforced_by"]["memory"].as_str(),
            Some("cgroup_v1" | "cgroup_v2" | "rlimit_data")
        ),
        "{iso}"
    );

    let out = dir.path().join("out");
    let run = Command::new(env!("CARGO_BIN_EXE_sandspec"))
        .args(["run", "--target", &base])
        .args([
            "--owner-token-env",
            "NOUSERNS_OWNER",
            "--other-token-env",
            "NOUSERNS_OTHER",
        ])
        .args(["--profile", "isolation", "--out"])
        .arg(&out)
        .env("NOUSERNS_OWNER", &alice)
        .env("NOUSERNS_OTHER", &bob)
        .output()
        .await
        .expect("run sandspec");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(
        run.status.code(),
        Some(1),
        "a skipped MUST is partial:\n{text}"
    );
    let report = receipt::predicate(&out);
    // Not conformant: nothing of the family ran (how the verdict names that is the runner's).
    assert_ne!(receipt::verdict(&report), "conformant");
    let skipped = receipt::scenarios(&report);
    assert_eq!(skipped.len(), 4, "{text}");
    for s in skipped {
        assert_eq!(s["outcome"], "skip", "{s}");
        let reason = s["reason"].as_str().unwrap();
        assert_eq!(
            reason,
            format!("target does not advertise `isolation`: {why}"),
            "{}",
            s["id"]
        );
    }
    assert!(text.contains(&why), "the run shows the reason:\n{text}");

    server.start_kill().unwrap();
    server.wait().await.unwrap();
    let mut log = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut tokio::io::BufReader::new(stderr), &mut log)
        .await
        .unwrap();
    let said: Vec<&str> = log.lines().filter(|l| l.contains(&why)).collect();
    assert_eq!(said.len(), 1, "one line says why, with the fix:\n{log}");
    assert!(
        said[0].contains("sandboxes run without namespaces"),
        "{}",
        said[0]
    );
}
