//! The few control-plane calls the MCP server makes, over E2B's HTTP API.

use std::time::Duration;

use serde_json::{Value, json};

/// A control-plane client: base URL and API key.
#[derive(Clone)]
pub struct ControlPlane {
    /// Shared connection pool.
    http: reqwest::Client,
    /// Base URL without a trailing slash.
    base: String,
    /// Sent as `X-API-Key`; never logged.
    key: String,
}

/// A control-plane answer the MCP server could not use. Messages read after "failed to ...".
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("reach the control plane: {0}")]
    Transport(String),
    #[error("{what}: the control plane answered {status}: {message}")]
    Status {
        what: &'static str,
        status: u16,
        message: String,
    },
    #[error("use the control plane URL `{0}`: it must be http:// or https://")]
    BadUrl(String),
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    pub fn new(base: &str, key: String) -> Result<Self, ControlError> {
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(ControlError::BadUrl(base.to_owned()));
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| ControlError::Transport(e.to_string()))?;
        Ok(Self {
            http,
            base: base.trim_end_matches('/').to_owned(),
            key,
        })
    }

    async fn call(
        &self,
        what: &'static str,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, ControlError> {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header("X-API-Key", &self.key);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| ControlError::Transport(e.without_url().to_string()))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| ControlError::Transport(e.without_url().to_string()))?;
        if !status.is_success() {
            let message = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_owned))
                .unwrap_or_else(|| "no message".into());
            return Err(ControlError::Status {
                what,
                status: status.as_u16(),
                message,
            });
        }
        Ok(if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::Null)
        })
    }

    /// `POST /sandboxes` from the `base` template, secured as the SDKs create them (envd
    /// takes the sandbox's access token); the new sandbox's ID.
    pub async fn create(&self, timeout_s: u64) -> Result<String, ControlError> {
        let body = json!({ "templateID": "base", "timeout": timeout_s, "secure": true });
        let v = self
            .call(
                "create a sandbox",
                reqwest::Method::POST,
                "/sandboxes",
                Some(body),
            )
            .await?;
        v.get("sandboxID")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| ControlError::Status {
                what: "create a sandbox",
                status: 201,
                message: "the answer has no sandboxID".into(),
            })
    }

    /// `GET /sandboxes/{id}`: the readback (`cpuCount`, `memoryMB`, `state`, `endAt`).
    pub async fn get(&self, id: &str) -> Result<Value, ControlError> {
        self.call(
            "read a sandbox",
            reqwest::Method::GET,
            &format!("/sandboxes/{id}"),
            None,
        )
        .await
    }

    /// `POST /sandboxes/{id}/connect` with timeout 0: reaches a running sandbox (or resumes a
    /// paused one) without touching its end.
    pub async fn connect(&self, id: &str) -> Result<Value, ControlError> {
        self.call(
            "connect to a sandbox",
            reqwest::Method::POST,
            &format!("/sandboxes/{id}/connect"),
            Some(json!({ "timeout": 0 })),
        )
        .await
    }

    /// `DELETE /sandboxes/{id}`. A sandbox already gone (404) counts as killed.
    pub async fn kill(&self, id: &str) -> Result<(), ControlError> {
        match self
            .call(
                "kill a sandbox",
                reqwest::Method::DELETE,
                &format!("/sandboxes/{id}"),
                None,
            )
            .await
        {
            Ok(_) | Err(ControlError::Status { status: 404, .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Runs `command` with `bash -c` in the sandbox `id` and waits for its end: envd's
    /// `process.Process/Start` (a Connect server stream, JSON codec) reached on the control
    /// plane's URL with the routing headers, with the access token the sandbox's detail
    /// gives. Returns `(stdout, stderr, exit code)`.
    pub async fn run(
        &self,
        id: &str,
        command: &str,
    ) -> Result<(String, String, i64), ControlError> {
        const WHAT: &str = "run a command";
        let detail = self.get(id).await?;
        let request = json!({"process": {"cmd": "/bin/bash", "args": ["-c", command]}});
        let message = serde_json::to_vec(&request).unwrap_or_default();
        let mut req = self
            .http
            .post(format!("{}/process.Process/Start", self.base))
            .header("E2b-Sandbox-Id", id)
            .header("E2b-Sandbox-Port", "49983")
            .header("Content-Type", "application/connect+json")
            .header("Connect-Protocol-Version", "1")
            .body(crate::e2b::connect::envelope(0, &message));
        if let Some(token) = detail.get("envdAccessToken").and_then(Value::as_str) {
            req = req.header("X-Access-Token", token);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| ControlError::Transport(e.without_url().to_string()))?;
        let status = resp.status().as_u16();
        let body = resp
            .bytes()
            .await
            .map_err(|e| ControlError::Transport(e.without_url().to_string()))?;
        let failed = |message: String| ControlError::Status {
            what: WHAT,
            status,
            message,
        };
        if status != 200 {
            return Err(failed(String::from_utf8_lossy(&body).into_owned()));
        }
        let (mut stdout, mut stderr, mut exit) = (Vec::new(), Vec::new(), None);
        let mut rest: &[u8] = &body;
        while !rest.is_empty() {
            let (flags, message, tail) = crate::e2b::connect::split_envelope(rest)
                .map_err(|e| failed(format!("a malformed stream: {}", e.message)))?;
            rest = tail;
            let v: Value = serde_json::from_slice(message).unwrap_or(Value::Null);
            if flags & 0x02 != 0 {
                if let Some(error) = v.get("error") {
                    return Err(failed(format!("the stream ended with {error}")));
                }
                continue;
            }
            let event = &v["event"];
            let bytes = |k: &str| {
                event["data"][k]
                    .as_str()
                    .and_then(|t| crate::e2b::connect::decode_bytes(t).ok())
            };
            stdout.extend(bytes("stdout").unwrap_or_default());
            stderr.extend(bytes("stderr").unwrap_or_default());
            if let Some(code) = event["end"].get("exitCode") {
                exit = Some(code.as_i64().unwrap_or(-1));
            }
        }
        let exit =
            exit.ok_or_else(|| failed("the stream ended without the process's end".into()))?;
        Ok((
            String::from_utf8_lossy(&stdout).into_owned(),
            String::from_utf8_lossy(&stderr).into_owned(),
            exit,
        ))
    }
}
