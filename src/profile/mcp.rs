//! The MCP profile: a sandbox MCP server, driven over its stdio or over streamable HTTP as an
//! agent's host drives it, judged by what its tools answer and by what an E2B control plane
//! shows a client of its own. Its clauses are `docs/profiles/mcp.md`'s; the control plane is
//! an E2B one (credentials, creations and sweeps as the E2B profile's); the server and its tool
//! map come from `--mcp-server` or `--mcp-url`, and `--tool-map`.

use std::time::Duration;

use futures_util::future::BoxFuture;
use serde_json::Value;

use super::api::Api;
use super::binding::{Clauses, Creation, Profile};
use super::clauses::{ClauseTable, RowLevels};
use super::e2b;
use crate::live::{RunSweep, Swept};
use crate::mcp::{HttpServer, McpServer, McpServerSpec, McpTransport, ServerCommand, ToolMap};
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

    /// The MCP server is judged by what the E2B control plane shows: the requests a run sends
    /// are E2B's, so E2B's operations are what they are measured against.
    fn operations(&self) -> Vec<super::operations::Operation> {
        super::e2b::E2b.operations()
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

    /// The server's command line or URL, checked, with its token read from the variable
    /// named: a URL that is not `http`/`https` or carries credentials, and a variable that is
    /// not set, are refused before anything starts.
    fn mcp_server(
        &self,
        spec: Option<&McpServerSpec>,
        tool_map: &str,
    ) -> Result<Option<McpServer>, String> {
        let spec = spec.ok_or(
            "--api mcp needs --mcp-server \"<command line>\" (stdio) or --mcp-url URL \
             (streamable HTTP)",
        )?;
        let transport = match spec {
            McpServerSpec::Command(line) => McpTransport::Stdio(
                ServerCommand::parse(line).map_err(|e| format!("failed to {e}"))?,
            ),
            McpServerSpec::Url { url, token_env } => {
                let parsed = reqwest::Url::parse(url)
                    .map_err(|e| format!("--mcp-url `{url}` is not a URL: {e}"))?;
                if !matches!(parsed.scheme(), "http" | "https")
                    || !parsed.username().is_empty()
                    || parsed.password().is_some()
                {
                    return Err(format!(
                        "--mcp-url `{url}` must be http:// or https://, without credentials \
                         (the token goes in the variable --mcp-token-env names)"
                    ));
                }
                let token = match token_env {
                    Some(name) => match std::env::var(name) {
                        Ok(token) if !token.is_empty() => Some(token),
                        _ => {
                            return Err(format!(
                                "--mcp-token-env names {name}, which is not set or is empty"
                            ));
                        }
                    },
                    None => None,
                };
                McpTransport::Http(HttpServer {
                    url: url.clone(),
                    token,
                })
            }
        };
        let map = ToolMap::load(tool_map).map_err(|e| format!("failed to {e}"))?;
        Ok(Some(McpServer { transport, map }))
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

    fn command(line: &str) -> McpServerSpec {
        McpServerSpec::Command(line.to_owned())
    }

    fn url(url: &str, token_env: Option<&str>) -> McpServerSpec {
        McpServerSpec::Url {
            url: url.to_owned(),
            token_env: token_env.map(str::to_owned),
        }
    }

    #[test]
    fn the_profile_needs_its_server_and_others_refuse_one() {
        assert!(Mcp.mcp_server(None, "reference").is_err());
        let server = Mcp
            .mcp_server(Some(&command("sandspec mcp")), "reference")
            .unwrap()
            .unwrap();
        let McpTransport::Stdio(cmd) = &server.transport else {
            panic!("a command line is a stdio server: {server:?}");
        };
        assert_eq!(cmd.argv, ["sandspec", "mcp"]);
        assert!(server.follows_deployment());
        let v1 = super::super::v1::V1;
        assert_eq!(
            v1.mcp_server(Some(&command("x")), "reference").unwrap_err(),
            "--mcp-server needs --api mcp"
        );
        assert_eq!(
            v1.mcp_server(Some(&url("http://127.0.0.1:1/mcp", None)), "reference")
                .unwrap_err(),
            "--mcp-url needs --api mcp"
        );
    }

    #[test]
    fn an_http_server_is_a_checked_url_with_a_token_from_the_environment() {
        let server = Mcp
            .mcp_server(Some(&url("http://127.0.0.1:1/mcp", None)), "reference")
            .unwrap()
            .unwrap();
        let McpTransport::Http(http) = &server.transport else {
            panic!("a URL is an HTTP server: {server:?}");
        };
        assert_eq!(
            (http.url.as_str(), &http.token),
            ("http://127.0.0.1:1/mcp", &None)
        );
        assert!(!server.follows_deployment());
        // PATH is set in every test process; its value stands for a token.
        let path = std::env::var("PATH").unwrap();
        let server = Mcp
            .mcp_server(
                Some(&url("https://mcp.test/mcp", Some("PATH"))),
                "reference",
            )
            .unwrap()
            .unwrap();
        let McpTransport::Http(http) = &server.transport else {
            panic!("{server:?}");
        };
        assert_eq!(http.token.as_deref(), Some(path.as_str()));
        assert!(
            !format!("{server:?}").contains(&path),
            "the token is never shown"
        );
        for (bad, says) in [
            (
                url("ftp://127.0.0.1/mcp", None),
                "must be http:// or https://",
            ),
            (url("http://u:p@127.0.0.1/mcp", None), "without credentials"),
            (url("not a url", None), "is not a URL"),
            (
                url("http://127.0.0.1/mcp", Some("SANDSPEC_NO_SUCH_VARIABLE")),
                "--mcp-token-env names SANDSPEC_NO_SUCH_VARIABLE, which is not set",
            ),
        ] {
            let err = Mcp.mcp_server(Some(&bad), "reference").unwrap_err();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }
}
