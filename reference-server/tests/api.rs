//! The HTTP API of the reference server, exercised over real TCP: one server per test.

use crate::support;

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use support::*;

#[tokio::test]
async fn health_answers_without_auth_and_every_response_has_a_request_id() {
    let app = spawn_app(|_| {}).await;
    let reply = app.send(app.request(None, Method::GET, "/v1/health")).await;
    assert_eq!(reply.ok(200), json!({"status": "ok"}));
    let rid = reply.header("x-request-id").unwrap();
    assert!(rid.starts_with("req_") && rid.len() == 30, "{rid}");
    let other = app.send(app.request(None, Method::GET, "/v1/health")).await;
    assert_ne!(other.header("x-request-id"), Some(rid));
}

/// An `isolation` object of the capabilities: namespaces with how they are made, the uid,
/// the users and home inside and a loopback network, or none with the reason; what is
/// enforced, each with its mechanism (a cgroup version, or a per-process limit for memory).
/// With `SANDSPEC_REQUIRE_ISOLATION=1` the namespaces must be there.
fn check_isolation_report(iso: &Value) {
    let namespaces = iso["namespaces"].as_array().expect("namespaces");
    if namespaces.is_empty() {
        assert!(
            std::env::var("SANDSPEC_REQUIRE_ISOLATION").as_deref() != Ok("1"),
            "isolation is required but unavailable: {iso}"
        );
        assert_eq!(iso["uid"], Value::Null, "{iso}");
        assert_eq!(iso["privilege"], Value::Null, "{iso}");
        assert_eq!(iso["users"], json!([]), "{iso}");
        assert_eq!(iso["home"], Value::Null, "{iso}");
        assert_eq!(iso["network"], "host", "{iso}");
        assert!(iso["unavailable"].is_string(), "{iso}");
    } else {
        assert_eq!(
            iso["namespaces"],
            json!(["user", "mount", "pid", "ipc", "uts", "network"])
        );
        // Root in the host's user namespace makes them as root, anyone else unprivileged.
        let root = own_euid() == 0
            && std::fs::read_to_string("/proc/self/uid_map").is_ok_and(|m| {
                m.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"]
            });
        assert_eq!(
            iso["privilege"],
            if root { "root" } else { "unprivileged" },
            "{iso}"
        );
        assert_eq!(iso["uid"], 1000, "{iso}");
        assert_eq!(iso["users"], json!(["user", "root"]), "{iso}");
        assert_eq!(iso["home"], "/home/user", "{iso}");
        assert_eq!(iso["network"], "loopback", "{iso}");
        assert_eq!(iso["unavailable"], Value::Null, "{iso}");
    }
    let enforced: Vec<&str> = iso["enforced"]
        .as_array()
        .expect("enforced")
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let by = iso["enforced_by"].as_object().expect("enforced_by");
    let mut named: Vec<&str> = by.keys().map(String::as_str).collect();
    let mut listed = enforced.clone();
    named.sort_unstable();
    listed.sort_unstable();
    assert_eq!(named, listed, "one mechanism per enforced limit: {iso}");
    assert!(
        enforced.contains(&"memory"),
        "memory is always limited: {iso}"
    );
    for (what, how) in by {
        let how = how.as_str().unwrap();
        match how {
            "cgroup_v1" | "cgroup_v2" => {}
            "rlimit_data" => assert_eq!(what, "memory", "{iso}"),
            other => panic!("unknown mechanism {other}: {iso}"),
        }
    }
    let cgroups = by
        .values()
        .any(|v| v.as_str().unwrap().starts_with("cgroup_"));
    assert_eq!(iso["cgroup"].is_null(), !cgroups, "{iso}");
    assert!(
        matches!(iso["cgroup"].as_str(), None | Some("v1" | "v2" | "hybrid")),
        "{iso}"
    );
    assert_eq!(
        enforced.contains(&"pids"),
        iso["pids_max"].is_u64(),
        "{iso}"
    );
}

/// This process's effective uid.
fn own_euid() -> u32 {
    // SAFETY: geteuid(2) has no preconditions.
    unsafe { libc::geteuid() }
}

#[tokio::test]
async fn capabilities_describe_providers_features_limits_and_retention() {
    let app = spawn_app(|c| c.limits.max_streams_per_principal = 3).await;
    let caps = app.get(ALICE, "/v1/capabilities").await.ok(200);
    assert_eq!(caps["api_version"], "v1");
    assert_eq!(caps["server"]["name"], "sandspec-reference");
    // What isolation a provider has depends on the machine; its shape does not.
    let mut providers = caps["providers"].clone();
    let isolation: Vec<Value> = providers
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .map(|p| p.as_object_mut().unwrap().remove("isolation").unwrap())
        .collect();
    assert_eq!(
        providers,
        json!([
            {"name": "local", "default": true, "capacity": {"cpu": 4.0, "memory_mb": 8192}},
            {"name": "local-b", "default": false, "capacity": {"cpu": 2.0, "memory_mb": 2048}},
        ])
    );
    assert_eq!(caps["isolation"], isolation[0], "the default provider's");
    for iso in &isolation {
        check_isolation_report(iso);
    }
    assert_eq!(
        caps["features"],
        json!([
            "pause",
            "snapshots",
            "previews",
            "sessions",
            "fixture_models",
            "test_controls",
            "expiry_hold",
            "test_clock"
        ])
    );
    assert_eq!(caps["limits"]["max_streams_per_principal"], 3);
    for key in [
        "max_body_bytes",
        "heartbeat_interval_s",
        "max_stream_duration_s",
        "max_page_size",
        "max_queue_depth",
    ] {
        assert!(caps["limits"][key].is_u64(), "{key}");
    }
    for key in ["process_output_s", "result_s", "events_s", "idempotency_s"] {
        assert!(caps["retention"][key].is_u64(), "{key}");
    }
    let app = spawn_app(|c| c.test_controls = false).await;
    let caps = app.get(ALICE, "/v1/capabilities").await.ok(200);
    assert_eq!(
        caps["features"],
        json!([
            "pause",
            "snapshots",
            "previews",
            "sessions",
            "fixture_models"
        ])
    );
    // Workers pointed at a real model endpoint make the fixture scripts moot.
    let app = spawn_app(|c| c.gateway.model_base_url = Some("http://127.0.0.1:9/v1".into())).await;
    let caps = app.get(ALICE, "/v1/capabilities").await.ok(200);
    assert!(
        !caps["features"]
            .as_array()
            .unwrap()
            .contains(&json!("fixture_models")),
        "{caps}"
    );
}

#[tokio::test]
async fn authentication_and_scopes() {
    let app = spawn_app(|_| {}).await;
    let missing = app
        .send(app.request(None, Method::GET, "/v1/sandboxes"))
        .await;
    missing.problem(401, "unauthenticated");
    assert_eq!(missing.header("www-authenticate"), Some("Bearer"));
    let malformed = app
        .send(
            app.request(None, Method::GET, "/v1/sandboxes")
                .header("Authorization", "Basic YWxpY2U6eA=="),
        )
        .await;
    malformed.problem(401, "unauthenticated");
    assert_eq!(malformed.header("www-authenticate"), Some("Bearer"));
    let unknown = app.get("no-such-token", "/v1/sandboxes").await;
    unknown.problem(401, "unauthenticated");
    assert_eq!(unknown.header("www-authenticate"), Some("Bearer"));

    // The reader may read but not write; the scope check comes before any lookup.
    app.get(READER, "/v1/sandboxes").await.ok(200);
    let digest = app.digest().await;
    app.post(READER, "/v1/sandboxes", json!({}))
        .await
        .problem(403, "permission_denied");
    app.delete(READER, "/v1/sandboxes/local:sbx_nothing")
        .await
        .problem(403, "permission_denied");
    assert_eq!(app.digest().await, digest);

    // Test controls: a principal's token is 403, no token 401.
    app.get(ALICE, "/v1/test/digest")
        .await
        .problem(403, "permission_denied");
    app.send(app.request(None, Method::GET, "/v1/test/digest"))
        .await
        .problem(401, "unauthenticated");
    let off = spawn_app(|c| c.test_controls = false).await;
    off.get(ADMIN, "/v1/test/digest")
        .await
        .problem(404, "not_found");
}

#[tokio::test]
async fn foreign_and_missing_objects_are_the_same_404() {
    let app = spawn_app(|_| {}).await;
    let sbx = app.create_sandbox(ALICE, json!({})).await;
    let id = sbx["id"].as_str().unwrap();
    let strip = |mut v: Value| {
        v.as_object_mut().unwrap().remove("request_id");
        v
    };
    let foreign = app.get(BOB, &format!("/v1/sandboxes/{id}")).await;
    let missing = app
        .get(BOB, "/v1/sandboxes/local:sbx_01jzzzzzzzzzzzzzzzzzzzzzzz")
        .await;
    let undecodable = app.get(BOB, "/v1/sandboxes/local:sbx_%FF").await;
    undecodable.problem(404, "not_found");
    let malformed = app.get(BOB, "/v1/sandboxes/..%2Fetc").await;
    let f = strip(foreign.problem(404, "not_found"));
    assert_eq!(f, strip(missing.problem(404, "not_found")));
    assert_eq!(f, strip(malformed.problem(404, "not_found")));
    assert_eq!(foreign.body.len(), missing.body.len());
    app.delete(BOB, &format!("/v1/sandboxes/{id}"))
        .await
        .problem(404, "not_found");
    let p = app.start(ALICE, id, &["true"]).await;
    app.get(BOB, &format!("/v1/processes/{}", p["id"].as_str().unwrap()))
        .await
        .problem(404, "not_found");
    app.get(BOB, &format!("/v1/sandboxes/{id}/files?path=x"))
        .await
        .problem(404, "not_found");
    let listed = app.get(BOB, "/v1/sandboxes").await.ok(200);
    assert_eq!(listed["data"], json!([]));
    // Still there for its owner.
    app.get(ALICE, &format!("/v1/sandboxes/{id}")).await.ok(200);
}

