//! Real `sandspec serve` processes: a data directory has one server (a second one refuses,
//! naming the first), and a SIGKILLed server leaves no sandbox process behind (the PID
//! namespace ends with the holder whose pipe the server held).
//!
//! The second test needs sandbox isolation; it is skipped (with a message) on a machine
//! without it, unless `SANDSPEC_REQUIRE_ISOLATION=1`, which makes that a failure.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::process::{Child, Command};

use crate::support::http;
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
