//! `sandspec run` end to end through its argument parser, against a reference server started
//! here and named with `--target` (tokens in environment variables): a clean server is
//! conformant (exit 0) with a verified evidence folder written; a server with a defect is not
//! (exit 1) and the receipt names the failing scenario. Also `sandspec sweep`.

use crate::support::http;
use crate::support::owner;
use crate::support::receipt;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use sandspec::cli::{ListArgs, RunArgs};
use sandspec::target::{ReferenceOptions, ReferenceServer};

#[derive(Parser)]
struct Wrapper {
    #[command(flatten)]
    run: RunArgs,
}

/// A catalog of three scenarios of the real catalog, so the test does not move with it.
fn small_catalog(dir: &std::path::Path) -> PathBuf {
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let catalog = dir.join("catalog");
    for file in [
        "lifecycle/create-get-list-kill.yaml",
        "lifecycle/ttl-expiry-kills.yaml",
        "processes/stream-cut-and-resume.yaml",
    ] {
        let to = catalog.join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(source.join(file), to).unwrap();
    }
    catalog
}

async fn run_against(defects: &[&str], env_prefix: &str, out: &std::path::Path) -> ExitCode {
    let server = reference_with(defects).await;
    run_on(&server, env_prefix, out, &[]).await
}

async fn reference_with(defects: &[&str]) -> ReferenceServer {
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        defects: defects.iter().map(|d| (*d).to_owned()).collect(),
        ..ReferenceOptions::default()
    };
    ReferenceServer::start(&options).await.unwrap()
}

/// `sandspec run` of the small catalog against `server`, tokens in variables named after
/// `env_prefix`, evidence in `out`, with `extra` flags.
async fn run_on(
    server: &ReferenceServer,
    env_prefix: &str,
    out: &std::path::Path,
    extra: &[&str],
) -> ExitCode {
    let catalog = small_catalog(out.parent().unwrap());
    let owner = format!("{env_prefix}_OWNER");
    let other = format!("{env_prefix}_OTHER");
    let admin = format!("{env_prefix}_ADMIN");
    // SAFETY: this test binary sets each variable once, before any thread reads it, and
    // every variable name is unique to one call.
    unsafe {
        std::env::set_var(&owner, &server.tokens.owner);
        std::env::set_var(&other, &server.tokens.other);
        std::env::set_var(&admin, server.tokens.admin.as_deref().unwrap());
    }
    let catalog = catalog.display().to_string();
    let out = out.display().to_string();
    let mut argv = vec![
        "run",
        "--target",
        &server.url,
        "--owner-token-env",
        &owner,
        "--other-token-env",
        &other,
        "--admin-token-env",
        &admin,
        "--scenarios",
        &catalog,
        "--out",
        &out,
        "--jobs",
        "2",
    ];
    argv.extend_from_slice(extra);
    let args = Wrapper::try_parse_from(argv).unwrap();
    sandspec::commands::run(args.run).await
}

#[tokio::test]
async fn clean_server_is_conformant_and_a_defect_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let clean = dir.path().join("clean");
    let code = run_against(&[], "SANDSPEC_CLI_CLEAN", &clean).await;
    assert_eq!(code, ExitCode::from(0));
    assert_eq!(
        sandspec::evidence::verify_cli(&clean, None),
        0,
        "the folder verifies"
    );
    let report = receipt::predicate(&clean);
    assert_eq!(receipt::verdict(&report), "conformant");
    assert_eq!(receipt::scenarios(&report).len(), 3);
    // The whole catalog ran: no verdict is a subset.
    assert_eq!(report["selection"]["subset"], false);
    assert!(
        report["profiles"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["subset"] == false && p["selected"] == p["catalog"])
    );
    // The stream scenario recorded its measurements, and eventsource-client read its streams.
    let stream = receipt::scenario(&report, "PRC-STREAM-001");
    assert!(
        stream["measurements"]["process_stream_first_frame_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(
        stream["measurements"]["process_stream_eof_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    let transcript =
        std::fs::read_to_string(clean.join(stream["transcript"]["path"].as_str().unwrap()))
            .unwrap();
    if cfg!(feature = "interop") {
        assert!(
            transcript.contains("interop: eventsource-client read"),
            "{transcript}"
        );
    }
    let junit = std::fs::read_to_string(clean.join("junit.xml")).unwrap();
    assert!(
        junit.contains("<testcase classname=\"lifecycle\" name=\"SBX-LIFE-001"),
        "{junit}"
    );
    // Tokens never reach the evidence.
    let text = std::fs::read_to_string(clean.join("receipt.json")).unwrap() + &transcript;
    assert!(!text.contains("sst_"), "a token leaked into the evidence");

    let broken = dir.path().join("broken");
    let code = run_against(&["ttl-not-enforced"], "SANDSPEC_CLI_BROKEN", &broken).await;
    assert_eq!(code, ExitCode::from(1));
    let report = receipt::predicate(&broken);
    let failed: Vec<&str> = receipt::scenarios(&report)
        .iter()
        .filter(|s| s["outcome"] == "fail")
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(failed, vec!["SBX-LIFE-002"]);
}

/// A baseline of known failures gates the run: every failure expected passes the gate (exit
/// 0) while the verdict stays non-conformant; a failure the baseline lost, a stale entry, an
/// expired one and one listed at another step each fail it (exit 1). Every folder verifies:
/// `evidence verify` judges the gate again. JUnit reports the expected failure as skipped.
#[tokio::test]
async fn a_baseline_of_known_failures_gates_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let server = reference_with(&["ttl-not-enforced"]).await;
    let first = dir.path().join("first");
    assert_eq!(
        run_on(&server, "SANDSPEC_GATE_FIRST", &first, &[]).await,
        ExitCode::from(1)
    );
    let report = receipt::predicate(&first);
    let failed = receipt::scenario(&report, "SBX-LIFE-002");
    assert_eq!(failed["outcome"], "fail");
    let step = failed["failed_step"].as_str().unwrap().to_owned();
    let baseline = |name: &str, entries: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, entries).unwrap();
        path.display().to_string()
    };
    let known = format!(
        "- id: SBX-LIFE-002\n  step: {step:?}\n  reason: expiry is off\n  link: https://tracker.example/1\n  expires: 2999-12-31\n"
    );
    let cases = [
        (
            "expected",
            known.clone(),
            0,
            "pass (1 expected failure(s) of 1 listed)",
        ),
        (
            "removed",
            String::new(),
            1,
            "unexpected failure: SBX-LIFE-002",
        ),
        (
            "stale",
            format!("{known}- id: SBX-LIFE-001\n  reason: it used to fail\n"),
            1,
            "stale (passes now; remove it from the baseline): SBX-LIFE-001",
        ),
        (
            "expired",
            known.replace("2999-12-31", "2020-01-31"),
            1,
            "expired: SBX-LIFE-002",
        ),
        (
            "wrong-step",
            known.replace(&step, "steps[0] create"),
            1,
            "failed at another step than listed: SBX-LIFE-002",
        ),
    ];
    for (name, entries, code, gate) in cases {
        let file = baseline(&format!("{name}.yaml"), &entries);
        let out = dir.path().join(name);
        let junit = dir.path().join(format!("{name}.xml"));
        let got = run_on(
            &server,
            &format!("SANDSPEC_GATE_{}", name.to_uppercase().replace('-', "_")),
            &out,
            &[
                "--expected-failures",
                &file,
                "--junit",
                &junit.display().to_string(),
            ],
        )
        .await;
        assert_eq!(got, ExitCode::from(code), "{name}");
        let report = receipt::predicate(&out);
        assert_eq!(
            receipt::verdict(&report),
            "non-conformant",
            "{name}: the verdict stays"
        );
        let stated = &report["gate"];
        assert_eq!(
            stated["result"],
            if code == 0 { "pass" } else { "fail" },
            "{name}"
        );
        let line = if code == 0 {
            "pass (1 expected failure(s) of 1 listed)".to_owned()
        } else {
            stated["reasons"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r.as_str().unwrap())
                .collect::<Vec<_>>()
                .join("; ")
        };
        assert!(line.contains(gate), "{name}: {line}");
        assert_eq!(
            sandspec::evidence::verify_cli(&out, None),
            0,
            "{name}: verifies"
        );
        let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
        assert!(summary.contains("## Gate"), "{name}: {summary}");
        let junit = std::fs::read_to_string(&junit).unwrap();
        let expected_as_skipped = junit.contains("expected failure (expiry is off)");
        assert_eq!(
            expected_as_skipped,
            name == "expected" || name == "stale" || name == "expired",
            "{name}: {junit}"
        );
    }
    // A baseline that names no scenario of the catalog is a usage error, before anything runs.
    let bad = baseline("bad.yaml", "- id: NOPE-001\n  reason: r\n");
    let out = dir.path().join("bad");
    assert_eq!(
        run_on(
            &server,
            "SANDSPEC_GATE_BAD",
            &out,
            &["--expected-failures", &bad]
        )
        .await,
        ExitCode::from(2)
    );
    assert!(!out.exists(), "nothing ran");
}