#[tokio::test]
async fn create_get_list_kill() {
    let app = spawn_app(|_| {}).await;
    let sbx = app
        .create_sandbox(
            ALICE,
            json!({"resources": {"cpu": 0.3, "memory_mb": 100}, "metadata": {"team": "x"}, "env": {"SECRET": "s3"}, "timeout_s": 600}),
        )
        .await;
    let id = sbx["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("local:sbx_"), "{id}");
    assert_eq!(sbx["provider"], "local");
    assert_eq!(sbx["state"], "running");
    assert_eq!(sbx["template"], "base");
    assert_eq!(sbx["requested"], json!({"cpu": 0.3, "memory_mb": 100}));
    assert!(sbx["resources"]["cpu"].as_f64().unwrap() >= 0.3);
    assert!(sbx["resources"]["memory_mb"].as_u64().unwrap() >= 100);
    assert_eq!(sbx["metadata"], json!({"team": "x"}));
    assert_eq!(
        sbx["owner"],
        json!({"principal": "alice", "session_id": null})
    );
    assert_eq!(sbx["on_timeout"], "kill");
    assert!(sbx.get("env").is_none(), "env is never returned");
    let created = time::OffsetDateTime::parse(
        sbx["created_at"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let expires = time::OffsetDateTime::parse(
        sbx["expires_at"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    assert!((expires - created).whole_seconds() >= 599);
    assert!(app.sandbox_dir(&id).exists());

    assert_eq!(
        app.get(ALICE, &format!("/v1/sandboxes/{id}")).await.ok(200),
        sbx
    );
    let listed = app.get(ALICE, "/v1/sandboxes").await.ok(200);
    assert_eq!(
        listed,
        json!({"data": [sbx.clone()], "has_more": false, "next_page_token": null})
    );
    let filtered = app
        .get(ALICE, "/v1/sandboxes?metadata.team=y")
        .await
        .ok(200);
    assert_eq!(filtered["data"], json!([]));
    let filtered = app
        .get(ALICE, "/v1/sandboxes?metadata.team=x&state=running")
        .await
        .ok(200);
    assert_eq!(filtered["data"].as_array().unwrap().len(), 1);
    app.get(ALICE, "/v1/sandboxes?state=exploded")
        .await
        .problem(400, "invalid_argument");

    // The environment reaches processes.
    let p = app
        .start(ALICE, &id, &["sh", "-c", "printf %s \"$SECRET\""])
        .await;
    let pid = p["id"].as_str().unwrap();
    app.wait_process(ALICE, pid).await;
    let out = app
        .get(ALICE, &format!("/v1/processes/{pid}/output"))
        .await
        .ok(200);
    assert_eq!(out["stdout"], "s3");

    let long = app.start(ALICE, &id, &["sleep", "30"]).await;
    let kill = app.delete(ALICE, &format!("/v1/sandboxes/{id}")).await;
    assert_eq!(kill.status, 204);
    assert!(kill.body.is_empty());
    app.get(ALICE, &format!("/v1/sandboxes/{id}"))
        .await
        .problem(404, "not_found");
    app.get(
        ALICE,
        &format!("/v1/processes/{}", long["id"].as_str().unwrap()),
    )
    .await
    .problem(404, "not_found");
    assert!(
        !app.sandbox_dir(&id).exists(),
        "the sandbox's directory is removed"
    );
    app.delete(ALICE, &format!("/v1/sandboxes/{id}"))
        .await
        .problem(404, "not_found");
}

#[tokio::test]
async fn create_validation_and_rejections_record_nothing() {
    let app = spawn_app(|c| c.limits.max_body_bytes = 2048).await;
    let digest = app.digest().await;
    let bad = |body: Value, param: &'static str| {
        let app = &app;
        async move {
            let p = app
                .post(ALICE, "/v1/sandboxes", body)
                .await
                .problem(400, "invalid_argument");
            assert_eq!(p["param"], param);
        }
    };
    bad(json!({"provider": "nowhere"}), "provider").await;
    bad(json!({"template": "fancy"}), "template").await;
    bad(json!({"resources": {"cpu": 0}}), "resources.cpu").await;
    bad(
        json!({"resources": {"memory_mb": 0}}),
        "resources.memory_mb",
    )
    .await;
    bad(json!({"resources": {"cpu": 1, "gpu": 1}}), "resources.gpu").await;
    bad(json!({"timeout_s": 0}), "timeout_s").await;
    bad(json!({"timeout_s": 999_999_999}), "timeout_s").await;
    bad(json!({"timeout_s": "soon"}), "timeout_s").await;
    bad(json!({"on_timeout": "explode"}), "on_timeout").await;
    bad(json!({"metadata": {"bad key": "v"}}), "metadata").await;
    bad(json!({"surprise": true}), "surprise").await;

    // Bad JSON never echoes the body.
    let r = app
        .send(
            app.request(Some(ALICE), Method::POST, "/v1/sandboxes")
                .header("content-type", "application/json")
                .body("{\"x\": \"hunter2\""),
        )
        .await;
    let p = r.problem(400, "invalid_argument");
    assert!(!String::from_utf8_lossy(&r.body).contains("hunter2"), "{p}");
    let r = app
        .send(
            app.request(Some(ALICE), Method::POST, "/v1/sandboxes")
                .header("content-type", "text/plain")
                .body("{}"),
        )
        .await;
    r.problem(415, "unsupported_media_type");
    let big = json!({"metadata": {"k": "v".repeat(4000)}});
    app.post(ALICE, "/v1/sandboxes", big)
        .await
        .problem(413, "payload_too_large");
    app.send(app.request(Some(ALICE), Method::PATCH, "/v1/sandboxes"))
        .await
        .problem(405, "method_not_allowed");
    app.get(ALICE, "/v1/nothing-here")
        .await
        .problem(404, "not_found");
    app.get(ALICE, "/v1/sandboxes?limit=0")
        .await
        .problem(400, "invalid_argument");
    assert_eq!(
        app.digest().await,
        digest,
        "rejected requests changed durable state"
    );
}

#[tokio::test]
async fn idempotent_creates_replay_refuse_reuse_and_in_flight() {
    let app = spawn_app(|_| {}).await;
    let body = json!({"metadata": {"n": "1"}});
    let first = app
        .post_idem(ALICE, "/v1/sandboxes", "key-1", body.clone())
        .await;
    let sbx = first.ok(201);
    assert!(first.header("idempotent-replayed").is_none());
    let again = app
        .post_idem(ALICE, "/v1/sandboxes", "key-1", body.clone())
        .await;
    assert_eq!(again.ok(201)["id"], sbx["id"]);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    app.post_idem(
        ALICE,
        "/v1/sandboxes",
        "key-1",
        json!({"metadata": {"n": "2"}}),
    )
    .await
    .problem(422, "idempotency_key_reused");
    // The same key of another principal is another key.
    let bobs = app
        .post_idem(BOB, "/v1/sandboxes", "key-1", body.clone())
        .await
        .ok(201);
    assert_ne!(bobs["id"], sbx["id"]);
    let listed = app.get(ALICE, "/v1/sandboxes").await.ok(200);
    assert_eq!(listed["data"].as_array().unwrap().len(), 1);

    // The replay shows the current state.
    let id = sbx["id"].as_str().unwrap();
    app.post(ALICE, &format!("/v1/sandboxes/{id}/pause"), json!({}))
        .await
        .ok(200);
    let replay = app
        .post_idem(ALICE, "/v1/sandboxes", "key-1", body.clone())
        .await
        .ok(201);
    assert_eq!(replay["state"], "paused");

    // A failed validation records nothing: the key is still free.
    app.post_idem(ALICE, "/v1/sandboxes", "key-2", json!({"timeout_s": 0}))
        .await
        .problem(400, "invalid_argument");
    app.post_idem(
        ALICE,
        "/v1/sandboxes",
        "key-2",
        json!({"metadata": {"n": "3"}}),
    )
    .await
    .ok(201);

    // In flight.
    app.post(
        ADMIN,
        "/v1/test/providers/local/create_delay",
        json!({"delay_ms": 1500}),
    )
    .await
    .ok(204);
    let slow = {
        let client = app.client.clone();
        let url = app.url("/v1/sandboxes");
        tokio::spawn(async move {
            client
                .post(url)
                .bearer_auth(ALICE)
                .header("Idempotency-Key", "key-3")
                .json(&json!({}))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    app.post_idem(ALICE, "/v1/sandboxes", "key-3", json!({}))
        .await
        .problem(409, "idempotency_key_in_use");
    assert_eq!(slow.await.unwrap(), 201);
    app.post(
        ADMIN,
        "/v1/test/providers/local/create_delay",
        json!({"delay_ms": 0}),
    )
    .await
    .ok(204);
    let replayed = app
        .post_idem(ALICE, "/v1/sandboxes", "key-3", json!({}))
        .await;
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
}

#[tokio::test]
async fn pagination_tokens_are_bound_to_principal_and_filters() {
    let app = spawn_app(|_| {}).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(
            app.create_sandbox(ALICE, json!({"metadata": {"g": "a", "i": i.to_string()}}))
                .await["id"]
                .clone(),
        );
    }
    app.create_sandbox(BOB, json!({"metadata": {"g": "a"}}))
        .await;
    let mut seen = Vec::new();
    let mut path = "/v1/sandboxes?limit=2&metadata.g=a".to_owned();
    let mut first_token = None;
    loop {
        let page = app.get(ALICE, &path).await.ok(200);
        seen.extend(
            page["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["id"].clone()),
        );
        match page["next_page_token"].as_str() {
            Some(token) => {
                assert_eq!(page["has_more"], true);
                first_token.get_or_insert(token.to_owned());
                path = format!("/v1/sandboxes?limit=2&metadata.g=a&page_token={token}");
            }
            None => {
                assert_eq!(page["has_more"], false);
                break;
            }
        }
    }
    assert_eq!(seen, ids);
    let token = first_token.unwrap();
    app.get(
        BOB,
        &format!("/v1/sandboxes?limit=2&metadata.g=a&page_token={token}"),
    )
    .await
    .problem(400, "invalid_page_token");
    app.get(
        ALICE,
        &format!("/v1/sandboxes?limit=2&metadata.g=b&page_token={token}"),
    )
    .await
    .problem(400, "invalid_page_token");
    app.get(ALICE, &format!("/v1/sandboxes?limit=2&page_token={token}"))
        .await
        .problem(400, "invalid_page_token");
    app.get(ALICE, "/v1/sandboxes?page_token=garbage")
        .await
        .problem(400, "invalid_page_token");
    // The limit is not a filter.
    app.get(
        ALICE,
        &format!("/v1/sandboxes?limit=3&metadata.g=a&page_token={token}"),
    )
    .await
    .ok(200);
    app.get(ALICE, "/v1/sandboxes?limit=101")
        .await
        .problem(400, "invalid_argument");
}

#[tokio::test]
async fn bare_ids_resolve_in_the_default_provider_only() {
    let app = spawn_app(|_| {}).await;
    let local = "sbx_01jsameidsameidsameidsame";
    for provider in ["local", "local-b"] {
        app.post(
            ADMIN,
            &format!("/v1/test/providers/{provider}/next_local_id"),
            json!({"kind": "sandbox", "local_id": local}),
        )
        .await
        .ok(204);
    }
    let a = app
        .create_sandbox(ALICE, json!({"metadata": {"p": "a"}}))
        .await;
    let b = app
        .create_sandbox(
            ALICE,
            json!({"provider": "local-b", "metadata": {"p": "b"}}),
        )
        .await;
    assert_eq!(a["id"], format!("local:{local}"));
    assert_eq!(b["id"], format!("local-b:{local}"));
    assert_eq!(
        app.get(ALICE, &format!("/v1/sandboxes/{local}"))
            .await
            .ok(200)["metadata"]["p"],
        "a"
    );
    assert_eq!(
        app.get(ALICE, &format!("/v1/sandboxes/local-b:{local}"))
            .await
            .ok(200)["metadata"]["p"],
        "b"
    );
    // Killing the qualified local-b sandbox leaves the local one alone.
    assert_eq!(
        app.delete(ALICE, &format!("/v1/sandboxes/local-b:{local}"))
            .await
            .status,
        204
    );
    app.get(ALICE, &format!("/v1/sandboxes/local:{local}"))
        .await
        .ok(200);
    app.get(ALICE, &format!("/v1/sandboxes/local-b:{local}"))
        .await
        .problem(404, "not_found");
    // A bare ID whose sandbox lives only in local-b is not found.
    let only_b = app
        .create_sandbox(ALICE, json!({"provider": "local-b"}))
        .await;
    let bare = only_b["id"]
        .as_str()
        .unwrap()
        .split_once(':')
        .unwrap()
        .1
        .to_owned();
    app.get(ALICE, &format!("/v1/sandboxes/{bare}"))
        .await
        .problem(404, "not_found");
    app.get(ALICE, &format!("/v1/sandboxes/elsewhere:{bare}"))
        .await
        .problem(404, "not_found");
}

#[tokio::test]
async fn unsatisfiable_and_quota_leave_nothing_behind() {
    let app = spawn_app(|c| c.limits.max_sandboxes_per_principal = 2).await;
    let digest = app.digest().await;
    let r = app
        .post(
            ALICE,
            "/v1/sandboxes",
            json!({"provider": "local-b", "resources": {"cpu": 4}}),
        )
        .await;
    r.problem(422, "resources_unsatisfiable");
    app.post(
        ALICE,
        "/v1/sandboxes",
        json!({"resources": {"memory_mb": 100_000}}),
    )
    .await
    .problem(422, "resources_unsatisfiable");
    assert_eq!(
        app.get(ALICE, "/v1/sandboxes").await.ok(200)["data"],
        json!([])
    );
    assert_eq!(app.digest().await, digest);
    let sandboxes = std::fs::read_dir(app.data_dir.join("providers/local-b/sandboxes"))
        .unwrap()
        .count();
    assert_eq!(sandboxes, 0);

    app.create_sandbox(ALICE, json!({})).await;
    app.create_sandbox(ALICE, json!({})).await;
    let digest = app.digest().await;
    app.post(ALICE, "/v1/sandboxes", json!({}))
        .await
        .problem(429, "quota_exceeded");
    assert_eq!(app.digest().await, digest);
    app.create_sandbox(BOB, json!({})).await;
}

#[tokio::test]
async fn connections_close_without_ending_the_sandbox() {
    let app = spawn_app(|_| {}).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let conn = app
        .post(ALICE, &format!("/v1/sandboxes/{id}/connections"), json!({}))
        .await
        .ok(201);
    let cid = conn["id"].as_str().unwrap();
    assert!(cid.starts_with("conn_"));
    assert_eq!(conn["sandbox_id"], id.as_str());
    app.post(BOB, &format!("/v1/sandboxes/{id}/connections"), json!({}))
        .await
        .problem(404, "not_found");
    let listed = app
        .get(ALICE, &format!("/v1/sandboxes/{id}/connections"))
        .await
        .ok(200);
    assert_eq!(listed["data"][0]["id"], cid);
    assert_eq!(
        app.delete(ALICE, &format!("/v1/sandboxes/{id}/connections/{cid}"))
            .await
            .status,
        204
    );
    assert_eq!(
        app.get(ALICE, &format!("/v1/sandboxes/{id}")).await.ok(200)["state"],
        "running"
    );
    assert!(app.sandbox_dir(&id).exists());
    app.delete(ALICE, &format!("/v1/sandboxes/{id}/connections/{cid}"))
        .await
        .problem(404, "not_found");
    app.post(ALICE, &format!("/v1/sandboxes/{id}/pause"), json!({}))
        .await
        .ok(200);
    app.post(ALICE, &format!("/v1/sandboxes/{id}/connections"), json!({}))
        .await
        .problem(409, "invalid_state");
}

#[tokio::test]
async fn pause_resume_and_timeout() {
    let app = spawn_app(|_| {}).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let empty_json = app
        .request(
            Some(ALICE),
            Method::POST,
            &format!("/v1/sandboxes/{id}/pause"),
        )
        .header("content-type", "application/json");
    assert_eq!(app.send(empty_json).await.ok(200)["state"], "paused");
    app.post(ALICE, &format!("/v1/sandboxes/{id}/resume"), json!({}))
        .await
        .ok(200);
    app.post(ALICE, &format!("/v1/sandboxes/{id}/resume"), json!({}))
        .await
        .problem(409, "invalid_state");
    let paused = app
        .send(app.request(
            Some(ALICE),
            Method::POST,
            &format!("/v1/sandboxes/{id}/pause"),
        ))
        .await
        .ok(200);
    assert_eq!(paused["state"], "paused");
    app.post(ALICE, &format!("/v1/sandboxes/{id}/pause"), json!({}))
        .await
        .problem(409, "invalid_state");
    app.post(
        ALICE,
        &format!("/v1/sandboxes/{id}/processes"),
        json!({"cmd": ["true"]}),
    )
    .await
    .problem(409, "invalid_state");
    let listed = app.get(ALICE, "/v1/sandboxes?state=paused").await.ok(200);
    assert_eq!(listed["data"].as_array().unwrap().len(), 1);
    assert_eq!(
        app.post(ALICE, &format!("/v1/sandboxes/{id}/resume"), json!({}))
            .await
            .ok(200)["state"],
        "running"
    );
    let before = app.get(ALICE, &format!("/v1/sandboxes/{id}")).await.ok(200)["expires_at"].clone();
    let after = app
        .post(
            ALICE,
            &format!("/v1/sandboxes/{id}/timeout"),
            json!({"timeout_s": 7200}),
        )
        .await
        .ok(200);
    assert!(after["expires_at"].as_str().unwrap() > before.as_str().unwrap());
    app.post(
        ALICE,
        &format!("/v1/sandboxes/{id}/timeout"),
        json!({"timeout_s": 0}),
    )
    .await
    .problem(400, "invalid_argument");
    app.post(ALICE, &format!("/v1/sandboxes/{id}/pause"), json!({"x": 1}))
        .await
        .problem(400, "invalid_argument");
}

#[tokio::test]
async fn processes_output_stdin_signal_and_listing() {
    let app = spawn_app(|_| {}).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let p = app
        .post(
            ALICE,
            &format!("/v1/sandboxes/{id}/processes"),
            json!({"cmd": ["sh", "-c", "echo out; echo err >&2; exit 3"], "tag": "t1"}),
        )
        .await
        .ok(201);
    let pid = p["id"].as_str().unwrap().to_owned();
    assert!(pid.starts_with("local:prc_"));
    assert_eq!(p["sandbox_id"], id.as_str());
    assert_eq!(p["tag"], "t1");
    let done = app.wait_process(ALICE, &pid).await;
    assert_eq!(done["state"], "exited");
    assert_eq!(done["exit_code"], 3);
    assert_eq!(done["signal"], Value::Null);
    assert!(done["ended_at"].is_string());
    let out = app
        .get(ALICE, &format!("/v1/processes/{pid}/output"))
        .await
        .ok(200);
    assert_eq!(out["stdout"], "out\n");
    assert_eq!(out["stderr"], "err\n");
    assert_eq!(out["complete"], true);
    assert_eq!(out["truncated"], false);
    let next = out["next_offset"].as_i64().unwrap();
    let rest = app
        .get(ALICE, &format!("/v1/processes/{pid}/output?after={next}"))
        .await
        .ok(200);
    assert_eq!(
        rest,
        json!({"stdout": "", "stderr": "", "next_offset": next, "complete": true, "truncated": false})
    );
    app.post(
        ALICE,
        &format!("/v1/processes/{pid}/signal"),
        json!({"signal": "TERM"}),
    )
    .await
    .problem(409, "process_exited");
    app.post(
        ALICE,
        &format!("/v1/processes/{pid}/stdin"),
        json!({"data": "x"}),
    )
    .await
    .problem(409, "process_exited");

    // stdin and signals.
    let cat = app
        .post(
            ALICE,
            &format!("/v1/sandboxes/{id}/processes"),
            json!({"cmd": ["cat"], "stdin": true}),
        )
        .await
        .ok(201);
    let cat_id = cat["id"].as_str().unwrap();
    app.post(
        ALICE,
        &format!("/v1/processes/{cat_id}/stdin"),
        json!({"data": "hello\n", "eof": true}),
    )
    .await
    .ok(204);
    app.wait_process(ALICE, cat_id).await;
    assert_eq!(
        app.get(ALICE, &format!("/v1/processes/{cat_id}/output"))
            .await
            .ok(200)["stdout"],
        "hello\n"
    );
    let sleeper = app.start(ALICE, &id, &["sleep", "30"]).await;
    let sid = sleeper["id"].as_str().unwrap();
    app.post(
        ALICE,
        &format!("/v1/processes/{sid}/stdin"),
        json!({"data": "x"}),
    )
    .await
    .problem(409, "invalid_state");
    app.post(
        ALICE,
        &format!("/v1/processes/{sid}/signal"),
        json!({"signal": "HUP"}),
    )
    .await
    .problem(400, "invalid_argument");
    app.post(
        ALICE,
        &format!("/v1/processes/{sid}/signal"),
        json!({"signal": "KILL"}),
    )
    .await
    .ok(204);
    let killed = app.wait_process(ALICE, sid).await;
    assert_eq!(killed["state"], "killed");
    assert_eq!(killed["signal"], "KILL");
    assert_eq!(killed["exit_code"], Value::Null);

    let timed = app
        .post(
            ALICE,
            &format!("/v1/sandboxes/{id}/processes"),
            json!({"cmd": ["sleep", "30"], "timeout_ms": 200}),
        )
        .await
        .ok(201);
    let timed = app.wait_process(ALICE, timed["id"].as_str().unwrap()).await;
    assert_eq!(timed["signal"], "KILL");

    app.post(
        ALICE,
        &format!("/v1/sandboxes/{id}/processes"),
        json!({"cmd": []}),
    )
    .await
    .problem(400, "invalid_argument");
    let page = app
        .get(ALICE, &format!("/v1/sandboxes/{id}/processes?limit=2"))
        .await
        .ok(200);
    assert_eq!(page["data"][0]["id"], pid.as_str());
    assert_eq!(page["has_more"], true);
    let all = app
        .get(ALICE, &format!("/v1/sandboxes/{id}/processes"))
        .await
        .ok(200);
    assert_eq!(all["data"].as_array().unwrap().len(), 4);
}

/// Host PIDs of the running processes whose command line holds `marker`.
fn host_processes_with(marker: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let found = cmdline
                .windows(marker.len())
                .any(|w| w == marker.as_bytes());
            (found && !stat.contains(") Z ")).then_some(pid)
        })
        .collect()
}

/// A signal goes to the sandboxed process itself: one that traps TERM lives on and is
/// recorded running, and the KILL that then ends it is what the record says ended it.
#[tokio::test]
async fn a_process_that_traps_term_runs_on_until_kill() {
    let app = spawn_app(|_| {}).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    // Found on the host by its command line (a PID it could report is one of its sandbox's
    // PID namespace).
    let marker = format!("trap-term-{}", std::process::id());
    let script =
        format!("trap 'echo got TERM' TERM; echo ready; while :; do sleep 0.1; done # {marker}");
    let p = app.start(ALICE, &id, &["sh", "-c", &script]).await;
    let pid = p["id"].as_str().unwrap().to_owned();
    let stdout = |want: &'static str| {
        let (app, pid) = (&app, &pid);
        poll(move || async move {
            let out = app
                .get(ALICE, &format!("/v1/processes/{pid}/output"))
                .await
                .ok(200);
            out["stdout"].as_str().unwrap().contains(want).then_some(())
        })
    };
    stdout("ready").await;
    // The shell, not a child it forked for `sleep` that has not exec'd yet.
    let found = host_processes_with(&marker);
    let shell: Vec<u32> = found
        .iter()
        .copied()
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            ppid.is_some_and(|ppid| !found.contains(&ppid))
        })
        .collect();
    assert_eq!(shell.len(), 1, "the shell on the host: {found:?}");

    let signal = |sig: &'static str| {
        let (app, pid) = (&app, &pid);
        async move {
            app.post(
                ALICE,
                &format!("/v1/processes/{pid}/signal"),
                json!({"signal": sig}),
            )
            .await
            .ok(204);
        }
    };
    signal("TERM").await;
    stdout("got TERM").await;
    let record = app
        .get(ALICE, &format!("/v1/processes/{pid}"))
        .await
        .ok(200);
    assert_eq!(record["state"], "running", "{record}");
    assert!(
        host_processes_with(&marker).contains(&shell[0]),
        "the shell runs on"
    );

    signal("KILL").await;
    let done = app.wait_process(ALICE, &pid).await;
    assert_eq!(done["state"], "killed");
    assert_eq!(done["signal"], "KILL", "the trapped TERM ended nothing");
    assert_eq!(done["exit_code"], Value::Null);
    // Bounded: the kernel reaps what the kill ended asynchronously.
    poll(|| async { host_processes_with(&marker).is_empty().then_some(()) }).await;
}

fn sse_headers() -> Vec<(&'static str, &'static str)> {
    vec![("Accept", "text/event-stream")]
}

#[tokio::test]
async fn process_events_stream_resume_and_finish() {
    let app = spawn_app(|_| {}).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let p = app
        .start(
            ALICE,
            &id,
            &[
                "sh",
                "-c",
                "for i in 1 2 3 4; do echo line$i; sleep 0.1; done",
            ],
        )
        .await;
    let pid = p["id"].as_str().unwrap().to_owned();
    let path = format!("/v1/processes/{pid}/events");

    let mut sse = RawSse::open(&app, &path, ALICE, &sse_headers()).await;
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
    assert!(sse.header("content-encoding").is_none());
    let events = sse.events_until_end(Duration::from_secs(10)).await;
    let seqs: Vec<i64> = events
        .iter()
        .map(|e| e.field("id").unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as i64).collect::<Vec<_>>(),
        "gap-free ids"
    );
    for e in &events {
        assert_eq!(e.data()["seq"].to_string(), e.field("id").unwrap());
        assert_eq!(e.lines.iter().filter(|l| l.starts_with("data:")).count(), 1);
    }
    let last = events.last().unwrap();
    assert_eq!(last.field("event"), Some("exit"));
    assert_eq!(last.data()["state"], "exited");
    let text: String = events
        .iter()
        .filter(|e| e.field("event") == Some("stdout"))
        .map(|e| e.data()["data"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, "line1\nline2\nline3\nline4\n");

    // Resume with Last-Event-ID and with ?after=: no gap, no duplicate.
    let mut resumed = RawSse::open(
        &app,
        &path,
        ALICE,
        &[("Accept", "text/event-stream"), ("Last-Event-ID", "2")],
    )
    .await;
    let rest = resumed.events_until_end(Duration::from_secs(5)).await;
    assert_eq!(rest, events[2..].to_vec());
    let mut resumed = RawSse::open(&app, &format!("{path}?after=1"), ALICE, &sse_headers()).await;
    assert_eq!(
        resumed.events_until_end(Duration::from_secs(5)).await,
        events[1..].to_vec()
    );

    // Finished with nothing after the cursor: 204.
    let last_id = last.field("id").unwrap();
    let done = RawSse::open(
        &app,
        &path,
        ALICE,
        &[("Accept", "text/event-stream"), ("Last-Event-ID", last_id)],
    )
    .await;
    assert_eq!(done.status, 204);
    let r = app
        .send(
            app.request(Some(ALICE), Method::GET, &path)
                .header("Accept", "application/json"),
        )
        .await;
    r.problem(406, "not_acceptable");
    let r = app
        .send(
            app.request(Some(ALICE), Method::GET, &path)
                .header("Accept", "text/event-stream")
                .header("Last-Event-ID", "x"),
        )
        .await;
    r.problem(400, "invalid_argument");
}

#[tokio::test]
async fn stream_quota_heartbeat_and_max_duration() {
    let app = spawn_app(|c| {
        c.limits.max_streams_per_principal = 1;
        c.limits.heartbeat_interval_s = 1;
        c.limits.max_stream_duration_s = 2;
    })
    .await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let p = app
        .start(ALICE, &id, &["sh", "-c", "echo start; sleep 30"])
        .await;
    let path = format!("/v1/processes/{}/events", p["id"].as_str().unwrap());
    let started = tokio::time::Instant::now();
    let mut sse = RawSse::open(&app, &path, ALICE, &sse_headers()).await;
    assert_eq!(sse.status, 200);
    let second = app
        .send(
            app.request(Some(ALICE), Method::GET, &path)
                .header("Accept", "text/event-stream"),
        )
        .await;
    second.problem(429, "too_many_streams");
    assert!(second.header("retry-after").is_some());

    // An idle stream opens with a heartbeat; the first event follows.
    let mut first = sse.next(Duration::from_secs(5)).await.unwrap();
    while first.is_comment() {
        first = sse.next(Duration::from_secs(5)).await.unwrap();
    }
    assert_eq!(first.field("event"), Some("stdout"));
    let ping = sse.next(Duration::from_secs(3)).await.unwrap();
    assert_eq!(ping.lines, vec![": ping".to_owned()]);
    let mut end = sse.next(Duration::from_secs(3)).await.unwrap();
    while end.is_comment() {
        end = sse.next(Duration::from_secs(3)).await.unwrap();
    }
    assert_eq!(end.field("event"), Some("stream.end"));
    assert!(end.field("id").is_none());
    assert_eq!(
        end.data(),
        json!({"reason": "max_duration", "resume_after": 1})
    );
    assert!(
        sse.next(Duration::from_secs(2)).await.is_none(),
        "clean EOF after stream.end"
    );
    assert!(started.elapsed() >= Duration::from_secs(2));

    // The slot is free again once a client goes away.
    let held = RawSse::open(
        &app,
        &path,
        ALICE,
        &[("Accept", "text/event-stream"), ("Last-Event-ID", "1")],
    )
    .await;
    assert_eq!(held.status, 200);
    app.send(
        app.request(Some(ALICE), Method::GET, &path)
            .header("Accept", "text/event-stream"),
    )
    .await
    .problem(429, "too_many_streams");
    drop(held);
    let reopened = poll(|| async {
        let r = RawSse::open(&app, &path, ALICE, &sse_headers()).await;
        (r.status == 200).then_some(r)
    })
    .await;
    drop(reopened);
}

#[tokio::test]
async fn output_expires_after_retention() {
    let app = spawn_app(|c| c.retention.process_output_s = 1).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let p = app.start(ALICE, &id, &["echo", "bye"]).await;
    let pid = p["id"].as_str().unwrap().to_owned();
    app.wait_process(ALICE, &pid).await;
    assert_eq!(
        app.get(ALICE, &format!("/v1/processes/{pid}/output"))
            .await
            .ok(200)["stdout"],
        "bye\n"
    );
    poll(|| async {
        (app.get(ALICE, &format!("/v1/processes/{pid}/output"))
            .await
            .status
            == 410)
            .then_some(())
    })
    .await;
    app.get(ALICE, &format!("/v1/processes/{pid}/output"))
        .await
        .problem(410, "output_expired");
    let r = app
        .send(
            app.request(
                Some(ALICE),
                Method::GET,
                &format!("/v1/processes/{pid}/events"),
            )
            .header("Accept", "text/event-stream"),
        )
        .await;
    r.problem(410, "output_expired");
    assert_eq!(
        app.get(ALICE, &format!("/v1/processes/{pid}"))
            .await
            .ok(200)["state"],
        "exited"
    );
}

#[tokio::test]
async fn files_round_trip_and_stay_inside_the_root() {
    let app = spawn_app(|c| c.limits.max_file_bytes = 1024).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let bytes: Vec<u8> = (0..=255u8).collect();
    let path = format!("/v1/sandboxes/{id}/files?path=dir/sub/blob.bin");
    let put = app
        .send(
            app.request(Some(ALICE), Method::PUT, &path)
                .body(bytes.clone()),
        )
        .await
        .ok(201);
    assert_eq!(put["path"], "dir/sub/blob.bin");
    assert_eq!(put["size"], 256);
    assert_eq!(put["sha256"].as_str().unwrap().len(), 64);
    app.send(
        app.request(Some(ALICE), Method::PUT, &path)
            .body(bytes.clone()),
    )
    .await
    .ok(200);
    let got = app.get(ALICE, &path).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.body.to_vec(), bytes);
    let list = app
        .get(
            ALICE,
            &format!("/v1/sandboxes/{id}/files/list?path=dir/sub"),
        )
        .await
        .ok(200);
    assert_eq!(
        list,
        json!({"entries": [{"name": "blob.bin", "kind": "file", "size": 256}]})
    );
    let root = app
        .get(ALICE, &format!("/v1/sandboxes/{id}/files/list"))
        .await
        .ok(200);
    assert_eq!(root["entries"][0]["name"], "dir");

    let digest = app.digest().await;
    for bad in ["../escape.txt", "/etc/passwd", "dir/../../x"] {
        let r = app
            .send(
                app.request(
                    Some(ALICE),
                    Method::PUT,
                    &format!("/v1/sandboxes/{id}/files?path={bad}"),
                )
                .body("x"),
            )
            .await;
        r.problem(400, "invalid_path");
        app.get(ALICE, &format!("/v1/sandboxes/{id}/files?path={bad}"))
            .await
            .problem(400, "invalid_path");
    }
    app.send(
        app.request(
            Some(ALICE),
            Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path="),
        )
        .body("x"),
    )
    .await
    .problem(400, "invalid_path");
    app.send(
        app.request(
            Some(ALICE),
            Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path=big"),
        )
        .body(vec![0u8; 2048]),
    )
    .await
    .problem(413, "payload_too_large");
    assert_eq!(app.digest().await, digest);
    // A symlink pointing out of the root is refused.
    let link = app.start(ALICE, &id, &["ln", "-s", "/etc", "out"]).await;
    app.wait_process(ALICE, link["id"].as_str().unwrap()).await;
    app.get(
        ALICE,
        &format!("/v1/sandboxes/{id}/files?path=out/hostname"),
    )
    .await
    .problem(400, "invalid_path");

    app.get(ALICE, &format!("/v1/sandboxes/{id}/files?path=nope.txt"))
        .await
        .problem(404, "path_not_found");
    assert_eq!(
        app.delete(ALICE, &format!("/v1/sandboxes/{id}/files?path=dir"))
            .await
            .status,
        204
    );
    app.get(ALICE, &path).await.problem(404, "path_not_found");
}

