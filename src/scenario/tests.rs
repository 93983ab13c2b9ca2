//! Parser tests: good files parse; every bad file fails with the expected `line:col: message`.

use std::path::Path;

use super::*;

const GOOD: &str = r#"
id: SBX-LIFE-001
title: Create and kill
clauses: [SBX-3.1]
level: MUST
tags: [lifecycle]
defects: [{defect: kill-reports-success-without-removing, fails_at: "POST /v1/sandboxes"}]
steps:
  - request:
      method: POST
      path: /v1/sandboxes
      json: {metadata: {run: "{{run_id}}"}, timeout_s: "{{limits.max_timeout_s}}"}
      expect:
        status: 201
        json:
          - {pointer: /state, equals: running}
          - {pointer: /exit, equals: null}
      capture:
        sbx: {json: /id}
  - sse:
      path: /v1/processes/{{sbx}}/events
      until: {event: exit}
      within_s: limits.heartbeat_interval_s * 2
      capture_last_id: last
cleanup:
  - request: {method: DELETE, path: "/v1/sandboxes/{{sbx}}", expect: {status_in: [204, 404]}}
  - absent: {path: "/v1/sandboxes/{{sbx}}", list: /v1/sandboxes, id: "{{sbx}}"}
"#;

#[test]
fn good_file_parses() {
    let s = parse_str(Path::new("good.yaml"), GOOD).unwrap();
    assert_eq!(s.id.value, "SBX-LIFE-001");
    assert_eq!(s.steps.len(), 2);
    assert_eq!(s.cleanup.len(), 2);
    let Step::Request(r) = &s.steps[0] else {
        panic!("first step is a request")
    };
    assert_eq!(r.expect.status, Some(201));
    assert_eq!(
        r.expect.json[1].equals.as_ref().unwrap().value,
        serde_json::Value::Null
    );
    let Step::Sse(sse) = &s.steps[1] else {
        panic!("second step is sse")
    };
    assert!(matches!(&sse.until, Until::Event(e) if e == "exit"));
    assert_eq!(
        sse.within_s.as_ref().unwrap().expr.to_string(),
        "limits.heartbeat_interval_s * 2"
    );
}

/// Parses `text` (named `bad.yaml`) and asserts the first error renders as `expect`.
fn check_err(text: &str, expect: &str) {
    let errs = parse_str(Path::new("bad.yaml"), text).expect_err("must be rejected");
    let rendered: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert!(
        rendered.iter().any(|r| r.starts_with(expect)),
        "expected an error starting with {expect:?}, got {rendered:#?}"
    );
}

fn header(rest: &str) -> String {
    format!("id: SBX-LIFE-001\ntitle: t\nclauses: [SBX-3.1]\nlevel: SHOULD\n{rest}")
}

#[test]
fn unknown_top_level_key() {
    check_err(
        &header("colour: red\nsteps: []\n"),
        "bad.yaml:5:1: unknown field `colour`",
    );
}

#[test]
fn unknown_key_in_step() {
    let text = header(
        "steps:\n  - request:\n      method: GET\n      path: /v1/health\n      expct: {status: 200}\n",
    );
    check_err(&text, "bad.yaml:9:7: unknown field `expct`");
}

#[test]
fn unknown_step_kind() {
    let text = header("steps:\n  - fetch: {method: GET, path: /}\n");
    check_err(&text, "bad.yaml:6:5: unknown variant `fetch`");
}

#[test]
fn unknown_capture_name() {
    let text =
        header("steps:\n  - request:\n      method: GET\n      path: /v1/sandboxes/{{sbx}}\n");
    check_err(
        &text,
        "bad.yaml:8:13: unknown variable `sbx`: not built in and not captured by an earlier step",
    );
}

#[test]
fn capture_used_before_it_is_defined() {
    let text = header(
        "steps:\n  - request: {method: GET, path: \"/v1/x/{{later}}\"}\n  - request:\n      method: GET\n      path: /v1/x\n      capture: {later: {json: /id}}\n",
    );
    check_err(&text, "bad.yaml:6:34: unknown variable `later`");
}

#[test]
fn unknown_variable_in_json_body() {
    let text = header(
        "steps:\n  - request:\n      method: POST\n      path: /v1/x\n      json: {a: \"{{nope}}\"}\n",
    );
    check_err(&text, "bad.yaml:9:13: unknown variable `nope`");
}

#[test]
fn unknown_limit() {
    let text = header("steps:\n  - request: {method: GET, path: \"/v1/{{limits.bogus}}\"}\n");
    check_err(&text, "bad.yaml:6:34: unknown variable `limits.bogus`");
}

