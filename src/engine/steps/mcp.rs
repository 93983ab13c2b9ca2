//! `mcp`: an agent's action through the sandbox MCP server under test (MCP profile). Each
//! named session is a server process of its own, started at its first action with the tool
//! map's environment (the target's base URL and the owner's key); an action is the one tool
//! call the map binds to it, judged by whether the tool accepted or refused it and by the
//! handle the result names; `shutdown` ends the session as a client does. Every exchange goes
//! into the transcript as a note, in order.

use std::time::Duration;

use serde_json::{Map, Value};

use super::StepKind;
use crate::engine::context::{Ctx, StepError};
use crate::engine::expect::json_check;
use crate::mcp::toolmap::provider_of;
use crate::mcp::{Action, McpSession, ServerCommand, toolmap};
use crate::scenario::Mcp;

/// How long a server has to exit after stdin closes, and again after SIGTERM.
pub(in crate::engine) const GRACE: Duration = Duration::from_secs(15);
/// How long one tool call may take: a server under test may start slowly (an interpreter
/// importing its SDK) and a create waits for the control plane.
const CALL_WAIT: Duration = Duration::from_secs(60);

/// One MCP server process of a scenario run.
pub(in crate::engine) struct Session {
    session: McpSession,
    /// How many of the session's exchanges are in the transcript already.
    recorded: usize,
}

impl StepKind for Mcp {
    fn waits(&self, _ctx: &Ctx<'_>) -> Duration {
        match self.action {
            Action::Shutdown => GRACE * 2,
            _ => CALL_WAIT,
        }
    }

    fn expects_success(&self) -> bool {
        !self.refused && self.action != Action::Shutdown
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
            return ended
                .map(|_| ())
                .map_err(|e| StepError::Fail(format!("failed to {e}")));
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
            let command = ServerCommand {
                argv: server.command.argv.clone(),
                env: server
                    .command
                    .env
                    .iter()
                    .cloned()
                    .chain(
                        server
                            .map
                            .environment(&self.target.base_url, &self.target.tokens.owner),
                    )
                    .collect(),
            };
            self.secrets.push(self.target.tokens.owner.clone());
            let session = tokio::time::timeout(CALL_WAIT, McpSession::start(&command))
                .await
                .map_err(|_| {
                    StepError::Fail(format!(
                        "the MCP server did not finish `initialize` within {}s",
                        CALL_WAIT.as_secs()
                    ))
                })?
                .map_err(|e| StepError::Fail(format!("failed to {e}")))?;
            self.mcp_sessions.insert(
                m.session.clone(),
                Session {
                    session,
                    recorded: 0,
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
        let reply = match result {
            Ok(Some(reply)) => reply,
            Ok(None) => return Ok(()),
            Err(e) => return Err(StepError::Fail(format!("failed to {e}"))),
        };
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
    fn record_mcp(&mut self, name: &str, s: &mut Session, label: &str) {
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
