//! E2B's code interpreter (`e2b-dev/code-interpreter`) for sandboxes made from its template:
//! the service upstream runs beside envd on port 49999, reached as envd is (the routing
//! headers with `E2b-Sandbox-Port: 49999`, or the host `49999-<id>.<domain>`): `GET /health`,
//! `POST /execute` (a stream of JSON lines), and contexts (`POST`/`GET /contexts`,
//! `DELETE /contexts/{id}`, `POST /contexts/{id}/restart`).
//!
//! Each context is a kernel: a long-lived Python process of the sandbox (`kernel.py`, started
//! as envd starts a command, so with the sandbox's isolation, user, environment and home),
//! whose namespace lasts as long as it does. A kernel is an ordinary process record of the
//! sandbox with an `e2b_kernel` object in its body (the context's ID, language, cwd, whether
//! it is a language's default, the secret the kernel asks of every connection); it says on
//! its stdout which loopback port of the sandbox it listens on, and every execution is one
//! connection to it, so executions of a context run one after another. A context whose
//! kernel has died is started again when next used, with a fresh namespace, as Jupyter
//! restarts a dead kernel. Upstream's behaviour and what is not served: `docs/profiles/e2b.md`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};

use crate::api::AppState;
use crate::api::extract::read_body;
use crate::clock::now;
use crate::defects::Defect;
use crate::domain::{IdKind, Process, ProcessSpec, ProcessState, QualifiedId};
use crate::sandbox::{ProviderError, Signal, process_record};
use crate::store::{Kind, ListQuery, Record, Scope, StoreError};
use crate::stream::process_stream;

use super::envd::{self, EnvdSandbox};

/// The port the code interpreter's service listens on inside a sandbox.
pub const PORT: u16 = 49999;
/// The template the `e2b-code-interpreter` SDKs create sandboxes from (`DEFAULT_TEMPLATE`).
pub const TEMPLATE: &str = "code-interpreter-v1";
/// The one language served.
const PYTHON: &str = "python";

/// The kernel program, written to the kernel's stdin after its configuration.
const KERNEL: &str = include_str!("kernel.py");
/// What the kernel process runs: it reads its configuration and program from stdin.
const BOOTSTRAP: &str = "import json,sys;c=json.loads(sys.stdin.readline());\
exec(compile(sys.stdin.read(),'<sandspec-kernel>','exec'),{'__name__':'sandspec_kernel','CONFIG':c})";
/// How long a kernel has to say which port it listens on.
const KERNEL_START: Duration = Duration::from_secs(30);
/// How long an execution stream may be silent before a keepalive line (upstream's interval):
/// the write also tells a client that went away from one still reading.
const KEEPALIVE: Duration = Duration::from_secs(5);
/// The longest line a kernel may send (a result with a large image).
const MAX_LINE: usize = 64 * 1024 * 1024;

/// Serializes choosing a language's default context and starting a dead kernel again, so
/// that two requests never start two kernels for one context.
static KERNELS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What a kernel's process record keeps in `e2b_kernel`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct KernelInfo {
    context_id: String,
    language: String,
    /// The context's working directory as asked (`/home/user` by default).
    cwd: String,
    /// The context `/execute` uses for its language when given no context.
    #[serde(default)]
    default: bool,
    /// Asked of every connection to the kernel, so that only this server runs code there.
    token: String,
    /// The context was removed; its kernel is killed.
    #[serde(default)]
    removed: bool,
}

fn kernel_of(rec: &Record) -> Option<KernelInfo> {
    rec.body
        .get("e2b_kernel")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
}

/// A failed request: a plain-text body, as the service's FastAPI handlers answer, or a
/// validation error (422 with `detail`, as FastAPI answers a body it cannot take).
#[derive(Debug)]
enum Failure {
    Text(StatusCode, String),
    Invalid(String),
}

impl Failure {
    fn internal(e: impl std::fmt::Display) -> Failure {
        tracing::error!(error = %e, "code interpreter failed");
        Failure::Text(StatusCode::INTERNAL_SERVER_ERROR, "internal error".into())
    }