#[test]
fn bad_id_and_clause() {
    let text = "id: sbx-1\ntitle: t\nclauses: [SBX3]\nlevel: SHOULD\nsteps:\n  - sleep: {ms: 1}\n";
    check_err(text, "bad.yaml:1:5: scenario id `sbx-1`");
    check_err(
        text,
        "bad.yaml:3:11: clause `SBX3` is not a clause of docs/protocol.md",
    );
}

#[test]
fn clauses_must_exist_in_the_protocol() {
    let text = "id: SBX-LIFE-001\ntitle: t\nclauses: [SBX-3.1, SBX-3.999]\nlevel: SHOULD\nsteps:\n  - sleep: {ms: 1}\n";
    check_err(
        text,
        "bad.yaml:3:20: clause `SBX-3.999` is not a clause of docs/protocol.md",
    );
    // SBX-3.13 is a SHOULD clause: a MUST scenario needs a MUST one.
    let text = "id: SBX-LIFE-001\ntitle: t\nclauses: [SBX-3.13]\nlevel: MUST\ndefects: [{defect: ttl-not-enforced, fails_at: sleep}]\nsteps:\n  - sleep: {ms: 1}\n";
    check_err(
        text,
        "bad.yaml:3:11: a MUST scenario must cite at least one MUST clause",
    );
    let text = text.replace("SBX-3.13]", "SBX-3.13, SBX-3.1]");
    parse_str(Path::new("ok.yaml"), &text).expect("a MUST clause beside a SHOULD one is fine");
}

/// A comparison in `cleanup` may find no digest or snapshot: steps stop at their first
/// failure and cleanup runs anyway. The parser refuses it rather than the run failing there.
#[test]
fn cleanup_cannot_compare_with_a_digest_that_may_not_exist() {
    let text = "id: SBX-LIFE-001\ntitle: t\nclauses: [SBX-3.1]\nlevel: SHOULD\nrequires: [test_controls, expiry_hold, admin_token]\n\
        steps:\n  - digest: {into: before}\n  - snapshot: {into: owned}\n  - sleep: {ms: 1}\n\
        cleanup:\n  - expect_digest_unchanged: {since: before}\n  - expect_snapshot_unchanged: {since: owned}\n";
    check_err(
        text,
        "bad.yaml:11:38: `expect_digest_unchanged` cannot be a cleanup step: digest `before` may never have been taken",
    );
    check_err(
        text,
        "bad.yaml:12:40: `expect_snapshot_unchanged` cannot be a cleanup step: snapshot `owned` may never have been taken",
    );
    // The same comparisons as steps are fine: a step runs only if every earlier one passed.
    let steps = text
        .replace("  - sleep: {ms: 1}\ncleanup:\n", "")
        .replace("cleanup:", "");
    parse_str(Path::new("ok.yaml"), &steps).expect("comparisons in steps parse");
}

#[test]
fn a_snapshot_comparison_needs_an_earlier_snapshot() {
    let text = header(
        "steps:\n  - expect_snapshot_unchanged: {since: owned}\n  - snapshot: {into: owned}\n",
    );
    check_err(&text, "bad.yaml:6:40: no earlier `snapshot` named `owned`");
}

/// A request's expectations are judged before its captures are taken, and an `sse` step's
/// request is sent before its `capture_last_id` exists.
#[test]
fn a_step_cannot_use_what_it_captures_itself() {
    let text = header(
        "steps:\n  - request:\n      method: GET\n      path: /v1/x\n      expect: {json: [{pointer: /id, equals: \"{{own}}\"}]}\n      capture: {own: {json: /id}}\n",
    );
    check_err(&text, "bad.yaml:9:46: unknown variable `own`");
    let text = header(
        "steps:\n  - sse:\n      path: /v1/x/events\n      last_event_id: \"{{cursor}}\"\n      until: eof\n      capture_last_id: cursor\n",
    );
    check_err(&text, "bad.yaml:8:22: unknown variable `cursor`");
}

/// A poll's deadline is computed before its request is first sent.
#[test]
fn a_poll_deadline_cannot_use_what_the_poll_captures() {
    let text = header(
        "steps:\n  - poll:\n      request:\n        method: GET\n        path: /v1/x\n        capture: {wait: {json: /n}}\n      within_s: wait\n",
    );
    check_err(
        &text,
        "bad.yaml:11:17: unknown variable `wait`: not built in and not captured by an earlier step",
    );
}

