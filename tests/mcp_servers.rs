//! Published sandbox MCP servers that drive sandboxes through E2B's SDKs, each installed at a
//! pinned version and run through the MCP catalog against the reference server's E2B surface
//! with the suite's tool map for it. The outcome of each scenario is pinned as a snapshot;
//! `docs/findings/` explains each for the server's maintainers.

use crate::support::venv;

use sandspec::engine::Outcome;
use sandspec::mcp::{McpServer, ServerCommand, ToolMap};
use sandspec::profile::Api;

/// `code-sandbox-mcp` 0.1.0 on the 2.x SDK. The package asks for `mcp[cli]>=1.25.0`, which
/// today resolves to `mcp` 2.x, where its `mcp.server.fastmcp` import no longer exists
/// (`docs/findings/code-sandbox-mcp-0.1.0.md`): the last 1.x release is pinned with it.
const CODE_SANDBOX_MCP: &[&str] = &[
    "code-sandbox-mcp==0.1.0",
    "e2b-code-interpreter==2.11.5",
    "e2b==2.63.0",
    "mcp[cli]==1.30.0",
];

/// `e2b-mcp-server` 0.1.1 on the 1.x SDK its requirements allow.
const E2B_MCP_SERVER: &[&str] = &[
    "e2b-mcp-server==0.1.1",
    "e2b-code-interpreter==1.5.2",
    "e2b==1.11.1",
    "mcp==1.30.0",
];

/// What a run of the MCP catalog says, one line per scenario, with the values that change
/// from run to run (sandbox IDs, ports) replaced.
fn normalized_summary(results: &[(String, Outcome)]) -> String {
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

/// Runs the MCP catalog through the server `command` starts, bound by the built-in tool map
/// `map`, against a fresh reference server: each scenario's outcome, in catalog order.
fn through_the_catalog(map: &str, command: &str) -> Vec<(String, Outcome)> {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let catalog = sandspec::scenario::load_dir(&Api::Mcp.catalog(&dir)).expect("catalog");
    // The packages load a `.env` and may read the home: an empty one, and an empty directory
    // to start in.
    let home = tempfile::tempdir().expect("home");
    rt.block_on(async {
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
            .speaking(Api::Mcp);
        let mut command = ServerCommand::parse(command).expect("command");
        command.env = vec![("HOME".into(), home.path().display().to_string())];
        target.mcp = Some(McpServer {
            transport: sandspec::mcp::McpTransport::Stdio(command),
            map: ToolMap::load(map).expect("map"),
        });
        let mut results = Vec::new();
        for s in &catalog {
            let run_id = format!("test{}", ulid::Ulid::new().to_string().to_lowercase());
            let run = sandspec::engine::run_scenario(&target, &s.scenario, &run_id).await;
            results.push((s.id().to_owned(), run.outcome));
        }
        results
    })
}

/// The published `code-sandbox-mcp` 0.1.0 MCP server through the MCP catalog with the
/// suite's `code-sandbox-mcp` tool map (`docs/findings/code-sandbox-mcp-0.1.0.md`).
#[test]
fn code_sandbox_mcp_0_1_0_through_the_mcp_catalog() {
    let Some(python) = venv::executable("code-sandbox-mcp-venv", CODE_SANDBOX_MCP, "python") else {
        return;
    };
    let results = through_the_catalog(
        "code-sandbox-mcp",
        &format!(
            "{} -c \"from code_sandbox_mcp import main; main()\"",
            python.display()
        ),
    );
    insta::assert_snapshot!(normalized_summary(&results));
}

/// The published `e2b-mcp-server` 0.1.1 MCP server through the MCP catalog with the suite's
/// `e2b-mcp-server` tool map, reaching the reference through the router
/// (`docs/findings/e2b-mcp-server-0.1.1.md`).
#[test]
fn e2b_mcp_server_0_1_1_through_the_mcp_catalog() {
    let Some(python) = venv::executable("e2b-mcp-server-venv", E2B_MCP_SERVER, "python") else {
        return;
    };
    let results = through_the_catalog(
        "e2b-mcp-server",
        &format!(
            "{} -c \"from e2b_mcp_server import main; main()\"",
            python.display()
        ),
    );
    insta::assert_snapshot!(normalized_summary(&results));
}
