//! One MCP client session with a server started as a child process: initialize, list tools,
//! call tools, and end the session as a client does — close stdin, wait a grace period,
//! SIGTERM, wait again, SIGKILL last — recording every exchange for the transcript.

use std::process::Stdio;
use std::time::Duration;

use rmcp::ServiceExt as _;
use rmcp::model::{CallToolRequestParams, CallToolResult, JsonObject};
use rmcp::service::{RoleClient, RunningService};
use serde_json::Value;
use tokio::process::{Child, Command};

use crate::target::{CappedReader, Framing, Meter, ReadLimits, Tripped};

/// One MCP server process of a scenario run, and how much of what it exchanged the run's
/// transcript holds already.
pub struct RunSession {
    pub session: McpSession,
    /// How many of the session's exchanges are in the transcript already.
    pub recorded: usize,
    /// The router the server reaches E2B's host names through, for a tool map with
    /// `env.domain`; it lives as long as the session.
    pub router: Option<crate::profile::e2b::Router>,
}

/// How to start the server under test.
#[derive(Debug, Clone)]
pub struct ServerCommand {
    /// Program and arguments, already split.
    pub argv: Vec<String>,
    /// Variables added to the child's environment (control-plane URL and key, mostly).
    pub env: Vec<(String, String)>,
}

impl ServerCommand {
    /// Splits a command line on whitespace, honouring single and double quotes (no escapes
    /// beyond that: the line comes from a flag, not from a shell script).
    pub fn parse(line: &str) -> Result<Self, McpError> {
        let mut argv = Vec::new();
        let mut cur = String::new();
        let mut quote: Option<char> = None;
        let mut in_word = false;
        for c in line.chars() {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), c) => cur.push(c),
                (None, '\'' | '"') => {
                    quote = Some(c);
                    in_word = true;
                }
                (None, c) if c.is_whitespace() => {
                    if in_word {
                        argv.push(std::mem::take(&mut cur));
                        in_word = false;
                    }
                }
                (None, c) => {
                    cur.push(c);
                    in_word = true;
                }
            }
        }
        if quote.is_some() {
            return Err(McpError::Command(format!("unclosed quote in `{line}`")));
        }
        if in_word {
            argv.push(cur);
        }
        if argv.is_empty() {
            return Err(McpError::Command("the MCP server command is empty".into()));
        }
        Ok(Self {
            argv,
            env: Vec::new(),
        })
    }
}

/// Errors of the MCP client session. Messages read after "failed to ...".
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    #[error("start the MCP server: {0}")]
    Command(String),
    #[error("initialize the MCP session: {0}")]
    Initialize(String),
    #[error("call `{method}` on the MCP server: {message}")]
    Request { method: String, message: String },
    #[error("end the MCP server process: {0}")]
    Shutdown(String),
}

/// One request and its answer (or the error in its place), as the transcript shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Exchange {
    pub method: String,
    pub params: Value,
    /// The result as the server sent it, or `{"error": "..."}` when the request failed.
    pub result: Value,
}

/// What a tool call returned, in the shapes a tool map can point into.
#[derive(Debug, Clone)]
pub struct ToolReply {
    /// `isError` of the result.
    pub is_error: bool,
    /// `structuredContent` if the server sent one, else the first text block parsed as JSON,
    /// else that text as a JSON string.
    pub value: Value,
    /// Every text block, joined by newlines.
    pub text: String,
}

/// How the server process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shutdown {
    /// It exited on its own after stdin closed, within the grace period.
    ExitedOnEof,
    /// It needed SIGTERM.
    Terminated,
    /// It ignored SIGTERM and was killed.
    Killed,
}

