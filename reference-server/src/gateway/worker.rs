//! The worker runtime: runs inside a session's sandbox (as `sandspec-worker`), takes the
//! session's lease over the private bridge, heartbeats, and runs each turn it is given:
//! model calls to an OpenAI-compatible endpoint and the tool calls the model asks for.
//!
//! Every operation is recorded through the bridge before its side effect starts (the
//! write-ahead record that uncertain outcomes are decided from). A cancel seen in a
//! heartbeat ends the running tool's process group; a lost lease ends the worker.

use std::collections::HashSet;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt as _;
use tokio_util::sync::CancellationToken;

use super::signing::{REVISION_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign};

/// How long the worker waits before asking for work again when there is none.
const IDLE_POLL: Duration = Duration::from_millis(150);
/// How long an idle worker's `POST /next` asks the gateway to wait for work.
const NEXT_WAIT_MS: u64 = 1_000;
/// How long one bridge request may take.
const BRIDGE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one model call may take before the turn fails with `model_error`.
const MODEL_TIMEOUT: Duration = Duration::from_secs(600);
/// After a tool exits, how long output still in its pipes is waited for.
const OUTPUT_DRAIN: Duration = Duration::from_millis(500);
/// How often a running tool checks whether it was cancelled.
const CANCEL_POLL: Duration = Duration::from_millis(50);

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("missing environment variable {0} (or, for the secret, a first line on stdin)")]
    MissingEnv(&'static str),
    #[error("bridge request failed: {0}")]
    Bridge(String),
    #[error("the lease was lost")]
    LeaseLost,
    #[error("unexpected bridge answer {status} to {path}")]
    Unexpected { status: u16, path: String },
}

/// What the gateway tells its worker, through the environment.
#[derive(Clone)]
pub struct WorkerEnv {
    pub bridge_url: String,
    pub session_id: String,
    pub secret: String,
    pub control_revision: String,
    pub worker_id: String,
    pub model_base_url: String,
    pub model_api_key: Option<String>,
    /// Sent instead of the session's `agent.model` when set.
    pub model_override: Option<String>,
    pub heartbeat: Duration,
    pub max_steps: u32,
    pub max_tool_output_bytes: usize,
    /// PEM certificates to trust for an HTTPS bridge (the server's own), if any.
    pub bridge_ca_file: Option<String>,
}

/// Variables that must not reach the processes the worker's tools start.
const PRIVATE_VARS: &[&str] = &[
    "SANDSPEC_BRIDGE_URL",
    "SANDSPEC_SESSION_ID",
    "SANDSPEC_BRIDGE_SECRET",
    "SANDSPEC_CONTROL_REVISION",
    "SANDSPEC_WORKER_ID",
    "SANDSPEC_MODEL_BASE_URL",
    "SANDSPEC_MODEL_API_KEY",
    "SANDSPEC_MODEL",
    "SANDSPEC_HEARTBEAT_MS",
    "SANDSPEC_MAX_STEPS",
    "SANDSPEC_MAX_TOOL_OUTPUT_BYTES",
    "SANDSPEC_BRIDGE_CA_FILE",
];

impl WorkerEnv {
    pub fn from_env() -> Result<Self, WorkerError> {
        let var =
            |name: &'static str| std::env::var(name).map_err(|_| WorkerError::MissingEnv(name));
        let num = |name: &'static str, default: u64| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(default)
        };
        Ok(Self {
            bridge_url: var("SANDSPEC_BRIDGE_URL")?,
            session_id: var("SANDSPEC_SESSION_ID")?,
            secret: match std::env::var("SANDSPEC_BRIDGE_SECRET") {
                Ok(secret) => secret,
                Err(_) => secret_from_stdin()?,
            },
            control_revision: var("SANDSPEC_CONTROL_REVISION")?,
            worker_id: var("SANDSPEC_WORKER_ID").unwrap_or_else(|_| "worker".into()),
            model_base_url: var("SANDSPEC_MODEL_BASE_URL")?,
            model_api_key: std::env::var("SANDSPEC_MODEL_API_KEY").ok(),
            model_override: std::env::var("SANDSPEC_MODEL")
                .ok()
                .filter(|m| !m.is_empty()),
            heartbeat: Duration::from_millis(num("SANDSPEC_HEARTBEAT_MS", 1000)),
            max_steps: u32::try_from(num("SANDSPEC_MAX_STEPS", 16)).unwrap_or(16),
            max_tool_output_bytes: usize::try_from(num("SANDSPEC_MAX_TOOL_OUTPUT_BYTES", 65536))
                .unwrap_or(65536),
            bridge_ca_file: std::env::var("SANDSPEC_BRIDGE_CA_FILE").ok(),
        })
    }
}