/// Two real runs compared for a release review: a clean server, then one with a defect. The
/// diff names the regression (and, the other way round, the fix), writes JSON beside the
/// Markdown, and refuses a folder that does not verify.
#[tokio::test]
async fn evidence_diff_names_a_regression_and_a_fix() {
    let dir = tempfile::tempdir().unwrap();
    let clean = dir.path().join("clean");
    let broken = dir.path().join("broken");
    assert_eq!(
        run_against(&[], "SANDSPEC_DIFF_CLEAN", &clean).await,
        ExitCode::from(0)
    );
    assert_eq!(
        run_against(&["ttl-not-enforced"], "SANDSPEC_DIFF_BROKEN", &broken).await,
        ExitCode::from(1)
    );
    let json = dir.path().join("diff.json");
    let md = dir.path().join("diff.md");
    assert_eq!(
        sandspec::commands::diff(&clean, &broken, Some(&json), Some(&md)),
        ExitCode::from(1),
        "a regression is worse"
    );
    let diff: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let ids = |key: &str| -> Vec<String> {
        diff[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(ids("regressions"), ["SBX-LIFE-002"]);
    assert!(ids("fixes").is_empty());
    assert!(
        diff["verdicts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["of"] == "all" && v["old"] == "conformant" && v["new"] == "non-conformant"),
        "{diff}"
    );
    let text = std::fs::read_to_string(&md).unwrap();
    assert!(
        text.contains("## Regressions (1)")
            && text.contains("| SBX-LIFE-002 | MUST | Pass | Fail |"),
        "{text}"
    );
    let back = dir.path().join("back.json");
    assert_eq!(
        sandspec::commands::diff(
            &broken,
            &clean,
            Some(&back),
            Some(&dir.path().join("back.md"))
        ),
        ExitCode::from(0),
        "a fix is not worse"
    );
    let back: serde_json::Value = serde_json::from_slice(&std::fs::read(&back).unwrap()).unwrap();
    assert_eq!(back["fixes"][0]["id"], "SBX-LIFE-002");
    assert_eq!(back["regressions"], serde_json::json!([]));
    // A folder whose receipt was changed after it was written is refused.
    let receipt = broken.join("receipt.json");
    let text = std::fs::read_to_string(&receipt)
        .unwrap()
        .replace("non-conformant", "conformant");
    std::fs::write(&receipt, text).unwrap();
    assert_eq!(
        sandspec::commands::diff(&clean, &broken, None, Some(&dir.path().join("refused.md"))),
        ExitCode::from(2)
    );
}

/// The three shards of one run, run separately with one label, merge into one verified
/// folder with one verdict over all three; a missing shard, a shard given twice and a shard
/// of another run are refused, naming what is wrong.
#[tokio::test]
async fn evidence_merge_joins_the_shards_of_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let server = reference_with(&[]).await;
    let mut shards = Vec::new();
    for i in 1..=3 {
        let out = dir.path().join(format!("shard{i}"));
        let shard = format!("{i}/3");
        assert_eq!(
            run_on(
                &server,
                &format!("SANDSPEC_MERGE_{i}"),
                &out,
                &["--shard", &shard, "--label", "pipeline-42"]
            )
            .await,
            ExitCode::from(0)
        );
        shards.push(out);
    }
    let merged = dir.path().join("merged");
    assert_eq!(
        sandspec::commands::merge(&shards, &merged, None),
        ExitCode::from(0)
    );
    assert_eq!(
        sandspec::evidence::verify_cli(&merged, None),
        0,
        "the merged folder verifies"
    );
    let report = receipt::predicate(&merged);
    assert_eq!(receipt::verdict(&report), "conformant");
    assert_eq!(receipt::scenarios(&report).len(), 3);
    assert_eq!(
        report["selection"]["subset"], false,
        "the shards cover the catalog"
    );
    assert_eq!(report["selection"]["label"], "pipeline-42");
    let from: Vec<&str> = report["merged_from"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["shard"].as_str().unwrap())
        .collect();
    assert_eq!(from, ["1/3", "2/3", "3/3"]);
    let refused = |dirs: Vec<std::path::PathBuf>, name: &str| {
        let out = dir.path().join(name);
        let code = sandspec::commands::merge(&dirs, &out, None);
        assert!(!out.exists(), "{name}: nothing is written");
        code
    };
    assert_eq!(
        refused(vec![shards[0].clone(), shards[2].clone()], "missing"),
        ExitCode::from(2)
    );
    assert_eq!(
        refused(
            vec![
                shards[0].clone(),
                shards[1].clone(),
                shards[1].clone(),
                shards[2].clone()
            ],
            "twice"
        ),
        ExitCode::from(2)
    );
    // A shard of another run: another label.
    let foreign = dir.path().join("foreign");
    assert_eq!(
        run_on(
            &server,
            "SANDSPEC_MERGE_FOREIGN",
            &foreign,
            &["--shard", "2/3", "--label", "pipeline-43"]
        )
        .await,
        ExitCode::from(0)
    );
    assert_eq!(
        refused(
            vec![shards[0].clone(), foreign, shards[2].clone()],
            "with-foreign"
        ),
        ExitCode::from(2)
    );
    // A folder that is not a shard at all.
    assert_eq!(
        refused(vec![merged.clone()], "not-a-shard"),
        ExitCode::from(2)
    );
}

/// The script the CI recipes of docs/ci.md call, run here as a pipeline runs it: two shards of
/// a small catalog against the embedded reference server, merged (the gate, exit 0 for a
/// conformant run), and the merged evidence compared with the previous release's (here, a
/// copy of it: nothing changed), and with none.
#[test]
fn the_ci_script_runs_a_pipeline_locally() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = small_catalog(dir.path());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ci/sandspec-ci.sh");
    let step = |args: &[&str]| {
        let out = std::process::Command::new("bash")
            .arg(&script)
            .args(args)
            .current_dir(dir.path())
            .env("SANDSPEC", env!("CARGO_BIN_EXE_sandspec"))
            .env("SANDSPEC_LABEL", "local-pipeline")
            .env("CI", "true")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), text)
    };
    let catalog = catalog.display().to_string();
    for i in ["1", "2"] {
        let (code, text) = step(&[
            "shard",
            i,
            "2",
            &format!("shard-{i}"),
            "--scenarios",
            &catalog,
        ]);
        assert_eq!(code, Some(0), "shard {i}: {text}");
        assert!(
            dir.path().join(format!("shard-{i}.junit.xml")).exists(),
            "{text}"
        );
    }
    let (code, text) = step(&["merge", "merged", "shard-2", "shard-1"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("all: conformant"), "{text}");
    assert_eq!(
        sandspec::evidence::verify_cli(&dir.path().join("merged"), None),
        0
    );
    let (code, text) = step(&["merge", "again", "shard-1"]);
    assert_eq!(code, Some(2), "a missing shard is refused: {text}");
    let (code, text) = step(&["diff", "previous", "merged", "first.md"]);
    assert_eq!(code, Some(0), "{text}");
    let report = std::fs::read_to_string(dir.path().join("first.md")).unwrap();
    assert!(
        report.contains("No evidence of a previous release"),
        "{report}"
    );
    let copy = std::process::Command::new("cp")
        .args(["-r", "merged", "previous"])
        .current_dir(dir.path())
        .status()
        .unwrap();
    assert!(copy.success());
    let (code, text) = step(&["diff", "previous", "merged", "diff.md"]);
    assert_eq!(code, Some(0), "{text}");
    let report = std::fs::read_to_string(dir.path().join("diff.md")).unwrap();
    assert!(
        report.contains("## Regressions (0)") && report.contains("## Fixes (0)"),
        "{report}"
    );
    assert!(dir.path().join("diff.json").exists());
    let (code, _) = step(&["nonsense"]);
    assert_eq!(code, Some(2), "a usage error");
}

