//! One MCP client session with a server under test, over the stdio of a child process the
//! session starts or over streamable HTTP to a server already running: initialize, list tools,
//! call tools, and end the session as a client does (on stdio: close stdin, wait a grace
//! period, SIGTERM, wait again, SIGKILL last; over HTTP: `DELETE` the session), recording
//! every exchange for the transcript.

use std::process::Stdio;
use std::time::Duration;

use rmcp::ServiceExt as _;
use rmcp::model::{CallToolRequestParams, CallToolResult, JsonObject};
use rmcp::service::{RoleClient, RunningService};
use serde_json::Value;
use tokio::process::{Child, Command};

use super::http::{self, Deleted, HttpLink};
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
    #[error("end the MCP session: {0}")]
    End(String),
    /// The session has no end a client can bring about, so what the server does at the end
    /// cannot be judged.
    #[error("end the MCP session: {0}")]
    NoEnd(String),
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

/// How the session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shutdown {
    /// The server process exited on its own after stdin closed, within the grace period.
    ExitedOnEof,
    /// It needed SIGTERM.
    Terminated,
    /// It ignored SIGTERM and was killed.
    Killed,
    /// Over HTTP: the server answered the session's `DELETE` with success.
    Deleted,
    /// Over HTTP: the `DELETE` found the session gone already (404): it had expired.
    Expired,
}

/// The server under test over streamable HTTP: where, and the bearer token, if any.
#[derive(Clone)]
pub struct HttpServer {
    /// The MCP endpoint's URL (`--mcp-url`), e.g. `http://127.0.0.1:8000/mcp`.
    pub url: String,
    /// Sent as `Authorization: Bearer`; never recorded.
    pub token: Option<String>,
}

impl std::fmt::Debug for HttpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpServer")
            .field("url", &self.url)
            .field("token", &self.token.as_ref().map(|_| ".."))
            .finish()
    }
}

/// What carries a session's messages, and so how it ends.
enum Link {
    /// The server process, owned here so the session decides how it ends.
    Stdio(Child),
    /// The HTTP endpoint, the client requests go through, and what the transport saw.
    Http {
        server: HttpServer,
        http: reqwest::Client,
        link: HttpLink,
    },
}

/// A running client session. Dropping it kills a child server (`kill_on_drop`) and has rmcp
/// `DELETE` an HTTP session, so a failed scenario never leaves a session behind;
/// [`McpSession::shutdown`] is the orderly end.
pub struct McpSession {
    link: Link,
    /// The rmcp client; over stdio it owns the child's stdin and stdout, and closing it
    /// closes stdin.
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
        Ok(Self::initialized(Link::Stdio(child), client, tripped))
    }

    /// Connects to a server over streamable HTTP and runs the `initialize` handshake, which
    /// opens its session. `http` is the runner's client (TLS settings, no redirects); each
    /// message the server sends (an SSE event or a JSON body) is read under the event cap of
    /// `limits` (`--max-event-bytes`), as on stdio.
    pub async fn connect(
        server: &HttpServer,
        http: reqwest::Client,
        limits: ReadLimits,
    ) -> Result<Self, McpError> {
        let (transport, link) = http::transport(
            &server.url,
            server.token.as_deref(),
            http.clone(),
            limits.event,
        );
        let client = ().serve(transport).await.map_err(|e| {
            McpError::Initialize(match link.refused() {
                Some(why) => format!("{e} ({why})"),
                None => e.to_string(),
            })
        })?;
        Ok(Self::initialized(
            Link::Http {
                server: server.clone(),
                http,
                link,
            },
            client,
            // The link, not a reader, says what the transport refused.
            Tripped::default(),
        ))
    }

    fn initialized(link: Link, client: RunningService<RoleClient, ()>, tripped: Tripped) -> Self {
        let server = client
            .peer_info()
            .map(|info| serde_json::to_value(&*info).unwrap_or(Value::Null))
            .unwrap_or(Value::Null);
        Self {
            link,
            client: Some(client),
            exchanges: vec![Exchange {
                method: "initialize".into(),
                params: Value::Null,
                result: server,
            }],
            tripped,
        }
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
        let refused = match &self.link {
            Link::Http { link, .. } => link.refused(),
            Link::Stdio(_) => None,
        };
        let message = match (self.tripped.get(), refused) {
            (Some(t), _) => format!("{t}; the session ended"),
            (None, Some(why)) => format!("{message} ({why})"),
            (None, None) => message,
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

    /// Ends the session as a client does. On stdio: close stdin and wait up to `grace` for
    /// the server to exit; then SIGTERM and wait `grace` again; then SIGKILL. Over HTTP:
    /// `DELETE` the session, and wait up to twice `grace` for the answer (the server may
    /// first dispose of what the session owns, as a process does before it exits).
    pub async fn shutdown(&mut self, grace: Duration) -> Result<Shutdown, McpError> {
        let ended = match &mut self.link {
            Link::Stdio(child) => end_child(child, self.client.take(), grace).await,
            Link::Http { server, http, link } => {
                end_http(server, http, link, self.client.take(), grace).await
            }
        };
        let result = match &ended {
            Ok(how) => serde_json::to_value(how).unwrap_or(Value::Null),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        };
        self.exchanges.push(Exchange {
            method: "shutdown".into(),
            params: serde_json::json!({ "grace_ms": grace.as_millis() as u64 }),
            result,
        });
        ended
    }
}

/// Closes the child's stdin (by dropping the client), then SIGTERM, then SIGKILL.
async fn end_child(
    child: &mut Child,
    client: Option<RunningService<RoleClient, ()>>,
    grace: Duration,
) -> Result<Shutdown, McpError> {
    if let Some(client) = client {
        // Cancelling the service drops the transport, which closes the child's stdin.
        let _ = client.cancel().await;
    }
    if wait_for(child, grace).await? {
        return Ok(Shutdown::ExitedOnEof);
    }
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) on our own child's pid; it has not been reaped yet.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    }
    if wait_for(child, grace).await? {
        return Ok(Shutdown::Terminated);
    }
    child
        .kill()
        .await
        .map_err(|e| McpError::Shutdown(e.to_string()))?;
    Ok(Shutdown::Killed)
}

