//! The E2B surface of the reference server: the control plane's wire shapes and errors, envd's
//! Connect services and `/files` over HTTP, the E2B defects, and the real E2B Python and
//! JavaScript SDKs driving the server (installed from PyPI into a venv and from npm into a
//! prefix; required under `CI`).

use crate::support;
#[path = "../../tests/support/npm.rs"]
mod npm;
#[path = "../../tests/support/venv.rs"]
pub(crate) mod venv;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use base64::Engine as _;
use reqwest::Method;
use serde_json::{Value, json};
use support::{ALICE, BOB, Reply, TestApp, spawn_app, strings};

/// The pinned SDK the compatibility test installs.
const E2B_SDK: &str = "e2b==2.63.0";
/// The pinned JavaScript SDK the JavaScript compatibility test installs.
const E2B_JS_SDK: &str = "e2b@2.51.0";

async fn e2b(
    app: &TestApp,
    key: Option<&str>,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Reply {
    let mut rb = app.client.request(method, app.url(path));
    if let Some(key) = key {
        rb = rb.header("X-API-Key", key);
    }
    if let Some(body) = body {
        rb = rb.json(&body);
    }
    Reply::read(rb.send().await.expect("send")).await
}

#[track_caller]
fn e2b_error(reply: &Reply, status: u16) -> Value {
    assert_eq!(
        reply.status.as_u16(),
        status,
        "body: {}",
        String::from_utf8_lossy(&reply.body)
    );
    let body = reply.json();
    assert_eq!(body["code"], status, "body: {body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    body
}

/// Creates a sandbox through `/v2/sandboxes` (secure): (sandboxID, envdAccessToken).
async fn create(app: &TestApp, key: &str, body: Value) -> (String, String) {
    let reply = e2b(app, Some(key), Method::POST, "/v2/sandboxes", Some(body)).await;
    let created = reply.ok(201);
    (
        created["sandboxID"].as_str().expect("sandboxID").to_owned(),
        created["envdAccessToken"].as_str().unwrap_or("").to_owned(),
    )
}

fn envd(app: &TestApp, sandbox: &str, token: Option<&str>, path: &str) -> reqwest::RequestBuilder {
    let mut rb = app
        .client
        .post(app.url(path))
        .header("E2b-Sandbox-Id", sandbox)
        .header("E2b-Sandbox-Port", "49983");
    if let Some(token) = token {
        rb = rb.header("X-Access-Token", token);
    }
    rb
}

/// A `GET` to envd, with the sandbox's access token.
fn envd_get(app: &TestApp, sandbox: &str, token: &str, path: &str) -> reqwest::RequestBuilder {
    app.client
        .get(app.url(path))
        .header("E2b-Sandbox-Id", sandbox)
        .header("E2b-Sandbox-Port", "49983")
        .header("X-Access-Token", token)
}

async fn unary(app: &TestApp, sandbox: &str, token: &str, method: &str, body: Value) -> Reply {
    let rb = envd(app, sandbox, Some(token), &format!("/{method}"))
        .header("Content-Type", "application/json")
        .body(body.to_string());
    Reply::read(rb.send().await.expect("send")).await
}

fn envelope(message: &Value) -> Vec<u8> {
    let json = message.to_string().into_bytes();
    let mut out = vec![0];
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    out
}

/// Splits a whole server-stream body into its envelopes, checking the framing strictly:
/// only the last envelope is the end of the stream.
#[track_caller]
fn envelopes(body: &[u8]) -> (Vec<Value>, Value) {
    let mut rest = body;
    let mut messages = Vec::new();
    loop {
        assert!(rest.len() >= 5, "truncated envelope prefix: {rest:?}");
        let flags = rest[0];
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        assert!(rest.len() >= 5 + len, "truncated envelope");
        let message: Value = serde_json::from_slice(&rest[5..5 + len]).expect("JSON message");
        rest = &rest[5 + len..];
        match flags {
            0 => messages.push(message),
            2 => {
                assert!(rest.is_empty(), "bytes after the end of the stream");
                return (messages, message);
            }
            other => panic!("unexpected flags {other:#x}"),
        }
    }
}

async fn stream(
    app: &TestApp,
    sandbox: &str,
    token: &str,
    method: &str,
    body: Value,
) -> (Vec<Value>, Value) {
    let rb = envd(app, sandbox, Some(token), &format!("/{method}"))
        .header("Content-Type", "application/connect+json")
        .body(envelope(&body));
    let reply = Reply::read(rb.send().await.expect("send")).await;
    assert_eq!(
        reply.status.as_u16(),
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(
        reply.header("content-type"),
        Some("application/connect+json")
    );
    envelopes(&reply.body)
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn stdout_of(events: &[Value]) -> Vec<u8> {
    events
        .iter()
        .filter_map(|e| e["event"]["data"]["stdout"].as_str())
        .flat_map(|s| {
            base64::engine::general_purpose::STANDARD
                .decode(s)
                .expect("base64")
        })
        .collect()
}

#[tokio::test]
async fn control_plane_shapes_create_get_list_kill() {
    let app = spawn_app(|_| {}).await;
    let reply = e2b(
        &app,
        Some(ALICE),
        Method::POST,
        "/sandboxes",
        Some(json!({"templateID": "base", "timeout": 120, "metadata": {"team": "a"}, "envVars": {"X": "1"}})),
    )
    .await;
    let created = reply.ok(201);
    let id = created["sandboxID"].as_str().unwrap().to_owned();
    assert_eq!(created["templateID"], "base");
    assert_eq!(created["envdVersion"], "0.6.4");
    assert!(created["clientID"].is_string());
    // `secure` not asked for on /sandboxes: no access token.
    assert!(created.get("envdAccessToken").is_none(), "{created}");
    assert!(
        id.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()),
        "E2B IDs are DNS-label safe: {id}"
    );

    let detail = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        &format!("/sandboxes/{id}"),
        None,
    )
    .await
    .ok(200);
    for field in [
        "startedAt",
        "endAt",
        "cpuCount",
        "memoryMB",
        "diskSizeMB",
        "envdVersion",
    ] {
        assert!(detail.get(field).is_some(), "{field} missing: {detail}");
    }
    assert_eq!(detail["state"], "running");
    assert_eq!(detail["metadata"], json!({"team": "a"}));
    assert_eq!(detail["lifecycle"]["onTimeout"], "kill");

    // The same sandbox is a /v1 sandbox: the E2B ID maps to its provider-qualified ID.
    let v1 = app
        .get(ALICE, &format!("/v1/sandboxes/local:sbx_{id}"))
        .await
        .ok(200);
    assert_eq!(v1["metadata"], json!({"team": "a"}));

    let listed = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        "/sandboxes?metadata=team%3Da",
        None,
    )
    .await
    .ok(200);
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert_eq!(listed[0]["sandboxID"], id.as_str());
    let none = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        "/sandboxes?metadata=team%3Db",
        None,
    )
    .await
    .ok(200);
    assert_eq!(none, json!([]));
    let bobs = e2b(&app, Some(BOB), Method::GET, "/v2/sandboxes", None)
        .await
        .ok(200);
    assert_eq!(bobs, json!([]), "another team's sandboxes are not listed");

    e2b(
        &app,
        Some(ALICE),
        Method::DELETE,
        &format!("/sandboxes/{id}"),
        None,
    )
    .await
    .ok(204);
    let gone = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        &format!("/sandboxes/{id}"),
        None,
    )
    .await;
    e2b_error(&gone, 404);
    let again = e2b(
        &app,
        Some(ALICE),
        Method::DELETE,
        &format!("/sandboxes/{id}"),
        None,
    )
    .await;
    e2b_error(&again, 404);
}