#[test]
fn must_without_defect() {
    let text =
        "id: SBX-LIFE-001\ntitle: t\nclauses: [SBX-3.1]\nlevel: MUST\nsteps:\n  - sleep: {ms: 1}\n";
    check_err(text, "bad.yaml:1:5: a MUST scenario must name the defects");
    // There is no waiver any more: the key is unknown.
    let waived = format!("{text}defects_waiver: covered by SBX-LIFE-002\n");
    check_err(&waived, "bad.yaml:7:1: unknown field `defects_waiver`");
}

#[test]
fn defect_without_failing_step() {
    let text = header("defects: [pause-noop]\nsteps:\n  - sleep: {ms: 1}\n");
    check_err(
        &text,
        "bad.yaml:5:11: write `{defect: pause-noop, fails_at: <step>}`: a negative control names the step that must fail",
    );
    let text = header("defects: [{defect: pause-noop}]\nsteps:\n  - sleep: {ms: 1}\n");
    check_err(&text, "bad.yaml:5:12: missing field `fails_at`");
}

#[test]
fn fails_at_must_name_exactly_one_step() {
    let steps = "steps:\n  - request: {name: pause, method: POST, path: /v1/x}\n  - sleep: {ms: 1}\n  - sleep: {ms: 2}\n";
    let ok = header(&format!(
        "defects: [{{defect: pause-noop, fails_at: pause}}, {{defect: ttl-not-enforced, fails_at: POST /v1/y}}]\n{steps}"
    ));
    check_err(
        &ok,
        "bad.yaml:5:87: `fails_at: POST /v1/y` names no step (a step's `name`",
    );
    let twice = header(&format!(
        "defects: [{{defect: pause-noop, fails_at: sleep}}]\n{steps}"
    ));
    check_err(
        &twice,
        "bad.yaml:5:42: `fails_at: sleep` names 2 steps; give the failing one a unique `name`",
    );
    let named_twice = header(&format!(
        "defects: [{{defect: pause-noop, fails_at: pause}}, {{defect: pause-noop, fails_at: pause}}]\n{steps}"
    ));
    check_err(
        &named_twice,
        "bad.yaml:5:59: defect `pause-noop` is named twice",
    );
    let good = header(&format!(
        "defects: [{{defect: pause-noop, fails_at: pause}}]\n{steps}"
    ));
    let s = parse_str(Path::new("good.yaml"), &good).unwrap();
    assert_eq!(s.fails_at(&s.defects[0]).as_deref(), Some("steps[0] pause"));
}

#[test]
fn cleanup_steps_are_not_failing_steps() {
    let text = header(
        "defects: [{defect: pause-noop, fails_at: undo}]\nsteps:\n  - sleep: {ms: 1}\ncleanup:\n  - request: {name: undo, method: DELETE, path: /v1/x}\n",
    );
    check_err(&text, "bad.yaml:5:42: `fails_at: undo` names no step");
}

#[test]
fn unknown_defect_and_capability() {
    let text = header(
        "defects: [{defect: no-such-bug, fails_at: sleep}]\nrequires: [teleport]\nsteps:\n  - sleep: {ms: 1}\n",
    );
    check_err(&text, "bad.yaml:5:20: unknown defect `no-such-bug`");
    check_err(&text, "bad.yaml:6:12: unknown capability `teleport`");
}

#[test]
fn digest_needs_test_controls() {
    let text =
        header("steps:\n  - digest: {into: before}\n  - expect_digest_unchanged: {since: after}\n");
    check_err(&text, "bad.yaml:6:20: a `digest` step needs");
    check_err(&text, "bad.yaml:7:38: no earlier `digest` named `after`");
}

#[test]
fn sleep_is_bounded_and_checks_are_single() {
    check_err(
        &header("steps:\n  - sleep: {ms: 60000}\n"),
        "bad.yaml:6:17: `sleep` is bounded",
    );
    let text = header(
        "steps:\n  - request:\n      method: GET\n      path: /v1/x\n      expect:\n        json:\n          - {pointer: /a, exists: true, equals: 1}\n",
    );
    check_err(&text, "bad.yaml:11:23: check on `/a` must give exactly one");
}

#[test]
fn other_provider_needs_two_providers() {
    let text = header(
        "steps:\n  - request: {method: POST, path: /v1/sandboxes, json: {provider: \"{{provider.other}}\"}}\n",
    );
    check_err(&text, "bad.yaml:6:56: `{{provider.other}}` needs");
}