/// Stops the client (its streams and requests; the session lives on the server until it is
/// deleted), then `DELETE`s the session.
async fn end_http(
    server: &HttpServer,
    http: &reqwest::Client,
    link: &HttpLink,
    client: Option<RunningService<RoleClient, ()>>,
    grace: Duration,
) -> Result<Shutdown, McpError> {
    let version = client
        .as_ref()
        .and_then(|c| c.peer_info())
        .map(|info| info.protocol_version.to_string());
    link.take_over_end();
    if let Some(client) = client {
        let _ = client.cancel().await;
    }
    let Some(session) = link.session() else {
        return Err(McpError::NoEnd(
            "the server gave the session no `Mcp-Session-Id`: a session without one has no \
             end a client can bring about"
                .into(),
        ));
    };
    let deleted = tokio::time::timeout(
        grace * 2,
        http::delete(
            http,
            &server.url,
            server.token.as_deref(),
            &session,
            version.as_deref(),
        ),
    )
    .await
    .map_err(|_| {
        McpError::End(format!(
            "the `DELETE` of the session had no answer within {}s",
            (grace * 2).as_secs()
        ))
    })?
    .map_err(|e| McpError::End(format!("the `DELETE` of the session failed: {e}")))?;
    match deleted {
        Deleted::Ended => Ok(Shutdown::Deleted),
        Deleted::AlreadyGone => Ok(Shutdown::Expired),
        Deleted::NotAllowed => Err(McpError::NoEnd(
            "the server answered the session's `DELETE` with 405: a client cannot end its \
             sessions, which end only when the server lets them expire"
                .into(),
        )),
        Deleted::Refused(status) => Err(McpError::End(format!(
            "the server answered the session's `DELETE` with {status}"
        ))),
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

    /// How the fake server below misbehaves.
    #[derive(Clone, Copy)]
    enum Hostile {
        /// Answers a tool call with one SSE event of this many bytes of text.
        Event(usize),
        /// Answers a tool call with a JSON body of this many bytes of text.
        Json(usize),
        /// Answers every request after `initialize` with 404: the session expired.
        Expires,
        /// Gives the session no `Mcp-Session-Id`.
        NoSession,
        /// Answers `DELETE` with 405.
        NoDelete,
    }

    /// A streamable HTTP MCP server that misbehaves as `how` says, and counts the
    /// `initialize` requests it got. A fake of the server under test: what a hostile one does
    /// cannot be had from a real one.
    async fn hostile(how: Hostile) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use http_body_util::{BodyExt as _, Full};
        use hyper::body::{Bytes, Incoming};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/mcp", listener.local_addr().unwrap());
        let inits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = inits.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let inits = counted.clone();
                let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                    let inits = inits.clone();
                    async move {
                        let method = req.method().clone();
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let message: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                        let reply = |status: u16, kind: &str, body: Vec<u8>| {
                            let mut r = hyper::Response::builder()
                                .status(status)
                                .header("content-type", kind);
                            if !matches!(how, Hostile::NoSession) {
                                r = r.header("mcp-session-id", "s1");
                            }
                            Ok::<_, std::convert::Infallible>(
                                r.body(Full::new(Bytes::from(body))).unwrap(),
                            )
                        };
                        if method == hyper::Method::DELETE {
                            return reply(405, "text/plain", Vec::new());
                        }
                        if method == hyper::Method::GET {
                            return reply(405, "text/plain", Vec::new());
                        }
                        let id = message["id"].clone();
                        match message["method"].as_str() {
                            Some("initialize") => {
                                inits.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                                let result = serde_json::json!({"jsonrpc": "2.0", "id": id,
                                    "result": {"protocolVersion": "2025-06-18",
                                    "capabilities": {"tools": {}},
                                    "serverInfo": {"name": "hostile", "version": "1"}}});
                                reply(200, "application/json", result.to_string().into_bytes())
                            }
                            _ if id.is_null() => reply(202, "text/plain", Vec::new()),
                            _ if matches!(how, Hostile::Expires) => {
                                reply(404, "text/plain", Vec::new())
                            }
                            _ if let Hostile::Event(size) = how => {
                                let text = "x".repeat(size);
                                let result = serde_json::json!({"jsonrpc": "2.0", "id": id,
                                    "result": {"content": [{"type": "text", "text": text}]}});
                                let event = format!("data: {result}\n\n");
                                reply(200, "text/event-stream", event.into_bytes())
                            }
                            _ if let Hostile::Json(size) = how => {
                                let text = "x".repeat(size);
                                let result = serde_json::json!({"jsonrpc": "2.0", "id": id,
                                    "result": {"content": [{"type": "text", "text": text}]}});
                                reply(200, "application/json", result.to_string().into_bytes())
                            }
                            _ => {
                                let result = serde_json::json!({"jsonrpc": "2.0", "id": id,
                                    "result": {"content": [{"type": "text", "text": "{}"}]}});
                                reply(200, "application/json", result.to_string().into_bytes())
                            }
                        }
                    }
                });
                tokio::spawn(async move {
                    let io = hyper_util::rt::TokioIo::new(socket);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await;
                });
            }
        });
        (url, inits)
    }

    async fn connect(url: &str) -> McpSession {
        let server = HttpServer {
            url: url.to_owned(),
            token: None,
        };
        // reqwest is built without a TLS provider of its own.
        let _ = rustls::crypto::ring::default_provider().install_default();
        McpSession::connect(&server, reqwest::Client::new(), CAP)
            .await
            .expect("initialize")
    }

    /// The run's caps in these tests: one message up to 64 KiB.
    const CAP: ReadLimits = ReadLimits {
        body: 1024 * 1024,
        event: 64 * 1024,
    };

    const GRACE: Duration = Duration::from_secs(2);

    #[tokio::test]
    async fn a_message_larger_than_the_cap_fails_the_call_and_says_so() {
        let cap = CAP.event as usize;
        for (half, whole) in [
            (Hostile::Event(cap / 2), Hostile::Event(cap)),
            (Hostile::Json(cap / 2), Hostile::Json(cap)),
        ] {
            let (url, _) = hostile(half).await;
            let mut session = connect(&url).await;
            let reply = session
                .call_tool("t", Value::Null)
                .await
                .expect("half the cap is read");
            assert_eq!(reply.text.len(), cap / 2);
            let (url, _) = hostile(whole).await;
            let mut session = connect(&url).await;
            let err = tokio::time::timeout(GRACE * 5, session.call_tool("t", Value::Null))
                .await
                .expect("the call ends")
                .expect_err("a message over the cap is not read");
            let said = err.to_string();
            assert!(said.contains("tools/call"), "{said}");
            assert!(
                said.contains(&format!("exceeds --max-event-bytes ({cap} bytes)")),
                "{said}"
            );
            let recorded = &session
                .exchanges()
                .last()
                .expect("the call is recorded")
                .result;
            assert!(
                recorded["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("--max-event-bytes")),
                "{recorded}"
            );
        }
    }

    #[tokio::test]
    async fn an_expired_session_is_not_replaced_by_a_new_one() {
        let (url, inits) = hostile(Hostile::Expires).await;
        let mut session = connect(&url).await;
        let err = session.call_tool("t", Value::Null).await.unwrap_err();
        assert!(err.to_string().to_lowercase().contains("expired"), "{err}");
        assert_eq!(inits.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_session_that_cannot_be_ended_is_said_so() {
        for (how, says) in [
            (Hostile::NoDelete, "405"),
            (Hostile::NoSession, "no `Mcp-Session-Id`"),
        ] {
            let (url, _) = hostile(how).await;
            let mut session = connect(&url).await;
            let reply = session.call_tool("t", Value::Null).await.expect("a reply");
            assert!(!reply.is_error);
            match session.shutdown(GRACE).await {
                Err(e @ McpError::NoEnd(_)) => assert!(e.to_string().contains(says), "{e}"),
                other => panic!("expected NoEnd, got {other:?}"),
            }
            let last = session
                .exchanges()
                .last()
                .expect("the shutdown is recorded");
            assert_eq!(last.method, "shutdown");
            assert!(
                last.result["error"]
                    .as_str()
                    .is_some_and(|e| e.contains(says))
            );
        }
    }
}
