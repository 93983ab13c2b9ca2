//! Live runs against a cloud-like target (`support/cloud.rs`: TLS with a private CA, latency,
//! a per-key rate limit answered `429` with `Retry-After`, occasional `503`s, a count of the
//! sandboxes live behind it): throttling answers are waited out and recorded where the step
//! does not name them, and judged as they are where it does; `--max-sandboxes` is never
//! exceeded; `--max-sandbox-seconds` ends a run cleanly, its verdict saying so; and the
//! `/v1` and E2B catalogs stay conformant against such a target, with what they consumed in
//! the receipt and nothing left behind.

use crate::support::cloud::{Cloud, Netns, Options, RateLimit, Scripted, loopback_listener};
use crate::support::receipt;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use sandspec::target::{ReferenceOptions, ReferenceServer};
use serde_json::Value;

#[derive(Parser)]
struct Wrapper {
    #[command(flatten)]
    run: sandspec::cli::RunArgs,
}

/// A bound no run here comes near; reaching it means the run did not end.
const NEVER: Duration = Duration::from_secs(900);

/// Sets the token variables, prefixed by `prefix`, for `server`; returns the flags that name
/// them (the admin's too).
fn token_flags(prefix: &str, server: &ReferenceServer) -> Vec<String> {
    let names = [
        format!("{prefix}_OWNER"),
        format!("{prefix}_OTHER"),
        format!("{prefix}_ADMIN"),
    ];
    // SAFETY: each test sets its own variables once, before its runs read them; the names are
    // unique to one test.
    unsafe {
        std::env::set_var(&names[0], &server.tokens.owner);
        std::env::set_var(&names[1], &server.tokens.other);
        std::env::set_var(&names[2], server.tokens.admin.as_deref().unwrap());
    }
    [
        "--owner-token-env",
        &names[0],
        "--other-token-env",
        &names[1],
        "--admin-token-env",
        &names[2],
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// `sandspec run` with `args`; ends within [`NEVER`] or the test fails.
async fn run(args: Vec<String>) -> ExitCode {
    let argv = std::iter::once("run".to_owned()).chain(args);
    let parsed = Wrapper::try_parse_from(argv).unwrap();
    tokio::time::timeout(NEVER, sandspec::commands::run(parsed.run))
        .await
        .expect("the run ends")
}

/// The flags of a run against `cloud`, trusting its CA (written into `dir`), its evidence in
/// `out`.
fn cloud_flags(cloud: &Cloud, dir: &Path, tokens: &[String], out: &Path) -> Vec<String> {
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, &cloud.ca_pem).unwrap();
    let mut args: Vec<String> = vec![
        "--target".into(),
        cloud.url.clone(),
        "--ca-file".into(),
        ca.display().to_string(),
        "--live".into(),
        "--out".into(),
        out.display().to_string(),
    ];
    args.extend(tokens.iter().cloned());
    args
}

fn reference(extra: &[&str]) -> ReferenceOptions {
    ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        extra_args: extra.iter().map(|s| (*s).to_owned()).collect(),
        ..ReferenceOptions::default()
    }
}

fn loopback_cloud(server: &ReferenceServer, options: Options) -> Cloud {
    Cloud::start(
        loopback_listener(),
        "127.0.0.1".parse().unwrap(),
        &server.url,
        options,
    )
}