/// The bridge secret as the gateway hands it over: the first line of stdin.
fn secret_from_stdin() -> Result<String, WorkerError> {
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .map_err(|_| WorkerError::MissingEnv("SANDSPEC_BRIDGE_SECRET"))?;
    let secret = line.trim().to_owned();
    if secret.is_empty() {
        return Err(WorkerError::MissingEnv("SANDSPEC_BRIDGE_SECRET"));
    }
    Ok(secret)
}

/// One HTTP client for the bridge and the model endpoint; HTTPS endpoints are verified
/// against the platform's trust store.
type HttpClient = reqwest::Client;

async fn http_post(
    client: &HttpClient,
    url: &str,
    headers: &[(&str, String)],
    body: Vec<u8>,
    timeout: Duration,
) -> Result<(u16, Bytes), WorkerError> {
    let mut req = client
        .post(url)
        .timeout(timeout)
        .header("content-type", "application/json")
        .body(body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let resp = req
        .send()
        .await
        .map_err(|e| WorkerError::Bridge(e.without_url().to_string()))?;
    let status = resp.status().as_u16();
    let bytes = resp
        .bytes()
        .await
        .map_err(|e| WorkerError::Bridge(e.without_url().to_string()))?;
    Ok((status, bytes))
}

/// Signed requests to the session's bridge.
struct Bridge {
    client: HttpClient,
    env: WorkerEnv,
}

impl Bridge {
    async fn post(&self, suffix: &str, body: &Value) -> Result<(u16, Value), WorkerError> {
        let target = format!("/bridge/v1/sessions/{}/{suffix}", self.env.session_id);
        let body = serde_json::to_vec(body).map_err(|e| WorkerError::Bridge(e.to_string()))?;
        let ts = time::OffsetDateTime::now_utc().unix_timestamp().to_string();
        let sig = sign(&self.env.secret, "POST", &target, &body, &ts);
        let headers = [
            (TIMESTAMP_HEADER, ts),
            (SIGNATURE_HEADER, sig),
            (REVISION_HEADER, self.env.control_revision.clone()),
        ];
        let (status, bytes) = http_post(
            &self.client,
            &format!("{}{target}", self.env.bridge_url),
            &headers,
            body,
            BRIDGE_TIMEOUT,
        )
        .await?;
        if status == 409
            && serde_json::from_slice::<Value>(&bytes)
                .ok()
                .and_then(|v| v.get("code").and_then(Value::as_str).map(str::to_owned))
                .as_deref()
                == Some("lease_lost")
        {
            return Err(WorkerError::LeaseLost);
        }
        let value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or(Value::Null)
        };
        Ok((status, value))
    }

    async fn expect(&self, suffix: &str, body: &Value, want: u16) -> Result<Value, WorkerError> {
        let (status, value) = self.post(suffix, body).await?;
        if status != want {
            return Err(WorkerError::Unexpected {
                status,
                path: suffix.to_owned(),
            });
        }
        Ok(value)
    }
}

/// Cancellation requests seen in heartbeats.
#[derive(Default)]
struct Cancels {
    submission: AtomicBool,
    operations: Mutex<HashSet<String>>,
}

