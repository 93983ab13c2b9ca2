//! Evidence run folders: the writer sanitizes and refuses leaks (the canary above all),
//! `verify` catches tampering and pasted tokens, receipts satisfy the published schema, the
//! honesty rules hold, and an independent scanner (detect-secrets) finds nothing.

use crate::support::command;
use crate::support::venv;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use sandspec::engine::run_all;
use sandspec::engine::{Body, Credential, Entry, Frame, HttpExchange, Note, Outcome, SseExchange};
use sandspec::evidence::{
    ENVELOPE, Envelope, EvidenceError, OutcomeLabel, PAYLOAD_TYPE, Problem, Sanitizer, SigningKey,
    Statement, Subject, SubjectSource, VerifyingKey, WriteOptions, for_tokens, new_canary,
    normalize, sanitized_report, sha256_hex, validate_receipt, verify, verify_cli, verify_with_key,
    write_run_folder,
};
use sandspec::report::{RunFacts, RunReport, ScenarioReport, TargetInfo};
use sandspec::scenario::{Level, Principal, load_dir_partial};
use sandspec::target::{ReferenceOptions, Target};

const OWNER_TOKEN: &str = "sst_0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";
const OTHER_TOKEN: &str = "sst_aa11bb22cc33dd44ee55ff66aa11bb22cc33dd44ee55ff66aa11bb22cc33dd44";
const DB_PASSWORD: &str = "hunter2-correct-horse";
const PREVIEW_TOKEN: &str = "pvt9d8c7b6a5f4e3d2c1b0a";
const SBX: &str = "local:sbx_01jabcdefghjkmnpqrstvwxyz0";

/// Everything a test needs: the run's secrets, a sanitizer that knows the tokens, and a
/// canary that it deliberately does not know.
struct Run {
    canary: String,
    sanitizer: Sanitizer,
}

impl Run {
    fn new() -> Run {
        let mut sanitizer = Sanitizer::new();
        sanitizer.add_secret(OWNER_TOKEN, "owner-token").unwrap();
        sanitizer.add_secret(OTHER_TOKEN, "other-token").unwrap();
        sanitizer
            .add_secret(DB_PASSWORD, "database-password")
            .unwrap();
        Run {
            canary: new_canary(),
            sanitizer,
        }
    }

    fn options(&self) -> WriteOptions {
        WriteOptions {
            canary: self.canary.clone(),
            subject: Subject {
                name: "sandspec".into(),
                sha256: "ab".repeat(32),
                source: SubjectSource::ReferenceBinary,
            },
            interrupted: false,
            not_run: Vec::new(),
            sign_key: None,
            gate: None,
        }
    }

    fn write(&self, report: &RunReport, dest: &Path) -> Result<PathBuf, EvidenceError> {
        write_run_folder(dest, report, &self.sanitizer, &self.options())
    }
}

fn text(s: &str) -> Option<Body> {
    Some(Body::of(s.as_bytes()))
}

fn http(
    step: &str,
    method: &str,
    target: &str,
    status: u16,
    request: Option<Body>,
    response: Option<Body>,
) -> Entry {
    Entry::Http(HttpExchange {
        step: step.into(),
        at_ms: 5,
        credential: Credential::Principal(Principal::Owner),
        method: method.into(),
        target: target.into(),
        request_headers: vec![("content-type".into(), "application/json".into())],
        request_body: request,
        status: Some(status),
        response_headers: vec![(
            "x-request-id".into(),
            "req_01jabcdefghjkmnpqrstvwxyz0".into(),
        )],
        response_body: response,
        duration_ms: 3,
        error: None,
    })
}

fn scenario(
    id: &str,
    family: &str,
    level: Level,
    outcome: Outcome,
    transcript: Vec<Entry>,
) -> ScenarioReport {
    ScenarioReport {
        id: id.into(),
        title: format!("{id} title"),
        family: family.into(),
        file: format!("scenarios/{family}/{id}.yaml"),
        level,
        clauses: vec!["SBX-3.1".into()],
        tags: vec![],
        defects: vec![],
        outcome,
        started_ms: 0,
        duration_ms: 120,
        attempts: 1,
        measurements: BTreeMap::new(),
        swept: vec![],
        faults: vec![],
        throttled: Default::default(),
        transcript,
    }
}

