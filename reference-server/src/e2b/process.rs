//! envd's `process.Process` service over this server's processes: Start, Connect, List,
//! SendInput, SendSignal and CloseStdin.
//!
//! A process started here is an ordinary process record of the sandbox (its output in the
//! durable log `process:<id>`), with an `e2b` object in its body: the pid clients address it
//! by, and the command as it was asked for. Pids are assigned per sandbox from 1000 upwards;
//! they are handles, not the host's process IDs. Start streams everything the process
//! writes; Connect, as upstream, sends only what is written after it attached, and the end
//! event of a process that has already ended.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::api::AppState;
use crate::clock::now;
use crate::defects::Defect;
use crate::domain::{IdKind, Process, ProcessSpec, ProcessState, QualifiedId};
use crate::sandbox::{LocalProvider, ProviderError, Signal, TerminalSize, process_record};
use crate::store::{Kind, ListQuery, Record, Scope};
use crate::stream::process_stream;

use super::connect::{self, Code, ConnectError, StreamSender};
use super::envd::{self, EnvdSandbox};

/// The first pid handed out in a sandbox.
const FIRST_PID: u32 = 1000;
/// How often a stream reads the store without a wake-up (another server process's appends,
/// a sandbox killed under it).
const POLL: Duration = Duration::from_millis(500);

/// Serializes pid assignment (the next pid is one more than the largest in the sandbox) and
/// holds a start's record back from `List` until its process is spawned.
static PID_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProcessConfig {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

/// `PTY.Size`: a terminal's rows and columns.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PtySize {
    #[serde(default)]
    rows: u32,
    #[serde(default)]
    cols: u32,
}

/// `PTY`: a pseudo-terminal for the process, of this size.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Pty {
    size: Option<PtySize>,
}

