//! `sandspec run` end to end through its argument parser, against a reference server started
//! here and named with `--target` (tokens in environment variables): a clean server is
//! conformant (exit 0) with report.json and JUnit written; a server with a defect is not
//! (exit 1) and the report names the failing scenario.

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
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        defects: defects.iter().map(|d| (*d).to_owned()).collect(),
        ..ReferenceOptions::default()
    };
    let server = ReferenceServer::start(&options).await.unwrap();
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
    let args = Wrapper::try_parse_from([
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
        &catalog.display().to_string(),
        "--out",
        &out.display().to_string(),
        "--jobs",
        "2",
    ])
    .unwrap();
    sandspec::cli::run(args.run).await
}

#[tokio::test]
async fn clean_server_is_conformant_and_a_defect_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let clean = dir.path().join("clean");
    let code = run_against(&[], "SANDSPEC_CLI_CLEAN", &clean).await;
    assert_eq!(code, ExitCode::from(0));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(clean.join("report.json")).unwrap()).unwrap();
    let all = report["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["profile"] == "all")
        .unwrap();
    assert_eq!(all["verdict"], "conformant");
    assert_eq!(report["scenarios"].as_array().unwrap().len(), 3);
    // The stream scenario recorded its measurements, and eventsource-client read its streams.
    let stream = report["scenarios"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == "PRC-STREAM-001")
        .unwrap();
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
    let transcript = stream["transcript"].to_string();
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
    // Tokens never reach the report.
    let text = std::fs::read_to_string(clean.join("report.json")).unwrap();
    assert!(!text.contains("sst_"), "a token leaked into report.json");

    let broken = dir.path().join("broken");
    let code = run_against(&["ttl-not-enforced"], "SANDSPEC_CLI_BROKEN", &broken).await;
    assert_eq!(code, ExitCode::from(1));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(broken.join("report.json")).unwrap())
            .unwrap();
    let failed: Vec<&str> = report["scenarios"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["outcome"].get("fail").is_some())
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(failed, vec!["SBX-LIFE-002"]);
}

#[test]
fn list_and_bad_flags() {
    #[derive(Parser)]
    struct ListWrapper {
        #[command(flatten)]
        list: ListArgs,
    }
    let args = ListWrapper::try_parse_from(["list"]).unwrap();
    assert_eq!(sandspec::cli::list(&args.list), ExitCode::from(0));
    let missing =
        ListWrapper::try_parse_from(["list", "--scenarios", "/nonexistent/scenarios"]).unwrap();
    assert_eq!(sandspec::cli::list(&missing.list), ExitCode::from(2));
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
        .block_on(sandspec::cli::run(bad.run));
    assert_eq!(code, ExitCode::from(2));
    assert!(
        Wrapper::try_parse_from(["run", "--owner-token-env", "X"]).is_err(),
        "token flags need --target"
    );
    assert!(
        Wrapper::try_parse_from(["run", "--target", "http://x", "--defect", "pause-noop"]).is_err()
    );
}