#[test]
fn list_and_bad_flags() {
    #[derive(Parser)]
    struct ListWrapper {
        #[command(flatten)]
        list: ListArgs,
    }
    let args = ListWrapper::try_parse_from(["list"]).unwrap();
    assert_eq!(sandspec::commands::list(&args.list), ExitCode::from(0));
    let missing =
        ListWrapper::try_parse_from(["list", "--scenarios", "/nonexistent/scenarios"]).unwrap();
    assert_eq!(sandspec::commands::list(&missing.list), ExitCode::from(2));
    // The exit codes are part of --help.
    let help = <Wrapper as clap::CommandFactory>::command()
        .render_long_help()
        .to_string();
    assert!(
        help.contains("Exit codes:") && help.contains("3  harness error"),
        "{help}"
    );
    assert!(Wrapper::try_parse_from(["run", "--shard", "5/4"]).is_err());
    // An unknown capability is a usage error (exit 2) before any target starts.
    let bad = Wrapper::try_parse_from(["run", "--drop-capability", "teleport"]).unwrap();
    let code = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(sandspec::commands::run(bad.run));
    assert_eq!(code, ExitCode::from(2));
    // So is a signing key that is missing or is not an Ed25519 private key.
    let dir = tempfile::tempdir().unwrap();
    let not_a_key = dir.path().join("not-a-key.pem");
    std::fs::write(
        &not_a_key,
        "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n",
    )
    .unwrap();
    for key in [dir.path().join("missing.pem"), not_a_key] {
        let bad = Wrapper::try_parse_from(["run", "--sign-key", key.to_str().unwrap()]).unwrap();
        let code = tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(sandspec::commands::run(bad.run));
        assert_eq!(code, ExitCode::from(2), "{}", key.display());
    }
    assert!(
        Wrapper::try_parse_from(["run", "--owner-token-env", "X"]).is_err(),
        "token flags need --target"
    );
    assert!(
        Wrapper::try_parse_from(["run", "--target", "http://x", "--defect", "pause-noop"]).is_err()
    );
}

/// `sandspec list` ends with the MUST clauses none of the listed scenarios cites.
#[test]
fn list_names_the_must_clauses_no_scenario_cites() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = small_catalog(dir.path());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandspec"))
        .arg("list")
        .arg("--scenarios")
        .arg(&catalog)
        .output()
        .expect("run sandspec");
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap();
    let must = sandspec::profile::v1::must_clauses().count();
    let (head, uncited) = last
        .split_once("; by none of these scenarios: ")
        .expect(last);
    let uncited: Vec<&str> = uncited.split(", ").collect();
    assert_eq!(
        head,
        format!(
            "{} of {must} MUST clauses of docs/protocol.md cited",
            must - uncited.len()
        )
    );
    // SBX-LIFE-001 cites SBX-3.1; nothing in the three files cites CONV-1.1.
    assert!(
        uncited.contains(&"CONV-1.1") && !uncited.contains(&"SBX-3.1"),
        "{last}"
    );
}

