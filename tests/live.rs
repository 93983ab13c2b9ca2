//! Live-run safety over real sockets: a target that accepts and never answers ends the run,
//! not conformant, with the reason in the receipt; a target whose lists ignore the `metadata`
//! filter loses nothing a run did not create, to the end-of-run sweep or to `sandspec
//! sweep`; a scenario that leaves something behind fails at its `leak check`, and the sweep
//! then removes what it left.

use crate::support::faulty_proxy;
use crate::support::owner;
use crate::support::receipt;

use owner::{create, status};
use receipt::{scenario, verdict};

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use faulty_proxy::Faults;
use sandspec::target::{ReferenceOptions, ReferenceServer};
use serde_json::{Value, json};

#[derive(Parser)]
struct Wrapper {
    #[command(flatten)]
    run: sandspec::cli::RunArgs,
}

#[derive(Parser)]
struct SweepWrapper {
    #[command(flatten)]
    sweep: sandspec::cli::SweepArgs,
}

/// A bound no run of these tests comes near; reaching it means the run did not end.
const NEVER: Duration = Duration::from_secs(600);

/// A catalog made of these files of the real catalog (or of `source`).
fn catalog(dir: &Path, source: &Path, files: &[&str]) -> PathBuf {
    let catalog = dir.join("catalog");
    for file in files {
        let to = catalog.join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(source.join(file), to).unwrap();
    }
    catalog
}

fn real_catalog() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios")
}

/// Sets the token variables (names prefixed by `prefix`) and returns their names.
fn token_env(prefix: &str, owner: &str, other: &str) -> (String, String) {
    let names = (format!("{prefix}_OWNER"), format!("{prefix}_OTHER"));
    // SAFETY: each test sets its own variables once, before the run reads them; the names
    // are unique to one test.
    unsafe {
        std::env::set_var(&names.0, owner);
        std::env::set_var(&names.1, other);
    }
    names
}

/// `sandspec run` against `url` with `extra` flags; ends within [`NEVER`] or the test fails.
async fn run(
    url: &str,
    env: &(String, String),
    catalog: &Path,
    out: &Path,
    extra: &[&str],
) -> ExitCode {
    let mut argv = vec![
        "run".to_owned(),
        "--target".into(),
        url.into(),
        "--owner-token-env".into(),
        env.0.clone(),
        "--other-token-env".into(),
        env.1.clone(),
        "--scenarios".into(),
        catalog.display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ];
    argv.extend(extra.iter().map(|s| (*s).to_owned()));
    let args = Wrapper::try_parse_from(argv).unwrap();
    tokio::time::timeout(NEVER, sandspec::commands::run(args.run))
        .await
        .expect("the run ends")
}

async fn reference() -> ReferenceServer {
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        ..ReferenceOptions::default()
    };
    ReferenceServer::start(&options).await.unwrap()
}