#[tokio::test]
async fn snapshots_and_clones() {
    let app = spawn_app(|_| {}).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    app.send(
        app.request(
            Some(ALICE),
            Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path=a.txt"),
        )
        .body("one"),
    )
    .await
    .ok(201);
    let snap = app
        .post(ALICE, &format!("/v1/sandboxes/{id}/snapshots"), json!({}))
        .await
        .ok(201);
    let sid = snap["id"].as_str().unwrap().to_owned();
    assert!(sid.starts_with("local:snp_"));
    assert_eq!(snap["sandbox_id"], id.as_str());
    assert_eq!(
        app.get(ALICE, &format!("/v1/snapshots/{sid}"))
            .await
            .ok(200),
        snap
    );
    app.get(BOB, &format!("/v1/snapshots/{sid}"))
        .await
        .problem(404, "not_found");
    assert_eq!(
        app.get(ALICE, "/v1/snapshots").await.ok(200)["data"],
        json!([snap.clone()])
    );
    let clone = app
        .create_sandbox(ALICE, json!({"from_snapshot": sid}))
        .await;
    let cid = clone["id"].as_str().unwrap();
    assert_eq!(
        &app.get(ALICE, &format!("/v1/sandboxes/{cid}/files?path=a.txt"))
            .await
            .body[..],
        b"one"
    );
    app.send(
        app.request(
            Some(ALICE),
            Method::PUT,
            &format!("/v1/sandboxes/{cid}/files?path=a.txt"),
        )
        .body("two"),
    )
    .await
    .ok(200);
    assert_eq!(
        &app.get(ALICE, &format!("/v1/sandboxes/{id}/files?path=a.txt"))
            .await
            .body[..],
        b"one"
    );
    let p = app
        .post(
            ALICE,
            "/v1/sandboxes",
            json!({"provider": "local-b", "from_snapshot": sid}),
        )
        .await;
    p.problem(400, "invalid_argument");
    // Snapshots outlive their sandbox.
    assert_eq!(
        app.delete(ALICE, &format!("/v1/sandboxes/{id}"))
            .await
            .status,
        204
    );
    app.get(ALICE, &format!("/v1/snapshots/{sid}"))
        .await
        .ok(200);
    assert_eq!(
        app.delete(ALICE, &format!("/v1/snapshots/{sid}"))
            .await
            .status,
        204
    );
    app.get(ALICE, &format!("/v1/snapshots/{sid}"))
        .await
        .problem(404, "not_found");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn previews_check_tokens_and_proxy() {
    let app = spawn_app(|_| {}).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let port = free_port();
    let preview = app
        .post(
            ALICE,
            &format!("/v1/sandboxes/{id}/previews"),
            json!({"port": port}),
        )
        .await
        .ok(201);
    let url = preview["url"].as_str().unwrap().to_owned();
    assert!(
        url.starts_with(&format!("{}/previews/prv_", app.base)),
        "{url}"
    );
    assert_eq!(preview["port"], port);
    let bare = url.split('?').next().unwrap().to_owned();

    app.send(app.client.get(&bare))
        .await
        .problem(403, "permission_denied");
    app.send(app.client.get(format!("{bare}?preview_token=wrong")))
        .await
        .problem(403, "permission_denied");
    app.send(app.client.get(&url))
        .await
        .problem(502, "upstream_unavailable");

    app.send(
        app.request(
            Some(ALICE),
            Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path=hello.txt"),
        )
        .body("from the sandbox"),
    )
    .await
    .ok(201);
    let port_s = port.to_string();
    app.start(
        ALICE,
        &id,
        &[
            "python3",
            "-m",
            "http.server",
            &port_s,
            "--bind",
            "127.0.0.1",
        ],
    )
    .await;
    let page = poll(|| async {
        let r = app
            .send(app.client.get(format!(
                "{bare}hello.txt?preview_token={}",
                url.split("preview_token=").nth(1).unwrap()
            )))
            .await;
        (r.status == 200).then_some(r)
    })
    .await;
    assert_eq!(&page.body[..], b"from the sandbox");
    let token = url.split("preview_token=").nth(1).unwrap();
    let by_header = app
        .send(
            app.client
                .get(format!("{bare}hello.txt"))
                .header("X-Preview-Token", token),
        )
        .await;
    assert_eq!(&by_header.body[..], b"from the sandbox");
    app.post(
        ALICE,
        &format!("/v1/sandboxes/{id}/previews"),
        json!({"port": 0}),
    )
    .await
    .problem(400, "invalid_argument");
    app.post(
        BOB,
        &format!("/v1/sandboxes/{id}/previews"),
        json!({"port": port}),
    )
    .await
    .problem(404, "not_found");
}

#[tokio::test]
async fn expired_sandboxes_are_killed_or_paused() {
    let app = spawn_app(|_| {}).await;
    let kill = app.create_sandbox(ALICE, json!({"timeout_s": 1})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let pause = app
        .create_sandbox(ALICE, json!({"timeout_s": 1, "on_timeout": "pause"}))
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    poll(|| async {
        (app.get(ALICE, &format!("/v1/sandboxes/{kill}"))
            .await
            .status
            == 404)
            .then_some(())
    })
    .await;
    assert!(!app.sandbox_dir(&kill).exists());
    let paused = poll(|| async {
        let s = app
            .get(ALICE, &format!("/v1/sandboxes/{pause}"))
            .await
            .ok(200);
        (s["state"] == "paused").then_some(s)
    })
    .await;
    assert_eq!(paused["on_timeout"], "pause");
    let resumed = app
        .post(ALICE, &format!("/v1/sandboxes/{pause}/resume"), json!({}))
        .await
        .ok(200);
    assert_eq!(resumed["state"], "running");
}

#[tokio::test]
async fn serves_https_with_a_certificate_from_files() {
    let dir = tempfile::tempdir().unwrap();
    let (tls, root) = self_signed_tls(dir.path());
    let app = spawn_app_with_client(
        move |c| c.tls = Some(tls),
        reqwest::Client::builder().add_root_certificate(root),
    )
    .await;
    assert!(app.base.starts_with("https://"));
    let reply = app.send(app.request(None, Method::GET, "/v1/health")).await;
    assert_eq!(reply.ok(200), json!({"status": "ok"}));
    let sbx = app.create_sandbox(ALICE, json!({})).await;
    let id = sbx["id"].as_str().unwrap();
    let preview = app
        .post(
            ALICE,
            &format!("/v1/sandboxes/{id}/previews"),
            json!({"port": 9}),
        )
        .await
        .ok(201);
    assert!(preview["url"].as_str().unwrap().starts_with("https://"));
}

/// One test per deliberate defect of the API layer: each changes observable behaviour.
#[cfg(feature = "defects")]
mod defects {
    use super::*;
    use reference_server::defects::Defects;

    async fn with(defect: &str) -> TestApp {
        let defects = Defects::parse([defect]).unwrap();
        spawn_app(move |c| c.defects = defects).await
    }

    #[tokio::test]
    async fn borrower_close_kills_owner() {
        let app = with("borrower-close-kills-owner").await;
        let id = app.create_sandbox(ALICE, json!({})).await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let conn = app
            .post(ALICE, &format!("/v1/sandboxes/{id}/connections"), json!({}))
            .await
            .ok(201);
        app.delete(
            ALICE,
            &format!(
                "/v1/sandboxes/{id}/connections/{}",
                conn["id"].as_str().unwrap()
            ),
        )
        .await
        .ok(204);
        app.get(ALICE, &format!("/v1/sandboxes/{id}"))
            .await
            .problem(404, "not_found");
    }

    #[tokio::test]
    async fn bare_id_any_provider() {
        let app = with("bare-id-any-provider").await;
        let b = app
            .create_sandbox(ALICE, json!({"provider": "local-b"}))
            .await;
        let bare = b["id"]
            .as_str()
            .unwrap()
            .split_once(':')
            .unwrap()
            .1
            .to_owned();
        assert_eq!(
            app.get(ALICE, &format!("/v1/sandboxes/{bare}"))
                .await
                .ok(200)["id"],
            b["id"]
        );
    }

    #[tokio::test]
    async fn kill_ignores_provider() {
        let app = with("kill-ignores-provider").await;
        let local = "sbx_01jkillkillkillkillkillkil";
        for provider in ["local", "local-b"] {
            app.post(
                ADMIN,
                &format!("/v1/test/providers/{provider}/next_local_id"),
                json!({"kind": "sandbox", "local_id": local}),
            )
            .await
            .ok(204);
        }
        app.create_sandbox(ALICE, json!({})).await;
        app.create_sandbox(ALICE, json!({"provider": "local-b"}))
            .await;
        app.delete(ALICE, &format!("/v1/sandboxes/local-b:{local}"))
            .await
            .ok(204);
        app.get(ALICE, &format!("/v1/sandboxes/local:{local}"))
            .await
            .problem(404, "not_found");
        app.get(ALICE, &format!("/v1/sandboxes/local-b:{local}"))
            .await
            .ok(200);
    }

    #[tokio::test]
    async fn unsatisfiable_leaks() {
        let app = with("unsatisfiable-leaks").await;
        let digest = app.digest().await;
        app.post(ALICE, "/v1/sandboxes", json!({"resources": {"cpu": 64}}))
            .await
            .problem(422, "resources_unsatisfiable");
        assert_ne!(app.digest().await, digest);
        assert_eq!(
            app.get(ALICE, "/v1/sandboxes").await.ok(200)["data"]
                .as_array()
                .unwrap()
                .len(),
            1
        );
    }

    #[tokio::test]
    async fn sse_resume_drops_event() {
        let app = with("sse-resume-drops-event").await;
        let id = app.create_sandbox(ALICE, json!({})).await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let p = app
            .start(
                ALICE,
                &id,
                &["sh", "-c", "echo a; sleep 0.3; echo b; sleep 0.3; echo c"],
            )
            .await;
        let pid = p["id"].as_str().unwrap();
        app.wait_process(ALICE, pid).await;
        let path = format!("/v1/processes/{pid}/events");
        let mut sse = RawSse::open(
            &app,
            &path,
            ALICE,
            &[("Accept", "text/event-stream"), ("Last-Event-ID", "1")],
        )
        .await;
        let events = sse.events_until_end(Duration::from_secs(5)).await;
        let ids: Vec<&str> = events.iter().filter_map(|e| e.field("id")).collect();
        // Output written apart normally makes events 1 to 3 and the exit 4; on a loaded
        // machine two writes can come as one event. Either way the resume must start at 2,
        // and the defect starts it at 3.
        assert_eq!(
            ids.first(),
            Some(&"3"),
            "the defect skips the event after the cursor: {ids:?}"
        );
    }

    #[tokio::test]
    async fn rejected_request_writes_state() {
        let app = with("rejected-request-writes-state").await;
        let digest = app.digest().await;
        app.post(ALICE, "/v1/sandboxes", json!({"timeout_s": 0}))
            .await
            .problem(400, "invalid_argument");
        assert_ne!(app.digest().await, digest);
    }

    #[tokio::test]
    async fn foreign_object_403() {
        let app = with("foreign-object-403").await;
        let id = app.create_sandbox(ALICE, json!({})).await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        app.get(BOB, &format!("/v1/sandboxes/{id}"))
            .await
            .problem(403, "permission_denied");
    }

    #[tokio::test]
    async fn foreign_object_visible() {
        let app = with("foreign-object-visible").await;
        let id = app.create_sandbox(ALICE, json!({})).await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        app.get(BOB, &format!("/v1/sandboxes/{id}")).await.ok(200);
        assert_eq!(
            app.get(BOB, "/v1/sandboxes").await.ok(200)["data"][0]["id"],
            id.as_str()
        );
    }

    #[tokio::test]
    async fn kill_reports_success_without_removing() {
        let app = with("kill-reports-success-without-removing").await;
        let id = app.create_sandbox(ALICE, json!({})).await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        app.delete(ALICE, &format!("/v1/sandboxes/{id}"))
            .await
            .ok(204);
        app.get(ALICE, &format!("/v1/sandboxes/{id}")).await.ok(200);
        assert!(app.sandbox_dir(&id).exists());
    }

    #[tokio::test]
    async fn page_token_unbound() {
        let app = with("page-token-unbound").await;
        for _ in 0..3 {
            app.create_sandbox(ALICE, json!({})).await;
        }
        let page = app.get(ALICE, "/v1/sandboxes?limit=1").await.ok(200);
        let token = page["next_page_token"].as_str().unwrap();
        app.get(BOB, &format!("/v1/sandboxes?limit=1&page_token={token}"))
            .await
            .ok(200);
    }

    #[tokio::test]
    async fn preview_token_unchecked() {
        let app = with("preview-token-unchecked").await;
        let id = app.create_sandbox(ALICE, json!({})).await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let preview = app
            .post(
                ALICE,
                &format!("/v1/sandboxes/{id}/previews"),
                json!({"port": free_port()}),
            )
            .await
            .ok(201);
        let bare = preview["url"]
            .as_str()
            .unwrap()
            .split('?')
            .next()
            .unwrap()
            .to_owned();
        // Past the token check: nothing listens, so 502 instead of 403.
        app.send(app.client.get(&bare))
            .await
            .problem(502, "upstream_unavailable");
    }

    #[tokio::test]
    async fn idempotency_ignored() {
        let app = with("idempotency-ignored").await;
        let a = app
            .post_idem(ALICE, "/v1/sandboxes", "k", json!({}))
            .await
            .ok(201);
        let b = app
            .post_idem(ALICE, "/v1/sandboxes", "k", json!({}))
            .await
            .ok(201);
        assert_ne!(a["id"], b["id"]);
    }

    #[tokio::test]
    async fn ttl_not_enforced() {
        let app = with("ttl-not-enforced").await;
        let id = app.create_sandbox(ALICE, json!({"timeout_s": 1})).await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            app.get(ALICE, &format!("/v1/sandboxes/{id}")).await.ok(200)["state"],
            "running"
        );
    }

    #[tokio::test]
    async fn output_never_expires() {
        let defects = Defects::parse(["output-never-expires"]).unwrap();
        let app = spawn_app(move |c| {
            c.defects = defects;
            c.retention.process_output_s = 1;
        })
        .await;
        let id = app.create_sandbox(ALICE, json!({})).await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let p = app.start(ALICE, &id, &["echo", "kept"]).await;
        let pid = p["id"].as_str().unwrap();
        app.wait_process(ALICE, pid).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            app.get(ALICE, &format!("/v1/processes/{pid}/output"))
                .await
                .ok(200)["stdout"],
            "kept\n"
        );
    }

    /// Output a process writes after its stream's client went away is lost; what the stream
    /// carried before stays readable, and a process nobody streamed keeps everything.
    #[tokio::test]
    async fn output_lost_on_disconnect() {
        let app = with("output-lost-on-disconnect").await;
        let id = app.create_sandbox(ALICE, json!({})).await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let p = app
            .start(ALICE, &id, &["sh", "-c", "echo seen; sleep 1; echo unseen"])
            .await;
        let pid = p["id"].as_str().unwrap().to_owned();
        let mut stream = RawSse::open(
            &app,
            &format!("/v1/processes/{pid}/events"),
            ALICE,
            &sse_headers(),
        )
        .await;
        assert_eq!(stream.status, 200);
        loop {
            let frame = stream
                .next(Duration::from_secs(10))
                .await
                .expect("the first output arrives");
            if frame.field("event") == Some("stdout") {
                break;
            }
        }
        drop(stream);
        app.wait_process(ALICE, &pid).await;
        let out = app
            .get(ALICE, &format!("/v1/processes/{pid}/output"))
            .await
            .ok(200);
        assert_eq!(out["stdout"], "seen\n");
        assert_eq!(out["complete"], false);
        let quiet = app.start(ALICE, &id, &["echo", "kept"]).await;
        let quiet = quiet["id"].as_str().unwrap();
        app.wait_process(ALICE, quiet).await;
        let out = app
            .get(ALICE, &format!("/v1/processes/{quiet}/output"))
            .await
            .ok(200);
        assert_eq!(out["stdout"], "kept\n");
    }

    /// A sandbox with a process that runs for a minute; its event stream path.
    async fn long_stream(app: &TestApp) -> String {
        let id = app.create_sandbox(ALICE, json!({})).await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let p = app.start(ALICE, &id, &["sleep", "60"]).await;
        format!("/v1/processes/{}/events", p["id"].as_str().unwrap())
    }

    #[tokio::test]
    async fn stream_quota_unenforced() {
        let defects = Defects::parse(["stream-quota-unenforced"]).unwrap();
        let app = spawn_app(move |c| {
            c.defects = defects;
            c.limits.max_streams_per_principal = 1;
        })
        .await;
        let path = long_stream(&app).await;
        let first = RawSse::open(&app, &path, ALICE, &sse_headers()).await;
        assert_eq!(first.status, 200);
        let second = RawSse::open(&app, &path, ALICE, &sse_headers()).await;
        assert_eq!(
            second.status, 200,
            "the defect grants a stream beyond the quota"
        );
    }

    #[tokio::test]
    async fn stream_slot_leaked_on_close() {
        let defects = Defects::parse(["stream-slot-leaked-on-close"]).unwrap();
        let app = spawn_app(move |c| {
            c.defects = defects;
            c.limits.max_streams_per_principal = 1;
            c.limits.heartbeat_interval_s = 1;
        })
        .await;
        let path = long_stream(&app).await;
        let held = RawSse::open(&app, &path, ALICE, &sse_headers()).await;
        assert_eq!(held.status, 200);
        drop(held);
        // Heartbeats make the server notice the closed connection within a second or two;
        // the slot stays taken.
        tokio::time::sleep(Duration::from_secs(3)).await;
        app.send(
            app.request(Some(ALICE), Method::GET, &path)
                .header("Accept", "text/event-stream"),
        )
        .await
        .problem(429, "too_many_streams");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_store_is_503_and_the_server_recovers() {
    let Some(pg) = pg_cluster::PgCluster::start_or_skip() else {
        return;
    };
    let url = pg.fresh_database().await;
    let app =
        spawn_app(move |c| c.database = reference_server::config::Database::Postgres(url)).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    tokio::task::block_in_place(|| pg.stop());
    let health = app.send(app.request(None, Method::GET, "/v1/health")).await;
    health.problem(503, "unavailable");
    assert!(health.header("retry-after").is_some());
    let get = app.get(ALICE, &format!("/v1/sandboxes/{id}")).await;
    get.problem(503, "unavailable");
    assert_eq!(get.json()["retryable"], true);
    tokio::task::block_in_place(|| pg.start());
    poll(|| async {
        (app.send(app.request(None, Method::GET, "/v1/health"))
            .await
            .status
            == 200)
            .then_some(())
    })
    .await;
    app.get(ALICE, &format!("/v1/sandboxes/{id}")).await.ok(200);
}

#[tokio::test]
async fn rejected_requests_of_every_kind_change_nothing() {
    let app = spawn_app(|_| {}).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    app.post_idem(
        ALICE,
        &format!("/v1/sandboxes/{id}/connections"),
        "c1",
        json!({}),
    )
    .await
    .ok(201);
    let digest = app.digest().await;
    let sbx = format!("/v1/sandboxes/{id}");
    app.post(ALICE, &format!("{sbx}/processes"), json!({"cmd": []}))
        .await
        .problem(400, "invalid_argument");
    let p = app
        .post(
            ALICE,
            &format!("{sbx}/processes"),
            json!({"cmd": ["true"], "nice": 5}),
        )
        .await
        .problem(400, "invalid_argument");
    assert_eq!(p["param"], "nice");
    app.post(
        ALICE,
        &format!("{sbx}/processes"),
        json!({"cmd": ["true"], "cwd": "/"}),
    )
    .await
    .problem(400, "invalid_path");
    // Refused by the provider after the record was written: the record goes again.
    app.post_idem(
        ALICE,
        &format!("{sbx}/processes"),
        "p1",
        json!({"cmd": ["true"], "cwd": "../.."}),
    )
    .await
    .problem(400, "invalid_path");
    // Not an existing directory, or a program that cannot run: 400 naming the field (PRC-4.23,
    // PRC-4.9), and no process is left.
    let p = app
        .post(
            ALICE,
            &format!("{sbx}/processes"),
            json!({"cmd": ["true"], "cwd": "no/such/dir"}),
        )
        .await
        .problem(400, "invalid_argument");
    assert_eq!(p["param"], "cwd");
    let p = app
        .post_idem(
            ALICE,
            &format!("{sbx}/processes"),
            "p2",
            json!({"cmd": ["no-such-program-anywhere"]}),
        )
        .await
        .problem(400, "invalid_argument");
    assert_eq!(p["param"], "cmd");
    assert!(
        p["detail"]
            .as_str()
            .unwrap()
            .contains("no-such-program-anywhere")
    );
    app.post(ALICE, &format!("{sbx}/previews"), json!({"port": 70000}))
        .await
        .problem(400, "invalid_argument");
    app.post(
        ALICE,
        &format!("{sbx}/previews"),
        json!({"port": 80, "expires_in_s": 0}),
    )
    .await
    .problem(400, "invalid_argument");
    app.post(ALICE, &format!("{sbx}/timeout"), json!({}))
        .await
        .problem(400, "invalid_argument");
    app.post(ALICE, &format!("{sbx}/snapshots"), json!({"name": "x"}))
        .await
        .problem(400, "invalid_argument");
    app.post(ALICE, &format!("{sbx}/resume"), json!({}))
        .await
        .problem(409, "invalid_state");
    app.post_idem(ALICE, &format!("{sbx}/connections"), "c1", json!({"x": 1}))
        .await
        .problem(400, "invalid_argument");
    app.delete(ALICE, &format!("{sbx}/connections/conn_nope"))
        .await
        .problem(404, "not_found");
    app.delete(BOB, &sbx).await.problem(404, "not_found");
    app.post(BOB, &format!("{sbx}/pause"), json!({}))
        .await
        .problem(404, "not_found");
    app.get(ALICE, "/v1/processes/local:prc_nope")
        .await
        .problem(404, "not_found");
    app.delete(ALICE, "/v1/snapshots/local:snp_nope")
        .await
        .problem(404, "not_found");
    app.post(
        ALICE,
        "/v1/processes/local:prc_nope/signal",
        json!({"signal": "TERM"}),
    )
    .await
    .problem(404, "not_found");
    assert_eq!(app.digest().await, digest);
}

#[tokio::test]
async fn shutdown_ends_open_streams_and_every_sandbox_process() {
    let app = spawn_app(|_| {}).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    // Found on the host by its command line: a PID the process could report itself is one
    // of its own PID namespace, where the sandbox has one.
    let marker = format!("{}", 60.0 + f64::from(std::process::id() % 1000) / 1e4);
    let p = app.start(ALICE, &id, &["sleep", &marker]).await;
    let argv = format!("sleep\0{marker}\0");
    let pid: u32 = poll(|| async {
        std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let pid = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            (cmdline == argv.as_bytes()).then_some(pid)
        })
    })
    .await;
    let path = format!("/v1/processes/{}/events", p["id"].as_str().unwrap());
    let mut sse = RawSse::open(&app, &path, ALICE, &[("Accept", "text/event-stream")]).await;
    assert_eq!(sse.status, 200);
    let started = std::time::Instant::now();
    tokio::task::spawn_blocking(move || drop(app))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "open streams do not hold up shutdown"
    );
    sse.events_until_end(Duration::from_secs(2)).await;
    // A zombie until its reaper runs counts as gone.
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    assert!(
        state.is_empty() || state.contains(") Z "),
        "process {pid} still runs: {state}"
    );
}