#[tokio::test]
async fn unauthenticated_is_401_and_another_teams_sandbox_is_404_everywhere() {
    let app = spawn_app(|_| {}).await;
    let (id, _) = create(&app, ALICE, json!({"templateID": "base"})).await;
    e2b_error(
        &e2b(&app, None, Method::GET, "/v2/sandboxes", None).await,
        401,
    );
    e2b_error(
        &e2b(
            &app,
            Some("wrong"),
            Method::GET,
            &format!("/sandboxes/{id}"),
            None,
        )
        .await,
        401,
    );
    e2b_error(
        &e2b(
            &app,
            None,
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "base"})),
        )
        .await,
        401,
    );
    // The deprecated bearer form authenticates too.
    let bearer = app
        .send(app.request(Some(ALICE), Method::GET, &format!("/sandboxes/{id}")))
        .await;
    bearer.ok(200);

    let calls: Vec<(Method, String, Option<Value>)> = vec![
        (Method::GET, format!("/sandboxes/{id}"), None),
        (Method::DELETE, format!("/sandboxes/{id}"), None),
        (
            Method::POST,
            format!("/sandboxes/{id}/timeout"),
            Some(json!({"timeout": 30})),
        ),
        (
            Method::POST,
            format!("/sandboxes/{id}/refreshes"),
            Some(json!({"duration": 30})),
        ),
        (
            Method::POST,
            format!("/sandboxes/{id}/pause"),
            Some(json!({})),
        ),
        (
            Method::POST,
            format!("/sandboxes/{id}/resume"),
            Some(json!({})),
        ),
        (
            Method::POST,
            format!("/sandboxes/{id}/connect"),
            Some(json!({"timeout": 30})),
        ),
        (
            Method::POST,
            format!("/v2/sandboxes/{id}/connect"),
            Some(json!({})),
        ),
    ];
    for (method, path, body) in calls {
        let reply = e2b(&app, Some(BOB), method.clone(), &path, body).await;
        e2b_error(&reply, 404);
    }
    // Nothing of Bob's calls reached Alice's sandbox.
    let detail = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        &format!("/sandboxes/{id}"),
        None,
    )
    .await
    .ok(200);
    assert_eq!(detail["state"], "running");
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_foreign_sandbox_403_leaks_existence() {
    let app = spawn_app(|c| {
        c.defects = reference_server::defects::Defects::parse(["e2b-foreign-sandbox-403"]).unwrap()
    })
    .await;
    let (id, _) = create(&app, ALICE, json!({"templateID": "base"})).await;
    let reply = e2b(
        &app,
        Some(BOB),
        Method::GET,
        &format!("/sandboxes/{id}"),
        None,
    )
    .await;
    e2b_error(&reply, 403);
}

