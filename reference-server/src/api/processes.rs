//! Processes: start, list, get, retained output, the event stream, stdin and signals.
//!
//! The process record (`domain::Process` as its body) is inserted here and then owned by the
//! provider, which records the exit. Output lives in the durable log `process:<id>`; the
//! reaper marks it expired `retention.process_output_s` after the end.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{OriginalUri, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::clock::now;
use crate::defects::Defect;
use crate::domain::{IdKind, Process, ProcessSpec, ProcessState, QualifiedId, SandboxState};
use crate::sandbox::{ProviderError, Signal, process_record};
use crate::store::{Kind, ListQuery, Record, Scope};
use crate::stream::process_stream;
use crate::stream::sse::{self, Options, Subject};

use super::error::ApiError;
use super::extract::{Caller, IdempotencyKey, Json, Path, QueryPairs};
use super::idempotency::{self, IdemRequest};
use super::lookup;
use super::pagination::PageRequest;
use super::sandboxes::{env_of, sandbox_now};
use super::state::AppState;

/// How long an output read waits for the `exit` event of a process already recorded as
/// ended (the runtime appends it right after): tries × step, 10 s. A read almost never waits,
/// but the two writes are separate, and on a loaded machine the second has been seen to land
/// more than 2 s after the first.
const EXIT_EVENT_WAIT_TRIES: u32 = 500;
const EXIT_EVENT_WAIT_STEP: std::time::Duration = std::time::Duration::from_millis(20);

const MAX_TAG_CHARS: usize = 256;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartProcess {
    cmd: Vec<String>,
    cwd: Option<String>,
    env: Option<BTreeMap<String, String>>,
    stdin: Option<bool>,
    timeout_ms: Option<u64>,
    tag: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stdin {
    data: String,
    eof: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendSignal {
    signal: String,
}

/// The process as clients see it.
#[derive(Debug, Serialize)]
struct View {
    id: String,
    sandbox_id: String,
    state: ProcessState,
    cmd: Vec<String>,
    tag: Option<String>,
    exit_code: Option<i32>,
    signal: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    started_at: time::OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    ended_at: Option<time::OffsetDateTime>,
}

fn process_of(rec: &Record) -> Result<Process, ApiError> {
    serde_json::from_value(rec.body.clone())
        .map_err(|e| ApiError::internal(format!("process body {}: {e}", rec.id)))
}

fn view(rec: &Record) -> Result<Value, ApiError> {
    let p = process_of(rec)?;
    let view = View {
        id: p.id,
        sandbox_id: p.sandbox_id,
        state: p.state,
        cmd: p.cmd,
        tag: p.tag,
        exit_code: p.exit_code,
        signal: p.signal,
        started_at: p.started_at,
        ended_at: p.ended_at,
    };
    serde_json::to_value(view).map_err(ApiError::internal)
}

pub async fn start(
    State(state): State<AppState>,
    caller: Caller,
    OriginalUri(uri): OriginalUri,
    Path(id): Path<String>,
    IdempotencyKey(key): IdempotencyKey,
    body: Json<StartProcess>,
) -> Result<Response, ApiError> {
    let req = body.value;
    if req.cmd.is_empty() || req.cmd[0].is_empty() {
        return Err(ApiError::invalid("cmd", "cmd must be a non-empty argv"));
    }
    if req.cmd.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::invalid("cmd", "arguments cannot contain NUL"));
    }
    let env = req.env.unwrap_or_default();
    if env
        .iter()
        .any(|(k, v)| k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0'))
    {
        return Err(ApiError::invalid(
            "env",
            "environment names must be non-empty without `=` or NUL",
        ));
    }
    if req.timeout_ms == Some(0) {
        return Err(ApiError::invalid(
            "timeout_ms",
            "timeout_ms must be positive",
        ));
    }
    if req
        .tag
        .as_ref()
        .is_some_and(|t| t.chars().count() > MAX_TAG_CHARS)
    {
        return Err(ApiError::invalid(
            "tag",
            format!("tag is at most {MAX_TAG_CHARS} characters"),
        ));
    }
    if let Some(cwd) = &req.cwd
        && (cwd.starts_with('/') || cwd.contains('\0'))
    {
        return Err(ApiError::InvalidPath);
    }
    let sandbox = lookup::qualified(&state, Kind::Sandbox, &caller.principal, &id).await?;
    let spec = ProcessSpec {
        cmd: req.cmd,
        cwd: req.cwd,
        env,
        stdin: req.stdin.unwrap_or(false),
        timeout_ms: req.timeout_ms,
        tag: req.tag,
    };
    let create = move |state: AppState, principal: String| async move {
        let current = sandbox_now(&state, &sandbox.id, &[SandboxState::Running]).await?;
        let (provider_name, sandbox_local) = lookup::split(&current.id)?;
        let provider = state
            .providers
            .get(provider_name)
            .ok_or_else(|| ApiError::internal("unknown provider"))?;
        let process = Process::running(
            QualifiedId::new(provider_name, provider.allocate_local_id(IdKind::Process))
                .to_string(),
            current.id.clone(),
            spec.cmd.clone(),
            spec.tag.clone(),
            now(),
        );
        let body = serde_json::to_value(&process).map_err(ApiError::internal)?;
        let rec = process_record(&process, principal, body);
        state.store.insert(&rec).await?;
        if let Err(e) = provider
            .spawn(sandbox_local, rec.clone(), &spec, &env_of(&current))
            .await
        {
            // With `failed-start-leaves-process` the record stored above is kept.
            if !state.config.defects.has(Defect::FailedStartLeavesProcess)
                && let Err(e) = state.store.delete(Kind::Process, &rec.id).await
            {
                tracing::warn!(error = %e, "could not remove the record of a failed start");
            }
            return Err(e.into());
        }
        // The process may already have ended: answer with what is stored now.
        let rec = state
            .store
            .get(Kind::Process, Scope::System, &rec.id)
            .await?
            .unwrap_or(rec);
        Ok(rec)
    };
    let idem = IdemRequest::post(&caller.principal, uri.path(), key, &body.raw);
    idempotency::run_create(&state, idem, Kind::Process, view, create).await
}

pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let sandbox = lookup::qualified(&state, Kind::Sandbox, &caller.principal, &id).await?;
    let state_filter = match query.get("state") {
        None => None,
        Some(s @ ("running" | "exited" | "killed")) => Some(s.to_owned()),
        Some(_) => {
            return Err(ApiError::invalid(
                "state",
                "state must be running, exited or killed",
            ));
        }
    };
    let filters = format!(
        "sandbox={}&state={}",
        sandbox.id,
        state_filter.as_deref().unwrap_or("")
    );
    let page = PageRequest::parse(&state, &query, &caller.principal, filters)?;
    let mut q = ListQuery::new(Kind::Process, Scope::Owner(&caller.principal));
    q.parent = Some(&sandbox.id);
    q.state = state_filter.as_deref();
    q.after = page.after.clone();
    q.limit = Some(page.limit + 1);
    let records = state.store.list(&q).await?;
    Ok(axum::Json(page.page(&state, records, view)?).into_response())
}

pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let rec = lookup::qualified(&state, Kind::Process, &caller.principal, &id).await?;
    Ok(axum::Json(view(&rec)?).into_response())
}

#[derive(Debug, Serialize)]
struct Output {
    stdout: String,
    stderr: String,
    next_offset: i64,
    complete: bool,
    truncated: bool,
}

pub async fn output(
    State(state): State<AppState>,
    caller: Result<Caller, ApiError>,
    Path(id): Path<String>,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let caller = match caller {
        Ok(caller) => Some(caller),
        // The defect: a route that never asks who is calling.
        Err(ApiError::Unauthenticated)
            if state.config.defects.has(Defect::ProcessOutputSkipsAuth) =>
        {
            None
        }
        Err(e) => return Err(e),
    };
    let scope = match &caller {
        Some(caller) => Scope::Owner(&caller.principal),
        None => Scope::System,
    };
    let rec = lookup::qualified_in(&state, Kind::Process, scope, &id).await?;
    let process = process_of(&rec)?;
    if output_gone(&state, &process) {
        return Err(ApiError::OutputExpired);
    }
    let after = match query.get("after") {
        None => 0,
        Some(raw) => raw
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= 0)
            .ok_or_else(|| ApiError::invalid("after", "after must be a non-negative offset"))?,
    };
    let stream = process_stream(&rec.id);
    // A process that keeps nothing once its client has gone: after a stream was read, only
    // what a stream has carried is readable.
    let readable_through = if state.config.defects.has(Defect::OutputLostOnDisconnect) {
        state
            .delivered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&rec.id)
            .copied()
            // Nobody streamed it, so nobody went away: everything is kept.
            .unwrap_or(i64::MAX)
    } else {
        i64::MAX
    };
    let mut out = Output {
        stdout: String::new(),
        stderr: String::new(),
        next_offset: after,
        complete: false,
        // With `truncation-unreported` what was dropped is not admitted.
        truncated: !state.config.defects.has(Defect::TruncationUnreported)
            && rec
                .body
                .get("truncated")
                .and_then(Value::as_bool)
                .unwrap_or(false),
    };
    // The runtime records the end of a process just before it appends the `exit` event. A
    // reader that already saw the process ended waits that moment out, so that `complete`
    // never lags behind the state GET reports.
    let exit_wait = if process.state == ProcessState::Running {
        0
    } else {
        EXIT_EVENT_WAIT_TRIES
    };
    let log = StoreLog {
        state: &state,
        stream: &stream,
    };
    read_output(&log, after, readable_through, exit_wait, &mut out).await?;
    if !out.complete && process.state != ProcessState::Running && out.next_offset > 0 {
        // Everything was read earlier: complete when the event at the offset is the exit.
        let last = state
            .store
            .events_after(&stream, out.next_offset - 1, 1)
            .await?;
        out.complete = last
            .first()
            .is_some_and(|e| e.kind == "exit" && e.seq == out.next_offset);
    }
    // Retention may have run between the record read and the event reads.
    if !out.complete && process.state != ProcessState::Running {
        let fresh = state
            .store
            .get(Kind::Process, Scope::System, &rec.id)
            .await?;
        if fresh
            .is_some_and(|r| r.body.get("output_expired").and_then(Value::as_bool) == Some(true))
        {
            return Err(ApiError::OutputExpired);
        }
    }
    Ok(axum::Json(out).into_response())
}