/// The notes of a scenario's transcript in `out`.
fn notes(out: &Path, id: &str) -> Vec<String> {
    let text = std::fs::read_to_string(out.join("transcripts").join(format!("{id}.json"))).unwrap();
    let transcript: Value = serde_json::from_str(&text).unwrap();
    transcript["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["note"]["text"].as_str().map(str::to_owned))
        .collect()
}

/// Throttling answers at steps that do not name them (two `429`s with `Retry-After` on the
/// create, a `503` with `Retry-After` on a read, a `429` without `Retry-After` on the kill) are
/// waited out and the requests sent again: the scenario passes, each wait is a note in its
/// transcript, and the scenario's record and the run's consumption count them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_answers_are_waited_out_and_counted() {
    let server = ReferenceServer::start(&reference(&[])).await.unwrap();
    let cloud = loopback_cloud(
        &server,
        Options {
            scripted: vec![
                Scripted {
                    method: "POST",
                    path: "/v1/sandboxes",
                    times: 2,
                    status: 429,
                    retry_after: Some("1"),
                },
                Scripted {
                    method: "GET",
                    path: "/v1/sandboxes/",
                    times: 1,
                    status: 503,
                    retry_after: Some("1"),
                },
                Scripted {
                    method: "DELETE",
                    path: "/v1/sandboxes/",
                    times: 1,
                    status: 429,
                    retry_after: None,
                },
            ],
            ..Options::default()
        },
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let tokens = token_flags("SANDSPEC_CLOUD_WAIT", &server);
    let mut args = cloud_flags(&cloud, dir.path(), &tokens, &out);
    args.extend(["--filter".into(), "SBX-LIFE-001".into()]);
    assert_eq!(run(args).await, ExitCode::SUCCESS);
    let r = receipt::predicate(&out);
    let s = receipt::scenario(&r, "SBX-LIFE-001");
    assert_eq!(s["outcome"], "pass", "{s}");
    assert_eq!(s["throttled"]["waits"], 4, "{s}");
    assert!(s["throttled"]["waited_ms"].as_u64().unwrap() >= 4000, "{s}");
    let c = &r["consumption"];
    assert_eq!(c["throttles"]["waits"], 4, "{c}");
    assert_eq!(c["throttles"]["by_status"]["429"], 3, "{c}");
    assert_eq!(c["throttles"]["by_status"]["503"], 1, "{c}");
    assert_eq!(c["sandboxes_created"], 1, "{c}");
    let waits: Vec<String> = notes(&out, "SBX-LIFE-001")
        .into_iter()
        .filter(|n| n.contains("throttled:"))
        .collect();
    assert_eq!(waits.len(), 4, "{waits:?}");
    assert!(
        waits[0].contains("POST /v1/sandboxes was answered 429 with Retry-After: 1; waiting 1.0s"),
        "{waits:?}"
    );
    assert!(
        waits[3].contains("was answered 429 without Retry-After"),
        "{waits:?}"
    );
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(
        summary.contains("PASS (throttled: 4 waits,") && summary.contains("## Consumption"),
        "{summary}"
    );
    assert_eq!(sandspec::evidence::verify_cli(&out, None), 0);
}

/// What is not waited out: a `429` at a step that names it (seen as it is), a `503` without
/// `Retry-After` (the target may have acted), and a `Retry-After` longer than what the
/// scenario may still wait, which ends the scenario in ERROR, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_step_names_or_cannot_wait_for_is_not_sent_again() {
    let server = ReferenceServer::start(&reference(&[])).await.unwrap();
    let cloud = loopback_cloud(
        &server,
        Options {
            scripted: vec![
                Scripted {
                    method: "POST",
                    path: "/v1/sandboxes",
                    times: 1,
                    status: 429,
                    retry_after: Some("1"),
                },
                Scripted {
                    method: "GET",
                    path: "/v1/sessions",
                    times: 1,
                    status: 503,
                    retry_after: None,
                },
                Scripted {
                    method: "GET",
                    path: "/v1/sandboxes",
                    times: 1,
                    status: 429,
                    retry_after: Some("600"),
                },
            ],
            ..Options::default()
        },
    );
    let dir = tempfile::tempdir().unwrap();
    let catalog = dir.path().join("catalog/throttle");
    std::fs::create_dir_all(&catalog).unwrap();
    let scenario = |id: &str, title: &str, step: &str| {
        std::fs::write(
            catalog.join(format!("{id}.yaml")),
            format!(
                "id: {id}\ntitle: {title}\nclauses: [SBX-3.9]\nlevel: SHOULD\nsteps:\n  - {step}\n"
            ),
        )
        .unwrap();
    };
    scenario(
        "THR-NAMED-001",
        "A 429 the step expects is the step's",
        "request: {method: POST, path: /v1/sandboxes, json: {metadata: {sandspec_run: \"{{run_id}}\"}}, expect: {status: 429}}",
    );
    scenario(
        "THR-UNAVAIL-001",
        "A 503 without Retry-After is judged",
        "request: {method: GET, path: /v1/sessions, expect: {status: 200}}",
    );
    scenario(
        "THR-LONG-001",
        "A wait longer than the budget is not waited",
        "request: {method: GET, path: /v1/sandboxes, expect: {status: 200}}",
    );
    let out = dir.path().join("out");
    let tokens = token_flags("SANDSPEC_CLOUD_NAMED", &server);
    let mut args = cloud_flags(&cloud, dir.path(), &tokens, &out);
    args.extend(
        [
            "--scenarios",
            &dir.path().join("catalog").display().to_string(),
            "--max-wait",
            "30s",
        ]
        .iter()
        .map(|s| (*s).to_owned()),
    );
    // An ERROR is a harness error: the run could not judge that scenario.
    assert_eq!(run(args).await, ExitCode::from(3));
    let r = receipt::predicate(&out);
    let named = receipt::scenario(&r, "THR-NAMED-001");
    assert_eq!(named["outcome"], "pass", "{named}");
    assert_eq!(named["throttled"]["waits"], 0, "{named}");
    let unavailable = receipt::scenario(&r, "THR-UNAVAIL-001");
    assert_eq!(unavailable["outcome"], "fail", "{unavailable}");
    assert!(
        unavailable["reason"]
            .as_str()
            .unwrap()
            .contains("status 503, expected 200"),
        "{unavailable}"
    );
    let long = receipt::scenario(&r, "THR-LONG-001");
    assert_eq!(long["outcome"], "error", "{long}");
    let reason = long["reason"].as_str().unwrap();
    assert!(
        reason.contains(
            "throttled: GET /v1/sandboxes was answered 429 with Retry-After: 600: a wait of 600.0s is more than"
        ),
        "{reason}"
    );
    assert_eq!(r["consumption"]["throttles"]["waits"], 0);
    assert_eq!(sandspec::evidence::verify_cli(&out, None), 0);
}