async fn state_of(app: &TestApp, id: &str) -> String {
    let detail = e2b(
        app,
        Some(ALICE),
        Method::GET,
        &format!("/sandboxes/{id}"),
        None,
    )
    .await
    .ok(200);
    detail["state"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn pause_resume_connect_follow_the_state_machine() {
    let app = spawn_app(|_| {}).await;
    let (id, _) = create(&app, ALICE, json!({"templateID": "base"})).await;
    let path = |op: &str| format!("/sandboxes/{id}/{op}");
    // Running: resume is a conflict, connect answers 200.
    e2b_error(
        &e2b(&app, Some(ALICE), Method::POST, &path("resume"), None).await,
        409,
    );
    e2b(
        &app,
        Some(ALICE),
        Method::POST,
        &path("connect"),
        Some(json!({"timeout": 60})),
    )
    .await
    .ok(200);

    e2b(&app, Some(ALICE), Method::POST, &path("pause"), None)
        .await
        .ok(204);
    assert_eq!(state_of(&app, &id).await, "paused");
    e2b_error(
        &e2b(&app, Some(ALICE), Method::POST, &path("pause"), None).await,
        409,
    );
    e2b_error(
        &e2b(
            &app,
            Some(ALICE),
            Method::POST,
            &path("timeout"),
            Some(json!({"timeout": 30})),
        )
        .await,
        409,
    );
    let paused = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        "/v2/sandboxes?state=paused",
        None,
    )
    .await
    .ok(200);
    assert_eq!(paused.as_array().unwrap().len(), 1);
    let running = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        "/v2/sandboxes?state=running",
        None,
    )
    .await
    .ok(200);
    assert_eq!(running, json!([]));

    let resumed = e2b(
        &app,
        Some(ALICE),
        Method::POST,
        &path("resume"),
        Some(json!({"timeout": 60})),
    )
    .await;
    assert_eq!(resumed.ok(201)["sandboxID"], id.as_str());
    assert_eq!(state_of(&app, &id).await, "running");

    e2b(&app, Some(ALICE), Method::POST, &path("pause"), None)
        .await
        .ok(204);
    let connected = e2b(
        &app,
        Some(ALICE),
        Method::POST,
        &format!("/v2/sandboxes/{id}/connect"),
        Some(json!({"timeout": 60})),
    )
    .await;
    assert!(connected.ok(201)["envdAccessToken"].is_string());
    assert_eq!(state_of(&app, &id).await, "running");
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_connect_does_not_resume_leaves_it_paused() {
    let app = spawn_app(|c| {
        c.defects =
            reference_server::defects::Defects::parse(["e2b-connect-does-not-resume"]).unwrap()
    })
    .await;
    let (id, _) = create(&app, ALICE, json!({"templateID": "base"})).await;
    e2b(
        &app,
        Some(ALICE),
        Method::POST,
        &format!("/sandboxes/{id}/pause"),
        None,
    )
    .await
    .ok(204);
    e2b(
        &app,
        Some(ALICE),
        Method::POST,
        &format!("/sandboxes/{id}/connect"),
        Some(json!({"timeout": 60})),
    )
    .await
    .ok(201);
    assert_eq!(state_of(&app, &id).await, "paused");
}

async fn end_at(app: &TestApp, id: &str) -> time::OffsetDateTime {
    let detail = e2b(
        app,
        Some(ALICE),
        Method::GET,
        &format!("/sandboxes/{id}"),
        None,
    )
    .await
    .ok(200);
    time::OffsetDateTime::parse(
        detail["endAt"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap()
}

/// Sets a long timeout, then a short one: the end moves earlier (E2B's timeout overwrites).
async fn shortened(app: &TestApp) -> bool {
    let (id, _) = create(app, ALICE, json!({"templateID": "base", "timeout": 3000})).await;
    let before = end_at(app, &id).await;
    e2b(
        app,
        Some(ALICE),
        Method::POST,
        &format!("/sandboxes/{id}/timeout"),
        Some(json!({"timeout": 60})),
    )
    .await
    .ok(204);
    end_at(app, &id).await < before
}

#[tokio::test]
async fn timeout_overwrites_and_can_shorten() {
    let app = spawn_app(|_| {}).await;
    assert!(shortened(&app).await);
    // Refreshes only ever extend.
    let (id, _) = create(&app, ALICE, json!({"templateID": "base", "timeout": 3000})).await;
    let before = end_at(&app, &id).await;
    e2b(
        &app,
        Some(ALICE),
        Method::POST,
        &format!("/sandboxes/{id}/refreshes"),
        Some(json!({"duration": 10})),
    )
    .await
    .ok(204);
    assert_eq!(end_at(&app, &id).await, before);
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_timeout_only_extends_cannot_shorten() {
    let app = spawn_app(|c| {
        c.defects = reference_server::defects::Defects::parse(["e2b-timeout-only-extends"]).unwrap()
    })
    .await;
    assert!(!shortened(&app).await);
}

#[tokio::test]
async fn v2_list_pages_with_next_token_and_refuses_bad_parameters() {
    let app = spawn_app(|_| {}).await;
    for _ in 0..3 {
        create(
            &app,
            ALICE,
            json!({"templateID": "base", "metadata": {"k": "v w"}}),
        )
        .await;
    }
    create(&app, ALICE, json!({"templateID": "base"})).await;
    let first = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        "/v2/sandboxes?limit=2&metadata=k%3Dv%2520w",
        None,
    )
    .await;
    assert_eq!(first.ok(200).as_array().unwrap().len(), 2);
    let token = first
        .header("x-next-token")
        .expect("X-Next-Token")
        .to_owned();
    let second = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        &format!("/v2/sandboxes?limit=2&metadata=k%3Dv%2520w&nextToken={token}"),
        None,
    )
    .await;
    assert_eq!(second.ok(200).as_array().unwrap().len(), 1);
    assert_eq!(second.header("x-next-token"), None);
    // A token is bound to its filters and its team.
    let other_filter = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        &format!("/v2/sandboxes?limit=2&nextToken={token}"),
        None,
    )
    .await;
    e2b_error(&other_filter, 400);
    let other_team = e2b(
        &app,
        Some(BOB),
        Method::GET,
        &format!("/v2/sandboxes?limit=2&metadata=k%3Dv%2520w&nextToken={token}"),
        None,
    )
    .await;
    e2b_error(&other_team, 400);
    for bad in [
        "limit=0",
        "limit=101",
        "limit=x",
        "state=stopped",
        "nextToken=forged",
    ] {
        e2b_error(
            &e2b(
                &app,
                Some(ALICE),
                Method::GET,
                &format!("/v2/sandboxes?{bad}"),
                None,
            )
            .await,
            400,
        );
    }
}

#[tokio::test]
async fn bad_create_input_is_a_clear_4xx_and_creates_nothing() {
    let app = spawn_app(|_| {}).await;
    // Each bad body is refused with its status, and the message names what is wrong.
    let cases: Vec<(Value, u16, &str)> = vec![
        (json!({}), 400, "templateID"),
        (json!({"templateID": "nope"}), 404, "nope"),
        (json!({"templateID": "base", "timeout": -1}), 400, "timeout"),
        (
            json!({"templateID": "base", "timeout": 999_999_999}),
            400,
            "timeout",
        ),
        (
            json!({"templateID": "base", "metadata": {"bad key!": "x"}}),
            400,
            "metadata",
        ),
        (
            json!({"templateID": "base", "envVars": {"A=B": "x"}}),
            400,
            "environment",
        ),
        (json!({"templateID": "base", "unknown": 1}), 400, "unknown"),
        (
            json!({"templateID": "base", "volumeMounts": [{"name": "v", "path": "/x"}]}),
            400,
            "volumeMounts",
        ),
        (json!({"templateID": "base", "secure": true}), 400, "secure"),
        (json!({"templateID": 7}), 400, "templateID"),
    ];
    for (body, status, names) in cases {
        let reply = e2b(
            &app,
            Some(ALICE),
            Method::POST,
            "/v2/sandboxes",
            Some(body.clone()),
        )
        .await;
        let err = e2b_error(&reply, status);
        let message = err["message"].as_str().unwrap();
        assert!(message.contains(names), "{body}: {message}");
    }
    let raw = app
        .client
        .post(app.url("/sandboxes"))
        .header("X-API-Key", ALICE)
        .header("Content-Type", "application/json")
        .body("{not json");
    e2b_error(&Reply::read(raw.send().await.unwrap()).await, 400);
    let text = app
        .client
        .post(app.url("/sandboxes"))
        .header("X-API-Key", ALICE)
        .header("Content-Type", "text/plain")
        .body("templateID=base");
    e2b_error(&Reply::read(text.send().await.unwrap()).await, 415);
    let listed = e2b(&app, Some(ALICE), Method::GET, "/v2/sandboxes", None)
        .await
        .ok(200);
    assert_eq!(listed, json!([]));
}

/// Starts `cmd` through envd and returns the stream's messages and its end.
async fn run(app: &TestApp, id: &str, token: &str, script: &str) -> (Vec<Value>, Value) {
    stream(
        app,
        id,
        token,
        "process.Process/Start",
        json!({"process": {"cmd": "/bin/sh", "args": ["-c", script], "envs": {"E": "from-envs"}}}),
    )
    .await
}

/// A late Connect to a process that has ended: does the stream carry its `end`?
async fn late_connect_sees_exit(app: &TestApp) -> bool {
    let (id, token) = create(app, ALICE, json!({"templateID": "base"})).await;
    let (events, end) = run(app, &id, &token, "printf 'hi %s' \"$E\"; exit 3").await;
    assert_eq!(end, json!({}));
    let pid = events[0]["event"]["start"]["pid"]
        .as_u64()
        .expect("start first");
    assert_eq!(stdout_of(&events), b"hi from-envs");
    let last = &events.last().unwrap()["event"]["end"];
    assert_eq!(last["exitCode"], 3);
    assert_eq!(last["exited"], true);

    let (events, end) = stream(
        app,
        &id,
        &token,
        "process.Process/Connect",
        json!({"process": {"pid": pid}}),
    )
    .await;
    assert_eq!(end, json!({}));
    assert_eq!(events[0]["event"]["start"]["pid"], pid);
    events.iter().any(|e| e["event"]["end"]["exitCode"] == 3)
}

#[tokio::test]
async fn envd_process_start_streams_output_and_a_late_connect_gets_the_exit() {
    let app = spawn_app(|_| {}).await;
    assert!(late_connect_sees_exit(&app).await);
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_late_connect_loses_exit() {
    let app = spawn_app(|c| {
        c.defects =
            reference_server::defects::Defects::parse(["e2b-late-connect-loses-exit"]).unwrap()
    })
    .await;
    assert!(!late_connect_sees_exit(&app).await);
}

#[tokio::test]
async fn envd_stdin_signals_list_and_unknown_processes() {
    let app = spawn_app(|_| {}).await;
    let (id, token) = create(&app, ALICE, json!({"templateID": "base"})).await;
    let rb = envd(&app, &id, Some(&token), "/process.Process/Start")
        .header("Content-Type", "application/connect+json")
        .header("Keepalive-Ping-Interval", "50")
        .body(envelope(
            &json!({"process": {"cmd": "cat"}, "stdin": true, "tag": "t1"}),
        ));
    let start = tokio::spawn(rb.send());

    let pid = support::poll(|| async {
        let listed = unary(&app, &id, &token, "process.Process/List", json!({}))
            .await
            .ok(200);
        listed["processes"]
            .as_array()
            .and_then(|p| p.first())
            .map(|p| {
                (
                    p["pid"].as_u64().unwrap(),
                    p["tag"].clone(),
                    p["config"]["cmd"].clone(),
                )
            })
    })
    .await;
    assert_eq!((pid.1.clone(), pid.2.clone()), (json!("t1"), json!("cat")));
    let pid = pid.0;
    unary(
        &app,
        &id,
        &token,
        "process.Process/SendInput",
        json!({"process": {"tag": "t1"}, "input": {"stdin": b64(b"abc\n")}}),
    )
    .await
    .ok(200);
    unary(
        &app,
        &id,
        &token,
        "process.Process/CloseStdin",
        json!({"process": {"pid": pid}}),
    )
    .await
    .ok(200);
    let body = Reply::read(start.await.unwrap().unwrap()).await;
    let (events, end) = envelopes(&body.body);
    assert_eq!(end, json!({}));
    assert_eq!(stdout_of(&events), b"abc\n");
    assert_eq!(events.last().unwrap()["event"]["end"]["exitCode"], 0);

    // A process that has ended takes no input or signals: not_found, as upstream.
    let reply = unary(
        &app,
        &id,
        &token,
        "process.Process/SendSignal",
        json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
    )
    .await;
    assert_eq!(reply.status.as_u16(), 404);
    assert_eq!(reply.json()["code"], "not_found");
    let reply = unary(
        &app,
        &id,
        &token,
        "process.Process/SendSignal",
        json!({"process": {"pid": 99999}, "signal": 9}),
    )
    .await;
    assert_eq!(reply.json()["code"], "not_found");
    let reply = unary(
        &app,
        &id,
        &token,
        "process.Process/SendSignal",
        json!({"process": {"pid": pid}, "signal": "SIGHUP"}),
    )
    .await;
    assert_eq!(reply.status.as_u16(), 400);
    assert_eq!(reply.json()["code"], "invalid_argument");
    let (_, end) = stream(
        &app,
        &id,
        &token,
        "process.Process/Connect",
        json!({"process": {"pid": 424242}}),
    )
    .await;
    assert_eq!(end["error"]["code"], "not_found");

    // A signal ends a running process with upstream's end event.
    let rb = envd(&app, &id, Some(&token), "/process.Process/Start")
        .header("Content-Type", "application/connect+json")
        .body(envelope(
            &json!({"process": {"cmd": "sleep", "args": ["600"]}, "tag": "sleeper"}),
        ));
    let sleeper = tokio::spawn(rb.send());
    // The sleeper itself: the `cat` before it may still be listed until its exit is recorded.
    support::poll(|| async {
        let listed = unary(&app, &id, &token, "process.Process/List", json!({}))
            .await
            .ok(200);
        listed["processes"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["tag"] == "sleeper"))
            .then_some(())
    })
    .await;
    unary(
        &app,
        &id,
        &token,
        "process.Process/SendSignal",
        json!({"process": {"tag": "sleeper"}, "signal": "SIGNAL_SIGKILL"}),
    )
    .await
    .ok(200);
    let (events, _) = envelopes(&Reply::read(sleeper.await.unwrap().unwrap()).await.body);
    let end = &events.last().unwrap()["event"]["end"];
    assert_eq!(
        (end["exited"].clone(), end["exitCode"].clone()),
        (json!(false), json!(-1))
    );
}

#[tokio::test]
async fn envd_routing_framing_and_access_token() {
    let app = spawn_app(|_| {}).await;
    let (id, token) = create(&app, ALICE, json!({"templateID": "base"})).await;
    assert!(!token.is_empty());
    let list = |token: Option<&str>, id: &str| {
        envd(&app, id, token, "/process.Process/List")
            .header("Content-Type", "application/json")
            .body("{}")
    };
    e2b_error(
        &Reply::read(list(None, &id).send().await.unwrap()).await,
        401,
    );
    e2b_error(
        &Reply::read(list(Some("wrong"), &id).send().await.unwrap()).await,
        401,
    );
    Reply::read(list(Some(&token), &id).send().await.unwrap())
        .await
        .ok(200);
    // An unknown sandbox is the proxy's 502 "was not found".
    let unknown = Reply::read(
        list(Some(&token), "01jf0000000000000000000000")
            .send()
            .await
            .unwrap(),
    )
    .await;
    let body = e2b_error(&unknown, 502);
    assert!(body["message"].as_str().unwrap().contains("was not found"));
    // Only envd's port is served.
    let other_port = app
        .client
        .get(app.url("/health"))
        .header("E2b-Sandbox-Id", &id)
        .header("E2b-Sandbox-Port", "8080");
    e2b_error(&Reply::read(other_port.send().await.unwrap()).await, 502);
    // /health needs no token; E2B's host form routes as the headers do.
    let health = app
        .client
        .get(app.url("/health"))
        .header("E2b-Sandbox-Id", &id)
        .header("E2b-Sandbox-Port", "49983");
    assert_eq!(health.send().await.unwrap().status().as_u16(), 204);
    let host = app
        .client
        .get(app.url("/health"))
        .header("Host", format!("49983-{id}.sandbox.test"));
    assert_eq!(host.send().await.unwrap().status().as_u16(), 204);

    // Framing faults are precise Connect errors, never 5xx.
    let wrong_type = envd(&app, &id, Some(&token), "/process.Process/Start")
        .header("Content-Type", "application/json")
        .body(envelope(&json!({})));
    let (_, end) = envelopes(&Reply::read(wrong_type.send().await.unwrap()).await.body);
    assert_eq!(end["error"]["code"], "invalid_argument");
    let mut truncated = envelope(&json!({"process": {"cmd": "true"}}));
    truncated.truncate(8);
    let short = envd(&app, &id, Some(&token), "/process.Process/Start")
        .header("Content-Type", "application/connect+json")
        .body(truncated);
    let (_, end) = envelopes(&Reply::read(short.send().await.unwrap()).await.body);
    assert_eq!(end["error"]["code"], "invalid_argument");
    assert!(
        end["error"]["message"]
            .as_str()
            .unwrap()
            .contains("announces")
    );
    let unknown_field = unary(
        &app,
        &id,
        &token,
        "filesystem.Filesystem/Stat",
        json!({"path": "x", "nope": 1}),
    )
    .await;
    assert_eq!(unknown_field.status.as_u16(), 400);
    assert_eq!(unknown_field.json()["code"], "invalid_argument");
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_access_token_unchecked_lets_anyone_in() {
    let app = spawn_app(|c| {
        c.defects =
            reference_server::defects::Defects::parse(["e2b-access-token-unchecked"]).unwrap()
    })
    .await;
    let (id, _) = create(&app, ALICE, json!({"templateID": "base"})).await;
    let rb = envd(&app, &id, None, "/process.Process/List")
        .header("Content-Type", "application/json")
        .body("{}");
    Reply::read(rb.send().await.unwrap()).await.ok(200);
}

/// Uploads every byte value with octet-stream and reads it back: is it unchanged?
async fn binary_round_trip(app: &TestApp) -> bool {
    let (id, token) = create(app, ALICE, json!({"templateID": "base"})).await;
    let bytes: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
    let rb = envd(app, &id, Some(&token), "/files?path=/home/user/bin/all.dat")
        .header("Content-Type", "application/octet-stream")
        .body(bytes.clone());
    let written = Reply::read(rb.send().await.unwrap()).await.ok(200);
    assert_eq!(
        written,
        json!([{"name": "all.dat", "type": "file", "path": "/home/user/bin/all.dat"}])
    );
    let read = envd_get(app, &id, &token, "/files?path=bin/all.dat");
    let read = Reply::read(read.send().await.unwrap()).await;
    assert_eq!(read.status.as_u16(), 200);
    read.body.as_ref() == bytes.as_slice()
}

#[tokio::test]
async fn envd_files_octet_stream_and_multipart() {
    let app = spawn_app(|_| {}).await;
    assert!(binary_round_trip(&app).await);
    let (id, token) = create(&app, ALICE, json!({"templateID": "base"})).await;
    let boundary = "sandspec-boundary-7f3a";
    let mut form = Vec::new();
    for (name, data) in [("/home/user/m/one.txt", "one"), ("m/two.txt", "two")] {
        form.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n{data}\r\n"
            )
            .as_bytes(),
        );
    }
    form.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let rb = envd(&app, &id, Some(&token), "/files")
        .header(
            "Content-Type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(form);
    let written = Reply::read(rb.send().await.unwrap()).await.ok(200);
    assert_eq!(written.as_array().unwrap().len(), 2);
    assert_eq!(written[1]["path"], "/home/user/m/two.txt");
    let files = unary(
        &app,
        &id,
        &token,
        "filesystem.Filesystem/ListDir",
        json!({"path": "/home/user/m", "depth": 1}),
    )
    .await
    .ok(200);
    let names = strings(&files["entries"], "name");
    assert_eq!(names, ["one.txt", "two.txt"]);

    let missing = envd_get(&app, &id, &token, "/files?path=nope");
    e2b_error(&Reply::read(missing.send().await.unwrap()).await, 404);
    let outside = envd(&app, &id, Some(&token), "/files?path=/etc/passwd")
        .header("Content-Type", "application/octet-stream")
        .body("x");
    e2b_error(&Reply::read(outside.send().await.unwrap()).await, 400);
    let escape = envd(&app, &id, Some(&token), "/files?path=../x")
        .header("Content-Type", "application/octet-stream")
        .body("x");
    e2b_error(&Reply::read(escape.send().await.unwrap()).await, 400);
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_file_bytes_altered_breaks_binary_uploads() {
    let app = spawn_app(|c| {
        c.defects = reference_server::defects::Defects::parse(["e2b-file-bytes-altered"]).unwrap()
    })
    .await;
    assert!(!binary_round_trip(&app).await);
}

#[tokio::test]
async fn envd_filesystem_rpcs_and_watchers() {
    let app = spawn_app(|_| {}).await;
    let (id, token) = create(&app, ALICE, json!({"templateID": "base"})).await;
    let call = |method: &'static str, body: Value| {
        let (app, id, token) = (&app, id.clone(), token.clone());
        async move {
            unary(
                app,
                &id,
                &token,
                &format!("filesystem.Filesystem/{method}"),
                body,
            )
            .await
        }
    };
    let made = call("MakeDir", json!({"path": "/home/user/d/e"}))
        .await
        .ok(200);
    assert_eq!(made["entry"]["type"], "FILE_TYPE_DIRECTORY");
    assert_eq!(made["entry"]["path"], "/home/user/d/e");
    let again = call("MakeDir", json!({"path": "d/e"})).await;
    assert_eq!(
        (again.status.as_u16(), again.json()["code"].clone()),
        (409, json!("already_exists"))
    );

    let watcher = call(
        "CreateWatcher",
        json!({"path": "/home/user/d", "recursive": true}),
    )
    .await
    .ok(200);
    let watcher_id = watcher["watcherId"].as_str().unwrap().to_owned();

    let rb = envd(&app, &id, Some(&token), "/files?path=d/e/f.txt")
        .header("Content-Type", "application/octet-stream")
        .body("12345");
    Reply::read(rb.send().await.unwrap()).await.ok(200);
    let stat = call("Stat", json!({"path": "d/e/f.txt"})).await.ok(200);
    assert_eq!(stat["entry"]["size"], "5");
    assert_eq!(stat["entry"]["name"], "f.txt");
    assert_eq!(stat["entry"]["type"], "FILE_TYPE_FILE");

    let events = call("GetWatcherEvents", json!({"watcherId": watcher_id}))
        .await
        .ok(200);
    let events: Vec<&Value> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] != "EVENT_TYPE_CHMOD")
        .collect();
    assert_eq!(
        events,
        [
            &json!({"name": "e/f.txt", "type": "EVENT_TYPE_CREATE"}),
            &json!({"name": "e/f.txt", "type": "EVENT_TYPE_WRITE"})
        ]
    );

    let moved = call(
        "Move",
        json!({"source": "d/e/f.txt", "destination": "/home/user/g.txt"}),
    )
    .await
    .ok(200);
    assert_eq!(moved["entry"]["path"], "/home/user/g.txt");
    let events = call("GetWatcherEvents", json!({"watcherId": watcher_id}))
        .await
        .ok(200);
    // Moved out of the watched tree: fsnotify's (and inotify's) rename.
    assert_eq!(
        events["events"],
        json!([{"name": "e/f.txt", "type": "EVENT_TYPE_RENAME"}])
    );
    let all = call("ListDir", json!({"path": "/home/user", "depth": 3}))
        .await
        .ok(200);
    let paths = strings(&all["entries"], "path");
    // Depth first in name order, as envd's filepath.WalkDir.
    assert_eq!(
        paths,
        ["/home/user/d", "/home/user/d/e", "/home/user/g.txt"]
    );

    call("Remove", json!({"path": "g.txt"})).await.ok(200);
    let gone = call("Stat", json!({"path": "g.txt"})).await;
    assert_eq!(
        (gone.status.as_u16(), gone.json()["code"].clone()),
        (404, json!("not_found"))
    );
    // envd removes with os.RemoveAll: a path that is not there is already removed.
    call("Remove", json!({"path": "g.txt"})).await.ok(200);
    let outside = call("Stat", json!({"path": "/etc"})).await;
    assert_eq!(outside.json()["code"], "invalid_argument");
    call("RemoveWatcher", json!({"watcherId": watcher_id}))
        .await
        .ok(200);
    let removed = call("GetWatcherEvents", json!({"watcherId": watcher_id})).await;
    assert_eq!(removed.json()["code"], "not_found");
}