#[test]
fn bad_fixture_files() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/scenarios-bad");
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let expected = std::fs::read_to_string(path.with_extension("err")).unwrap();
        let errs = parse_str(Path::new(path.file_name().unwrap()), &text)
            .expect_err("bad fixture must fail");
        let rendered: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert_eq!(
            rendered.join("\n"),
            expected.trim_end(),
            "{}",
            path.display()
        );
        count += 1;
    }
    assert!(count >= 2, "fixtures found: {count}");
}

#[test]
fn partial_loading_keeps_good_files_and_reports_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let family = dir.path().join("lifecycle");
    std::fs::create_dir(&family).unwrap();
    std::fs::write(family.join("good.yaml"), GOOD).unwrap();
    std::fs::write(family.join("dup.yaml"), GOOD).unwrap();
    std::fs::write(family.join("bad.yaml"), "id: X\n").unwrap();
    std::fs::write(family.join("notes.txt"), "not a scenario").unwrap();
    let (loaded, errors) = load_dir_partial(dir.path());
    assert_eq!(loaded.len(), 1);
    assert_eq!(loaded[0].family, "lifecycle");
    let rendered: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(rendered.len(), 2, "{rendered:#?}");
    assert!(
        rendered.iter().any(|e| e.contains("bad.yaml:")),
        "{rendered:#?}"
    );
    assert!(
        rendered
            .iter()
            .any(|e| e.contains("duplicate scenario id `SBX-LIFE-001`")),
        "{rendered:#?}"
    );
    assert!(load_dir(dir.path()).is_err());
}

#[test]
fn a_bridge_signing_secret_must_be_a_secret_capture() {
    let steps = |secret_flag: &str| {
        header(&format!(
            "steps:\n  - request:\n      method: GET\n      path: /x\n      capture:\n        key: {{json: /secret{secret_flag}}}\n  - request:\n      method: POST\n      path: /bridge\n      bridge_signature: {{secret: \"{{{{key}}}}\"}}\n"
        ))
    };
    check_err(
        &steps(""),
        "bad.yaml:14:34: `key` signs bridge requests: capture it with `secret: true`",
    );
    let s = parse_str(Path::new("good.yaml"), &steps(", secret: true")).unwrap();
    let Step::Request(r) = &s.steps[1] else {
        panic!("a request")
    };
    assert_eq!(r.bridge_signature.as_ref().unwrap().secret.raw, "{{key}}");
    // A literal wrong key is fine: it is the scenario's own, not a credential of the target.
    let literal = header(
        "steps:\n  - request: {method: POST, path: /b, bridge_signature: {secret: not-the-key}}\n",
    );
    parse_str(Path::new("good.yaml"), &literal).unwrap();
}

#[test]
fn a_signed_request_does_not_also_set_the_signature_headers() {
    let text = header(
        "steps:\n  - request: {method: POST, path: /b, headers: {X-Sandspec-Signature: v1=00}, bridge_signature: {secret: some-literal-key}}\n",
    );
    check_err(
        &text,
        "bad.yaml:6:35: `bridge_signature` sets `X-Sandspec-Signature`",
    );
}

#[test]
fn stream_view_checks_parse_and_contradict_expect_none() {
    let text = header(
        "steps:\n  - sse:\n      path: /s\n      id_gaps: true\n      each_event: [{pointer: /k, equals: v}]\n      last_event: {event: done}\n      expect_none: true\n",
    );
    check_err(&text, "bad.yaml:7:13: `expect_none` contradicts `events`");
    let loose = header("steps:\n  - sse: {path: /s, id_gaps: true, strict_framing: false}\n");
    check_err(&loose, "bad.yaml:6:17: `id_gaps` loosens `strict_framing`");
}

#[test]
fn parallel_tallies_take_header_checks() {
    let good = header(
        "steps:\n  - parallel:\n      repeat: 3\n      request: {method: GET, path: /s, headers: {Idempotency-Key: \"{{uuid}}\"}}\n      expect:\n        - {status: 200, exactly: 2}\n        - {status: 429, code: too_many_streams, rest: true, headers: [{name: Retry-After, present: true}]}\n",
    );
    let s = parse_str(Path::new("good.yaml"), &good).unwrap();
    let Step::Parallel(p) = &s.steps[0] else {
        panic!("a parallel step")
    };
    assert_eq!(p.expect[1].headers[0].name.value, "Retry-After");
    let two_checks = header(
        "steps:\n  - parallel:\n      repeat: 2\n      request: {method: GET, path: /s}\n      expect:\n        - {status: 429, rest: true, headers: [{name: Retry-After, present: true, absent: true}]}\n",
    );
    check_err(
        &two_checks,
        "bad.yaml:10:54: a header check gives exactly one of present, absent, equals, matches",
    );
    let unknown = header(
        "steps:\n  - parallel:\n      repeat: 2\n      request: {method: GET, path: /s}\n      expect:\n        - {status: 429, rest: true, headers: [{name: X, equals: \"{{nope}}\"}]}\n",
    );
    check_err(&unknown, "bad.yaml:10:65: unknown variable `nope`");
}