/// What reading a process's retained output needs of its log.
trait OutputLog {
    /// Events after `cursor`, oldest first.
    async fn after(&self, cursor: i64) -> Result<Vec<crate::store::Event>, ApiError>;
    /// Whether the log's last event is the `exit`.
    async fn exit_logged(&self) -> Result<bool, ApiError>;
}

/// A process's log in the store.
struct StoreLog<'a> {
    state: &'a AppState,
    stream: &'a str,
}

impl OutputLog for StoreLog<'_> {
    async fn after(&self, cursor: i64) -> Result<Vec<crate::store::Event>, ApiError> {
        Ok(self
            .state
            .store
            .events_after(self.stream, cursor, 1000)
            .await?)
    }

    async fn exit_logged(&self) -> Result<bool, ApiError> {
        exit_logged(self.state, self.stream).await
    }
}

/// Reads the output after `after` (through `readable_through`) into `out`, up to and with the
/// `exit` event, which makes it complete. With `exit_wait` tries left, a read that finds
/// nothing more waits for the `exit` of a process recorded as ended; once the log has it, it
/// reads once more rather than stopping, since it may have landed just after the read that
/// found nothing (and a read after the exit itself finds nothing again, and stops).
async fn read_output(
    log: &impl OutputLog,
    after: i64,
    readable_through: i64,
    mut exit_wait: u32,
    out: &mut Output,
) -> Result<(), ApiError> {
    let mut cursor = after;
    loop {
        let events = log.after(cursor).await?;
        if events.is_empty() {
            if exit_wait == 0 || cursor >= readable_through {
                return Ok(());
            }
            if log.exit_logged().await? {
                // One more read: it has the exit unless the exit is at or before the cursor.
                exit_wait = 0;
            } else {
                exit_wait -= 1;
                tokio::time::sleep(EXIT_EVENT_WAIT_STEP).await;
            }
            continue;
        }
        for event in &events {
            if event.seq > readable_through {
                return Ok(());
            }
            cursor = event.seq;
            out.next_offset = event.seq;
            let text = event.data.get("data").and_then(Value::as_str).unwrap_or("");
            match event.kind.as_str() {
                "stdout" => out.stdout.push_str(text),
                "stderr" => out.stderr.push_str(text),
                "exit" => {
                    out.complete = true;
                    return Ok(());
                }
                _ => {}
            }
        }
    }
}

/// Whether the process's output is past its retention: marked expired by the reaper, or due
/// on the server's clock already (decided here, so that a read right after the test clock
/// moved (TC-9.12) does not depend on the reaper having run).
fn output_gone(state: &AppState, process: &Process) -> bool {
    process.output_expired
        || (process.output_expires_at.is_some_and(|t| now() >= t)
            && !state.config.defects.has(Defect::OutputNeverExpires))
}

