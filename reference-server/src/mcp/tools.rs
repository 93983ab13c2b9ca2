//! The tools of `sandspec mcp` and what the session owns: which sandboxes it created (and
//! must kill at shutdown), which it only connected to (and must leave alone), and how many
//! creates are still in flight. A client that sets a logging level is told, in log messages at
//! or above it, what each tool call did.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

use rmcp::ErrorData;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Implementation, JsonObject,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
#[expect(
    deprecated,
    reason = "logging is deprecated from protocol 2026-07-28 on; the versions this server \
              speaks (2025-06-18, 2025-11-25) have it"
)]
use rmcp::model::{LoggingLevel, LoggingMessageNotificationParam, SetLevelRequestParams};
use rmcp::service::{RequestContext, RoleServer};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::control::{ControlError, ControlPlane};
use crate::defects::{Defect, Defects};

/// The provider prefix of every handle this server returns.
pub const PROVIDER: &str = "e2b";

/// The MCP server's state, shared by every request and by shutdown.
#[derive(Clone)]
pub struct SandboxTools {
    /// Where sandboxes are created and killed.
    control: ControlPlane,
    /// Negative controls; empty in a normal run.
    defects: Defects,
    /// Ownership, guarded by one lock so that shutdown and a completing create agree on who
    /// disposes of a late sandbox.
    state: Arc<Mutex<Owned>>,
    /// Number of creates in flight; shutdown waits for it to reach zero.
    in_flight: Arc<watch::Sender<usize>>,
    /// The least severity the client asked to be told of (`logging/setLevel`), as
    /// [`severity`] ranks it; none is sent before it asks.
    log_level: Arc<Mutex<Option<u8>>>,
}

/// The rank of a logging level, from `debug` (0) to `emergency` (7), as the protocol orders
/// them.
#[expect(deprecated, reason = "see the `use` of LoggingLevel")]
fn severity(level: LoggingLevel) -> u8 {
    match level {
        LoggingLevel::Debug => 0,
        LoggingLevel::Info => 1,
        LoggingLevel::Notice => 2,
        LoggingLevel::Warning => 3,
        LoggingLevel::Error => 4,
        LoggingLevel::Critical => 5,
        LoggingLevel::Alert => 6,
        LoggingLevel::Emergency => 7,
    }
}

#[derive(Default)]
struct Owned {
    /// Sandbox IDs this session created and has not killed.
    created: BTreeSet<String>,
    /// Sandbox IDs this session connected to without creating them.
    borrowed: BTreeSet<String>,
    /// Set at shutdown: a create that completes afterwards kills its sandbox itself.
    closed: bool,
}

fn lock(m: &Mutex<Owned>) -> MutexGuard<'_, Owned> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A tool call the server refuses: an `isError` result naming the problem.
fn refused(message: impl Into<String>) -> CallToolResult {
    CallToolResult::structured_error(json!({ "error": message.into() }))
}

fn control_refused(e: ControlError) -> CallToolResult {
    refused(format!("failed to {e}"))
}

impl SandboxTools {
    pub fn new(control: ControlPlane, defects: Defects) -> Self {
        Self {
            control,
            defects,
            state: Arc::default(),
            in_flight: Arc::new(watch::channel(0).0),
            log_level: Arc::default(),
        }
    }

    /// The log message that tells what a tool call did, when the client asked for messages of
    /// its severity: a refusal is a warning, anything else information.
    #[expect(deprecated, reason = "see the `use` of LoggingLevel")]
    fn log_of(
        &self,
        tool: &str,
        result: &CallToolResult,
    ) -> Option<LoggingMessageNotificationParam> {
        let level = if result.is_error == Some(true) {
            LoggingLevel::Warning
        } else {
            LoggingLevel::Info
        };
        let least = (*self.log_level.lock().unwrap_or_else(|p| p.into_inner()))?;
        if severity(level) < least {
            return None;
        }
        let data = json!({
            "tool": tool,
            "result": result.structured_content.clone().unwrap_or(Value::Null),
        });
        let mut param = LoggingMessageNotificationParam::new(level, data);
        param.logger = Some("sandspec-mcp".to_owned());
        Some(param)
    }

