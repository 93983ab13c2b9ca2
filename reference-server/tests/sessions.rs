//! The Agents Sessions gateway over real HTTP, with real worker processes inside real
//! sandboxes and the fixture model server replaying scripted turns.

use crate::support;

use std::time::Duration;

use reference_server::config::Config;
use serde_json::{Value, json};
use support::{ADMIN, ALICE, BOB, TestApp, poll, strings};

/// Gateway settings for tests: the built worker, the repository's scripts, quick timings.
fn gateway(c: &mut Config) {
    c.gateway.worker_bin = Some(env!("CARGO_BIN_EXE_sandspec-worker").into());
    c.gateway.fixtures_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/models").into();
    c.gateway.heartbeat_interval = Duration::from_millis(200);
    c.gateway.lease_ttl = Duration::from_secs(2);
    c.gateway.cancel_grace = Duration::from_secs(2);
    c.gateway.supervise_interval = Duration::from_millis(100);
}

async fn app() -> TestApp {
    support::spawn_app(gateway).await
}

async fn app_with(tweak: impl FnOnce(&mut Config)) -> TestApp {
    support::spawn_app(|c| {
        gateway(c);
        tweak(c);
    })
    .await
}

async fn create_session(app: &TestApp, token: &str, model: &str) -> Value {
    app.post(
        token,
        "/v1/sessions",
        json!({"agent": {"model": model}, "sandbox": {"create": {}}}),
    )
    .await
    .ok(201)
}

async fn submit(app: &TestApp, token: &str, sid: &str, key: &str, input: &str) -> Value {
    app.post_idem(
        token,
        &format!("/v1/sessions/{sid}/submissions"),
        key,
        json!({"input": input}),
    )
    .await
    .ok(202)
}

/// Polls the submission until `done` holds for it.
async fn wait_submission(
    app: &TestApp,
    token: &str,
    id: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    poll(|| async {
        let s = app
            .get(token, &format!("/v1/submissions/{id}"))
            .await
            .ok(200);
        done(&s).then_some(s)
    })
    .await
}

fn terminal(s: &Value) -> bool {
    ["completed", "failed", "cancelled", "expired", "uncertain"]
        .contains(&s["state"].as_str().unwrap_or(""))
}

async fn events(app: &TestApp, token: &str, sid: &str) -> Vec<Value> {
    let page = app
        .get(
            token,
            &format!("/v1/sessions/{sid}/events?format=json&limit=100"),
        )
        .await
        .ok(200);
    page["data"].as_array().cloned().unwrap_or_default()
}

fn types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap_or("").to_owned())
        .collect()
}

fn root(app: &TestApp, sandbox: &str) -> std::path::PathBuf {
    app.sandbox_dir(sandbox).join("root")
}

/// Waits until the `slow-shell` tool call has written its marker: an operation is `running`
/// from its write-ahead record on, a moment before the command itself has done anything.
async fn wait_marker(app: &TestApp, sandbox: &str) {
    let marker = root(app, sandbox).join("marker.txt");
    poll(|| async { (std::fs::read_to_string(&marker).ok()? == "started\n").then_some(()) }).await;
}

#[tokio::test]
async fn a_turn_runs_a_tool_call_in_the_sandbox_and_keeps_its_result() {
    let app = app().await;
    let session = create_session(&app, ALICE, "shell-then-done").await;
    let sid = session["id"].as_str().unwrap();
    assert_eq!(session["state"], "active");
    assert_eq!(session["sandbox_ownership"], "owned");
    let sandbox = session["sandbox_id"].as_str().unwrap();
    assert!(sandbox.starts_with("local:sbx_"));

    let sub = submit(&app, ALICE, sid, "k1", "say hello").await;
    assert_eq!(sub["state"], "queued");
    assert_eq!(sub["queue_position"], 1);
    let id = sub["id"].as_str().unwrap();
    let done = wait_submission(&app, ALICE, id, terminal).await;
    assert_eq!(done["state"], "completed", "{done}");
    assert_eq!(done["lease_generation"], 1);
    assert!(done["usage"]["input_tokens"].as_u64().unwrap() > 0);

    let result = app
        .get(ALICE, &format!("/v1/submissions/{id}/result"))
        .await
        .ok(200);
    assert_eq!(result["output"], "done");
    assert_eq!(result["stop_reason"], "end_turn");
    // The tool really ran inside the sandbox, exactly once.
    let marker = std::fs::read_to_string(root(&app, sandbox).join("marker.txt")).unwrap();
    assert_eq!(marker, "ran\n");

    let ops = app
        .get(
            ALICE,
            &format!("/v1/sessions/{sid}/operations?submission_id={id}"),
        )
        .await
        .ok(200);
    let ops = ops["data"].as_array().unwrap();
    let kinds: Vec<(&str, &str, &str)> = ops
        .iter()
        .map(|o| {
            (
                o["kind"].as_str().unwrap(),
                o["name"].as_str().unwrap(),
                o["state"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("model_call", "shell-then-done", "succeeded"),
            ("tool_call", "shell", "succeeded"),
            ("model_call", "shell-then-done", "succeeded"),
        ]
    );
    assert_eq!(ops[1]["effect_class"], "write");
    assert_eq!(ops[1]["exit_code"], 0);
    let op = app
        .get(
            ALICE,
            &format!("/v1/operations/{}", ops[1]["id"].as_str().unwrap()),
        )
        .await
        .ok(200);
    assert_eq!(op["output"], "hello\n");

    let log = events(&app, ALICE, sid).await;
    let seqs: Vec<i64> = log.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as i64).collect::<Vec<_>>(),
        "gap-free"
    );
    assert_eq!(
        types(&log),
        [
            "session.created",
            "submission.queued",
            "submission.started",
            "operation.started",
            "operation.completed",
            "operation.started",
            "output.delta",
            "operation.completed",
            "operation.started",
            "operation.completed",
            "output.delta",
            "submission.completed",
        ]
    );
    let session = app.get(ALICE, &format!("/v1/sessions/{sid}")).await.ok(200);
    assert_eq!(session["last_seq"], log.len());
    assert_eq!(session["queue_depth"], 0);
    assert_eq!(session["active_submission_id"], Value::Null);
}