/// A run with one passing lifecycle scenario full of secrets the sanitizer must remove, an
/// SSE stream, a failing MUST, a skipped SHOULD and an error.
fn report(canary: &str) -> RunReport {
    let create_body = format!(r#"{{"template":"base","metadata":{{"canary_secret":"{canary}"}}}}"#);
    let created =
        format!(r#"{{"id":"{SBX}","state":"running","metadata":{{"canary_secret":"{canary}"}}}}"#);
    let mut create = http(
        "steps[0] create",
        "POST",
        "/v1/sandboxes",
        201,
        text(&create_body),
        text(&created),
    );
    if let Entry::Http(h) = &mut create {
        h.request_headers
            .push(("X-Sandspec-Canary".into(), canary.into()));
        h.request_headers
            .push(("Cookie".into(), format!("session={OWNER_TOKEN}")));
        h.response_headers
            .push(("set-cookie".into(), "sid=abcdef0123456789".into()));
    }
    let preview = format!(
        r#"{{"id":"prv_01jabcdefghjkmnpqrstvwxyz3","url":"http://127.0.0.1:4000/previews/prv_01jabcdefghjkmnpqrstvwxyz3/?preview_token={PREVIEW_TOKEN}","port":8080}}"#
    );
    let echo = format!(
        r#"{{"headers":{{"authorization":"Bearer {OWNER_TOKEN}"}},"seen":"{OWNER_TOKEN}"}}"#
    );
    let db_error =
        format!("store unreachable at postgres://sandspec:{DB_PASSWORD}@127.0.0.1:5432/sandspec");
    let api_key = "config has sk-live0123456789abcdefghij and ghp_0123456789abcdefghijABCDEFGHIJ";
    let mut lifecycle = scenario(
        "SBX-LIFE-001",
        "lifecycle",
        Level::Must,
        Outcome::Pass,
        vec![
            create,
            http(
                "steps[1] preview",
                "POST",
                &format!("/v1/sandboxes/{SBX}/previews"),
                201,
                text(r#"{"port":8080}"#),
                text(&preview),
            ),
            http(
                "steps[2] open preview",
                "GET",
                &format!("/previews/prv_01jabcdefghjkmnpqrstvwxyz3/?preview_token={PREVIEW_TOKEN}"),
                200,
                None,
                text(&echo),
            ),
            http(
                "steps[3] health",
                "GET",
                "/v1/health",
                503,
                None,
                text(&db_error),
            ),
            http(
                "steps[4] config",
                "GET",
                "/v1/capabilities",
                200,
                None,
                text(api_key),
            ),
            Entry::Sse(SseExchange {
                step: "steps[5] events".into(),
                at_ms: 40,
                credential: Credential::Principal(Principal::Owner),
                target: "/v1/processes/local:prc_01jabcdefghjkmnpqrstvwxyz4/events".into(),
                last_event_id: None,
                status: Some(200),
                response_headers: vec![("content-type".into(), "text/event-stream".into())],
                frames: vec![
                    Frame::Event {
                        at_ms: 52,
                        event: "stdout".into(),
                        id: Some("1".into()),
                        data: format!(r#"{{"seq":1,"data":"token {OTHER_TOKEN}"}}"#),
                    },
                    Frame::Comment {
                        at_ms: 60,
                        text: " ping".into(),
                    },
                    Frame::Event {
                        at_ms: 75,
                        event: "exit".into(),
                        id: Some("2".into()),
                        data: r#"{"seq":2,"state":"exited","exit_code":0,"signal":null}"#.into(),
                    },
                ],
                first_frame_ms: Some(12),
                eof_ms: Some(35),
                end: "eof".into(),
            }),
            http(
                "cleanup[0] DELETE /v1/sandboxes/{{sbx}}",
                "DELETE",
                &format!("/v1/sandboxes/{SBX}"),
                204,
                None,
                None,
            ),
            http(
                "cleanup[1] absent",
                "GET",
                &format!("/v1/sandboxes/{SBX}"),
                404,
                None,
                text(r#"{"code":"not_found"}"#),
            ),
            http(
                "cleanup[1] absent",
                "GET",
                "/v1/sandboxes?limit=100",
                200,
                None,
                text(r#"{"data":[],"has_more":false}"#),
            ),
            Entry::Note(Note {
                at_ms: 90,
                text: format!("swept with Authorization: Bearer {OWNER_TOKEN}"),
            }),
        ],
    );
    lifecycle
        .measurements
        .insert("time_to_first_frame".into(), 0.012);
    lifecycle.measurements.insert("time_to_eof".into(), 0.035);
    let auth = scenario(
        "AUTH-NOAUTH-001",
        "auth",
        Level::Must,
        Outcome::Fail {
            step: "steps[0] GET /v1/sandboxes".into(),
            reason: "status 200, expected 401".into(),
        },
        vec![
            http(
                "steps[0] GET /v1/sandboxes",
                "GET",
                "/v1/sandboxes",
                200,
                None,
                text(r#"{"data":[]}"#),
            ),
            http(
                "steps[1] GET /v1/capabilities",
                "GET",
                "/v1/capabilities",
                401,
                None,
                text(r#"{"code":"unauthenticated"}"#),
            ),
            http(
                "steps[2] GET /v1/sandboxes/x",
                "GET",
                "/v1/sandboxes/x",
                403,
                None,
                text(r#"{"code":"permission_denied"}"#),
            ),
        ],
    );
    let skip = scenario(
        "SBX-PAUSE-001",
        "lifecycle",
        Level::Should,
        Outcome::Skip {
            reason: "target does not advertise `pause`".into(),
        },
        vec![],
    );
    let error = scenario(
        "PRC-STREAM-001",
        "processes",
        Level::Must,
        Outcome::Error {
            reason: "target unreachable".into(),
        },
        vec![],
    );
    let scenarios = vec![lifecycle, auth, skip, error];
    RunReport {
        run_id: "01jrunidabcdefghjkmnpqrstv".into(),
        suite_version: "0.1.0".into(),
        started_at: "2026-01-02T03:04:05Z".into(),
        finished_at: "2026-01-02T03:04:09.5Z".into(),
        duration_ms: 4500,
        target: TargetInfo {
            kind: "reference".into(),
            url: format!("http://alice:{DB_PASSWORD}@127.0.0.1:4000"),
            server_name: Some("sandspec-reference".into()),
            server_version: Some("0.1.0".into()),
            defects: vec![],
            capabilities: serde_json::json!({"api_version": "v1", "server": {"name": "sandspec-reference", "version": "0.1.0"}, "admin_token": "whatever-it-is"}),
        },
        profile: "all".into(),
        filters: vec![],
        shard: None,
        label: None,
        retries: 0,
        certify: false,
        profiles: RunReport::judge(&scenarios, &whole_catalog(&scenarios)),
        scenarios,
        run_sweep: Default::default(),
        not_applicable: Vec::new(),
        sdk_matrix: None,
        consumption: Default::default(),
    }
}

/// The facts of a run of a whole catalog that holds exactly these scenarios.
fn whole_catalog(scenarios: &[ScenarioReport]) -> RunFacts {
    RunFacts::whole_catalog(scenarios.iter().map(|s| s.family.as_str()))
}

/// Every file of a folder, by relative path.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                out.insert(
                    p.strip_prefix(root).unwrap().to_string_lossy().into_owned(),
                    std::fs::read(&p).unwrap(),
                );
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

fn receipt(dir: &Path) -> Statement {
    serde_json::from_slice(&std::fs::read(dir.join("receipt.json")).unwrap()).unwrap()
}

/// Copies a folder.
fn copy(from: &Path, to: &Path) {
    for (rel, bytes) in files(from) {
        let p = to.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    }
}

/// Rewrites `manifest.json` so it matches the folder again: after this only the schema and
/// the secret scan can notice a change.
fn reseal(dir: &Path) {
    let entries: Vec<serde_json::Value> = files(dir)
        .into_iter()
        .filter(|(rel, _)| rel != "manifest.json")
        .map(|(rel, bytes)| serde_json::json!({"path": rel, "sha256": sha256_hex(&bytes), "bytes": bytes.len()}))
        .collect();
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec_pretty(&serde_json::json!({"files": entries})).unwrap(),
    )
    .unwrap();
}

#[test]
fn a_clean_folder_is_written_and_verifies() {
    let run = Run::new();
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("runs").join("r1");
    let written = run.write(&report(&run.canary), &dest).unwrap();
    assert_eq!(written, dest);

    let all = files(&dest);
    let names: Vec<&str> = all.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "junit.xml",
            "manifest.json",
            "receipt.json",
            "report.html",
            "summary.md",
            "transcripts/AUTH-NOAUTH-001.json",
            "transcripts/PRC-STREAM-001.json",
            "transcripts/SBX-LIFE-001.json",
            "transcripts/SBX-PAUSE-001.json"
        ]
    );
    for (name, bytes) in &all {
        let text = String::from_utf8(bytes.clone()).unwrap();
        for secret in [
            OWNER_TOKEN,
            OTHER_TOKEN,
            DB_PASSWORD,
            PREVIEW_TOKEN,
            run.canary.as_str(),
            "sk-live0123",
            "ghp_0123",
            "abcdef0123456789",
            "whatever-it-is",
        ] {
            assert!(!text.contains(secret), "{name} still holds {secret}");
        }
    }
    // What the sanitizer keeps is still there: the transcript is evidence, not an empty shell.
    let life = String::from_utf8(all["transcripts/SBX-LIFE-001.json"].clone()).unwrap();
    assert!(
        life.contains(SBX)
            && life.contains("preview_token=[REDACTED]")
            && life.contains("postgres://sandspec:[REDACTED]@"),
        "{life}"
    );
    assert!(
        life.contains(r#"\"canary_secret\":\"[REDACTED]\""#),
        "{life}"
    );

    let report = verify(&dest);
    assert!(report.ok(), "{:?}", report.problems);
    assert_eq!(report.files_checked, 9);
    assert_eq!(verify_cli(&dest, None), 0);
}

#[test]
fn the_receipt_says_what_happened() {
    let run = Run::new();
    let tmp = tempfile::tempdir().unwrap();
    let dest = run
        .write(&report(&run.canary), &tmp.path().join("r"))
        .unwrap();
    let raw: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dest.join("receipt.json")).unwrap()).unwrap();
    validate_receipt(&raw).unwrap();
    assert_eq!(raw["_type"], "https://in-toto.io/Statement/v1");
    assert_eq!(raw["predicateType"], "https://sandspec.dev/receipt/v1");
    assert_eq!(raw["subject"][0]["digest"]["sha256"], "ab".repeat(32));

    let r = receipt(&dest).predicate;
    assert_eq!(
        r.target.base_url, "http://127.0.0.1:4000",
        "credentials are dropped from the URL"
    );
    assert_eq!(r.target.api_version.as_deref(), Some("v1"));
    assert!(!r.interrupted && r.not_run.is_empty());
    let by_id = |id: &str| r.scenarios.iter().find(|s| s.id == id).unwrap();
    // A failure stays a failure, with its step and reason; an error is not a pass either.
    let auth = by_id("AUTH-NOAUTH-001");
    assert_eq!(auth.outcome, OutcomeLabel::Fail);
    assert_eq!(
        auth.failed_step.as_deref(),
        Some("steps[0] GET /v1/sandboxes")
    );
    assert_eq!(
        auth.reason.as_deref(),
        Some("steps[0] GET /v1/sandboxes: status 200, expected 401")
    );
    assert_eq!(by_id("PRC-STREAM-001").outcome, OutcomeLabel::Error);
    // A skip carries its reason.
    assert_eq!(
        by_id("SBX-PAUSE-001").reason.as_deref(),
        Some("target does not advertise `pause`")
    );
    let all = r.profiles.iter().find(|p| p.profile == "all").unwrap();
    assert_eq!(all.verdict, "non-conformant");

    let c = &r.counts;
    assert_eq!(
        (c.total, c.pass, c.flaky, c.skip, c.fail, c.error, c.not_run),
        (4, 1, 0, 1, 1, 1, 0)
    );
    // 2xx: create, preview, open, capabilities, SSE, delete, list, and the auth scenario's 200.
    assert_eq!(c.positive_operations, 8);
    assert_eq!(c.authentication_rejections, 2);
    assert_eq!(c.requests, 12);

    let m: Vec<(&str, f64)> = r
        .measurements
        .iter()
        .map(|m| (m.name.as_str(), m.seconds))
        .collect();
    assert_eq!(m, [("time_to_eof", 0.035), ("time_to_first_frame", 0.012)]);
    assert_eq!(r.streams.len(), 1);
    assert_eq!(
        (
            r.streams[0].first_frame_ms,
            r.streams[0].eof_ms,
            r.streams[0].events
        ),
        (Some(12), Some(35), 2)
    );
    assert_eq!(r.cleanup.confirmed_absent.len(), 1);
    assert_eq!(
        r.cleanup.confirmed_absent[0].path,
        "/v1/sandboxes/local:<sbx-1>"
    );
    assert!(r.sanitizer.canary_checked);
    assert_eq!(r.sanitizer.secrets_registered, 3);

    // The transcript digest in the receipt is the transcript's.
    let t = by_id("SBX-LIFE-001").transcript.clone().unwrap();
    assert_eq!(
        t.sha256,
        sha256_hex(&std::fs::read(dest.join(&t.path)).unwrap())
    );

    let summary = std::fs::read_to_string(dest.join("summary.md")).unwrap();
    assert!(summary.contains("**FAIL** `AUTH-NOAUTH-001`"), "{summary}");
    assert!(summary.contains("**ERROR** `PRC-STREAM-001`"), "{summary}");
    assert!(
        summary.contains(
            "`SBX-PAUSE-001` SBX-PAUSE-001 title (SHOULD): target does not advertise `pause`"
        ),
        "{summary}"
    );
    assert!(
        summary.contains("| all | **non-conformant** |"),
        "{summary}"
    );
    let junit = std::fs::read_to_string(dest.join("junit.xml")).unwrap();
    assert!(
        junit.contains(r#"failures="1" errors="1" skipped="1""#),
        "{junit}"
    );
}

#[test]
fn an_echoed_authorization_value_makes_writing_fail() {
    // The scenario sent the canary as its Authorization value (literal header, not kept in
    // the transcript); the target echoed it back in a response body, where no rule can
    // recognise it as a credential.
    let run = Run::new();
    let mut rep = report(&run.canary);
    rep.scenarios[1].transcript.push(Entry::Http(HttpExchange {
        credential: Credential::ScenarioLiteral,
        ..match http(
            "steps[3] GET /echo",
            "GET",
            "/v1/echo",
            200,
            None,
            text(&format!(r#"{{"you_sent":"{}"}}"#, run.canary)),
        ) {
            Entry::Http(h) => h,
            _ => unreachable!(),
        }
    }));
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("r");
    let err = run.write(&rep, &dest).unwrap_err();
    match &err {
        EvidenceError::Leak { file, what } => {
            assert!(
                file.starts_with("transcripts/AUTH-NOAUTH-001.json:"),
                "{file}"
            );
            assert_eq!(what, "canary");
        }
        other => panic!("expected a leak, got {other}"),
    }
    assert!(
        !err.to_string().contains(&run.canary),
        "the error must not print the secret: {err}"
    );
    assert!(!dest.exists(), "nothing is written");
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "no temporary directory is left behind"
    );
}

#[test]
fn an_echo_in_a_recognisable_credential_place_is_removed_instead() {
    // Echoed as an Authorization header or field, the canary is removed like any credential,
    // so the folder is written, and holds no canary.
    let run = Run::new();
    let mut rep = report(&run.canary);
    let body = format!(
        r#"{{"headers":{{"Authorization":"{0}"}},"raw":"Authorization: {0}"}}"#,
        run.canary
    );
    rep.scenarios[1].transcript.push(http(
        "steps[3] GET /echo",
        "GET",
        "/v1/echo",
        200,
        None,
        text(&body),
    ));
    let tmp = tempfile::tempdir().unwrap();
    let dest = run.write(&rep, &tmp.path().join("r")).unwrap();
    for (name, bytes) in files(&dest) {
        assert!(
            !String::from_utf8_lossy(&bytes).contains(&run.canary),
            "{name}"
        );
    }
}

#[test]
fn a_sanitized_report_holds_no_secret() {
    let run = Run::new();
    let clean = sanitized_report(&report(&run.canary), &run.sanitizer);
    let json = serde_json::to_string(&clean).unwrap();
    for secret in [OWNER_TOKEN, OTHER_TOKEN, DB_PASSWORD, PREVIEW_TOKEN] {
        assert!(!json.contains(secret), "{secret}");
    }
    assert_eq!(
        clean.scenarios[1].outcome,
        report(&run.canary).scenarios[1].outcome,
        "outcomes are kept"
    );
}

#[test]
fn a_canary_in_a_binary_body_is_found_too() {
    let run = Run::new();
    let mut rep = report(&run.canary);
    let mut bytes = vec![0xff, 0xfe, 0x00];
    bytes.extend_from_slice(run.canary.as_bytes());
    rep.scenarios[0].transcript.push(http(
        "steps[9] read",
        "GET",
        "/v1/x",
        200,
        None,
        Some(Body::of(&bytes)),
    ));
    let tmp = tempfile::tempdir().unwrap();
    match run.write(&rep, &tmp.path().join("r")).unwrap_err() {
        EvidenceError::Leak { what, .. } => assert_eq!(what, "canary"),
        other => panic!("expected a leak, got {other}"),
    }
}

#[test]
fn an_echoed_token_is_redacted_not_refused() {
    // Tokens are known secrets: the sanitizer removes them, even from binary bodies.
    let run = Run::new();
    let mut rep = report(&run.canary);
    let mut bytes = vec![0xff, 0xfe];
    bytes.extend_from_slice(OWNER_TOKEN.as_bytes());
    rep.scenarios[0].transcript.push(http(
        "steps[9] read",
        "GET",
        "/v1/x",
        200,
        None,
        Some(Body::of(&bytes)),
    ));
    let tmp = tempfile::tempdir().unwrap();
    let dest = run.write(&rep, &tmp.path().join("r")).unwrap();
    let life = std::fs::read_to_string(dest.join("transcripts/SBX-LIFE-001.json")).unwrap();
    let b64 = {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(&bytes)
    };
    assert!(!life.contains(&b64));
    assert!(verify(&dest).ok());
}

#[test]
fn a_canary_registered_for_redaction_is_refused() {
    let mut run = Run::new();
    let canary = run.canary.clone();
    run.sanitizer.add_secret(&canary, "canary").unwrap();
    let tmp = tempfile::tempdir().unwrap();
    assert!(matches!(
        run.write(&report(&canary), &tmp.path().join("r")),
        Err(EvidenceError::CanaryDisarmed)
    ));
}

#[test]
fn an_existing_folder_is_not_overwritten() {
    let run = Run::new();
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("r");
    std::fs::create_dir_all(&dest).unwrap();
    // An empty destination (a fresh `--out` directory) is fine...
    run.write(&report(&run.canary), &dest).unwrap();
    // ...a folder with evidence in it is not.
    assert!(matches!(
        run.write(&report(&run.canary), &dest),
        Err(EvidenceError::Exists(_))
    ));
    assert!(verify(&dest).ok());
}

#[test]
fn an_interrupted_run_says_so_and_lists_what_never_ran() {
    let run = Run::new();
    let mut rep = report(&run.canary);
    // All four were selected; two never ran.
    let facts = RunFacts {
        never_ran: 2,
        ..whole_catalog(&rep.scenarios)
    };
    rep.scenarios.truncate(2);
    rep.profiles = RunReport::judge(&rep.scenarios, &facts);
    let options = WriteOptions {
        interrupted: true,
        not_run: vec!["SBX-PAUSE-001".into(), "PRC-STREAM-001".into()],
        ..run.options()
    };
    let tmp = tempfile::tempdir().unwrap();
    let dest = write_run_folder(&tmp.path().join("r"), &rep, &run.sanitizer, &options).unwrap();
    let r = receipt(&dest).predicate;
    assert!(r.interrupted);
    assert_eq!(r.not_run, ["SBX-PAUSE-001", "PRC-STREAM-001"]);
    assert_eq!((r.counts.total, r.counts.not_run), (2, 2));
    let summary = std::fs::read_to_string(dest.join("summary.md")).unwrap();
    assert!(
        summary.contains("**Interrupted.**")
            && summary.contains("2 never ran: SBX-PAUSE-001, PRC-STREAM-001"),
        "{summary}"
    );
    assert!(verify(&dest).ok());

    // Scenarios listed as never run without the interruption flag would be a contradiction.
    let bad = WriteOptions {
        interrupted: false,
        ..options
    };
    assert!(matches!(
        write_run_folder(&tmp.path().join("r2"), &rep, &run.sanitizer, &bad),
        Err(EvidenceError::NotRunWithoutInterruption)
    ));
}

/// A written folder in a temporary directory, and its sibling copy for tampering.
fn written_and_copy() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let run = Run::new();
    let tmp = tempfile::tempdir().unwrap();
    let dest = run
        .write(&report(&run.canary), &tmp.path().join("r"))
        .unwrap();
    let copy_dir = tmp.path().join("copy");
    copy(&dest, &copy_dir);
    assert!(verify(&copy_dir).ok(), "an exact copy verifies");
    (tmp, dest, copy_dir)
}

#[test]
fn verify_fails_on_one_changed_byte() {
    let (_tmp, _dest, copy_dir) = written_and_copy();
    let path = copy_dir.join("summary.md");
    let mut bytes = std::fs::read(&path).unwrap();
    let i = bytes.iter().position(|b| *b == b'P').unwrap();
    bytes[i] = b'Q';
    std::fs::write(&path, bytes).unwrap();
    let report = verify(&copy_dir);
    assert_eq!(
        report.problems,
        [
            Problem::DigestMismatch("summary.md".into()),
            Problem::Inconsistent("summary.md differs from the receipt's digest".into())
        ]
    );
    assert_eq!(verify_cli(&copy_dir, None), 1);
}

#[test]
fn verify_fails_on_a_pasted_token_even_with_a_matching_manifest() {
    let (_tmp, _dest, copy_dir) = written_and_copy();
    let path = copy_dir.join("summary.md");
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str("\nreplay with: curl -H 'Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJlMDEyMzQ1'\n");
    std::fs::write(&path, text).unwrap();
    reseal(&copy_dir);
    let report = verify(&copy_dir);
    assert!(!report.ok());
    // The resealed manifest hides nothing: the receipt names summary.md's digest too.
    assert!(
        report
            .problems
            .iter()
            .any(|p| matches!(p, Problem::Secret { file, .. } if file == "summary.md")),
        "{:?}",
        report.problems
    );
    assert!(
        report.problems.iter().all(|p| match p {
            Problem::Secret { file, .. } => file == "summary.md",
            Problem::Inconsistent(d) => d == "summary.md differs from the receipt's digest",
            _ => false,
        }),
        "{:?}",
        report.problems
    );
    let shown: Vec<String> = report.problems.iter().map(ToString::to_string).collect();
    assert!(
        shown.iter().all(|s| !s.contains("eyJ")),
        "problems never print the value: {shown:?}"
    );
}

#[test]
fn verify_fails_on_an_unredacted_header_in_a_transcript() {
    let (_tmp, _dest, copy_dir) = written_and_copy();
    let path = copy_dir.join("transcripts/SBX-LIFE-001.json");
    let text = std::fs::read_to_string(&path).unwrap();
    // Put the cookie value back where the sanitizer had redacted it.
    let name = text
        .find(r#""set-cookie","#)
        .expect("the transcript records the header");
    let value = name + text[name..].find(r#""[REDACTED]""#).unwrap();
    let pasted = format!(
        "{}\"sid=abcdef0123456789\"{}",
        &text[..value],
        &text[value + r#""[REDACTED]""#.len()..]
    );
    std::fs::write(&path, pasted).unwrap();
    reseal(&copy_dir);
    let problems = verify(&copy_dir).problems;
    assert!(
        problems.iter().any(|p| matches!(p, Problem::Secret { file, what, .. } if file == "transcripts/SBX-LIFE-001.json" && what == "credential-header")),
        "{problems:?}"
    );
}

#[test]
fn verify_fails_on_a_receipt_that_breaks_the_schema() {
    let (_tmp, _dest, copy_dir) = written_and_copy();
    let path = copy_dir.join("receipt.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    // Relabelling a failure as a pass without dropping its reason is exactly what the schema forbids.
    let auth = v["predicate"]["scenarios"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|s| s["id"] == "AUTH-NOAUTH-001")
        .unwrap();
    auth["outcome"] = "pass".into();
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    reseal(&copy_dir);
    let problems = verify(&copy_dir).problems;
    assert!(!problems.is_empty());
    assert!(
        problems.iter().all(|p| matches!(p, Problem::Schema(_))),
        "{problems:?}"
    );

    // An unknown field is a violation too.
    v["predicate"]["extra"] = true.into();
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    reseal(&copy_dir);
    assert!(
        verify(&copy_dir)
            .problems
            .iter()
            .any(|p| matches!(p, Problem::Schema(s) if s.contains("additionalProperties")))
    );
}

#[test]
fn verify_fails_on_missing_and_unlisted_files_and_inconsistent_counts() {
    let (_tmp, _dest, copy_dir) = written_and_copy();
    std::fs::remove_file(copy_dir.join("junit.xml")).unwrap();
    std::fs::write(copy_dir.join("notes.txt"), "added later").unwrap();
    let problems = verify(&copy_dir).problems;
    assert!(
        problems.contains(&Problem::Missing("junit.xml".into())),
        "{problems:?}"
    );
    assert!(
        problems.contains(&Problem::Unlisted("notes.txt".into())),
        "{problems:?}"
    );

    let (_tmp2, _dest2, copy2) = written_and_copy();
    let path = copy2.join("receipt.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["predicate"]["counts"]["fail"] = 0.into();
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    reseal(&copy2);
    let problems = verify(&copy2).problems;
    assert_eq!(
        problems,
        [Problem::Inconsistent(
            "counts.fail is 0 but the scenarios give 1".into()
        )]
    );
}

/// Rewrites `receipt.json` of `dir` with `edit`, then reseals the manifest, so that only the
/// receipt's own checks can notice.
fn tamper(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> Vec<Problem> {
    let path = dir.join("receipt.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    reseal(dir);
    verify(dir).problems
}

fn profile<'v>(v: &'v mut serde_json::Value, name: &str) -> &'v mut serde_json::Value {
    v["predicate"]["profiles"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|p| p["profile"] == name)
        .unwrap()
}

/// A verdict that does not follow from the outcomes is refused, even in a receipt that
/// satisfies the schema and a resealed manifest.
#[test]
fn verify_refuses_verdicts_that_do_not_follow_from_the_outcomes() {
    let (_tmp, _dest, copy_dir) = written_and_copy();
    let problems = tamper(&copy_dir, |v| {
        let all = profile(v, "all");
        all["verdict"] = "conformant".into();
        all["reason"] = serde_json::Value::Null;
    });
    assert_eq!(
        problems,
        [Problem::Inconsistent(
            "profile `all`: the receipt says conformant (no reason) but its scenario outcomes give non-conformant (MUST failed: AUTH-NOAUTH-001, PRC-STREAM-001)".into()
        )]
    );
    assert_eq!(verify_cli(&copy_dir, None), 1);

    // A family's verdict, and its counts, are judged again too.
    let (_tmp, _dest, copy_dir) = written_and_copy();
    let problems = tamper(&copy_dir, |v| {
        let p = profile(v, "lifecycle");
        p["verdict"] = "partial".into();
        p["reason"] = "MUST skipped: SBX-PAUSE-001".into();
    });
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0]
            .to_string()
            .starts_with("receipt inconsistent: profile `lifecycle`: the receipt says partial"),
        "{problems:?}"
    );
    let (_tmp, _dest, copy_dir) = written_and_copy();
    let problems = tamper(&copy_dir, |v| {
        profile(v, "auth")["must_run"] = 0.into();
    });
    assert_eq!(problems.len(), 1, "{problems:?}");

    // A profile dropped from the receipt is noticed.
    let (_tmp, _dest, copy_dir) = written_and_copy();
    let problems = tamper(&copy_dir, |v| {
        v["predicate"]["profiles"]
            .as_array_mut()
            .unwrap()
            .retain(|p| p["profile"] != "processes");
    });
    assert_eq!(
        problems,
        [Problem::Inconsistent(
            "profiles are [auth, lifecycle, all] but the scenarios' families give [auth, lifecycle, processes, all]".into()
        )]
    );
}

/// The subset flags must agree with the counts and with the selection flags.
#[test]
fn verify_refuses_a_scope_that_does_not_add_up() {
    let (_tmp, _dest, copy_dir) = written_and_copy();
    let problems = tamper(&copy_dir, |v| {
        v["predicate"]["selection"]["catalog"] = 95.into();
        v["predicate"]["selection"]["subset"] = true.into();
    });
    let shown: Vec<String> = problems.iter().map(ToString::to_string).collect();
    assert!(
        shown.iter().any(|p| p.contains(
            "selection.subset is true but neither --family, --filter nor --shard narrowed the run"
        )),
        "{shown:?}"
    );
    assert!(
        shown
            .iter()
            .any(|p| p.contains("profile `all`: scope 4 of 4 (subset false) does not follow")),
        "{shown:?}"
    );

    // A family cannot be a subset of a run that nothing narrowed.
    let (_tmp, _dest, copy_dir) = written_and_copy();
    let problems = tamper(&copy_dir, |v| {
        let p = profile(v, "lifecycle");
        p["catalog"] = 5.into();
        p["subset"] = true.into();
    });
    let shown: Vec<String> = problems.iter().map(ToString::to_string).collect();
    assert!(
        shown
            .iter()
            .any(|p| p.contains("profile `lifecycle`: scope 2 of 5 (subset true) does not follow")),
        "{shown:?}"
    );

    let (_tmp, _dest, copy_dir) = written_and_copy();
    let problems = tamper(&copy_dir, |v| {
        v["predicate"]["selection"]["selected"] = 3.into();
    });
    assert!(
        problems.contains(&Problem::Inconsistent(
            "selection.selected is 3 but the receipt accounts for 4 scenarios (reported, not applicable, never run)".into()
        )),
        "{problems:?}"
    );
}

/// A subset run is written with its scope everywhere and verifies; hiding the subset is
/// refused.
#[test]
fn a_subset_run_says_so_and_cannot_hide_it() {
    let run = Run::new();
    let mut rep = report(&run.canary);
    rep.filters = vec!["0".into()];
    let mut facts = whole_catalog(&rep.scenarios);
    *facts.catalog.get_mut("lifecycle").unwrap() += 5;
    facts.catalog.insert("files".into(), 12);
    rep.profiles = RunReport::judge(&rep.scenarios, &facts);
    let tmp = tempfile::tempdir().unwrap();
    let dest = run.write(&rep, &tmp.path().join("r")).unwrap();
    assert!(verify(&dest).ok(), "{:?}", verify(&dest).problems);
    let r = receipt(&dest).predicate;
    assert!(r.selection.subset);
    assert_eq!((r.selection.selected, r.selection.catalog), (4, 21));
    let summary = std::fs::read_to_string(dest.join("summary.md")).unwrap();
    assert!(
        summary.contains("| all | **non-conformant** (subset: 4 of 21 scenarios) |")
            && summary.contains("| lifecycle | **conformant** (subset: 2 of 7 scenarios) |")
            && summary.contains("| auth | **non-conformant** |"),
        "{summary}"
    );

    let copy_dir = tmp.path().join("copy");
    copy(&dest, &copy_dir);
    let problems = tamper(&copy_dir, |v| {
        v["predicate"]["selection"]["subset"] = false.into();
        profile(v, "all")["subset"] = false.into();
    });
    let shown: Vec<String> = problems.iter().map(ToString::to_string).collect();
    assert_eq!(shown.len(), 2, "{shown:?}");
    assert!(
        shown[0].contains("selection.subset is false but 4 of 21 scenarios were selected"),
        "{shown:?}"
    );
}

/// The coverage table lists every MUST clause of docs/protocol.md; claiming a clause was
/// judged when no scenario cites it is refused.
#[test]
fn coverage_lists_every_must_clause_and_cannot_be_inflated() {
    let (_tmp, dest, copy_dir) = written_and_copy();
    let c = receipt(&dest).predicate.coverage;
    let must: Vec<&str> = sandspec::profile::v1::must_clauses().collect();
    assert_eq!(c.must_clauses, must.len());
    assert_eq!(
        c.clauses
            .iter()
            .map(|r| r.clause.as_str())
            .collect::<Vec<_>>(),
        must
    );
    // Every scenario of the report cites SBX-3.1; only the pass and the fail judged it.
    let row = c.clauses.iter().find(|r| r.clause == "SBX-3.1").unwrap();
    assert_eq!(
        row.scenarios,
        [
            "SBX-LIFE-001",
            "AUTH-NOAUTH-001",
            "SBX-PAUSE-001",
            "PRC-STREAM-001"
        ]
    );
    assert!(row.checked);
    assert_eq!((c.checked, c.unchecked.len()), (1, must.len() - 1));
    let summary = std::fs::read_to_string(dest.join("summary.md")).unwrap();
    assert!(
        summary.contains(&format!(
            "1 of {} MUST clauses of docs/protocol.md were judged by a scenario of this run",
            must.len()
        )) && summary.contains("| CONV-1.1 | **no** | none |"),
        "{summary}"
    );

    let problems = tamper(&copy_dir, |v| {
        let cov = &mut v["predicate"]["coverage"];
        cov["clauses"][0]["checked"] = true.into();
        cov["clauses"][0]["scenarios"] = serde_json::json!(["SBX-LIFE-001"]);
        cov["checked"] = 2.into();
        cov["unchecked"].as_array_mut().unwrap().remove(0);
    });
    assert_eq!(
        problems,
        [Problem::Inconsistent(
            "coverage does not follow from the scenarios' clauses and outcomes (rows CONV-1.1)"
                .into()
        )]
    );
    // Dropping an unchecked clause from the table altogether is refused as well.
    let (_tmp, _dest, copy_dir) = written_and_copy();
    let problems = tamper(&copy_dir, |v| {
        let cov = &mut v["predicate"]["coverage"];
        cov["clauses"].as_array_mut().unwrap().remove(0);
        cov["unchecked"].as_array_mut().unwrap().remove(0);
        cov["must_clauses"] = (must.len() - 1).into();
    });
    if sandspec::evidence::suite_commit() == "unknown" {
        // Built without a commit, the verifier cannot tell which clause list a receipt had.
        assert!(problems.is_empty(), "{problems:?}");
        return;
    }
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].to_string().contains(&format!(
            "coverage lists {} MUST clauses; docs/protocol.md of this suite's commit has {}",
            must.len() - 1,
            must.len()
        )),
        "{problems:?}"
    );
}

#[test]
fn verify_cli_refuses_a_missing_directory() {
    let tmp = tempfile::tempdir().unwrap();
    assert_eq!(verify_cli(&tmp.path().join("nope"), None), 2);
    assert_eq!(
        verify_cli(tmp.path(), None),
        1,
        "an empty folder has no manifest and no receipt"
    );
}

/// The schema's honesty rules, on hand-made receipts.
#[test]
fn the_schema_enforces_the_honesty_rules() {
    let run = Run::new();
    let tmp = tempfile::tempdir().unwrap();
    let dest = run
        .write(&report(&run.canary), &tmp.path().join("r"))
        .unwrap();
    let good: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dest.join("receipt.json")).unwrap()).unwrap();
    fn idx(v: &serde_json::Value, id: &str) -> usize {
        v["predicate"]["scenarios"]
            .as_array()
            .unwrap()
            .iter()
            .position(|s| s["id"] == id)
            .unwrap()
    }
    validate_receipt(&good).unwrap();
    type Mutation = fn(&mut serde_json::Value);
    let cases: Vec<(&str, Mutation)> = vec![
        ("a skip without a reason", |v| {
            let i = idx(v, "SBX-PAUSE-001");
            v["predicate"]["scenarios"][i]["reason"] = serde_json::Value::Null;
        }),
        ("a failure without its step", |v| {
            let i = idx(v, "AUTH-NOAUTH-001");
            v["predicate"]["scenarios"][i]["failed_step"] = serde_json::Value::Null;
        }),
        ("a flaky pass on the first attempt", |v| {
            let i = idx(v, "SBX-LIFE-001");
            v["predicate"]["scenarios"][i]["outcome"] = "flaky".into();
            v["predicate"]["scenarios"][i]["reason"] = "passed on attempt 1".into();
        }),
        ("never-run scenarios in an uninterrupted run", |v| {
            v["predicate"]["not_run"] = serde_json::json!(["SBX-LIFE-002"])
        }),
        ("an unknown outcome", |v| {
            let i = idx(v, "SBX-LIFE-001");
            v["predicate"]["scenarios"][i]["outcome"] = "passed".into();
        }),
        ("credentials in the target URL", |v| {
            v["predicate"]["target"]["base_url"] = "http://u:p@host".into()
        }),
        ("a conformant verdict with a reason", |v| {
            v["predicate"]["profiles"][0]["verdict"] = "conformant".into();
        }),
        ("a subject without a digest", |v| {
            v["subject"][0]["digest"] = serde_json::json!({})
        }),
        ("a certification run of a subset", |v| {
            v["predicate"]["selection"]["certify"] = true.into();
            v["predicate"]["selection"]["subset"] = true.into();
        }),
        ("a certification run with a filter", |v| {
            v["predicate"]["selection"]["certify"] = true.into();
            v["predicate"]["selection"]["filters"] = serde_json::json!(["SBX"]);
        }),
        ("a profile without its scope", |v| {
            v["predicate"]["profiles"][0]
                .as_object_mut()
                .unwrap()
                .remove("subset");
        }),
        ("a receipt without clause coverage", |v| {
            v["predicate"].as_object_mut().unwrap().remove("coverage");
        }),
    ];
    for (what, mutate) in cases {
        let mut v = good.clone();
        mutate(&mut v);
        assert!(validate_receipt(&v).is_err(), "the schema accepted {what}");
    }
}

/// detect-secrets over every file of the current directory. Its entropy detectors flag
/// identifiers that a receipt exists to carry, so exactly those formats are excluded: SHA-256
/// digests and git commits (64 and 40 lowercase hex), and the API's ULID-based IDs (a short
/// lowercase kind such as `req_`, `sbx_` or `sub_`, then 26 characters), alone or as a segment of a URL path whose other segments
/// are short lowercase words (`/v1/sandboxes/sbx_…/files`), and run IDs behind a short label
/// (`once-<run id>`, the idempotency keys scenarios build). Nothing else is. `.ci/run` can run
/// the same scan on a real run folder with these arguments.
const DETECT_SECRETS_ARGS: &[&str] = &[
    "scan",
    "--all-files",
    "--exclude-secrets",
    "^[0-9a-f]{40}([0-9a-f]{24})?$",
    "--exclude-secrets",
    // A trailing backslash: the closing quote, escaped, inside a JSON body kept as text.
    r"^/?([a-z][a-z0-9._-]{0,19}|[a-z]{2,5}_[0-9a-z]{26})(/([a-z][a-z0-9._-]{0,19}|[a-z]{2,5}_[0-9a-z]{26}))*/?\\?$",
    "--exclude-secrets",
    // Run IDs (a lowercase ULID), alone or behind short labels, as scenarios build their
    // idempotency keys, tags and marker files: `once-<run id>`, `/tmp/iso-escape-<run id>`;
    // a trailing backslash where one sits inside a JSON body kept as text.
    r"^(/?[a-z][a-z0-9._-]{0,19}/)*([a-z]{1,12}-)*[0-9a-z]{26}\\?$",
    "--exclude-secrets",
    // The Content-Security-Policy source of report.html: the SHA-256 of its own style sheet.
    "^sha256-[A-Za-z0-9+/]{43}=$",
];

/// The page loads nothing and runs nothing: no scripts, no external style sheets, fonts or
/// images, links only within the folder, and a policy whose hash is that of its one style
/// sheet. It shows every scenario, the verdict, and failures first with their reasons.
#[test]
fn the_report_is_self_contained_and_shows_the_run() {
    let run = Run::new();
    let tmp = tempfile::tempdir().unwrap();
    let dest = run
        .write(&report(&run.canary), &tmp.path().join("r"))
        .unwrap();
    let html = std::fs::read_to_string(dest.join("report.html")).unwrap();
    for banned in [
        "<script", "<link", "<img", "<iframe", " src=", "url(", "@import",
    ] {
        assert!(!html.contains(banned), "report.html holds {banned}");
    }
    for href in html.split("href=\"").skip(1) {
        let target = &href[..href.find('"').unwrap()];
        assert!(
            target.starts_with("transcripts/") && !target.contains(".."),
            "a link leaves the folder: {target}"
        );
    }
    let style = {
        let start = html.find("<style>").unwrap() + "<style>".len();
        &html[start..html.find("</style>").unwrap()]
    };
    use base64::Engine as _;
    let hash = base64::engine::general_purpose::STANDARD
        .encode(<sha2::Sha256 as sha2::Digest>::digest(style.as_bytes()));
    assert!(
        html.contains(&format!(
            r#"content="default-src 'none'; style-src 'sha256-{hash}'; img-src 'none'; base-uri 'none'; form-action 'none'""#
        )),
        "the policy does not allow exactly the page's style sheet"
    );

    let r = receipt(&dest).predicate;
    for s in &r.scenarios {
        let outcome = serde_json::to_value(s.outcome).unwrap();
        let row = format!(
            r#"<tr id="scenario-{}" data-outcome="{}">"#,
            s.id,
            outcome.as_str().unwrap()
        );
        assert!(html.contains(&row), "no row {row}");
    }
    assert!(html.contains(r#"id="verdict-all">non-conformant</span>"#));
    // Failures come first, each with its reason and its transcript collapsed.
    let failures = html.find(r#"<section id="failures">"#).unwrap();
    let card = html.find(r#"id="failure-AUTH-NOAUTH-001""#).unwrap();
    assert!(failures < card && card < html.find(r#"<section id="skips">"#).unwrap());
    let reason = r
        .scenarios
        .iter()
        .find(|s| s.id == "AUTH-NOAUTH-001")
        .and_then(|s| s.reason.clone())
        .unwrap();
    assert!(reason.contains("status 200, expected 401"), "{reason}");
    assert!(
        html[card..].contains(&format!(r#"<p class="reason">{reason}</p>"#)),
        "{reason}"
    );
    assert!(html[card..].contains("<details>"));
    assert!(html.contains(r#"<tr id="skip-SBX-PAUSE-001">"#));
    assert!(html.contains("target does not advertise `pause`"));
    // The manifest and the receipt both name it.
    let manifest = String::from_utf8(std::fs::read(dest.join("manifest.json")).unwrap()).unwrap();
    assert!(manifest.contains(r#""path": "report.html""#));
    assert!(r.documents.iter().any(|d| d.path == "report.html"));
}

/// A scenario full of secrets fails, so its transcript is rendered into report.html: the
/// page holds none of them, says where they were redacted, and detect-secrets finds nothing.
#[test]
fn a_failed_transcript_in_the_report_holds_no_secret() {
    let run = Run::new();
    let mut rep = report(&run.canary);
    let life = rep
        .scenarios
        .iter_mut()
        .find(|s| s.id == "SBX-LIFE-001")
        .unwrap();
    life.outcome = Outcome::Fail {
        step: "steps[2] open preview".into(),
        reason: "status 200, expected 404".into(),
    };
    rep.profiles = RunReport::judge(&rep.scenarios, &whole_catalog(&rep.scenarios));
    let tmp = tempfile::tempdir().unwrap();
    let dest = run.write(&rep, &tmp.path().join("r")).unwrap();
    let html = std::fs::read_to_string(dest.join("report.html")).unwrap();
    assert!(html.contains(r#"id="failure-SBX-LIFE-001""#));
    assert!(
        html.contains("preview_token=[REDACTED]") && html.contains("(failed step)"),
        "the transcript is on the page"
    );
    for secret in [
        OWNER_TOKEN,
        OTHER_TOKEN,
        DB_PASSWORD,
        PREVIEW_TOKEN,
        run.canary.as_str(),
        "sk-live0123",
        "ghp_0123",
    ] {
        assert!(!html.contains(secret), "report.html holds {secret}");
    }
    assert!(verify(&dest).ok());
    let Some(findings) = detect_secrets(&dest) else {
        return;
    };
    assert!(
        findings.is_empty(),
        "detect-secrets found:\n{}",
        findings.join("\n")
    );
}

/// A canary echoed into a failed scenario's transcript is refused before anything is
/// written, and named in the transcript where it arose, not in the page that shows it.
#[test]
fn a_canary_in_a_failed_transcript_is_named_where_it_arose() {
    let run = Run::new();
    let mut rep = report(&run.canary);
    let auth = rep
        .scenarios
        .iter_mut()
        .find(|s| s.id == "AUTH-NOAUTH-001")
        .unwrap();
    auth.transcript.push(http(
        "steps[3] echo",
        "GET",
        "/v1/echo",
        200,
        None,
        text(&format!("you said {}", run.canary)),
    ));
    let tmp = tempfile::tempdir().unwrap();
    match run.write(&rep, &tmp.path().join("r")) {
        Err(EvidenceError::Leak { file, what }) => {
            assert!(
                file.starts_with("transcripts/AUTH-NOAUTH-001.json:"),
                "{file}"
            );
            assert_eq!(what, "canary");
        }
        other => panic!("expected a leak, got {other:?}"),
    }
    assert!(!tmp.path().join("r").exists());
}

/// A fresh Ed25519 key, made for this test only.
fn signing_key() -> SigningKey {
    SigningKey::generate()
}

fn public(key: &SigningKey) -> VerifyingKey {
    VerifyingKey::from_pem(&key.public_key_pem(), Path::new("test-key.pub")).unwrap()
}

/// A signed folder and a copy of it to tamper with.
fn signed_and_copy(key: &SigningKey) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let run = Run::new();
    let tmp = tempfile::tempdir().unwrap();
    let options = WriteOptions {
        sign_key: Some(key.clone()),
        ..run.options()
    };
    let dest = write_run_folder(
        &tmp.path().join("r"),
        &report(&run.canary),
        &run.sanitizer,
        &options,
    )
    .unwrap();
    let copy_dir = tmp.path().join("copy");
    copy(&dest, &copy_dir);
    (tmp, dest, copy_dir)
}

#[test]
fn a_signed_folder_verifies_with_its_key_and_no_other() {
    let key = signing_key();
    let (_tmp, dest, _copy) = signed_and_copy(&key);
    assert!(dest.join(ENVELOPE).is_file());
    let checked = verify_with_key(&dest, Some(&public(&key)));
    assert!(checked.ok(), "{:?}", checked.problems);
    assert_eq!(checked.signature_by.as_deref(), Some(key.keyid()));

    // Without a key the folder still verifies, and says it is signed.
    let unchecked = verify(&dest);
    assert!(unchecked.ok() && unchecked.signed && unchecked.signature_by.is_none());

    // The envelope is DSSE over the exact bytes of receipt.json.
    let envelope: Envelope =
        serde_json::from_slice(&std::fs::read(dest.join(ENVELOPE)).unwrap()).unwrap();
    assert_eq!(envelope.payload_type, PAYLOAD_TYPE);
    assert_eq!(envelope.signatures.len(), 1);
    assert_eq!(envelope.signatures[0].keyid, key.keyid());
    use base64::Engine as _;
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(&envelope.payload)
            .unwrap(),
        std::fs::read(dest.join("receipt.json")).unwrap()
    );

    let other = signing_key();
    let refused = verify_with_key(&dest, Some(&public(&other)));
    assert_eq!(
        refused.problems,
        [Problem::Signature(format!(
            "no signature in {ENVELOPE} verifies with key {}",
            other.keyid()
        ))]
    );
}

#[test]
fn an_unsigned_folder_is_refused_when_a_key_is_given() {
    let (_tmp, dest, _copy) = written_and_copy();
    let key = signing_key();
    assert_eq!(
        verify_with_key(&dest, Some(&public(&key))).problems,
        [Problem::Signature(format!(
            "the receipt is not signed ({ENVELOPE} is missing)"
        ))]
    );
}

/// Changes one character in the middle of `bytes` (a letter or digit to another).
fn change_one_character(bytes: &mut [u8]) {
    let at = (bytes.len() / 2..bytes.len())
        .chain(0..bytes.len() / 2)
        .find(|i| bytes[*i].is_ascii_alphanumeric())
        .expect("a letter or digit to change");
    bytes[at] = match bytes[at] {
        b'0'..=b'8' | b'a'..=b'y' | b'A'..=b'Y' => bytes[at] + 1,
        b'9' => b'0',
        b'z' => b'a',
        _ => b'A',
    };
}

/// Every file of a signed folder, changed by one character with the manifest resealed (so
/// the manifest check alone cannot be what notices), is refused under the signing key; so is
/// a file added to the folder and to the manifest.
#[test]
fn any_change_to_a_signed_folder_is_refused() {
    let key = signing_key();
    let (tmp, dest, _copy) = signed_and_copy(&key);
    let public = public(&key);
    let names: Vec<String> = files(&dest).into_keys().collect();
    assert!(names.len() >= 10, "{names:?}");
    for (i, name) in names.iter().enumerate() {
        let dir = tmp.path().join(format!("changed-{i}"));
        copy(&dest, &dir);
        let path = dir.join(name);
        let mut bytes = std::fs::read(&path).unwrap();
        change_one_character(&mut bytes);
        std::fs::write(&path, bytes).unwrap();
        if name != "manifest.json" {
            reseal(&dir);
        }
        let checked = verify_with_key(&dir, Some(&public));
        assert!(!checked.ok(), "a change to {name} went unnoticed");
        if name != "manifest.json" {
            assert!(
                checked
                    .problems
                    .iter()
                    .any(|p| !matches!(p, Problem::DigestMismatch(_) | Problem::Manifest(_))),
                "{name}: only the manifest noticed: {:?}",
                checked.problems
            );
        }
    }

    // A changed receipt signed again with another key is refused under the right one.
    let dir = tmp.path().join("resigned");
    copy(&dest, &dir);
    let receipt_path = dir.join("receipt.json");
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&receipt_path).unwrap()).unwrap();
    v["predicate"]["target"]["server_version"] = "9.9.9".into();
    let mut changed = serde_json::to_vec_pretty(&v).unwrap();
    changed.push(b'\n');
    std::fs::write(&receipt_path, &changed).unwrap();
    std::fs::write(
        dir.join(ENVELOPE),
        serde_json::to_vec_pretty(&signing_key().sign(&changed)).unwrap(),
    )
    .unwrap();
    reseal(&dir);
    let problems = verify_with_key(&dir, Some(&public)).problems;
    assert!(
        matches!(problems.as_slice(), [Problem::Signature(d)] if d.starts_with("no signature")),
        "{problems:?}"
    );

    // A file added to the folder and to the manifest is not named by the signed receipt.
    let dir = tmp.path().join("added");
    copy(&dest, &dir);
    std::fs::write(dir.join("notes.md"), "all good\n").unwrap();
    reseal(&dir);
    assert_eq!(
        verify_with_key(&dir, Some(&public)).problems,
        [Problem::Inconsistent(
            "notes.md is in the folder but the receipt does not name it".into()
        )]
    );
}

/// Runs detect-secrets (PyPI, an independent scanner) over `dir` and returns its findings
/// as `file:line type: line text`, or `None` when it cannot be installed. It is installed in
/// a virtualenv under the target directory; unavailable is a visible skip locally and a
/// failure under `CI=true`.
fn detect_secrets(dir: &Path) -> Option<Vec<String>> {
    let bin = venv::executable(
        "detect-secrets-venv",
        &["detect-secrets==1.5.0"],
        "detect-secrets",
    )?;
    let out = command::succeeded(
        Command::new(&bin)
            .args(DETECT_SECRETS_ARGS)
            .current_dir(dir),
        "detect-secrets",
    );
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    Some(
        result["results"]
            .as_object()
            .unwrap()
            .values()
            .flat_map(|list| list.as_array().unwrap().iter())
            .map(|f| {
                let file = f["filename"].as_str().unwrap();
                let line = f["line_number"].as_u64().unwrap() as usize;
                let text = std::fs::read_to_string(dir.join(file)).unwrap();
                format!(
                    "{file}:{line} {}: {}",
                    f["type"],
                    text.lines().nth(line - 1).unwrap_or_default().trim()
                )
            })
            .collect(),
    )
}

#[test]
fn detect_secrets_finds_nothing() {
    let run = Run::new();
    let tmp = tempfile::tempdir().unwrap();
    let dest = run
        .write(&report(&run.canary), &tmp.path().join("r"))
        .unwrap();
    let Some(findings) = detect_secrets(&dest) else {
        return;
    };
    assert!(
        findings.is_empty(),
        "detect-secrets found:\n{}",
        findings.join("\n")
    );

    // The control: the same scanner does find a secret pasted into the folder.
    std::fs::write(
        dest.join("pasted.txt"),
        format!(
            "aws_secret_access_key = \"{}\"\n",
            "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
        ),
    )
    .unwrap();
    let findings = detect_secrets(&dest).unwrap();
    assert!(
        findings.iter().any(|f| f.starts_with("pasted.txt:1 ")),
        "the control secret was not found: {findings:?}"
    );
}

/// Run IDs are random, and some are of high enough entropy for the scanner to flag. The
/// exclusions pass them behind labels and paths inside JSON bodies kept as text, where the
/// scanner reads the escaped closing quote's backslash as part of the string. This ID is one
/// that was flagged there; a key of the same length beside it is still found.
#[test]
fn detect_secrets_passes_high_entropy_run_ids_inside_json_text() {
    let tmp = tempfile::tempdir().unwrap();
    let id = "01m8tfyxh62709je20wvx006g4";
    let body = |v: serde_json::Value| serde_json::to_string(&v).unwrap();
    let lines = [
        body(serde_json::json!({ "path": format!("iso-marker-{id}"), "size": 4 })),
        body(serde_json::json!({ "cmd": ["rm", "-f", format!("/tmp/iso-escape-{id}")] })),
        body(serde_json::json!({ "key": format!("once-{id}") })),
    ];
    let text = serde_json::json!({ "exchanges": lines.iter().map(|t| serde_json::json!({ "text": t })).collect::<Vec<_>>() });
    std::fs::write(
        tmp.path().join("t.json"),
        serde_json::to_string_pretty(&text).unwrap(),
    )
    .unwrap();
    let Some(findings) = detect_secrets(tmp.path()) else {
        return;
    };
    assert!(
        findings.is_empty(),
        "detect-secrets found:\n{}",
        findings.join("\n")
    );

    let key = body(serde_json::json!({ "path": "iso-marker-Zq8Xr2Lp9Vb4Nc7Md1Fh3Jk6Gt" }));
    std::fs::write(
        tmp.path().join("t.json"),
        serde_json::to_string_pretty(&serde_json::json!({ "text": key })).unwrap(),
    )
    .unwrap();
    let findings = detect_secrets(tmp.path()).unwrap();
    assert!(
        findings.iter().any(|f| f.starts_with("t.json:")),
        "a mixed-case key behind the same label was not found: {findings:?}"
    );
}

/// A run through the real engine against a fresh reference server, written as a run folder.
struct RealRun {
    _tmp: tempfile::TempDir,
    dest: PathBuf,
    scenarios: usize,
    /// The run's tokens and canary: none of them may appear in the folder.
    secrets: Vec<String>,
    /// Values the scenarios captured as secrets (bridge keys), registered with the sanitizer
    /// as `sandspec run` does; none of them may appear in the folder either.
    captured: Vec<String>,
    run_id: String,
}

/// Runs the catalog (or the scenarios with these IDs) and writes the folder.
async fn real_run(only: &[&str], jobs: usize) -> RealRun {
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_sandspec"));
    let options = ReferenceOptions {
        binary: binary.clone(),
        ..ReferenceOptions::default()
    };
    let target = Arc::new(Target::start_reference(&options).await.unwrap());
    // Files that do not parse are the catalog's own tests' business; this runs what parses.
    let (mut scenarios, _) =
        load_dir_partial(&Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios"));
    if !only.is_empty() {
        scenarios.retain(|s| only.contains(&s.id()));
        assert_eq!(
            scenarios.len(),
            only.len(),
            "every chosen scenario is in the catalog"
        );
    }
    let run_id = ulid::Ulid::new().to_string().to_lowercase();
    let now = || {
        time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap()
    };
    let started_at = now();
    let started = std::time::Instant::now();
    let results = run_all(&target, &scenarios, &run_id, jobs, 0).await;
    let captured: Vec<String> = results.iter().flat_map(|r| r.secrets.clone()).collect();
    let reports: Vec<ScenarioReport> = scenarios
        .iter()
        .zip(results)
        .map(|(s, r)| ScenarioReport::new(s, r))
        .collect();
    let caps = &target.capabilities;
    let report = RunReport {
        run_id: run_id.clone(),
        suite_version: env!("CARGO_PKG_VERSION").into(),
        started_at,
        finished_at: now(),
        duration_ms: started.elapsed().as_millis() as u64,
        target: TargetInfo {
            kind: "reference".into(),
            url: target.base_url.clone(),
            server_name: caps.server_name.clone(),
            server_version: caps.server_version.clone(),
            defects: vec![],
            capabilities: caps.raw.clone(),
        },
        profile: "all".into(),
        filters: vec![],
        shard: None,
        label: None,
        retries: 0,
        certify: false,
        profiles: RunReport::judge(&reports, &whole_catalog(&reports)),
        scenarios: reports,
        run_sweep: Default::default(),
        not_applicable: Vec::new(),
        sdk_matrix: None,
        consumption: target.usage.consumption(Default::default(), false),
    };
    let tokens = &target.tokens;
    let mut sanitizer = for_tokens(tokens).unwrap();
    assert_eq!(
        sanitizer.secret_count(),
        2 + usize::from(tokens.admin.is_some())
    );
    for (i, value) in captured.iter().enumerate() {
        sanitizer
            .add_secret(value, &format!("captured-secret-{i}"))
            .unwrap();
    }
    let write = WriteOptions {
        canary: new_canary(),
        subject: Subject::reference_binary(&binary).unwrap(),
        interrupted: false,
        not_run: vec![],
        sign_key: None,
        gate: None,
    };
    let tmp = tempfile::tempdir().unwrap();
    let dest = write_run_folder(
        &tmp.path().join(&report.run_id),
        &report,
        &sanitizer,
        &write,
    )
    .unwrap();
    let mut secrets = vec![
        tokens.owner.clone(),
        tokens.other.clone(),
        write.canary.clone(),
    ];
    secrets.extend(tokens.admin.clone());
    secrets.extend(captured.iter().cloned());
    RealRun {
        _tmp: tmp,
        dest,
        scenarios: scenarios.len(),
        secrets,
        captured,
        run_id,
    }
}

/// The whole catalog against the reference server, through the real engine, written as a
/// run folder: it verifies, holds none of the run's tokens, and detect-secrets finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_run_writes_a_verified_folder() {
    let run = real_run(&[], 8).await;
    let verified = verify(&run.dest);
    assert!(verified.ok(), "{:?}", verified.problems);
    for (name, bytes) in files(&run.dest) {
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            run.secrets.iter().all(|s| !text.contains(s.as_str())),
            "{name} holds a token of the run"
        );
    }
    let r = receipt(&run.dest).predicate;
    assert_eq!(r.counts.total, run.scenarios);
    assert_eq!(r.target.subject_source, SubjectSource::ReferenceBinary);
    assert_eq!(r.target.api_version.as_deref(), Some("v1"));
    assert!(
        r.counts.positive_operations > 0 && r.counts.authentication_rejections > 0,
        "{:?}",
        r.counts
    );
    let Some(findings) = detect_secrets(&run.dest) else {
        return;
    };
    assert!(
        findings.is_empty(),
        "detect-secrets found:\n{}",
        findings.join("\n")
    );
}

/// A scenario that signs bridge requests with a session's bridge secret: the secret was
/// captured as a secret, and neither it nor any signature made with it is in the folder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_secret_and_its_signatures_never_reach_the_folder() {
    let run = real_run(&["WRK-FENCE-001"], 1).await;
    assert!(verify(&run.dest).ok());
    let r = receipt(&run.dest).predicate;
    assert_eq!(r.counts.total, 1);
    assert_eq!(r.counts.pass, 1, "{:?}", r.counts);
    // The bridge secret (256 bits, hex) was registered, once.
    let keys: Vec<&String> = run
        .captured
        .iter()
        .filter(|v| v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()))
        .collect();
    assert_eq!(keys.len(), 1, "{:?}", run.captured.len());
    let transcript =
        String::from_utf8(std::fs::read(run.dest.join("transcripts/WRK-FENCE-001.json")).unwrap())
            .unwrap();
    for (name, bytes) in files(&run.dest) {
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            !text.contains(keys[0].as_str()),
            "{name} holds the bridge secret"
        );
        assert!(!text.contains("v1="), "{name} holds a bridge signature");
    }
    // Signed requests were sent, and their signature headers were redacted, not dropped.
    let transcript: serde_json::Value = serde_json::from_str(&transcript).unwrap();
    let signatures: Vec<&serde_json::Value> = transcript["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["http"]["request_headers"].as_array())
        .flatten()
        .filter(|pair| {
            pair[0]
                .as_str()
                .is_some_and(|k| k.eq_ignore_ascii_case("x-sandspec-signature"))
        })
        .map(|pair| &pair[1])
        .collect();
    assert!(signatures.len() >= 6, "{signatures:?}");
    assert!(
        signatures.iter().all(|v| *v == "[REDACTED]"),
        "{signatures:?}"
    );
}

/// Scenarios whose observed behaviour is kept as snapshots: no polling and no timing-bound
/// counts, so two runs of one build give the same normal form. They run one at a time, so
/// no list response shows another scenario's sandbox.
const SNAPSHOT_SCENARIOS: &[&str] = &[
    "SBX-LIFE-001",
    "AUTH-MATRIX-001",
    "SBX-OWN-001",
    "PRC-STREAM-001",
];

/// The normalized receipt and the normalized lifecycle transcript of a run against the
/// reference server. A change here is a change in what the reference server or the
/// scenarios do: review it, then accept it with `INSTA_UPDATE=always`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_of_a_reference_run() {
    let run = real_run(SNAPSHOT_SCENARIOS, 1).await;
    assert!(verify(&run.dest).ok());
    let read = |rel: &str| {
        serde_json::from_slice::<serde_json::Value>(&std::fs::read(run.dest.join(rel)).unwrap())
            .unwrap()
    };
    let pretty = |v: serde_json::Value| serde_json::to_string_pretty(&v).unwrap();
    let mut receipt = normalize(&read("receipt.json"), Some(&run.run_id));
    // The coverage table has a row for every MUST clause of docs/protocol.md; the snapshot
    // keeps the rows these scenarios cite and the totals, so that a clause added to the
    // protocol does not rewrite it. `coverage_lists_every_must_clause_and_cannot_be_inflated`
    // checks the whole table.
    let coverage = &mut receipt["predicate"]["coverage"];
    let unchecked = coverage["unchecked"].as_array().unwrap().len();
    coverage["unchecked"] = format!("<{unchecked} clauses>").into();
    coverage["clauses"]
        .as_array_mut()
        .unwrap()
        .retain(|row| !row["scenarios"].as_array().unwrap().is_empty());
    insta::assert_snapshot!("reference_receipt", pretty(receipt));
    insta::assert_snapshot!(
        "reference_transcript_sbx_life_001",
        pretty(normalize(
            &read("transcripts/SBX-LIFE-001.json"),
            Some(&run.run_id)
        ))
    );
}