#[test]
fn via_peer_parses_and_needs_the_peer_requirement() {
    let text = header(
        "requires: [peer]\nsteps:\n  - request: {via: peer, method: GET, path: /v1/sessions}\n  - sse: {via: primary, path: /v1/sessions/x/events}\n  - poll:\n      within_s: 5\n      request: {via: peer, method: GET, path: /v1/sessions}\n",
    );
    let s = parse_str(Path::new("good.yaml"), &text).unwrap();
    let Step::Request(r) = &s.steps[0] else {
        panic!("a request")
    };
    assert_eq!(r.via, Via::Peer);
    let Step::Sse(sse) = &s.steps[1] else {
        panic!("an sse step")
    };
    assert_eq!(sse.via, Via::Primary);
    let Step::Poll(p) = &s.steps[2] else {
        panic!("a poll")
    };
    assert_eq!(p.request.via, Via::Peer);
    // Without the requirement, a step through the peer is refused where it is written.
    check_err(
        &header("steps:\n  - request: {via: peer, method: GET, path: /v1/sessions}\n"),
        "bad.yaml:6:45: `via: peer` needs `requires: [peer]`",
    );
    check_err(
        &header("steps:\n  - sse:\n      via: peer\n      path: /v1/x\n"),
        "bad.yaml:8:13: `via: peer` needs",
    );
}

#[test]
fn unknown_via_is_an_error_at_its_line() {
    check_err(
        &header(
            "requires: [peer]\nsteps:\n  - request: {via: secondary, method: GET, path: /v1/x}\n",
        ),
        "bad.yaml:7:",
    );
    let errs = parse_str(
        Path::new("bad.yaml"),
        &header(
            "requires: [peer]\nsteps:\n  - request: {via: secondary, method: GET, path: /v1/x}\n",
        ),
    )
    .unwrap_err();
    assert!(
        errs.iter()
            .any(|e| e.to_string().contains("unknown variant `secondary`")),
        "{errs:?}"
    );
}