/// `--certify` judges the whole catalog: any narrowing is a usage error (exit 2), said
/// before anything starts.
#[test]
fn certify_refuses_every_narrowed_selection() {
    for narrowing in [
        &["--filter", "SBX-LIFE"][..],
        &["--shard", "1/2"],
        &["--family", "lifecycle"],
        // The flag's older name is the same flag.
        &["--profile", "lifecycle"],
    ] {
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_sandspec"))
            .args(["run", "--certify"])
            .args(narrowing)
            .env("CI", "true")
            .output()
            .expect("run sandspec");
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{narrowing:?}: {stderr}");
        assert!(
            stderr.contains(
                "error: --certify runs the whole catalog: drop --filter, --shard and --family"
            ),
            "{narrowing:?}: {stderr}"
        );
    }
}

/// A run narrowed by `--filter` is conformant for what it ran and says, everywhere, that it
/// ran a subset; the folder verifies.
#[test]
fn a_filtered_run_says_it_is_a_subset() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = small_catalog(dir.path());
    let out = dir.path().join("out");
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_sandspec"))
        .arg("run")
        .arg("--scenarios")
        .arg(&catalog)
        .args(["--filter", "SBX-LIFE-001"])
        .arg("--out")
        .arg(&out)
        .env("CI", "true")
        .output()
        .expect("run sandspec");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert_eq!(
        run.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("all: conformant (subset: 1 of 3 scenarios)"),
        "{stdout}"
    );
    let p = receipt::predicate(&out);
    assert_eq!(
        (
            &p["selection"]["subset"],
            &p["selection"]["selected"],
            &p["selection"]["catalog"]
        ),
        (&true.into(), &1.into(), &3.into())
    );
    let profiles: Vec<(String, String, bool)> = p["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["profile"].as_str().unwrap().to_owned(),
                format!("{} of {}", p["selected"], p["catalog"]),
                p["subset"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        profiles,
        [
            ("lifecycle".to_owned(), "1 of 2".to_owned(), true),
            ("all".to_owned(), "1 of 3".to_owned(), true),
        ]
    );
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(
        summary.contains("| all | **conformant** (subset: 1 of 3 scenarios) |")
            && summary.contains("**Subset.** The selection ran 1 of the catalog's 3 scenarios"),
        "{summary}"
    );
    let junit = std::fs::read_to_string(out.join("junit.xml")).unwrap();
    assert!(
        junit.contains(
            r#"<property name="sandspec.run_verdict" value="conformant (subset: 1 of 3 scenarios)"/>"#
        ),
        "{junit}"
    );
    assert_eq!(sandspec::evidence::verify_cli(&out, None), 0);
}

/// Creates a sandbox as the owner over plain HTTP, returning its ID.
async fn create(server: &ReferenceServer, metadata: serde_json::Value) -> String {
    owner::create(
        server,
        "/v1/sandboxes",
        serde_json::json!({"metadata": metadata}),
    )
    .await
}

async fn status_of(server: &ReferenceServer, id: &str) -> u16 {
    owner::status(server, &format!("/v1/sandboxes/{id}")).await
}

#[tokio::test]
async fn sweep_removes_only_tagged_leftovers() {
    #[derive(Parser)]
    struct SweepWrapper {
        #[command(flatten)]
        sweep: sandspec::cli::SweepArgs,
    }
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        ..ReferenceOptions::default()
    };
    let server = ReferenceServer::start(&options).await.unwrap();
    // SAFETY: set once, before any thread reads it; the name is unique to this test.
    unsafe { std::env::set_var("SANDSPEC_SWEEP_OWNER", &server.tokens.owner) };
    let tagged = create(&server, serde_json::json!({"sandspec_run": "old-run"})).await;
    let untagged = create(&server, serde_json::json!({"team": "keep"})).await;
    let sweep = |extra: &[&str]| {
        let mut argv = vec![
            "sweep",
            "--target",
            &server.url,
            "--owner-token-env",
            "SANDSPEC_SWEEP_OWNER",
            "--older-than",
            "0s",
        ];
        argv.extend_from_slice(extra);
        SweepWrapper::try_parse_from(argv).unwrap().sweep
    };
    // A dry run removes nothing.
    let code = tokio::task::spawn_blocking({
        let args = sweep(&["--dry-run"]);
        move || sandspec::commands::sweep_blocking(args)
    })
    .await
    .unwrap();
    assert_eq!(code, ExitCode::from(0));
    assert_eq!(status_of(&server, &tagged).await, 200);
    // A real sweep removes the tagged sandbox and only it.
    let code = tokio::task::spawn_blocking({
        let args = sweep(&[]);
        move || sandspec::commands::sweep_blocking(args)
    })
    .await
    .unwrap();
    assert_eq!(code, ExitCode::from(0));
    assert_eq!(status_of(&server, &tagged).await, 404);
    assert_eq!(status_of(&server, &untagged).await, 200);
    // Something younger than --older-than is left alone.
    let young = create(&server, serde_json::json!({"sandspec_run": "running-now"})).await;
    let code = tokio::task::spawn_blocking({
        let mut args = sweep(&[]);
        args.older_than = std::time::Duration::from_secs(3600);
        move || sandspec::commands::sweep_blocking(args)
    })
    .await
    .unwrap();
    assert_eq!(code, ExitCode::from(0));
    assert_eq!(status_of(&server, &young).await, 200);
}