impl Cancels {
    fn op_cancelled(&self, op: &str) -> bool {
        self.submission.load(Ordering::SeqCst)
            || self
                .operations
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(op)
    }
}

/// The whole worker process: reads its environment, runs, and maps the end to an exit
/// status (2: misconfigured, 3: lease lost, 1: other failure). Shared by `sandspec-worker`
/// and any binary that offers a `worker` subcommand.
pub async fn run_from_env() -> std::process::ExitCode {
    let env = match WorkerEnv::from_env() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("sandspec-worker: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match run(env).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(WorkerError::LeaseLost) => std::process::ExitCode::from(3),
        Err(e) => {
            eprintln!("sandspec-worker: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Runs the worker until its lease is lost or the bridge refuses it.
pub async fn run(env: WorkerEnv) -> Result<(), WorkerError> {
    // A binary that embeds the worker may have installed a crypto provider already; it is kept.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut builder = reqwest::Client::builder().connect_timeout(Duration::from_secs(10));
    if let Some(path) = &env.bridge_ca_file {
        let pem = std::fs::read(path).map_err(|e| WorkerError::Bridge(format!("{path}: {e}")))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| WorkerError::Bridge(format!("{path}: {e}")))?;
        for cert in certs {
            builder = builder.add_root_certificate(cert);
        }
    }
    let client = builder
        .build()
        .map_err(|e| WorkerError::Bridge(e.to_string()))?;
    let bridge = Arc::new(Bridge {
        client,
        env: env.clone(),
    });
    let lease = bridge
        .expect("lease", &json!({"worker_id": env.worker_id}), 201)
        .await?;
    let generation = lease
        .get("lease_generation")
        .and_then(Value::as_i64)
        .ok_or_else(|| WorkerError::Bridge("lease without a generation".into()))?;
    let cancels = Arc::new(Cancels::default());
    let lost = CancellationToken::new();
    {
        let bridge = Arc::clone(&bridge);
        let cancels = Arc::clone(&cancels);
        let lost = lost.clone();
        let every = env.heartbeat;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match bridge
                    .post("heartbeat", &json!({"lease_generation": generation}))
                    .await
                {
                    Ok((200, v)) => {
                        let sub = v
                            .get("cancel_submission")
                            .and_then(Value::as_bool)
                            .unwrap_or(false);
                        cancels.submission.store(sub, Ordering::SeqCst);
                        let ops: HashSet<String> = v
                            .get("cancel_operations")
                            .and_then(Value::as_array)
                            .map(|a| {
                                a.iter()
                                    .filter_map(|x| x.as_str().map(str::to_owned))
                                    .collect()
                            })
                            .unwrap_or_default();
                        *cancels.operations.lock().unwrap_or_else(|e| e.into_inner()) = ops;
                    }
                    Err(WorkerError::LeaseLost) | Ok((403 | 409, _)) => {
                        lost.cancel();
                        return;
                    }
                    // Transient: try again at the next beat; the lease has slack.
                    _ => {}
                }
            }
        });
    }
    let mut turns = tokio::task::JoinSet::new();
    loop {
        if lost.is_cancelled() {
            return Err(WorkerError::LeaseLost);
        }
        while let Some(done) = turns.try_join_next() {
            if let Ok(Err(WorkerError::LeaseLost)) = done {
                return Err(WorkerError::LeaseLost);
            }
        }
        // An idle worker lets the gateway hold its ask until work comes (or a second
        // passes); a busy one only asks whether more may start beside its turns.
        let idle = turns.is_empty();
        let asked = tokio::time::Instant::now();
        let ask = if idle {
            json!({"lease_generation": generation, "wait_ms": NEXT_WAIT_MS})
        } else {
            json!({"lease_generation": generation})
        };
        match bridge.post("next", &ask).await? {
            (200, work) => {
                let turn = Turn {
                    bridge: Arc::clone(&bridge),
                    generation,
                    cancels: Arc::clone(&cancels),
                    submission_id: work
                        .get("submission_id")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned(),
                    input: work
                        .get("input")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned(),
                    model: env.model_override.clone().unwrap_or_else(|| {
                        work.pointer("/agent/model")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned()
                    }),
                    instructions: work
                        .pointer("/agent/instructions")
                        .and_then(Value::as_str)
                        .map(str::to_owned),
                };
                let lost = lost.clone();
                turns.spawn(async move {
                    tokio::select! {
                        r = turn.run() => r,
                        () = lost.cancelled() => Err(WorkerError::LeaseLost),
                    }
                });
            }
            // The gateway waited the whole time for work and none came: ask again. An
            // earlier 204 (a server shutting down) gets the pause below instead.
            (204, _) if idle && asked.elapsed() >= Duration::from_millis(NEXT_WAIT_MS) => {}
            (204, _) => {
                // Nothing to take now: ask again after a pause, or at once when a turn of
                // this worker ends (the queue's next turn can start then).
                tokio::select! {
                    () = tokio::time::sleep(IDLE_POLL) => {}
                    () = lost.cancelled() => {}
                    Some(done) = turns.join_next(), if !turns.is_empty() => {
                        if let Ok(Err(WorkerError::LeaseLost)) = done {
                            return Err(WorkerError::LeaseLost);
                        }
                    }
                }
            }
            (403, _) => return Err(WorkerError::LeaseLost),
            (409, _) => tokio::time::sleep(IDLE_POLL).await,
            (status, _) => {
                return Err(WorkerError::Unexpected {
                    status,
                    path: "next".into(),
                });
            }
        }
    }
}