/// `--max-sandboxes 3` with eight scenarios at once, behind a tight rate limit (2 requests a
/// second per key and resource, in bursts of 4; the lifecycle family names no `429`): the
/// cloud never has more than three sandboxes live, the scenarios that may hold more are
/// skipped with the numbers, the others pass, and the limit's `429`s were waited out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_sandboxes_is_never_exceeded() {
    let server = ReferenceServer::start(&reference(&[])).await.unwrap();
    let cloud = loopback_cloud(
        &server,
        Options {
            rate: Some(RateLimit {
                burst: 4.0,
                per_second: 2.0,
            }),
            ..Options::default()
        },
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let tokens = token_flags("SANDSPEC_CLOUD_MAX", &server);
    let mut args = cloud_flags(&cloud, dir.path(), &tokens, &out);
    args.extend(
        [
            "--family",
            "lifecycle",
            "--jobs",
            "8",
            "--max-sandboxes",
            "3",
        ]
        .iter()
        .map(|s| (*s).to_owned()),
    );
    run(args).await;
    let peak = cloud.stats.peak.load(std::sync::atomic::Ordering::SeqCst);
    assert!(peak <= 3, "{peak} sandboxes were live at once");
    let r = receipt::predicate(&out);
    let mut skipped = 0;
    for s in receipt::scenarios(&r) {
        match s["outcome"].as_str().unwrap() {
            "pass" => {}
            "skip" => {
                let reason = s["reason"].as_str().unwrap();
                assert!(
                    reason.contains("sandboxes at once, more than --max-sandboxes 3 allows"),
                    "{s}"
                );
                skipped += 1;
            }
            _ => panic!("{s}"),
        }
    }
    assert!(skipped >= 1, "a lifecycle scenario holds more than three");
    let c = &r["consumption"];
    assert_eq!(c["limits"]["max_sandboxes"], 3);
    assert!(c["peak_sandboxes"].as_u64().unwrap() <= 3, "{c}");
    assert!(c["sandboxes_created"].as_u64().unwrap() >= 10, "{c}");
    let limited = cloud
        .stats
        .throttled
        .load(std::sync::atomic::Ordering::SeqCst);
    assert!(limited > 0, "the rate limit answered no 429");
    assert!(
        c["throttles"]["by_status"]["429"].as_u64().unwrap() >= limited,
        "{c}: {limited} answered 429 by the rate limit"
    );
    assert!(cloud.stats.live().is_empty(), "{:?}", cloud.stats.live());
}