    fn context_not_found(id: &str) -> Failure {
        Failure::Text(StatusCode::NOT_FOUND, format!("Context {id} not found"))
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Failure::internal(e)
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        match self {
            Failure::Text(status, text) => (
                status,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                text,
            )
                .into_response(),
            Failure::Invalid(why) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                Json(json!({"detail": why})),
            )
                .into_response(),
        }
    }
}

/// A request routed to port 49999 of a sandbox that serves the code interpreter.
pub async fn serve(state: AppState, sbx: EnvdSandbox, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().trim_end_matches('/').to_owned();
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    let limit = state.config.limits.max_file_bytes;
    let read = |body: Body| async move {
        read_body(&parts.headers, body, limit)
            .await
            .map_err(|_| Failure::Text(StatusCode::PAYLOAD_TOO_LARGE, "body too large".into()))
    };
    let result = match (&parts.method, segments.as_slice()) {
        (&Method::GET, ["health"]) => Ok(Json("OK").into_response()),
        (&Method::POST, ["execute"]) => match read(body).await {
            Ok(raw) => execute(&state, &sbx, &raw).await,
            Err(e) => Err(e),
        },
        (&Method::POST, ["contexts"]) => match read(body).await {
            Ok(raw) => create_context(&state, &sbx, &raw).await,
            Err(e) => Err(e),
        },
        (&Method::GET, ["contexts"]) => list_contexts(&state, &sbx).await,
        (&Method::DELETE, ["contexts", id]) => remove_context(&state, &sbx, id).await,
        (&Method::POST, ["contexts", id, "restart"]) => restart_context(&state, &sbx, id).await,
        (_, ["health" | "execute" | "contexts"] | ["contexts", _] | ["contexts", _, "restart"]) => {
            Ok((
                StatusCode::METHOD_NOT_ALLOWED,
                Json(json!({"detail": "Method Not Allowed"})),
            )
                .into_response())
        }
        _ => Ok((StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"}))).into_response()),
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

/// The body of a request as the service's pydantic models take it: a JSON object whose
/// unknown fields are ignored and whose optional fields may be null.
fn object(raw: &[u8]) -> Result<serde_json::Map<String, Value>, Failure> {
    match serde_json::from_slice::<Value>(raw) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(Failure::Invalid("the body must be a JSON object".into())),
        Err(e) => Err(Failure::Invalid(format!("the body is not JSON: {e}"))),
    }
}

/// An optional string field: absent or null is `None`; anything but a string is refused.
fn optional_string(
    body: &serde_json::Map<String, Value>,
    field: &str,
) -> Result<Option<String>, Failure> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(Failure::Invalid(format!("`{field}` must be a string"))),
    }
}

/// The language as the service normalizes it: absent or empty is Python, case and
/// surrounding space are ignored, `js` and `ts` are JavaScript and TypeScript.
fn normalize_language(language: Option<&str>) -> String {
    let language = language
        .map(|l| l.trim().to_lowercase())
        .unwrap_or_default();
    match language.as_str() {
        "" => PYTHON.to_owned(),
        "js" => "javascript".to_owned(),
        "ts" => "typescript".to_owned(),
        _ => language,
    }
}

/// Refuses a language this service has no kernel for.
fn served(language: &str) -> Result<(), Failure> {
    if language == PYTHON {
        return Ok(());
    }
    Err(Failure::Text(
        StatusCode::BAD_REQUEST,
        format!(
            "the language `{language}` is not served: this code interpreter has Python kernels only"
        ),
    ))
}

fn context_view(k: &KernelInfo) -> Value {
    json!({"id": k.context_id, "language": k.language, "cwd": k.cwd})
}

/// Jupyter's kernel IDs are UUIDs (version 4); so are the contexts' here.
fn new_context_id() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The kernel records of the sandbox, oldest first.
async fn kernel_records(
    state: &AppState,
    sbx: &EnvdSandbox,
) -> Result<Vec<(Record, KernelInfo)>, Failure> {
    let mut q = ListQuery::new(Kind::Process, Scope::System);
    q.parent = Some(&sbx.rec.id);
    let mut out: Vec<(Record, KernelInfo)> = state
        .store
        .list(&q)
        .await?
        .into_iter()
        .filter_map(|r| kernel_of(&r).map(|k| (r, k)))
        .collect();
    out.sort_by(|a, b| (a.0.created_at, &a.0.id).cmp(&(b.0.created_at, &b.0.id)));
    Ok(out)
}

/// The sandbox's contexts: for each context, its newest kernel record, unless removed.
async fn contexts(
    state: &AppState,
    sbx: &EnvdSandbox,
) -> Result<Vec<(Record, KernelInfo)>, Failure> {
    let mut latest: BTreeMap<String, (Record, KernelInfo)> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    for (rec, k) in kernel_records(state, sbx).await? {
        if !latest.contains_key(&k.context_id) {
            order.push(k.context_id.clone());
        }
        latest.insert(k.context_id.clone(), (rec, k));
    }
    Ok(order
        .into_iter()
        .filter_map(|id| latest.remove(&id))
        .filter(|(_, k)| !k.removed)
        .collect())
}

async fn context(
    state: &AppState,
    sbx: &EnvdSandbox,
    id: &str,
) -> Result<(Record, KernelInfo), Failure> {
    contexts(state, sbx)
        .await?
        .into_iter()
        .find(|(_, k)| k.context_id == id)
        .ok_or_else(|| Failure::context_not_found(id))
}

fn running(rec: &Record) -> bool {
    rec.state == ProcessState::Running.as_str()
}

/// Starts a kernel for `info` (a new context, or one started again): its process record,
/// the process, its program on stdin, and the port it then announces.
async fn start_kernel(
    state: &AppState,
    sbx: &EnvdSandbox,
    info: KernelInfo,
) -> Result<(Record, KernelInfo), Failure> {
    let rel = envd::to_rel(&info.cwd).map_err(|_| {
        Failure::Text(
            StatusCode::BAD_REQUEST,
            format!("cwd {} is outside the sandbox ({})", info.cwd, envd::HOME),
        )
    })?;
    let cmd: Vec<String> = vec!["python3".into(), "-c".into(), BOOTSTRAP.into()];
    let spec = ProcessSpec {
        cmd: cmd.clone(),
        cwd: (!rel.is_empty()).then_some(rel),
        env: BTreeMap::new(),
        stdin: true,
        timeout_ms: None,
        tag: None,
    };
    // The kernel is one of the sandbox's processes: its environment is theirs.
    let sandbox_env = if state.config.defects.has(Defect::E2bCiEnvVarsDropped) {
        BTreeMap::new()
    } else {
        sbx.env()
    };
    let (provider_name, _) = crate::api::lookup::split(&sbx.rec.id).map_err(Failure::internal)?;
    let process = Process::running(
        QualifiedId::new(
            provider_name,
            sbx.provider.allocate_local_id(IdKind::Process),
        )
        .to_string(),
        sbx.rec.id.clone(),
        cmd,
        None,
        now(),
    );
    let mut body = serde_json::to_value(&process).map_err(Failure::internal)?;
    body["e2b_kernel"] = serde_json::to_value(&info).map_err(Failure::internal)?;
    let rec = process_record(&process, sbx.rec.owner.clone(), body);
    state.store.insert(&rec).await?;
    if let Err(e) = sbx
        .provider
        .spawn(&sbx.local, rec.clone(), &spec, &sandbox_env)
        .await
    {
        if let Err(e) = state.store.delete(Kind::Process, &rec.id).await {
            tracing::warn!(error = %e, "could not remove the record of a kernel that did not start");
        }
        return Err(match e {
            ProviderError::InvalidPath => Failure::Text(
                StatusCode::BAD_REQUEST,
                format!("cwd {} is outside the sandbox", info.cwd),
            ),
            ProviderError::InvalidArgument { detail, .. } => Failure::Text(
                StatusCode::BAD_REQUEST,
                format!("Failed to create context: {detail}"),
            ),
            other => Failure::internal(other),
        });
    }
    let config = json!({"token": info.token});
    let program = format!("{config}\n{KERNEL}");
    let started = match sbx
        .provider
        .write_stdin(&rec.id, program.as_bytes(), true)
        .await
    {
        Ok(()) => announced_port(state, &rec.id, Some(KERNEL_START)).await,
        Err(e) => Err(format!("its program could not be written: {e}")),
    };
    if let Err(why) = started {
        let _ = sbx.provider.signal(&rec.id, Signal::Kill);
        return Err(Failure::Text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("Failed to create context: the kernel did not start: {why}"),
        ));
    }
    Ok((rec, info))
}

