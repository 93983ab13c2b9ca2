//! The MCP client session against a real MCP server process: `sandspec mcp` over the
//! reference server's E2B control plane. Each guarantee of the reference MCP server is shown
//! to hold, and to break under the defect that is its negative control, as seen on the control
//! plane by a fresh client.

#[expect(dead_code, reason = "the shared helpers serve several test binaries")]
#[path = "../reference-server/tests/support/mod.rs"]
mod server_support;
use crate::support::venv;

use std::time::Duration;

use reqwest::Method;
use sandspec::mcp::{McpSession, ServerCommand, Shutdown};
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
}

fn handle(reply: &sandspec::mcp::ToolReply) -> String {
    assert!(!reply.is_error, "{}", reply.text);
    reply.value["handle"].as_str().expect("a handle").to_owned()
}

/// Connects to a borrowed sandbox and creates one, then shuts down: (borrowed ID, its
/// detail before, created handle).
async fn borrow_create_shutdown(
    cp: &ControlPlane,
    session: &mut McpSession,
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
    assert_eq!(
        session.shutdown(GRACE).await.expect("shutdown"),
        Shutdown::ExitedOnEof
    );
    (borrowed, before, created)
}

fn bare(handle: &str) -> &str {
    handle.strip_prefix("e2b:").unwrap_or(handle)
}

#[tokio::test]
async fn shutdown_kills_what_the_session_created_and_leaves_what_it_borrowed() {
    let cp = ControlPlane::start().await;
    let mut session = cp.mcp(&[]).await;
    let (borrowed, before, created) = borrow_create_shutdown(&cp, &mut session).await;

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
        .call(Method::GET, &format!("/sandboxes/{}", bare(&created)), None)
        .await;
    assert_eq!(status, 404, "the created sandbox outlived the session");
    assert_eq!(cp.listed().await, vec![borrowed]);

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
    let (borrowed, _, _) = borrow_create_shutdown(&cp, &mut session).await;
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
    let (_, _, created) = borrow_create_shutdown(&cp, &mut session).await;
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
        let mut target = sandspec::target::Target::start_reference(&options)
            .await
            .expect("reference server")
            .speaking(sandspec::profile::Api::Mcp);
        let mut command =
            ServerCommand::parse(&format!("{} -m agent_sandbox.agent.mcp", python.display()))
                .expect("command");
        // The package reads its configuration from the home directory too: an empty one.
        command.env = vec![("HOME".into(), home.path().display().to_string())];
        target.mcp = Some(sandspec::mcp::McpServer {
            command,
            map: sandspec::mcp::ToolMap::load("agent-sandbox-client").expect("map"),
        });
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