/// The test clock (TC-9.12) is the admin's alone and refuses bad moves with a problem body.
/// (Moving it is tested in `tests/clock.rs`: the clock is one per process, and this binary's
/// other tests share the process.)
#[tokio::test]
async fn the_test_clock_is_admin_only_and_refuses_bad_moves() {
    let app = spawn_app(|_| {}).await;
    let digest = app.digest().await;
    app.post(ALICE, "/v1/test/clock", json!({"advance_ms": 1000}))
        .await
        .problem(403, "permission_denied");
    app.send(
        app.request(Some("no-such-token"), Method::POST, "/v1/test/clock")
            .json(&json!({"advance_ms": 1000})),
    )
    .await
    .problem(401, "unauthenticated");
    for bad in [
        json!({"advance_ms": 0}),
        json!({"advance_ms": 86_400_001}),
        json!({"advance_ms": -5}),
        json!({"advance_ms": "60s"}),
    ] {
        let refused = app.post(ADMIN, "/v1/test/clock", bad.clone()).await;
        let problem = refused.problem(400, "invalid_argument");
        if bad["advance_ms"].is_u64() {
            assert_eq!(problem["param"], "advance_ms", "{bad}");
        }
    }
    app.post(ADMIN, "/v1/test/clock", json!({"advance": 5}))
        .await
        .problem(400, "invalid_argument");
    assert_eq!(app.digest().await, digest, "a refused move changes nothing");
    let off = spawn_app(|c| c.test_controls = false).await;
    off.post(ADMIN, "/v1/test/clock", json!({"advance_ms": 1000}))
        .await
        .problem(404, "not_found");
}