#[tokio::test]
async fn envd_watch_dir_streams_events() {
    let app = spawn_app(|_| {}).await;
    let (id, token) = create(&app, ALICE, json!({"templateID": "base"})).await;
    let mut response = envd(&app, &id, Some(&token), "/filesystem.Filesystem/WatchDir")
        .header("Content-Type", "application/connect+json")
        .body(envelope(&json!({"path": "/home/user", "recursive": false})))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let mut buf = Vec::new();
    let mut messages: Vec<Value> = Vec::new();
    let mut wrote = false;
    while messages.iter().all(|m| m.get("filesystem").is_none()) {
        let chunk = tokio::time::timeout(Duration::from_secs(30), response.chunk())
            .await
            .expect("a watch event")
            .unwrap()
            .expect("stream open");
        buf.extend_from_slice(&chunk);
        while buf.len() >= 5 {
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            if buf.len() < 5 + len {
                break;
            }
            assert_eq!(buf[0], 0, "no end of stream while watching");
            messages.push(serde_json::from_slice(&buf[5..5 + len]).unwrap());
            buf.drain(..5 + len);
        }
        if !wrote && messages.first().is_some_and(|m| m.get("start").is_some()) {
            wrote = true;
            let rb = envd(&app, &id, Some(&token), "/files?path=w.txt")
                .header("Content-Type", "application/octet-stream")
                .body("x");
            Reply::read(rb.send().await.unwrap()).await.ok(200);
        }
    }
    assert_eq!(messages[0], json!({"start": {}}));
    let event = messages.iter().find_map(|m| m.get("filesystem")).unwrap();
    assert_eq!(
        event,
        &json!({"name": "w.txt", "type": "EVENT_TYPE_CREATE"})
    );
}