/// Waits until an operation of `kind`/`name` of the session is in `state`, and returns it.
async fn wait_operation(app: &TestApp, sid: &str, name: &str, state: &str) -> Value {
    poll(|| async {
        let ops = app
            .get(ALICE, &format!("/v1/sessions/{sid}/operations"))
            .await
            .ok(200);
        ops["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["name"] == name && o["state"] == state)
            .cloned()
    })
    .await
}

async fn wait_sandbox_running(app: &TestApp, sandbox: &str) {
    poll(|| async {
        let s = app
            .get(ALICE, &format!("/v1/sandboxes/{sandbox}"))
            .await
            .ok(200);
        (s["state"] == "running").then_some(())
    })
    .await;
}

async fn wait_gone(app: &TestApp, path: &str) {
    poll(|| async { (app.get(ALICE, path).await.status == 404).then_some(()) }).await;
}

#[tokio::test]
async fn create_validates_before_anything_is_created() {
    let app = app().await;
    let before = app.digest().await;
    let cases = [
        (json!({"agent": {"model": "echo"}}), "sandbox"),
        (
            json!({"agent": {"model": "echo"}, "sandbox": {"create": {}, "attach": "local:sbx_x"}}),
            "sandbox",
        ),
        (
            json!({"agent": {"model": ""}, "sandbox": {"create": {}}}),
            "agent.model",
        ),
        (json!({"sandbox": {"create": {}}}), "agent.model"),
        (
            json!({"agent": {"model": "echo"}, "sandbox": {"create": {"resources": {"cpu": 0}}}}),
            "sandbox.create.resources.cpu",
        ),
        (
            json!({"agent": {"model": "echo"}, "sandbox": {"create": {"provider": "nope"}}}),
            "sandbox.create.provider",
        ),
        (
            json!({"agent": {"model": "echo"}, "sandbox": {"create": {}}, "bogus": 1}),
            "bogus",
        ),
    ];
    for (body, param) in cases {
        let r = app.post(ALICE, "/v1/sessions", body).await;
        assert_eq!(r.problem(400, "invalid_argument")["param"], param);
    }
    let r = app
        .post(
            ALICE,
            "/v1/sessions",
            json!({"agent": {"model": "echo"}, "sandbox": {"create": {"resources": {"cpu": 64}}}}),
        )
        .await;
    r.problem(422, "resources_unsatisfiable");
    let r = app
        .post(
            ALICE,
            "/v1/sessions",
            json!({"agent": {"model": "echo"}, "sandbox": {"attach": "local:sbx_nothing"}}),
        )
        .await;
    r.problem(404, "not_found");
    assert_eq!(app.digest().await, before);
    let list = app.get(ALICE, "/v1/sessions").await.ok(200);
    assert_eq!(list["data"], json!([]));
}

#[tokio::test]
async fn sessions_are_private_to_their_principal() {
    let app = app().await;
    let session = create_session(&app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap();
    let foreign = app.get(BOB, &format!("/v1/sessions/{sid}")).await;
    let never = app
        .get(BOB, "/v1/sessions/ses_01jzzzzzzzzzzzzzzzzzzzzzzz")
        .await;
    let (a, b) = (
        foreign.problem(404, "not_found"),
        never.problem(404, "not_found"),
    );
    assert_eq!(a["detail"], b["detail"]);
    assert_eq!(
        app.get(BOB, "/v1/sessions").await.ok(200)["data"],
        json!([])
    );
    app.post_idem(
        BOB,
        &format!("/v1/sessions/{sid}/submissions"),
        "k",
        json!({"input": "x"}),
    )
    .await
    .problem(404, "not_found");
    app.delete(BOB, &format!("/v1/sessions/{sid}"))
        .await
        .problem(404, "not_found");
    let list = app.get(ALICE, "/v1/sessions").await.ok(200);
    assert_eq!(list["data"][0]["id"], sid);
}

#[tokio::test]
async fn deleting_an_owned_session_kills_its_sandbox_and_confirms_absence() {
    let app = app().await;
    let session = create_session(&app, ALICE, "shell-then-done").await;
    let sid = session["id"].as_str().unwrap();
    let sandbox = session["sandbox_id"].as_str().unwrap().to_owned();
    let sbx = app
        .get(ALICE, &format!("/v1/sandboxes/{sandbox}"))
        .await
        .ok(200);
    assert_eq!(sbx["owner"]["session_id"], sid);
    assert_eq!(sbx["owner"]["principal"], "alice");
    let sub = submit(&app, ALICE, sid, "k", "go").await;
    wait_submission(&app, ALICE, sub["id"].as_str().unwrap(), terminal).await;

    let deleting = app
        .delete(ALICE, &format!("/v1/sessions/{sid}"))
        .await
        .ok(202);
    assert_eq!(deleting["state"], "deleting");
    wait_gone(&app, &format!("/v1/sessions/{sid}")).await;
    // Independently: the sandbox, its root, the submission and the log are all gone.
    app.get(ALICE, &format!("/v1/sandboxes/{sandbox}"))
        .await
        .problem(404, "not_found");
    assert!(!app.sandbox_dir(&sandbox).exists());
    app.get(
        ALICE,
        &format!("/v1/submissions/{}", sub["id"].as_str().unwrap()),
    )
    .await
    .problem(404, "not_found");
    app.get(ALICE, &format!("/v1/sessions/{sid}/events?format=json"))
        .await
        .problem(404, "not_found");
    assert_eq!(
        app.get(ALICE, "/v1/sandboxes").await.ok(200)["data"],
        json!([])
    );
}

async fn borrowed_delete(app: &TestApp) -> (String, Value) {
    let sandbox = app.create_sandbox(ALICE, json!({})).await;
    let sbx_id = sandbox["id"].as_str().unwrap().to_owned();
    std::fs::write(root(app, &sbx_id).join("keep.txt"), "mine").unwrap();
    let session = app
        .post(
            ALICE,
            "/v1/sessions",
            json!({"agent": {"model": "shell-then-done"}, "sandbox": {"attach": sbx_id}}),
        )
        .await
        .ok(201);
    assert_eq!(session["sandbox_ownership"], "borrowed");
    assert_eq!(session["sandbox_id"], sbx_id.as_str());
    let sid = session["id"].as_str().unwrap();
    let sub = submit(app, ALICE, sid, "k", "go").await;
    let done = wait_submission(app, ALICE, sub["id"].as_str().unwrap(), terminal).await;
    assert_eq!(done["state"], "completed");
    app.delete(ALICE, &format!("/v1/sessions/{sid}"))
        .await
        .ok(202);
    wait_gone(app, &format!("/v1/sessions/{sid}")).await;
    let after = app.get(ALICE, &format!("/v1/sandboxes/{sbx_id}")).await;
    let after = if after.status == 200 {
        after.json()
    } else {
        Value::Null
    };
    (sbx_id, after)
}

#[tokio::test]
async fn deleting_a_borrowing_session_leaves_the_owners_sandbox_running() {
    let app = app().await;
    let (sbx_id, after) = borrowed_delete(&app).await;
    assert_eq!(after["state"], "running", "{after}");
    assert_eq!(after["owner"]["session_id"], Value::Null);
    assert_eq!(
        std::fs::read_to_string(root(&app, &sbx_id).join("keep.txt")).unwrap(),
        "mine"
    );
    // Still usable through §3.
    let p = app.start(ALICE, &sbx_id, &["cat", "keep.txt"]).await;
    let p = app.wait_process(ALICE, p["id"].as_str().unwrap()).await;
    assert_eq!(p["exit_code"], 0);
    // The session's worker ended; nothing else runs.
    let procs = app
        .get(ALICE, &format!("/v1/sandboxes/{sbx_id}/processes"))
        .await
        .ok(200);
    assert!(
        procs["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["state"] != "running")
    );
}

#[tokio::test]
async fn a_session_deleted_while_its_sandbox_is_created_disposes_exactly_that_sandbox() {
    let app = app().await;
    let bystander = app.create_sandbox(ALICE, json!({})).await;
    app.post(
        ADMIN,
        "/v1/test/providers/local/create_delay",
        json!({"delay_ms": 1500}),
    )
    .await
    .ok(204);
    let session = create_session(&app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap();
    let sandbox = session["sandbox_id"].as_str().unwrap().to_owned();
    assert_eq!(
        app.get(ALICE, &format!("/v1/sandboxes/{sandbox}"))
            .await
            .ok(200)["state"],
        "starting"
    );
    let upload = app
        .request(
            Some(ALICE),
            reqwest::Method::POST,
            &format!("/v1/sessions/{sid}/files?path=a.txt"),
        )
        .body("x");
    app.send(upload).await.problem(409, "invalid_state");
    let deleting = app
        .delete(ALICE, &format!("/v1/sessions/{sid}"))
        .await
        .ok(202);
    assert_eq!(deleting["cleanup"]["sandbox"], "pending");
    assert_eq!(
        app.delete(ALICE, &format!("/v1/sessions/{sid}"))
            .await
            .ok(202)["state"],
        "deleting"
    );
    app.post_idem(
        ALICE,
        &format!("/v1/sessions/{sid}/submissions"),
        "late",
        json!({"input": "x"}),
    )
    .await
    .problem(409, "session_not_active");
    app.post(ALICE, &format!("/v1/sessions/{sid}/resume"), json!({}))
        .await
        .problem(409, "session_not_active");
    // Until the create completes the session stays visible, deleting.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        app.get(ALICE, &format!("/v1/sessions/{sid}")).await.ok(200)["state"],
        "deleting"
    );
    wait_gone(&app, &format!("/v1/sessions/{sid}")).await;
    app.post(
        ADMIN,
        "/v1/test/providers/local/create_delay",
        json!({"delay_ms": 0}),
    )
    .await
    .ok(204);
    tokio::time::sleep(Duration::from_millis(300)).await;
    app.get(ALICE, &format!("/v1/sandboxes/{sandbox}"))
        .await
        .problem(404, "not_found");
    assert!(!app.sandbox_dir(&sandbox).exists());
    let list = app.get(ALICE, "/v1/sandboxes").await.ok(200);
    let ids = strings(&list["data"], "id");
    assert_eq!(ids, [bystander["id"].as_str().unwrap()]);
}

#[tokio::test]
async fn submit_is_idempotent_and_needs_a_key() {
    let app = app().await;
    let session = create_session(&app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap();
    let path = format!("/v1/sessions/{sid}/submissions");
    wait_sandbox_running(&app, session["sandbox_id"].as_str().unwrap()).await;
    let before = app.digest().await;
    let r = app.post(ALICE, &path, json!({"input": "hi"})).await;
    assert_eq!(
        r.problem(400, "invalid_argument")["param"],
        "Idempotency-Key"
    );
    for body in [json!({}), json!({"input": ""}), json!({"input": 3})] {
        let r = app.post_idem(ALICE, &path, "bad", body).await;
        assert_eq!(r.problem(400, "invalid_argument")["param"], "input");
    }
    assert_eq!(app.digest().await, before);

    let first = app
        .post_idem(ALICE, &path, "same", json!({"input": "hi"}))
        .await;
    let first_body = first.ok(202);
    let id = first_body["id"].as_str().unwrap();
    assert_eq!(
        first.header("location"),
        Some(format!("/v1/submissions/{id}").as_str())
    );
    let again = app
        .post_idem(ALICE, &path, "same", json!({"input": "hi"}))
        .await;
    assert_eq!(again.ok(202)["id"], id);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    app.post_idem(ALICE, &path, "same", json!({"input": "other"}))
        .await
        .problem(422, "idempotency_key_reused");
    wait_submission(&app, ALICE, id, terminal).await;
    let list = app.get(ALICE, &path).await.ok(200);
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
    let result = app
        .get(ALICE, &format!("/v1/submissions/{id}/result"))
        .await
        .ok(200);
    assert_eq!(result["output"], "echo: hi");
}

/// Submits three slow turns and returns the session's log once all are terminal.
async fn three_queued_turns(app: &TestApp) -> Vec<Value> {
    let session = create_session(app, ALICE, "slow-text").await;
    let sid = session["id"].as_str().unwrap();
    let mut ids = Vec::new();
    for i in 0..3 {
        let s = submit(app, ALICE, sid, &format!("k{i}"), &format!("turn {i}")).await;
        // Behind the turns submitted before it, less any that already started.
        let position = s["queue_position"].as_u64().unwrap();
        assert!((1..=i + 1).contains(&position), "turn {i}: {s}");
        ids.push(s["id"].as_str().unwrap().to_owned());
    }
    for id in &ids {
        wait_submission(app, ALICE, id, terminal).await;
    }
    let log = events(app, ALICE, sid).await;
    log.into_iter()
        .filter(|e| e["type"] == "submission.started" || e["type"] == "submission.completed")
        .map(|e| {
            json!([
                e["type"],
                ids.iter().position(|i| e["submission_id"] == i.as_str())
            ])
        })
        .collect()
}

#[tokio::test]
async fn queued_turns_run_one_at_a_time_in_order() {
    let app = app().await;
    let order = three_queued_turns(&app).await;
    assert_eq!(
        order,
        [
            json!(["submission.started", 0]),
            json!(["submission.completed", 0]),
            json!(["submission.started", 1]),
            json!(["submission.completed", 1]),
            json!(["submission.started", 2]),
            json!(["submission.completed", 2]),
        ]
    );
}

#[tokio::test]
async fn cancellation_of_queued_running_and_finished_turns() {
    let app = app().await;
    let session = create_session(&app, ALICE, "slow-shell").await;
    let sid = session["id"].as_str().unwrap();
    let sandbox = session["sandbox_id"].as_str().unwrap();
    let running = submit(&app, ALICE, sid, "a", "long").await;
    let queued = submit(&app, ALICE, sid, "b", "later").await;
    let (running, queued) = (
        running["id"].as_str().unwrap(),
        queued["id"].as_str().unwrap(),
    );
    wait_operation(&app, sid, "shell", "running").await;
    wait_marker(&app, sandbox).await;

    let r = app
        .post(
            ALICE,
            &format!("/v1/submissions/{queued}/cancel"),
            json!({}),
        )
        .await;
    assert_eq!(r.ok(200)["state"], "cancelled");
    let r = app
        .post(
            ALICE,
            &format!("/v1/submissions/{running}/cancel"),
            json!({}),
        )
        .await;
    assert_eq!(r.ok(202)["state"], "cancelling");
    let r = app
        .post(
            ALICE,
            &format!("/v1/submissions/{running}/cancel"),
            json!({}),
        )
        .await;
    assert_eq!(r.ok(202)["state"], "cancelling");
    let done = wait_submission(&app, ALICE, running, terminal).await;
    assert_eq!(done["state"], "cancelled");
    let op = wait_operation(&app, sid, "shell", "cancelled").await;
    assert_eq!(op["cancel_requested"], false);
    // The tool's process is gone: nothing in the sandbox still runs `sleep`.
    let marker = std::fs::read_to_string(root(&app, sandbox).join("marker.txt")).unwrap();
    assert_eq!(marker, "started\n");
    // The cancelled queued turn never ran.
    assert_eq!(
        app.get(ALICE, &format!("/v1/submissions/{queued}"))
            .await
            .ok(200)["started_at"],
        Value::Null
    );

    // A finished turn is left as it is.
    let before = app
        .get(ALICE, &format!("/v1/submissions/{running}"))
        .await
        .ok(200);
    let r = app
        .post(
            ALICE,
            &format!("/v1/submissions/{running}/cancel"),
            json!({}),
        )
        .await;
    assert_eq!(r.ok(200), before);
    let result = app
        .get(ALICE, &format!("/v1/submissions/{running}/result"))
        .await
        .ok(200);
    assert_eq!(result["stop_reason"], "cancelled");
}

#[tokio::test]
async fn finished_turns_are_not_changed_by_cancel() {
    let app = app().await;
    let session = create_session(&app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap();
    let sub = submit(&app, ALICE, sid, "k", "hi").await;
    let id = sub["id"].as_str().unwrap();
    let done = wait_submission(&app, ALICE, id, terminal).await;
    assert_eq!(done["state"], "completed");
    let r = app
        .post(ALICE, &format!("/v1/submissions/{id}/cancel"), json!({}))
        .await;
    assert_eq!(r.ok(200)["state"], "completed");
    assert_eq!(
        app.get(ALICE, &format!("/v1/submissions/{id}"))
            .await
            .ok(200),
        done
    );
}

#[tokio::test]
async fn results_expire_after_retention_but_the_submission_stays() {
    let app = app_with(|c| c.retention.result_s = 1).await;
    let session = create_session(&app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap();
    let sub = submit(&app, ALICE, sid, "k", "hi").await;
    let id = sub["id"].as_str().unwrap();
    app.get(ALICE, &format!("/v1/submissions/{id}/result"))
        .await;
    let done = wait_submission(&app, ALICE, id, terminal).await;
    assert!(done["result_expires_at"].is_string());
    app.get(ALICE, &format!("/v1/submissions/{id}/result"))
        .await
        .ok(200);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    app.get(ALICE, &format!("/v1/submissions/{id}/result"))
        .await
        .problem(410, "result_expired");
    let kept = app
        .get(ALICE, &format!("/v1/submissions/{id}"))
        .await
        .ok(200);
    assert_eq!(kept["state"], "completed");
    assert_eq!(kept["usage"], done["usage"]);
}

#[tokio::test]
async fn a_result_is_not_terminal_until_the_turn_ends_and_queues_are_bounded() {
    let app = app_with(|c| c.limits.max_queue_depth = 1).await;
    let session = create_session(&app, ALICE, "slow-shell").await;
    let sid = session["id"].as_str().unwrap();
    let running = submit(&app, ALICE, sid, "a", "long").await;
    let running = running["id"].as_str().unwrap();
    wait_operation(&app, sid, "shell", "running").await;
    app.get(ALICE, &format!("/v1/submissions/{running}/result"))
        .await
        .problem(409, "not_terminal");
    submit(&app, ALICE, sid, "b", "queued").await;
    let before = app.digest().await;
    let full = app
        .post_idem(
            ALICE,
            &format!("/v1/sessions/{sid}/submissions"),
            "c",
            json!({"input": "more"}),
        )
        .await;
    full.problem(429, "queue_full");
    assert!(full.header("retry-after").is_some());
    assert_eq!(app.digest().await, before);
}

#[tokio::test]
async fn a_killed_worker_makes_the_turn_uncertain_and_it_is_never_replayed() {
    let app = app().await;
    let session = create_session(&app, ALICE, "slow-shell").await;
    let sid = session["id"].as_str().unwrap();
    let sandbox = session["sandbox_id"].as_str().unwrap();
    let first = submit(&app, ALICE, sid, "a", "long").await;
    let waiting = submit(&app, ALICE, sid, "b", "next").await;
    let (first, waiting) = (
        first["id"].as_str().unwrap(),
        waiting["id"].as_str().unwrap(),
    );
    let tool = wait_operation(&app, sid, "shell", "running").await;
    wait_marker(&app, sandbox).await;
    app.post(
        ADMIN,
        &format!("/v1/test/sessions/{sid}/kill_worker"),
        json!({}),
    )
    .await
    .ok(204);

    let s = wait_submission(&app, ALICE, first, terminal).await;
    assert_eq!(s["state"], "uncertain", "{s}");
    assert_eq!(s["outcome"]["reason"], "worker_lost");
    assert_eq!(s["outcome"]["lease_generation"], 1);
    assert_eq!(s["outcome"]["side_effects"], "possible");
    assert_eq!(s["outcome"]["operations_in_doubt"], json!([tool["id"]]));
    let op = app
        .get(
            ALICE,
            &format!("/v1/operations/{}", tool["id"].as_str().unwrap()),
        )
        .await
        .ok(200);
    assert_eq!(op["state"], "uncertain");
    let session = app.get(ALICE, &format!("/v1/sessions/{sid}")).await.ok(200);
    assert_eq!(session["state"], "paused");
    assert_eq!(session["pause_reason"], "uncertain_submission");

    // Paused: the next turn waits and the first one is not run again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        app.get(ALICE, &format!("/v1/submissions/{waiting}"))
            .await
            .ok(200)["state"],
        "queued"
    );
    let marker = std::fs::read_to_string(root(&app, sandbox).join("marker.txt")).unwrap();
    assert_eq!(marker, "started\n", "the tool call ran again");
    let r = app
        .post(
            ALICE,
            &format!("/v1/test/sessions/{sid}/kill_worker"),
            json!({}),
        )
        .await;
    r.problem(403, "permission_denied");
    app.post(
        ADMIN,
        &format!("/v1/test/sessions/{sid}/kill_worker"),
        json!({}),
    )
    .await
    .problem(409, "invalid_state");

    // Resume: the waiting turn runs under a new generation.
    app.post(ALICE, &format!("/v1/sessions/{sid}/resume"), json!({}))
        .await
        .ok(200);
    app.post(ALICE, &format!("/v1/sessions/{sid}/resume"), json!({}))
        .await
        .problem(409, "session_not_paused");
    let next = wait_submission(&app, ALICE, waiting, |s| s["state"] == "running").await;
    assert_eq!(next["lease_generation"], 2);
    assert_eq!(
        app.get(ALICE, &format!("/v1/submissions/{first}"))
            .await
            .ok(200)["state"],
        "uncertain"
    );
    let log = types(&events(&app, ALICE, sid).await);
    assert_eq!(
        log.iter().filter(|t| *t == "submission.uncertain").count(),
        1
    );
    assert!(
        log.contains(&"session.paused".to_owned()) && log.contains(&"session.resumed".to_owned())
    );
}

// ----- the private bridge -----

struct Bridge {
    sid: String,
    secret: String,
    revision: String,
}

impl Bridge {
    async fn of(app: &TestApp, sid: &str) -> Bridge {
        let creds = app
            .get(ADMIN, &format!("/v1/test/sessions/{sid}/bridge"))
            .await
            .ok(200);
        assert_eq!(creds["session_id"], sid);
        Bridge {
            sid: sid.to_owned(),
            secret: creds["secret"].as_str().unwrap().to_owned(),
            revision: creds["control_revision"].as_str().unwrap().to_owned(),
        }
    }

    /// Sends a bridge request; `sign` false leaves the signature out, `secret` overrides it.
    async fn send(
        &self,
        app: &TestApp,
        suffix: &str,
        body: Value,
        how: Signing<'_>,
    ) -> support::Reply {
        let target = format!("/bridge/v1/sessions/{}/{suffix}", self.sid);
        let bytes = serde_json::to_vec(&body).unwrap();
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let mut rb = app
            .client
            .post(app.url(&target))
            .header("content-type", "application/json")
            .body(bytes.clone());
        let (secret, ts, revision) = match how {
            Signing::Unsigned => (None, now, Some(self.revision.as_str())),
            Signing::Secret(s) => (Some(s), now, Some(self.revision.as_str())),
            Signing::Valid => (
                Some(self.secret.as_str()),
                now,
                Some(self.revision.as_str()),
            ),
            Signing::At(ts) => (Some(self.secret.as_str()), ts, Some(self.revision.as_str())),
            Signing::Revision(r) => (Some(self.secret.as_str()), now, r),
        };
        if let Some(secret) = secret {
            let ts = ts.to_string();
            let sig =
                reference_server::gateway::signing::sign(secret, "POST", &target, &bytes, &ts);
            rb = rb
                .header("x-sandspec-timestamp", ts)
                .header("x-sandspec-signature", sig);
        }
        if let Some(r) = revision {
            rb = rb.header("x-sandspec-control-revision", r);
        }
        app.send(rb).await
    }
}

#[derive(Clone, Copy)]
enum Signing<'a> {
    Unsigned,
    Secret(&'a str),
    Valid,
    At(i64),
    Revision(Option<&'a str>),
}

/// A session with no work (so no worker) and the sandbox already running.
async fn idle_session(app: &TestApp) -> (String, Bridge) {
    let session = create_session(app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap().to_owned();
    wait_sandbox_running(app, session["sandbox_id"].as_str().unwrap()).await;
    let bridge = Bridge::of(app, &sid).await;
    (sid, bridge)
}

#[tokio::test]
async fn bridge_requests_are_authenticated_before_anything_is_read_or_written() {
    let app = app_with(|c| c.gateway.lease_ttl = Duration::from_secs(30)).await;
    let (sid, bridge) = idle_session(&app).await;
    let creds = app
        .get(ADMIN, &format!("/v1/test/sessions/{sid}/bridge"))
        .await
        .ok(200);
    assert_eq!(creds["lease_generation"], Value::Null);
    let before = app.digest().await;
    let lease = json!({"worker_id": "w"});
    let mut details = Vec::new();
    for how in [
        Signing::Unsigned,
        Signing::Secret("wrong"),
        Signing::At(1_000),
    ] {
        let r = bridge.send(&app, "lease", lease.clone(), how).await;
        details.push(r.problem(403, "permission_denied")["detail"].clone());
    }
    // A principal's bearer token is no substitute for a signature.
    let r = app
        .send(
            app.request(
                Some(ALICE),
                reqwest::Method::POST,
                &format!("/bridge/v1/sessions/{sid}/lease"),
            )
            .header("x-sandspec-control-revision", "r")
            .json(&lease),
        )
        .await;
    details.push(r.problem(403, "permission_denied")["detail"].clone());
    // An unknown session looks exactly like a bad signature.
    let other = Bridge {
        sid: "ses_01jzzzzzzzzzzzzzzzzzzzzzzz".into(),
        secret: bridge.secret.clone(),
        revision: bridge.revision.clone(),
    };
    let r = other
        .send(&app, "lease", lease.clone(), Signing::Valid)
        .await;
    details.push(r.problem(403, "permission_denied")["detail"].clone());
    assert!(details.windows(2).all(|w| w[0] == w[1]));
    for revision in [None, Some("")] {
        let r = bridge
            .send(&app, "lease", lease.clone(), Signing::Revision(revision))
            .await;
        assert_eq!(
            r.problem(400, "invalid_argument")["param"],
            "control_revision"
        );
    }
    assert_eq!(app.digest().await, before);
    let r = bridge
        .send(&app, "lease", lease.clone(), Signing::Valid)
        .await;
    assert_eq!(r.ok(201)["lease_generation"], 1);
}

#[tokio::test]
async fn a_stale_lease_generation_writes_nothing() {
    let app = app_with(|c| c.gateway.lease_ttl = Duration::from_secs(30)).await;
    let (sid, bridge) = idle_session(&app).await;
    let lease = json!({"worker_id": "w"});
    assert_eq!(
        bridge
            .send(&app, "lease", lease.clone(), Signing::Valid)
            .await
            .ok(201)["lease_generation"],
        1
    );
    assert_eq!(
        bridge
            .send(&app, "lease", lease.clone(), Signing::Valid)
            .await
            .ok(201)["lease_generation"],
        2
    );
    let before = app.digest().await;
    let stale = json!({"lease_generation": 1});
    bridge
        .send(&app, "heartbeat", stale.clone(), Signing::Valid)
        .await
        .problem(409, "lease_lost");
    bridge
        .send(&app, "next", stale, Signing::Valid)
        .await
        .problem(409, "lease_lost");
    let write = json!({"lease_generation": 1, "submission_id": "sub_x", "stream": "assistant", "text": "x"});
    bridge
        .send(&app, "output", write, Signing::Valid)
        .await
        .problem(409, "lease_lost");
    assert_eq!(app.digest().await, before);
    let hb = bridge
        .send(
            &app,
            "heartbeat",
            json!({"lease_generation": 2}),
            Signing::Valid,
        )
        .await
        .ok(200);
    assert_eq!(hb["cancel_submission"], false);
    assert_eq!(
        app.get(ADMIN, &format!("/v1/test/sessions/{sid}/bridge"))
            .await
            .ok(200)["lease_generation"],
        2
    );
}

#[tokio::test]
async fn an_idle_workers_next_waits_for_work_and_takes_what_comes() {
    let app = app_with(|c| c.gateway.lease_ttl = Duration::from_secs(30)).await;
    let (sid, bridge) = idle_session(&app).await;
    bridge
        .send(&app, "lease", json!({"worker_id": "suite"}), Signing::Valid)
        .await
        .ok(201);
    let before = app.digest().await;
    for bad in [json!(1001), json!(-1), json!("10")] {
        let r = bridge
            .send(
                &app,
                "next",
                json!({"lease_generation": 1, "wait_ms": bad}),
                Signing::Valid,
            )
            .await;
        r.problem(400, "invalid_argument");
    }
    assert_eq!(app.digest().await, before);
    // Nothing queued: a short wait ends empty.
    bridge
        .send(
            &app,
            "next",
            json!({"lease_generation": 1, "wait_ms": 50}),
            Signing::Valid,
        )
        .await
        .ok(204);
    // A submission made while the ask waits is what it answers with.
    let (work, sub) = tokio::join!(
        bridge.send(
            &app,
            "next",
            json!({"lease_generation": 1, "wait_ms": 1000}),
            Signing::Valid,
        ),
        async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            submit(&app, ALICE, &sid, "k", "hi").await
        }
    );
    assert_eq!(work.ok(200)["submission_id"], sub["id"]);
}

// ----- the session event stream -----

#[tokio::test]
async fn the_session_stream_replays_follows_and_resumes_without_gaps() {
    let app = app().await;
    let session = create_session(&app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap();
    let path = format!("/v1/sessions/{sid}/events");
    let r = app.get(ALICE, &path).await;
    r.problem(406, "not_acceptable");

    let mut sse =
        support::RawSse::open(&app, &path, ALICE, &[("Accept", "text/event-stream")]).await;
    assert_eq!(sse.status, 200);
    assert_eq!(
        sse.header("content-type").as_deref(),
        Some("text/event-stream")
    );
    assert_eq!(
        sse.header("cache-control").as_deref(),
        Some("no-store, no-transform")
    );
    assert_eq!(sse.header("x-accel-buffering").as_deref(), Some("no"));
    let first = sse.next(Duration::from_secs(5)).await.unwrap();
    assert_eq!(first.field("id"), Some("1"));
    assert_eq!(first.field("event"), Some("session.created"));
    assert_eq!(first.data()["seq"], 1);
    let sub = submit(&app, ALICE, sid, "k", "hi").await;
    let mut seen = vec![first];
    while seen.last().unwrap().field("event") != Some("submission.completed") {
        let f = sse
            .next(Duration::from_secs(10))
            .await
            .expect("stream open");
        if !f.is_comment() {
            seen.push(f);
        }
    }
    let ids: Vec<i64> = seen
        .iter()
        .map(|f| f.field("id").unwrap().parse().unwrap())
        .collect();
    assert_eq!(ids, (1..=ids.len() as i64).collect::<Vec<_>>());
    assert!(seen.iter().all(|f| f.data()["session_id"] == sid));
    assert_eq!(seen.last().unwrap().data()["submission_id"], sub["id"]);
    drop(sse);

    let resumed = resume_first_id(&app, &path, 2).await;
    assert_eq!(resumed, 3);
}

/// The `id` of the first event after resuming from `after` with `Last-Event-ID`.
async fn resume_first_id(app: &TestApp, path: &str, after: i64) -> i64 {
    let after = after.to_string();
    let mut sse = support::RawSse::open(
        app,
        path,
        ALICE,
        &[
            ("Accept", "text/event-stream"),
            ("Last-Event-ID", after.as_str()),
        ],
    )
    .await;
    assert_eq!(sse.status, 200);
    loop {
        let f = sse.next(Duration::from_secs(5)).await.expect("an event");
        if !f.is_comment() {
            return f.field("id").unwrap().parse().unwrap();
        }
    }
}

#[tokio::test]
async fn open_streams_of_a_deleted_session_end_with_session_deleted() {
    let app = app().await;
    let session = create_session(&app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap();
    let mut sse = support::RawSse::open(
        &app,
        &format!("/v1/sessions/{sid}/events"),
        ALICE,
        &[("Accept", "text/event-stream")],
    )
    .await;
    app.delete(ALICE, &format!("/v1/sessions/{sid}"))
        .await
        .ok(202);
    let frames = sse.events_until_end(Duration::from_secs(15)).await;
    let last = frames.last().expect("events");
    assert_eq!(last.field("event"), Some("session.deleted"));
    assert!(sse.eof);
}

/// Opens `/v1/submissions/{id}/events` for ALICE, resuming after `after` when given.
async fn submission_stream(app: &TestApp, id: &str, after: Option<i64>) -> support::RawSse {
    let after = after.map(|n| n.to_string());
    let mut headers = vec![("Accept", "text/event-stream")];
    if let Some(after) = &after {
        headers.push(("Last-Event-ID", after.as_str()));
    }
    support::RawSse::open(
        app,
        &format!("/v1/submissions/{id}/events"),
        ALICE,
        &headers,
    )
    .await
}

fn ids(frames: &[support::Frame]) -> Vec<i64> {
    frames
        .iter()
        .map(|f| f.field("id").expect("an id").parse().expect("a number"))
        .collect()
}

/// A session with two finished turns: `(sid, first, second)`.
#[cfg(feature = "defects")]
async fn two_finished_turns(app: &TestApp) -> (String, String, String) {
    let session = create_session(app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap().to_owned();
    let first = submit(app, ALICE, &sid, "a", "one").await;
    let second = submit(app, ALICE, &sid, "b", "two").await;
    let [first, second] = [&first, &second].map(|s| s["id"].as_str().unwrap().to_owned());
    wait_submission(app, ALICE, &second, terminal).await;
    (sid, first, second)
}

#[tokio::test]
async fn a_submission_stream_carries_its_own_events_and_ends_after_the_last() {
    let app = app().await;
    let session = create_session(&app, ALICE, "slow-text").await;
    let sid = session["id"].as_str().unwrap();
    let first = submit(&app, ALICE, sid, "a", "one").await;
    let second = submit(&app, ALICE, sid, "b", "two").await;
    let (first, second) = (
        first["id"].as_str().unwrap(),
        second["id"].as_str().unwrap(),
    );
    let path = format!("/v1/submissions/{second}/events");
    app.get(ALICE, &path).await.problem(406, "not_acceptable");
    for (token, id) in [(BOB, second), (ALICE, "sub_01jzzzzzzzzzzzzzzzzzzzzzzz")] {
        let r = app
            .send(
                app.request(
                    Some(token),
                    reqwest::Method::GET,
                    &format!("/v1/submissions/{id}/events"),
                )
                .header("Accept", "text/event-stream"),
            )
            .await;
        r.problem(404, "not_found");
    }

    // Opened while the turn is still queued behind the first one.
    let mut sse = submission_stream(&app, second, None).await;
    assert_eq!(sse.status, 200);
    assert_eq!(
        sse.header("content-type").as_deref(),
        Some("text/event-stream")
    );
    assert_eq!(
        app.get(ALICE, &format!("/v1/submissions/{second}"))
            .await
            .ok(200)["state"],
        "queued"
    );
    let frames = sse.events_until_end(Duration::from_secs(20)).await;
    assert!(sse.eof);
    assert!(
        frames.iter().all(|f| f.data()["submission_id"] == second),
        "{frames:?}"
    );
    let seen = types(&frames.iter().map(support::Frame::data).collect::<Vec<_>>());
    assert_eq!(seen.first().map(String::as_str), Some("submission.queued"));
    assert_eq!(
        seen.last().map(String::as_str),
        Some("submission.completed")
    );
    assert!(seen.contains(&"submission.started".to_owned()), "{seen:?}");
    for f in &frames {
        assert_eq!(f.data()["seq"].to_string(), f.field("id").unwrap());
    }
    // The session's seq numbers: increasing, with the first turn's events left out.
    let got = ids(&frames);
    assert!(got.windows(2).all(|w| w[0] < w[1]), "{got:?}");
    let log = events(&app, ALICE, sid).await;
    let expected: Vec<i64> = log
        .iter()
        .filter(|e| e["submission_id"] == second)
        .map(|e| e["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(got, expected);
    assert!(log.iter().any(|e| e["submission_id"] == first));
    assert!(got[0] > 1);

    // A resume continues with the next of its own events, cursors being the session's seq.
    let mut resumed = submission_stream(&app, second, Some(got[0])).await;
    assert_eq!(
        ids(&resumed.events_until_end(Duration::from_secs(5)).await),
        got[1..]
    );
    // Finished, with nothing of it after the cursor: 204, even though the log goes on.
    let last = *got.last().unwrap();
    assert_eq!(
        submission_stream(&app, second, Some(last)).await.status,
        204
    );
    let first_end = log
        .iter()
        .find(|e| e["submission_id"] == first && e["type"] == "submission.completed")
        .unwrap()["seq"]
        .as_i64()
        .unwrap();
    assert!(first_end < last);
    assert_eq!(
        submission_stream(&app, first, Some(first_end)).await.status,
        204
    );
    // Without a cursor a finished submission replays its events and ends.
    let mut replay = submission_stream(&app, first, None).await;
    assert_eq!(replay.status, 200);
    let replayed = replay.events_until_end(Duration::from_secs(5)).await;
    assert_eq!(
        replayed.last().unwrap().field("event"),
        Some("submission.completed")
    );
    assert_eq!(*ids(&replayed).last().unwrap(), first_end);
}

#[tokio::test]
async fn a_cancelled_queued_submission_stream_ends_with_its_cancel() {
    let app = app().await;
    let session = create_session(&app, ALICE, "slow-text-2s").await;
    let sid = session["id"].as_str().unwrap();
    submit(&app, ALICE, sid, "a", "one").await;
    let queued = submit(&app, ALICE, sid, "b", "two").await;
    let queued = queued["id"].as_str().unwrap();
    let mut sse = submission_stream(&app, queued, None).await;
    assert_eq!(sse.status, 200);
    app.post(
        ALICE,
        &format!("/v1/submissions/{queued}/cancel"),
        json!({}),
    )
    .await
    .ok(200);
    let frames = sse.events_until_end(Duration::from_secs(10)).await;
    let seen: Vec<_> = frames.iter().map(|f| f.field("event").unwrap()).collect();
    assert_eq!(seen, ["submission.queued", "submission.cancelled"]);
}

// ----- negative controls: each gateway defect changes what the tests above observe -----

#[cfg(feature = "defects")]
mod defects {
    use super::*;
    use reference_server::defects::Defects;

    async fn with_defect(name: &str) -> TestApp {
        let name = name.to_owned();
        app_with(move |c| {
            c.defects = Defects::parse([name.as_str()]).unwrap();
            c.gateway.lease_ttl = Duration::from_secs(30);
        })
        .await
    }

    #[tokio::test]
    async fn worker_death_replays_turn() {
        let app = with_defect("worker-death-replays-turn").await;
        let session = create_session(&app, ALICE, "slow-shell").await;
        let sid = session["id"].as_str().unwrap();
        let sandbox = session["sandbox_id"].as_str().unwrap();
        let sub = submit(&app, ALICE, sid, "a", "long").await;
        wait_operation(&app, sid, "shell", "running").await;
        wait_marker(&app, sandbox).await;
        app.post(
            ADMIN,
            &format!("/v1/test/sessions/{sid}/kill_worker"),
            json!({}),
        )
        .await
        .ok(204);
        let marker = root(&app, sandbox).join("marker.txt");
        poll(|| async {
            (std::fs::read_to_string(&marker).ok()? == "started\nstarted\n").then_some(())
        })
        .await;
        let s = app
            .get(
                ALICE,
                &format!("/v1/submissions/{}", sub["id"].as_str().unwrap()),
            )
            .await
            .ok(200);
        assert_ne!(s["state"], "uncertain");
    }

    #[tokio::test]
    async fn borrowed_sandbox_killed_on_delete() {
        let app = with_defect("borrowed-sandbox-killed-on-delete").await;
        let (_, after) = borrowed_delete(&app).await;
        assert_eq!(after, Value::Null);
    }

    #[tokio::test]
    async fn owned_sandbox_left_on_delete() {
        let app = with_defect("owned-sandbox-left-on-delete").await;
        let session = create_session(&app, ALICE, "echo").await;
        let sid = session["id"].as_str().unwrap();
        let sandbox = session["sandbox_id"].as_str().unwrap();
        wait_sandbox_running(&app, sandbox).await;
        app.delete(ALICE, &format!("/v1/sessions/{sid}"))
            .await
            .ok(202);
        wait_gone(&app, &format!("/v1/sessions/{sid}")).await;
        app.get(ALICE, &format!("/v1/sandboxes/{sandbox}"))
            .await
            .ok(200);
    }

    #[tokio::test]
    async fn cancel_running_ignored() {
        let app = with_defect("cancel-running-ignored").await;
        let session = create_session(&app, ALICE, "slow-shell").await;
        let sid = session["id"].as_str().unwrap();
        let sub = submit(&app, ALICE, sid, "a", "long").await;
        let id = sub["id"].as_str().unwrap();
        wait_operation(&app, sid, "shell", "running").await;
        let r = app
            .post(ALICE, &format!("/v1/submissions/{id}/cancel"), json!({}))
            .await;
        assert_eq!(r.ok(202)["state"], "cancelling");
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            app.get(ALICE, &format!("/v1/submissions/{id}"))
                .await
                .ok(200)["state"],
            "running"
        );
    }

    #[tokio::test]
    async fn artifact_tracks_file() {
        let app = with_defect("artifact-tracks-file").await;
        let session = create_session(&app, ALICE, "write-artifact").await;
        let sid = session["id"].as_str().unwrap();
        let sandbox = session["sandbox_id"].as_str().unwrap();
        let sub = submit(&app, ALICE, sid, "a", "write").await;
        let id = sub["id"].as_str().unwrap();
        wait_submission(&app, ALICE, id, terminal).await;
        let result = app
            .get(ALICE, &format!("/v1/submissions/{id}/result"))
            .await
            .ok(200);
        let art = result["artifacts"][0]["id"].as_str().unwrap().to_owned();
        std::fs::write(root(&app, sandbox).join("artifacts/report.txt"), "changed").unwrap();
        let content = app
            .get(ALICE, &format!("/v1/artifacts/{art}/content"))
            .await;
        assert_eq!(&content.body[..], b"changed");
    }

    #[tokio::test]
    async fn rejected_request_writes_state() {
        let app = with_defect("rejected-request-writes-state").await;
        let before = app.digest().await;
        let r = app
            .post(ALICE, "/v1/sessions", json!({"agent": {"model": "echo"}}))
            .await;
        r.problem(400, "invalid_argument");
        assert_ne!(app.digest().await, before);
    }

    #[tokio::test]
    async fn operation_cancel_ignored() {
        let app = with_defect("operation-cancel-ignored").await;
        let session = create_session(&app, ALICE, "slow-shell").await;
        let sid = session["id"].as_str().unwrap();
        submit(&app, ALICE, sid, "a", "long").await;
        let tool = wait_operation(&app, sid, "shell", "running").await;
        let id = tool["id"].as_str().unwrap();
        let r = app
            .post(ALICE, &format!("/v1/operations/{id}/cancel"), json!({}))
            .await;
        assert_eq!(r.ok(200)["cancel_requested"], true);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let op = app
            .get(ALICE, &format!("/v1/operations/{id}"))
            .await
            .ok(200);
        assert_eq!(op["state"], "running");
        assert_eq!(op["cancel_requested"], false);
    }

    #[tokio::test]
    async fn late_create_leaks() {
        let app = with_defect("late-create-leaks").await;
        app.post(
            ADMIN,
            "/v1/test/providers/local/create_delay",
            json!({"delay_ms": 1000}),
        )
        .await
        .ok(204);
        let session = create_session(&app, ALICE, "echo").await;
        let sid = session["id"].as_str().unwrap();
        app.delete(ALICE, &format!("/v1/sessions/{sid}"))
            .await
            .ok(202);
        wait_gone(&app, &format!("/v1/sessions/{sid}")).await;
        let sandbox = session["sandbox_id"].as_str().unwrap();
        poll(|| async {
            (app.get(ALICE, &format!("/v1/sandboxes/{sandbox}"))
                .await
                .status
                == 200)
                .then_some(())
        })
        .await;
    }

    #[tokio::test]
    async fn cancel_finished_changes_it() {
        let app = with_defect("cancel-finished-changes-it").await;
        let session = create_session(&app, ALICE, "echo").await;
        let sid = session["id"].as_str().unwrap();
        let sub = submit(&app, ALICE, sid, "k", "hi").await;
        let id = sub["id"].as_str().unwrap();
        wait_submission(&app, ALICE, id, terminal).await;
        let r = app
            .post(ALICE, &format!("/v1/submissions/{id}/cancel"), json!({}))
            .await;
        assert_eq!(r.ok(200)["state"], "cancelled");
    }

    #[tokio::test]
    async fn result_never_expires() {
        let app = app_with(|c| {
            c.defects = Defects::parse(["result-never-expires"]).unwrap();
            c.retention.result_s = 1;
        })
        .await;
        let session = create_session(&app, ALICE, "echo").await;
        let sid = session["id"].as_str().unwrap();
        let sub = submit(&app, ALICE, sid, "k", "hi").await;
        let id = sub["id"].as_str().unwrap();
        wait_submission(&app, ALICE, id, terminal).await;
        tokio::time::sleep(Duration::from_millis(1200)).await;
        app.get(ALICE, &format!("/v1/submissions/{id}/result"))
            .await
            .ok(200);
    }

    #[tokio::test]
    async fn queue_runs_concurrently() {
        let app = with_defect("queue-runs-concurrently").await;
        let order = three_queued_turns(&app).await;
        assert_eq!(order[1], json!(["submission.started", 1]), "{order:?}");
    }

    #[tokio::test]
    async fn stale_lease_write_accepted() {
        let app = with_defect("stale-lease-write-accepted").await;
        let (_, bridge) = idle_session(&app).await;
        bridge
            .send(&app, "lease", json!({"worker_id": "w"}), Signing::Valid)
            .await
            .ok(201);
        bridge
            .send(&app, "lease", json!({"worker_id": "w"}), Signing::Valid)
            .await
            .ok(201);
        bridge
            .send(
                &app,
                "heartbeat",
                json!({"lease_generation": 1}),
                Signing::Valid,
            )
            .await
            .ok(200);
    }

    #[tokio::test]
    async fn empty_revision_accepted() {
        let app = with_defect("empty-revision-accepted").await;
        let (_, bridge) = idle_session(&app).await;
        let r = bridge
            .send(
                &app,
                "lease",
                json!({"worker_id": "w"}),
                Signing::Revision(Some("")),
            )
            .await;
        assert_eq!(r.status, 201);
    }

    #[tokio::test]
    async fn bridge_signature_unchecked() {
        let app = with_defect("bridge-signature-unchecked").await;
        let (_, bridge) = idle_session(&app).await;
        let r = bridge
            .send(&app, "lease", json!({"worker_id": "w"}), Signing::Unsigned)
            .await;
        assert_eq!(r.status, 201);
    }

    #[tokio::test]
    async fn submission_stream_never_ends() {
        let app = with_defect("submission-stream-never-ends").await;
        let (_, _, second) = two_finished_turns(&app).await;
        let mut sse = submission_stream(&app, &second, None).await;
        assert_eq!(sse.status, 200);
        let mut last = None;
        while let Some(f) = sse.next(Duration::from_secs(5)).await {
            if f.field("event") == Some("submission.completed") {
                last = f.field("id").map(str::to_owned);
                break;
            }
        }
        // Past its terminal event the stream stays open, with at most heartbeats.
        let open_for = tokio::time::Instant::now() + Duration::from_secs(2);
        while let Ok(more) =
            tokio::time::timeout_at(open_for, sse.next(Duration::from_secs(3))).await
        {
            assert!(
                more.as_ref().is_some_and(support::Frame::is_comment),
                "{more:?}"
            );
        }
        let last: i64 = last.expect("the terminal event").parse().unwrap();
        assert_eq!(
            submission_stream(&app, &second, Some(last)).await.status,
            200
        );
    }

    #[tokio::test]
    async fn submission_stream_leaks_other_events() {
        let app = with_defect("submission-stream-leaks-other-events").await;
        let (sid, _, second) = two_finished_turns(&app).await;
        let mut sse = submission_stream(&app, &second, None).await;
        let first = sse.next(Duration::from_secs(5)).await.expect("an event");
        assert_eq!(first.field("event"), Some("session.created"));
        assert_eq!(first.data()["session_id"], sid);
    }

    #[tokio::test]
    async fn session_stream_drops_on_resume() {
        let app = with_defect("session-stream-drops-on-resume").await;
        let session = create_session(&app, ALICE, "echo").await;
        let sid = session["id"].as_str().unwrap();
        let sub = submit(&app, ALICE, sid, "k", "hi").await;
        wait_submission(&app, ALICE, sub["id"].as_str().unwrap(), terminal).await;
        let first = resume_first_id(&app, &format!("/v1/sessions/{sid}/events"), 2).await;
        assert_eq!(first, 4);
    }

    #[tokio::test]
    async fn queue_limit_unenforced() {
        let app = app_with(|c| {
            c.defects = Defects::parse(["queue-limit-unenforced"]).unwrap();
            c.limits.max_queue_depth = 1;
        })
        .await;
        let session = create_session(&app, ALICE, "slow-shell").await;
        let sid = session["id"].as_str().unwrap();
        submit(&app, ALICE, sid, "a", "long").await;
        wait_operation(&app, sid, "shell", "running").await;
        submit(&app, ALICE, sid, "b", "queued").await;
        // Beyond the queue depth: accepted anyway.
        submit(&app, ALICE, sid, "c", "more").await;
        let view = app.get(ALICE, &format!("/v1/sessions/{sid}")).await.ok(200);
        assert_eq!(view["queue_depth"], 2);
    }

    #[tokio::test]
    async fn submit_to_deleting_accepted() {
        let app = with_defect("submit-to-deleting-accepted").await;
        app.post(
            ADMIN,
            "/v1/test/providers/local/create_delay",
            json!({"delay_ms": 1500}),
        )
        .await
        .ok(204);
        let session = create_session(&app, ALICE, "echo").await;
        let sid = session["id"].as_str().unwrap();
        let deleting = app
            .delete(ALICE, &format!("/v1/sessions/{sid}"))
            .await
            .ok(202);
        assert_eq!(deleting["state"], "deleting");
        let late = submit(&app, ALICE, sid, "late", "x").await;
        assert_eq!(late["state"], "queued");
        app.post(
            ADMIN,
            "/v1/test/providers/local/create_delay",
            json!({"delay_ms": 0}),
        )
        .await
        .ok(204);
    }

    #[tokio::test]
    async fn expired_cursor_skips() {
        let app = app_with(|c| {
            c.defects = Defects::parse(["expired-cursor-skips"]).unwrap();
            c.retention.events_s = 1;
        })
        .await;
        let session = create_session(&app, ALICE, "echo").await;
        let sid = session["id"].as_str().unwrap();
        let sub = submit(&app, ALICE, sid, "k", "hi").await;
        wait_submission(&app, ALICE, sub["id"].as_str().unwrap(), terminal).await;
        let path = format!("/v1/sessions/{sid}/events");
        // Once retention has dropped the first events, a page from 0 starts after them.
        let page = poll(|| async {
            let page = app
                .get(ALICE, &format!("{path}?format=json&after=0"))
                .await
                .ok(200);
            (page["data"][0]["seq"] != 1).then_some(page)
        })
        .await;
        assert_ne!(page["data"][0]["seq"], 1, "{page}");
        let sse = support::RawSse::open(
            &app,
            &path,
            ALICE,
            &[("Accept", "text/event-stream"), ("Last-Event-ID", "0")],
        )
        .await;
        assert_eq!(sse.status, 200);
    }
}

#[tokio::test]
async fn uploaded_files_are_what_the_agent_reads() {
    let app = app().await;
    let session = create_session(&app, ALICE, "read-input").await;
    let sid = session["id"].as_str().unwrap();
    wait_sandbox_running(&app, session["sandbox_id"].as_str().unwrap()).await;
    let upload = |path: &str| {
        app.request(
            Some(ALICE),
            reqwest::Method::POST,
            &format!("/v1/sessions/{sid}/files?path={path}"),
        )
        .header("content-type", "application/octet-stream")
        .body("the input\n")
    };
    let r = app.send(upload("inbox/input.txt")).await.ok(201);
    assert_eq!(r["size"], 10);
    assert_eq!(r["path"], "inbox/input.txt");
    app.send(upload("../escape.txt"))
        .await
        .problem(400, "invalid_path");
    let sub = submit(&app, ALICE, sid, "k", "read the input").await;
    let done = wait_submission(&app, ALICE, sub["id"].as_str().unwrap(), terminal).await;
    assert_eq!(done["state"], "completed");
    let op = wait_operation(&app, sid, "read_file", "succeeded").await;
    assert_eq!(op["effect_class"], "read");
    assert_eq!(op["output"], "the input\n");
}

#[tokio::test]
async fn a_lease_that_is_not_renewed_makes_its_turn_uncertain() {
    let app = app_with(|c| c.gateway.lease_ttl = Duration::from_millis(1500)).await;
    let (sid, bridge) = idle_session(&app).await;
    // The suite plays the worker: it takes the lease and starts the turn, then goes silent.
    bridge
        .send(&app, "lease", json!({"worker_id": "suite"}), Signing::Valid)
        .await
        .ok(201);
    let sub = submit(&app, ALICE, &sid, "k", "hi").await;
    let id = sub["id"].as_str().unwrap();
    let work = bridge
        .send(&app, "next", json!({"lease_generation": 1}), Signing::Valid)
        .await
        .ok(200);
    assert_eq!(work["submission_id"], id);
    let op = bridge
        .send(
            &app,
            "operations",
            json!({"lease_generation": 1, "submission_id": id, "kind": "model_call", "name": "echo", "effect_class": "read", "input": null}),
            Signing::Valid,
        )
        .await
        .ok(201);
    let s = wait_submission(&app, ALICE, id, terminal).await;
    assert_eq!(s["state"], "uncertain");
    assert_eq!(s["outcome"]["reason"], "lease_expired");
    assert_eq!(s["outcome"]["side_effects"], "none_started");
    assert_eq!(
        s["outcome"]["operations_in_doubt"],
        json!([op["operation_id"]])
    );
    // The late worker is fenced and the turn stays uncertain.
    let complete = json!({"lease_generation": 1, "state": "completed", "output": "late", "stop_reason": "end_turn", "usage": null, "error": null});
    bridge
        .send(
            &app,
            &format!("submissions/{id}/complete"),
            complete,
            Signing::Valid,
        )
        .await
        .problem(409, "lease_lost");
    assert_eq!(
        app.get(ALICE, &format!("/v1/submissions/{id}"))
            .await
            .ok(200)["state"],
        "uncertain"
    );
    assert_eq!(
        app.get(ALICE, &format!("/v1/sessions/{sid}")).await.ok(200)["state"],
        "paused"
    );
}

#[tokio::test]
async fn cancelling_a_tool_call_ends_it_and_the_turn_goes_on() {
    let app = app().await;
    let session = create_session(&app, ALICE, "slow-shell").await;
    let sid = session["id"].as_str().unwrap();
    let sub = submit(&app, ALICE, sid, "k", "go").await;
    let tool = wait_operation(&app, sid, "shell", "running").await;
    let tool_id = tool["id"].as_str().unwrap();
    let r = app
        .post(
            ALICE,
            &format!("/v1/operations/{tool_id}/cancel"),
            json!({}),
        )
        .await;
    assert_eq!(r.ok(200)["cancel_requested"], true);
    let done = wait_submission(&app, ALICE, sub["id"].as_str().unwrap(), terminal).await;
    assert_eq!(done["state"], "completed");
    let op = app
        .get(ALICE, &format!("/v1/operations/{tool_id}"))
        .await
        .ok(200);
    assert_eq!(op["state"], "cancelled");
    let result = app
        .get(
            ALICE,
            &format!("/v1/submissions/{}/result", sub["id"].as_str().unwrap()),
        )
        .await
        .ok(200);
    assert_eq!(result["output"], "finished");
    // A terminal operation is left as it is.
    let again = app
        .post(
            ALICE,
            &format!("/v1/operations/{tool_id}/cancel"),
            json!({}),
        )
        .await;
    assert_eq!(again.ok(200), op);
}

#[tokio::test]
async fn a_running_model_call_cannot_be_cancelled() {
    let app = app().await;
    let session = create_session(&app, ALICE, "slow-text-2s").await;
    let sid = session["id"].as_str().unwrap();
    submit(&app, ALICE, sid, "k", "go").await;
    let call = wait_operation(&app, sid, "slow-text-2s", "running").await;
    let r = app
        .post(
            ALICE,
            &format!("/v1/operations/{}/cancel", call["id"].as_str().unwrap()),
            json!({}),
        )
        .await;
    r.problem(409, "invalid_state");
}

#[tokio::test]
async fn a_worker_that_cannot_start_fails_the_queue_instead_of_hanging() {
    let app =
        app_with(|c| c.gateway.worker_bin = Some("/nonexistent/sandspec-worker".into())).await;
    let session = create_session(&app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap();
    let sub = submit(&app, ALICE, sid, "k", "hi").await;
    let done = wait_submission(&app, ALICE, sub["id"].as_str().unwrap(), terminal).await;
    assert_eq!(done["state"], "failed");
    assert_eq!(done["error"]["code"], "worker_unavailable");
}

#[tokio::test]
async fn a_model_error_fails_the_turn() {
    let app = app().await;
    let session = create_session(&app, ALICE, "model-error").await;
    let sid = session["id"].as_str().unwrap();
    let sub = submit(&app, ALICE, sid, "k", "hi").await;
    let done = wait_submission(&app, ALICE, sub["id"].as_str().unwrap(), terminal).await;
    assert_eq!(done["state"], "failed");
    assert_eq!(done["error"]["code"], "model_error");
    let result = app
        .get(
            ALICE,
            &format!("/v1/submissions/{}/result", sub["id"].as_str().unwrap()),
        )
        .await
        .ok(200);
    assert_eq!(result["stop_reason"], "error");
    let ops = app
        .get(ALICE, &format!("/v1/sessions/{sid}/operations"))
        .await
        .ok(200);
    assert_eq!(ops["data"][0]["state"], "failed");
}

/// Every child of the list at `path`, read `limit` at a time by following its page tokens.
async fn all_pages(app: &TestApp, path: &str, limit: usize) -> Vec<Value> {
    let sep = if path.contains('?') { '&' } else { '?' };
    let mut children = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let url = match &token {
            None => format!("{path}{sep}limit={limit}"),
            Some(t) => format!("{path}{sep}limit={limit}&page_token={t}"),
        };
        let page = app.get(ALICE, &url).await.ok(200);
        let data = page["data"].as_array().unwrap();
        assert!(data.len() <= limit, "{page}");
        children.extend(data.iter().cloned());
        match page["next_page_token"].as_str() {
            Some(next) => {
                assert_eq!(page["has_more"], true, "{page}");
                token = Some(next.to_owned());
            }
            None => {
                assert_eq!(page["has_more"], false, "{page}");
                return children;
            }
        }
    }
}

/// A session's submissions, operations and artifacts page alike and filter by state and by
/// submission; a page token serves only the list and the filters it was issued for.
#[tokio::test]
async fn a_sessions_children_page_and_filter_alike() {
    let app = app().await;
    let session = create_session(&app, ALICE, "write-artifact").await;
    let sid = session["id"].as_str().unwrap();
    let sandbox = session["sandbox_id"].as_str().unwrap();
    let mut turns = Vec::new();
    for key in ["a", "b"] {
        let sub = submit(&app, ALICE, sid, key, "write it").await;
        let id = sub["id"].as_str().unwrap().to_owned();
        wait_submission(&app, ALICE, &id, terminal).await;
        // The next turn's write then changes the file, so that it leaves an artifact too.
        std::fs::write(root(&app, sandbox).join("artifacts/report.txt"), "changed").unwrap();
        turns.push(id);
    }
    let ids = |children: &[Value], field: &str| -> Vec<String> {
        children
            .iter()
            .map(|c| c[field].as_str().unwrap().to_owned())
            .collect()
    };
    let list = format!("/v1/sessions/{sid}");

    let subs = all_pages(&app, &format!("{list}/submissions"), 1).await;
    assert_eq!(ids(&subs, "id"), turns);
    let done = all_pages(&app, &format!("{list}/submissions?state=completed"), 1).await;
    assert_eq!(ids(&done, "id"), turns);
    assert!(
        all_pages(&app, &format!("{list}/submissions?state=queued"), 5)
            .await
            .is_empty()
    );

    let ops = all_pages(&app, &format!("{list}/operations"), 4).await;
    assert_eq!(ops.len(), 6, "{ops:?}");
    let by_turn = ids(&ops, "submission_id");
    assert_eq!(by_turn[..3], [&turns[0]; 3].map(String::as_str));
    assert_eq!(by_turn[3..], [&turns[1]; 3].map(String::as_str));
    let second = format!("{list}/operations?submission_id={}", turns[1]);
    assert_eq!(
        ids(&all_pages(&app, &second, 2).await, "id"),
        ids(&ops[3..], "id")
    );
    let first_ok = format!(
        "{list}/operations?state=succeeded&submission_id={}",
        turns[0]
    );
    assert_eq!(
        ids(&all_pages(&app, &first_ok, 1).await, "id"),
        ids(&ops[..3], "id")
    );
    let running = format!("{list}/operations?state=running");
    assert!(all_pages(&app, &running, 5).await.is_empty());

    let arts = all_pages(&app, &format!("{list}/artifacts"), 1).await;
    assert_eq!(ids(&arts, "submission_id"), turns);
    let second = format!("{list}/artifacts?submission_id={}", turns[1]);
    assert_eq!(
        ids(&all_pages(&app, &second, 1).await, "id"),
        ids(&arts[1..], "id")
    );

    for bad in ["submissions", "operations"] {
        let r = app.get(ALICE, &format!("{list}/{bad}?state=nope")).await;
        assert_eq!(r.problem(400, "invalid_argument")["param"], "state");
    }
    // A token of the submissions list, and one of another submission's operations.
    let page = app
        .get(ALICE, &format!("{list}/submissions?limit=1"))
        .await
        .ok(200);
    let token = page["next_page_token"].as_str().unwrap();
    app.get(
        ALICE,
        &format!("{list}/operations?limit=1&page_token={token}"),
    )
    .await
    .problem(400, "invalid_page_token");
    let page = app
        .get(
            ALICE,
            &format!("{}&limit=1", second.replace("artifacts", "operations")),
        )
        .await
        .ok(200);
    let token = page["next_page_token"].as_str().unwrap();
    let first = format!("{list}/operations?submission_id={}", turns[0]);
    app.get(ALICE, &format!("{first}&limit=1&page_token={token}"))
        .await
        .problem(400, "invalid_page_token");
    for child in ["submissions", "operations", "artifacts"] {
        app.get(BOB, &format!("{list}/{child}"))
            .await
            .problem(404, "not_found");
    }
}

#[tokio::test]
async fn files_a_turn_leaves_under_artifacts_are_kept_as_they_were() {
    let app = app_with(|c| c.retention.result_s = 2).await;
    let session = create_session(&app, ALICE, "write-artifact").await;
    let sid = session["id"].as_str().unwrap();
    let sandbox = session["sandbox_id"].as_str().unwrap();
    let first = submit(&app, ALICE, sid, "a", "write it").await;
    let first = first["id"].as_str().unwrap();
    wait_submission(&app, ALICE, first, terminal).await;
    let result = app
        .get(ALICE, &format!("/v1/submissions/{first}/result"))
        .await
        .ok(200);
    let artifacts = result["artifacts"].as_array().unwrap();
    assert_eq!(artifacts.len(), 1, "{result}");
    let art = &artifacts[0];
    assert_eq!(art["path"], "artifacts/report.txt");
    assert_eq!(art["size"], 20);
    assert_eq!(art["submission_id"], first);
    let id = art["id"].as_str().unwrap();
    // Later changes to the file do not change the artifact.
    std::fs::write(root(&app, sandbox).join("artifacts/report.txt"), "changed").unwrap();
    let content = app.get(ALICE, &format!("/v1/artifacts/{id}/content")).await;
    assert_eq!(
        content.header("content-type"),
        Some("application/octet-stream")
    );
    assert_eq!(&content.body[..], b"report for the turn\n");
    let listed = app
        .get(ALICE, &format!("/v1/sessions/{sid}/artifacts"))
        .await
        .ok(200);
    assert_eq!(listed["data"][0]["id"], id);
    app.get(BOB, &format!("/v1/artifacts/{id}/content"))
        .await
        .problem(404, "not_found");
    let log = types(&events(&app, ALICE, sid).await);
    let at = log.iter().position(|t| t == "artifact.created").unwrap();
    assert_eq!(log[at + 1], "submission.completed");

    // The next turn writes the file again (it differs from what the turn started with).
    let second = submit(&app, ALICE, sid, "b", "again").await;
    let second = second["id"].as_str().unwrap();
    wait_submission(&app, ALICE, second, terminal).await;
    let result = app
        .get(ALICE, &format!("/v1/submissions/{second}/result"))
        .await
        .ok(200);
    assert_eq!(result["artifacts"].as_array().unwrap().len(), 1);
    // A third turn that leaves the file as it found it has no artifact.
    let third = submit(&app, ALICE, sid, "c", "same").await;
    let third = third["id"].as_str().unwrap();
    wait_submission(&app, ALICE, third, terminal).await;
    let result = app
        .get(ALICE, &format!("/v1/submissions/{third}/result"))
        .await
        .ok(200);
    assert_eq!(result["artifacts"], json!([]));

    tokio::time::sleep(Duration::from_millis(2200)).await;
    app.get(ALICE, &format!("/v1/artifacts/{id}/content"))
        .await
        .problem(410, "artifact_expired");
    // Past retention the content itself is dropped; the artifact's metadata stays listed.
    let kept = app.data_dir.join("artifacts").join(id);
    poll(|| async { (!kept.exists()).then_some(()) }).await;
    let listed = app
        .get(ALICE, &format!("/v1/sessions/{sid}/artifacts"))
        .await
        .ok(200);
    assert_eq!(listed["data"][0]["id"], id);
}

#[tokio::test]
async fn expired_cursors_are_refused_never_skipped() {
    let app = app_with(|c| c.retention.events_s = 1).await;
    let session = create_session(&app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap();
    let path = format!("/v1/sessions/{sid}/events");
    app.get(ALICE, &format!("{path}?format=json&after=0"))
        .await
        .ok(200);
    poll(|| async {
        (app.get(ALICE, &format!("{path}?format=json&after=0"))
            .await
            .status
            == 410)
            .then_some(())
    })
    .await;
    app.get(ALICE, &format!("{path}?format=json&after=0"))
        .await
        .problem(410, "cursor_expired");
    let sse = support::RawSse::open(
        &app,
        &path,
        ALICE,
        &[("Accept", "text/event-stream"), ("Last-Event-ID", "0")],
    )
    .await;
    assert_eq!(sse.status, 410);
    // The newest cursor stays valid: nothing after it is lost.
    let page = app
        .get(ALICE, &format!("{path}?format=json&after=1"))
        .await
        .ok(200);
    assert_eq!(page["data"], json!([]));
    assert_eq!(page["last_seq"], 1);
}

/// The JSON form of session events takes the stream's cursor: a `Last-Event-ID` header wins
/// over `after`, and one that is not digits (the empty value included) is refused as on the
/// stream, whatever `after` says.
#[tokio::test]
async fn the_json_form_reads_and_checks_last_event_id() {
    let app = support::spawn_app(|_| {}).await;
    let session = create_session(&app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap();
    let path = format!("/v1/sessions/{sid}/events?format=json&after=0");
    let all = app.get(ALICE, &path).await.ok(200);
    let first = all["data"][0]["seq"].as_i64().expect("a first event");
    let get = |cursor: String| {
        app.send(
            app.request(Some(ALICE), reqwest::Method::GET, &path)
                .header("Last-Event-ID", cursor),
        )
    };
    let page = get(first.to_string()).await.ok(200);
    assert!(
        page["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["seq"].as_i64() > Some(first)),
        "{page}"
    );
    assert_eq!(
        page["data"].as_array().unwrap().len() + 1,
        all["data"].as_array().unwrap().len()
    );
    for bad in ["", "x", "+1", "-1"] {
        let problem = get(bad.to_owned()).await.problem(400, "invalid_argument");
        assert_eq!(problem["param"], "Last-Event-ID", "{bad:?}: {problem}");
    }
}

#[tokio::test]
async fn a_turn_that_never_ends_stops_at_its_step_budget() {
    let app = app_with(|c| c.gateway.max_steps = 3).await;
    let session = create_session(&app, ALICE, "loop-tool").await;
    let sid = session["id"].as_str().unwrap();
    let sub = submit(&app, ALICE, sid, "k", "loop").await;
    let done = wait_submission(&app, ALICE, sub["id"].as_str().unwrap(), terminal).await;
    assert_eq!(done["state"], "failed");
    assert_eq!(done["error"]["code"], "step_budget_exceeded");
    let ops = app
        .get(ALICE, &format!("/v1/sessions/{sid}/operations"))
        .await
        .ok(200);
    assert_eq!(ops["data"].as_array().unwrap().len(), 6);
}

#[tokio::test]
async fn the_bridge_secret_is_out_of_reach_of_the_tools_environment() {
    let app = app().await;
    let session = create_session(&app, ALICE, "env-check").await;
    let sid = session["id"].as_str().unwrap();
    let secret = app
        .get(ADMIN, &format!("/v1/test/sessions/{sid}/bridge"))
        .await
        .ok(200)["secret"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(secret.len(), 64);
    let sub = submit(&app, ALICE, sid, "k", "check").await;
    wait_submission(&app, ALICE, sub["id"].as_str().unwrap(), terminal).await;
    let op = wait_operation(&app, sid, "shell", "succeeded").await;
    let output = op["output"].as_str().unwrap();
    // The tool saw its environment and its parent's (the worker's), but never the secret.
    assert!(output.contains("SANDSPEC_SESSION_ID="), "{output}");
    assert!(!output.contains(&secret));
    let log = events(&app, ALICE, sid).await;
    assert!(log.iter().all(|e| !e.to_string().contains(&secret)));
}

#[tokio::test]
async fn killing_a_sessions_sandbox_ends_its_turn_and_fails_later_ones() {
    let app = app_with(|c| c.gateway.lease_ttl = Duration::from_secs(30)).await;
    let session = app
        .post(
            ALICE,
            "/v1/sessions",
            json!({"agent": {"model": "slow-shell"}, "sandbox": {"create": {}}, "on_uncertain": "continue"}),
        )
        .await
        .ok(201);
    let sid = session["id"].as_str().unwrap();
    let sandbox = session["sandbox_id"].as_str().unwrap();
    let running = submit(&app, ALICE, sid, "a", "long").await;
    wait_operation(&app, sid, "shell", "running").await;
    app.delete(ALICE, &format!("/v1/sandboxes/{sandbox}"))
        .await
        .ok(204);
    let ended = wait_submission(&app, ALICE, running["id"].as_str().unwrap(), terminal).await;
    assert!(
        ["failed", "uncertain"].contains(&ended["state"].as_str().unwrap()),
        "{ended}"
    );
    // on_uncertain: continue keeps the session active; new turns are accepted, then fail.
    assert_eq!(
        app.get(ALICE, &format!("/v1/sessions/{sid}")).await.ok(200)["state"],
        "active"
    );
    let later = submit(&app, ALICE, sid, "b", "again").await;
    let later = wait_submission(&app, ALICE, later["id"].as_str().unwrap(), terminal).await;
    assert_eq!(later["state"], "failed");
    assert_eq!(later["error"]["code"], "sandbox_gone");
}

#[tokio::test]
async fn an_owned_sandbox_can_start_from_a_snapshot() {
    let app = app().await;
    let source = app.create_sandbox(ALICE, json!({})).await;
    let source = source["id"].as_str().unwrap();
    std::fs::create_dir_all(root(&app, source).join("inbox")).unwrap();
    std::fs::write(
        root(&app, source).join("inbox/input.txt"),
        "from the snapshot",
    )
    .unwrap();
    let snap = app
        .post(
            ALICE,
            &format!("/v1/sandboxes/{source}/snapshots"),
            json!({}),
        )
        .await
        .ok(201);
    let session = app
        .post(
            ALICE,
            "/v1/sessions",
            json!({"agent": {"model": "read-input"}, "sandbox": {"create": {"from_snapshot": snap["id"]}}}),
        )
        .await
        .ok(201);
    let sid = session["id"].as_str().unwrap();
    let sub = submit(&app, ALICE, sid, "k", "read").await;
    wait_submission(&app, ALICE, sub["id"].as_str().unwrap(), terminal).await;
    let op = wait_operation(&app, sid, "read_file", "succeeded").await;
    assert_eq!(op["output"], "from the snapshot");
    let r = app
        .post(
            BOB,
            "/v1/sessions",
            json!({"agent": {"model": "read-input"}, "sandbox": {"create": {"from_snapshot": snap["id"]}}}),
        )
        .await;
    r.problem(404, "not_found");
}

#[tokio::test]
async fn tool_output_streams_as_it_comes_and_background_processes_do_not_hold_the_turn() {
    let app = app().await;
    let session = create_session(&app, ALICE, "chatty-shell").await;
    let sid = session["id"].as_str().unwrap();
    let sub = submit(&app, ALICE, sid, "k", "talk").await;
    let started = std::time::Instant::now();
    let done = wait_submission(&app, ALICE, sub["id"].as_str().unwrap(), terminal).await;
    assert_eq!(done["state"], "completed");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "a background process held the turn"
    );
    let log = events(&app, ALICE, sid).await;
    let deltas: Vec<(String, String)> = log
        .iter()
        .filter(|e| e["type"] == "output.delta" && e["stream"] != "assistant")
        .map(|e| {
            (
                e["stream"].as_str().unwrap().to_owned(),
                e["text"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        deltas,
        [
            ("stdout".to_owned(), "one\n".to_owned()),
            ("stderr".to_owned(), "two\n".to_owned()),
            ("stdout".to_owned(), "three\n".to_owned()),
            ("stdout".to_owned(), "left a process behind\n".to_owned()),
        ]
    );
    let op = log.iter().find(|e| e["type"] == "output.delta").unwrap()["operation_id"].clone();
    let op = app
        .get(ALICE, &format!("/v1/operations/{}", op.as_str().unwrap()))
        .await
        .ok(200);
    assert_eq!(op["output"], "one\ntwo\nthree\n");
}

#[tokio::test]
async fn session_streams_heartbeat_and_count_against_the_stream_quota() {
    let app = app_with(|c| {
        c.limits.max_streams_per_principal = 1;
        c.limits.heartbeat_interval_s = 1;
    })
    .await;
    let session = create_session(&app, ALICE, "echo").await;
    let sid = session["id"].as_str().unwrap();
    let path = format!("/v1/sessions/{sid}/events");
    let headers = [("Accept", "text/event-stream"), ("Last-Event-ID", "1")];
    let mut open = support::RawSse::open(&app, &path, ALICE, &headers).await;
    assert_eq!(open.status, 200);
    let first = open
        .next(Duration::from_millis(2500))
        .await
        .expect("a heartbeat");
    assert!(first.is_comment(), "{first:?}");
    let refused = app
        .send(
            app.request(Some(ALICE), reqwest::Method::GET, &path)
                .header("Accept", "text/event-stream"),
        )
        .await;
    refused.problem(429, "too_many_streams");
    assert!(refused.header("retry-after").is_some());
    drop(open);
    poll(|| async {
        let again = support::RawSse::open(&app, &path, ALICE, &headers).await;
        (again.status == 200).then_some(())
    })
    .await;
}

#[tokio::test]
async fn workers_reach_a_server_that_serves_https() {
    let dir = tempfile::tempdir().unwrap();
    let (tls, root) = support::self_signed_tls(dir.path());
    let app = support::spawn_app_with_client(
        move |c| {
            gateway(c);
            c.tls = Some(tls);
        },
        reqwest::Client::builder().add_root_certificate(root),
    )
    .await;
    assert!(app.base.starts_with("https://"));
    let session = create_session(&app, ALICE, "shell-then-done").await;
    let sid = session["id"].as_str().unwrap();
    let sub = submit(&app, ALICE, sid, "k", "go").await;
    let done = wait_submission(&app, ALICE, sub["id"].as_str().unwrap(), terminal).await;
    assert_eq!(done["state"], "completed", "{done}");
}

#[tokio::test]
async fn a_configured_model_replaces_the_sessions_model_for_live_runs() {
    let app = app_with(|c| c.gateway.model_override = Some("echo".into())).await;
    let session = create_session(&app, ALICE, "shell-then-done").await;
    let sid = session["id"].as_str().unwrap();
    let sub = submit(&app, ALICE, sid, "k", "hi").await;
    let id = sub["id"].as_str().unwrap();
    wait_submission(&app, ALICE, id, terminal).await;
    let result = app
        .get(ALICE, &format!("/v1/submissions/{id}/result"))
        .await
        .ok(200);
    assert_eq!(result["output"], "echo: hi");
    let ops = app
        .get(ALICE, &format!("/v1/sessions/{sid}/operations"))
        .await
        .ok(200);
    assert_eq!(ops["data"][0]["name"], "echo");
}

#[tokio::test]
async fn with_on_uncertain_continue_the_next_turn_runs_under_a_new_generation() {
    let app = app().await;
    let session = app
        .post(
            ALICE,
            "/v1/sessions",
            json!({"agent": {"model": "slow-shell"}, "sandbox": {"create": {}}, "on_uncertain": "continue"}),
        )
        .await
        .ok(201);
    let sid = session["id"].as_str().unwrap();
    let first = submit(&app, ALICE, sid, "a", "long").await;
    let waiting = submit(&app, ALICE, sid, "b", "next").await;
    wait_operation(&app, sid, "shell", "running").await;
    app.post(
        ADMIN,
        &format!("/v1/test/sessions/{sid}/kill_worker"),
        json!({}),
    )
    .await
    .ok(204);
    let first = wait_submission(&app, ALICE, first["id"].as_str().unwrap(), terminal).await;
    assert_eq!(first["state"], "uncertain");
    let next = wait_submission(&app, ALICE, waiting["id"].as_str().unwrap(), |s| {
        s["state"] == "running"
    })
    .await;
    assert_eq!(next["lease_generation"], 2);
    let session = app.get(ALICE, &format!("/v1/sessions/{sid}")).await.ok(200);
    assert_eq!(session["state"], "active");
    assert_eq!(session["pause_reason"], Value::Null);
    let log = types(&events(&app, ALICE, sid).await);
    assert!(!log.contains(&"session.paused".to_owned()));
}

#[tokio::test]
async fn a_new_lease_makes_the_turn_of_the_old_one_uncertain() {
    let app = app_with(|c| c.gateway.lease_ttl = Duration::from_secs(30)).await;
    let (sid, bridge) = idle_session(&app).await;
    let lease = json!({"worker_id": "suite"});
    bridge
        .send(&app, "lease", lease.clone(), Signing::Valid)
        .await
        .ok(201);
    let sub = submit(&app, ALICE, &sid, "k", "hi").await;
    let id = sub["id"].as_str().unwrap();
    bridge
        .send(&app, "next", json!({"lease_generation": 1}), Signing::Valid)
        .await
        .ok(200);
    // Nothing else to run while it runs.
    let idle = bridge
        .send(&app, "next", json!({"lease_generation": 1}), Signing::Valid)
        .await;
    assert_eq!(idle.status, 204);
    let second = bridge
        .send(&app, "lease", lease, Signing::Valid)
        .await
        .ok(201);
    assert_eq!(second["lease_generation"], 2);
    let s = app
        .get(ALICE, &format!("/v1/submissions/{id}"))
        .await
        .ok(200);
    assert_eq!(s["state"], "uncertain");
    assert_eq!(s["outcome"]["reason"], "worker_lost");
    assert_eq!(s["outcome"]["lease_generation"], 1);
    assert_eq!(s["outcome"]["side_effects"], "none_started");
    assert_eq!(s["outcome"]["operations_in_doubt"], json!([]));
}

/// A path the file system cannot hold (one component of combining characters, far beyond
/// 255 bytes) is the client's error: 400 `invalid_path`, never a 500, and nothing is written.
#[tokio::test]
async fn an_upload_path_too_long_for_the_file_system_is_400() {
    let app = app().await;
    let session = create_session(&app, ALICE, "read-input").await;
    let sid = session["id"].as_str().unwrap();
    wait_sandbox_running(&app, session["sandbox_id"].as_str().unwrap()).await;
    let digest = app.digest().await;
    for path in [
        format!("a{}", "\u{0301}".repeat(200)),
        format!("d/{}", "\u{0301}\u{0302}".repeat(70)),
    ] {
        let r = app
            .send(
                app.request(
                    Some(ALICE),
                    reqwest::Method::POST,
                    &format!("/v1/sessions/{sid}/files?path={path}"),
                )
                .header("content-type", "application/octet-stream")
                .body("x"),
            )
            .await;
        r.problem(400, "invalid_path");
    }
    assert_eq!(app.digest().await, digest);
}

/// `Last-Event-ID` is digits only, as the schema's pattern says: a sign or any other character
/// is 400 `invalid_argument` naming the header, on the session's stream as on the others.
#[tokio::test]
async fn a_last_event_id_outside_its_pattern_is_400() {
    let app = app().await;
    let session = create_session(&app, ALICE, "read-input").await;
    let sid = session["id"].as_str().unwrap();
    for bad in ["+0", "-1", "1e3", "0x1", "1 2"] {
        let r = app
            .send(
                app.request(
                    Some(ALICE),
                    reqwest::Method::GET,
                    &format!("/v1/sessions/{sid}/events"),
                )
                .header("Accept", "text/event-stream")
                .header("Last-Event-ID", bad),
            )
            .await;
        let problem = r.problem(400, "invalid_argument");
        assert_eq!(problem["param"], "Last-Event-ID", "{bad:?}");
    }
}
