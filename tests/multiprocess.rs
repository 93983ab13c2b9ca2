//! Two real `sandspec serve` processes on one PostgreSQL database: events appended by one
//! reach streams on the other, submits, cancels and deletes made on one are carried out by the
//! session's home process, page tokens from one are accepted by the other, and a session whose
//! home process dies is taken over: its running turn becomes `uncertain`, never replayed.
//!
//! Skipped (with a message) when PostgreSQL is not installed, unless
//! `SANDSPEC_REQUIRE_POSTGRES=1`, which makes a missing PostgreSQL a failure.

use std::process::Stdio;
use std::time::{Duration, Instant};

use pg_cluster::PgCluster;
use reqwest::{Client, Method, StatusCode};
use serde_json::{Value, json};
use tokio::process::{Child, Command};

use crate::support::serve;

const ALICE: &str = "alice-multiprocess-token";
const ADMIN: &str = "admin-multiprocess-token";

/// One `sandspec serve` child with its own data directory.
struct Server {
    child: Child,
    base: String,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start(database_url: &str) -> Server {
        Self::start_with(database_url, &[]).await
    }

    async fn start_with(database_url: &str, extra: &[&str]) -> Server {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut child = Command::new(env!("CARGO_BIN_EXE_sandspec"))
            .args(["serve", "--listen", "127.0.0.1:0", "--database-url"])
            .arg(database_url)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--principal", &format!("alice:{ALICE}")])
            .args(["--admin-token", ADMIN, "--enable-test-controls"])
            .args(["--limit", "heartbeat_interval_s=1"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start sandspec serve");
        let base = serve::base_url(&mut child).await;
        Server {
            child,
            base,
            _dir: dir,
        }
    }

    /// SIGKILL: no shutdown, no cleanup, its connections simply drop.
    async fn kill(&mut self) {
        self.child.start_kill().expect("SIGKILL the server");
        self.child.wait().await.expect("reap the server");
    }
}

async fn call(client: &Client, server: &Server, method: Method, path: &str) -> (StatusCode, Value) {
    call_json(client, server, method, path, None, None).await
}

async fn call_json(
    client: &Client,
    server: &Server,
    method: Method,
    path: &str,
    body: Option<Value>,
    key: Option<&str>,
) -> (StatusCode, Value) {
    let mut req = client
        .request(method, format!("{}{path}", server.base))
        .bearer_auth(ALICE);
    if let Some(body) = body {
        req = req.json(&body);
    }
    if let Some(key) = key {
        req = req.header("Idempotency-Key", key);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// Polls `GET path` on `server` until `done` holds for the body, or fails after `within`.
async fn wait_for(
    client: &Client,
    server: &Server,
    path: &str,
    within: Duration,
    what: &str,
    done: impl Fn(StatusCode, &Value) -> bool,
) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let (status, body) = call(client, server, Method::GET, path).await;
        if done(status, &body) {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still {status} {body} after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads a session's event stream to its end: the event names in order, and whether it ended
/// with a clean EOF.
fn collect_stream(
    client: &Client,
    server: &Server,
    sid: &str,
) -> tokio::task::JoinHandle<Vec<String>> {
    let req = client
        .get(format!("{}/v1/sessions/{sid}/events", server.base))
        .bearer_auth(ALICE)
        .header("Accept", "text/event-stream");
    tokio::spawn(async move {
        let mut resp = req.send().await.expect("open the stream");
        assert_eq!(resp.status(), StatusCode::OK);
        let mut text = String::new();
        while let Some(chunk) = resp.chunk().await.expect("read the stream") {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        text.lines()
            .filter_map(|l| {
                l.strip_prefix("event: ")
                    .or_else(|| l.strip_prefix("event:"))
            })
            .map(|e| e.trim().to_owned())
            .collect()
    })
}

fn database() -> Option<String> {
    let cluster = PgCluster::shared_or_skip()?;
    Some(cluster.fresh_database_blocking())
}

async fn create_session(client: &Client, server: &Server, model: &str) -> (String, String) {
    let (status, body) = call_json(
        client,
        server,
        Method::POST,
        "/v1/sessions",
        Some(json!({"agent": {"model": model}, "sandbox": {"create": {}}})),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let sid = body["id"].as_str().expect("id").to_owned();
    let sbx = body["sandbox_id"].as_str().expect("sandbox_id").to_owned();
    (sid, sbx)
}

async fn submit(client: &Client, server: &Server, sid: &str, input: &str) -> String {
    let (status, body) = call_json(
        client,
        server,
        Method::POST,
        &format!("/v1/sessions/{sid}/submissions"),
        Some(json!({"input": input})),
        Some(&format!("key-{input}")),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    body["id"].as_str().expect("id").to_owned()
}

fn state_is(want: &'static str) -> impl Fn(StatusCode, &Value) -> bool {
    move |status, body| status == StatusCode::OK && body["state"] == want
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_share_streams_submits_cancels_and_deletes() {
    let Some(url) = database() else { return };
    let (a, b) = tokio::join!(Server::start(&url), Server::start(&url));
    let client = sandspec::target::build_client(None).unwrap();
    let wait = Duration::from_secs(30);

    // A session made on A is visible on B, sandbox and all.
    let (sid, sbx) = create_session(&client, &a, "slow-text").await;
    wait_for(
        &client,
        &b,
        &format!("/v1/sandboxes/{sbx}"),
        wait,
        "sandbox on B",
        state_is("running"),
    )
    .await;
    let on_b = collect_stream(&client, &b, &sid);

    // Turns submitted on B run on A (the session's home), in order.
    let first = submit(&client, &b, &sid, "one").await;
    let second = submit(&client, &b, &sid, "two").await;
    for id in [&first, &second] {
        wait_for(
            &client,
            &b,
            &format!("/v1/submissions/{id}"),
            wait,
            "turn on B",
            state_is("completed"),
        )
        .await;
    }
    let (_, one) = call(
        &client,
        &a,
        Method::GET,
        &format!("/v1/submissions/{first}"),
    )
    .await;
    let (_, two) = call(
        &client,
        &a,
        Method::GET,
        &format!("/v1/submissions/{second}"),
    )
    .await;
    assert!(
        one["ended_at"].as_str() <= two["started_at"].as_str(),
        "one turn at a time across processes: {one} {two}"
    );

    // A cancel accepted by B stops the turn A runs (a turn that sleeps in a tool for 60 s).
    let (slow, _) = create_session(&client, &a, "slow-shell").await;
    let third = submit(&client, &b, &slow, "three").await;
    wait_for(
        &client,
        &a,
        &format!("/v1/submissions/{third}"),
        wait,
        "third running",
        state_is("running"),
    )
    .await;
    let (status, body) = call(
        &client,
        &b,
        Method::POST,
        &format!("/v1/submissions/{third}/cancel"),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    wait_for(
        &client,
        &a,
        &format!("/v1/submissions/{third}"),
        wait,
        "third cancelled",
        state_is("cancelled"),
    )
    .await;
    let (status, body) = call(&client, &b, Method::DELETE, &format!("/v1/sessions/{slow}")).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    wait_for(
        &client,
        &a,
        &format!("/v1/sessions/{slow}"),
        wait,
        "slow session deleted",
        |status, _| status == StatusCode::NOT_FOUND,
    )
    .await;

    // Page tokens from one process work on the other.
    let (status, page) = call(
        &client,
        &a,
        Method::GET,
        &format!("/v1/sessions/{sid}/submissions?limit=1"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let token = page["next_page_token"]
        .as_str()
        .expect("a next page")
        .to_owned();
    let (status, next) = call(
        &client,
        &b,
        Method::GET,
        &format!("/v1/sessions/{sid}/submissions?limit=1&page_token={token}"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "B refused A's page token: {next}");
    assert_eq!(next["data"][0]["id"], second.as_str());

    // A delete on B: A (the home) cleans up; streams on both processes end.
    let on_a = collect_stream(&client, &a, &sid);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, body) = call(&client, &b, Method::DELETE, &format!("/v1/sessions/{sid}")).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    for (name, stream) in [("B", on_b), ("A", on_a)] {
        let events = tokio::time::timeout(wait, stream)
            .await
            .unwrap_or_else(|_| panic!("the stream on {name} did not end after the delete"))
            .expect("stream task");
        assert_eq!(
            events.last().map(String::as_str),
            Some("session.deleted"),
            "stream on {name}: {events:?}"
        );
        if name == "B" {
            // Everything A appended reached B's stream, in order.
            let completed = events
                .iter()
                .filter(|e| *e == "submission.completed")
                .count();
            assert_eq!(completed, 2, "stream on B: {events:?}");
        }
    }
    // The record goes right after `session.deleted` is appended.
    for server in [&a, &b] {
        for path in [
            format!("/v1/sessions/{sid}"),
            format!("/v1/sandboxes/{sbx}"),
        ] {
            wait_for(
                &client,
                server,
                &path,
                wait,
                "gone after the delete",
                |status, _| status == StatusCode::NOT_FOUND,
            )
            .await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_home_is_taken_over_and_its_turn_is_uncertain() {
    let Some(url) = database() else { return };
    let (mut a, b) = tokio::join!(Server::start(&url), Server::start(&url));
    let client = sandspec::target::build_client(None).unwrap();
    let wait = Duration::from_secs(40);

    let (sid, _sbx) = create_session(&client, &a, "slow-text-2s").await;
    let sub = submit(&client, &a, &sid, "once").await;
    wait_for(
        &client,
        &b,
        &format!("/v1/submissions/{sub}"),
        wait,
        "turn running",
        state_is("running"),
    )
    .await;
    a.kill().await;

    // B sees A's instance lock go, waits out the grace, takes the session over.
    let done = wait_for(
        &client,
        &b,
        &format!("/v1/submissions/{sub}"),
        wait,
        "turn uncertain",
        |status, body| status == StatusCode::OK && body["state"] != "running",
    )
    .await;
    assert_eq!(done["state"], "uncertain", "{done}");
    assert_eq!(done["outcome"]["reason"], "worker_lost", "{done}");
    let session = wait_for(
        &client,
        &b,
        &format!("/v1/sessions/{sid}"),
        wait,
        "session paused",
        state_is("paused"),
    )
    .await;
    assert_eq!(session["pause_reason"], "uncertain_submission");

    // Never replayed: the turn stays uncertain after resuming, and the session deletes.
    let (status, body) = call(
        &client,
        &b,
        Method::POST,
        &format!("/v1/sessions/{sid}/resume"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, again) = call(&client, &b, Method::GET, &format!("/v1/submissions/{sub}")).await;
    assert_eq!(again["state"], "uncertain", "{again}");
    let (status, body) = call(&client, &b, Method::DELETE, &format!("/v1/sessions/{sid}")).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    wait_for(
        &client,
        &b,
        &format!("/v1/sessions/{sid}"),
        wait,
        "session deleted",
        |status, _| status == StatusCode::NOT_FOUND,
    )
    .await;
}

/// `limits.max_streams_per_principal` holds over both processes: with a limit of 2, one
/// stream on each process leaves no room on either; closing one frees a slot for the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_quota_counts_every_process() {
    let Some(url) = database() else { return };
    let limit = ["--limit", "max_streams_per_principal=2"];
    let (a, b) = tokio::join!(
        Server::start_with(&url, &limit),
        Server::start_with(&url, &limit)
    );
    let client = sandspec::target::build_client(None).unwrap();
    let (sid, _) = create_session(&client, &a, "echo").await;
    let open = |server: &Server| {
        client
            .get(format!("{}/v1/sessions/{sid}/events", server.base))
            .bearer_auth(ALICE)
            .header("Accept", "text/event-stream")
            .send()
    };
    let on_a = open(&a).await.unwrap();
    assert_eq!(on_a.status(), StatusCode::OK);
    let on_b = open(&b).await.unwrap();
    assert_eq!(on_b.status(), StatusCode::OK);
    for server in [&a, &b] {
        let refused = open(server).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(refused.headers().contains_key("retry-after"));
    }
    drop(on_a);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let again = open(&b).await.unwrap();
        if again.status() == StatusCode::OK {
            break;
        }
        assert_eq!(again.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(
            Instant::now() < deadline,
            "the closed stream's slot was never released"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(on_b);
    let (status, _) = call(&client, &b, Method::DELETE, &format!("/v1/sessions/{sid}")).await;
    assert_eq!(status, StatusCode::ACCEPTED);
}