/// A listener that answers only its capabilities: every scenario fails at its first
/// request once the request timeout passes, and the end-of-run sweep cannot list anything.
/// The run ends with the reasons in the receipt, non-conformant (exit 1): it could not confirm
/// that it left nothing behind, and the verdict says so.
#[tokio::test]
async fn a_target_that_never_answers_ends_the_run() {
    let url = faulty_proxy::silent_target(json!({
        "api_version": "v1",
        "providers": [{"name": "local", "default": true}],
        "features": [],
        "limits": {},
        "retention": {}
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let catalog = catalog(
        dir.path(),
        &real_catalog(),
        &[
            "lifecycle/create-get-list-kill.yaml",
            "files/write-read-list-delete.yaml",
        ],
    );
    let env = token_env(
        "SANDSPEC_LIVE_SILENT",
        "owner-token-silent-1",
        "other-token-silent-2",
    );
    let out = dir.path().join("out");
    let code = run(&url, &env, &catalog, &out, &["--request-timeout", "1s"]).await;
    assert_eq!(code, ExitCode::from(1));
    let r = receipt::predicate(&out);
    assert_eq!(verdict(&r), "non-conformant");
    let all = receipt::profile(&r, "all");
    assert!(
        all["reason"].as_str().unwrap().contains(
            "cleanup could not be confirmed: the end-of-run sweep could not finish: GET /v1/sessions"
        ),
        "{all}"
    );
    for id in ["SBX-LIFE-001", "FILE-RW-001"] {
        let s = scenario(&r, id);
        assert_eq!(s["outcome"], "fail", "{s}");
        assert!(
            s["failed_step"].as_str().unwrap().starts_with("steps[0] "),
            "{s}"
        );
        let reason = s["reason"].as_str().unwrap();
        assert!(
            reason.contains("headers not received within 1s"),
            "{reason}"
        );
    }
    let error = r["cleanup"]["run_sweep"]["error"].as_str().unwrap();
    assert!(
        error.contains("GET /v1/sessions: no response: not received within 1s"),
        "{error}"
    );
    assert_eq!(
        sandspec::evidence::verify_cli(&out, None),
        0,
        "the folder verifies"
    );
}

/// A proxy in front of a correct server that accepts two kinds of request and never
/// answers them: event streams, and file writes. The stream step fails within its declared
/// deadline, the file step within the request timeout; cleanup and the sweeps go through,
/// so the run ends not conformant (exit 1) with both reasons in the receipt.
#[tokio::test]
async fn a_stream_or_a_request_that_is_never_answered_fails_its_step() {
    let server = reference().await;
    let proxy = faulty_proxy::start(
        &server.url,
        Faults {
            hang: Some(Box::new(|method, path, headers| {
                let stream = headers
                    .get("accept")
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.contains("text/event-stream"));
                stream || (method == hyper::Method::PUT && path.ends_with("/files"))
            })),
            ..Faults::default()
        },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let catalog = catalog(
        dir.path(),
        &real_catalog(),
        &[
            "processes/stream-cut-and-resume.yaml",
            "files/write-read-list-delete.yaml",
        ],
    );
    let env = token_env(
        "SANDSPEC_LIVE_HANG",
        &server.tokens.owner,
        &server.tokens.other,
    );
    let out = dir.path().join("out");
    let code = run(
        &proxy.url,
        &env,
        &catalog,
        &out,
        &["--request-timeout", "2s"],
    )
    .await;
    assert_eq!(code, ExitCode::from(1));
    let r = receipt::predicate(&out);
    assert_eq!(verdict(&r), "non-conformant");
    let stream = scenario(&r, "PRC-STREAM-001");
    assert_eq!(stream["outcome"], "fail");
    assert!(
        stream["failed_step"]
            .as_str()
            .unwrap()
            .contains("read two events"),
        "{stream}"
    );
    let reason = stream["reason"].as_str().unwrap();
    assert!(
        reason.contains("headers not received within 15s (the step's deadline)"),
        "{reason}"
    );
    let files = scenario(&r, "FILE-RW-001");
    assert_eq!(files["outcome"], "fail");
    let reason = files["reason"].as_str().unwrap();
    assert!(
        reason.contains("headers not received within 2s (--request-timeout)"),
        "{reason}"
    );
    // Cleanup went through: nothing was left, and the sweep finished.
    assert_eq!(r["cleanup"]["swept"], json!([]));
    assert_eq!(r["cleanup"]["run_sweep"]["error"], Value::Null);
    assert_eq!(
        sandspec::evidence::verify_cli(&out, None),
        0,
        "the folder verifies"
    );
}

/// A target whose lists ignore `metadata` filters (a proxy that drops them) holds a sandbox
/// and a session the run did not create, without the tag, and a sandbox and a session of
/// an older run. The run's end-of-run sweep touches none of them and reports the untagged
/// records it was given as ignored; `sandspec sweep` removes the older run's objects and
/// only them.
#[tokio::test]
async fn a_target_that_ignores_list_filters_loses_nothing() {
    let server = reference().await;
    let proxy = faulty_proxy::start(
        &server.url,
        Faults {
            drop_metadata_filters: true,
            ..Faults::default()
        },
    )
    .await;
    let keep_sbx = create(
        &server,
        "/v1/sandboxes",
        json!({"metadata": {"team": "keep"}}),
    )
    .await;
    let keep_ses = create(
        &server,
        "/v1/sessions",
        json!({"agent": {"model": "echo"}, "sandbox": {"create": {}}}),
    )
    .await;
    let old = json!({"sandspec_run": "an-older-run"});
    let old_sbx = create(&server, "/v1/sandboxes", json!({"metadata": old})).await;
    let old_ses = create(
        &server,
        "/v1/sessions",
        json!({"agent": {"model": "echo"}, "metadata": old, "sandbox": {"create": {"metadata": old}}}),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let catalog = catalog(
        dir.path(),
        &real_catalog(),
        &["lifecycle/create-get-list-kill.yaml"],
    );
    let env = token_env(
        "SANDSPEC_LIVE_FILTER",
        &server.tokens.owner,
        &server.tokens.other,
    );
    let out = dir.path().join("out");
    let code = run(&proxy.url, &env, &catalog, &out, &[]).await;
    assert_eq!(code, ExitCode::from(0));
    let r = receipt::predicate(&out);
    assert_eq!(verdict(&r), "conformant");
    assert_eq!(
        r["cleanup"]["swept"],
        json!([]),
        "the run found nothing of its own"
    );
    for path in [
        format!("/v1/sandboxes/{keep_sbx}"),
        format!("/v1/sessions/{keep_ses}"),
        format!("/v1/sandboxes/{old_sbx}"),
        format!("/v1/sessions/{old_ses}"),
    ] {
        assert_eq!(status(&server, &path).await, 200, "{path} is untouched");
    }
    // The owner's sandbox list, unfiltered, held four sandboxes that are not the run's (two
    // of them the sessions'): a warning, since it was asked to filter. The session list has
    // no filter: its two records are ignored quietly.
    let ignored = r["cleanup"]["run_sweep"]["ignored"].as_array().unwrap();
    assert!(
        ignored.contains(
            &json!({"principal": "owner", "list": "/v1/sandboxes", "filtered": true, "count": 4})
        ),
        "{ignored:?}"
    );
    assert!(
        ignored.contains(
            &json!({"principal": "owner", "list": "/v1/sessions", "filtered": false, "count": 2})
        ),
        "{ignored:?}"
    );
    assert_eq!(
        sandspec::evidence::verify_cli(&out, None),
        0,
        "the folder verifies"
    );

    // `sandspec sweep` through the same proxy: only the older run's session and sandbox go.
    let args = SweepWrapper::try_parse_from([
        "sweep",
        "--target",
        &proxy.url,
        "--owner-token-env",
        &env.0,
        "--older-than",
        "0s",
    ])
    .unwrap()
    .sweep;
    let code = tokio::task::spawn_blocking(move || sandspec::commands::sweep_blocking(args))
        .await
        .unwrap();
    assert_eq!(code, ExitCode::from(0));
    assert_eq!(
        status(&server, &format!("/v1/sessions/{old_ses}")).await,
        404
    );
    assert_eq!(
        status(&server, &format!("/v1/sandboxes/{old_sbx}")).await,
        404
    );
    assert_eq!(
        status(&server, &format!("/v1/sandboxes/{keep_sbx}")).await,
        200
    );
    assert_eq!(
        status(&server, &format!("/v1/sessions/{keep_ses}")).await,
        200
    );
}

/// A scenario whose cleanup leaves a sandbox (with a process), a snapshot and a session
/// behind fails at `leak check`, naming each; the sweep then removes them, and the receipt
/// records both.
#[tokio::test]
async fn a_scenario_that_leaks_fails_at_its_leak_check_and_is_swept() {
    let server = reference().await;
    let dir = tempfile::tempdir().unwrap();
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/scenarios-leaky");
    let catalog = catalog(dir.path(), &fixtures, &["leaks/leaves-things-behind.yaml"]);
    let env = token_env(
        "SANDSPEC_LIVE_LEAK",
        &server.tokens.owner,
        &server.tokens.other,
    );
    let out = dir.path().join("out");
    let code = run(&server.url, &env, &catalog, &out, &[]).await;
    assert_eq!(code, ExitCode::from(1));
    let r = receipt::predicate(&out);
    let s = scenario(&r, "LEAK-FIXTURE-001");
    assert_eq!(s["outcome"], "fail");
    assert_eq!(s["failed_step"], "leak check");
    let reason = s["reason"].as_str().unwrap();
    for kind in [
        "/v1/sandboxes/",
        "/v1/processes/",
        "/v1/snapshots/",
        "/v1/sessions/",
    ] {
        assert!(reason.contains(kind), "{kind} named in: {reason}");
    }
    assert!(!reason.contains("could not"), "{reason}");
    let swept = r["cleanup"]["swept"].as_array().unwrap();
    // The sandbox, its process, the snapshot, the session and the session's own sandbox.
    assert_eq!(swept.len(), 5, "{swept:?}");
    assert!(
        swept
            .iter()
            .all(|l| l["scenario"] == "LEAK-FIXTURE-001" && l["removed"] == true),
        "{swept:?}"
    );
    // Gone from the server, so the end-of-run sweep found nothing more.
    for list in ["/v1/sandboxes", "/v1/snapshots", "/v1/sessions"] {
        let listed = sandspec::target::build_client(None)
            .unwrap()
            .get(format!("{}{list}", server.url))
            .bearer_auth(&server.tokens.owner)
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap();
        assert_eq!(listed["data"], json!([]), "{list}");
    }
    assert_eq!(
        r["cleanup"]["run_sweep"],
        json!({"ignored": [], "error": null})
    );
    assert!(
        r["scenarios"].as_array().unwrap().len() == 1 && verdict(&r) == "not-tested",
        "a SHOULD scenario alone: no MUST ran"
    );
    assert_eq!(
        sandspec::evidence::verify_cli(&out, None),
        0,
        "the folder verifies"
    );
}

/// A session whose delete never completes (the proxy answers the delete and keeps the
/// session `deleting`): the leak check waits for it, once, then fails naming it. The sweep's
/// delete of a session that is already deleting changes nothing (SES-8.7), so the sweep looks
/// at it once more, without a second wait, and says it could not remove it.
#[tokio::test]
async fn a_session_that_stays_deleting_is_waited_for_once() {
    use sandspec::engine::Entry;
    let server = reference().await;
    let proxy = faulty_proxy::start(
        &server.url,
        Faults {
            stuck_session_deletes: true,
            ..Faults::default()
        },
    )
    .await;
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/scenarios-leaky/leaks/session-never-goes.yaml");
    let scenario =
        sandspec::scenario::parse_str(&file, &std::fs::read_to_string(&file).unwrap()).unwrap();
    let target =
        sandspec::target::Target::connect_with_tokens(&proxy.url, server.tokens.clone(), None)
            .await
            .unwrap();
    let run = tokio::time::timeout(
        NEVER,
        sandspec::engine::run_scenario(&target, &scenario, "testsessionstuck"),
    )
    .await
    .expect("the scenario ends");
    let (step, reason) = match &run.outcome {
        sandspec::engine::Outcome::Fail { step, reason } => (step.as_str(), reason.as_str()),
        other => panic!("expected the leak check to fail, got {other}"),
    };
    assert_eq!(step, "leak check");
    let session = reason
        .split("the sweep could not remove: ")
        .nth(1)
        .unwrap_or_else(|| panic!("the session is reported as not removed: {reason}"));
    assert!(session.starts_with("/v1/sessions/ses_"), "{reason}");
    // The leak check's looks at the session, before and after the sweep's delete of it.
    let mut before = 0;
    let mut after = None;
    for entry in &run.transcript {
        let Entry::Http(x) = entry else { continue };
        if x.target != session {
            continue;
        }
        match (x.step.as_str(), x.method.as_str(), &mut after) {
            ("sweep", "DELETE", None) => after = Some(0),
            ("leak check", "GET", None) => before += 1,
            ("leak check", "GET", Some(n)) => *n += 1,
            _ => {}
        }
    }
    assert!(before > 1, "the leak check waited for the deleting session");
    assert_eq!(after, Some(1), "one look after the sweep's delete");
}

/// The streams a `parallel` group is granted stay open until every request of the group has
/// its answer, so that they are open together however late the last request is sent: with a
/// quota of two streams and the third request of a burst of three held back (by the proxy)
/// until the server would have seen the first two close, the third is still refused, 429.
#[tokio::test]
async fn a_bursts_streams_are_held_until_its_last_request_is_answered() {
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        extra_args: vec!["--limit".into(), "max_streams_per_principal=2".into()],
        ..ReferenceOptions::default()
    };
    let server = ReferenceServer::start(&options).await.unwrap();
    // Later than a granted stream's close takes to reach the server: at its next heartbeat,
    // one second here.
    let proxy = faulty_proxy::start(
        &server.url,
        Faults {
            late_stream: Some((3, Duration::from_millis(2500))),
            ..Faults::default()
        },
    )
    .await;
    let text = r#"
id: BURST-FIXTURE-001
title: A burst of one stream more than the quota
clauses: [SSE-7.21]
level: SHOULD
steps:
  - request:
      method: POST
      path: /v1/sandboxes
      json: {metadata: {sandspec_run: "{{run_id}}"}}
      expect: {status: 201}
      capture:
        sbx: {json: /id}
  - request:
      method: POST
      path: /v1/sandboxes/{{sbx}}/processes
      json: {cmd: [sh, -c, "echo ready; exec sleep 60"]}
      expect: {status: 201}
      capture:
        long: {json: /id}
  # `within_s` makes the group close its granted streams instead of reading them to their
  # end; one second and a pause of four leave room for one attempt only.
  - parallel:
      name: one stream more than the quota
      within_s: 1
      every_ms: 4000
      repeat: limits.max_streams_per_principal + 1
      request:
        method: GET
        path: /v1/processes/{{long}}/events
        headers: {Accept: text/event-stream}
      expect:
        - {status: 200, exactly: limits.max_streams_per_principal}
        - {status: 429, code: too_many_streams, rest: true}
cleanup:
  - request: {method: DELETE, path: "/v1/sandboxes/{{sbx}}", expect: {status_in: [204, 404]}}
"#;
    let scenario =
        sandspec::scenario::parse_str(Path::new("burst.yaml"), text).expect("the fixture parses");
    let target =
        sandspec::target::Target::connect_with_tokens(&proxy.url, server.tokens.clone(), None)
            .await
            .unwrap();
    let run = tokio::time::timeout(
        NEVER,
        sandspec::engine::run_scenario(&target, &scenario, "testburstheld"),
    )
    .await
    .expect("the scenario ends");
    assert_eq!(
        run.outcome,
        sandspec::engine::Outcome::Pass,
        "{:?}",
        run.outcome
    );
}