/// Whether the last event of a process's log is its `exit`.
async fn exit_logged(state: &AppState, stream: &str) -> Result<bool, ApiError> {
    let bounds = state.store.stream_bounds(stream).await?;
    if bounds.last_seq == 0 {
        return Ok(false);
    }
    let last = state
        .store
        .events_after(stream, bounds.last_seq - 1, 1)
        .await?;
    Ok(last.first().is_some_and(|e| e.kind == "exit"))
}

pub async fn events(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    sse::check_accept(&headers)?;
    let rec = lookup::qualified(&state, Kind::Process, &caller.principal, &id).await?;
    if output_gone(&state, &process_of(&rec)?) {
        return Err(ApiError::OutputExpired);
    }
    let cursor = sse::parse_cursor(&headers, query.get("after"))?;
    let limits = &state.config.limits;
    let slot = state
        .streams
        .acquire(
            &state.store,
            &caller.principal,
            limits.max_streams_per_principal,
        )
        .await?;
    let stream = process_stream(&rec.id);
    let finished: sse::Finished = {
        let store = Arc::clone(&state.store);
        let id = rec.id.clone();
        let stream = stream.clone();
        Box::new(move || {
            let (store, id, stream) = (Arc::clone(&store), id.clone(), stream.clone());
            Box::pin(async move {
                let Some(rec) = store.get(Kind::Process, Scope::System, &id).await? else {
                    return Ok(true);
                };
                if rec.state == ProcessState::Running.as_str() {
                    return Ok(false);
                }
                // The exit is recorded before the `exit` event is appended: finished means both.
                let bounds = store.stream_bounds(&stream).await?;
                let last = store.events_after(&stream, bounds.last_seq - 1, 1).await?;
                Ok(last.first().is_some_and(|e| e.kind == "exit"))
            })
        })
    };
    let on_delivered: Option<Box<dyn Fn(i64) + Send + Sync>> = {
        let delivered = Arc::clone(&state.delivered);
        let id = rec.id.clone();
        Some(Box::new(move |seq| {
            let mut map = delivered.lock().unwrap_or_else(|e| e.into_inner());
            let entry = map.entry(id.clone()).or_insert(0);
            *entry = (*entry).max(seq);
        }))
    };
    let subject = Subject {
        stream,
        is_terminal: Box::new(|e| e.kind == "exit"),
        finished,
        known_live: false,
        filter: None,
        on_delivered,
        head: None,
    };
    let options = Options {
        heartbeat: std::time::Duration::from_secs(limits.heartbeat_interval_s),
        max_duration: if state.config.defects.has(Defect::StreamEndsEarly) {
            // The defect: seconds taken for milliseconds.
            std::time::Duration::from_millis(limits.max_stream_duration_s)
        } else {
            std::time::Duration::from_secs(limits.max_stream_duration_s)
        },
        shutdown: state.shutdown.clone(),
        skip_first_on_resume: state.config.defects.has(Defect::SseResumeDropsEvent),
        expired_cursor_skips: state.config.defects.has(Defect::ExpiredCursorSkips),
        leak_slot_on_close: state.config.defects.has(Defect::StreamSlotLeakedOnClose),
        heartbeats_stop: state.config.defects.has(Defect::HeartbeatsStop),
        outage_stalls: state.config.defects.has(Defect::OutageStallsStream),
    };
    Ok(sse::respond(&state.log, subject, cursor, slot, options).await?)
}

/// The running process `id` of the caller's, with its provider.
async fn running(
    state: &AppState,
    principal: &str,
    id: &str,
) -> Result<(Record, Arc<crate::sandbox::LocalProvider>), ApiError> {
    let rec = lookup::qualified(state, Kind::Process, principal, id).await?;
    if rec.state != ProcessState::Running.as_str() {
        return Err(ApiError::ProcessExited);
    }
    let (provider, _) = lookup::split(&rec.id)?;
    let provider = state
        .providers
        .get(provider)
        .cloned()
        .ok_or_else(|| ApiError::internal("unknown provider"))?;
    Ok((rec, provider))
}

/// The provider forgets a process once it is gone: for a client that is an exited process.
fn exited_if_unknown(e: ProviderError) -> ApiError {
    match e {
        ProviderError::NotFound => ApiError::ProcessExited,
        other => other.into(),
    }
}