/// `POST /sandboxes` on the E2B surface with `metadata`, as the owner: the sandbox's E2B ID.
async fn create_e2b(server: &ReferenceServer, metadata: serde_json::Value) -> String {
    let resp = sandspec::target::build_client(None)
        .unwrap()
        .post(format!("{}/sandboxes", server.url))
        .header("X-API-Key", &server.tokens.owner)
        .json(&serde_json::json!({"templateID": "base", "timeout": 600, "metadata": metadata}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 201);
    resp.json::<serde_json::Value>().await.unwrap()["sandboxID"]
        .as_str()
        .unwrap()
        .to_owned()
}

async fn e2b_status_of(server: &ReferenceServer, id: &str) -> u16 {
    sandspec::target::build_client(None)
        .unwrap()
        .get(format!("{}/sandboxes/{id}", server.url))
        .header("X-API-Key", &server.tokens.owner)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// `sandspec sweep --api e2b`: the team's running and paused E2B sandboxes tagged by a run and
/// older than `--older-than` are killed and confirmed gone; untagged and young ones stay.
#[tokio::test]
async fn e2b_sweep_removes_only_tagged_leftovers() {
    #[derive(Parser)]
    struct SweepWrapper {
        #[command(flatten)]
        sweep: sandspec::cli::SweepArgs,
    }
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        ..ReferenceOptions::default()
    };
    let server = ReferenceServer::start(&options).await.unwrap();
    // SAFETY: set once, before any thread reads it; the name is unique to this test.
    unsafe { std::env::set_var("SANDSPEC_E2B_SWEEP_OWNER", &server.tokens.owner) };
    let tagged = create_e2b(&server, serde_json::json!({"sandspec_run": "old-run"})).await;
    let paused = create_e2b(&server, serde_json::json!({"sandspec_run": "old-run"})).await;
    let pause = sandspec::target::build_client(None)
        .unwrap()
        .post(format!("{}/sandboxes/{paused}/pause", server.url))
        .header("X-API-Key", &server.tokens.owner)
        .send()
        .await
        .unwrap();
    assert_eq!(pause.status().as_u16(), 204);
    let untagged = create_e2b(&server, serde_json::json!({"team": "keep"})).await;
    // What the E2B sweep finds: the tagged sandboxes by their E2B paths, paused one included.
    let spec = sandspec::target::TargetSpec::new(
        sandspec::profile::Api::E2b,
        sandspec::target::Endpoint::Url(sandspec::target::UrlEndpoint::new(
            &server.url,
            "SANDSPEC_E2B_SWEEP_OWNER",
            "SANDSPEC_E2B_SWEEP_OWNER",
        )),
    );
    let target = sandspec::target::Target::open(spec.check().unwrap())
        .await
        .unwrap();
    let found = target
        .profile()
        .sweep_older_than(
            &target.conn(),
            &server.tokens.owner,
            std::time::Duration::ZERO,
            true,
        )
        .await
        .unwrap();
    let mut paths: Vec<String> = found.iter().map(|s| s.path.clone()).collect();
    paths.sort();
    let mut want = vec![
        format!("/sandboxes/{tagged}"),
        format!("/sandboxes/{paused}"),
    ];
    want.sort();
    assert_eq!(paths, want);
    assert!(found.iter().all(|s| s.run == "old-run" && !s.removed));
    let sweep = |extra: &[&str]| {
        let mut argv = vec![
            "sweep",
            "--api",
            "e2b",
            "--target",
            &server.url,
            "--owner-token-env",
            "SANDSPEC_E2B_SWEEP_OWNER",
            "--older-than",
            "0s",
        ];
        argv.extend_from_slice(extra);
        SweepWrapper::try_parse_from(argv).unwrap().sweep
    };
    let code = tokio::task::spawn_blocking({
        let args = sweep(&["--dry-run"]);
        move || sandspec::commands::sweep_blocking(args)
    })
    .await
    .unwrap();
    assert_eq!(code, ExitCode::from(0));
    assert_eq!(e2b_status_of(&server, &tagged).await, 200);
    let code = tokio::task::spawn_blocking({
        let args = sweep(&[]);
        move || sandspec::commands::sweep_blocking(args)
    })
    .await
    .unwrap();
    assert_eq!(code, ExitCode::from(0));
    assert_eq!(e2b_status_of(&server, &tagged).await, 404);
    assert_eq!(e2b_status_of(&server, &paused).await, 404);
    assert_eq!(e2b_status_of(&server, &untagged).await, 200);
    let young = create_e2b(&server, serde_json::json!({"sandspec_run": "running-now"})).await;
    let code = tokio::task::spawn_blocking({
        let mut args = sweep(&[]);
        args.older_than = std::time::Duration::from_secs(3600);
        move || sandspec::commands::sweep_blocking(args)
    })
    .await
    .unwrap();
    assert_eq!(code, ExitCode::from(0));
    assert_eq!(e2b_status_of(&server, &young).await, 200);
}

/// A URL target without `--peer-url`: a scenario that requires a peer does not apply to it,
/// said with the way to run it and recorded in the receipt, never passed and never skipped,
/// so the correct deployment is conformant on what it serves (exit 0). With the target itself
/// named as its peer (one process serves the whole deployment), it runs.
#[tokio::test]
async fn a_peer_scenario_is_not_applicable_without_a_peer() {
    let dir = tempfile::tempdir().unwrap();
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let catalog = dir.path().join("catalog");
    for file in [
        "lifecycle/create-get-list-kill.yaml",
        "faults/two-processes-one-database.yaml",
    ] {
        let to = catalog.join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(source.join(file), to).unwrap();
    }
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        ..ReferenceOptions::default()
    };
    let server = ReferenceServer::start(&options).await.unwrap();
    // SAFETY: this test binary sets each variable once, before any thread reads it, and
    // every variable name is unique to this test.
    unsafe {
        std::env::set_var("SANDSPEC_CLI_PEER_OWNER", &server.tokens.owner);
        std::env::set_var("SANDSPEC_CLI_PEER_OTHER", &server.tokens.other);
    }
    let outcome_of = |out: &std::path::Path| -> (String, String, Option<String>) {
        let report = receipt::predicate(out);
        let peer = receipt::scenario(&report, "FLT-PEER-001");
        (
            receipt::verdict(&report),
            peer["outcome"].as_str().unwrap().to_owned(),
            peer["reason"].as_str().map(str::to_owned),
        )
    };
    let run = |out: PathBuf, peer: Option<String>| {
        let mut argv = vec![
            "run".to_owned(),
            "--target".into(),
            server.url.clone(),
            "--owner-token-env".into(),
            "SANDSPEC_CLI_PEER_OWNER".into(),
            "--other-token-env".into(),
            "SANDSPEC_CLI_PEER_OTHER".into(),
            "--scenarios".into(),
            catalog.display().to_string(),
            "--out".into(),
            out.display().to_string(),
        ];
        if let Some(peer) = peer {
            argv.extend(["--peer-url".to_owned(), peer]);
        }
        let args = Wrapper::try_parse_from(argv).unwrap();
        sandspec::commands::run(args.run)
    };
    let without = dir.path().join("without");
    assert_eq!(run(without.clone(), None).await, ExitCode::from(0));
    let report = receipt::predicate(&without);
    assert_eq!(receipt::verdict(&report), "conformant");
    assert!(
        receipt::scenarios(&report)
            .iter()
            .all(|s| s["id"] != "FLT-PEER-001"),
        "never run"
    );
    let not_applicable = report["selection"]["not_applicable"].as_array().unwrap();
    assert_eq!(not_applicable.len(), 1, "{not_applicable:?}");
    assert_eq!(not_applicable[0]["id"], "FLT-PEER-001");
    assert!(
        not_applicable[0]["reason"]
            .as_str()
            .unwrap()
            .contains("--peer-url"),
        "{not_applicable:?}"
    );
    assert_eq!(sandspec::evidence::verify_cli(&without, None), 0);

    let with = dir.path().join("with");
    assert_eq!(
        run(with.clone(), Some(server.url.clone())).await,
        ExitCode::from(0)
    );
    let (verdict, outcome, _) = outcome_of(&with);
    assert_eq!((verdict.as_str(), outcome.as_str()), ("conformant", "pass"));
    assert!(
        Wrapper::try_parse_from(["run", "--peer-url", "http://127.0.0.1:1"]).is_err(),
        "--peer-url needs --target"
    );
}

