//! The gateway's engine: per-session serialization, state transitions with their events,
//! worker supervision, lease expiry, cancellation deadlines and delete cleanup.
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
use crate::defects::Defect;
use crate::domain::{
    IdKind, Process, ProcessSpec, ProcessState, QualifiedId, Sandbox, SandboxState, now,
};
use crate::sandbox::{LocalProvider, Signal};
use crate::store::{Event, Kind, ListQuery, Record, Scope, StoreError, StoreLock};

use super::config::GatewayConfig;
use super::http::ApiResult;
use super::model::{
    Cleanup, OperationDoc, Outcome, SessionDoc, SubmissionDoc, rfc3339, session_stream,
};
use crate::api::ApiError;

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
        let mut q = ListQuery::new(kind, Scope::System);
        q.parent = Some(sid);
        q.state = state;
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
        for st in ["running", "cancelling"] {
            if let Some(found) = self.submissions(sid, Some(st)).await?.into_iter().next() {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }

    pub async fn operations(
        &self,
        sid: &str,
        state: Option<&str>,
    ) -> ApiResult<Vec<(Record, OperationDoc)>> {
        self.children(Kind::Operation, sid, state).await
    }

    pub async fn session_view(&self, loaded: &Loaded) -> ApiResult<Value> {
        let sid = &loaded.doc.id;
        let active = self.active_submission(sid).await?.map(|(_, d)| d.id);
        let depth = self.submissions(sid, Some("queued")).await?.len();
        let bounds = self.state.store.stream_bounds(&session_stream(sid)).await?;
        Ok(loaded.doc.view(active.as_deref(), depth, bounds.last_seq))
    }

    /// 1-based position among the session's queued submissions.
    pub async fn queue_position(&self, sub: &SubmissionDoc) -> ApiResult<Option<usize>> {
        if sub.state != "queued" {
            return Ok(None);
        }
        let queued = self.submissions(&sub.session_id, Some("queued")).await?;
        Ok(queued
            .iter()
            .position(|(_, d)| d.id == sub.id)
            .map(|i| i + 1))
    }

    pub async fn submission_view(&self, sub: &SubmissionDoc) -> ApiResult<Value> {
        Ok(sub.view(self.queue_position(sub).await?))
    }

    // ----- writing (callers hold the session lock) -----

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

    /// The session's sandbox files, if its sandbox still exists.
    async fn sandbox_files(&self, sandbox_id: &str) -> Option<crate::sandbox::SandboxFiles> {
        let (provider, local) = self.provider(sandbox_id).ok()?;
        provider.files(&local).ok()
    }

    /// The `artifacts/` manifest of a sandbox now (empty when it cannot be read).
    pub async fn artifact_manifest(&self, sandbox_id: &str) -> super::artifacts::Manifest {
        let Some(files) = self.sandbox_files(sandbox_id).await else {
            return Default::default();
        };
        tokio::task::spawn_blocking(move || super::artifacts::scan(&files))
            .await
            .ok()
            .and_then(Result::ok)
            .map(|found| super::artifacts::manifest(&found))
            .unwrap_or_default()
    }

    /// Copies the files below `artifacts/` that the submission created or changed, records
    /// them, and appends `artifact.created` for each (before the terminal event).
    async fn collect_artifacts(&self, doc: &SubmissionDoc) -> ApiResult<()> {
        let Some(session) = self.session(Scope::System, &doc.session_id).await? else {
            return Ok(());
        };
        if session.doc.state == "deleting" {
            return Ok(());
        }
        let baseline = {
            let rt = self.rt(&doc.session_id);
            let mut live = rt.live();
            match live.artifact_baseline.take() {
                Some((id, manifest)) if id == doc.id => Some(manifest),
                _ => None,
            }
        };
        let Some(files) = self.sandbox_files(&session.doc.sandbox_id).await else {
            return Ok(());
        };
        let found = tokio::task::spawn_blocking(move || super::artifacts::scan(&files))
            .await
            .map_err(ApiError::internal)?
            .map_err(|e| ApiError::internal(format!("scanning artifacts: {e}")))?;
        let dir = self.state.config.data_dir.join("artifacts");
        for file in super::artifacts::changed(found, baseline.as_ref()) {
            let art = super::artifacts::ArtifactDoc {
                id: super::model::new_id("art_"),
                session_id: doc.session_id.clone(),
                submission_id: doc.id.clone(),
                path: file.path.clone(),
                size: file.bytes.len() as u64,
                sha256: file.sha256.clone(),
                created_at: now(),
                expires_at: doc
                    .result_expires_at
                    .unwrap_or_else(|| self.result_expiry()),
            };
            tokio::fs::create_dir_all(&dir)
                .await
                .map_err(ApiError::internal)?;
            tokio::fs::write(
                super::artifacts::content_path(&self.state.config.data_dir, &art.id),
                &file.bytes,
            )
            .await
            .map_err(ApiError::internal)?;
            self.state
                .store
                .insert(&Record {
                    kind: Kind::Artifact,
                    id: art.id.clone(),
                    owner: session.rec.owner.clone(),
                    parent: Some(doc.session_id.clone()),
                    state: "available".into(),
                    body: encode(&art)?,
                    version: 1,
                    created_at: art.created_at,
                    due_at: Some(art.expires_at),
                })
                .await?;
            self.append(
                &doc.session_id,
                "artifact.created",
                json!({"submission_id": doc.id, "artifact_id": art.id, "path": art.path}),
            )
            .await?;
        }
        Ok(())
    }

    /// The artifacts of a submission, in creation order.
    pub async fn submission_artifacts(
        &self,
        sid: &str,
        sub_id: &str,
    ) -> ApiResult<Vec<super::artifacts::ArtifactDoc>> {
        let mut q = ListQuery::new(Kind::Artifact, Scope::System);
        q.parent = Some(sid);
        let mut out = Vec::new();
        for rec in self.state.store.list(&q).await? {
            let art: super::artifacts::ArtifactDoc = decode(&rec)?;
            if art.submission_id == sub_id {
                out.push(art);
            }
        }
        Ok(out)
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

    /// The model endpoint given to workers.
    pub async fn model_base_url(&self) -> ApiResult<String> {
        let url = self
            .model_url
            .get_or_try_init(|| async {
                if let Some(url) = &self.cfg.model_base_url {
                    return Ok::<_, ApiError>(url.clone());
                }
                let server =
                    crate::model_fixture::FixtureServer::start(self.cfg.fixtures_dir.clone())
                        .await
                        .map_err(|e| ApiError::internal(format!("fixture model server: {e}")))?;
                let url = server.base_url();
                *lock(&self.fixture) = Some(server);
                Ok(url)
            })
            .await?;
        Ok(url.clone())
    }

    /// The worker's command line: the configured binary; else `sandspec-worker` beside the
    /// running executable; else the running executable's `worker` subcommand.
    fn worker_command(&self) -> ApiResult<Vec<String>> {
        let bin = super::config::worker_binary(&self.cfg)
            .ok_or_else(|| ApiError::internal("the running executable is unknown"))?;
        let mut cmd = vec![bin.to_string_lossy().into_owned()];
        if self.cfg.worker_bin.is_none() && bin.file_name().is_none_or(|n| n != "sandspec-worker") {
            cmd.push("worker".into());
        }
        Ok(cmd)
    }

    fn bridge_url(&self) -> String {
        let mut addr = self.state.local_addr;
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        format!("{}://{addr}", self.state.scheme())
    }

    /// The server's own loopback addresses a worker needs (the bridge, the model endpoint),
    /// made reachable inside the sandbox's network namespace.
    async fn forward_for_worker(
        &self,
        provider: &crate::sandbox::LocalProvider,
        local: &str,
        model_url: &str,
    ) -> ApiResult<()> {
        let mut addrs = vec![self.state.local_addr];
        if addrs[0].ip().is_unspecified() {
            addrs[0].set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        if let Ok(url) = reqwest::Url::parse(model_url)
            && let Some(host) = url.host_str()
            && let Some(port) = url.port_or_known_default()
            && let Ok(ip) = host.trim_matches(['[', ']']).parse::<std::net::IpAddr>()
        {
            addrs.push(std::net::SocketAddr::new(ip, port));
        }
        for addr in addrs {
            provider.forward_loopback(local, addr).await.map_err(|e| {
                ApiError::internal(format!("forwarding {addr} into the sandbox: {e}"))
            })?;
        }
        Ok(())
    }

    /// Starts a worker process inside the session's (running) sandbox.
    async fn start_worker(
        &self,
        loaded: &Loaded,
        sandbox: &Record,
        rt: &SessionRt,
    ) -> ApiResult<()> {
        let (provider, local) = self.provider(&sandbox.id)?;
        let model_url = self.model_base_url().await?;
        self.forward_for_worker(&provider, &local, &model_url)
            .await?;
        let process_local = provider.allocate_local_id(IdKind::Process);
        let process_id = QualifiedId::new(provider.name(), &process_local).to_string();
        let cmd = self.worker_command()?;
        let mut env = BTreeMap::new();
        env.insert("SANDSPEC_BRIDGE_URL".to_owned(), self.bridge_url());
        if let Some(tls) = &self.state.config.tls {
            // The worker trusts the server's own certificate for the bridge.
            env.insert(
                "SANDSPEC_BRIDGE_CA_FILE".to_owned(),
                tls.cert.to_string_lossy().into_owned(),
            );
        }
        env.insert("SANDSPEC_SESSION_ID".to_owned(), loaded.doc.id.clone());
        env.insert(
            "SANDSPEC_CONTROL_REVISION".to_owned(),
            loaded.doc.control_revision.clone(),
        );
        env.insert("SANDSPEC_WORKER_ID".to_owned(), process_id.clone());
        env.insert("SANDSPEC_MODEL_BASE_URL".to_owned(), model_url);
        if let Some(model) = &self.cfg.model_override {
            env.insert("SANDSPEC_MODEL".to_owned(), model.clone());
        }
        if let Some(key) = &self.cfg.model_api_key {
            env.insert("SANDSPEC_MODEL_API_KEY".to_owned(), key.clone());
        }
        env.insert(
            "SANDSPEC_HEARTBEAT_MS".to_owned(),
            self.cfg.heartbeat_interval.as_millis().to_string(),
        );
        env.insert(
            "SANDSPEC_MAX_STEPS".to_owned(),
            self.cfg.max_steps.to_string(),
        );
        env.insert(
            "SANDSPEC_MAX_TOOL_OUTPUT_BYTES".to_owned(),
            self.cfg.max_tool_output_bytes.to_string(),
        );
        let spec = ProcessSpec {
            cmd,
            cwd: None,
            env,
            // The bridge secret goes through stdin, not the environment, so that it does not
            // sit in `/proc/<pid>/environ` for the tools' processes to read.
            stdin: true,
            timeout_ms: None,
            tag: Some("sandspec-worker".into()),
        };
        let process = Process {
            id: process_id.clone(),
            sandbox_id: sandbox.id.clone(),
            state: ProcessState::Running,
            cmd: spec.cmd.clone(),
            tag: spec.tag.clone(),
            exit_code: None,
            signal: None,
            started_at: now(),
            ended_at: None,
            output_expires_at: None,
            output_expired: false,
        };
        let rec = Record {
            kind: Kind::Process,
            id: process_id.clone(),
            owner: loaded.rec.owner.clone(),
            parent: Some(sandbox.id.clone()),
            state: ProcessState::Running.as_str().to_owned(),
            body: encode(&process)?,
            version: 1,
            created_at: process.started_at,
            due_at: None,
        };
        self.state.store.insert(&rec).await?;
        let sandbox_env: BTreeMap<String, String> = sandbox
            .body
            .get("env")
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .unwrap_or_default();
        if let Err(e) = provider
            .spawn(&local, rec.clone(), &spec, &sandbox_env)
            .await
        {
            let _ = self.state.store.delete(Kind::Process, &rec.id).await;
            return Err(ApiError::internal(format!("starting the worker: {e}")));
        }
        let secret = format!("{}\n", loaded.doc.bridge_secret);
        if let Err(e) = provider
            .write_stdin(&process_id, secret.as_bytes(), true)
            .await
        {
            tracing::warn!(error = %e, "could not hand the worker its secret");
        }
        let mut live = rt.live();
        live.worker = Some(process_id);
        // The worker must take its lease within one TTL.
        live.lease_expires = None;
        Ok(())
    }

    /// Whether the worker process `process_id` is still running.
    async fn worker_alive(&self, process_id: &str) -> ApiResult<bool> {
        Ok(self
            .state
            .store
            .get(Kind::Process, Scope::System, process_id)
            .await?
            .is_some_and(|r| r.state == "running"))
    }

    /// SIGKILLs the worker's process group and waits until its exit is recorded.
    pub async fn kill_worker(&self, process_id: &str) -> ApiResult<()> {
        let (provider, _) = self.provider(process_id)?;
        match provider.signal(process_id, Signal::Kill) {
            Ok(())
            | Err(
                crate::sandbox::ProviderError::ProcessExited
                | crate::sandbox::ProviderError::NotFound,
            ) => {}
            Err(e) => return Err(ApiError::internal(format!("killing the worker: {e}"))),
        }
        let deadline = Instant::now() + KILL_WAIT;
        while Instant::now() < deadline {
            if !self.worker_alive(process_id).await? {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(ApiError::internal("the worker did not exit after SIGKILL"))
    }

    // ----- supervision -----

    /// Runs until shutdown: looks at every session each `supervise_interval`.
    /// A change made by another server process (a submit, a cancel, a delete appends to the
    /// session's log) also wakes the supervisor at once for that session.
    pub async fn supervise_forever(self: Arc<Self>) {
        let shutdown = self.state.shutdown.clone();
        let mut last_purge = Instant::now();
        let mut foreign = self.state.store.foreign_appends();
        let mut next_scan = Instant::now() + self.cfg.supervise_interval;
        // The test clock moving (TC-9.12) starts a pass with retention at once.
        let mut moved = crate::clock::subscribe();
        loop {
            let mut clock_moved = false;
            let appended = async {
                match foreign.as_mut() {
                    Some(rx) => rx.recv().await.ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep_until(next_scan) => {}
                Ok(()) = moved.changed() => clock_moved = true,
                Some((stream, _)) = appended => {
                    if let Some(sid) = stream.strip_prefix("session:")
                        && let Err(e) = self.supervise(sid).await
                    {
                        tracing::warn!(session = %sid, error = %e, "supervisor pass failed");
                    }
                    continue;
                }
            }
            next_scan = Instant::now() + self.cfg.supervise_interval;
            let sessions = match self
                .state
                .store
                .list(&ListQuery::new(Kind::Session, Scope::System))
                .await
            {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "supervisor: listing sessions failed");
                    continue;
                }
            };
            let purge = clock_moved || last_purge.elapsed() >= PURGE_EVERY;
            if purge {
                last_purge = Instant::now();
                // Retention waits while the test control holds expiry (TC-9.11).
                if let Some(_pass) = self.state.expiry_hold.pass().await
                    && let Err(e) = self.expire_results().await
                {
                    tracing::warn!(error = %e, "result retention failed");
                }
            }
            for rec in sessions {
                if let Err(e) = self.supervise(&rec.id).await {
                    tracing::warn!(session = %rec.id, error = %e, "supervisor pass failed");
                }
                if purge
                    && let Some(_pass) = self.state.expiry_hold.pass().await
                    && let Err(e) = self.purge_old_events(&rec.id).await
                {
                    tracing::warn!(session = %rec.id, error = %e, "event retention failed");
                }
            }
        }
    }

    /// Drops the output of results and the content of artifacts past their retention; their
    /// metadata stays (reads answer 410).
    async fn expire_results(&self) -> ApiResult<()> {
        if self.state.config.defects.has(Defect::ResultNeverExpires) {
            return Ok(());
        }
        let store = &self.state.store;
        for mut rec in store.due(Kind::Submission, now(), 100).await? {
            let mut doc: SubmissionDoc = decode(&rec)?;
            doc.output = None;
            rec.body = encode(&doc)?;
            rec.due_at = None;
            match store.update(&rec).await {
                Ok(_) | Err(StoreError::Conflict | StoreError::NotFound) => {}
                Err(e) => return Err(e.into()),
            }
        }
        for mut rec in store.due(Kind::Artifact, now(), 100).await? {
            let path = super::artifacts::content_path(&self.state.config.data_dir, &rec.id);
            if let Err(e) = tokio::fs::remove_file(&path).await
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(artifact = %rec.id, error = %e, "could not remove artifact content");
                continue;
            }
            rec.state = "expired".into();
            rec.due_at = None;
            match store.update(&rec).await {
                Ok(_) | Err(StoreError::Conflict | StoreError::NotFound) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Drops the session's events older than `retention.events_s`; cursors before them are
    /// answered 410 `cursor_expired` from then on.
    async fn purge_old_events(&self, sid: &str) -> ApiResult<()> {
        let stream = session_stream(sid);
        let store = &self.state.store;
        let cutoff = now()
            - time::Duration::seconds(
                i64::try_from(self.state.config.retention.events_s).unwrap_or(i64::MAX / 4),
            );
        let bounds = store.stream_bounds(&stream).await?;
        let mut through = bounds.purged_through;
        loop {
            let batch = store.events_after(&stream, through, 256).await?;
            let old: Vec<i64> = batch
                .iter()
                .take_while(|e| e.at < cutoff)
                .map(|e| e.seq)
                .collect();
            let Some(&last) = old.last() else { break };
            through = last;
            if old.len() < batch.len() || batch.len() < 256 {
                break;
            }
        }
        if through > bounds.purged_through {
            store.purge_events(&stream, through).await?;
        }
        Ok(())
    }

    /// One supervision pass over one session. Only the session's home process supervises it
    /// (it started the session's worker, whose bridge requests come to it); another process
    /// takes over once the home has been dead for the takeover grace.
    pub async fn supervise(&self, sid: &str) -> ApiResult<()> {
        let rt = self.rt(sid);
        let Some(seen) = self.session(Scope::System, sid).await? else {
            self.forget(sid);
            return Ok(());
        };
        if !self.is_home(&seen.doc).await? {
            // Another process took the session over: a worker this process still runs for it
            // is fenced already, and must not run on.
            if let Some(pid) = rt.take_worker() {
                tracing::warn!(session = %sid, "session taken over by another process; ending its worker here");
                self.kill_worker(&pid).await?;
            }
            return Ok(());
        }
        let _guard = self.lock(&rt, sid).await?;
        let Some(mut loaded) = self.session(Scope::System, sid).await? else {
            self.forget(sid);
            return Ok(());
        };
        if loaded.doc.home.as_deref() != Some(self.instance()) {
            if !self.is_home(&loaded.doc).await? {
                return Ok(());
            }
            tracing::info!(session = %sid, from = ?loaded.doc.home, "taking the session over");
            loaded.doc.home = Some(self.instance().to_owned());
            self.save_session(&mut loaded).await?;
        }
        // A worker that ended: its running submission's outcome is unknown.
        let worker = rt.worker();
        if let Some(pid) = &worker
            && !self.worker_alive(pid).await?
        {
            rt.live().worker = None;
            let running = self.active_submission(sid).await?;
            match running {
                Some((mut rec, mut sub))
                    if self
                        .state
                        .config
                        .defects
                        .has(Defect::WorkerExitCompletesTurn) =>
                {
                    // The bug: the worker's end is read as the turn's end.
                    self.end_running_operations(sid, &sub.id, "succeeded")
                        .await?;
                    self.end_submission(&mut rec, &mut sub, "completed", json!({}))
                        .await?;
                }
                Some((_, s))
                    if loaded
                        .doc
                        .lease_is_current(s.lease_generation.unwrap_or(-1)) =>
                {
                    self.make_uncertain(&mut loaded, "worker_lost").await?;
                }
                _ => {}
            }
            self.revoke_lease(&mut loaded, &rt).await?;
        }
        // A running turn that no worker here runs and no lease covers (this server process
        // restarted, and its workers with it): its outcome is unknown.
        let orphaned = rt.worker().is_none() && rt.live().lease_expires.is_none();
        if orphaned && !loaded.doc.lease_revoked && self.active_submission(sid).await?.is_some() {
            self.make_uncertain(&mut loaded, "worker_lost").await?;
            self.revoke_lease(&mut loaded, &rt).await?;
        }
        if loaded.doc.state == "deleting" {
            return self.drive_cleanup(&mut loaded, &rt).await;
        }
        // A lease not renewed in time (unless the test control holds expiry, TC-9.11).
        let pass = self.state.expiry_hold.pass().await;
        let expired = rt
            .live()
            .lease_expires
            .is_some_and(|t| crate::clock::instant() >= t)
            && !self.state.config.defects.has(Defect::LeaseNeverExpires)
            && pass.is_some();
        if expired && !loaded.doc.lease_revoked {
            if self.active_submission(sid).await?.is_some() {
                self.make_uncertain(&mut loaded, "lease_expired").await?;
            }
            self.revoke_lease(&mut loaded, &rt).await?;
            let worker = rt.take_worker();
            if let Some(pid) = worker {
                self.kill_worker(&pid).await?;
            }
        }
        drop(pass);
        // A cancel accepted by another server process: the grace starts when this one sees it.
        if rt.live().cancel_deadline.is_none()
            && let Some((_, sub)) = self.active_submission(sid).await?
            && sub.state == "cancelling"
        {
            rt.live().cancel_deadline = Some(Instant::now() + self.cfg.cancel_grace);
        }
        // A cancel the worker did not honour in time.
        let overdue = rt
            .live()
            .cancel_deadline
            .is_some_and(|t| Instant::now() >= t);
        if overdue {
            rt.live().cancel_deadline = None;
            if let Some((mut rec, mut sub)) = self.active_submission(sid).await?
                && sub.state == "cancelling"
            {
                let worker = rt.take_worker();
                if let Some(pid) = worker {
                    self.kill_worker(&pid).await?;
                }
                self.end_running_operations(sid, &sub.id, "cancelled")
                    .await?;
                self.end_submission(&mut rec, &mut sub, "cancelled", json!({}))
                    .await?;
                self.revoke_lease(&mut loaded, &rt).await?;
            }
        }
        // Queued work and no worker: start one.
        // A worker holding an unexpired lease is live even if this process did not start it.
        let leased = !loaded.doc.lease_revoked
            && rt
                .live()
                .lease_expires
                .is_some_and(|t| crate::clock::instant() < t);
        let idle = rt.worker().is_none() && !leased;
        let creating = rt.creating();
        if loaded.doc.state == "active"
            && idle
            && !self.submissions(sid, Some("queued")).await?.is_empty()
        {
            let sandbox = self
                .state
                .store
                .get(Kind::Sandbox, Scope::System, &loaded.doc.sandbox_id)
                .await?;
            match sandbox {
                Some(sbx) if sbx.state == "running" => {
                    let failed_starts = rt.live().starts_without_lease;
                    if failed_starts >= MAX_STARTS_WITHOUT_LEASE {
                        rt.live().starts_without_lease = 0;
                        self.fail_queued(
                            &loaded,
                            "worker_unavailable",
                            "the session's worker could not start",
                        )
                        .await?;
                    } else {
                        rt.live().starts_without_lease += 1;
                        if let Err(e) = self.start_worker(&loaded, &sbx, &rt).await {
                            tracing::warn!(session = %sid, error = %e, "could not start a worker");
                        }
                    }
                }
                Some(_) => {}
                None if !creating => {
                    self.fail_queued(
                        &loaded,
                        "sandbox_gone",
                        "the session's sandbox no longer exists",
                    )
                    .await?
                }
                None => {}
            }
        }
        Ok(())
    }

    /// The session cannot run work (its sandbox is gone, its worker cannot start): queued
    /// submissions fail instead of waiting forever.
    async fn fail_queued(&self, loaded: &Loaded, code: &str, message: &str) -> ApiResult<()> {
        for (mut rec, mut sub) in self.submissions(&loaded.doc.id, Some("queued")).await? {
            let error = super::model::ErrorBody {
                code: code.to_owned(),
                message: message.to_owned(),
            };
            sub.error = Some(error.clone());
            self.end_submission(&mut rec, &mut sub, "failed", json!({"error": error}))
                .await?;
        }
        Ok(())
    }

    /// Deleting: end the worker, dispose of (owned) or detach from (borrowed) the sandbox,
    /// and remove the session only once the sandbox's absence is confirmed.
    async fn drive_cleanup(&self, loaded: &mut Loaded, rt: &SessionRt) -> ApiResult<()> {
        let worker = rt.take_worker();
        if let Some(pid) = worker {
            self.kill_worker(&pid).await?;
        }
        let sandbox_id = loaded.doc.sandbox_id.clone();
        let owned = loaded.doc.sandbox_ownership == "owned";
        let mut cleanup = loaded.doc.cleanup.clone().unwrap_or(Cleanup {
            sandbox: "pending".into(),
            attempts: 0,
            last_error: None,
        });
        let defects = &self.state.config.defects;
        let kill = if owned {
            !defects.has(Defect::OwnedSandboxLeftOnDelete)
        } else {
            defects.has(Defect::BorrowedSandboxKilledOnDelete)
        };
        let done = if kill {
            if rt.creating() && !self.state.config.defects.has(Defect::LateCreateLeaks) {
                // The create task disposes of exactly this sandbox when it completes.
                false
            } else {
                cleanup.attempts += 1;
                cleanup.sandbox = "disposing".into();
                let (provider, local) = self.provider(&sandbox_id)?;
                let attempt = match self
                    .state
                    .store
                    .get(Kind::Sandbox, Scope::System, &sandbox_id)
                    .await?
                {
                    Some(rec)
                        if rec.state == "starting"
                            && self.state.config.defects.has(Defect::LateCreateLeaks) =>
                    {
                        self.state
                            .store
                            .delete(Kind::Sandbox, &rec.id)
                            .await
                            .map(|_| ())
                            .map_err(ApiError::from)
                    }
                    Some(rec) => crate::api::destroy_sandbox(&self.state, &rec).await,
                    None => provider
                        .destroy(&local)
                        .await
                        .map_err(|e| ApiError::internal(e.to_string())),
                };
                cleanup.last_error = attempt.err().map(|e| e.to_string());
                let absent = self
                    .state
                    .store
                    .get(Kind::Sandbox, Scope::System, &sandbox_id)
                    .await?
                    .is_none()
                    && (!provider.exists(&local)
                        || self.state.config.defects.has(Defect::LateCreateLeaks));
                if absent {
                    cleanup.sandbox = "absent".into();
                }
                absent
            }
        } else {
            if let Some(conn) = &loaded.doc.connection_id {
                self.state.store.delete(Kind::Connection, conn).await?;
            }
            cleanup.sandbox = "detached".into();
            true
        };
        if loaded.doc.cleanup.as_ref() != Some(&cleanup) {
            loaded.doc.cleanup = Some(cleanup);
            self.save_session(loaded).await?;
        }
        if done {
            self.finish_delete(loaded).await?;
        }
        Ok(())
    }

    /// Removes the session and everything below it; its log ends with `session.deleted`.
    async fn finish_delete(&self, loaded: &Loaded) -> ApiResult<()> {
        let sid = loaded.doc.id.clone();
        for kind in [Kind::Operation, Kind::Submission, Kind::Artifact] {
            let mut q = ListQuery::new(kind, Scope::System);
            q.parent = Some(&sid);
            for rec in self.state.store.list(&q).await? {
                self.state.store.delete(kind, &rec.id).await?;
                if kind == Kind::Artifact {
                    let path = super::artifacts::content_path(&self.state.config.data_dir, &rec.id);
                    if let Err(e) = tokio::fs::remove_file(&path).await
                        && e.kind() != std::io::ErrorKind::NotFound
                    {
                        tracing::warn!(artifact = %rec.id, error = %e, "could not remove artifact content");
                    }
                }
            }
        }
        self.append(&sid, "session.deleted", json!({})).await?;
        self.state.store.delete(Kind::Session, &sid).await?;
        self.forget(&sid);
        let state = self.state.clone();
        tokio::spawn(async move {
            tokio::time::sleep(DELETED_LOG_GRACE).await;
            // An expiry like the others: it waits while the test control holds expiry.
            let _pass = loop {
                match state.expiry_hold.pass().await {
                    Some(pass) => break pass,
                    None => tokio::time::sleep(Duration::from_millis(250)).await,
                }
            };
            if let Err(e) = state.store.drop_stream(&session_stream(&sid)).await {
                tracing::warn!(error = %e, "could not drop a deleted session's log");
            }
        });
        Ok(())
    }

    /// Creates the owned sandbox in the background; if the session was deleted meanwhile,
    /// disposes of exactly that sandbox.
    pub fn spawn_create(
        self: &Arc<Self>,
        sid: String,
        sandbox: Record,
        requested: crate::domain::Resources,
        timeout_s: u64,
        from_snapshot: Option<String>,
    ) {
        let gw = Arc::clone(self);
        let rt = self.rt(&sid);
        rt.live().creating = true;
        tokio::spawn(async move {
            if let Err(e) = gw
                .complete_create(
                    &sid,
                    &rt,
                    sandbox,
                    requested,
                    timeout_s,
                    from_snapshot.as_deref(),
                )
                .await
            {
                tracing::warn!(session = %sid, error = %e, "owned sandbox create failed");
            }
            rt.live().creating = false;
        });
    }

    async fn complete_create(
        &self,
        sid: &str,
        rt: &SessionRt,
        sandbox: Record,
        requested: crate::domain::Resources,
        timeout_s: u64,
        from_snapshot: Option<&str>,
    ) -> ApiResult<()> {
        let (provider, local) = self.provider(&sandbox.id)?;
        let created = provider.create(&local, &requested, from_snapshot).await;
        let _guard = self.lock(rt, sid).await?;
        rt.live().creating = false;
        let session = self.session(Scope::System, sid).await?;
        let gone = session.as_ref().is_none_or(|s| s.doc.state == "deleting");
        let granted = match created {
            Ok(g) => g,
            Err(e) => {
                self.state.store.delete(Kind::Sandbox, &sandbox.id).await?;
                return Err(ApiError::internal(format!("provider create: {e}")));
            }
        };
        let leak = self.state.config.defects.has(Defect::LateCreateLeaks);
        if gone && !leak {
            provider
                .destroy(&local)
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?;
            self.state.store.delete(Kind::Sandbox, &sandbox.id).await?;
            return Ok(());
        }
        let current = self
            .state
            .store
            .get(Kind::Sandbox, Scope::System, &sandbox.id)
            .await?;
        let mut rec = match current {
            Some(rec) => rec,
            None if leak => {
                // The bug: the late completion brings its sandbox back after cleanup.
                self.state.store.insert(&sandbox).await?;
                sandbox.clone()
            }
            None => {
                // Killed through §3 while starting.
                provider
                    .destroy(&local)
                    .await
                    .map_err(|e| ApiError::internal(e.to_string()))?;
                return Ok(());
            }
        };
        let mut sbx: Sandbox = decode(&rec)?;
        let started = now();
        sbx.state = SandboxState::Running;
        sbx.resources = granted;
        sbx.expires_at =
            started + time::Duration::seconds(i64::try_from(timeout_s).unwrap_or(i64::MAX / 4));
        let mut body = encode(&sbx)?;
        if let (Value::Object(new), Value::Object(old)) = (&mut body, &rec.body) {
            for key in ["env", "timeout_s"] {
                if let Some(v) = old.get(key) {
                    new.insert(key.into(), v.clone());
                }
            }
        }
        rec.body = body;
        rec.state = SandboxState::Running.as_str().to_owned();
        rec.due_at = Some(sbx.expires_at);
        match self.state.store.update(&rec).await {
            Ok(_) => Ok(()),
            Err(StoreError::NotFound) => {
                provider
                    .destroy(&local)
                    .await
                    .map_err(|e| ApiError::internal(e.to_string()))?;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }
}