#[test]
fn what_goes_beyond_the_contract_must_be_declared() {
    // A test control, acting as the admin, a fixture model script: each refused where it is
    // written until the scenario requires it.
    check_err(
        &header(
            "steps:\n  - request: {method: GET, path: /v1/test/providers/local/create_delay}\n",
        ),
        "bad.yaml:6:34: `/v1/test/providers/local/create_delay` is a test control: needs `requires: [test_controls]`",
    );
    check_err(
        &header(
            "requires: [test_controls]\nsteps:\n  - request: {as: admin, method: GET, path: /v1/test/x}\n",
        ),
        "bad.yaml:7:45: `as: admin` needs `requires: [admin_token]`",
    );
    check_err(
        &header("steps:\n  - request: {as: unscoped, method: GET, path: /v1/x}\n"),
        "bad.yaml:6:48: `as: unscoped` needs `requires: [unscoped_token]`",
    );
    check_err(
        &header(
            "steps:\n  - operations: {name: all, groups: [g], as: unscoped, expect: {status: 403}}\n",
        ),
        "bad.yaml:6:24: `as: unscoped` needs `requires: [unscoped_token]`",
    );
    check_err(
        &header(
            "steps:\n  - operations: {name: all, groups: [], except: {nothing: why}, params: {id: \"{{nope}}\"}, expect: {status: 401}}\n",
        ),
        "bad.yaml:6:37: `groups` names no group",
    );
    check_err(
        &header(
            "steps:\n  - operations: {name: all, groups: [g], except: {nothing: why}, expect: {status: 401}}\n",
        ),
        "bad.yaml:6:24: `except` entry `nothing`: write `METHOD /path: why it gets no request`",
    );
    check_err(
        &header(
            "steps:\n  - operations: {name: all, groups: [g], params: {id: \"{{nope}}\"}, expect: {status: 401}}\n",
        ),
        "bad.yaml:6:55: unknown variable `nope`",
    );
    check_err(
        &header("steps:\n  - sse: {as: admin, path: /v1/test/x}\n"),
        "bad.yaml:6:28: `as: admin` needs `requires: [admin_token]`",
    );
    check_err(
        &header("steps:\n  - absent: {as: admin, path: /v1/x, list: /v1/y, id: z}\n"),
        "bad.yaml:6:31: `as: admin` needs",
    );
    check_err(
        &header(
            "steps:\n  - poll:\n      within_s: 5\n      request: {as: admin, method: GET, path: /v1/x}\n",
        ),
        "bad.yaml:8:47: `as: admin` needs", // the poll's request, at its path
    );
    check_err(
        &header(
            "requires: [sessions]\nsteps:\n  - request:\n      method: POST\n      path: /v1/sessions\n      json: {agent: {model: echo}}\n",
        ),
        "bad.yaml:10:13: `agent.model` names a fixture model script: needs `requires: [fixture_models]`",
    );
    check_err(
        &header("requires: [test_controls]\nsteps:\n  - digest: {into: before}\n"),
        "bad.yaml:7:20: a `digest` step needs `requires: [test_controls, expiry_hold, admin_token]` (missing: expiry_hold, admin_token)",
    );
    check_err(
        &header("requires: [teleport]\nsteps:\n  - request: {method: GET, path: /v1/x}\n"),
        "bad.yaml:5:12: unknown capability `teleport` (known: pause, snapshots, previews, test_controls, sessions, fixture_models, expiry_hold, two_providers, peer, admin_token, unscoped_token, server_control, database_control, restart, isolation, memory_limit)",
    );
    // Declared, they parse; an empty model names no script (a validation check).
    let text = header(
        "requires: [test_controls, admin_token, fixture_models, expiry_hold]\nsteps:\n  - request: {as: admin, method: POST, path: /v1/test/digest}\n  - request: {method: POST, path: /v1/sessions, json: {agent: {model: echo}}}\n  - digest: {into: before}\n  - expect_digest_unchanged: {since: before}\n",
    );
    parse_str(Path::new("good.yaml"), &text).unwrap();
    let text = header(
        "steps:\n  - request: {method: POST, path: /v1/sessions, json: {agent: {model: \"\"}}, expect: {status: 400}}\n",
    );
    parse_str(Path::new("good.yaml"), &text).unwrap();
}

#[test]
fn a_parallel_group_may_retry_for_a_bounded_time() {
    let text = header(
        "steps:\n  - parallel:\n      within_s: limits.heartbeat_interval_s + 15\n      every_ms: 1500\n      repeat: 2\n      request: {method: GET, path: /v1/x}\n      expect: [{status: 200, rest: true}]\n",
    );
    let s = parse_str(Path::new("good.yaml"), &text).unwrap();
    let Step::Parallel(p) = &s.steps[0] else {
        panic!("a parallel group")
    };
    assert_eq!(p.every_ms.as_ref().map(|e| e.value), Some(1500));
    assert_eq!(
        p.within_s.as_ref().unwrap().expr.to_string(),
        "limits.heartbeat_interval_s + 15"
    );
    check_err(
        &header(
            "steps:\n  - parallel:\n      every_ms: 1500\n      repeat: 2\n      request: {method: GET, path: /v1/x}\n      expect: [{status: 200, rest: true}]\n",
        ),
        "bad.yaml:7:17: `every_ms` paces the attempts of `within_s`, which is not given",
    );
    check_err(
        &header(
            "steps:\n  - parallel:\n      within_s: limits.nope\n      repeat: 2\n      request: {method: GET, path: /v1/x}\n      expect: [{status: 200, rest: true}]\n",
        ),
        "bad.yaml:7:17: unknown variable `limits.nope`",
    );
}

#[test]
fn e2b_clauses_must_be_defined_and_connect_steps_checked() {
    let e2b = |clause: &str, step: &str| {
        format!("id: E2B-LIFE-001\ntitle: t\nclauses: [{clause}]\nlevel: SHOULD\nsteps:\n{step}")
    };
    let sleep = "  - sleep: {ms: 1}\n";
    assert!(parse_str(Path::new("ok.yaml"), &e2b("E2B-SBX-1", sleep)).is_ok());
    check_err(
        &e2b("E2B-SBX-99", sleep),
        "bad.yaml:3:11: clause `E2B-SBX-99` is not defined in docs/profiles/e2b.md",
    );
    check_err(
        &e2b(
            "E2B-PRC-1",
            "  - connect: {sandbox: x, rpc: process.Process.Start}\n",
        ),
        "bad.yaml:6:32: rpc `process.Process.Start` must look like `process.Process/Start`",
    );
    check_err(
        &e2b(
            "E2B-PRC-1",
            "  - connect: {sandbox: x, rpc: process.Process/Start, capture: {pid: {header: X}}}\n",
        ),
        "bad.yaml:6:70: a `connect` capture takes only `json: <pointer>`",
    );
    let captured = "  - connect: {sandbox: x, rpc: process.Process/List, capture: {n: {json: /processes}}}\n  - connect: {sandbox: \"{{n}}\", rpc: process.Process/List}\n";
    assert!(parse_str(Path::new("ok.yaml"), &e2b("E2B-PRC-1", captured)).is_ok());
}