/// The port a kernel announced on its stdout. With `wait`, waits that long for it; without,
/// answers from what the kernel has written so far. An error says why there is none.
async fn announced_port(
    state: &AppState,
    process_id: &str,
    wait: Option<Duration>,
) -> Result<u16, String> {
    let stream = process_stream(process_id);
    let mut woken = state.log.follow(&stream);
    let deadline = tokio::time::Instant::now() + wait.unwrap_or_default();
    let (mut cursor, mut out, mut err) = (0, String::new(), String::new());
    loop {
        let events = state
            .log
            .read_after(&stream, cursor, 256)
            .await
            .map_err(|e| e.to_string())?;
        for framed in &events {
            let event = &framed.event;
            cursor = event.seq;
            let text = event.data.get("data").and_then(Value::as_str).unwrap_or("");
            match event.kind.as_str() {
                "stdout" => out.push_str(text),
                "stderr" if err.len() < 4096 => err.push_str(text),
                "exit" => {
                    return Err(format!("it exited: {}", err.trim()));
                }
                _ => {}
            }
        }
        if let Some((line, _)) = out.split_once('\n') {
            return serde_json::from_str::<Value>(line)
                .ok()
                .and_then(|v| v.get("port").and_then(Value::as_u64))
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| "it announced no port".to_owned());
        }
        if !events.is_empty() {
            continue;
        }
        if wait.is_none() {
            return Err("it has not announced its port".into());
        }
        tokio::select! {
            _ = woken.changed() => {}
            () = tokio::time::sleep(Duration::from_millis(200)) => {}
            () = tokio::time::sleep_until(deadline) => {
                return Err(format!("no port within {}s", KERNEL_START.as_secs()));
            }
        }
    }
}

