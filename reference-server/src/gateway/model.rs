//! The gateway's objects as stored (record bodies) and as sent (views). No HTTP here.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use time::OffsetDateTime;

/// The key of a session's durable event log.
pub fn session_stream(session_id: &str) -> String {
    format!("session:{session_id}")
}

/// A fresh flat ID: `prefix` and a lowercase ULID.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", ulid::Ulid::new().to_string().to_lowercase())
}

/// Whether a client-supplied flat ID could name an object with this prefix.
pub fn plausible_id(id: &str, prefix: &str) -> bool {
    id.starts_with(prefix)
        && id.len() <= 128
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Agent {
    pub model: String,
    #[serde(default)]
    pub instructions: Option<String>,
}

/// Progress of a deleting session's cleanup, shown on the session until it is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cleanup {
    /// `pending` (waiting for the create or the worker), `disposing` (kill attempted, absence
    /// not yet confirmed), `detached` (borrowed) or `absent` (confirmed gone).
    pub sandbox: String,
    pub attempts: u32,
    pub last_error: Option<String>,
}

/// A session as stored. The bridge secret, the revision and the lease live here too but are
/// never part of the view.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionDoc {
    pub id: String,
    pub state: String,
    pub pause_reason: Option<String>,
    pub agent: Agent,
    pub sandbox_id: String,
    pub sandbox_ownership: String,
    pub on_uncertain: String,
    pub metadata: BTreeMap<String, String>,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    pub bridge_secret: String,
    pub control_revision: String,
    /// The generation of the current (or last) lease; `None` before the first.
    pub lease_generation: Option<i64>,
    /// Set when the current generation was made stale without a new lease (its worker died,
    /// its lease expired, the session is being deleted): every write under it is fenced.
    pub lease_revoked: bool,
    /// The connection an attach holds on a borrowed sandbox.
    pub connection_id: Option<String>,
    pub cleanup: Option<Cleanup>,
    /// The server process (store instance) that supervises the session: it starts the
    /// session's workers and serves their bridge. Another process takes over when it dies.
    #[serde(default)]
    pub home: Option<String>,
}

impl SessionDoc {
    /// Whether `generation` may write now.
    pub fn lease_is_current(&self, generation: i64) -> bool {
        self.lease_generation == Some(generation) && !self.lease_revoked
    }

    pub fn view(
        &self,
        active_submission_id: Option<&str>,
        queue_depth: usize,
        last_seq: i64,
    ) -> Value {
        let mut v = json!({
            "id": self.id,
            "state": self.state,
            "pause_reason": self.pause_reason,
            "agent": {"model": self.agent.model, "instructions": self.agent.instructions},
            "sandbox_id": self.sandbox_id,
            "sandbox_ownership": self.sandbox_ownership,
            "on_uncertain": self.on_uncertain,
            "metadata": self.metadata,
            "active_submission_id": active_submission_id,
            "queue_depth": queue_depth,
            "last_seq": last_seq,
            "created_at": rfc3339(self.created_at),
        });
        if let (Some(cleanup), Value::Object(map)) = (&self.cleanup, &mut v) {
            map.insert("cleanup".into(), json!(cleanup));
        }
        v
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// Why a submission's effects are in doubt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    pub reason: String,
    pub lease_generation: Option<i64>,
    pub side_effects: String,
    pub operations_in_doubt: Vec<String>,
}

pub const SUBMISSION_TERMINAL: &[&str] =
    &["completed", "failed", "cancelled", "expired", "uncertain"];

/// A submission as stored; the result's `output` and `stop_reason` live here too.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SubmissionDoc {
    pub id: String,
    pub session_id: String,
    pub state: String,
    pub input: String,
    pub lease_generation: Option<i64>,
    pub error: Option<ErrorBody>,
    pub outcome: Option<Outcome>,
    pub usage: Option<Usage>,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    pub started_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub ended_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub result_expires_at: Option<OffsetDateTime>,
    pub output: Option<String>,
    pub stop_reason: Option<String>,
}

impl SubmissionDoc {
    pub fn is_terminal(&self) -> bool {
        SUBMISSION_TERMINAL.contains(&self.state.as_str())
    }

    pub fn view(&self, queue_position: Option<usize>) -> Value {
        json!({
            "id": self.id,
            "session_id": self.session_id,
            "state": self.state,
            "input": self.input,
            "queue_position": queue_position,
            "lease_generation": self.lease_generation,
            "error": self.error,
            "outcome": self.outcome,
            "usage": self.usage,
            "created_at": rfc3339(self.created_at),
            "started_at": self.started_at.map(rfc3339),
            "ended_at": self.ended_at.map(rfc3339),
            "result_expires_at": self.result_expires_at.map(rfc3339),
        })
    }

    pub fn result_view(&self) -> Value {
        json!({
            "submission_id": self.id,
            "state": self.state,
            "output": self.output.clone().unwrap_or_default(),
            "stop_reason": self.stop_reason,
            "usage": self.usage,
            "artifacts": [],
        })
    }
}

/// A model call or tool call, recorded before its side effect.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OperationDoc {
    pub id: String,
    pub session_id: String,
    pub submission_id: String,
    pub kind: String,
    pub name: String,
    pub effect_class: String,
    pub state: String,
    pub input: Option<Value>,
    pub output: Option<String>,
    pub exit_code: Option<i32>,
    pub lease_generation: i64,
    pub cancel_requested: bool,
    #[serde(with = "time::serde::rfc3339")]
    pub started_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    pub ended_at: Option<OffsetDateTime>,
}

impl OperationDoc {
    pub fn view(&self) -> Value {
        json!(self)
    }
}

pub fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}