/// A running client session. Dropping it kills the child (`kill_on_drop`), so a failed
/// scenario never leaves a server behind; [`McpSession::shutdown`] is the orderly end.
pub struct McpSession {
    /// The server process: owned here so the session decides how it ends.
    child: Child,
    /// The rmcp client; it owns the child's stdin and stdout, and closing it closes stdin.
    client: Option<RunningService<RoleClient, ()>>,
    /// Every exchange so far, in order.
    exchanges: Vec<Exchange>,
    /// What the cap on the server's messages refused, if anything: the session ended there.
    tripped: Tripped,
}

impl McpSession {
    /// Starts the server and runs the MCP `initialize` handshake. Its messages are read under
    /// the event cap of `limits` (`--max-event-bytes`): the first one over it ends the session.
    pub async fn start(cmd: &ServerCommand, limits: ReadLimits) -> Result<Self, McpError> {
        let (program, args) = cmd
            .argv
            .split_first()
            .ok_or_else(|| McpError::Command("the MCP server command is empty".into()))?;
        let mut child = Command::new(program)
            .args(args)
            .envs(cmd.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| McpError::Command(format!("`{program}`: {e}")))?;
        let stdin = child.stdin.take().expect("stdin is piped");
        let stdout = child.stdout.take().expect("stdout is piped");
        let (stdout, tripped) = CappedReader::new(stdout, Meter::stream(limits, Framing::McpLines));
        let client = ().serve((stdout, stdin)).await.map_err(|e| {
            McpError::Initialize(match tripped.get() {
                Some(t) => t.to_string(),
                None => e.to_string(),
            })
        })?;
        let server = client
            .peer_info()
            .map(|info| serde_json::to_value(&*info).unwrap_or(Value::Null))
            .unwrap_or(Value::Null);
        Ok(Self {
            child,
            client: Some(client),
            exchanges: vec![Exchange {
                method: "initialize".into(),
                params: Value::Null,
                result: server,
            }],
            tripped,
        })
    }

    fn client(&self, method: &str) -> Result<&RunningService<RoleClient, ()>, McpError> {
        self.client.as_ref().ok_or_else(|| McpError::Request {
            method: method.into(),
            message: "the session has ended".into(),
        })
    }

    /// `tools/list`, every page: the tool names in the server's order.
    pub async fn list_tools(&mut self) -> Result<Vec<String>, McpError> {
        let result = self.client("tools/list")?.list_all_tools().await;
        match result {
            Ok(tools) => {
                let names: Vec<String> = tools.iter().map(|t| t.name.to_string()).collect();
                self.exchanges.push(Exchange {
                    method: "tools/list".into(),
                    params: Value::Null,
                    result: serde_json::json!({ "tools": names }),
                });
                Ok(names)
            }
            Err(e) => Err(self.failed("tools/list", Value::Null, e.to_string())),
        }
    }

    /// `tools/call`. A result with `isError` is a reply, not an error: the caller judges it.
    pub async fn call_tool(&mut self, name: &str, arguments: Value) -> Result<ToolReply, McpError> {
        let params = serde_json::json!({ "name": name, "arguments": arguments });
        let args: JsonObject = match arguments {
            Value::Object(map) => map,
            Value::Null => JsonObject::new(),
            other => {
                return Err(McpError::Request {
                    method: "tools/call".into(),
                    message: format!("arguments must be an object, not {other}"),
                });
            }
        };
        let request = CallToolRequestParams::new(name.to_owned()).with_arguments(args);
        let result = self.client("tools/call")?.call_tool(request).await;
        match result {
            Ok(result) => {
                let reply = reply_of(&result);
                self.exchanges.push(Exchange {
                    method: "tools/call".into(),
                    params,
                    result: serde_json::to_value(&result).unwrap_or(Value::Null),
                });
                Ok(reply)
            }
            Err(e) => Err(self.failed("tools/call", params, e.to_string())),
        }
    }