/// A running kernel for the context: its kernel as it is, or, when that one has died, a new
/// one with a fresh namespace (as Jupyter restarts a kernel that died).
async fn live_kernel(
    state: &AppState,
    sbx: &EnvdSandbox,
    context_id: &str,
) -> Result<(Record, KernelInfo), Failure> {
    let (rec, info) = context(state, sbx, context_id).await?;
    if running(&rec) {
        return Ok((rec, info));
    }
    let _serial = KERNELS.lock().await;
    let (rec, info) = context(state, sbx, context_id).await?;
    if running(&rec) {
        return Ok((rec, info));
    }
    start_kernel(state, sbx, info).await
}

/// The default context of `language`, made when there is none yet.
async fn default_context(
    state: &AppState,
    sbx: &EnvdSandbox,
    language: &str,
) -> Result<String, Failure> {
    let _serial = KERNELS.lock().await;
    if let Some((_, k)) = contexts(state, sbx)
        .await?
        .into_iter()
        .find(|(_, k)| k.default && k.language == language)
    {
        return Ok(k.context_id);
    }
    let info = KernelInfo {
        context_id: new_context_id(),
        language: language.to_owned(),
        cwd: envd::HOME.to_owned(),
        default: true,
        token: crate::domain::new_token(),
        removed: false,
    };
    Ok(start_kernel(state, sbx, info).await?.1.context_id)
}