/// A venv with the pinned E2B SDK, or `None` (with the reason) when it cannot be had;
/// under `CI=true` that is a failure, not a skip.
fn sdk_python() -> Option<std::path::PathBuf> {
    venv::executable("e2b-sdk-venv", &[E2B_SDK], "python")
}

/// The real E2B Python SDK drives the reference server through `E2B_API_URL` and
/// `E2B_SANDBOX_URL`: every call succeeds with the SDK's own types, and a killed sandbox and
/// a wrong key surface as the SDK's own exceptions (`tests/e2b_sdk.py` asserts each).
#[test]
fn e2b_sdk_drives_the_reference_server() {
    let Some(python) = sdk_python() else { return };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let app = rt.block_on(spawn_app(|_| {}));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2b_sdk.py");
    let output = Command::new(&python)
        .arg(&script)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("E2B_API_URL", &app.base)
        .env("E2B_SANDBOX_URL", &app.base)
        .env("E2B_API_KEY", ALICE)
        .env("E2B_DOMAIN", "sandbox.test")
        .env("SANDSPEC_E2B_DOC", e2b_doc())
        .output()
        .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "SDK script failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains("e2b sdk: all checks passed"),
        "stdout:\n{stdout}"
    );
    drop(app);
}

/// `docs/profiles/e2b.md`, whose SDK method table both drivers check the SDKs against.
fn e2b_doc() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/profiles/e2b.md")
}

/// The real E2B JavaScript SDK (npm `e2b`, run by node) drives the reference server as the
/// Python one does (`tests/e2b_sdk.mjs` asserts each call), and every public method of its
/// `Sandbox`, `files`, `commands` and `pty` has a row in the doc's SDK method table.
#[test]
fn e2b_js_sdk_drives_the_reference_server() {
    let Some(prefix) = npm::pinned(env!("CARGO_TARGET_TMPDIR"), "e2b-js-sdk", &[E2B_JS_SDK]) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let app = rt.block_on(spawn_app(|_| {}));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2b_sdk.mjs");
    let output = Command::new("node")
        .arg(&script)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("E2B_API_URL", &app.base)
        .env("E2B_SANDBOX_URL", &app.base)
        .env("E2B_API_KEY", ALICE)
        .env("E2B_DOMAIN", "sandbox.test")
        .env("SANDSPEC_NPM_PREFIX", &prefix)
        .env("SANDSPEC_E2B_DOC", e2b_doc())
        .output()
        .expect("run the JavaScript SDK script");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "JavaScript SDK script failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains("e2b js sdk: all checks passed"),
        "stdout:\n{stdout}"
    );
    drop(app);
}