    /// Sends a `tools/call` and returns without waiting for its answer, so that the session
    /// can be ended while the call is in flight. The request is recorded with its result
    /// `{"in_flight": true}`: its answer, if any comes, belongs to a session that has ended.
    pub fn call_tool_in_flight(
        &mut self,
        name: &str,
        arguments: JsonObject,
    ) -> Result<tokio::task::JoinHandle<Result<ToolReply, String>>, McpError> {
        let peer = self.client("tools/call")?.peer().clone();
        self.exchanges.push(Exchange {
            method: "tools/call".into(),
            params: serde_json::json!({ "name": name, "arguments": arguments }),
            result: serde_json::json!({ "in_flight": true }),
        });
        let request = CallToolRequestParams::new(name.to_owned()).with_arguments(arguments);
        Ok(tokio::spawn(async move {
            peer.call_tool(request)
                .await
                .map(|r| reply_of(&r))
                .map_err(|e| e.to_string())
        }))
    }

    fn failed(&mut self, method: &str, params: Value, message: String) -> McpError {
        // A message over the cap ended the session: that is why the call failed.
        let message = match self.tripped.get() {
            Some(t) => format!("{t}; the session ended"),
            None => message,
        };
        self.exchanges.push(Exchange {
            method: method.into(),
            params,
            result: serde_json::json!({ "error": message }),
        });
        McpError::Request {
            method: method.into(),
            message,
        }
    }

    /// The exchanges so far.
    pub fn exchanges(&self) -> &[Exchange] {
        &self.exchanges
    }

    /// Ends the session as a client does: close stdin and wait up to `grace` for the server
    /// to exit; then SIGTERM and wait `grace` again; then SIGKILL.
    pub async fn shutdown(&mut self, grace: Duration) -> Result<Shutdown, McpError> {
        if let Some(client) = self.client.take() {
            // Cancelling the service drops the transport, which closes the child's stdin.
            let _ = client.cancel().await;
        }
        let how = if wait_for(&mut self.child, grace).await? {
            Shutdown::ExitedOnEof
        } else {
            if let Some(pid) = self.child.id() {
                // SAFETY: kill(2) on our own child's pid; it has not been reaped yet.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
            }
            if wait_for(&mut self.child, grace).await? {
                Shutdown::Terminated
            } else {
                self.child
                    .kill()
                    .await
                    .map_err(|e| McpError::Shutdown(e.to_string()))?;
                Shutdown::Killed
            }
        };
        self.exchanges.push(Exchange {
            method: "shutdown".into(),
            params: serde_json::json!({ "grace_ms": grace.as_millis() as u64 }),
            result: serde_json::to_value(how).unwrap_or(Value::Null),
        });
        Ok(how)
    }
}

/// True when the child exited within `within`.
async fn wait_for(child: &mut Child, within: Duration) -> Result<bool, McpError> {
    match tokio::time::timeout(within, child.wait()).await {
        Ok(Ok(_)) => Ok(true),
        Ok(Err(e)) => Err(McpError::Shutdown(e.to_string())),
        Err(_) => Ok(false),
    }
}

fn reply_of(result: &CallToolResult) -> ToolReply {
    let texts: Vec<&str> = result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.as_str()))
        .collect();
    let text = texts.join("\n");
    let value = match (&result.structured_content, texts.first()) {
        (Some(v), _) => v.clone(),
        (None, Some(first)) => {
            serde_json::from_str(first).unwrap_or_else(|_| Value::String((*first).to_owned()))
        }
        (None, None) => Value::Null,
    };
    ToolReply {
        is_error: result.is_error.unwrap_or(false),
        value,
        text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_split_like_a_shell_would_for_simple_quoting() {
        let c = ServerCommand::parse(r#"python -m "agent_sandbox.agent.mcp" --x 'a b'"#).unwrap();
        assert_eq!(
            c.argv,
            ["python", "-m", "agent_sandbox.agent.mcp", "--x", "a b"]
        );
        assert!(ServerCommand::parse("  ").is_err());
        assert!(ServerCommand::parse("a 'b").is_err());
        assert_eq!(ServerCommand::parse("a ''").unwrap().argv, ["a", ""]);
    }
}