/// One submission being run.
struct Turn {
    bridge: Arc<Bridge>,
    generation: i64,
    cancels: Arc<Cancels>,
    submission_id: String,
    input: String,
    model: String,
    instructions: Option<String>,
}

/// What a model call answered.
struct ModelReply {
    content: String,
    tool_calls: Vec<(String, String, Value)>,
    raw_message: Value,
    input_tokens: u64,
    output_tokens: u64,
}

fn tool_definitions() -> Value {
    json!([
        {"type": "function", "function": {"name": "shell", "description": "Run a command in the sandbox",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "array", "items": {"type": "string"}}, "cwd": {"type": "string"}}, "required": ["cmd"]}}},
        {"type": "function", "function": {"name": "read_file", "description": "Read a text file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
        {"type": "function", "function": {"name": "write_file", "description": "Write a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}}},
    ])
}

impl Turn {
    async fn run(self) -> Result<(), WorkerError> {
        let mut messages = Vec::new();
        if let Some(system) = &self.instructions {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": self.input}));
        let (mut input_tokens, mut output_tokens) = (0u64, 0u64);
        let max_steps = self.bridge.env.max_steps;
        for _ in 0..max_steps {
            if self.cancels.submission.load(Ordering::SeqCst) {
                return self
                    .finish("cancelled", "", None, input_tokens, output_tokens)
                    .await;
            }
            let op = self
                .start_op("model_call", &self.model, "read", Value::Null)
                .await?;
            let reply = match self.call_model(&messages).await {
                Ok(r) => r,
                Err(message) => {
                    self.complete_op(&op, "failed", Some(message.clone()), None)
                        .await?;
                    let error = json!({"code": "model_error", "message": message});
                    return self
                        .finish("failed", "", Some(error), input_tokens, output_tokens)
                        .await;
                }
            };
            input_tokens += reply.input_tokens;
            output_tokens += reply.output_tokens;
            self.complete_op(&op, "succeeded", Some(reply.content.clone()), None)
                .await?;
            if !reply.content.is_empty() {
                self.output(None, "assistant", &reply.content).await?;
            }
            messages.push(reply.raw_message.clone());
            if reply.tool_calls.is_empty() {
                return self
                    .finish(
                        "completed",
                        &reply.content,
                        None,
                        input_tokens,
                        output_tokens,
                    )
                    .await;
            }
            for (call_id, name, args) in reply.tool_calls {
                if self.cancels.submission.load(Ordering::SeqCst) {
                    return self
                        .finish("cancelled", "", None, input_tokens, output_tokens)
                        .await;
                }
                let effect = if name == "read_file" { "read" } else { "write" };
                // The write-ahead record: nothing happens before the gateway has it.
                let op = self
                    .start_op("tool_call", &name, effect, args.clone())
                    .await?;
                let (state, text, exit_code) = self.run_tool(&op, &name, &args).await?;
                self.complete_op(&op, state, Some(text.clone()), exit_code)
                    .await?;
                messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": text}));
            }
        }
        let error = json!({"code": "step_budget_exceeded", "message": format!("more than {max_steps} model calls")});
        self.finish("failed", "", Some(error), input_tokens, output_tokens)
            .await
    }

    async fn start_op(
        &self,
        kind: &str,
        name: &str,
        effect: &str,
        input: Value,
    ) -> Result<String, WorkerError> {
        let input = if input.is_null() { Value::Null } else { input };
        let v = self
            .bridge
            .expect(
                "operations",
                &json!({
                    "lease_generation": self.generation,
                    "submission_id": self.submission_id,
                    "kind": kind,
                    "name": name,
                    "effect_class": effect,
                    "input": input,
                }),
                201,
            )
            .await?;
        v.get("operation_id")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| WorkerError::Bridge("operation without an id".into()))
    }

    async fn complete_op(
        &self,
        op: &str,
        state: &str,
        output: Option<String>,
        exit_code: Option<i32>,
    ) -> Result<(), WorkerError> {
        self.bridge
            .expect(
                &format!("operations/{op}/complete"),
                &json!({"lease_generation": self.generation, "state": state, "output": output, "exit_code": exit_code}),
                204,
            )
            .await
            .map(|_| ())
    }

    async fn output(&self, op: Option<&str>, stream: &str, text: &str) -> Result<(), WorkerError> {
        self.bridge
            .expect(
                "output",
                &json!({
                    "lease_generation": self.generation,
                    "submission_id": self.submission_id,
                    "operation_id": op,
                    "stream": stream,
                    "text": text,
                }),
                204,
            )
            .await
            .map(|_| ())
    }

    async fn finish(
        &self,
        state: &str,
        output: &str,
        error: Option<Value>,
        input_tokens: u64,
        output_tokens: u64,
    ) -> Result<(), WorkerError> {
        let stop_reason = match state {
            "completed" => "end_turn",
            "failed" => "error",
            _ => "cancelled",
        };
        self.bridge
            .expect(
                &format!("submissions/{}/complete", self.submission_id),
                &json!({
                    "lease_generation": self.generation,
                    "state": state,
                    "output": output,
                    "stop_reason": stop_reason,
                    "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
                    "error": error,
                }),
                204,
            )
            .await
            .map(|_| ())
    }

    async fn call_model(&self, messages: &[Value]) -> Result<ModelReply, String> {
        let env = &self.bridge.env;
        let url = format!(
            "{}/chat/completions",
            env.model_base_url.trim_end_matches('/')
        );
        let body = json!({"model": self.model, "messages": messages, "tools": tool_definitions()});
        let mut headers = Vec::new();
        if let Some(key) = &env.model_api_key {
            headers.push(("authorization", format!("Bearer {key}")));
        }
        let (status, bytes) = http_post(
            &self.bridge.client,
            &url,
            &headers,
            body.to_string().into_bytes(),
            MODEL_TIMEOUT,
        )
        .await
        .map_err(|e| format!("model endpoint unreachable: {e}"))?;
        let value: Value = serde_json::from_slice(&bytes)
            .map_err(|_| format!("model answered {status} without JSON"))?;
        if !(200..300).contains(&status) {
            let message = value
                .pointer("/error/message")
                .and_then(Value::as_str)
                .unwrap_or("model error");
            return Err(format!("model answered {status}: {message}"));
        }
        let message = value
            .pointer("/choices/0/message")
            .cloned()
            .ok_or("model answer without a message")?;
        let content = message
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let tool_calls = message
            .get("tool_calls")
            .and_then(Value::as_array)
            .map(|calls| {
                calls
                    .iter()
                    .map(|c| {
                        let id = c.get("id").and_then(Value::as_str).unwrap_or("").to_owned();
                        let name = c
                            .pointer("/function/name")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned();
                        let args = c
                            .pointer("/function/arguments")
                            .and_then(Value::as_str)
                            .and_then(|a| serde_json::from_str(a).ok())
                            .unwrap_or(Value::Null);
                        (id, name, args)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut raw_message = json!({"role": "assistant", "content": message.get("content").cloned().unwrap_or(Value::Null)});
        if let Some(calls) = message.get("tool_calls") {
            raw_message["tool_calls"] = calls.clone();
        }
        Ok(ModelReply {
            content,
            tool_calls,
            raw_message,
            input_tokens: value
                .pointer("/usage/prompt_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            output_tokens: value
                .pointer("/usage/completion_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
        })
    }

    /// Runs one tool: `(operation state, result text, exit code)`.
    async fn run_tool(
        &self,
        op: &str,
        name: &str,
        args: &Value,
    ) -> Result<(&'static str, String, Option<i32>), WorkerError> {
        let max = self.bridge.env.max_tool_output_bytes;
        let path_arg = |key: &str| args.get(key).and_then(Value::as_str).and_then(confined);
        Ok(match name {
            "shell" => {
                let cmd: Vec<String> = args
                    .get("cmd")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x.as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default();
                let cwd = match args.get("cwd").and_then(Value::as_str) {
                    None => Some(PathBuf::from(".")),
                    Some(c) => confined(c),
                };
                match (cmd.split_first(), cwd) {
                    (Some((prog, rest)), Some(cwd)) => {
                        self.shell(op, prog, rest, &cwd, max).await?
                    }
                    _ => (
                        "failed",
                        "shell needs a non-empty cmd and a relative cwd".into(),
                        None,
                    ),
                }
            }
            "read_file" => match path_arg("path") {
                Some(p) => match tokio::fs::read(&p).await {
                    Ok(bytes) => (
                        "succeeded",
                        clip(String::from_utf8_lossy(&bytes).into_owned(), max),
                        None,
                    ),
                    Err(e) => ("failed", format!("read_file: {e}"), None),
                },
                None => ("failed", "read_file needs a relative path".into(), None),
            },
            "write_file" => match (
                path_arg("path"),
                args.get("content").and_then(Value::as_str),
            ) {
                (Some(p), Some(content)) => {
                    if let Some(parent) = p.parent() {
                        let _ = tokio::fs::create_dir_all(parent).await;
                    }
                    match tokio::fs::write(&p, content).await {
                        Ok(()) => ("succeeded", format!("wrote {} bytes", content.len()), None),
                        Err(e) => ("failed", format!("write_file: {e}"), None),
                    }
                }
                _ => (
                    "failed",
                    "write_file needs a relative path and content".into(),
                    None,
                ),
            },
            other => ("failed", format!("unknown tool `{other}`"), None),
        })
    }

    async fn shell(
        &self,
        op: &str,
        prog: &str,
        rest: &[String],
        cwd: &Path,
        max: usize,
    ) -> Result<(&'static str, String, Option<i32>), WorkerError> {
        let mut command = tokio::process::Command::new(prog);
        command
            .args(rest)
            .current_dir(cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for var in PRIVATE_VARS {
            command.env_remove(var);
        }
        let mut child = match command.spawn() {
            Ok(c) => c,
            Err(e) => return Ok(("failed", format!("shell: {e}"), None)),
        };
        // Tools stay in the worker's process group, so that ending the worker (a kill, a
        // lost lease) ends them too; a cancel ends just this tool and what it started.
        let pid = child.id().and_then(|p| i32::try_from(p).ok());
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(&'static str, Vec<u8>)>(64);
        if let Some(pipe) = child.stdout.take() {
            tokio::spawn(forward(pipe, "stdout", tx.clone()));
        }
        if let Some(pipe) = child.stderr.take() {
            tokio::spawn(forward(pipe, "stderr", tx.clone()));
        }
        drop(tx);
        // Output is sent as it arrives, up to `max` bytes per tool; the rest is drained.
        let mut pending: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
        let mut collected = String::new();
        let (mut status, mut exited, mut readers_done, mut cancelled) = (None, false, false, false);
        let mut drain_until: Option<tokio::time::Instant> = None;
        loop {
            if exited && readers_done {
                break;
            }
            tokio::select! {
                chunk = rx.recv(), if !readers_done => match chunk {
                    Some((stream, bytes)) => {
                        let slot = &mut pending[usize::from(stream == "stderr")];
                        slot.extend_from_slice(&bytes);
                        let text = take_utf8(slot);
                        let room = max.saturating_sub(collected.len());
                        if !text.is_empty() && room > 0 {
                            let part = clip(text, room);
                            self.output(Some(op), stream, &part).await?;
                            collected.push_str(&part);
                        }
                    }
                    None => readers_done = true,
                },
                st = child.wait(), if !exited => {
                    status = st.ok();
                    exited = true;
                    // Something the tool left in the background may hold its pipes open.
                    drain_until = Some(tokio::time::Instant::now() + OUTPUT_DRAIN);
                }
                () = tokio::time::sleep(CANCEL_POLL), if !exited && !cancelled => {
                    if self.cancels.op_cancelled(op) {
                        cancelled = true;
                        if let Some(pid) = pid {
                            kill_tree(pid);
                        }
                    }
                }
                () = sleep_until_opt(drain_until) => break,
            }
        }
        let code = status.and_then(|s| s.code());
        if cancelled {
            return Ok(("cancelled", "cancelled".into(), code));
        }
        let state = if code == Some(0) {
            "succeeded"
        } else {
            "failed"
        };
        Ok((state, collected, code))
    }
}

/// Sends what a pipe yields, chunk by chunk, until it closes.
async fn forward(
    mut pipe: impl tokio::io::AsyncRead + Unpin,
    stream: &'static str,
    tx: tokio::sync::mpsc::Sender<(&'static str, Vec<u8>)>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if tx.send((stream, buf[..n].to_vec())).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Takes the longest valid UTF-8 prefix out of `bytes`, keeping an incomplete character at
/// the end for the next chunk; invalid bytes become U+FFFD.
fn take_utf8(bytes: &mut Vec<u8>) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => {
            let s = s.to_owned();
            bytes.clear();
            s
        }
        Err(e) if e.error_len().is_none() => {
            let valid = e.valid_up_to();
            let s = String::from_utf8_lossy(&bytes[..valid]).into_owned();
            bytes.drain(..valid);
            s
        }
        Err(_) => {
            let s = String::from_utf8_lossy(bytes).into_owned();
            bytes.clear();
            s
        }
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// SIGKILLs `pid` and every process descended from it, found through `/proc`.
fn kill_tree(pid: i32) {
    let mut parents: Vec<(i32, i32)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(p) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<i32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
                continue;
            };
            // The fields after the command (which may contain spaces) start after the last ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|v| v.parse::<i32>().ok());
            if let Some(ppid) = ppid {
                parents.push((p, ppid));
            }
        }
    }
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    for p in tree {
        // SAFETY: kill(2) with a PID of this worker's own descendants; no memory is involved.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
}

/// A path relative to the sandbox root (the worker's working directory) that stays inside it.
fn confined(p: &str) -> Option<PathBuf> {
    let path = Path::new(p);
    let ok = !p.is_empty()
        && path
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    ok.then(|| path.to_path_buf())
}

fn clip(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}
