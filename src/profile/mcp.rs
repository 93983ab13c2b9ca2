//! The MCP profile: a sandbox MCP server, driven over its stdio as an agent's host drives it,
//! judged by what its tools answer and by what an E2B control plane shows a client of its own.
//! Its clauses are `docs/profiles/mcp.md`'s; the control plane is an E2B one (credentials,
//! creations and sweeps as the E2B profile's); the server and its tool map come from
//! `--mcp-server` and `--tool-map`.

use std::time::Duration;

use futures_util::future::BoxFuture;
use serde_json::Value;

use super::api::Api;
use super::binding::{Clauses, Creation, Profile};
use super::clauses::{ClauseTable, RowLevels};
use super::e2b;
use crate::live::{RunSweep, Swept};
use crate::mcp::{McpServer, ServerCommand, ToolMap};
use crate::target::{Capabilities, Conn, Tokens};

/// The clause document; a clause is a MUST when its requirement says so.
pub const CLAUSES: ClauseTable = ClauseTable {
    prefix: "MCP-",
    path: "docs/profiles/mcp.md",
    text: include_str!("../../docs/profiles/mcp.md"),
    levels: RowLevels::Stated,
};

/// The MCP profile.
pub struct Mcp;

impl Profile for Mcp {
    fn api(&self) -> Api {
        Api::Mcp
    }

    fn catalog_folder(&self) -> Option<&'static str> {
        Some("mcp")
    }

    fn clauses(&self) -> Clauses {
        Clauses::Table(CLAUSES)
    }

    fn credential(&self, token: &str) -> (&'static str, String) {
        e2b::api_key(token)
    }

    /// The reference server is the control plane here, a fixture and not what is judged: its
    /// test controls stay usable (a create held in flight).
    fn reference_capabilities(&self, advertised: Capabilities) -> Capabilities {
        Capabilities {
            features: advertised
                .features
                .into_iter()
                .filter(|f| f == "test_controls")
                .collect(),
            ..Capabilities::default()
        }
    }

    fn mcp_server(
        &self,
        command: Option<&str>,
        tool_map: &str,
    ) -> Result<Option<McpServer>, String> {
        let line = command.ok_or("--api mcp needs --mcp-server \"<command line>\"")?;
        let command = ServerCommand::parse(line).map_err(|e| format!("failed to {e}"))?;
        let map = ToolMap::load(tool_map).map_err(|e| format!("failed to {e}"))?;
        Ok(Some(McpServer { command, map }))
    }

    fn created(&self, method: &str, path: &str, status: u16, body: &Value) -> Vec<Creation> {
        e2b::created(method, path, status, body)
    }

    fn creates_sandbox(&self, method: &str, path: &str) -> bool {
        e2b::creates_sandbox(method, path)
    }

    fn sweep_run<'a>(
        &'a self,
        conn: &'a Conn<'a>,
        tokens: &'a Tokens,
        run_id: &'a str,
    ) -> BoxFuture<'a, RunSweep> {
        e2b::sweep_run(conn, tokens, run_id)
    }

    fn sweep_older_than<'a>(
        &'a self,
        conn: &'a Conn<'a>,
        token: &'a str,
        older_than: Duration,
        dry_run: bool,
    ) -> BoxFuture<'a, Result<Vec<Swept>, String>> {
        e2b::sweep_older_than(conn, token, older_than, dry_run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Level;

    #[test]
    fn a_clause_is_a_must_when_its_requirement_says_so() {
        assert!(CLAUSES.ids().count() >= 5);
        assert_eq!(CLAUSES.level("MCP-1"), Some(Level::Must));
        assert_eq!(CLAUSES.level("MCP-999"), None);
    }

    #[test]
    fn the_profile_needs_its_server_and_others_refuse_one() {
        assert!(Mcp.mcp_server(None, "reference").is_err());
        let server = Mcp
            .mcp_server(Some("sandspec mcp"), "reference")
            .unwrap()
            .unwrap();
        assert_eq!(server.command.argv, ["sandspec", "mcp"]);
        assert_eq!(
            super::super::v1::V1
                .mcp_server(Some("x"), "reference")
                .unwrap_err(),
            "--mcp-server needs --api mcp"
        );
    }
}