#[test]
fn connect_until_needs_a_stream_and_no_expected_error() {
    let e2b = |step: &str| {
        format!("id: E2B-PRC-001\ntitle: t\nclauses: [E2B-PRC-1]\nlevel: SHOULD\nsteps:\n{step}")
    };
    let until = "until: [{pointer: /event/start/pid, exists: true}]";
    let ok =
        format!("  - connect: {{sandbox: x, rpc: process.Process/Start, stream: true, {until}}}\n");
    assert!(parse_str(Path::new("ok.yaml"), &e2b(&ok)).is_ok());
    check_err(
        &e2b(&format!(
            "  - connect: {{sandbox: x, rpc: process.Process/List, {until}}}\n"
        )),
        "bad.yaml:6:72: `until` reads a stream: it needs `stream: true`",
    );
    check_err(
        &e2b(&format!(
            "  - connect: {{sandbox: x, rpc: process.Process/Start, stream: true, error: not_found, {until}}}\n"
        )),
        "bad.yaml:6:105: `until` stops at a message, `error` waits for the stream's end: give one",
    );
    check_err(
        &e2b(
            "  - connect: {sandbox: x, rpc: process.Process/Start, stream: true, until: [{pointer: /a, equals: \"{{nope}}\"}]}\n",
        ),
        "bad.yaml:6:99: unknown variable `nope`",
    );
}

/// A client stream's `messages`, the headers an SDK sends and `output` checks are read as
/// the step's fields, and each refuses what it cannot mean.
#[test]
fn connect_client_streams_headers_and_output_are_checked() {
    let e2b = |step: &str| {
        format!("id: E2B-PRC-001\ntitle: t\nclauses: [E2B-PRC-1]\nlevel: SHOULD\nsteps:\n{step}")
    };
    let ok = "  - connect: {sandbox: x, rpc: process.Process/StreamInput, stream: true, messages: [{start: {}}, {data: {}}], headers: {Connect-Timeout-Ms: \"5\"}, output: [{pointer: /event/data/stdout, contains: hi}]}\n";
    assert!(parse_str(Path::new("ok.yaml"), &e2b(ok)).is_ok());
    check_err(
        &e2b("  - connect: {sandbox: x, rpc: process.Process/StreamInput, messages: [{}]}\n"),
        "bad.yaml:6:71: `messages` is a client stream: it needs `stream: true`",
    );
    check_err(
        &e2b(
            "  - connect: {sandbox: x, rpc: process.Process/Start, stream: true, message: {}, messages: [{}]}\n",
        ),
        "bad.yaml:6:92: give `message` (one) or `messages` (a client stream), not both",
    );
    check_err(
        &e2b(
            "  - connect: {sandbox: x, rpc: process.Process/Start, headers: {X-Access-Token: t}}\n",
        ),
        "bad.yaml:6:81: `X-Access-Token` is the step's own header: give it with the step's fields",
    );
    check_err(
        &e2b(
            "  - connect: {sandbox: x, rpc: process.Process/List, output: [{pointer: /a, equals: b}]}\n",
        ),
        "bad.yaml:6:73: `output` joins a whole stream: it needs `stream: true` without `until`",
    );
    check_err(
        &e2b(
            "  - connect: {sandbox: x, rpc: process.Process/Start, stream: true, output: [{pointer: /a}]}\n",
        ),
        "bad.yaml:6:88: an `output` check takes one of `contains` or `equals`",
    );
}