/// Changes a kernel record's `e2b_kernel`, retrying when its process's exit is recorded at
/// the same time.
async fn update_kernel(
    state: &AppState,
    id: &str,
    change: impl Fn(&mut KernelInfo),
) -> Result<(), Failure> {
    for _ in 0..16 {
        let Some(mut rec) = state.store.get(Kind::Process, Scope::System, id).await? else {
            return Ok(());
        };
        let Some(mut info) = kernel_of(&rec) else {
            return Ok(());
        };
        change(&mut info);
        rec.body["e2b_kernel"] = serde_json::to_value(&info).map_err(Failure::internal)?;
        match state.store.update(&rec).await {
            Ok(_) | Err(StoreError::NotFound) => return Ok(()),
            Err(StoreError::Conflict) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(Failure::internal(format!(
        "kernel record {id} kept changing"
    )))
}

/// `POST /contexts`: `{language?, cwd?}`, a new context with a kernel of its own.
async fn create_context(
    state: &AppState,
    sbx: &EnvdSandbox,
    raw: &[u8],
) -> Result<Response, Failure> {
    let body = object(raw)?;
    let language = normalize_language(optional_string(&body, "language")?.as_deref());
    served(&language)?;
    let cwd = optional_string(&body, "cwd")?
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| envd::HOME.to_owned());
    let info = KernelInfo {
        context_id: new_context_id(),
        language,
        cwd,
        default: false,
        token: crate::domain::new_token(),
        removed: false,
    };
    let (_, info) = start_kernel(state, sbx, info).await?;
    Ok(Json(context_view(&info)).into_response())
}

/// `GET /contexts`: every context of the sandbox, the default one included (it is made by
/// the first request to the service, as upstream's exists from the service's start).
async fn list_contexts(state: &AppState, sbx: &EnvdSandbox) -> Result<Response, Failure> {
    if !contexts(state, sbx)
        .await?
        .iter()
        .any(|(_, k)| k.default && k.language == PYTHON)
    {
        default_context(state, sbx, PYTHON).await?;
    }
    let list: Vec<Value> = contexts(state, sbx)
        .await?
        .iter()
        .map(|(_, k)| context_view(k))
        .collect();
    Ok(Json(list).into_response())
}

/// `DELETE /contexts/{id}`: the context is gone and its kernel killed.
async fn remove_context(
    state: &AppState,
    sbx: &EnvdSandbox,
    id: &str,
) -> Result<Response, Failure> {
    let (rec, _) = context(state, sbx, id).await?;
    update_kernel(state, &rec.id, |k| k.removed = true).await?;
    if running(&rec) {
        let _ = sbx.provider.signal(&rec.id, Signal::Kill);
    }
    Ok(Json(Value::Null).into_response())
}

/// `POST /contexts/{id}/restart`: the context keeps its ID, language and cwd, and gets a
/// new kernel (a fresh namespace).
async fn restart_context(
    state: &AppState,
    sbx: &EnvdSandbox,
    id: &str,
) -> Result<Response, Failure> {
    let _serial = KERNELS.lock().await;
    let (rec, info) = context(state, sbx, id).await?;
    restart(state, sbx, &rec, info).await?;
    Ok(Json(Value::Null).into_response())
}

/// Kills a context's kernel and starts another for it.
async fn restart(
    state: &AppState,
    sbx: &EnvdSandbox,
    rec: &Record,
    info: KernelInfo,
) -> Result<(Record, KernelInfo), Failure> {
    if running(rec) {
        let _ = sbx.provider.signal(&rec.id, Signal::Kill);
    }
    start_kernel(state, sbx, info).await
}

/// What `/execute` is asked.
struct Execution {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: BTreeMap<String, String>,
}

fn execution(raw: &[u8]) -> Result<Execution, Failure> {
    let body = object(raw)?;
    let code = match body.get("code") {
        Some(Value::String(s)) => s.clone(),
        None => return Err(Failure::Invalid("`code` is required".into())),
        Some(_) => return Err(Failure::Invalid("`code` must be a string".into())),
    };
    let env_vars = match body.get("env_vars") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(Failure::Invalid(format!("`env_vars.{k}` must be a string"))),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(Failure::Invalid(
                "`env_vars` must be an object of strings".into(),
            ));
        }
    };
    if env_vars
        .iter()
        .any(|(k, v)| k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0'))
    {
        return Err(Failure::Invalid(
            "`env_vars` names must be non-empty without `=` or NUL".into(),
        ));
    }
    Ok(Execution {
        code,
        context_id: optional_string(&body, "context_id")?,
        language: optional_string(&body, "language")?,
        env_vars,
    })
}