/// The reference target on SQLite has no peer and no database server: a scenario that needs
/// one (or stops the database) is left out as not applicable, said on stderr and recorded with its reason in the receipt and the summary,
/// never counted as passed or skipped; the rest of the run is judged as usual.
#[test]
fn the_reference_on_sqlite_records_peer_scenarios_as_not_applicable() {
    let dir = tempfile::tempdir().unwrap();
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let catalog = dir.path().join("catalog");
    for file in [
        "lifecycle/create-get-list-kill.yaml",
        "faults/two-processes-one-database.yaml",
        "faults/database-outage-503.yaml",
    ] {
        let to = catalog.join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(source.join(file), to).unwrap();
    }
    let out = dir.path().join("out");
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_sandspec"))
        .arg("run")
        .arg("--scenarios")
        .arg(&catalog)
        .arg("--out")
        .arg(&out)
        .env("CI", "true")
        .output()
        .expect("run sandspec");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "stderr: {stderr}");
    assert!(
        stderr.contains("not applicable: FLT-PEER-001 needs a peer"),
        "{stderr}"
    );
    let p = receipt::predicate(&out);
    let not_applicable = p["selection"]["not_applicable"].as_array().unwrap();
    let reason = |id: &str| {
        not_applicable
            .iter()
            .find(|n| n["id"] == id)
            .unwrap_or_else(|| panic!("{id} is not applicable: {not_applicable:?}"))["reason"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(not_applicable.len(), 2, "{not_applicable:?}");
    assert!(reason("FLT-PEER-001").contains("needs a peer"));
    // SQLite has no database server to stop.
    assert!(
        stderr.contains("not applicable: FLT-PG-001 stops and starts the database"),
        "{stderr}"
    );
    assert!(reason("FLT-PG-001").contains("only on PostgreSQL"));
    let ran: Vec<&str> = receipt::scenarios(&p)
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(ran, ["SBX-LIFE-001"]);
    assert_eq!(p["counts"]["total"], 1);
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(
        summary.contains("## Not applicable to this target"),
        "{summary}"
    );
    assert!(summary.contains("`FLT-PEER-001`"), "{summary}");
}

/// Against `sandspec serve` started with its own defaults (300 s streams, 3,600 s retentions:
/// what a deployment runs), `sandspec run --target` ends within the default wait budget: the
/// scenarios that would wait those out are skipped with the numbers, the verdict is `partial`
/// and names each of them, and nothing fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn default_serve_ends_partial_within_the_wait_budget() {
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        serve_defaults: true,
        ..ReferenceOptions::default()
    };
    let server = ReferenceServer::start(&options).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let (owner, other, admin) = (
        "SANDSPEC_CLI_DEFAULTS_OWNER",
        "SANDSPEC_CLI_DEFAULTS_OTHER",
        "SANDSPEC_CLI_DEFAULTS_ADMIN",
    );
    // SAFETY: set once, before any thread reads them; the names are unique to this test.
    unsafe {
        std::env::set_var(owner, &server.tokens.owner);
        std::env::set_var(other, &server.tokens.other);
        std::env::set_var(admin, server.tokens.admin.as_deref().unwrap());
    }
    let args = Wrapper::try_parse_from([
        "run",
        "--target",
        &server.url,
        "--owner-token-env",
        owner,
        "--other-token-env",
        other,
        "--admin-token-env",
        admin,
        "--out",
        &out.display().to_string(),
    ])
    .unwrap();
    assert_eq!(
        args.run.max_wait,
        sandspec::cli::MaxWait(Some(std::time::Duration::from_secs(120)))
    );
    let code = sandspec::commands::run(args.run).await;
    let report = receipt::predicate(&out);
    let scenarios = receipt::scenarios(&report);
    let failed: Vec<String> = scenarios
        .iter()
        .filter(|s| s["outcome"] == "fail" || s["outcome"] == "error")
        .map(|s| format!("{}: {}", s["id"], s["reason"]))
        .collect();
    assert!(
        failed.is_empty(),
        "against default serve:\n{}",
        failed.join("\n")
    );
    assert_eq!(code, ExitCode::from(1), "partial is not conformant");
    let over_budget: Vec<&str> = scenarios
        .iter()
        .filter(|s| {
            s["outcome"] == "skip"
                && s["reason"]
                    .as_str()
                    .unwrap()
                    .starts_with("over the wait budget: advertised waits of ")
        })
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    // The hour-long retentions and five-minute streams are over two minutes, with the
    // advertised numbers in the reason.
    for id in [
        "PRC-RET-001",
        "PRC-RET-002",
        "RET-RESULT-001",
        "SSE-EXPIRE-001",
        "SSE-BOUND-001",
        "SSE-SES-002",
    ] {
        assert!(
            over_budget.contains(&id),
            "{id} not skipped: {over_budget:?}"
        );
    }
    let result_expires = receipt::scenario(&report, "RET-RESULT-001");
    assert!(
        result_expires["reason"]
            .as_str()
            .unwrap()
            .contains("advance_clock retention.result_s + 1 = 3601 s"),
        "{result_expires}"
    );
    let all = receipt::profile(&report, "all");
    assert_eq!(all["verdict"], "partial");
    let reason = all["reason"].as_str().unwrap();
    for id in &over_budget {
        assert!(reason.contains(id), "the verdict names {id}: {reason}");
    }
    // The scenarios within the budget ran: more passed than were skipped.
    let passed = scenarios.iter().filter(|s| s["outcome"] == "pass").count();
    assert!(
        passed > scenarios.len() / 2,
        "{passed} of {} passed",
        scenarios.len()
    );
}

/// Scenarios that need what is beyond the contract skip, with the reason, where the run does
/// not have it: no admin token given, the fixture model scripts not advertised (dropped here,
/// as on a server whose workers call a real model).
#[tokio::test]
async fn scenarios_beyond_the_contract_skip_where_the_target_lacks_it() {
    let dir = tempfile::tempdir().unwrap();
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let catalog = dir.path().join("catalog");
    for file in [
        "lifecycle/create-get-list-kill.yaml",
        "auth/admin-token-scope.yaml",
        "sessions/idempotent-submit.yaml",
    ] {
        let to = catalog.join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(source.join(file), to).unwrap();
    }
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        ..ReferenceOptions::default()
    };
    let server = ReferenceServer::start(&options).await.unwrap();
    // SAFETY: set once, before any thread reads them; the names are unique to this test.
    unsafe {
        std::env::set_var("SANDSPEC_CLI_CAPS_OWNER", &server.tokens.owner);
        std::env::set_var("SANDSPEC_CLI_CAPS_OTHER", &server.tokens.other);
    }
    let out = dir.path().join("out");
    let args = Wrapper::try_parse_from([
        "run",
        "--target",
        &server.url,
        "--owner-token-env",
        "SANDSPEC_CLI_CAPS_OWNER",
        "--other-token-env",
        "SANDSPEC_CLI_CAPS_OTHER",
        "--drop-capability",
        "fixture_models",
        "--scenarios",
        &catalog.display().to_string(),
        "--out",
        &out.display().to_string(),
    ])
    .unwrap();
    assert_eq!(sandspec::commands::run(args.run).await, ExitCode::from(1));
    let report = receipt::predicate(&out);
    let outcome = |id: &str| {
        let s = receipt::scenario(&report, id);
        (
            s["outcome"].as_str().unwrap().to_owned(),
            s["reason"].clone(),
        )
    };
    assert_eq!(outcome("SBX-LIFE-001").0, "pass");
    let (admin, reason) = outcome("AUTH-ADMIN-001");
    assert_eq!(admin, "skip");
    assert_eq!(reason, "no admin token (--admin-token-env)");
    let (session, reason) = outcome("SUB-IDEM-001");
    assert_eq!(session, "skip");
    assert_eq!(reason, "`fixture_models` dropped by --drop-capability");
}