#[tokio::test]
async fn a_held_expiry_changes_nothing_until_released() {
    let app = spawn_app(|c| {
        c.retention.process_output_s = 1;
        c.limits.reaper_interval_ms = 50;
    })
    .await;
    // Only the admin holds expiry, and only for a bounded time.
    app.post(ALICE, "/v1/test/expiry_hold", json!({"hold_s": 60}))
        .await
        .problem(403, "permission_denied");
    let too_long = app
        .post(ADMIN, "/v1/test/expiry_hold", json!({"hold_s": 3601}))
        .await;
    assert_eq!(too_long.problem(400, "invalid_argument")["param"], "hold_s");
    app.post(ADMIN, "/v1/test/expiry_hold", json!({"hold": true}))
        .await
        .problem(400, "invalid_argument");

    let sbx = app.create_sandbox(ALICE, json!({})).await;
    let sbx = sbx["id"].as_str().unwrap();
    app.post(ADMIN, "/v1/test/expiry_hold", json!({"hold_s": 60}))
        .await
        .ok(204);
    let pid = app.start(ALICE, sbx, &["true"]).await;
    let pid = pid["id"].as_str().unwrap();
    app.wait_process(ALICE, pid).await;
    let digest = app.digest().await;
    // Well past the output's retention and many reaper passes: the hold keeps it all.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(app.digest().await, digest, "nothing expired while held");
    app.post(ADMIN, "/v1/test/expiry_hold", json!({"hold_s": 0}))
        .await
        .ok(204);
    // Released: the output that came due meanwhile expires on a later pass.
    poll(|| async { (app.digest().await != digest).then_some(()) }).await;
    app.get(ALICE, &format!("/v1/processes/{pid}/output"))
        .await
        .problem(410, "output_expired");
}

