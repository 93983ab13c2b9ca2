//! `mcp`: an agent's action through the sandbox MCP server under test (MCP profile). Each
//! named session is, on stdio, a server process of its own, started at its first action with
//! the tool map's environment (the target's base URL and the owner's key), and over HTTP an
//! HTTP session of its own with the server at the run's URL; an action is the one tool call
//! the map binds to it, judged by whether the tool accepted or refused it and by the handle the
//! result names; `shutdown` ends the session as a client does (stdin closed, or the session's
//! `DELETE`). Every exchange goes into the transcript as a note, in order.

use std::time::Duration;

use serde_json::{Map, Value};

use serde::Deserialize;

use super::kind::StepKind;

use crate::engine::context::{Ctx, StepError};
use crate::engine::expect::json_check;
use crate::mcp::toolmap::provider_of;
use crate::mcp::{Action, McpError, McpSession, McpTransport, RunSession, ServerCommand, toolmap};
use crate::profile::e2b::{DOMAIN, Router};
use crate::scenario::{CheckCtx, Checker, JsonCheck, Located, Pos, Scope, present};

/// An action of an agent through the sandbox MCP server under test, for the MCP profile:
/// one tool call that the run's tool map binds to the action, or the end of the session.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mcp {
    #[serde(default)]
    pub name: Option<String>,
    /// Which MCP server process: each session name is a server of its own, started at its
    /// first action.
    #[serde(default = "main_session")]
    pub session: String,
    pub action: crate::mcp::Action,
    /// The action's parameters (`sandbox`, `timeout_s`, `cpu`, `memory_mb`, `command`);
    /// strings may hold `{{var}}`.
    #[serde(default, rename = "with", deserialize_with = "present")]
    pub params: Option<Located<serde_json::Value>>,
    /// The tool must refuse (`isError: true`); otherwise it must succeed.
    #[serde(default)]
    pub refused: bool,
    /// The handle in the result must be provider-qualified (`provider:id`).
    #[serde(default)]
    pub qualified: bool,
    /// Send the call and go on without its answer (a create in flight at a shutdown).
    #[serde(default)]
    pub in_flight: bool,
    /// Checks on the tool's result value.
    #[serde(default)]
    pub json: Vec<JsonCheck>,
    /// Captures the handle the result names.
    #[serde(default)]
    pub capture_handle: Option<Located<String>>,
    /// Captures the control plane's sandbox ID of that handle (without its provider).
    #[serde(default)]
    pub capture_sandbox: Option<Located<String>>,
}

fn main_session() -> String {
    "main".to_owned()
}

/// How long a server has to exit after stdin closes, and again after SIGTERM; over HTTP, half
/// of how long it has to answer the session's `DELETE`.
pub(in crate::engine) const GRACE: Duration = Duration::from_secs(15);
/// How long one tool call may take: a server under test may start slowly (an interpreter
/// importing its SDK) and a create waits for the control plane.
const CALL_WAIT: Duration = Duration::from_secs(60);

impl StepKind for Mcp {
    fn label(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| format!("mcp {} ({})", self.action.name(), self.session))
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        let m = self;
        let pos = m
            .params
            .as_ref()
            .map(Pos::of)
            .or(m.capture_handle.as_ref().map(Pos::of))
            .unwrap_or_default();
        if let Some(p) = &m.params {
            match &p.value {
                serde_json::Value::Object(map) => {
                    for k in map.keys() {
                        if !crate::mcp::toolmap::PARAMS.contains(&k.as_str()) {
                            c.err(
                                Pos::of(p),
                                format!(
                                    "`with` parameter `{k}` is unknown; parameters are {}",
                                    crate::mcp::toolmap::PARAMS.join(", ")
                                ),
                            );
                        }
                    }
                }
                _ => c.err(Pos::of(p), "`with` must be a mapping of parameters"),
            }
            c.json_value(p, scope, ctx);
        }
        if m.action == Action::Shutdown
            && (m.params.is_some()
                || m.refused
                || m.qualified
                || m.in_flight
                || !m.json.is_empty()
                || m.capture_handle.is_some()
                || m.capture_sandbox.is_some())
        {
            c.err(pos, "an `mcp` shutdown takes only `name` and `session`");
        }
        if m.in_flight
            && (m.action != Action::Create
                || m.refused
                || m.qualified
                || !m.json.is_empty()
                || m.capture_handle.is_some()
                || m.capture_sandbox.is_some())
        {
            c.err(
                pos,
                "`in_flight` is for a create whose answer is not awaited: nothing to check or capture",
            );
        }
        if m.refused && (m.qualified || m.capture_handle.is_some() || m.capture_sandbox.is_some()) {
            c.err(pos, "a refused call names no handle to check or capture");
        }
        for check in &m.json {
            c.json_check(check, scope, ctx);
        }
        for name in [&m.capture_handle, &m.capture_sandbox]
            .into_iter()
            .flatten()
        {
            c.define_capture(&name.value, Pos::of(name), scope);
        }
    }

    fn waits(&self, _ctx: &Ctx<'_>) -> Duration {
        match self.action {
            Action::Shutdown => GRACE * 2,
            _ => CALL_WAIT,
        }
    }

    fn expects_success(&self) -> bool {
        !self.refused && self.action != Action::Shutdown
    }

    /// A create through the MCP server makes a sandbox on the control plane.
    fn sandboxes(
        &self,
        _vars: &crate::engine::vars::Vars<'_>,
        _profile: &dyn crate::profile::Profile,
    ) -> u64 {
        u64::from(self.action == crate::mcp::Action::Create)
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        ctx.mcp(self, label).await
    }
}

