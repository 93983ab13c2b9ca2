//! The gateway's engine: per-session serialization, persistence and the state transitions with
//! their events. Its other jobs are parts of their own, each an `impl Gateway` block:
//! [`views`] (what the API shows), [`launcher`] (starting and killing workers), [`supervisor`]
//! (the loop that watches leases, starts workers and purges what retention let go) and
//! [`cleanup`] (the delete state machine and late creates).
//!
//! Every change to a session, its submissions and its operations happens while holding that
//! session's lock, and appends its event before the lock is released, so the event log's
//! order is the order of the changes.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use crate::api::AppState;
use crate::clock::now;
use crate::config::GatewayConfig;
use crate::defects::Defect;
use crate::domain::{IdKind, Process, ProcessSpec, QualifiedId, Sandbox, SandboxState};
use crate::sandbox::{LocalProvider, Signal, process_record};
use crate::store::{Event, Kind, ListQuery, Record, Scope, StoreError, StoreLock};

use super::http::ApiResult;
use super::model::{
    Cleanup, OperationDoc, Outcome, SessionDoc, SubmissionDoc, rfc3339, session_stream,
};
use crate::api::ApiError;

mod cleanup;
mod launcher;
mod supervisor;
mod views;

/// How long the log of a deleted session stays readable, so open streams deliver
/// `session.deleted` before it goes.
const DELETED_LOG_GRACE: Duration = Duration::from_secs(3);
/// How often the supervisor applies `retention.events_s` to session logs.
const PURGE_EVERY: Duration = Duration::from_secs(1);
/// Workers started in a row without one taking the lease before queued turns are failed.
const MAX_STARTS_WITHOUT_LEASE: u32 = 3;
/// How long `kill_worker` waits for the worker's exit to be recorded.
const KILL_WAIT: Duration = Duration::from_secs(10);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What only this server process knows about a session.
#[derive(Default)]
pub struct Live {
    /// The record ID of the worker process this gateway started, while it may be running.
    pub worker: Option<String>,
    /// When the current lease expires unless renewed. Kept in memory so that heartbeats do
    /// not rewrite durable state (and the digest) every second.
    pub lease_expires: Option<Instant>,
    /// When a cancelling submission's worker is killed if it has not stopped on its own.
    pub cancel_deadline: Option<Instant>,
    /// An owned sandbox's create is in flight; the create task disposes of it if the
    /// session is deleted meanwhile.
    pub creating: bool,
    /// Workers started since a worker last took the lease: a worker that keeps dying before
    /// it leases (a missing binary, an unreachable bridge) must not be restarted forever.
    pub starts_without_lease: u32,
    /// The `artifacts/` manifest taken when the running submission (by ID) started.
    pub artifact_baseline: Option<(String, super::artifacts::Manifest)>,
}

/// A session's lock, held in this process and across every server process on the database.
pub struct SessionGuard<'a> {
    _local: tokio::sync::MutexGuard<'a, ()>,
    _shared: StoreLock,
}

/// What this process last learned about another server process.
struct Peer {
    alive: bool,
    checked: Instant,
    /// When it was first seen dead (since then not seen alive).
    dead_since: Option<Instant>,
}

/// How long a peer's liveness answer is reused.
const PEER_CHECK_EVERY: Duration = Duration::from_secs(1);

/// One session's serialization point and in-memory state.
#[derive(Default)]
pub struct SessionRt {
    /// Held across every change to the session and its children.
    pub lock: tokio::sync::Mutex<()>,
    pub live: Mutex<Live>,
    /// The session's bridge secret, once a bridge request has been verified with it. The
    /// secret is chosen when the session is created and never changes, so the store's copy
    /// and this one are the same; a session that is gone is refused under its lock.
    pub bridge_secret: std::sync::OnceLock<String>,
}

impl SessionRt {
    pub fn live(&self) -> MutexGuard<'_, Live> {
        lock(&self.live)
    }

    pub fn take_worker(&self) -> Option<String> {
        self.live().worker.take()
    }

    pub fn worker(&self) -> Option<String> {
        self.live().worker.clone()
    }

    pub fn creating(&self) -> bool {
        self.live().creating
    }
}

