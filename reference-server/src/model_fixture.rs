//! A fixture model server: an OpenAI-compatible `POST /v1/chat/completions` on a loopback port
//! that replays scripted responses, so that every agent turn is deterministic.
//!
//! The request's `model` names a script, `<fixtures_dir>/<model>.json` or `.toml`:
//!
//! ```toml
//! [[responses]]
//! tool_calls = [{ name = "shell", arguments = { cmd = ["sh", "-c", "echo hi"] } }]
//!
//! [[responses]]
//! content = "done: {input}"
//! delay_ms = 100
//! ```
//!
//! Within a turn, the response given is the one whose index is the number of assistant
//! messages already in the request (the first call of a turn gets `responses[0]`, the call
//! after the first tool results gets `responses[1]`, …); past the end the last one repeats.
//! A response may instead be an error (`error = { status = 500, message = "…" }`). In
//! `content`, `{input}` stands for the last user message.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// One scripted conversation.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    pub responses: Vec<Step>,
}

/// One scripted model response.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub tool_calls: Vec<ScriptedCall>,
    /// Waits this long before answering.
    #[serde(default)]
    pub delay_ms: u64,
    #[serde(default)]
    pub error: Option<ScriptedError>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedCall {
    pub name: String,
    pub arguments: Value,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedError {
    pub status: u16,
    pub message: String,
}

/// Why a script could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    #[error("no script named `{0}`")]
    Unknown(String),
    #[error("failed to read script {path}: {message}")]
    Invalid { path: String, message: String },
}

/// Loads the script `model` names from `dir`. Names are restricted to `[A-Za-z0-9_.-]` so
/// that a request cannot name a file outside `dir`.
pub fn load_script(dir: &Path, model: &str) -> Result<Script, ScriptError> {
    let safe = !model.is_empty()
        && !model.starts_with('.')
        && model
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if !safe {
        return Err(ScriptError::Unknown(model.to_owned()));
    }
    for ext in ["json", "toml"] {
        let path = dir.join(format!("{model}.{ext}"));
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let invalid = |message: String| ScriptError::Invalid {
            path: path.display().to_string(),
            message,
        };
        let script: Script = if ext == "json" {
            serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?
        } else {
            toml::from_str(&text).map_err(|e| invalid(e.to_string()))?
        };
        if script.responses.is_empty() {
            return Err(invalid("a script needs at least one response".into()));
        }
        return Ok(script);
    }
    Err(ScriptError::Unknown(model.to_owned()))
}

/// The response body for one request, or an error status and message.
pub fn respond_to(
    script: &Script,
    request: &Value,
) -> Result<(Duration, Value), (u16, String, Duration)> {
    let messages = request
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let role = |m: &Value, r: &str| m.get("role").and_then(Value::as_str) == Some(r);
    let index = messages.iter().filter(|m| role(m, "assistant")).count();
    let step = &script.responses[index.min(script.responses.len() - 1)];
    let delay = Duration::from_millis(step.delay_ms);
    if let Some(err) = &step.error {
        return Err((err.status, err.message.clone(), delay));
    }
    let input = messages
        .iter()
        .rev()
        .find(|m| role(m, "user"))
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str)
        .unwrap_or("");
    let content = step.content.as_ref().map(|c| c.replace("{input}", input));
    let tool_calls: Vec<Value> = step
        .tool_calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            json!({
                "id": format!("call_{index}_{i}"),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments.to_string()},
            })
        })
        .collect();
    let prompt_chars: usize = messages
        .iter()
        .filter_map(|m| m.get("content").and_then(Value::as_str))
        .map(str::len)
        .sum();
    let completion_chars = content.as_deref().map_or(0, str::len)
        + tool_calls
            .iter()
            .map(|c| c.to_string().len())
            .sum::<usize>();
    let mut message = json!({"role": "assistant", "content": content});
    if !tool_calls.is_empty() {
        message["tool_calls"] = Value::Array(tool_calls.clone());
    }
    let (prompt, completion) = (prompt_chars / 4 + 1, completion_chars / 4 + 1);
    Ok((
        delay,
        json!({
            "id": format!("chatcmpl-fixture-{index}"),
            "object": "chat.completion",
            "created": 0,
            "model": request.get("model").cloned().unwrap_or(Value::Null),
            "choices": [{
                "index": 0,
                "message": message,
                "finish_reason": if tool_calls.is_empty() { "stop" } else { "tool_calls" },
            }],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }),
    ))
}

/// A running fixture model server; it stops when dropped.
pub struct FixtureServer {
    addr: SocketAddr,
    stop: CancellationToken,
}

impl FixtureServer {
    /// Binds `127.0.0.1:0` and serves the scripts in `dir`.
    pub async fn start(dir: PathBuf) -> std::io::Result<FixtureServer> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .with_state(Arc::new(dir));
        let token = stop.clone();
        tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { token.cancelled().await })
                .await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "fixture model server failed");
            }
        });
        Ok(FixtureServer { addr, stop })
    }

    /// The OpenAI-style base URL (`…/v1`), to which clients append `/chat/completions`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

impl Drop for FixtureServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn error(status: u16, message: &str) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        axum::Json(json!({"error": {"message": message, "type": "fixture_error"}})),
    )
        .into_response()
}

async fn chat(State(dir): State<Arc<PathBuf>>, body: axum::body::Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return error(400, "the request body is not JSON");
    };
    let model = request.get("model").and_then(Value::as_str).unwrap_or("");
    let script = match load_script(&dir, model) {
        Ok(s) => s,
        Err(e) => return error(404, &e.to_string()),
    };
    match respond_to(&script, &request) {
        Ok((delay, body)) => {
            tokio::time::sleep(delay).await;
            axum::Json(body).into_response()
        }
        Err((status, message, delay)) => {
            tokio::time::sleep(delay).await;
            error(status, &message)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn script() -> Script {
        toml::from_str(
            r#"
            [[responses]]
            tool_calls = [{ name = "shell", arguments = { cmd = ["true"] } }]
            [[responses]]
            content = "said {input}"
            "#,
        )
        .unwrap()
    }

    #[test]
    fn the_step_follows_the_number_of_assistant_messages() {
        let s = script();
        let first = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let (_, body) = respond_to(&s, &first).unwrap();
        let call = &body["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(call["function"]["name"], "shell");
        assert_eq!(call["function"]["arguments"], r#"{"cmd":["true"]}"#);
        assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
        let second = json!({"model": "m", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null},
            {"role": "tool", "content": "ok", "tool_call_id": "call_0_0"},
        ]});
        let (_, body) = respond_to(&s, &second).unwrap();
        assert_eq!(body["choices"][0]["message"]["content"], "said hi");
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
    }

    #[test]
    fn script_names_cannot_leave_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            load_script(dir.path(), "../x"),
            Err(ScriptError::Unknown(_))
        ));
        assert!(matches!(
            load_script(dir.path(), "nope"),
            Err(ScriptError::Unknown(_))
        ));
        std::fs::write(
            dir.path().join("ok.json"),
            r#"{"responses":[{"content":"x"}]}"#,
        )
        .unwrap();
        assert_eq!(load_script(dir.path(), "ok").unwrap().responses.len(), 1);
    }
}
