//! Bounded reads, each read path against a target that never stops sending: `sandspec run` is
//! started as a child process against a hostile loopback server (or an MCP server, or a
//! launched service, that prints for ever) and its peak resident memory (`VmHWM`, read from
//! `/proc` while it runs) and wall time are measured. Each run ends in seconds, not conformant, with
//! the size and the flag in the step's reason, and its memory stays under a small bound; the
//! run goes on to its cleanup and sweep, and its evidence folder verifies.

use crate::support::hostile::{Answer, catalog, json, run_measured, serve};
use crate::support::receipt;

use std::path::Path;
use std::time::Duration;

use serde_json::json;

/// Peak memory a run may reach against a target that never stops sending, with the default
/// caps (a 64 MiB body, 16 MiB events): the cap, what the runner holds anyway, and room.
const PEAK_BOUND_KIB: u64 = 256 * 1024;
/// With `--max-body-bytes 1M --max-event-bytes 256K`.
const SMALL_PEAK_BOUND_KIB: u64 = 96 * 1024;
/// The whole run, a debug build on a loaded two-core machine included.
const RUN_WITHIN: Duration = Duration::from_secs(60);

fn v1_capabilities() -> Answer {
    json(
        200,
        json!({
            "api_version": "v1",
            "providers": [{"name": "local", "default": true}],
            "features": [],
            "limits": {},
            "retention": {}
        }),
    )
}

/// The lists of the end-of-run sweeps (`GET`), empty.
fn empty_list(method: &str, path: &str) -> Option<Answer> {
    if method != "GET" {
        None
    } else if path.starts_with("/v1/sessions") || path.starts_with("/v1/sandboxes") {
        Some(json(200, json!({"data": []})))
    } else if path.starts_with("/v2/sandboxes") {
        Some(json(200, json!([])))
    } else {
        None
    }
}

fn endless(content_type: &'static str, first: &[u8], again: &[u8]) -> Answer {
    Answer::Endless {
        content_type,
        first: first.to_vec(),
        again: again.repeat(64 * 1024 / again.len().max(1)),
    }
}