#[tokio::test]
async fn expiry_kills_or_with_auto_pause_pauses() {
    let app = spawn_app(|_| {}).await;
    let (killed, _) = create(&app, ALICE, json!({"templateID": "base", "timeout": 1})).await;
    let (paused, _) = create(
        &app,
        ALICE,
        json!({"templateID": "base", "timeout": 1, "autoPause": true}),
    )
    .await;
    let detail = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        &format!("/sandboxes/{paused}"),
        None,
    )
    .await
    .ok(200);
    assert_eq!(detail["lifecycle"]["onTimeout"], "pause");
    support::poll(|| async {
        let reply = e2b(
            &app,
            Some(ALICE),
            Method::GET,
            &format!("/sandboxes/{killed}"),
            None,
        )
        .await;
        (reply.status.as_u16() == 404).then_some(())
    })
    .await;
    support::poll(|| async {
        let reply = e2b(
            &app,
            Some(ALICE),
            Method::GET,
            &format!("/sandboxes/{paused}"),
            None,
        )
        .await;
        (reply.ok(200)["state"] == "paused").then_some(())
    })
    .await;
    // A paused sandbox is not routable for envd until it is resumed.
    let health = app
        .client
        .get(app.url("/health"))
        .header("E2b-Sandbox-Id", &paused)
        .header("E2b-Sandbox-Port", "49983");
    assert_eq!(health.send().await.unwrap().status().as_u16(), 502);
    e2b(
        &app,
        Some(ALICE),
        Method::POST,
        &format!("/sandboxes/{paused}/connect"),
        Some(json!({"timeout": 60})),
    )
    .await
    .ok(201);
    let health = app
        .client
        .get(app.url("/health"))
        .header("E2b-Sandbox-Id", &paused)
        .header("E2b-Sandbox-Port", "49983");
    assert_eq!(health.send().await.unwrap().status().as_u16(), 204);
}

/// Starts `script` through envd with `extra` fields (`stdin`, `tag`) without waiting for its
/// end: the stream is read whole by the returned task. Returns the task and the pid once
/// `List` shows the process.
async fn start_in_background(
    app: &TestApp,
    id: &str,
    token: &str,
    script: &str,
    extra: Value,
) -> (tokio::task::JoinHandle<Reply>, u64) {
    let mut body = json!({"process": {"cmd": "/bin/sh", "args": ["-c", script]}});
    if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
        body.extend(extra.clone());
    }
    let rb = envd(app, id, Some(token), "/process.Process/Start")
        .header("Content-Type", "application/connect+json")
        .body(envelope(&body));
    let task = tokio::spawn(async move { Reply::read(rb.send().await.expect("send")).await });
    let pid = support::poll(|| async {
        let listed = unary(app, id, token, "process.Process/List", json!({}))
            .await
            .ok(200);
        listed["processes"]
            .as_array()
            .and_then(|p| p.first())
            .and_then(|p| p["pid"].as_u64())
    })
    .await;
    (task, pid)
}

