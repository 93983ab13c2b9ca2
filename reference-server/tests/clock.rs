//! The test clock (TC-9.12) moved: what came due expires at once. In a test binary of its
//! own, because the clock is one per server process and every test here shares the process.

#[expect(dead_code, reason = "the shared helpers serve several test binaries")]
mod support;

use std::time::Duration;

use serde_json::json;
use support::*;

#[tokio::test]
async fn moving_the_clock_expires_what_came_due_at_once() {
    let app = spawn_app(|c| {
        // Long enough that nothing expires in real time while the test runs, and a reaper
        // that does not come by on its own during it: only the clock's wake-up runs it.
        c.retention.process_output_s = 600;
        c.limits.reaper_interval_ms = 3_600_000;
    })
    .await;
    let caps = app.get(ALICE, "/v1/capabilities").await.ok(200);
    assert!(
        caps["features"]
            .as_array()
            .unwrap()
            .contains(&json!("test_clock")),
        "{caps}"
    );
    let sbx = app.create_sandbox(ALICE, json!({"timeout_s": 300})).await;
    let sbx = sbx["id"].as_str().unwrap().to_owned();
    let keep = app.create_sandbox(ALICE, json!({"timeout_s": 3000})).await;
    let keep = keep["id"].as_str().unwrap().to_owned();
    let pid = app.start(ALICE, &keep, &["echo", "hello"]).await;
    let pid = pid["id"].as_str().unwrap().to_owned();
    app.wait_process(ALICE, &pid).await;
    app.get(ALICE, &format!("/v1/processes/{pid}/output"))
        .await
        .ok(200);

    // Past the first sandbox's timeout, not the second's; the output's retention not yet.
    let moved = app
        .post(ADMIN, "/v1/test/clock", json!({"advance_ms": 301_000}))
        .await
        .ok(200);
    assert_eq!(moved["offset_ms"], 301_000);
    let started = std::time::Instant::now();
    poll(|| async {
        let r = app.get(ALICE, &format!("/v1/sandboxes/{sbx}")).await;
        (r.status == 404 || r.json()["state"] != "running").then_some(())
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the timed-out sandbox ended {:?} after the move",
        started.elapsed()
    );
    let kept = app
        .get(ALICE, &format!("/v1/sandboxes/{keep}"))
        .await
        .ok(200);
    assert_eq!(kept["state"], "running", "{kept}");
    app.get(ALICE, &format!("/v1/processes/{pid}/output"))
        .await
        .ok(200);

    // Past the output's retention: the very next read answers 410, no reaper pass needed.
    let moved = app
        .post(ADMIN, "/v1/test/clock", json!({"advance_ms": 300_000}))
        .await
        .ok(200);
    assert_eq!(moved["offset_ms"], 601_000);
    app.get(ALICE, &format!("/v1/processes/{pid}/output"))
        .await
        .problem(410, "output_expired");

    // The clock never goes further than a year ahead in all.
    let mut offset = 601_000_u64;
    loop {
        let r = app
            .post(ADMIN, "/v1/test/clock", json!({"advance_ms": 86_400_000}))
            .await;
        if r.status == 400 {
            assert_eq!(r.problem(400, "invalid_argument")["param"], "advance_ms");
            break;
        }
        offset += 86_400_000;
        assert_eq!(r.ok(200)["offset_ms"], offset);
        assert!(offset <= 366 * 86_400_000, "moved past a year: {offset} ms");
    }
    assert!(offset > 365 * 86_400_000, "refused early, at {offset} ms");
}