pub struct Gateway {
    pub state: AppState,
    pub cfg: GatewayConfig,
    runtimes: Mutex<HashMap<String, Arc<SessionRt>>>,
    /// The model endpoint workers use, resolved once (starting the fixture server if needed).
    model_url: tokio::sync::OnceCell<String>,
    /// Keeps the fixture model server running for the gateway's lifetime.
    fixture: Mutex<Option<crate::model_fixture::FixtureServer>>,
    /// Other server processes sharing the database, by instance ID.
    peers: Mutex<HashMap<String, Peer>>,
}

/// A session record with its decoded body.
pub struct Loaded {
    pub rec: Record,
    pub doc: SessionDoc,
}

pub fn decode<T: serde::de::DeserializeOwned>(rec: &Record) -> ApiResult<T> {
    serde_json::from_value(rec.body.clone())
        .map_err(|e| ApiError::internal(format!("{} body {}: {e}", rec.kind.as_str(), rec.id)))
}

fn encode<T: serde::Serialize>(doc: &T) -> ApiResult<Value> {
    serde_json::to_value(doc).map_err(ApiError::internal)
}

impl Gateway {
    pub fn new(state: AppState, cfg: GatewayConfig) -> Self {
        Self {
            state,
            cfg,
            runtimes: Mutex::default(),
            model_url: tokio::sync::OnceCell::new(),
            fixture: Mutex::default(),
            peers: Mutex::default(),
        }
    }