    fn handle(&self, id: &str) -> String {
        if self.defects.has(Defect::McpBareHandles) {
            id.to_owned()
        } else {
            format!("{PROVIDER}:{id}")
        }
    }

    /// A handle (`e2b:<id>`) or a bare sandbox ID (this server has one provider) to the ID.
    fn sandbox_id(arg: &str) -> Result<&str, String> {
        let id = match arg.split_once(':') {
            Some((PROVIDER, id)) => id,
            Some((other, _)) => {
                return Err(format!(
                    "handle `{arg}` names provider `{other}`; this server has only `{PROVIDER}`"
                ));
            }
            None => arg,
        };
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(format!("`{arg}` is not a sandbox handle"));
        }
        Ok(id)
    }

    fn tools() -> Vec<Tool> {
        fn schema(v: Value) -> Arc<JsonObject> {
            match v {
                Value::Object(m) => Arc::new(m),
                _ => unreachable!("schemas are objects"),
            }
        }
        let handle = json!({"type": "object", "properties": {"handle": {"type": "string"}},
            "required": ["handle"], "additionalProperties": false});
        vec![
            Tool::new(
                "create_sandbox",
                "Create a sandbox. Optional cpu and memory_mb are requirements: a sandbox granted \
                 less is killed and the call refused.",
                schema(json!({"type": "object", "properties": {
                    "timeout_s": {"type": "integer", "minimum": 1},
                    "cpu": {"type": "integer", "minimum": 1},
                    "memory_mb": {"type": "integer", "minimum": 1}},
                    "additionalProperties": false})),
            ),
            Tool::new(
                "connect_sandbox",
                "Connect to an existing sandbox by handle or sandbox ID. It is not this \
                 session's: shutdown leaves it running.",
                schema(handle.clone()),
            ),
            Tool::new("kill_sandbox", "Kill a sandbox by handle.", schema(handle)),
            Tool::new(
                "run_command",
                "Run a shell command in the sandbox the handle names and wait for its end. \
                 Without a handle the command runs in a sandbox made for it, killed before \
                 the call answers.",
                schema(json!({"type": "object", "properties": {
                    "handle": {"type": "string"},
                    "command": {"type": "string"}},
                    "required": ["command"], "additionalProperties": false})),
            ),
        ]
    }

    /// A tool call's result, or the protocol error of a tool this server does not have.
    async fn call(&self, name: &str, args: JsonObject) -> Result<CallToolResult, ErrorData> {
        let int = |k: &str| args.get(k).and_then(Value::as_u64);
        let str_arg = |k: &str| args.get(k).and_then(Value::as_str);
        Ok(match name {
            "create_sandbox" => {
                for (k, v) in &args {
                    if !matches!(k.as_str(), "timeout_s" | "cpu" | "memory_mb") {
                        return Ok(refused(format!("unknown argument `{k}`")));
                    }
                    if v.as_u64().is_none_or(|n| n == 0) {
                        return Ok(refused(format!("`{k}` must be a positive integer")));
                    }
                }
                self.create(
                    int("timeout_s").unwrap_or(300),
                    int("cpu"),
                    int("memory_mb"),
                )
                .await
            }
            "connect_sandbox" | "kill_sandbox" => {
                let Some(arg) = str_arg("handle") else {
                    return Ok(refused("`handle` (a string) is required"));
                };
                let id = match Self::sandbox_id(arg) {
                    Ok(id) => id.to_owned(),
                    Err(e) => return Ok(refused(e)),
                };
                if name == "connect_sandbox" {
                    self.connect(&id).await
                } else {
                    self.kill(&id).await
                }
            }
            "run_command" => {
                for k in args.keys() {
                    if !matches!(k.as_str(), "handle" | "command") {
                        return Ok(refused(format!("unknown argument `{k}`")));
                    }
                }
                let Some(command) = str_arg("command") else {
                    return Ok(refused("`command` (a string) is required"));
                };
                match args.get("handle") {
                    None => self.run_alone(command).await,
                    Some(Value::String(arg)) => match Self::sandbox_id(arg) {
                        Ok(id) => self.run(id, command).await,
                        Err(e) => refused(e),
                    },
                    Some(_) => refused("`handle` must be a string"),
                }
            }
            other => {
                return Err(ErrorData::invalid_params(
                    format!("unknown tool `{other}`"),
                    None,
                ));
            }
        })
    }

    /// Runs the create in a task of its own, so that it completes and is disposed of even when
    /// the request that started it is cancelled by the session ending.
    async fn create(
        &self,
        timeout_s: u64,
        cpu: Option<u64>,
        memory_mb: Option<u64>,
    ) -> CallToolResult {
        self.in_flight.send_modify(|n| *n += 1);
        let this = self.clone();
        let task = tokio::spawn(async move {
            let result = this.create_in_flight(timeout_s, cpu, memory_mb).await;
            this.in_flight.send_modify(|n| *n -= 1);
            result
        });
        match task.await {
            Ok(result) => result,
            Err(_) => refused("the create task failed"),
        }
    }

    async fn create_in_flight(
        &self,
        timeout_s: u64,
        cpu: Option<u64>,
        memory_mb: Option<u64>,
    ) -> CallToolResult {
        let id = match self.control.create(timeout_s).await {
            Ok(id) => id,
            Err(e) => return control_refused(e),
        };
        // Decide under the lock whether the session still exists to own it.
        let late = {
            let mut s = lock(&self.state);
            if !s.closed {
                s.created.insert(id.clone());
            }
            s.closed
        };
        if late {
            if self.defects.has(Defect::McpLateCreateLeaks) {
                return refused("the session ended while the sandbox was being created");
            }
            let _ = self.control.kill(&id).await;
            return refused("the session ended while the sandbox was being created; it was killed");
        }
        if (cpu.is_some() || memory_mb.is_some())
            && !self.defects.has(Defect::McpUnverifiedResources)
        {
            let shortfall = match self.control.get(&id).await {
                Ok(detail) => {
                    let granted_cpu = detail.get("cpuCount").and_then(Value::as_u64).unwrap_or(0);
                    let granted_mem = detail.get("memoryMB").and_then(Value::as_u64).unwrap_or(0);
                    let mut short = Vec::new();
                    if let Some(c) = cpu.filter(|&c| granted_cpu < c) {
                        short.push(format!("cpu {c} asked, {granted_cpu} granted"));
                    }
                    if let Some(m) = memory_mb.filter(|&m| granted_mem < m) {
                        short.push(format!("memory_mb {m} asked, {granted_mem} granted"));
                    }
                    short
                }
                Err(e) => vec![format!("the readback failed: {e}")],
            };
            if !shortfall.is_empty() {
                let killed = self.control.kill(&id).await;
                lock(&self.state).created.remove(&id);
                let tail = match killed {
                    Ok(()) => "the sandbox was killed".to_owned(),
                    Err(e) => format!("and failed to kill it: {e}"),
                };
                return refused(format!(
                    "resource requirement not met ({}); {tail}",
                    shortfall.join(", ")
                ));
            }
        }
        CallToolResult::structured(json!({ "handle": self.handle(&id), "created": true }))
    }

    async fn connect(&self, id: &str) -> CallToolResult {
        match self.control.connect(id).await {
            Ok(detail) => {
                let mut s = lock(&self.state);
                if !s.created.contains(id) {
                    s.borrowed.insert(id.to_owned());
                }
                drop(s);
                CallToolResult::structured(json!({
                    "handle": self.handle(id),
                    "created": false,
                    "state": detail.get("state").cloned().unwrap_or(Value::Null),
                }))
            }
            Err(e) => control_refused(e),
        }
    }

    async fn kill(&self, id: &str) -> CallToolResult {
        match self.control.kill(id).await {
            Ok(()) => {
                let mut s = lock(&self.state);
                s.created.remove(id);
                s.borrowed.remove(id);
                CallToolResult::structured(json!({ "handle": self.handle(id), "killed": true }))
            }
            Err(e) => control_refused(e),
        }
    }

    /// Runs `command` in the sandbox `id`.
    async fn run(&self, id: &str, command: &str) -> CallToolResult {
        let mut target = id.to_owned();
        if self.defects.has(Defect::McpRunsElsewhere)
            && let Some(other) = lock(&self.state).created.iter().find(|c| *c != id)
        {
            target = other.clone();
        }
        match self.control.run(&target, command).await {
            Ok((stdout, stderr, exit_code)) => CallToolResult::structured(json!({
                "handle": self.handle(id),
                "stdout": stdout,
                "stderr": stderr,
                "exit_code": exit_code,
            })),
            Err(e) => control_refused(e),
        }
    }

    /// Runs `command` in a sandbox made for it, which is killed before the call answers: a
    /// command that names no sandbox leaves none behind.
    async fn run_alone(&self, command: &str) -> CallToolResult {
        let id = match self.control.create(300).await {
            Ok(id) => id,
            Err(e) => return control_refused(e),
        };
        let ran = self.control.run(&id, command).await;
        if !self.defects.has(Defect::McpRunLeavesSandbox)
            && let Err(e) = self.control.kill(&id).await
        {
            return refused(format!(
                "the command's sandbox `{}` could not be killed: failed to {e}",
                self.handle(&id)
            ));
        }
        match ran {
            Ok((stdout, stderr, exit_code)) => CallToolResult::structured(json!({
                "stdout": stdout,
                "stderr": stderr,
                "exit_code": exit_code,
            })),
            Err(e) => control_refused(e),
        }
    }

    /// Marks the session as ended, as soon as its end is seen (stdin at EOF): from here on a
    /// create that completes disposes of its own sandbox, even while the SDK is still
    /// finishing the requests it was serving.
    pub fn end_session(&self) {
        lock(&self.state).closed = true;
    }

    /// The end of the session: kill what it created, leave what it borrowed, and wait for
    /// creates in flight (each kills its own sandbox when it completes, seeing `closed`).
    pub async fn shutdown(&self) {
        let doomed: Vec<String> = {
            let mut s = lock(&self.state);
            s.closed = true;
            let mut doomed: Vec<String> = std::mem::take(&mut s.created).into_iter().collect();
            if self.defects.has(Defect::McpKeepsCreatedAtShutdown) {
                doomed.clear();
            }
            if self.defects.has(Defect::McpKillsBorrowedAtShutdown) {
                doomed.extend(std::mem::take(&mut s.borrowed));
            }
            doomed
        };
        for id in doomed {
            if let Err(e) = self.control.kill(&id).await {
                tracing::warn!(sandbox = %id, error = %e, "failed to kill a sandbox at shutdown");
            }
        }
        let mut rx = self.in_flight.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }
}