/// `POST /execute`: `{code, context_id?, language?, env_vars?}` runs the code in the context
/// (by default the language's default context, Python when no language is given) and streams
/// what it does as JSON lines, the last being `{"type": "end_of_execution"}`.
async fn execute(state: &AppState, sbx: &EnvdSandbox, raw: &[u8]) -> Result<Response, Failure> {
    let req = execution(raw)?;
    let context_id = match (&req.context_id, &req.language) {
        (Some(_), Some(_)) => {
            return Err(Failure::Text(
                StatusCode::BAD_REQUEST,
                "Only one of context_id or language can be provided".into(),
            ));
        }
        (Some(id), None) => id.clone(),
        (None, language) => {
            let language = normalize_language(language.as_deref());
            served(&language)?;
            default_context(state, sbx, &language).await?
        }
    };
    let (mut rec, mut info) = live_kernel(state, sbx, &context_id).await?;
    if state.config.defects.has(Defect::E2bCiContextsShareState) && !info.default {
        // The defect: every context runs its code in the default context's kernel.
        let default = default_context(state, sbx, &info.language).await?;
        (rec, info) = live_kernel(state, sbx, &default).await?;
    }
    if state.config.defects.has(Defect::E2bCiStateLost) {
        // The defect: each execution gets a kernel of its own, so nothing is kept.
        let _serial = KERNELS.lock().await;
        (rec, info) = restart(state, sbx, &rec, info).await?;
    }
    let port = match announced_port(state, &rec.id, None).await {
        Ok(port) => port,
        Err(why) => return Err(Failure::internal(format!("kernel {}: {why}", rec.id))),
    };
    let stream = match sbx.provider.connect(&sbx.local, port).await {
        Ok(stream) => stream,
        // It died since it was looked at: once more, with the kernel started again.
        Err(_) => {
            let (again, again_info) = live_kernel(state, sbx, &info.context_id).await?;
            let port = announced_port(state, &again.id, None)
                .await
                .map_err(|why| Failure::internal(format!("kernel {}: {why}", again.id)))?;
            rec = again;
            info = again_info;
            sbx.provider
                .connect(&sbx.local, port)
                .await
                .map_err(Failure::internal)?
        }
    };
    let request = json!({"token": info.token, "code": req.code, "env": req.env_vars});
    let (read, mut write) = stream.into_split();
    write
        .write_all(format!("{request}\n").as_bytes())
        .await
        .map_err(Failure::internal)?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(64);
    let pump = Pump {
        state: state.clone(),
        provider: sbx.provider.clone(),
        kernel: rec.id,
        tx,
    };
    tokio::spawn(pump.run(read, write));
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Ok((StatusCode::OK, body).into_response())
}

/// Carries one execution's lines from its kernel connection to the client.
struct Pump {
    state: AppState,
    provider: std::sync::Arc<crate::sandbox::LocalProvider>,
    kernel: String,
    tx: tokio::sync::mpsc::Sender<Result<Bytes, Infallible>>,
}

enum Next {
    Line(Option<Vec<u8>>),
    Keepalive,
    Gone,
}

impl Pump {
    async fn send(&self, value: &Value) -> bool {
        let line = Bytes::from(format!("{value}\n"));
        self.tx.send(Ok(line)).await.is_ok()
    }

    async fn run(
        self,
        read: tokio::net::tcp::OwnedReadHalf,
        // Kept open while the execution runs: the kernel drops a connection that closed.
        _write: tokio::net::tcp::OwnedWriteHalf,
    ) {
        let mut reader = tokio::io::BufReader::new(read);
        let (mut started, mut done) = (false, false);
        loop {
            let mut line = Vec::new();
            let next = tokio::select! {
                read = read_line(&mut reader, &mut line) => Next::Line(read.then_some(line)),
                () = tokio::time::sleep(KEEPALIVE) => Next::Keepalive,
                () = self.tx.closed() => Next::Gone,
            };
            let message = match next {
                Next::Line(None) => break,
                Next::Line(Some(line)) => match serde_json::from_slice::<Value>(&line) {
                    Ok(v) => v,
                    Err(_) => continue,
                },
                Next::Keepalive => json!({"type": "keepalive"}),
                Next::Gone => return self.gone(started, done),
            };
            let message = match message.get("type").and_then(Value::as_str) {
                Some("sandspec_done") => {
                    done = true;
                    break;
                }
                Some("number_of_executions") => {
                    started = true;
                    message
                }
                Some("error") if self.state.config.defects.has(Defect::E2bCiErrorAsStderr) => {
                    // The defect: an exception is reported as text on stderr, not as an error.
                    json!({
                        "type": "stderr",
                        "text": message.get("traceback").and_then(Value::as_str).unwrap_or(""),
                        "timestamp": crate::clock::now()
                            .format(&time::format_description::well_known::Rfc3339)
                            .unwrap_or_default(),
                    })
                }
                _ => message,
            };
            if !self.send(&message).await {
                return self.gone(started, done);
            }
        }
        if !done {
            // The connection ended under the execution: the kernel died (its context gets a
            // new one when next used), or the connection broke.
            let died = self.kernel_ended().await;
            let (name, value) = if died {
                ("ContextRestarting", "Context was restarted")
            } else {
                (
                    "UnexpectedEndOfExecution",
                    "Connection to the execution was closed before the execution was finished",
                )
            };
            if !self
                .send(&json!({"type": "error", "name": name, "value": value, "traceback": ""}))
                .await
            {
                return;
            }
        }
        self.send(&json!({"type": "end_of_execution"})).await;
    }