/// The `all` profile's verdict and the scenario IDs of the receipt in `out`.
fn verdict_and_ids(out: &std::path::Path) -> (String, Vec<String>) {
    let report = receipt::predicate(out);
    let ids = receipt::scenarios(&report)
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect();
    (receipt::verdict(&report), ids)
}

#[tokio::test]
async fn e2b_profile_is_conformant_on_a_separate_server_and_a_defect_is_not() {
    let dir = tempfile::tempdir().unwrap();
    // The whole E2B catalog against a separately started server, tokens from the environment.
    let server = ReferenceServer::start(&ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        ..ReferenceOptions::default()
    })
    .await
    .unwrap();
    // SAFETY: set once, before any thread reads them; the names are unique to this test.
    unsafe {
        std::env::set_var("SANDSPEC_CLI_E2B_OWNER", &server.tokens.owner);
        std::env::set_var("SANDSPEC_CLI_E2B_OTHER", &server.tokens.other);
    }
    let clean = dir.path().join("clean");
    let args = Wrapper::try_parse_from([
        "run",
        "--api",
        "e2b",
        "--target",
        &server.url,
        "--owner-token-env",
        "SANDSPEC_CLI_E2B_OWNER",
        "--other-token-env",
        "SANDSPEC_CLI_E2B_OTHER",
        "--out",
        &clean.display().to_string(),
    ])
    .unwrap();
    assert_eq!(sandspec::commands::run(args.run).await, ExitCode::from(0));
    assert_eq!(
        sandspec::evidence::verify_cli(&clean, None),
        0,
        "the folder verifies"
    );
    let (verdict, ids) = verdict_and_ids(&clean);
    assert_eq!(verdict, "conformant");
    assert!(ids.len() >= 5, "{ids:?}");
    assert!(ids.iter().all(|id| id.starts_with("E2B-")), "{ids:?}");
    let evidence = std::fs::read_dir(&clean)
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap_or_default())
        .collect::<String>();
    assert!(
        !evidence.contains(&server.tokens.owner),
        "an API key reached the evidence"
    );

    // A server with an E2B defect: the scenario it breaks fails, exit 1.
    let defective = ReferenceServer::start(&ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        defects: vec!["e2b-foreign-sandbox-403".into()],
        ..ReferenceOptions::default()
    })
    .await
    .unwrap();
    // SAFETY: as above.
    unsafe {
        std::env::set_var("SANDSPEC_CLI_E2B_BROKEN_OWNER", &defective.tokens.owner);
        std::env::set_var("SANDSPEC_CLI_E2B_BROKEN_OTHER", &defective.tokens.other);
    }
    let broken = dir.path().join("broken");
    let args = Wrapper::try_parse_from([
        "run",
        "--api",
        "e2b",
        "--target",
        &defective.url,
        "--owner-token-env",
        "SANDSPEC_CLI_E2B_BROKEN_OWNER",
        "--other-token-env",
        "SANDSPEC_CLI_E2B_BROKEN_OTHER",
        "--filter",
        "E2B-OWN-001",
        "--out",
        &broken.display().to_string(),
    ])
    .unwrap();
    assert_eq!(sandspec::commands::run(args.run).await, ExitCode::from(1));
    let (verdict, ids) = verdict_and_ids(&broken);
    assert_eq!(verdict, "non-conformant");
    assert_eq!(ids, ["E2B-OWN-001"]);
}

/// `advance_clock` moves a target's clock only on a deployment the runner started for the one
/// scenario: against a `--target` URL (whose clock other clients share, though it advertises
/// `test_clock`) it waits the time out. SSE-EXPIRE-001 passes there on real time, against a
/// server whose event retention is three seconds, and the server's clock was never moved.
#[tokio::test]
async fn advance_clock_waits_real_time_on_a_shared_target() {
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        extra_args: vec!["--retention".into(), "events_s=3".into()],
        ..ReferenceOptions::default()
    };
    let server = ReferenceServer::start(&options).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let catalog = dir.path().join("catalog");
    let file = "retention/expired-cursor.yaml";
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    std::fs::create_dir_all(catalog.join("retention")).unwrap();
    std::fs::copy(source.join(file), catalog.join(file)).unwrap();
    let out = dir.path().join("out");
    let (owner, other, admin) = (
        "SANDSPEC_CLI_REALTIME_OWNER",
        "SANDSPEC_CLI_REALTIME_OTHER",
        "SANDSPEC_CLI_REALTIME_ADMIN",
    );
    let admin_token = server.tokens.admin.clone().unwrap();
    // SAFETY: set once, before any thread reads them; the names are unique to this test.
    unsafe {
        std::env::set_var(owner, &server.tokens.owner);
        std::env::set_var(other, &server.tokens.other);
        std::env::set_var(admin, &admin_token);
    }
    let client = sandspec::target::build_client(None).unwrap();
    let caps = http::get_json(
        &client,
        &format!("{}/v1/capabilities", server.url),
        &server.tokens.owner,
    )
    .await;
    assert!(
        caps["features"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("test_clock")),
        "{caps}"
    );
    let args = Wrapper::try_parse_from([
        "run",
        "--target",
        &server.url,
        "--owner-token-env",
        owner,
        "--other-token-env",
        other,
        "--admin-token-env",
        admin,
        "--scenarios",
        &catalog.display().to_string(),
        "--out",
        &out.display().to_string(),
    ])
    .unwrap();
    sandspec::commands::run(args.run).await;
    let report = receipt::predicate(&out);
    let scenarios = receipt::scenarios(&report);
    assert_eq!(scenarios.len(), 1);
    let run = &scenarios[0];
    assert_eq!(run["id"], "SSE-EXPIRE-001");
    assert_eq!(run["outcome"], "pass", "{run}");
    // It waited the 3 s retention and the step's extra second in real time.
    assert!(run["duration_ms"].as_u64().unwrap() >= 4000, "{run}");
    // Nothing moved the server's clock: the first move is the whole offset.
    let moved = http::post_json(
        &client,
        &format!("{}/v1/test/clock", server.url),
        &admin_token,
        &serde_json::json!({"advance_ms": 1}),
    )
    .await;
    assert_eq!(moved["offset_ms"], 1, "{moved}");
}