/// `--max-sandbox-seconds 1`, one scenario at a time: once the run's sandboxes have been held
/// a second in all, no further scenario starts; the one running finishes and cleans up, the
/// run is swept, and the verdict says the budget ended it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sandbox_seconds_budget_ends_a_run_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let args = [
        "--family",
        "lifecycle",
        "--jobs",
        "1",
        "--max-sandbox-seconds",
        "1",
        "--out",
        &out.display().to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    // Against the reference server the runner starts: its binary is the test's.
    let code = tokio::task::spawn_blocking(move || {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sandspec"));
        command
            .arg("run")
            .args::<Vec<String>, _>(args)
            .env_remove("CI");
        command.output().unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&code.stderr);
    assert_eq!(code.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("budget: --max-sandbox-seconds ended the run"),
        "{stderr}"
    );
    let r = receipt::predicate(&out);
    let c = &r["consumption"];
    assert_eq!(c["budget_ended"], true, "{c}");
    assert!(c["sandbox_seconds"].as_f64().unwrap() >= 1.0, "{c}");
    assert_eq!(r["interrupted"], true);
    assert!(!r["not_run"].as_array().unwrap().is_empty());
    let reason = receipt::profile(&r, "all")["reason"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        reason.starts_with("the sandbox-seconds budget (--max-sandbox-seconds) ended the run: "),
        "{reason}"
    );
    assert_eq!(receipt::verdict(&r), "partial");
    assert!(r["cleanup"]["swept"].as_array().unwrap().is_empty());
    for s in receipt::scenarios(&r) {
        assert_eq!(s["outcome"], "pass", "{s}");
    }
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(
        summary.contains("Its sandbox-seconds budget (--max-sandbox-seconds) ended the run"),
        "{summary}"
    );
    assert_eq!(sandspec::evidence::verify_cli(&out, None), 0);
}