    /// The client went away: an execution that is running is interrupted, as upstream
    /// interrupts the kernel when its client disconnects, so that the next one is not held
    /// up. One still waiting for the kernel is never run (its connection closes now).
    fn gone(&self, started: bool, done: bool) {
        if started
            && !done
            && !self
                .state
                .config
                .defects
                .has(Defect::E2bCiDisconnectNotInterrupted)
        {
            let _ = self.provider.signal(&self.kernel, Signal::Int);
        }
    }

    /// Whether the kernel's process has ended (its exit is recorded within a moment).
    async fn kernel_ended(&self) -> bool {
        for _ in 0..20 {
            match self
                .state
                .store
                .get(Kind::Process, Scope::System, &self.kernel)
                .await
            {
                Ok(Some(rec)) if running(&rec) => {}
                _ => return true,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }
}

/// Reads one line (without its newline) into `line`; false at the end of the connection, on
/// an error, or for a line longer than `MAX_LINE`.
async fn read_line(
    reader: &mut tokio::io::BufReader<tokio::net::tcp::OwnedReadHalf>,
    line: &mut Vec<u8>,
) -> bool {
    loop {
        let available = match reader.fill_buf().await {
            Ok([]) | Err(_) => return false,
            Ok(buf) => buf,
        };
        match available.iter().position(|b| *b == b'\n') {
            Some(i) => {
                line.extend_from_slice(&available[..i]);
                reader.consume(i + 1);
                return true;
            }
            None => {
                let n = available.len();
                line.extend_from_slice(available);
                reader.consume(n);
                if line.len() > MAX_LINE {
                    return false;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn languages_are_normalized_as_the_service_does() {
        assert_eq!(normalize_language(None), "python");
        assert_eq!(normalize_language(Some("")), "python");
        assert_eq!(normalize_language(Some(" Python ")), "python");
        assert_eq!(normalize_language(Some("js")), "javascript");
        assert_eq!(normalize_language(Some("TS")), "typescript");
        assert!(served("python").is_ok());
        assert!(served("javascript").is_err());
    }

    #[test]
    fn context_ids_are_version_4_uuids() {
        let id = new_context_id();
        let parts: Vec<&str> = id.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(parts[2].starts_with('4'), "{id}");
        assert!(matches!(&parts[3][..1], "8" | "9" | "a" | "b"), "{id}");
        assert_ne!(id, new_context_id());
    }

    #[test]
    fn execution_bodies_are_taken_as_the_service_takes_them() {
        let e = execution(
            br#"{"code": "1", "context_id": null, "language": null, "env_vars": null, "more": 1}"#,
        )
        .unwrap_or_else(|_| panic!("a body the SDK sends"));
        assert_eq!(e.code, "1");
        assert!(e.context_id.is_none() && e.language.is_none() && e.env_vars.is_empty());
        for bad in [
            &br#"{}"#[..],
            br#"{"code": 1}"#,
            br#"{"code": "1", "env_vars": {"A": 1}}"#,
            br#"{"code": "1", "env_vars": {"": "x"}}"#,
            br#"[]"#,
            br#"not json"#,
        ] {
            assert!(
                matches!(execution(bad), Err(Failure::Invalid(_))),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