impl Pty {
    fn size(&self) -> Result<TerminalSize, ConnectError> {
        let size = self
            .size
            .as_ref()
            .ok_or_else(|| ConnectError::invalid("pty.size is required"))?;
        let fits = |n: u32| (1..=u32::from(u16::MAX)).contains(&n);
        if !fits(size.rows) || !fits(size.cols) {
            return Err(ConnectError::invalid(
                "pty.size has rows and cols between 1 and 65535",
            ));
        }
        Ok(TerminalSize {
            rows: size.rows as u16,
            cols: size.cols as u16,
        })
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateRequest {
    process: Option<Selector>,
    pty: Option<Pty>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StartRequest {
    process: Option<ProcessConfig>,
    pty: Option<Pty>,
    tag: Option<String>,
    stdin: Option<bool>,
}

/// `ProcessSelector`: a oneof of `pid` and `tag`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SelectorRequest {
    process: Option<Selector>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProcessInput {
    stdin: Option<String>,
    pty: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SendInputRequest {
    process: Option<Selector>,
    input: Option<ProcessInput>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SendSignalRequest {
    process: Option<Selector>,
    signal: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListRequest {}

/// What the `e2b` object of a process record holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct E2bProcess {
    pid: u32,
    cmd: String,
    args: Vec<String>,
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
    tag: Option<String>,
    /// Started on a pseudo-terminal: its output is `pty` data and its input goes there.
    #[serde(default)]
    pty: bool,
}

fn e2b_process(rec: &Record) -> Option<E2bProcess> {
    rec.body
        .get("e2b")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
}

fn process_of(rec: &Record) -> Result<Process, ConnectError> {
    serde_json::from_value(rec.body.clone())
        .map_err(|e| crate::api::ApiError::internal(format!("process body {}: {e}", rec.id)).into())
}

async fn processes_of(state: &AppState, sbx: &EnvdSandbox) -> Result<Vec<Record>, ConnectError> {
    let mut q = ListQuery::new(Kind::Process, Scope::System);
    q.parent = Some(&sbx.rec.id);
    Ok(state
        .store
        .list(&q)
        .await
        .map_err(crate::api::ApiError::from)?)
}

/// The process a selector names: by pid, or by tag (a running one first, else the latest).
async fn select(
    state: &AppState,
    sbx: &EnvdSandbox,
    selector: Option<Selector>,
) -> Result<Record, ConnectError> {
    let selector = selector.ok_or_else(|| ConnectError::invalid("process is required"))?;
    let by_tag_lost = state.config.defects.has(Defect::E2bConnectByTagNotFound);
    let records = processes_of(state, sbx).await?;
    let found = match (selector.pid, selector.tag) {
        (Some(pid), None) => records
            .into_iter()
            .find(|r| e2b_process(r).is_some_and(|p| p.pid == pid)),
        (None, Some(_)) if by_tag_lost => None,
        (None, Some(tag)) => {
            let tagged: Vec<Record> = records
                .into_iter()
                .filter(|r| e2b_process(r).is_some_and(|p| p.tag.as_deref() == Some(&tag)))
                .collect();
            let running = tagged
                .iter()
                .position(|r| r.state == ProcessState::Running.as_str());
            match running {
                Some(i) => tagged.into_iter().nth(i),
                None => tagged.into_iter().last(),
            }
        }
        _ => {
            return Err(ConnectError::invalid(
                "process selects by exactly one of pid and tag",
            ));
        }
    };
    found.ok_or_else(|| ConnectError::not_found("process not found"))
}

/// The `end` event of a process from its exit: upstream reports a process ended by a signal
/// with `exited: false`, exit code -1 and Go's status text.
fn end_event(state: &str, exit_code: Option<i64>, signal: Option<&str>) -> Value {
    if state == ProcessState::Killed.as_str() || exit_code.is_none() {
        let status = match signal {
            Some("KILL") => "signal: killed".to_owned(),
            Some("TERM") => "signal: terminated".to_owned(),
            Some("INT") => "signal: interrupt".to_owned(),
            Some(other) => format!("signal: {other}"),
            None => "signal: killed".to_owned(),
        };
        json!({"event": {"end": {"exitCode": -1, "exited": false, "status": status}}})
    } else {
        let code = exit_code.unwrap_or_default();
        json!({"event": {"end": {"exitCode": code, "exited": true, "status": format!("exit status {code}")}}})
    }
}

fn end_of_exit(data: &Value) -> Value {
    end_event(
        data.get("state")
            .and_then(Value::as_str)
            .unwrap_or("exited"),
        data.get("exit_code").and_then(Value::as_i64),
        data.get("signal").and_then(Value::as_str),
    )
}

fn end_of_record(p: &Process) -> Value {
    end_event(
        p.state.as_str(),
        p.exit_code.map(i64::from),
        p.signal.as_deref(),
    )
}

/// Sends the process's events after `cursor` until its `exit` (then the end event and the
/// end of the stream), the client going away, the sandbox ending, or shutdown. A process
/// ended because its sandbox was killed gets no end event: the stream fails, as upstream's
/// does when the sandbox's machine goes away under it (the SDK then finds the sandbox gone).
async fn pump(
    state: AppState,
    sender: StreamSender,
    sandbox: (Arc<LocalProvider>, String),
    process_id: String,
    mut cursor: i64,
    keepalive: Option<Duration>,
    pty: bool,
) {
    let stream = process_stream(&process_id);
    let mut woken = state.log.follow(&stream);
    // For the defect `e2b-fast-exit-loses-end`: whether the process wrote anything yet.
    let mut wrote = cursor > 0;
    let mut ping = keepalive.map(|d| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + d, d);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    loop {
        let events = match state.log.read_after(&stream, cursor, 256).await {
            Ok(events) => events,
            Err(e) => {
                sender
                    .finish(Some(crate::api::ApiError::from(e).into()))
                    .await;
                return;
            }
        };
        if !events.is_empty() {
            for framed in events {
                let event = &framed.event;
                cursor = event.seq;
                let text = event.data.get("data").and_then(Value::as_str).unwrap_or("");
                let message = match event.kind.as_str() {
                    // A terminal's output is one stream, upstream's `pty` data.
                    "stdout" if pty => {
                        json!({"event": {"data": {"pty": connect::encode_bytes(text.as_bytes())}}})
                    }
                    "stdout" => {
                        json!({"event": {"data": {"stdout": connect::encode_bytes(text.as_bytes())}}})
                    }
                    "stderr" => {
                        json!({"event": {"data": {"stderr": connect::encode_bytes(text.as_bytes())}}})
                    }
                    "exit" if sandbox.0.is_ending(&sandbox.1) => {
                        sender
                            .finish(Some(ConnectError::new(
                                Code::Unavailable,
                                "the sandbox was killed before the process ended",
                            )))
                            .await;
                        return;
                    }
                    "exit" if !wrote && state.config.defects.has(Defect::E2bFastExitLosesEnd) => {
                        // The defect: a process that ended before writing anything is taken
                        // for one that never started, and its stream just stops.
                        sender.finish(None).await;
                        return;
                    }
                    "exit" => {
                        if sender.send(&end_of_exit(&event.data)).await {
                            sender.finish(None).await;
                        }
                        return;
                    }
                    _ => continue,
                };
                wrote = true;
                if !sender.send(&message).await {
                    return;
                }
            }
            continue;
        }
        let tick = async {
            match ping.as_mut() {
                Some(t) => {
                    t.tick().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = woken.changed() => {}
            () = tokio::time::sleep(POLL) => {
                let exists = state
                    .store
                    .get(Kind::Process, Scope::System, &process_id)
                    .await
                    .map(|r| r.is_some())
                    .unwrap_or(true);
                if !exists {
                    sender
                        .finish(Some(ConnectError::new(
                            Code::Unavailable,
                            "the sandbox ended before the process did",
                        )))
                        .await;
                    return;
                }
            }
            () = tick => {
                if !sender.send(&json!({"event": {"keepalive": {}}})).await {
                    return;
                }
            }
            () = sender.closed() => return,
            () = state.shutdown.cancelled() => {
                sender
                    .finish(Some(ConnectError::new(Code::Unavailable, "the server is shutting down")))
                    .await;
                return;
            }
        }
    }
}

/// `Start`: runs a command and streams `start{pid}`, its output and `end`.
pub async fn start(
    State(state): State<AppState>,
    sbx: EnvdSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let deadline = match connect::request_timeout(&headers) {
        Ok(_) if state.config.defects.has(Defect::E2bRequestTimeoutIgnored) => None,
        Ok(d) => d,
        Err(e) => return connect::stream_error(e),
    };
    // The deadline counts from the request, as the Connect protocol has it, so it passes
    // before the process's own (which starts later, at spawn) and the stream ends with
    // `deadline_exceeded` rather than with the killed process's `end`.
    let ends_at = deadline.map(|d| tokio::time::Instant::now() + d);
    match start_process(&state, &sbx, &headers, &body, deadline).await {
        Err(e) => connect::stream_error(e),
        Ok((rec, pid)) => {
            let (response, sender) = connect::stream_response();
            let keepalive = connect::keepalive_interval(&headers)
                .filter(|_| !state.config.defects.has(Defect::E2bKeepaliveIgnored));
            let pty = e2b_process(&rec).is_some_and(|p| p.pty);
            let sandbox = (sbx.provider.clone(), sbx.local.clone());
            tokio::spawn(async move {
                if !sender
                    .send(&json!({"event": {"start": {"pid": pid}}}))
                    .await
                {
                    return;
                }
                let pumped = pump(state, sender.clone(), sandbox, rec.id, 0, keepalive, pty);
                // As envd: past the request's deadline the stream ends with
                // `deadline_exceeded` (the process, given the same deadline, is killed).
                match ends_at {
                    None => pumped.await,
                    Some(at) => {
                        if tokio::time::timeout_at(at, pumped).await.is_err() {
                            sender
                                .finish(Some(ConnectError::new(
                                    Code::DeadlineExceeded,
                                    "the request's deadline passed",
                                )))
                                .await;
                        }
                    }
                }
            });
            response
        }
    }
}

async fn start_process(
    state: &AppState,
    sbx: &EnvdSandbox,
    headers: &HeaderMap,
    body: &Bytes,
    deadline: Option<Duration>,
) -> Result<(Record, u32), ConnectError> {
    let req: StartRequest = connect::stream_request(headers, body)?;
    let terminal = req.pty.as_ref().map(Pty::size).transpose()?;
    let config = req
        .process
        .ok_or_else(|| ConnectError::invalid("process is required"))?;
    if config.cmd.is_empty() {
        return Err(ConnectError::invalid("process.cmd is required"));
    }
    if config.cmd.contains('\0') || config.args.iter().any(|a| a.contains('\0')) {
        return Err(ConnectError::invalid("arguments cannot contain NUL"));
    }
    if config
        .envs
        .iter()
        .any(|(k, v)| k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0'))
    {
        return Err(ConnectError::invalid(
            "environment names must be non-empty without `=` or NUL",
        ));
    }
    let cwd = match config.cwd.as_deref() {
        None | Some("") => None,
        Some(cwd) => {
            let rel = envd::to_rel(cwd)?;
            (!rel.is_empty()).then_some(rel)
        }
    };
    let mut cmd = vec![config.cmd.clone()];
    cmd.extend(config.args.iter().cloned());
    let spec = ProcessSpec {
        cmd: cmd.clone(),
        cwd,
        env: config.envs.clone(),
        stdin: req.stdin.unwrap_or(false),
        timeout_ms: deadline
            .filter(|_| !state.config.defects.has(Defect::E2bTimeoutLeavesProcess))
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        tag: req.tag.clone(),
    };
    let sandbox_env = if state.config.defects.has(Defect::E2bEnvVarsDropped) {
        BTreeMap::new()
    } else {
        sbx.env()
    };
    let (provider_name, _) = crate::api::lookup::split(&sbx.rec.id)?;
    let _serial = PID_LOCK.lock().await;
    let pid = processes_of(state, sbx)
        .await?
        .iter()
        .filter_map(e2b_process)
        .map(|p| p.pid + 1)
        .max()
        .unwrap_or(FIRST_PID);
    let process = Process::running(
        QualifiedId::new(
            provider_name,
            sbx.provider.allocate_local_id(IdKind::Process),
        )
        .to_string(),
        sbx.rec.id.clone(),
        cmd,
        req.tag.clone(),
        now(),
    );
    let mut body = serde_json::to_value(&process).map_err(crate::api::ApiError::internal)?;
    body["e2b"] = serde_json::to_value(E2bProcess {
        pid,
        cmd: config.cmd,
        args: config.args,
        envs: config.envs,
        cwd: config.cwd,
        tag: req.tag,
        pty: terminal.is_some(),
    })
    .map_err(crate::api::ApiError::internal)?;
    let rec = process_record(&process, sbx.rec.owner.clone(), body);
    state
        .store
        .insert(&rec)
        .await
        .map_err(crate::api::ApiError::from)?;
    let spawned = match terminal {
        Some(size) => {
            sbx.provider
                .spawn_terminal(&sbx.local, rec.clone(), &spec, &sandbox_env, size)
                .await
        }
        None => {
            sbx.provider
                .spawn(&sbx.local, rec.clone(), &spec, &sandbox_env)
                .await
        }
    };
    if let Err(e) = spawned {
        if let Err(e) = state.store.delete(Kind::Process, &rec.id).await {
            tracing::warn!(error = %e, "could not remove the record of a failed start");
        }
        return Err(match e {
            ProviderError::InvalidArgument { detail, .. } => ConnectError::invalid(detail),
            ProviderError::InvalidPath => ConnectError::invalid("cwd is outside the sandbox"),
            other => other.into(),
        });
    }
    Ok((rec, pid))
}

/// `Connect`: attaches to a process by pid or tag: `start{pid}`, then what it writes from now
/// on and its `end`; for a process that has already ended, `start` and `end` at once.
pub async fn connect_process(
    State(state): State<AppState>,
    sbx: EnvdSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let attach = async {
        let req: SelectorRequest = connect::stream_request(&headers, &body)?;
        let found = select(&state, &sbx, req.process).await?;
        let stream = process_stream(&found.id);
        // The bounds before the record: a process seen running appends its exit after them.
        let bounds = state
            .store
            .stream_bounds(&stream)
            .await
            .map_err(crate::api::ApiError::from)?;
        let rec = state
            .store
            .get(Kind::Process, Scope::System, &found.id)
            .await
            .map_err(crate::api::ApiError::from)?
            .ok_or_else(|| ConnectError::not_found("process not found"))?;
        let pid = e2b_process(&rec).map(|p| p.pid).unwrap_or_default();
        Ok::<_, ConnectError>((rec, pid, bounds.last_seq))
    };
    let (rec, pid, cursor) = match attach.await {
        Ok(found) => found,
        Err(e) => return connect::stream_error(e),
    };
    let ended = match process_of(&rec) {
        Ok(p) => (p.state != ProcessState::Running).then_some(p),
        Err(e) => return connect::stream_error(e),
    };
    let (response, sender) = connect::stream_response();
    let keepalive = connect::keepalive_interval(&headers)
        .filter(|_| !state.config.defects.has(Defect::E2bKeepaliveIgnored));
    let loses_exit = state.config.defects.has(Defect::E2bLateConnectLosesExit);
    let sandbox = (sbx.provider.clone(), sbx.local.clone());
    tokio::spawn(async move {
        if !sender
            .send(&json!({"event": {"start": {"pid": pid}}}))
            .await
        {
            return;
        }
        match ended {
            Some(process) => {
                if loses_exit {
                    // The defect: a process that has ended has nothing live left to forward.
                    sender.finish(None).await;
                } else if sender.send(&end_of_record(&process)).await {
                    sender.finish(None).await;
                }
            }
            None => {
                let pty = e2b_process(&rec).is_some_and(|p| p.pty);
                pump(state, sender, sandbox, rec.id, cursor, keepalive, pty).await
            }
        }
    });
    response
}

/// `List`: the sandbox's running processes.
pub async fn list(
    State(state): State<AppState>,
    sbx: EnvdSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let result = async {
        let _: ListRequest = connect::unary_request(&headers, &body)?;
        // A start holds the lock from its record's insert until its process is spawned, so
        // read under it: a pid listed here can be given input and signals at once.
        let records = {
            let _serial = PID_LOCK.lock().await;
            processes_of(&state, &sbx).await?
        };
        let mut processes = Vec::new();
        for rec in records {
            if rec.state != ProcessState::Running.as_str() {
                continue;
            }
            let Some(p) = e2b_process(&rec) else { continue };
            let mut config = json!({"cmd": p.cmd, "args": p.args, "envs": p.envs});
            if let Some(cwd) = p.cwd {
                config["cwd"] = json!(cwd);
            }
            let mut info = json!({"config": config, "pid": p.pid});
            if let Some(tag) = p.tag {
                info["tag"] = json!(tag);
            }
            processes.push(info);
        }
        Ok::<_, ConnectError>(json!({ "processes": processes }))
    };
    unary(result.await)
}

fn unary(result: Result<Value, ConnectError>) -> Response {
    match result {
        Ok(message) => connect::unary_response(&message),
        Err(e) => axum::response::IntoResponse::into_response(e),
    }
}

/// A running process of the sandbox, by selector; an ended one is not found, as upstream.
async fn running(
    state: &AppState,
    sbx: &EnvdSandbox,
    selector: Option<Selector>,
) -> Result<Record, ConnectError> {
    let rec = select(state, sbx, selector).await?;
    if rec.state != ProcessState::Running.as_str() {
        return Err(ConnectError::not_found("process not found (it has ended)"));
    }
    Ok(rec)
}

fn provider_error(e: ProviderError) -> ConnectError {
    match e {
        ProviderError::NotFound | ProviderError::ProcessExited => {
            ConnectError::not_found("process not found (it has ended)")
        }
        ProviderError::NoStdin => ConnectError::new(
            Code::FailedPrecondition,
            "the process was started without stdin",
        ),
        other => other.into(),
    }
}

/// `SendInput`: bytes to the process's stdin.
pub async fn send_input(
    State(state): State<AppState>,
    sbx: EnvdSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let result = async {
        let req: SendInputRequest = connect::unary_request(&headers, &body)?;
        let input = req
            .input
            .ok_or_else(|| ConnectError::invalid("input is required"))?;
        let rec = running(&state, &sbx, req.process).await?;
        let on_terminal = e2b_process(&rec).is_some_and(|p| p.pty);
        match (input.stdin, input.pty, on_terminal) {
            (Some(_), None, true) => Err(ConnectError::new(
                Code::FailedPrecondition,
                "the process has a terminal: its input is written to the pty, not to stdin",
            )),
            (None, Some(_), false) => Err(ConnectError::new(
                Code::FailedPrecondition,
                "the process has no terminal",
            )),
            (Some(stdin), None, false) => {
                let data = connect::decode_bytes(&stdin)?;
                sbx.provider
                    .write_stdin(&rec.id, &data, false)
                    .await
                    .map_err(provider_error)?;
                Ok(json!({}))
            }
            (None, Some(pty), true) => {
                let data = connect::decode_bytes(&pty)?;
                sbx.provider
                    .write_terminal(&rec.id, &data)
                    .await
                    .map_err(provider_error)?;
                Ok(json!({}))
            }
            (None, None, _) => Ok(json!({})),
            (Some(_), Some(_), _) => Err(ConnectError::invalid("input is one of stdin and pty")),
        }
    };
    unary(result.await)
}

/// One message of `StreamInput`: `start` (which process), then `data` and `keepalive`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamInputRequest {
    start: Option<SelectorRequest>,
    data: Option<StreamInputData>,
    keepalive: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamInputData {
    input: Option<ProcessInput>,
}

/// `StreamInput` (a client stream): `start` names a running process, then each `data`
/// message's input is written to its stdin or terminal as it arrives, as `SendInput` would.
/// Answered once the client's stream ends.
pub async fn stream_input(
    State(state): State<AppState>,
    sbx: EnvdSandbox,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let result = async {
        let mut stream = connect::ClientStream::new(&headers, body)?;
        let first: StreamInputRequest = stream
            .next()
            .await?
            .ok_or_else(|| ConnectError::invalid("the stream starts with `start`"))?;
        let selector = first
            .start
            .ok_or_else(|| ConnectError::invalid("the stream starts with `start`"))?
            .process;
        let rec = running(&state, &sbx, selector).await?;
        let on_terminal = e2b_process(&rec).is_some_and(|p| p.pty);
        let drops = state.config.defects.has(Defect::E2bStreamInputDropsData);
        let mut written = 0usize;
        while let Some(message) = stream.next::<StreamInputRequest>().await? {
            let _ = message.keepalive;
            if message.start.is_some() {
                return Err(ConnectError::invalid("`start` comes once, first"));
            }
            let Some(input) = message.data.and_then(|d| d.input) else {
                continue;
            };
            written += 1;
            if drops && written > 1 {
                continue;
            }
            match (input.stdin, input.pty, on_terminal) {
                (Some(stdin), None, false) => sbx
                    .provider
                    .write_stdin(&rec.id, &connect::decode_bytes(&stdin)?, false)
                    .await
                    .map_err(provider_error)?,
                (None, Some(pty), true) => sbx
                    .provider
                    .write_terminal(&rec.id, &connect::decode_bytes(&pty)?)
                    .await
                    .map_err(provider_error)?,
                (None, None, _) => {}
                _ => {
                    return Err(ConnectError::new(
                        Code::FailedPrecondition,
                        "input goes to a terminal as pty bytes, else to stdin",
                    ));
                }
            }
        }
        Ok::<_, ConnectError>(())
    };
    match result.await {
        Ok(()) => connect::client_stream_response(&json!({})),
        Err(e) => connect::stream_error(e),
    }
}

/// `Update`: resizes the terminal of a process started with a `pty`.
pub async fn update(
    State(state): State<AppState>,
    sbx: EnvdSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let result = async {
        let req: UpdateRequest = connect::unary_request(&headers, &body)?;
        let rec = running(&state, &sbx, req.process).await?;
        let Some(pty) = req.pty else {
            // Nothing to change.
            return Ok(json!({}));
        };
        let size = pty.size()?;
        if !e2b_process(&rec).is_some_and(|p| p.pty) {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                "the process has no terminal",
            ));
        }
        if sbx.defects.has(Defect::E2bPtyResizeIgnored) {
            // The defect: answered, and the terminal left as it was.
            return Ok(json!({}));
        }
        sbx.provider
            .resize_terminal(&rec.id, size)
            .map_err(provider_error)?;
        Ok(json!({}))
    };
    unary(result.await)
}

/// `CloseStdin`: end of input for the process.
pub async fn close_stdin(
    State(state): State<AppState>,
    sbx: EnvdSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let result = async {
        let req: SelectorRequest = connect::unary_request(&headers, &body)?;
        let rec = running(&state, &sbx, req.process).await?;
        if state.config.defects.has(Defect::E2bCloseStdinIgnored) {
            // The defect: answered, and the process's stdin left open.
            return Ok(json!({}));
        }
        sbx.provider
            .write_stdin(&rec.id, &[], true)
            .await
            .map_err(provider_error)?;
        Ok(json!({}))
    };
    unary(result.await)
}

/// `SendSignal`: SIGTERM or SIGKILL (by enum name or number).
pub async fn send_signal(
    State(state): State<AppState>,
    sbx: EnvdSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let result = async {
        let req: SendSignalRequest = connect::unary_request(&headers, &body)?;
        let signal = match req.signal.as_ref() {
            Some(Value::String(s)) if s == "SIGNAL_SIGKILL" => Signal::Kill,
            Some(Value::String(s)) if s == "SIGNAL_SIGTERM" => Signal::Term,
            Some(Value::Number(n)) if n.as_u64() == Some(9) => Signal::Kill,
            Some(Value::Number(n)) if n.as_u64() == Some(15) => Signal::Term,
            _ => {
                return Err(ConnectError::invalid(
                    "signal must be SIGNAL_SIGTERM or SIGNAL_SIGKILL",
                ));
            }
        };
        let signal = if signal == Signal::Kill
            && state.config.defects.has(Defect::E2bSigkillSentAsSigterm)
        {
            Signal::Term
        } else {
            signal
        };
        let rec = running(&state, &sbx, req.process).await?;
        sbx.provider
            .signal(&rec.id, signal)
            .map_err(provider_error)?;
        Ok(json!({}))
    };
    unary(result.await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_events_follow_upstream_for_exits_and_signals() {
        assert_eq!(
            end_of_exit(&json!({"state": "exited", "exit_code": 3, "signal": null})),
            json!({"event": {"end": {"exitCode": 3, "exited": true, "status": "exit status 3"}}})
        );
        assert_eq!(
            end_of_exit(&json!({"state": "killed", "exit_code": null, "signal": "KILL"})),
            json!({"event": {"end": {"exitCode": -1, "exited": false, "status": "signal: killed"}}})
        );
    }
}