/// The `/v1` and E2B catalogs with `--live --ca-file` against the reference server behind the
/// cloud: TLS with its own CA on a non-loopback address of a network namespace made here (on
/// loopback, saying so, where none can be made), 5–10 ms of latency, 6 requests a second per
/// key and resource in bursts of 30 (what the quota checks send at once on one resource fits:
/// a step that expects a `429` sees a rate limit's as it is) answered `429` with
/// `Retry-After` beyond, and every 97th request `503` with
/// `Retry-After`; the first creates of each run are answered `429` too, so that both runs are
/// throttled whatever the load. The sandbox quota is 8 and `--max-sandboxes 8`. Nothing
/// fails: every family is conformant but `faults`, whose scenarios kill the servers the runner
/// starts itself and so skip against a URL target (and one whose feature this machine's
/// server does not advertise); the E2B catalog is conformant; throttles were waited out and
/// counted; the cloud never had more than 8 sandboxes live; nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalogs_stay_conformant_against_a_cloud_like_target() {
    let (netns, listener, ip) = match Netns::make() {
        Ok(netns) => {
            let listener = netns.listener();
            let ip = netns.inner;
            (Some(netns), listener, ip)
        }
        Err(why) => {
            eprintln!(
                "network namespaces cannot be made here ({why}): the cloud listens on loopback"
            );
            (None, loopback_listener(), "127.0.0.1".parse().unwrap())
        }
    };
    // Retentions a run waits out in real time behind a URL (its clock is not the runner's
    // to move), short as in the proxy trial of the conformance harness.
    let server = ReferenceServer::start(&reference(&[
        "--retention",
        "process_output_s=3",
        "--retention",
        "result_s=3",
        "--retention",
        "events_s=20",
        "--limit",
        "max_sandboxes_per_principal=8",
    ]))
    .await
    .unwrap();
    let cloud = Cloud::start(
        listener,
        ip,
        &server.url,
        Options {
            latency: Duration::from_millis(5),
            rate: Some(RateLimit {
                burst: 30.0,
                per_second: 6.0,
            }),
            unavailable_every: Some(97),
            // The rate limit throttles when the load comes to it; these throttle for sure,
            // early in each run, where the creates expect a 201.
            scripted: vec![
                Scripted {
                    method: "POST",
                    path: "/v1/sandboxes",
                    times: 3,
                    status: 429,
                    retry_after: Some("1"),
                },
                Scripted {
                    method: "POST",
                    path: "/sandboxes",
                    times: 2,
                    status: 429,
                    retry_after: Some("1"),
                },
            ],
        },
    );
    assert!(
        netns.is_none() || !cloud.url.contains("127.0.0.1"),
        "{}",
        cloud.url
    );
    let dir = tempfile::tempdir().unwrap();
    let tokens = token_flags("SANDSPEC_CLOUD_CATALOG", &server);
    let mut verdicts = Vec::new();
    for api in ["v1", "e2b"] {
        let out = dir.path().join(api);
        let mut args = cloud_flags(&cloud, dir.path(), &tokens, &out);
        args.extend(
            ["--api", api, "--max-sandboxes", "8"]
                .iter()
                .map(|s| (*s).to_owned()),
        );
        let started = Instant::now();
        let code = run(args).await;
        let took = started.elapsed();
        let r = receipt::predicate(&out);
        let c = &r["consumption"];
        eprintln!(
            "{api} against {}: {:.1} s, exit {code:?}; consumption {c}",
            cloud.url,
            took.as_secs_f64()
        );
        // What may skip: the fault scenarios (the runner kills and restarts only servers it
        // started itself), and the scenarios of a feature this machine's reference server
        // does not advertise (sandbox isolation needs bubblewrap). Nothing fails.
        let mut skipped_families = std::collections::BTreeSet::new();
        for s in receipt::scenarios(&r) {
            let family = s["family"].as_str().unwrap().to_owned();
            match s["outcome"].as_str().unwrap() {
                "pass" => {}
                "skip" => {
                    let reason = s["reason"].as_str().unwrap();
                    assert!(
                        family == "faults" || reason.starts_with("target does not advertise"),
                        "{api}: {s}"
                    );
                    skipped_families.insert(family);
                }
                _ => panic!("{api}: {s}"),
            }
        }
        for p in r["profiles"].as_array().unwrap() {
            let name = p["profile"].as_str().unwrap();
            let skips = if name == "all" {
                !skipped_families.is_empty()
            } else {
                skipped_families.contains(name)
            };
            // A family that skipped is partial; one whose every scenario skipped ran no MUST.
            let verdict = p["verdict"].as_str().unwrap();
            match (skips, name) {
                (false, _) => assert_eq!(verdict, "conformant", "{api}: {p}"),
                (true, "all") => assert_eq!(verdict, "partial", "{api}: {p}"),
                (true, _) => assert_ne!(verdict, "conformant", "{api}: {p}"),
            }
        }
        let by_status = |status: &str| c["throttles"]["by_status"][status].as_u64().unwrap_or(0);
        assert!(by_status("429") >= 2, "{api}: {c}");
        assert!(by_status("503") >= 1, "{api}: {c}");
        assert!(c["sandboxes_created"].as_u64().unwrap() > 0, "{api}: {c}");
        assert!(c["peak_sandboxes"].as_u64().unwrap() <= 8, "{api}: {c}");
        assert!(
            r["cleanup"]["swept"].as_array().unwrap().is_empty(),
            "{api}"
        );
        assert!(r["cleanup"]["run_sweep"]["error"].is_null(), "{api}");
        assert_eq!(sandspec::evidence::verify_cli(&out, None), 0, "{api}");
        verdicts.push((api, code, took));
    }
    let stats = &cloud.stats;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!(
        "the cloud: {} requests, {} forwarded, {} answered 429 by the rate limit and {} by script, {} answered 503, {} sandboxes created, at most {} live at once",
        load(&stats.requests),
        load(&stats.forwarded),
        load(&stats.throttled),
        load(&stats.scripted),
        load(&stats.unavailable),
        load(&stats.created),
        stats.peak.load(std::sync::atomic::Ordering::SeqCst)
    );
    assert!(load(&stats.scripted) == 5 && load(&stats.unavailable) > 0);
    assert!(stats.peak.load(std::sync::atomic::Ordering::SeqCst) <= 8);
    // The sweeps left nothing: the cloud saw every sandbox go, and the server lists none.
    assert!(stats.live().is_empty(), "{:?}", stats.live());
    let client = sandspec::target::build_client(None).unwrap();
    for token in [&server.tokens.owner, &server.tokens.other] {
        for list in ["/v1/sandboxes", "/v1/sessions"] {
            let page: Value = client
                .get(format!("{}{list}", server.url))
                .bearer_auth(token)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(page["data"], serde_json::json!([]), "{list}");
        }
    }
    assert_eq!(verdicts.len(), 2);
}