    /// Takes the session's lock: first in this process, then across processes, so that a
    /// process waits on the database for at most one holder per session.
    pub async fn lock<'a>(&self, rt: &'a SessionRt, sid: &str) -> ApiResult<SessionGuard<'a>> {
        let local = rt.lock.lock().await;
        let shared = self.state.store.lock(&format!("session:{sid}")).await?;
        Ok(SessionGuard {
            _local: local,
            _shared: shared,
        })
    }

    /// This server process's instance ID.
    pub fn instance(&self) -> &str {
        self.state.store.instance()
    }

    /// Whether this process supervises the session: it is the session's home, or the home has
    /// been dead for the store's takeover grace (or the session has none).
    async fn is_home(&self, doc: &SessionDoc) -> ApiResult<bool> {
        let Some(home) = doc.home.as_deref() else {
            return Ok(true);
        };
        if home == self.instance() {
            return Ok(true);
        }
        if self
            .state
            .config
            .defects
            .has(Defect::DeadHomeNeverTakenOver)
        {
            // The bug: another process's session is never this one's, dead home or not.
            return Ok(false);
        }
        let cached = lock(&self.peers)
            .get(home)
            .filter(|p| p.checked.elapsed() < PEER_CHECK_EVERY)
            .map(|p| (p.alive, p.dead_since));
        let (alive, dead_since) = match cached {
            Some(found) => found,
            None => {
                let alive = self.state.store.instance_alive(home).await?;
                let now = Instant::now();
                let mut peers = lock(&self.peers);
                let peer = peers.entry(home.to_owned()).or_insert(Peer {
                    alive,
                    checked: now,
                    dead_since: None,
                });
                peer.alive = alive;
                peer.checked = now;
                peer.dead_since = if alive {
                    None
                } else {
                    Some(peer.dead_since.unwrap_or(now))
                };
                (peer.alive, peer.dead_since)
            }
        };
        Ok(!alive && dead_since.is_some_and(|t| t.elapsed() >= self.state.store.takeover_grace()))
    }

    pub fn rt(&self, sid: &str) -> Arc<SessionRt> {
        lock(&self.runtimes)
            .entry(sid.to_owned())
            .or_default()
            .clone()
    }

    /// The session's runtime if this process has one, without making one.
    pub fn rt_if_known(&self, sid: &str) -> Option<Arc<SessionRt>> {
        lock(&self.runtimes).get(sid).cloned()
    }

    fn forget(&self, sid: &str) {
        lock(&self.runtimes).remove(sid);
    }

    pub fn provider(&self, qualified: &str) -> ApiResult<(Arc<LocalProvider>, String)> {
        let (provider, local) = qualified.split_once(':').ok_or_else(|| {
            ApiError::internal(format!("stored id without provider: {qualified}"))
        })?;
        let p = self
            .state
            .providers
            .get(provider)
            .cloned()
            .ok_or_else(|| ApiError::internal(format!("unknown provider {provider}")))?;
        Ok((p, local.to_owned()))
    }

    // ----- reading -----

    pub async fn session(&self, scope: Scope<'_>, sid: &str) -> ApiResult<Option<Loaded>> {
        match self.state.store.get(Kind::Session, scope, sid).await? {
            None => Ok(None),
            Some(rec) => {
                let doc = decode(&rec)?;
                Ok(Some(Loaded { rec, doc }))
            }
        }
    }

    /// The session's children of `kind` (submissions, operations) with their decoded bodies,
    /// in creation order, optionally in one state.
    async fn children<T: serde::de::DeserializeOwned>(
        &self,
        kind: Kind,
        sid: &str,
        state: Option<&str>,
    ) -> ApiResult<Vec<(Record, T)>> {
        let states: &[&str] = match &state {
            Some(state) => std::slice::from_ref(state),
            None => &[],
        };
        self.children_in(kind, sid, states, None).await
    }

    /// [`Gateway::children`] in any of `states` (all when empty), at most `limit` of them.
    async fn children_in<T: serde::de::DeserializeOwned>(
        &self,
        kind: Kind,
        sid: &str,
        states: &[&str],
        limit: Option<u32>,
    ) -> ApiResult<Vec<(Record, T)>> {
        let mut q = ListQuery::new(kind, Scope::System);
        q.parent = Some(sid);
        q.states = states;
        q.limit = limit;
        let recs = self.state.store.list(&q).await?;
        recs.into_iter()
            .map(|r| {
                let d = decode(&r)?;
                Ok((r, d))
            })
            .collect()
    }

    /// The session's submissions in acceptance order, optionally in one state.
    pub async fn submissions(
        &self,
        sid: &str,
        state: Option<&str>,
    ) -> ApiResult<Vec<(Record, SubmissionDoc)>> {
        self.children(Kind::Submission, sid, state).await
    }

    pub async fn active_submission(&self, sid: &str) -> ApiResult<Option<(Record, SubmissionDoc)>> {
        Ok(self
            .children_in(Kind::Submission, sid, &["running", "cancelling"], Some(1))
            .await?
            .into_iter()
            .next())
    }

    /// The session's oldest queued submission.
    pub async fn next_queued(&self, sid: &str) -> ApiResult<Option<(Record, SubmissionDoc)>> {
        Ok(self
            .children_in(Kind::Submission, sid, &["queued"], Some(1))
            .await?
            .into_iter()
            .next())
    }

    pub async fn operations(
        &self,
        sid: &str,
        state: Option<&str>,
    ) -> ApiResult<Vec<(Record, OperationDoc)>> {
        self.children(Kind::Operation, sid, state).await
    }

    pub async fn append(&self, sid: &str, kind: &str, fields: Value) -> ApiResult<Event> {
        let mut data = json!({
            "type": kind,
            "created_at": rfc3339(now()),
            "session_id": sid,
        });
        if let (Value::Object(map), Value::Object(extra)) = (&mut data, fields) {
            map.extend(extra);
        }
        Ok(self
            .state
            .log
            .append(&session_stream(sid), kind, &data)
            .await?)
    }

    pub async fn save_session(&self, loaded: &mut Loaded) -> ApiResult<()> {
        loaded.rec.body = encode(&loaded.doc)?;
        loaded.rec.state = loaded.doc.state.clone();
        loaded.rec = self.state.store.update(&loaded.rec).await?;
        Ok(())
    }

    pub async fn save_submission(&self, rec: &mut Record, doc: &SubmissionDoc) -> ApiResult<()> {
        rec.body = encode(doc)?;
        rec.state = doc.state.clone();
        rec.due_at = doc.result_expires_at;
        *rec = self.state.store.update(rec).await?;
        Ok(())
    }

    pub async fn save_operation(&self, rec: &mut Record, doc: &OperationDoc) -> ApiResult<()> {
        rec.body = encode(doc)?;
        rec.state = doc.state.clone();
        *rec = self.state.store.update(rec).await?;
        Ok(())
    }

    pub fn result_expiry(&self) -> time::OffsetDateTime {
        now()
            + time::Duration::seconds(
                i64::try_from(self.state.config.retention.result_s).unwrap_or(i64::MAX / 4),
            )
    }

    /// Moves a non-terminal submission to a terminal state and appends its terminal event.
    pub async fn end_submission(
        &self,
        rec: &mut Record,
        doc: &mut SubmissionDoc,
        state: &str,
        extra: Value,
    ) -> ApiResult<()> {
        doc.state = state.to_owned();
        let t = now();
        doc.ended_at = Some(t);
        doc.result_expires_at = Some(self.result_expiry());
        if doc.started_at.is_some()
            && let Err(e) = self.collect_artifacts(doc).await
        {
            tracing::warn!(submission = %doc.id, error = %e, "could not collect artifacts");
        }
        if doc.stop_reason.is_none() {
            doc.stop_reason = Some(
                match state {
                    "completed" => "end_turn",
                    "failed" => "error",
                    other => other,
                }
                .to_owned(),
            );
        }
        self.save_submission(rec, doc).await?;
        let mut fields = json!({"submission_id": doc.id});
        if let (Value::Object(map), Value::Object(extra)) = (&mut fields, extra) {
            map.extend(extra);
        }
        self.append(&doc.session_id, &format!("submission.{state}"), fields)
            .await?;
        Ok(())
    }

    /// Ends every running operation of a submission in `state`, returning their IDs.
    pub async fn end_running_operations(
        &self,
        sid: &str,
        sub_id: &str,
        state: &str,
    ) -> ApiResult<Vec<String>> {
        let mut ended = Vec::new();
        for (mut rec, mut op) in self.operations(sid, Some("running")).await? {
            if op.submission_id != sub_id {
                continue;
            }
            op.state = state.to_owned();
            op.ended_at = Some(now());
            op.cancel_requested = false;
            self.save_operation(&mut rec, &op).await?;
            self.append(
                sid,
                "operation.completed",
                json!({"submission_id": sub_id, "operation_id": op.id, "state": state}),
            )
            .await?;
            ended.push(op.id);
        }
        Ok(ended)
    }

    /// The worker running `session`'s active submission is gone (`worker_lost`) or its lease
    /// ran out (`lease_expired`): the submission becomes `uncertain`, never replayed, and the
    /// session pauses unless it was created with `on_uncertain: continue`.
    pub async fn make_uncertain(&self, loaded: &mut Loaded, reason: &str) -> ApiResult<()> {
        let sid = loaded.doc.id.clone();
        let Some((mut rec, mut sub)) = self.active_submission(&sid).await? else {
            return Ok(());
        };
        if self
            .state
            .config
            .defects
            .has(Defect::WorkerDeathReplaysTurn)
        {
            // The bug: the turn goes back to the queue and runs again from the start.
            sub.state = "queued".into();
            sub.started_at = None;
            sub.lease_generation = None;
            self.save_submission(&mut rec, &sub).await?;
            self.end_running_operations(&sid, &sub.id, "failed").await?;
            return Ok(());
        }
        let writes = self
            .operations(&sid, None)
            .await?
            .iter()
            .any(|(_, op)| op.submission_id == sub.id && op.effect_class == "write");
        let in_doubt = self
            .end_running_operations(&sid, &sub.id, "uncertain")
            .await?;
        let outcome = Outcome {
            reason: reason.to_owned(),
            lease_generation: sub.lease_generation,
            side_effects: if writes { "possible" } else { "none_started" }.to_owned(),
            operations_in_doubt: in_doubt,
        };
        sub.outcome = Some(outcome.clone());
        self.end_submission(&mut rec, &mut sub, "uncertain", json!({"outcome": outcome}))
            .await?;
        let pause = loaded.doc.on_uncertain == "pause"
            || self.state.config.defects.has(Defect::ContinuePausesAnyway);
        if pause && loaded.doc.state == "active" {
            loaded.doc.state = "paused".into();
            loaded.doc.pause_reason = Some("uncertain_submission".into());
            self.save_session(loaded).await?;
            self.append(
                &sid,
                "session.paused",
                json!({"reason": "uncertain_submission", "submission_id": sub.id}),
            )
            .await?;
        }
        Ok(())
    }

    /// Makes the current lease generation stale without issuing a new one.
    pub async fn revoke_lease(&self, loaded: &mut Loaded, rt: &SessionRt) -> ApiResult<()> {
        rt.live().lease_expires = None;
        if loaded.doc.lease_generation.is_some() && !loaded.doc.lease_revoked {
            loaded.doc.lease_revoked = true;
            self.save_session(loaded).await?;
        }
        Ok(())
    }

    // ----- workers -----
}