impl Ctx<'_> {
    async fn mcp(&mut self, m: &Mcp, label: &str) -> Result<(), StepError> {
        let Some(server) = self.target.mcp.as_ref() else {
            return Err(StepError::Error(
                "the run drives no MCP server (`--api mcp --mcp-server ...`)".into(),
            ));
        };
        if m.action == Action::Shutdown {
            let Some(mut s) = self.mcp_sessions.remove(&m.session) else {
                return Err(StepError::Error(format!(
                    "MCP session `{}` was never started",
                    m.session
                )));
            };
            let ended = s.session.shutdown(GRACE).await;
            self.record_mcp(&m.session, &mut s, label);
            return match ended {
                Ok(_) => Ok(()),
                // A session that cannot be ended leaves the scenario unjudged, not failed.
                Err(e @ McpError::NoEnd(_)) => Err(StepError::Error(format!("failed to {e}"))),
                Err(e) => Err(StepError::Fail(format!("failed to {e}"))),
            };
        }
        let Some(binding) = server.map.binding(m.action) else {
            return Err(StepError::Error(format!(
                "the tool map `{}` binds no tool to `{}`",
                server.map.name,
                m.action.name()
            )));
        };
        let params: Map<String, Value> = match &m.params {
            Some(p) => match self.vars.render_json(&p.value)? {
                Value::Object(map) => map,
                _ => Map::new(),
            },
            None => Map::new(),
        };
        let args = binding.arguments(&params);
        if !self.mcp_sessions.contains_key(&m.session) {
            let map = &server.map;
            // A server that knows a deployment only by E2B's host names reaches the target's
            // envd domain when it has one, else the router's domain through the router.
            let mut router = None;
            let started = match &server.transport {
                McpTransport::Stdio(command) => {
                    let mut env: Vec<(String, String)> = command
                        .env
                        .iter()
                        .cloned()
                        .chain(map.environment(&self.target.base_url, &self.target.tokens.owner))
                        .collect();
                    if map.env.domain.is_some() {
                        match self.target.envd_domain.as_deref() {
                            Some(domain) => env.extend(map.routed(domain, None)),
                            None => {
                                let r = Router::start(
                                    &self.target.base_url,
                                    self.target.client.clone(),
                                )
                                .await
                                .map_err(|e| {
                                    StepError::Error(format!("failed to start the router: {e}"))
                                })?;
                                env.extend(map.routed(DOMAIN, Some((&r.proxy_url, r.ca_file()))));
                                router = Some(r);
                            }
                        }
                    }
                    let command = ServerCommand {
                        argv: command.argv.clone(),
                        env,
                    };
                    self.secrets.push(self.target.tokens.owner.clone());
                    tokio::time::timeout(CALL_WAIT, McpSession::start(&command, self.target.limits))
                        .await
                }
                McpTransport::Http(http) => {
                    self.secrets.extend(http.token.iter().cloned());
                    let client = self
                        .target
                        .fresh_client()
                        .map_err(|e| StepError::Error(e.to_string()))?;
                    let limits = self.target.limits;
                    tokio::time::timeout(CALL_WAIT, McpSession::connect(http, client, limits)).await
                }
            };
            let session = started
                .map_err(|_| {
                    StepError::Fail(format!(
                        "the MCP server did not finish `initialize` within {}s",
                        CALL_WAIT.as_secs()
                    ))
                })?
                .map_err(|e| StepError::Fail(format!("failed to {e}")))?;
            self.mcp_sessions.insert(
                m.session.clone(),
                RunSession {
                    session,
                    recorded: 0,
                    router,
                },
            );
        }
        let mut s = self
            .mcp_sessions
            .remove(&m.session)
            .expect("the session was just started");
        let result = if m.in_flight {
            s.session
                .call_tool_in_flight(&binding.tool, args)
                .map(|task| {
                    // Its answer, if one comes, belongs to a session that is about to end.
                    drop(task);
                    None
                })
        } else {
            match tokio::time::timeout(
                CALL_WAIT,
                s.session.call_tool(&binding.tool, Value::Object(args)),
            )
            .await
            {
                Ok(r) => r.map(Some),
                Err(_) => Err(crate::mcp::McpError::Request {
                    method: "tools/call".into(),
                    message: format!("no answer within {}s", CALL_WAIT.as_secs()),
                }),
            }
        };
        self.record_mcp(&m.session, &mut s, label);
        self.mcp_sessions.insert(m.session.clone(), s);
        let mut reply = match result {
            Ok(Some(reply)) => reply,
            Ok(None) => return Ok(()),
            Err(e) => return Err(StepError::Fail(format!("failed to {e}"))),
        };
        reply.value = server.map.value(&reply.value);
        let tool = &binding.tool;
        if m.refused {
            return if reply.is_error {
                Ok(())
            } else {
                Err(StepError::Fail(format!(
                    "`{tool}` accepted what it must refuse: {}",
                    reply.text
                )))
            };
        }
        if reply.is_error {
            return Err(StepError::Fail(format!("`{tool}` refused: {}", reply.text)));
        }
        self.saw_success = true;
        // A sandbox the server created counts in what the run consumed, by the handle its
        // tool returned (when the map says where it is).
        if m.action == crate::mcp::Action::Create
            && let Some(handle) = binding.handle(&reply.value, &params)
        {
            self.target
                .usage
                .sandbox_created(&format!("/sandboxes/{}", toolmap::sandbox_of(&handle)));
        }
        let mut failures = Vec::new();
        for check in &m.json {
            if let Err(msg) = json_check(check, &reply.value, &self.vars) {
                failures.push(msg);
            }
        }
        if !failures.is_empty() {
            return Err(StepError::Fail(failures.join("; ")));
        }
        if !(m.qualified || m.capture_handle.is_some() || m.capture_sandbox.is_some()) {
            return Ok(());
        }
        let Some(handle) = binding.handle(&reply.value, &params) else {
            return Err(StepError::Fail(format!(
                "the result of `{tool}` names no handle at `{}`: {}",
                binding.handle.as_deref().unwrap_or("(the `sandbox` given)"),
                reply.value
            )));
        };
        if m.qualified && provider_of(&handle).is_none() {
            return Err(StepError::Fail(format!(
                "`{tool}` returned the handle `{handle}`, which names no provider \
                 (`provider:id`)"
            )));
        }
        if let Some(name) = &m.capture_sandbox {
            self.vars.captures.insert(
                name.value.clone(),
                Value::String(toolmap::sandbox_of(&handle).to_owned()),
            );
        }
        if let Some(name) = &m.capture_handle {
            self.vars
                .captures
                .insert(name.value.clone(), Value::String(handle));
        }
        Ok(())
    }

    /// The session's exchanges since the last call, as transcript notes.
    fn record_mcp(&mut self, name: &str, s: &mut RunSession, label: &str) {
        let new: Vec<String> = s.session.exchanges()[s.recorded..]
            .iter()
            .map(|e| {
                format!(
                    "{label}: mcp session `{name}` {} {} -> {}",
                    e.method, e.params, e.result
                )
            })
            .collect();
        s.recorded = s.session.exchanges().len();
        for text in new {
            self.note(text);
        }
    }

    /// Ends every session a scenario left running, as a client would, before its cleanup
    /// and leak check look at the control plane.
    pub(in crate::engine) async fn end_mcp_sessions(&mut self) {
        let names: Vec<String> = self.mcp_sessions.keys().cloned().collect();
        for name in names {
            if let Some(mut s) = self.mcp_sessions.remove(&name) {
                let ended = s.session.shutdown(GRACE).await;
                self.record_mcp(&name, &mut s, "end of steps");
                if let Err(e) = ended {
                    self.note(format!("mcp session `{name}`: failed to {e}"));
                }
            }
        }
    }
}