#[test]
fn fault_steps_parse_with_labels_and_need_their_control() {
    let text = header(
        "requires: [server_control, database_control, peer]\nsteps:\n  - kill_server: {}\n  - restart_server: {name: back again}\n  - kill_server: {via: peer}\n  - stop_database: {}\n  - start_database: {name: db back}\n",
    );
    let s = parse_str(Path::new("good.yaml"), &text).unwrap();
    let labels: Vec<String> = s.steps.iter().map(Step::label).collect();
    assert_eq!(
        labels,
        [
            "kill_server",
            "back again",
            "kill_server (via peer)",
            "stop_database",
            "db back"
        ]
    );
    // Without the capability, a fault step is refused where it is written.
    check_err(
        &header("steps:\n  - kill_server: {}\n"),
        "bad.yaml:6:18: `kill_server` needs `requires: [server_control]`",
    );
    check_err(
        &header("requires: [server_control]\nsteps:\n  - stop_database: {}\n"),
        "bad.yaml:7:20: `stop_database` needs `requires: [database_control]`",
    );
    check_err(
        &header("requires: [database_control, peer]\nsteps:\n  - start_database: {via: peer}\n"),
        "bad.yaml:7:21: `start_database` acts on the database: it takes no `via`",
    );
    check_err(
        &header("requires: [server_control]\nsteps:\n  - restart_server: {via: peer}\n"),
        "bad.yaml:7:21: `via: peer` needs `requires: [peer]`",
    );
    check_err(
        &header("requires: [server_control]\nsteps:\n  - kill_server: {signal: TERM}\n"),
        "bad.yaml:7:",
    );
}

#[test]
fn agent_sandbox_clauses_defects_and_restarts_are_checked() {
    let asb = |clause: &str, extra: &str, step: &str| {
        format!("id: ASB-X-001\ntitle: t\nclauses: [{clause}]\nlevel: MUST\n{extra}steps:\n{step}")
    };
    let sleep = "  - sleep: {ms: 1}\n";
    // A MUST scenario of this profile may name no defect: its test requires it to fail
    // against the package instead.
    assert!(parse_str(Path::new("ok.yaml"), &asb("ASB-AUTH-1", "", sleep)).is_ok());
    check_err(
        &asb("ASB-AUTH-99", "", sleep),
        "bad.yaml:3:11: clause `ASB-AUTH-99` is not defined in docs/profiles/agent-sandbox.md",
    );
    // Its defects are the stand-in's, not the reference server's.
    let stand_in = "defects:\n  - {defect: asb-sessions-shared, fails_at: sleep}\n";
    assert!(parse_str(Path::new("ok.yaml"), &asb("ASB-TEN-1", stand_in, sleep)).is_ok());
    let reference = "defects:\n  - {defect: foreign-object-visible, fails_at: sleep}\n";
    check_err(
        &asb("ASB-TEN-1", reference, sleep),
        "bad.yaml:6:14: unknown defect `foreign-object-visible`",
    );
    let restart = "  - restart: {name: again}\n";
    check_err(
        &asb("ASB-DUR-1", "", restart),
        "bad.yaml:6:21: a `restart` step needs `requires: [restart]`",
    );
    assert!(
        parse_str(
            Path::new("ok.yaml"),
            &asb("ASB-DUR-1", "requires: [restart]\n", restart)
        )
        .is_ok()
    );
}

#[test]
fn a_bound_on_the_answer_is_not_combined_with_leaving_early_nor_in_parallel() {
    let leaving = header(
        "steps:\n  - request: {method: GET, path: /v1/health, within_s: 2, leave_after_ms: 100}\n",
    );
    check_err(
        &leaving,
        "bad.yaml:6:34: `within_s` bounds a request's whole answer",
    );
    let parallel = header(
        "steps:\n  - parallel:\n      repeat: 2\n      request: {method: GET, path: /v1/health, within_s: 2}\n      expect: [{status: 200, exactly: 2}]\n",
    );
    check_err(
        &parallel,
        "bad.yaml:8:36: `within_s` bounds a request's whole answer",
    );
    let unknown =
        header("steps:\n  - request: {method: GET, path: /v1/health, within_s: limits.nope}\n");
    check_err(&unknown, "bad.yaml:6:");
}

#[test]
fn a_followed_stream_takes_no_single_connection_action() {
    for (field, value) in [
        ("cut_after", "2"),
        (
            "request_after",
            "{events: 1, request: {method: GET, path: /v1/health}}",
        ),
        ("min_duration_s", "3"),
    ] {
        let text = header(&format!(
            "steps:\n  - sse: {{path: /v1/sessions/s/events, follow: true, {field}: {value}}}\n"
        ));
        check_err(
            &text,
            &format!(
                "bad.yaml:6:17: `follow` reads the stream over several connections: not with `{field}`"
            ),
        );
    }
    let fine = header("steps:\n  - sse: {path: /v1/sessions/s/events, follow: true}\n");
    parse_str(Path::new("ok.yaml"), &fine).expect("a plain followed stream parses");
}