impl rmcp::ServerHandler for SandboxTools {
    #[expect(deprecated, reason = "see the `use` of LoggingLevel")]
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_logging()
                .build(),
        )
        .with_server_info(Implementation::new(
            "sandspec-mcp",
            env!("CARGO_PKG_VERSION"),
        ))
    }

    #[expect(deprecated, reason = "see the `use` of LoggingLevel")]
    async fn set_level(
        &self,
        request: SetLevelRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        *self.log_level.lock().unwrap_or_else(|p| p.into_inner()) = Some(severity(request.level));
        Ok(())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(Self::tools()))
    }

    /// A tool this server does not have is a protocol error (`-32602`), as the protocol says
    /// of unknown tools; what a tool refuses is its own `isError` result.
    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.unwrap_or_default();
        let result = self.call(&request.name, args).await?;
        if let Some(log) = self.log_of(&request.name, &result) {
            // A client gone meanwhile misses the message, not the result.
            #[expect(deprecated, reason = "see the `use` of LoggingLevel")]
            let _ = context.peer.notify_logging_message(log).await;
        }
        Ok(CallToolResponse::Complete(result))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_name_this_provider_or_none() {
        assert_eq!(SandboxTools::sandbox_id("e2b:abc123").unwrap(), "abc123");
        assert_eq!(SandboxTools::sandbox_id("abc123").unwrap(), "abc123");
        assert!(
            SandboxTools::sandbox_id("daytona:abc")
                .unwrap_err()
                .contains("daytona")
        );
        assert!(SandboxTools::sandbox_id("e2b:").is_err());
        assert!(SandboxTools::sandbox_id("e2b:../x").is_err());
    }
}