fn loaded(id: &str, text: &str) -> sandspec::scenario::LoadedScenario {
    let file = PathBuf::from(format!("{id}.yaml"));
    sandspec::scenario::LoadedScenario {
        scenario: sandspec::scenario::parse_str(&file, text).unwrap(),
        file,
        family: "lifecycle".into(),
    }
}

/// An exclusive scenario whose digest of all durable state must not change for 1.5 s.
fn digest_kept(id: &str) -> sandspec::scenario::LoadedScenario {
    let text = format!(
        "id: {id}\ntitle: keeps a digest\nclauses: [SBX-3.1]\nlevel: SHOULD\n\
         requires: [test_controls, expiry_hold, admin_token]\nexclusive: true\nsteps:\n\
         \x20 - digest: {{into: before}}\n\
         \x20 - sleep: {{ms: 1500}}\n\
         \x20 - expect_digest_unchanged: {{since: before}}\n"
    );
    loaded(id, &text)
}

/// A scenario that creates a sandbox after 300 ms and kills it 1.2 s later.
fn creator(id: &str) -> sandspec::scenario::LoadedScenario {
    let text = format!(
        "id: {id}\ntitle: creates a sandbox\nclauses: [SBX-3.1]\nlevel: SHOULD\nsteps:\n\
         \x20 - sleep: {{ms: 300}}\n\
         \x20 - request:\n\
         \x20     method: POST\n\
         \x20     path: /v1/sandboxes\n\
         \x20     json: {{metadata: {{sandspec_run: \"{{{{run_id}}}}\"}}}}\n\
         \x20     expect: {{status: 201}}\n\
         \x20     capture: {{sbx: {{json: /id}}}}\n\
         \x20 - sleep: {{ms: 1200}}\n\
         cleanup:\n\
         \x20 - request: {{method: DELETE, path: \"/v1/sandboxes/{{{{sbx}}}}\", expect: {{status_in: [204, 404]}}}}\n"
    );
    loaded(id, &text)
}

/// Runs the two `scenarios`, two at a time, and checks that both pass.
async fn both_pass(
    target: &std::sync::Arc<sandspec::target::Target>,
    scenarios: &[sandspec::scenario::LoadedScenario; 2],
) -> (sandspec::engine::ScenarioRun, sandspec::engine::ScenarioRun) {
    use sandspec::engine::Outcome;

    let [alone, beside]: [_; 2] = sandspec::engine::run_all(target, scenarios, "both", 2, 0)
        .await
        .try_into()
        .expect("two runs");
    assert!(
        alone.outcome == Outcome::Pass && beside.outcome == Outcome::Pass,
        "{:?} {:?}",
        alone.outcome,
        beside.outcome
    );
    (alone, beside)
}

/// An exclusive scenario runs beside the others on a deployment of its own where the runner
/// started the target, and after them, on the target itself, where it did not (a URL target).
/// The exclusive one comes first in the catalog, so only the runner's choice can hold it back;
/// its digest would change if the other's sandbox were created on the same server.
#[tokio::test]
async fn an_exclusive_scenario_runs_beside_the_others_only_on_a_deployment_of_its_own() {
    use std::sync::Arc;

    use sandspec::target::Target;

    let scenarios = [digest_kept("TST-ALONE-001"), creator("TST-BESIDE-001")];
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        ..ReferenceOptions::default()
    };
    let started = Arc::new(Target::start_reference(&options).await.unwrap());
    assert!(started.isolates_exclusive());
    let (alone, beside) = both_pass(&started, &scenarios).await;
    assert!(
        alone.started_ms < beside.started_ms + beside.duration_ms,
        "on a deployment of its own the exclusive scenario runs beside the other: \
         it started at {} ms, the other ran from {} ms for {} ms",
        alone.started_ms,
        beside.started_ms,
        beside.duration_ms
    );

    let url = Target::connect_with_tokens(&started.base_url, started.tokens.clone(), None)
        .await
        .unwrap();
    let url = Arc::new(url);
    assert!(!url.isolates_exclusive());
    let (alone, beside) = both_pass(&url, &scenarios).await;
    assert!(
        alone.started_ms >= beside.started_ms + beside.duration_ms,
        "on a URL target the exclusive scenario runs after the other: it started at {} ms, \
         the other ran from {} ms for {} ms",
        alone.started_ms,
        beside.started_ms,
        beside.duration_ms
    );
}

/// A scenario that reads the health endpoint, or first sleeps `ms` when given.
fn health_after(id: &str, ms: Option<u64>) -> sandspec::scenario::LoadedScenario {
    let sleep = ms.map_or(String::new(), |ms| format!("\x20 - sleep: {{ms: {ms}}}\n"));
    let text = format!(
        "id: {id}\ntitle: reads the health endpoint\nclauses: [SBX-3.1]\nlevel: SHOULD\nsteps:\n\
         {sleep}\x20 - request: {{method: GET, path: /v1/health, expect: {{status: 200}}}}\n"
    );
    loaded(id, &text)
}

/// With one scenario at a time, the one that waits longest starts first wherever it is in the
/// catalog, so that its wait does not come at the end of the run; the others keep their order.
#[tokio::test]
async fn the_scenario_that_waits_longest_starts_first() {
    use std::sync::Arc;

    use sandspec::engine::Outcome;
    use sandspec::target::Target;

    let scenarios = [
        health_after("TST-QUICK-001", None),
        health_after("TST-SHORT-001", Some(300)),
        health_after("TST-QUICK-002", None),
        health_after("TST-LONG-001", Some(1500)),
    ];
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        ..ReferenceOptions::default()
    };
    let target = Arc::new(Target::start_reference(&options).await.unwrap());
    let runs = sandspec::engine::run_all(&target, &scenarios, "order", 1, 0).await;
    assert!(
        runs.iter().all(|r| r.outcome == Outcome::Pass),
        "{:?}",
        runs.iter().map(|r| &r.outcome).collect::<Vec<_>>()
    );
    let mut by_start: Vec<(u64, &str)> = runs
        .iter()
        .zip(&scenarios)
        .map(|(r, s)| (r.started_ms, s.id()))
        .collect();
    by_start.sort();
    let order: Vec<&str> = by_start.into_iter().map(|(_, id)| id).collect();
    assert_eq!(
        order,
        [
            "TST-LONG-001",
            "TST-SHORT-001",
            "TST-QUICK-001",
            "TST-QUICK-002"
        ]
    );
}