/// `sandspec run` against `url` with the catalog in `dir`, `extra` flags after the rest.
fn run(url: &str, dir: &Path, catalog: &Path, extra: &[&str]) -> crate::support::hostile::Measured {
    let mut args: Vec<String> = [
        "run",
        "--target",
        url,
        "--owner-token-env",
        "BOUNDS_OWNER",
        "--other-token-env",
        "BOUNDS_OTHER",
        "--scenarios",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.push(catalog.display().to_string());
    args.push("--out".into());
    args.push(dir.join("out").display().to_string());
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let measured = run_measured(
        &args,
        &[
            ("BOUNDS_OWNER", "owner-bounds-1"),
            ("BOUNDS_OTHER", "other-bounds-2"),
        ],
        RUN_WITHIN,
    );
    eprintln!(
        "peak {} KiB in {:.1}s\n{}",
        measured.peak_kib,
        measured.took.as_secs_f64(),
        measured.stderr
    );
    measured
}

/// The one scenario's reason in the run's receipt; the folder verifies.
fn reason_of(dir: &Path, id: &str) -> String {
    let out = dir.join("out");
    assert_eq!(
        sandspec::evidence::verify_cli(&out, None),
        0,
        "the folder verifies"
    );
    let r = receipt::predicate(&out);
    let s = receipt::scenario(&r, id);
    assert_eq!(s["outcome"], "fail", "{s}");
    s["reason"].as_str().unwrap().to_owned()
}

/// The peak and the time a run took are within bounds.
fn bounded(m: &crate::support::hostile::Measured, peak_kib: u64) {
    assert!(
        m.peak_kib < peak_kib,
        "peak resident memory {} KiB, over the bound of {peak_kib} KiB",
        m.peak_kib
    );
    assert!(m.took < RUN_WITHIN, "the run took {:?}", m.took);
}

const SSE_SCENARIO: &str = "\
id: BND-SSE-001
title: A stream is read
clauses: [SSE-7.1]
level: SHOULD
steps:
  - sse: {path: /v1/processes/p/events, within_s: 45}
";

/// The case: a sandbox create answered `200 application/json` and a body that never
/// ends (SBX-LIFE-001 of the real catalog).
#[test]
fn an_endless_body_fails_its_step_at_the_cap() {
    let url = serve(Box::new(|method, path| {
        if path == "/v1/capabilities" {
            return v1_capabilities();
        }
        if let Some(list) = empty_list(method, path) {
            return list;
        }
        match (method, path) {
            ("POST", "/v1/sandboxes") => endless("application/json", b"{\"id\": \"", b"x"),
            _ => json(404, json!({"code": "not_found"})),
        }
    }));
    let real = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    for (extra, bound, cap) in [
        (&[][..], PEAK_BOUND_KIB, "--max-body-bytes (67108864 bytes)"),
        (
            &["--max-body-bytes", "1M"][..],
            SMALL_PEAK_BOUND_KIB,
            "--max-body-bytes (1048576 bytes)",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["--filter", "SBX-LIFE-001"];
        args.extend(extra);
        let m = run(&url, dir.path(), &real, &args);
        assert_eq!(m.code, Some(1), "not conformant");
        let reason = reason_of(dir.path(), "SBX-LIFE-001");
        assert!(
            reason.starts_with("steps[0] ")
                && reason.contains(&format!("status 200, but the response body exceeds {cap}")),
            "{reason}"
        );
        bounded(&m, bound);
    }
}

/// An event stream whose first `data:` line never ends, read by the strict client and the
/// interop probe at once.
#[test]
fn an_endless_sse_line_fails_its_step_at_the_cap() {
    let url = serve(Box::new(|method, path| {
        if path == "/v1/capabilities" {
            return v1_capabilities();
        }
        if let Some(list) = empty_list(method, path) {
            return list;
        }
        endless("text/event-stream", b"data: ", b"x")
    }));
    let dir = tempfile::tempdir().unwrap();
    let catalog = catalog(dir.path(), "bounds/sse.yaml", SSE_SCENARIO);
    let m = run(&url, dir.path(), &catalog, &[]);
    assert_eq!(m.code, Some(1), "not conformant");
    let reason = reason_of(dir.path(), "BND-SSE-001");
    assert!(
        reason.contains("stream refused: an SSE line exceeds --max-event-bytes (16777216 bytes)"),
        "{reason}"
    );
    bounded(&m, PEAK_BOUND_KIB);
}

/// An event stream of short `data:` lines that never reach a blank line: one event for ever.
#[test]
fn an_endless_sse_event_fails_its_step_at_the_cap() {
    let url = serve(Box::new(|method, path| {
        if path == "/v1/capabilities" {
            return v1_capabilities();
        }
        if let Some(list) = empty_list(method, path) {
            return list;
        }
        endless("text/event-stream", b"", b"data: x\n")
    }));
    let dir = tempfile::tempdir().unwrap();
    let catalog = catalog(dir.path(), "bounds/sse.yaml", SSE_SCENARIO);
    let m = run(&url, dir.path(), &catalog, &["--max-event-bytes", "256K"]);
    assert_eq!(m.code, Some(1), "not conformant");
    let reason = reason_of(dir.path(), "BND-SSE-001");
    assert!(
        reason.contains("stream refused: an SSE event exceeds --max-event-bytes (262144 bytes)"),
        "{reason}"
    );
    bounded(&m, SMALL_PEAK_BOUND_KIB);
}

/// An E2B envd stream whose first Connect envelope declares 4 GiB and goes on for ever.
#[test]
fn an_endless_connect_message_fails_its_step_at_the_cap() {
    let url = serve(Box::new(|method, path| {
        if let Some(list) = empty_list(method, path) {
            return list;
        }
        if path == "/process.Process/Start" {
            return endless(
                "application/connect+json",
                &[0, 0xff, 0xff, 0xff, 0xff],
                b"x",
            );
        }
        json(404, json!({"message": "not found"}))
    }));
    let dir = tempfile::tempdir().unwrap();
    let catalog = catalog(
        dir.path(),
        "e2b/bounds/connect.yaml",
        "\
id: BND-CONNECT-001
title: A process is started
clauses: [E2B-ENVD-1]
level: SHOULD
steps:
  - connect:
      sandbox: sbx
      rpc: process.Process/Start
      stream: true
      within_s: 45
      message: {process: {cmd: /bin/true}}
",
    );
    let m = run(&url, dir.path(), &catalog, &["--api", "e2b"]);
    assert_eq!(m.code, Some(1), "not conformant");
    let reason = reason_of(dir.path(), "BND-CONNECT-001");
    assert!(
        reason.contains(
            "a Connect message declares 4294967295 bytes, over --max-event-bytes (16777216 bytes)"
        ),
        "{reason}"
    );
    bounded(&m, PEAK_BOUND_KIB);
}

/// An MCP server under test whose first message never ends: the session fails at
/// `initialize`, at the cap.
#[test]
fn an_endless_mcp_message_fails_its_step_at_the_cap() {
    let url = serve(Box::new(|method, path| {
        empty_list(method, path).unwrap_or_else(|| json(404, json!({"message": "not found"})))
    }));
    let dir = tempfile::tempdir().unwrap();
    let catalog = catalog(
        dir.path(),
        "mcp/bounds.yaml",
        "\
id: BND-MCP-001
title: A sandbox is made through the MCP server
clauses: [MCP-1]
level: SHOULD
steps:
  - mcp: {name: create, action: create}
",
    );
    let m = run(
        &url,
        dir.path(),
        &catalog,
        &["--api", "mcp", "--mcp-server", "cat /dev/zero"],
    );
    assert_eq!(m.code, Some(1), "not conformant");
    let reason = reason_of(dir.path(), "BND-MCP-001");
    assert!(
        reason.contains("an MCP message exceeds --max-event-bytes (16777216 bytes)"),
        "{reason}"
    );
    bounded(&m, PEAK_BOUND_KIB);
}

/// A target whose capabilities document never ends: the run stops before any scenario, a
/// harness error with the size.
#[test]
fn an_endless_capabilities_document_ends_the_run_at_the_cap() {
    let url = serve(Box::new(|_, path| {
        if path == "/v1/capabilities" {
            return endless("application/json", b"{\"features\": [\"", b"x");
        }
        json(404, json!({"code": "not_found"}))
    }));
    let dir = tempfile::tempdir().unwrap();
    let catalog = catalog(dir.path(), "bounds/sse.yaml", SSE_SCENARIO);
    let m = run(&url, dir.path(), &catalog, &["--max-body-bytes", "1M"]);
    assert_eq!(m.code, Some(3), "a harness error");
    assert!(
        m.stderr
            .contains("the response body exceeds --max-body-bytes (1048576 bytes)"),
        "{}",
        m.stderr
    );
    bounded(&m, SMALL_PEAK_BOUND_KIB);
}

/// A target whose session list never ends: the end-of-run sweep cannot finish, and says why.
#[test]
fn an_endless_list_stops_the_sweep_at_the_cap() {
    let url = serve(Box::new(|method, path| {
        if path == "/v1/capabilities" {
            return v1_capabilities();
        }
        if path.starts_with("/v1/sessions") {
            return endless("application/json", b"{\"data\": [", b"{},");
        }
        empty_list(method, path).unwrap_or_else(|| endless("text/event-stream", b"data: ", b"x"))
    }));
    let dir = tempfile::tempdir().unwrap();
    let catalog = catalog(dir.path(), "bounds/sse.yaml", SSE_SCENARIO);
    let m = run(
        &url,
        dir.path(),
        &catalog,
        &["--max-body-bytes", "1M", "--max-event-bytes", "256K"],
    );
    assert_eq!(
        m.code,
        Some(1),
        "the sweep could not finish: not conformant"
    );
    let r = receipt::predicate(&dir.path().join("out"));
    let error = r["cleanup"]["run_sweep"]["error"].as_str().unwrap();
    assert!(
        error.contains(
            "GET /v1/sessions: the response body exceeds --max-body-bytes (1048576 bytes)"
        ),
        "{error}"
    );
    bounded(&m, SMALL_PEAK_BOUND_KIB);
}

/// What the caps leave as it was: a redirect to another origin is not followed (the other
/// origin sees no request), a body that is not JSON where JSON is required and an event stream
/// that is not UTF-8 are plain FAILs with their reasons, and nothing panics.
#[test]
fn redirects_broken_json_and_invalid_utf8_are_plain_fails() {
    let other = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = other.clone();
    let elsewhere = serve(Box::new(move |_, _| {
        seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        json(201, json!({"id": "local:sbx_elsewhere"}))
    }));
    let url = serve(Box::new(move |method, path| {
        if path == "/v1/capabilities" {
            return v1_capabilities();
        }
        match (method, path) {
            ("POST", "/v1/sandboxes") => Answer::Raw(
                format!(
                    "HTTP/1.1 307 Temporary Redirect\r\nLocation: {elsewhere}/v1/sandboxes\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
                .into_bytes(),
            ),
            ("GET", p) if p.starts_with("/v1/sandboxes?") && p.contains("broken") => {
                Answer::Whole(200, "application/json", "{\"data\": [".to_owned())
            }
            ("GET", "/v1/processes/p/events") => {
                let mut raw = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\nid: 1\ndata: {\"seq\":1,\"data\":\"".to_vec();
                raw.extend_from_slice(b"\xff\xfe\"}\n\n");
                Answer::Raw(raw)
            }
            _ => empty_list(method, path).unwrap_or_else(|| json(404, json!({"code": "not_found"}))),
        }
    }));
    let dir = tempfile::tempdir().unwrap();
    let scenarios = [
        (
            "redirect.yaml",
            "id: BND-REDIRECT-001\ntitle: A create\nclauses: [SBX-3.1]\nlevel: SHOULD\nsteps:\n  - request: {method: POST, path: /v1/sandboxes, json: {metadata: {sandspec_run: \"{{run_id}}\"}}, expect: {status: 201}}\n",
        ),
        (
            "json.yaml",
            "id: BND-JSON-001\ntitle: A list\nclauses: [SBX-3.12]\nlevel: SHOULD\nsteps:\n  - request: {method: GET, path: /v1/sandboxes, query: {broken: \"yes\"}, expect: {status: 200, json: [{pointer: /data, length: 0}]}}\n",
        ),
        ("utf8.yaml", SSE_SCENARIO),
    ];
    let mut catalog_dir = None;
    for (file, yaml) in scenarios {
        catalog_dir = Some(catalog(dir.path(), &format!("bounds/{file}"), yaml));
    }
    let m = run(&url, dir.path(), &catalog_dir.unwrap(), &[]);
    assert_eq!(m.code, Some(1), "not conformant");
    assert!(!m.stderr.contains("panicked"), "{}", m.stderr);
    assert_eq!(
        other.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the redirect was followed"
    );
    let redirect = reason_of(dir.path(), "BND-REDIRECT-001");
    assert!(redirect.contains("status 307, expected 201"), "{redirect}");
    let broken = reason_of(dir.path(), "BND-JSON-001");
    assert!(broken.contains("response body is not JSON"), "{broken}");
    let utf8 = reason_of(dir.path(), "BND-SSE-001");
    assert!(
        utf8.contains("framing: line 2 is not valid UTF-8"),
        "{utf8}"
    );
}

/// A launched service that prints 200 MB on one line and exits: the start fails with its
/// output, whose line is kept cut to the output line cap.
#[test]
fn a_launched_service_printing_an_endless_line_is_kept_to_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<String> = [
        "run",
        "--api",
        "agent-sandbox",
        "--launch",
        "head -c 200000000 /dev/zero | tr '\\0' x; exit 1",
        "--out",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([dir.path().join("out").display().to_string()])
    .collect();
    let m = run_measured(&args, &[], RUN_WITHIN);
    eprintln!("peak {} KiB in {:?}", m.peak_kib, m.took);
    assert_eq!(m.code, Some(3), "{}", m.stderr);
    assert!(
        m.stderr.contains("(a line of 200000000 bytes, cut)"),
        "{}",
        m.stderr
    );
    bounded(&m, SMALL_PEAK_BOUND_KIB);
}

/// A request's `within_s` bounds how long its answer may take: an answer that comes later
/// fails the step at that bound (the connection closed then, not at the request timeout),
/// and one that comes in time passes the same scenario.
#[test]
fn an_answer_later_than_its_within_s_fails_at_that_step() {
    let url = serve(Box::new(|method, path| {
        if path == "/v1/capabilities" {
            return v1_capabilities();
        }
        match (method, path) {
            ("DELETE", "/v1/sandboxes/slow") => {
                std::thread::sleep(Duration::from_secs(20));
                json(204, json!({}))
            }
            ("DELETE", "/v1/sandboxes/quick") => json(200, json!({})),
            _ => {
                empty_list(method, path).unwrap_or_else(|| json(404, json!({"code": "not_found"})))
            }
        }
    }));
    let dir = tempfile::tempdir().unwrap();
    let scenario = |id: &str, which: &str| {
        format!(
            "id: {id}\ntitle: A delete answers in time\nclauses: [SBX-3.1]\nlevel: SHOULD\nsteps:\n  - request: {{method: GET, path: /v1/capabilities}}\n  - request: {{name: delete it, method: DELETE, path: /v1/sandboxes/{which}, within_s: 2}}\n"
        )
    };
    catalog(
        dir.path(),
        "bounds/slow.yaml",
        &scenario("BND-WITHIN-001", "slow"),
    );
    let catalog_dir = catalog(
        dir.path(),
        "bounds/quick.yaml",
        &scenario("BND-WITHIN-002", "quick"),
    );
    let m = run(&url, dir.path(), &catalog_dir, &[]);
    assert_eq!(m.code, Some(1), "not conformant");
    let slow = reason_of(dir.path(), "BND-WITHIN-001");
    assert!(
        slow.starts_with("steps[1] delete it") && slow.contains("no whole answer within 2s"),
        "{slow}"
    );
    let r = receipt::predicate(&dir.path().join("out"));
    assert_eq!(receipt::scenario(&r, "BND-WITHIN-002")["outcome"], "pass");
    // Cut at the bound: well before the slow answer (20 s) or the request timeout (30 s).
    assert!(
        m.took < Duration::from_secs(15),
        "the run took {:?}",
        m.took
    );
}

/// A stream that ends for its bound (`stream.end {reason: max_duration}`) before its subject
/// ends: a `follow` step resumes it from the cursor its end names, with `Last-Event-ID`, and
/// judges both connections as one stream; the same step without `follow` fails at the end the
/// bound made; a stream that never reaches its end condition fails a `follow` step at its
/// deadline rather than being followed for ever.
#[test]
fn a_followed_stream_is_resumed_after_its_bound_and_still_fails_when_it_never_ends() {
    const BOUNDED: &str = "id: 1\nevent: begun\ndata: {\"seq\":1}\n\nevent: stream.end\ndata: {\"reason\":\"max_duration\",\"resume_after\":1}\n\n";
    let url = crate::support::hostile::serve_with_head(Box::new(|method, path, head| {
        if path == "/v1/capabilities" {
            return v1_capabilities();
        }
        let resumed_at = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("last-event-id")
                    .then(|| v.trim().to_owned())
            })
            .unwrap_or_default();
        let sse = |body: &str| Answer::Whole(200, "text/event-stream", body.to_owned());
        match (method, path, resumed_at.as_str()) {
            ("GET", "/v1/jobs/ends/events" | "/v1/jobs/endless/events", "") => sse(BOUNDED),
            ("GET", "/v1/jobs/ends/events", "1") => {
                sse("id: 2\nevent: done\ndata: {\"seq\":2}\n\n")
            }
            // Resumed, it has nothing more, and ends for its bound again a moment later.
            ("GET", "/v1/jobs/endless/events", "1") => {
                std::thread::sleep(Duration::from_millis(300));
                sse("event: stream.end\ndata: {\"reason\":\"max_duration\",\"resume_after\":1}\n\n")
            }
            _ => {
                empty_list(method, path).unwrap_or_else(|| json(400, json!({"code": "bad_cursor"})))
            }
        }
    }));
    let dir = tempfile::tempdir().unwrap();
    let scenario = |id: &str, job: &str, follow: bool| {
        format!(
            "id: {id}\ntitle: A job's stream ends after its end\nclauses: [SSE-7.2]\nlevel: SHOULD\nsteps:\n  - request: {{method: GET, path: /v1/capabilities}}\n  - sse:\n      name: the job's stream\n      path: /v1/jobs/{job}/events\n      within_s: 3\n      follow: {follow}\n      events: [{{event: begun, id: \"1\"}}]\n      last_event: {{event: done}}\n"
        )
    };
    catalog(
        dir.path(),
        "follow/followed.yaml",
        &scenario("FOL-001", "ends", true),
    );
    catalog(
        dir.path(),
        "follow/not-followed.yaml",
        &scenario("FOL-002", "ends", false),
    );
    let catalog_dir = catalog(
        dir.path(),
        "follow/endless.yaml",
        &scenario("FOL-003", "endless", true),
    );
    let m = run(&url, dir.path(), &catalog_dir, &[]);
    assert_eq!(m.code, Some(1), "not conformant");
    let r = receipt::predicate(&dir.path().join("out"));
    assert_eq!(receipt::scenario(&r, "FOL-001")["outcome"], "pass");
    let not_followed = reason_of(dir.path(), "FOL-002");
    assert!(
        not_followed.starts_with("steps[1] the job's stream")
            && not_followed
                .contains("last event (#1) is `stream.end` ({\"reason\":\"max_duration\""),
        "{not_followed}"
    );
    let endless = reason_of(dir.path(), "FOL-003");
    // Followed until the deadline: it fails there, whether the last connection was being
    // read or was still being opened.
    assert!(
        endless.starts_with("steps[1] the job's stream")
            && (endless.contains("stream did not reach its end condition within 3s")
                || endless.contains("following the stream from 1: no response")),
        "{endless}"
    );
}

/// `leave_after_ms` counts from the answer's head: a client that goes away after reading a
/// long answer for a while reads it for that long even when the head comes later than that
/// (a loaded target), then closes the connection instead of reading on.
#[test]
fn leaving_early_counts_from_the_head_and_closes_the_answer() {
    let url = serve(Box::new(|method, path| {
        if path == "/v1/capabilities" {
            return v1_capabilities();
        }
        match (method, path) {
            ("POST", "/v1/jobs") => {
                std::thread::sleep(Duration::from_millis(1500));
                Answer::Trickle {
                    content_type: "application/x-ndjson",
                    first: b"{\"type\":\"started\"}\n".to_vec(),
                    again: b"{\"type\":\"output\"}\n".to_vec(),
                    every: Duration::from_millis(100),
                }
            }
            _ => {
                empty_list(method, path).unwrap_or_else(|| json(404, json!({"code": "not_found"})))
            }
        }
    }));
    let dir = tempfile::tempdir().unwrap();
    let catalog_dir = catalog(
        dir.path(),
        "leave/late-head.yaml",
        "id: LEAVE-001\ntitle: A job is left while it runs\nclauses: [SBX-3.1]\nlevel: SHOULD\nsteps:\n  - request: {method: GET, path: /v1/capabilities}\n  - request:\n      name: start it and go away\n      method: POST\n      path: /v1/jobs\n      json: {}\n      leave_after_ms: 1000\n      expect:\n        status: 200\n        json_lines:\n          - {pointer: \"\", includes: {type: started}}\n          - {pointer: \"\", includes: {type: output}}\n          - {pointer: \"\", excludes: {type: done}}\n",
    );
    let m = run(&url, dir.path(), &catalog_dir, &[]);
    let r = receipt::predicate(&dir.path().join("out"));
    assert_eq!(
        receipt::scenario(&r, "LEAVE-001")["outcome"],
        "pass",
        "{}",
        m.stdout
    );
    // Left about a second after the head: nowhere near the 30 s request timeout.
    assert!(
        m.took < Duration::from_secs(15),
        "the run took {:?}",
        m.took
    );
}