/// Whether `List` still shows a running process within a few seconds (polled).
async fn still_running_after_a_while(app: &TestApp, id: &str, token: &str) -> bool {
    for _ in 0..20 {
        let listed = unary(app, id, token, "process.Process/List", json!({}))
            .await
            .ok(200);
        if listed["processes"].as_array().is_some_and(Vec::is_empty) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    true
}

/// Input then `CloseStdin`: does the process see exactly the bytes, then end of input?
async fn stdin_then_eof(app: &TestApp) -> bool {
    let (id, token) = create(app, ALICE, json!({"templateID": "base"})).await;
    let (task, pid) =
        start_in_background(app, &id, &token, "cat > got.bin", json!({"stdin": true})).await;
    let bytes = b"\x00\xffin\xc3\n";
    let sent = unary(
        app,
        &id,
        &token,
        "process.Process/SendInput",
        json!({"process": {"pid": pid}, "input": {"stdin": b64(bytes)}}),
    )
    .await;
    if sent.status != 200 {
        // The process ended before its input: its own stream says how.
        let stream = tokio::time::timeout(Duration::from_secs(10), task).await;
        panic!(
            "SendInput answered {} {}; the process's stream: {:?}",
            sent.status,
            String::from_utf8_lossy(&sent.body),
            stream.map(|r| r.map(|reply| String::from_utf8_lossy(&reply.body).into_owned()))
        );
    }
    unary(
        app,
        &id,
        &token,
        "process.Process/CloseStdin",
        json!({"process": {"pid": pid}}),
    )
    .await
    .ok(200);
    if still_running_after_a_while(app, &id, &token).await {
        task.abort();
        return false;
    }
    let (events, _) = envelopes(&task.await.unwrap().body);
    assert_eq!(events.last().unwrap()["event"]["end"]["exitCode"], 0);
    let read = envd_get(app, &id, &token, "/files?path=got.bin");
    let got = Reply::read(read.send().await.unwrap()).await;
    assert_eq!(got.status.as_u16(), 200);
    assert_eq!(&got.body[..], bytes);
    true
}

#[tokio::test]
async fn close_stdin_ends_input() {
    let app = spawn_app(|_| {}).await;
    assert!(stdin_then_eof(&app).await);
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_close_stdin_ignored_leaves_the_process_reading() {
    let app = spawn_app(|c| {
        c.defects = reference_server::defects::Defects::parse(["e2b-close-stdin-ignored"]).unwrap()
    })
    .await;
    assert!(!stdin_then_eof(&app).await);
}

/// SIGKILL to a process whose child writes a marker a second later: is the marker ever
/// written? The end event says killed either way.
async fn kill_leaves_a_marker(app: &TestApp) -> bool {
    let (id, token) = create(app, ALICE, json!({"templateID": "base"})).await;
    let (task, pid) = start_in_background(
        app,
        &id,
        &token,
        "(sleep 1; echo late > marker) & echo > started; wait",
        json!({}),
    )
    .await;
    let file = |path: &str| envd_get(app, &id, &token, &format!("/files?path={path}"));
    support::poll(|| async {
        (file("started").send().await.unwrap().status().as_u16() == 200).then_some(())
    })
    .await;
    unary(
        app,
        &id,
        &token,
        "process.Process/SendSignal",
        json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
    )
    .await
    .ok(200);
    let (events, _) = envelopes(&task.await.unwrap().body);
    assert_eq!(
        events.last().unwrap()["event"]["end"]["status"],
        "signal: killed"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    file("marker").send().await.unwrap().status().as_u16() == 200
}

#[tokio::test]
async fn sigkill_ends_the_process_and_its_children() {
    let app = spawn_app(|_| {}).await;
    assert!(!kill_leaves_a_marker(&app).await);
}

/// SIGKILL to a shell that ignores SIGTERM: does it end, with upstream's end event?
async fn sigkill_ends_a_term_ignoring_shell(app: &TestApp) -> bool {
    let (id, token) = create(app, ALICE, json!({"templateID": "base"})).await;
    let (task, pid) = start_in_background(
        app,
        &id,
        &token,
        "trap '' TERM; : > trapped; while :; do sleep 0.2; done",
        json!({}),
    )
    .await;
    // The signal goes only once the shell ignores TERM: sent before, a TERM (the defect's)
    // would end it as surely as a KILL.
    support::poll(|| async {
        let rb = envd_get(app, &id, &token, "/files?path=trapped");
        (rb.send().await.expect("send").status() == 200).then_some(())
    })
    .await;
    unary(
        app,
        &id,
        &token,
        "process.Process/SendSignal",
        json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
    )
    .await
    .ok(200);
    if still_running_after_a_while(app, &id, &token).await {
        task.abort();
        return false;
    }
    let (events, _) = envelopes(&task.await.unwrap().body);
    assert_eq!(
        events.last().unwrap()["event"]["end"],
        json!({"exitCode": -1, "exited": false, "status": "signal: killed"})
    );
    true
}

#[tokio::test]
async fn sigkill_cannot_be_ignored() {
    let app = spawn_app(|_| {}).await;
    assert!(sigkill_ends_a_term_ignoring_shell(&app).await);
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_sigkill_sent_as_sigterm_is_ignored() {
    let app = spawn_app(|c| {
        c.defects =
            reference_server::defects::Defects::parse(["e2b-sigkill-sent-as-sigterm"]).unwrap()
    })
    .await;
    assert!(!sigkill_ends_a_term_ignoring_shell(&app).await);
}

/// A background process found again by its tag: the stream of `Connect` by tag.
async fn connect_by_tag(app: &TestApp) -> (u64, Vec<Value>, Value) {
    let (id, token) = create(app, ALICE, json!({"templateID": "base"})).await;
    let (task, pid) = start_in_background(
        app,
        &id,
        &token,
        "while [ ! -e release ]; do sleep 0.1; done; exit 7",
        json!({"tag": "bg"}),
    )
    .await;
    let rb = envd(app, &id, Some(&token), "/process.Process/Connect")
        .header("Content-Type", "application/connect+json")
        .body(envelope(&json!({"process": {"tag": "bg"}})));
    let attached = tokio::spawn(async move { Reply::read(rb.send().await.expect("send")).await });
    let rb = envd(app, &id, Some(&token), "/files?path=release")
        .header("Content-Type", "application/octet-stream")
        .body("go");
    Reply::read(rb.send().await.unwrap()).await.ok(200);
    task.await.unwrap();
    let (events, end) = envelopes(&attached.await.unwrap().body);
    (pid, events, end)
}

#[tokio::test]
async fn connect_by_tag_reaches_a_background_process() {
    let app = spawn_app(|_| {}).await;
    let (pid, events, end) = connect_by_tag(&app).await;
    assert_eq!(end, json!({}));
    assert_eq!(events[0]["event"]["start"]["pid"], pid);
    assert_eq!(events.last().unwrap()["event"]["end"]["exitCode"], 7);
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_connect_by_tag_not_found() {
    let app = spawn_app(|c| {
        c.defects =
            reference_server::defects::Defects::parse(["e2b-connect-by-tag-not-found"]).unwrap()
    })
    .await;
    let (_, events, end) = connect_by_tag(&app).await;
    assert!(events.is_empty());
    assert_eq!(end["error"]["code"], "not_found");
}

/// The event types a polling watcher reports after a create, a write that changes the size,
/// and a remove, one look after each.
async fn watched_events(app: &TestApp) -> Vec<Vec<Value>> {
    let (id, token) = create(app, ALICE, json!({"templateID": "base"})).await;
    let watcher = unary(
        app,
        &id,
        &token,
        "filesystem.Filesystem/CreateWatcher",
        json!({"path": "/home/user"}),
    )
    .await
    .ok(200);
    let watcher_id = watcher["watcherId"].as_str().unwrap().to_owned();
    let mut seen = Vec::new();
    for change in ["create", "write", "remove"] {
        if change == "remove" {
            unary(
                app,
                &id,
                &token,
                "filesystem.Filesystem/Remove",
                json!({"path": "w.txt"}),
            )
            .await
            .ok(200);
        } else {
            let rb = envd(app, &id, Some(&token), "/files?path=w.txt")
                .header("Content-Type", "application/octet-stream")
                .body(if change == "create" { "1" } else { "longer" });
            Reply::read(rb.send().await.unwrap()).await.ok(200);
        }
        let events = unary(
            app,
            &id,
            &token,
            "filesystem.Filesystem/GetWatcherEvents",
            json!({"watcherId": watcher_id}),
        )
        .await
        .ok(200);
        seen.push(
            events["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["type"].clone())
                .collect(),
        );
    }
    seen
}

/// The event types of each look, without the `CHMOD`s of the ownership changes the files API
/// makes (there are some only when the sandbox has a uid of its own) and with repeats of one
/// type in a row as one (inotify merges an event into the same one still unread before it).
fn without_chmod(looks: Vec<Vec<Value>>) -> Vec<Vec<Value>> {
    looks
        .into_iter()
        .map(|look| {
            let mut types: Vec<Value> = look
                .into_iter()
                .filter(|t| t != "EVENT_TYPE_CHMOD")
                .collect();
            types.dedup();
            types
        })
        .collect()
}

/// One event per change, as inotify reports them (envd's fsnotify too): a new file is created
/// then written, an overwrite written, a removal removed.
#[tokio::test]
async fn a_watcher_sees_create_write_and_remove() {
    let app = spawn_app(|_| {}).await;
    assert_eq!(
        without_chmod(watched_events(&app).await),
        [
            vec![json!("EVENT_TYPE_CREATE"), json!("EVENT_TYPE_WRITE")],
            vec![json!("EVENT_TYPE_WRITE")],
            vec![json!("EVENT_TYPE_REMOVE")]
        ]
    );
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_watch_misses_writes() {
    let app = spawn_app(|c| {
        c.defects = reference_server::defects::Defects::parse(["e2b-watch-misses-writes"]).unwrap()
    })
    .await;
    assert_eq!(
        without_chmod(watched_events(&app).await),
        [
            vec![json!("EVENT_TYPE_CREATE")],
            vec![],
            vec![json!("EVENT_TYPE_REMOVE")]
        ]
    );
}

/// A sandbox created with `autoPause` whose end passes: `paused`, or gone (404)?
async fn auto_pause_outcome(app: &TestApp) -> String {
    let (id, _) = create(
        app,
        ALICE,
        json!({"templateID": "base", "timeout": 1, "autoPause": true}),
    )
    .await;
    support::poll(|| async {
        let reply = e2b(
            app,
            Some(ALICE),
            Method::GET,
            &format!("/sandboxes/{id}"),
            None,
        )
        .await;
        match reply.status.as_u16() {
            404 => Some("gone".to_owned()),
            _ => {
                let state = reply.ok(200)["state"].as_str().unwrap().to_owned();
                (state == "paused").then_some(state)
            }
        }
    })
    .await
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_auto_pause_ignored_kills_instead() {
    let app = spawn_app(|c| {
        c.defects = reference_server::defects::Defects::parse(["e2b-auto-pause-ignored"]).unwrap()
    })
    .await;
    assert_eq!(auto_pause_outcome(&app).await, "gone");
}

#[tokio::test]
async fn expiry_pauses_an_auto_pause_sandbox() {
    let app = spawn_app(|_| {}).await;
    assert_eq!(auto_pause_outcome(&app).await, "paused");
}

/// What a process of a sandbox created with `envVars` prints for one, and what `/envs` says.
async fn env_var_seen(app: &TestApp) -> (Vec<u8>, Value) {
    let (id, token) = create(
        app,
        ALICE,
        json!({"templateID": "base", "envVars": {"SANDSPEC_GREETING": "hello there"}}),
    )
    .await;
    let (events, _) = run(app, &id, &token, "printf %s \"$SANDSPEC_GREETING\"").await;
    let envs = envd_get(app, &id, &token, "/envs");
    let envs = Reply::read(envs.send().await.unwrap()).await.ok(200);
    (stdout_of(&events), envs)
}

#[tokio::test]
async fn env_vars_reach_processes_and_envs() {
    let app = spawn_app(|_| {}).await;
    let (stdout, envs) = env_var_seen(&app).await;
    assert_eq!(stdout, b"hello there");
    assert_eq!(envs["SANDSPEC_GREETING"], "hello there");
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_env_vars_dropped() {
    let app = spawn_app(|c| {
        c.defects = reference_server::defects::Defects::parse(["e2b-env-vars-dropped"]).unwrap()
    })
    .await;
    let (stdout, envs) = env_var_seen(&app).await;
    assert_eq!(stdout, b"");
    assert_eq!(envs["SANDSPEC_GREETING"], "hello there");
}

/// `POST /sandboxes` with `Idempotency-Key`: as the SDK retries a create.
async fn create_with_key(app: &TestApp, key: &str, idem: &str, body: Value) -> Reply {
    let rb = app
        .client
        .post(app.url("/v2/sandboxes"))
        .header("X-API-Key", key)
        .header("Idempotency-Key", idem)
        .json(&body);
    Reply::read(rb.send().await.expect("send")).await
}

#[tokio::test]
async fn create_with_the_same_idempotency_key_replays_the_first_sandbox() {
    let app = spawn_app(|_| {}).await;
    let body = json!({"templateID": "base", "metadata": {"k": "v"}});
    let first = create_with_key(&app, ALICE, "create-1", body.clone())
        .await
        .ok(201);
    let again = create_with_key(&app, ALICE, "create-1", body.clone()).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let again = again.ok(201);
    assert_eq!(again["sandboxID"], first["sandboxID"]);
    assert_eq!(again["envdAccessToken"], first["envdAccessToken"]);
    let listed = e2b(&app, Some(ALICE), Method::GET, "/sandboxes", None)
        .await
        .ok(200);
    assert_eq!(listed.as_array().unwrap().len(), 1);

    // The key is the team's: another team with the same key gets a sandbox of its own.
    let other = create_with_key(&app, BOB, "create-1", body.clone())
        .await
        .ok(201);
    assert_ne!(other["sandboxID"], first["sandboxID"]);
    // The same key with another body is refused and creates nothing.
    let changed = create_with_key(
        &app,
        ALICE,
        "create-1",
        json!({"templateID": "base", "metadata": {"k": "other"}}),
    )
    .await;
    e2b_error(&changed, 422);
    // A new key creates a new sandbox; a killed one's key answers 404, not a new sandbox.
    let second = create_with_key(&app, ALICE, "create-2", body.clone())
        .await
        .ok(201);
    assert_ne!(second["sandboxID"], first["sandboxID"]);
    let id = first["sandboxID"].as_str().unwrap();
    let killed = e2b(
        &app,
        Some(ALICE),
        Method::DELETE,
        &format!("/sandboxes/{id}"),
        None,
    )
    .await;
    assert_eq!(killed.status.as_u16(), 204);
    let replayed = create_with_key(&app, ALICE, "create-1", body).await;
    e2b_error(&replayed, 404);
    let listed = e2b(&app, Some(ALICE), Method::GET, "/sandboxes", None)
        .await
        .ok(200);
    assert_eq!(listed.as_array().unwrap().len(), 1);
}

/// Egress configuration: a sandbox here reaches nothing outside the machine (its network
/// namespace has only loopback), so what denies traffic is taken and shown back, and what
/// would let traffic out is refused; on a machine without network namespaces nothing can be
/// denied either.
#[tokio::test]
async fn network_denials_are_taken_and_allowances_refused() {
    let app = spawn_app(|_| {}).await;
    let caps = app
        .client
        .get(app.url("/v1/capabilities"))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    let caps: Value = caps.json().await.unwrap();
    let isolated = caps["isolation"]["network"] == "loopback";
    let denied = e2b(
        &app,
        Some(ALICE),
        Method::POST,
        "/v2/sandboxes",
        Some(json!({"templateID": "base", "allow_internet_access": false, "network": {"denyOut": ["0.0.0.0/0"]}})),
    )
    .await;
    if !isolated {
        let body = e2b_error(&denied, 400);
        assert!(
            body["message"].as_str().unwrap().contains("host's network"),
            "{body}"
        );
        return;
    }
    let id = denied.ok(201)["sandboxID"].as_str().unwrap().to_owned();
    let detail = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        &format!("/sandboxes/{id}"),
        None,
    )
    .await
    .ok(200);
    assert_eq!(detail["allowInternetAccess"], false);
    assert_eq!(detail["network"], json!({"denyOut": ["0.0.0.0/0"]}));
    for refused in [
        json!({"allowOut": ["1.1.1.1"]}),
        json!({"allow_internet_access": true}),
        json!({"rules": {"example.com": [{}]}}),
    ] {
        let reply = e2b(
            &app,
            Some(ALICE),
            Method::PUT,
            &format!("/sandboxes/{id}/network"),
            Some(refused.clone()),
        )
        .await;
        e2b_error(&reply, 400);
    }
    let updated = e2b(
        &app,
        Some(ALICE),
        Method::PUT,
        &format!("/sandboxes/{id}/network"),
        Some(json!({"denyOut": ["8.8.8.8"]})),
    )
    .await;
    assert_eq!(updated.status.as_u16(), 204);
    let detail = e2b(
        &app,
        Some(ALICE),
        Method::GET,
        &format!("/sandboxes/{id}"),
        None,
    )
    .await
    .ok(200);
    assert_eq!(detail["network"], json!({"denyOut": ["8.8.8.8"]}));
    assert_eq!(detail["allowInternetAccess"], Value::Null);
    let foreign = e2b(
        &app,
        Some(BOB),
        Method::PUT,
        &format!("/sandboxes/{id}/network"),
        Some(json!({"denyOut": ["8.8.8.8"]})),
    )
    .await;
    e2b_error(&foreign, 404);
}

/// A port served inside a sandbox is reached as the SDK's `get_host` names it: by the routing
/// headers with that port, or by the host form `<port>-<id>.<domain>`; a port nothing listens
/// on is the proxy's 502, and the caller's credentials never reach the sandbox.
#[tokio::test]
async fn a_sandbox_port_is_reached_through_the_proxy() {
    let app = spawn_app(|_| {}).await;
    let (id, token) = create(&app, ALICE, json!({"templateID": "base"})).await;
    let rb = envd(&app, &id, Some(&token), "/files?path=served/index.txt")
        .header("Content-Type", "application/octet-stream")
        .body("served from inside");
    Reply::read(rb.send().await.unwrap()).await.ok(200);
    let server = envd(&app, &id, Some(&token), "/process.Process/Start")
        .header("Content-Type", "application/connect+json")
        .body(envelope(&json!({"process": {
            "cmd": "python3",
            "args": ["-m", "http.server", "8123", "--bind", "127.0.0.1", "--directory", "served"],
        }})));
    let _server = tokio::spawn(server.send());
    let by_header = support::poll(|| async {
        let reply = app
            .client
            .get(app.url("/index.txt"))
            .header("E2b-Sandbox-Id", &id)
            .header("E2b-Sandbox-Port", "8123")
            .send()
            .await
            .ok()?;
        let reply = Reply::read(reply).await;
        (reply.status.as_u16() == 200).then_some(reply)
    })
    .await;
    assert_eq!(&by_header.body[..], b"served from inside");
    let by_host = app
        .client
        .get(app.url("/index.txt"))
        .header("Host", format!("8123-{id}.sandbox.test"))
        .send()
        .await
        .unwrap();
    let by_host = Reply::read(by_host).await;
    assert_eq!(
        (by_host.status.as_u16(), &by_host.body[..]),
        (200, b"served from inside".as_slice())
    );
    let closed = app
        .client
        .get(app.url("/"))
        .header("E2b-Sandbox-Id", &id)
        .header("E2b-Sandbox-Port", "8124")
        .send()
        .await
        .unwrap();
    let body = e2b_error(&Reply::read(closed).await, 502);
    assert_eq!(body["sandboxId"], id.as_str());
    let unknown = app
        .client
        .get(app.url("/"))
        .header("E2b-Sandbox-Id", "nosuchsandbox")
        .header("E2b-Sandbox-Port", "8123")
        .send()
        .await
        .unwrap();
    e2b_error(&Reply::read(unknown).await, 502);
}