pub async fn stdin(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    body: Json<Stdin>,
) -> Result<Response, ApiError> {
    let (rec, provider) = running(&state, &caller.principal, &id).await?;
    provider
        .write_stdin(
            &rec.id,
            body.value.data.as_bytes(),
            // With `stdin-eof-ignored` the end of the input is never passed on.
            body.value.eof.unwrap_or(false) && !state.config.defects.has(Defect::StdinEofIgnored),
        )
        .await
        .map_err(exited_if_unknown)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub async fn signal(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    body: Json<SendSignal>,
) -> Result<Response, ApiError> {
    let signal = Signal::parse(&body.value.signal)
        // With `signal-name-unchecked` a name it does not know is taken for the default.
        .or_else(|| {
            state
                .config
                .defects
                .has(Defect::SignalNameUnchecked)
                .then_some(Signal::Term)
        })
        .ok_or_else(|| ApiError::invalid("signal", "signal must be TERM, KILL or INT"))?;
    let (rec, provider) = running(&state, &caller.principal, &id).await?;
    provider
        .signal(&rec.id, signal)
        .map_err(exited_if_unknown)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use serde_json::json;

    use super::*;

    /// A process's log whose `exit` is appended at a chosen moment: right after the first read
    /// that finds nothing more, before the reader asks whether the exit is logged.
    struct ExitLandsAfterARead {
        events: Mutex<Vec<crate::store::Event>>,
        empty_reads: Mutex<u32>,
    }

    fn event(seq: i64, kind: &str, data: Value) -> crate::store::Event {
        crate::store::Event {
            stream: "process:p".into(),
            seq,
            kind: kind.into(),
            data,
            at: time::OffsetDateTime::UNIX_EPOCH,
        }
    }

    impl OutputLog for ExitLandsAfterARead {
        async fn after(&self, cursor: i64) -> Result<Vec<crate::store::Event>, ApiError> {
            let events = self.events.lock().unwrap();
            let after: Vec<_> = events.iter().filter(|e| e.seq > cursor).cloned().collect();
            if after.is_empty() {
                *self.empty_reads.lock().unwrap() += 1;
            }
            Ok(after)
        }

        async fn exit_logged(&self) -> Result<bool, ApiError> {
            let mut events = self.events.lock().unwrap();
            if *self.empty_reads.lock().unwrap() == 1 && events.last().unwrap().kind != "exit" {
                events.push(event(3, "exit", json!({"exit_code": 5})));
            }
            Ok(events.last().unwrap().kind == "exit")
        }
    }

    fn empty_output() -> Output {
        Output {
            stdout: String::new(),
            stderr: String::new(),
            next_offset: 0,
            complete: false,
            truncated: false,
        }
    }

    #[tokio::test]
    async fn a_read_after_the_exit_finds_nothing_at_once() {
        let log = ExitLandsAfterARead {
            events: Mutex::new(vec![
                event(1, "stdout", json!({"data": "a\n"})),
                event(2, "exit", json!({"exit_code": 0})),
            ]),
            empty_reads: Mutex::new(0),
        };
        let mut out = empty_output();
        out.next_offset = 2;
        read_output(&log, 2, i64::MAX, EXIT_EVENT_WAIT_TRIES, &mut out)
            .await
            .unwrap();
        assert_eq!(out.stdout, "");
        assert_eq!(out.next_offset, 2);
        // The exit is logged: one more read, not one per try.
        assert_eq!(*log.empty_reads.lock().unwrap(), 2);
    }

    #[tokio::test]
    async fn an_exit_that_lands_between_two_reads_is_read_and_completes_the_output() {
        let log = ExitLandsAfterARead {
            events: Mutex::new(vec![
                event(1, "stdout", json!({"data": "a\n"})),
                event(2, "stderr", json!({"data": "b\n"})),
            ]),
            empty_reads: Mutex::new(0),
        };
        let mut out = empty_output();
        read_output(&log, 0, i64::MAX, EXIT_EVENT_WAIT_TRIES, &mut out)
            .await
            .unwrap();
        assert_eq!((out.stdout.as_str(), out.stderr.as_str()), ("a\n", "b\n"));
        assert!(
            out.complete,
            "the exit was in the log before the read ended"
        );
        assert_eq!(out.next_offset, 3);
    }
}