/// A file path with a component longer than the file system keeps is 400 `invalid_path`
/// on every files operation, not a 500, and writes nothing.
#[tokio::test]
async fn file_paths_the_file_system_cannot_hold_are_400() {
    let app = spawn_app(|_| {}).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let digest = app.digest().await;
    let long = format!("a{}", "\u{0301}".repeat(200));
    app.send(
        app.request(
            Some(ALICE),
            Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path={long}"),
        )
        .body("x"),
    )
    .await
    .problem(400, "invalid_path");
    app.get(ALICE, &format!("/v1/sandboxes/{id}/files?path={long}"))
        .await
        .problem(400, "invalid_path");
    app.get(ALICE, &format!("/v1/sandboxes/{id}/files/list?path={long}"))
        .await
        .problem(400, "invalid_path");
    app.delete(ALICE, &format!("/v1/sandboxes/{id}/files?path={long}"))
        .await
        .problem(400, "invalid_path");
    assert_eq!(app.digest().await, digest);
}

/// A metadata filter is held to the rules of metadata (at most 32 keys, keys of
/// `[A-Za-z0-9_.-]{1,64}`, values of at most 256 characters): beyond them it is 400. The
/// OpenAPI deepObject spelling `metadata[k]=v` filters as `metadata.k=v` does.
#[tokio::test]
async fn metadata_filters_follow_the_metadata_rules() {
    let app = spawn_app(|_| {}).await;
    let id = app
        .create_sandbox(ALICE, json!({"metadata": {"team": "red"}}))
        .await["id"]
        .clone();
    app.create_sandbox(ALICE, json!({"metadata": {"team": "blue"}}))
        .await;
    for path in [
        "/v1/sandboxes?metadata.team=red",
        "/v1/sandboxes?metadata%5Bteam%5D=red",
    ] {
        let page = app.get(ALICE, path).await.ok(200);
        let ids: Vec<&Value> = page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| &s["id"])
            .collect();
        assert_eq!(ids, vec![&id], "{path}");
    }
    let many: String = (0..33).map(|i| format!("&metadata.k{i}=v")).collect();
    let deep: String = (0..33).map(|i| format!("&metadata%5Bk{i}%5D=v")).collect();
    let long_value = format!("metadata.team={}", "v".repeat(257));
    for query in [
        many,
        deep,
        "metadata.b%20d=x".to_owned(),
        format!("metadata.{}=x", "k".repeat(65)),
        long_value,
    ] {
        let problem = app
            .get(ALICE, &format!("/v1/sandboxes?{query}"))
            .await
            .problem(400, "invalid_argument");
        assert_eq!(problem["param"], "metadata", "{query}");
    }
    // Exactly 32 keys is a filter like any other (it matches nothing here).
    let most: String = (0..32).map(|i| format!("&metadata.k{i}=v")).collect();
    let page = app
        .get(ALICE, &format!("/v1/sandboxes?{most}"))
        .await
        .ok(200);
    assert_eq!(page["data"], json!([]));
}

/// An `Idempotency-Key` breaking its rules (printable ASCII, 1 to 255 characters) is 400
/// `invalid_argument` naming the header on each create that takes one, and creates nothing;
/// the schema lists the 400 on each of them.
#[tokio::test]
async fn invalid_idempotency_keys_are_400_on_every_create() {
    let app = spawn_app(|_| {}).await;
    let id = app.create_sandbox(ALICE, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let digest = app.digest().await;
    let long = "k".repeat(256);
    for path in [
        "/v1/sandboxes".to_owned(),
        format!("/v1/sandboxes/{id}/connections"),
        format!("/v1/sandboxes/{id}/snapshots"),
    ] {
        for key in ["a b", long.as_str()] {
            let problem = app
                .post_idem(ALICE, &path, key, json!({}))
                .await
                .problem(400, "invalid_argument");
            assert_eq!(problem["param"], "Idempotency-Key", "{path} {key:?}");
        }
    }
    assert_eq!(app.digest().await, digest);
}
