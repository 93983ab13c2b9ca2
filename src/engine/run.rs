//! Runs one scenario against a target: steps in order until one fails, then every cleanup
//! step, then a sweep of anything the run created and did not remove.
//!
//! FAIL versus ERROR: whatever the target answered (a wrong status, HTML where JSON was
//! required, a broken SSE frame, a connection it reset, a response that never came) is the
//! target's failure. ERROR is kept for what says nothing about the target: it could not be
//! connected to at all, or the harness itself could not carry out a step (a variable with no
//! value in a non-cleanup step).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use super::expect::{
    Observed, capture, check_headers, check_response, json_check, problem_code, status_ok,
};
use super::outcome::Outcome;
use super::transcript::{
    Body, Credential, Entry, Frame, HttpExchange, Note, SseExchange, record_headers,
};
use super::vars::{VarError, Vars};
use crate::scenario::{
    Absent, Method, Parallel, Poll, Principal, Request, Scenario, Sse, Step, Until, Via, step_label,
};
use crate::sse::{EndReason, Framing, Item, Stop, read_stream};
use crate::target::{Target, describe_reqwest};

mod ledger;

use ledger::Created;
pub use ledger::{LEAK_CHECK, Leftover};

/// `(event type, id)` per event, as an interop probe saw them.
type Seen = Vec<(String, Option<String>)>;

/// What an interop probe returned: `None` when it did not run.
type Probed = Option<Result<Seen, String>>;

/// The header that carries the run's canary secret on every request.
pub const CANARY_HEADER: &str = "X-Sandspec-Canary";

/// Default deadline of an `sse` step.
const DEFAULT_SSE_DEADLINE_S: i64 = 30;
/// What a scenario's steps may take beyond their declared waits: a fixed part, and a part
/// per step (each request takes a moment even when the target is fast).
const STEPS_MARGIN: Duration = Duration::from_secs(60);
const CLEANUP_MARGIN: Duration = Duration::from_secs(30);
const MARGIN_PER_STEP: Duration = Duration::from_secs(2);
/// Pages an absence check or snapshot reads at most.
const MAX_PAGES: usize = 50;

/// Everything one scenario run produced.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioRun {
    pub outcome: Outcome,
    /// Milliseconds from the run's start to this scenario's start, set by the scheduler
    /// (`cli::run_until_stopped`) so the evidence can draw the run as a timeline.
    pub started_ms: u64,
    pub duration_ms: u64,
    /// Named measurements in seconds (time to first SSE frame, time to EOF, ...).
    pub measurements: BTreeMap<String, f64>,
    /// What the leak check found after cleanup, and whether the sweep then removed it.
    pub swept: Vec<Leftover>,
    pub transcript: Vec<Entry>,
    pub attempts: u32,
    /// Values of captures marked `secret: true`, for the sanitizer. Never serialized.
    #[serde(skip)]
    pub secrets: Vec<String>,
}

/// Runs `scenario` with up to `retries` extra attempts after a FAIL; a later pass is FLAKY.
pub async fn run_with_retries(
    target: &Target,
    scenario: &Scenario,
    run_id: &str,
    retries: u32,
) -> ScenarioRun {
    let mut first = run_scenario(target, scenario, run_id).await;
    if !matches!(first.outcome, Outcome::Fail { .. }) {
        return first;
    }
    for attempt in 2..=retries + 1 {
        let mut again = run_scenario(target, scenario, run_id).await;
        if again.outcome == Outcome::Pass {
            again.outcome = Outcome::Flaky {
                attempts: attempt,
                first_failure: first.outcome.reason().unwrap_or_default(),
            };
            again.attempts = attempt;
            return again;
        }
        first.attempts = attempt;
    }
    first
}

/// Runs `scenario` once.
pub async fn run_scenario(target: &Target, scenario: &Scenario, run_id: &str) -> ScenarioRun {
    let started = Instant::now();
    let mut run = ScenarioRun {
        outcome: Outcome::Pass,
        started_ms: 0,
        duration_ms: 0,
        measurements: BTreeMap::new(),
        swept: Vec::new(),
        transcript: Vec::new(),
        attempts: 1,
        secrets: Vec::new(),
    };
    if let Some(reason) = skip_reason(target, scenario) {
        run.outcome = Outcome::Skip { reason };
        return run;
    }
    let mut ctx = Ctx {
        target,
        vars: Vars::new(run_id, &target.capabilities, &target.canary),
        started,
        transcript: Vec::new(),
        measurements: BTreeMap::new(),
        digests: BTreeMap::new(),
        snapshots: BTreeMap::new(),
        ledger: Vec::new(),
        leftovers: Vec::new(),
        saw_success: false,
        secrets: Vec::new(),
        expiry_held: false,
    };
    // The steps, then the cleanup, each within a deadline derived from what they declare
    // they wait for: a target that stops answering cannot hold a scenario for longer.
    let steps_deadline = ctx.deadline(&scenario.steps, STEPS_MARGIN);
    let mut current = String::new();
    let steps = async {
        for (i, step) in scenario.steps.iter().enumerate() {
            let label = step_label("steps", i, step);
            current.clone_from(&label);
            if let Err(e) = ctx.step(step, &label).await {
                return e.into_outcome(label);
            }
        }
        Outcome::Pass
    };
    let mut outcome = match tokio::time::timeout(steps_deadline, steps).await {
        Ok(outcome) => outcome,
        Err(_) => deadline_passed(&mut ctx, current, "scenario", steps_deadline),
    };
    let cleanup_deadline = ctx.deadline(&scenario.cleanup, CLEANUP_MARGIN);
    let mut current = String::new();
    let cleanup = async {
        let mut outcome = Outcome::Pass;
        for (i, step) in scenario.cleanup.iter().enumerate() {
            let label = step_label("cleanup", i, step);
            current.clone_from(&label);
            match ctx.step(step, &label).await {
                Ok(()) => {}
                // A cleanup step for something that was never created has nothing to do.
                Err(StepError::Var(VarError::Missing(name))) => {
                    ctx.note(format!("{label}: skipped, `{name}` was never captured"))
                }
                Err(e) => outcome = outcome.combine(e.into_outcome(label)),
            }
        }
        outcome
    };
    outcome = outcome.combine(
        match tokio::time::timeout(cleanup_deadline, cleanup).await {
            Ok(outcome) => outcome,
            Err(_) => deadline_passed(&mut ctx, current, "cleanup", cleanup_deadline),
        },
    );
    // Each request of the leak check and the sweep is bounded by the request timeout.
    outcome = outcome.combine(ctx.leak_check().await);
    if ctx.expiry_held {
        let label = "release the expiry hold";
        if let Err(e) = ctx.hold_expiry(0, label).await {
            outcome = outcome.combine(e.into_outcome(label.to_owned()));
        }
    }
    // No vacuous passes: a scenario none of whose requests succeeded proves nothing, unless
    // that is its point (every step expected an error status).
    if outcome == Outcome::Pass && !ctx.saw_success && expects_some_success(scenario) {
        outcome = Outcome::Fail {
            step: "scenario".into(),
            reason: "no request succeeded".into(),
        };
    }
    run.outcome = outcome;
    run.duration_ms = ms(started.elapsed());
    run.measurements = ctx.measurements;
    run.swept = ctx.leftovers;
    run.transcript = ctx.transcript;
    run.secrets = ctx.secrets;
    run
}

/// Why a scenario cannot run against this target, if it cannot: a requirement the target
/// does not meet, or advertised waits over the run's wait budget.
pub fn skip_reason(target: &Target, scenario: &Scenario) -> Option<String> {
    for cap in &scenario.requires {
        match cap.value.as_str() {
            "peer" if target.peer.is_none() => return Some(crate::target::NO_PEER.to_owned()),
            "admin_token" if target.tokens.admin.is_none() => {
                return Some("no admin token (--admin-token-env)".into());
            }
            "peer" | "admin_token" => continue,
            _ => {}
        }
        if !target.capabilities.has(&cap.value) {
            let advertised = target.capabilities.raw["features"]
                .as_array()
                .is_some_and(|f| f.iter().any(|f| f.as_str() == Some(cap.value.as_str())));
            return Some(if advertised {
                format!("`{}` dropped by --drop-capability", cap.value)
            } else {
                format!("target does not advertise `{}`", cap.value)
            });
        }
    }
    if let Some(budget) = target.wait_budget {
        return super::waits::over_budget(scenario, &target.capabilities, budget);
    }
    None
}

/// Whether some step of the scenario expects a 2xx (then at least one must have happened).
fn expects_some_success(s: &Scenario) -> bool {
    let ok = |e: &crate::scenario::Expect| match (e.status, e.status_in.as_slice()) {
        (Some(st), _) => (200..300).contains(&st),
        (None, []) => true,
        (None, list) => list.iter().any(|st| (200..300).contains(st)),
    };
    s.steps.iter().any(|step| match step {
        Step::Request(r) => ok(&r.expect),
        Step::Poll(p) => ok(&p.request.expect),
        Step::Sse(s) => ok(&s.expect),
        _ => false,
    })
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// How a step went wrong.
#[derive(Debug)]
enum StepError {
    /// The target misbehaved.
    Fail(String),
    /// The harness could not carry on.
    Error(String),
    Var(VarError),
}

impl StepError {
    fn into_outcome(self, step: String) -> Outcome {
        match self {
            StepError::Fail(reason) => Outcome::Fail { step, reason },
            StepError::Error(reason) => Outcome::Error {
                reason: format!("{step}: {reason}"),
            },
            // A limit the target does not advertise is the target's omission.
            StepError::Var(e @ VarError::NotAdvertised(_)) => Outcome::Fail {
                step,
                reason: e.to_string(),
            },
            StepError::Var(e) => Outcome::Error {
                reason: format!("{step}: {e}"),
            },
        }
    }
}

impl From<VarError> for StepError {
    fn from(e: VarError) -> Self {
        StepError::Var(e)
    }
}

/// Whether a request asks for an event stream.
fn is_stream(r: &Request) -> bool {
    r.headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("accept") && v.raw.contains("text/event-stream"))
}

/// The outcome when a deadline passed during `step` (of the `part`, `scenario` or
/// `cleanup`).
fn deadline_passed(ctx: &mut Ctx<'_>, step: String, part: &str, deadline: Duration) -> Outcome {
    let reason = format!(
        "the {part}'s deadline of {}s (its declared waits plus a margin) passed during this step",
        deadline.as_secs()
    );
    ctx.note(format!("{step}: {reason}"));
    Outcome::Fail { step, reason }
}

/// State of one scenario run.
struct Ctx<'a> {
    target: &'a Target,
    vars: Vars<'a>,
    started: Instant,
    transcript: Vec<Entry>,
    measurements: BTreeMap<String, f64>,
    digests: BTreeMap<String, String>,
    /// Named API-level snapshots: principal and the set of object IDs it owned.
    snapshots: BTreeMap<String, (Principal, BTreeSet<String>)>,
    /// Everything this scenario created (from the target's 201 responses).
    ledger: Vec<Created>,
    /// What the leak check found, and whether the sweep removed it.
    leftovers: Vec<Leftover>,
    /// Whether any request was answered 2xx (for the vacuity rule).
    saw_success: bool,
    /// Values of captures marked secret.
    secrets: Vec<String>,
    /// Whether this run holds the target's background expiry (from its first `digest` step
    /// until after cleanup).
    expiry_held: bool,
}

/// How long a digest scenario holds background expiry at most: released after its cleanup,
/// and ending by itself if the runner never gets that far.
const HOLD_EXPIRY_S: u64 = 300;

/// A request ready to send.
struct Prepared {
    /// The endpoint it goes to.
    via: Via,
    method: Method,
    target: String,
    principal: Principal,
    headers: Vec<(String, String)>,
    literal_auth: bool,
    body: Option<(Vec<u8>, String)>,
}

impl<'a> Ctx<'a> {
    fn at(&self) -> u64 {
        ms(self.started.elapsed())
    }

    fn note(&mut self, text: String) {
        let at_ms = self.at();
        self.transcript.push(Entry::Note(Note { at_ms, text }));
    }

    /// The deadline of a part (the steps or the cleanup): the waits its steps declare (a
    /// poll's `within_s` plus one request, a stream's deadline, a sleep, the advertised
    /// stream duration for streams sent in parallel), a margin, and a little for every step. A wait that cannot be worked out yet counts as nothing (its
    /// step fails on its own then).
    fn deadline(&self, steps: &[Step], margin: Duration) -> Duration {
        let secs = |n: Result<i64, VarError>| {
            Duration::from_secs(n.ok().and_then(|n| u64::try_from(n).ok()).unwrap_or(0))
        };
        let mut total = margin;
        for step in steps {
            total += MARGIN_PER_STEP;
            total += match step {
                Step::Poll(p) => secs(self.vars.num(&p.within_s)) + self.target.request_timeout,
                Step::Sse(s) => match &s.within_s {
                    Some(n) => secs(self.vars.num(n)),
                    None => secs(Ok(DEFAULT_SSE_DEADLINE_S)),
                },
                Step::Sleep(s) => Duration::from_millis(s.ms.value),
                // Event streams sent in parallel are read to their end: at most the
                // advertised stream duration.
                Step::Parallel(p) if p.request.iter().chain(&p.requests).any(is_stream) => {
                    let limit = self.target.capabilities.limits.get("max_stream_duration_s");
                    secs(Ok(limit.copied().unwrap_or(0))) + self.target.request_timeout
                }
                _ => Duration::ZERO,
            };
        }
        total
    }

    async fn step(&mut self, step: &Step, label: &str) -> Result<(), StepError> {
        match step {
            Step::Request(r) => self.request(r, label).await,
            Step::Poll(p) => self.poll(p, label).await,
            Step::Sse(s) => self.sse(s, label).await,
            Step::Digest(d) => {
                if !self.expiry_held {
                    self.hold_expiry(HOLD_EXPIRY_S, label).await?;
                    self.expiry_held = true;
                }
                let digest = self.digest(label).await?;
                self.digests.insert(d.into.value.clone(), digest);
                Ok(())
            }
            Step::ExpectDigestUnchanged(since) => {
                let now = self.digest(label).await?;
                let before = &self.digests[&since.since.value];
                if &now == before {
                    Ok(())
                } else {
                    Err(StepError::Fail(format!(
                        "durable-state digest changed since `{}`",
                        since.since.value
                    )))
                }
            }
            Step::Snapshot(s) => {
                let set = self.owned(s.principal, label).await?;
                self.snapshots
                    .insert(s.into.value.clone(), (s.principal, set));
                Ok(())
            }
            Step::ExpectSnapshotUnchanged(since) => {
                let (principal, before) = self.snapshots[&since.since.value].clone();
                let now = self.owned(principal, label).await?;
                let added: Vec<_> = now.difference(&before).cloned().collect();
                let removed: Vec<_> = before.difference(&now).cloned().collect();
                if added.is_empty() && removed.is_empty() {
                    Ok(())
                } else {
                    Err(StepError::Fail(format!(
                        "what {principal} owns changed since `{}`: added {added:?}, removed {removed:?}",
                        since.since.value
                    )))
                }
            }
            Step::Parallel(p) => self.parallel(p, label).await,
            Step::Sleep(s) => {
                tokio::time::sleep(Duration::from_millis(s.ms.value)).await;
                Ok(())
            }
            Step::Absent(a) => self.absent(a, label).await,
        }
    }

    /// The base URL of `via`. A scenario that sends anything through the peer requires one
    /// (the parser insists), and is skipped when the target has none.
    fn base(&self, via: Via) -> &str {
        match (via, &self.target.peer) {
            (Via::Peer, Some(peer)) => &peer.base_url,
            _ => &self.target.base_url,
        }
    }

    fn token(&self, principal: Principal) -> Option<&str> {
        match principal {
            Principal::Owner => Some(&self.target.tokens.owner),
            Principal::Other => Some(&self.target.tokens.other),
            Principal::Admin => self.target.tokens.admin.as_deref(),
            Principal::Anonymous => None,
        }
    }

    /// The request to send: variables rendered, the body encoded, and bridge requests signed
    /// (their secret is registered with the sanitizer here).
    fn prepare(&mut self, r: &Request) -> Result<Prepared, StepError> {
        let path = self.vars.render(&r.path)?;
        let mut query = Vec::new();
        for (k, v) in &r.query {
            query.push((k.clone(), self.vars.render(v)?));
        }
        let mut headers = vec![(CANARY_HEADER.to_owned(), self.target.canary.clone())];
        let mut literal_auth = false;
        for (k, v) in &r.headers {
            if k.eq_ignore_ascii_case("authorization") {
                literal_auth = true;
            }
            headers.push((k.clone(), self.vars.render(v)?));
        }
        let body = if let Some(json) = &r.json {
            let value = self.vars.render_json(&json.value)?;
            Some((
                serde_json::to_vec(&value).expect("JSON values serialize"),
                "application/json".to_owned(),
            ))
        } else if let Some(t) = &r.body_text {
            Some((
                self.vars.render(t)?.into_bytes(),
                "text/plain; charset=utf-8".to_owned(),
            ))
        } else if let Some(b) = &r.body_base64 {
            use base64::Engine as _;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b.value.as_bytes())
                .unwrap_or_default();
            Some((bytes, "application/octet-stream".to_owned()))
        } else {
            None
        };
        let body = body.map(|(b, ct)| (b, r.content_type.clone().unwrap_or(ct)));
        let target = with_query(&path, &query);
        if let Some(sign) = &r.bridge_signature {
            let secret = self.vars.render(&sign.secret)?;
            // The signed target is the one on the wire, including any path prefix of the
            // base URL, after the URL parser's normalization.
            let url = reqwest::Url::parse(&format!("{}{target}", self.base(r.via)))
                .map_err(|e| StepError::Error(format!("cannot sign `{target}`: {e}")))?;
            let on_wire = match url.query() {
                Some(q) => format!("{}?{q}", url.path()),
                None => url.path().to_owned(),
            };
            let timestamp = time::OffsetDateTime::now_utc().unix_timestamp().to_string();
            let body = p_body(&body);
            let signature =
                super::bridge::signature(&secret, r.method.as_str(), &on_wire, body, &timestamp);
            headers.push((super::bridge::TIMESTAMP_HEADER.to_owned(), timestamp));
            headers.push((super::bridge::SIGNATURE_HEADER.to_owned(), signature));
            if !self.secrets.contains(&secret) {
                self.secrets.push(secret);
            }
        }
        Ok(Prepared {
            via: r.via,
            method: r.method,
            target,
            principal: r.principal,
            headers,
            literal_auth,
            body,
        })
    }

    fn builder(&self, client: &reqwest::Client, p: &Prepared) -> reqwest::RequestBuilder {
        let method =
            reqwest::Method::from_bytes(p.method.as_str().as_bytes()).expect("known method");
        let mut b = client.request(method, format!("{}{}", self.base(p.via), p.target));
        if !p.literal_auth
            && let Some(token) = self.token(p.principal)
        {
            b = b.bearer_auth(token);
        }
        for (k, v) in &p.headers {
            b = b.header(k.as_str(), v.as_str());
        }
        if let Some((body, ct)) = &p.body {
            if !p
                .headers
                .iter()
                .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
            {
                b = b.header(reqwest::header::CONTENT_TYPE, ct.as_str());
            }
            b = b.body(body.clone());
        }
        b
    }

    fn credential(&self, p: &Prepared) -> Credential {
        if p.literal_auth {
            Credential::ScenarioLiteral
        } else if p.principal == Principal::Anonymous {
            Credential::None
        } else {
            Credential::Principal(p.principal)
        }
    }

    /// Sends a prepared request and records it. Transport errors are classified here.
    async fn send(
        &mut self,
        client: &reqwest::Client,
        p: &Prepared,
        label: &str,
    ) -> Result<Observed, StepError> {
        let at_ms = self.at();
        let sent = Instant::now();
        let outcome = exchange(self.builder(client, p), self.target.request_timeout, false).await;
        let mut exchange = HttpExchange {
            step: label.to_owned(),
            at_ms,
            credential: self.credential(p),
            method: p.method.as_str().to_owned(),
            target: p.target.clone(),
            request_headers: p
                .headers
                .iter()
                .filter(|(k, _)| !k.eq_ignore_ascii_case("authorization"))
                .cloned()
                .collect(),
            request_body: p.body.as_ref().map(|(b, _)| Body::of(b)),
            status: None,
            response_headers: Vec::new(),
            response_body: None,
            duration_ms: 0,
            error: None,
        };
        exchange.duration_ms = ms(sent.elapsed());
        let result = match outcome {
            Ok(obs) => {
                exchange.status = Some(obs.status);
                exchange.response_headers = record_headers(&obs.headers);
                exchange.response_body = Some(Body::of(&obs.body));
                if (200..300).contains(&obs.status) {
                    self.saw_success = true;
                }
                self.remember_created(p, &obs);
                Ok(obs)
            }
            Err((reason, connect)) => {
                exchange.error = Some(reason.clone());
                if connect {
                    Err(StepError::Error(format!("{}: {reason}", self.base(p.via))))
                } else {
                    Err(StepError::Fail(format!("no response: {reason}")))
                }
            }
        };
        self.transcript.push(Entry::Http(exchange));
        result
    }

    fn judge(&mut self, r: &Request, obs: &Observed) -> Result<(), StepError> {
        let mut failures = Vec::new();
        if let Err(msg) = status_ok(&r.expect, obs.status, None) {
            // The other checks would only repeat that this is the wrong response.
            return Err(StepError::Fail(with_problem(msg, obs)));
        }
        failures.extend(check_response(&r.expect, obs, &self.vars));
        if !failures.is_empty() {
            return Err(StepError::Fail(failures.join("; ")));
        }
        let mut captured = Vec::new();
        for (name, c) in &r.capture {
            let value = capture(&c.value, obs).map_err(StepError::Fail)?;
            if c.value.secret {
                self.secrets.push(super::vars::scalar_text(&value));
            }
            captured.push((name.clone(), value));
        }
        self.vars.captures.extend(captured);
        Ok(())
    }

    async fn request(&mut self, r: &Request, label: &str) -> Result<(), StepError> {
        let p = self.prepare(r)?;
        let client = self.target.client.clone();
        let obs = self.send(&client, &p, label).await?;
        self.judge(r, &obs)
    }

    async fn poll(&mut self, p: &Poll, label: &str) -> Result<(), StepError> {
        let within = Duration::from_secs(u64::try_from(self.vars.num(&p.within_s)?).unwrap_or(0));
        let every = Duration::from_millis(p.every_ms.unwrap_or(200));
        let deadline = Instant::now() + within;
        let client = self.target.client.clone();
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let prepared = self.prepare(&p.request)?;
            let recorded = self.transcript.len();
            let obs = self.send(&client, &prepared, label).await?;
            match self.judge(&p.request, &obs) {
                Ok(()) => return Ok(()),
                Err(StepError::Fail(msg)) => {
                    if Instant::now() + every > deadline {
                        return Err(StepError::Fail(format!(
                            "still not holding after {attempts} attempts in {}s: {msg}",
                            within.as_secs()
                        )));
                    }
                    // Keep the transcript readable: only the first and the last attempts.
                    if attempts > 1 {
                        self.transcript.remove(recorded);
                    }
                }
                Err(other) => return Err(other),
            }
            tokio::time::sleep(every).await;
        }
    }

    async fn sse(&mut self, s: &Sse, label: &str) -> Result<(), StepError> {
        let path = self.vars.render(&s.path)?;
        let mut query = Vec::new();
        for (k, v) in &s.query {
            query.push((k.clone(), self.vars.render(v)?));
        }
        let mut headers = vec![
            (
                "Accept".to_owned(),
                s.accept
                    .clone()
                    .unwrap_or_else(|| "text/event-stream".into()),
            ),
            (CANARY_HEADER.to_owned(), self.target.canary.clone()),
        ];
        let mut literal_auth = false;
        for (k, v) in &s.headers {
            literal_auth |= k.eq_ignore_ascii_case("authorization");
            headers.push((k.clone(), self.vars.render(v)?));
        }
        let last_event_id = s
            .last_event_id
            .as_ref()
            .map(|t| self.vars.render(t))
            .transpose()?;
        if let Some(id) = &last_event_id {
            headers.push(("Last-Event-ID".to_owned(), id.clone()));
        }
        let resume_after: Option<u64> = last_event_id
            .as_deref()
            .or_else(|| {
                query
                    .iter()
                    .find(|(k, _)| k == "after")
                    .map(|(_, v)| v.as_str())
            })
            .and_then(|v| v.parse().ok());
        let prepared = Prepared {
            via: s.via,
            method: Method::Get,
            target: with_query(&path, &query),
            principal: s.principal,
            headers,
            literal_auth,
            body: None,
        };
        let deadline_s = s
            .within_s
            .as_ref()
            .map(|n| self.vars.num(n))
            .transpose()?
            .unwrap_or(DEFAULT_SSE_DEADLINE_S);
        let deadline = Duration::from_secs(u64::try_from(deadline_s).unwrap_or(0));
        let heartbeat = s
            .expect_heartbeat_within_s
            .as_ref()
            .map(|n| self.vars.num(n))
            .transpose()?;
        let min_duration_s = s
            .min_duration_s
            .as_ref()
            .map(|n| self.vars.num(n))
            .transpose()?;
        let at_ms = self.at();
        let sent = Instant::now();
        // The response headers, like the stream after them, must come within the step's
        // deadline; no request timeout beyond that.
        let result = tokio::time::timeout(
            deadline,
            self.builder(&self.target.client, &prepared).send(),
        )
        .await;
        let mut exchange = SseExchange {
            step: label.to_owned(),
            at_ms,
            credential: self.credential(&prepared),
            target: prepared.target.clone(),
            last_event_id: last_event_id.clone(),
            status: None,
            response_headers: Vec::new(),
            frames: Vec::new(),
            first_frame_ms: None,
            eof_ms: None,
            end: String::new(),
        };
        let response = match result {
            Ok(Ok(r)) => r,
            Err(_) => {
                let reason = format!(
                    "no response: headers not received within {deadline_s}s (the step's deadline)"
                );
                exchange.end = format!("error: {reason}");
                self.transcript.push(Entry::Sse(exchange));
                return Err(StepError::Fail(reason));
            }
            Ok(Err(e)) => {
                let reason = describe_reqwest(&e);
                exchange.end = format!("error: {reason}");
                self.transcript.push(Entry::Sse(exchange));
                return Err(if e.is_connect() {
                    StepError::Error(reason)
                } else {
                    StepError::Fail(format!("no response: {reason}"))
                });
            }
        };
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        exchange.status = Some(status);
        exchange.response_headers = record_headers(&headers);
        let mut failures = Vec::new();
        let status_check = status_ok(&s.expect, status, Some(200));
        if status == 200
            && let Err(msg) = status_check
        {
            // A stream where none was expected: do not wait for it to end.
            exchange.end = "unexpected stream".into();
            self.transcript.push(Entry::Sse(exchange));
            return Err(StepError::Fail(msg));
        }
        if status != 200 {
            // Not a stream: judge the response like any other.
            let body = tokio::time::timeout(self.target.request_timeout, response.bytes())
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
            exchange.end = "not a stream".into();
            self.transcript.push(Entry::Sse(exchange));
            let obs = Observed {
                status,
                headers,
                body,
            };
            if let Err(msg) = status_check {
                return Err(StepError::Fail(with_problem(msg, &obs)));
            }
            failures.extend(check_response(&s.expect, &obs, &self.vars));
            return if failures.is_empty() {
                Ok(())
            } else {
                Err(StepError::Fail(failures.join("; ")))
            };
        }
        self.saw_success = true;
        let obs_head = Observed {
            status,
            headers: headers.clone(),
            body: bytes::Bytes::new(),
        };
        failures.extend(check_response(&s.expect, &obs_head, &self.vars));
        let content_type = obs_head.content_type().to_owned();
        if !content_type.starts_with("text/event-stream") {
            failures.push(format!(
                "content-type `{content_type}`, expected text/event-stream"
            ));
        }
        let stop = match &s.until {
            Until::Eof => Stop::Eof,
            Until::Events(n) => Stop::Events(*n as usize),
            Until::Event(t) => Stop::Event(t.clone()),
        };
        // The interop probe reads the same stream at the same time, so it costs no time.
        let probe = self.interop_probe(s, &prepared, last_event_id.clone(), stop.clone(), deadline);
        let strict = read_stream(
            response,
            sent,
            stop,
            s.cut_after.map(|n| n as usize),
            deadline,
        );
        let (record, probed) = tokio::join!(strict, probe);
        exchange.first_frame_ms = record.first_frame.map(ms);
        exchange.eof_ms = record.eof.map(ms);
        exchange.end = format!("{:?}", record.end);
        let mut framing = Framing::after(resume_after);
        if s.id_gaps {
            framing = framing.allowing_gaps();
        }
        let mut events = Vec::new();
        for timed in &record.items {
            let at_ms = ms(timed.at);
            match &timed.item {
                Item::Event(e) => {
                    exchange.frames.push(Frame::Event {
                        at_ms,
                        event: e.event.clone(),
                        id: e.id.clone(),
                        data: e.data.clone(),
                    });
                    if s.strict_framing {
                        for fault in framing.check(e) {
                            failures.push(format!("framing: {fault}"));
                        }
                    }
                    events.push(e.clone());
                }
                Item::Comment(text) => exchange.frames.push(Frame::Comment {
                    at_ms,
                    text: text.clone(),
                }),
                Item::Retry(n) => exchange.frames.push(Frame::Retry { at_ms, ms: *n }),
                Item::Fault(fault) => {
                    exchange.frames.push(Frame::Fault {
                        at_ms,
                        fault: fault.to_string(),
                    });
                    if s.strict_framing {
                        failures.push(format!("framing: {fault}"));
                    }
                }
            }
        }
        self.transcript.push(Entry::Sse(exchange));
        match (&record.end, &s.until, s.cut_after) {
            (EndReason::BodyError(e), _, _) => failures.push(format!("stream broke: {e}")),
            (EndReason::Cut, _, Some(_))
            | (EndReason::Stopped, _, _)
            | (EndReason::Eof, Until::Eof, None) => {}
            (EndReason::Deadline, _, _) => failures.push(format!(
                "stream did not reach its end condition within {deadline_s}s ({} events)",
                events.len()
            )),
            (EndReason::Eof, _, Some(n)) => failures.push(format!(
                "stream ended after {} events, before the cut at {n}",
                events.len()
            )),
            (EndReason::Eof, until, None) => failures.push(format!(
                "stream ended before {until:?} ({} events)",
                events.len()
            )),
            (EndReason::Cut, _, None) => {}
        }
        // A lower bound only: a slow machine makes a stream last longer, never shorter.
        if let (Some(min_s), EndReason::Eof, Some(eof)) = (min_duration_s, &record.end, record.eof)
            && eof < Duration::from_secs(u64::try_from(min_s).unwrap_or(0))
        {
            failures.push(format!(
                "stream ended {:.3}s after it was requested, before the {min_s}s it must stay open",
                eof.as_secs_f64()
            ));
        }
        if s.expect_none {
            if !events.is_empty() {
                failures.push(format!("expected no events, got {}", events.len()));
            }
        } else if events.is_empty() {
            failures.push("stream delivered no events".into());
        }
        if s.exact && events.len() != s.events.len() {
            failures.push(format!(
                "{} events, expected exactly {}",
                events.len(),
                s.events.len()
            ));
        }
        for (i, check) in s.events.iter().enumerate() {
            let Some(event) = events.get(i) else {
                failures.push(format!(
                    "event #{i} expected, stream delivered {}",
                    events.len()
                ));
                break;
            };
            self.check_event(&format!("event #{i}"), check, event, &mut failures)?;
        }
        if !s.each_event.is_empty() {
            let each = crate::scenario::EventCheck {
                event: None,
                id: None,
                data: s.each_event.clone(),
            };
            for (i, event) in events.iter().enumerate() {
                if event.event != "stream.end" {
                    self.check_event(&format!("event #{i}"), &each, event, &mut failures)?;
                }
            }
        }
        if let Some(check) = &s.last_event {
            match events.len().checked_sub(1) {
                Some(i) => {
                    let label = format!("last event (#{i})");
                    self.check_event(&label, check, &events[i], &mut failures)?;
                }
                None => failures.push("a last event expected, the stream delivered none".into()),
            }
        }
        if let Some(limit) = heartbeat {
            let limit = Duration::from_secs(u64::try_from(limit).unwrap_or(0));
            if record.longest_silence > limit {
                failures.push(format!(
                    "silent for {:.1}s, heartbeats due every {}s",
                    record.longest_silence.as_secs_f64(),
                    limit.as_secs()
                ));
            }
        }
        if let Some(seen) = probed
            && matches!(
                record.end,
                EndReason::Eof | EndReason::Stopped | EndReason::Cut
            )
            && !events.is_empty()
            && let Some(msg) = self.compare_interop(seen, &events)
        {
            failures.push(msg);
        }
        if let Some(name) = &s.measure_first_frame {
            match record.first_frame {
                Some(t) => {
                    self.measurements.insert(name.clone(), t.as_secs_f64());
                }
                None => failures.push("no frame arrived to measure".into()),
            }
        }
        if let Some(name) = &s.measure_eof {
            match record.eof {
                Some(t) => {
                    self.measurements.insert(name.clone(), t.as_secs_f64());
                }
                None => failures
                    .push("the stream did not end, so time to EOF cannot be measured".into()),
            }
        }
        if !failures.is_empty() {
            return Err(StepError::Fail(failures.join("; ")));
        }
        if let Some(name) = &s.capture_last_id {
            let last = events
                .iter()
                .rev()
                .find_map(|e| e.id.clone())
                .unwrap_or(record.last_event_id);
            self.vars
                .captures
                .insert(name.value.clone(), Value::String(last));
        }
        Ok(())
    }

    /// Adds to `failures` what `event` (called `label` in messages) breaks of `check`.
    fn check_event(
        &self,
        label: &str,
        check: &crate::scenario::EventCheck,
        event: &crate::sse::Event,
        failures: &mut Vec<String>,
    ) -> Result<(), StepError> {
        if let Some(want) = &check.event
            && &event.event != want
        {
            failures.push(format!("{label} is `{}`, expected `{want}`", event.event));
        }
        if let Some(id) = &check.id {
            let want = self.vars.render(id)?;
            if event.id.as_deref() != Some(want.as_str()) {
                failures.push(format!("{label} id {:?}, expected {want:?}", event.id));
            }
        }
        if !check.data.is_empty() {
            match serde_json::from_str::<Value>(&event.data) {
                Ok(data) => {
                    for c in &check.data {
                        if let Err(msg) = json_check(c, &data, &self.vars) {
                            failures.push(format!("{label} data {msg}"));
                        }
                    }
                }
                Err(_) => failures.push(format!("{label} data is not JSON")),
            }
        }
        Ok(())
    }

    /// Reads the same stream with `eventsource-client`; a difference in event types or ids
    /// is a failure message. Only plain-HTTP targets are probed (the probe has no TLS stack).
    /// Reads the same stream with `eventsource-client`, when the `interop` feature is on and
    /// the step allows it. Only plain-HTTP targets are probed (the probe has no TLS stack),
    /// and only streams authenticated as a principal with no extra headers (the run's canary
    /// aside).
    fn interop_probe(
        &self,
        s: &Sse,
        p: &Prepared,
        last_event_id: Option<String>,
        stop: Stop,
        deadline: Duration,
    ) -> impl std::future::Future<Output = Probed> + use<> {
        let plain = self.base(p.via).starts_with("http://")
            && !p.literal_auth
            && p.headers
                .iter()
                .all(|(k, _)| k == "Accept" || k == "Last-Event-ID" || k == CANARY_HEADER)
            && p.headers
                .iter()
                .any(|(k, v)| k == "Accept" && v.contains("text/event-stream"));
        let enabled = cfg!(feature = "interop") && s.interop && plain;
        let url = format!("{}{}", self.base(p.via), p.target);
        let bearer = self.token(p.principal).map(str::to_owned);
        let cut_after = s.cut_after.map(|n| n as usize);
        async move {
            if !enabled {
                return None;
            }
            #[cfg(feature = "interop")]
            {
                Some(
                    crate::sse::interop::consume(
                        url,
                        bearer,
                        last_event_id,
                        stop,
                        cut_after,
                        deadline,
                    )
                    .await,
                )
            }
            #[cfg(not(feature = "interop"))]
            {
                let _ = (url, bearer, last_event_id, stop, cut_after, deadline);
                None
            }
        }
    }

    /// A failure message when `eventsource-client` saw other event types or ids than the
    /// strict parser.
    fn compare_interop(
        &mut self,
        seen: Result<Seen, String>,
        events: &[crate::sse::Event],
    ) -> Option<String> {
        let seen = match seen {
            Ok(seen) => seen,
            Err(e) => return Some(format!("interop: {e}")),
        };
        let strict: Vec<(&str, Option<&str>)> = events
            .iter()
            .map(|e| (e.event.as_str(), e.id.as_deref()))
            .collect();
        // Ids are compared where the strict parser saw an `id:` line; the probe reports the
        // persisted last id on events without one.
        let same = seen.len() == strict.len()
            && seen
                .iter()
                .zip(&strict)
                .all(|((t, id), (st, sid))| t == st && (sid.is_none() || id.as_deref() == *sid));
        self.note(format!(
            "interop: eventsource-client read {} events",
            seen.len()
        ));
        if same {
            None
        } else {
            Some(format!(
                "interop: eventsource-client saw {seen:?}, the strict parser saw {strict:?}"
            ))
        }
    }

    /// `POST /v1/test/expiry_hold` (TC-9.11): background expiry waits `hold_s` seconds (0
    /// releases it), so that a digest comparison sees only what the scenario did.
    async fn hold_expiry(&mut self, hold_s: u64, label: &str) -> Result<(), StepError> {
        let body = serde_json::to_vec(&serde_json::json!({ "hold_s": hold_s }))
            .expect("a JSON object serializes");
        let p = Prepared {
            via: Via::Primary,
            method: Method::Post,
            target: "/v1/test/expiry_hold".into(),
            principal: Principal::Admin,
            headers: Vec::new(),
            literal_auth: false,
            body: Some((body, "application/json".into())),
        };
        let client = self.target.client.clone();
        let obs = self.send(&client, &p, label).await?;
        if obs.status == 204 {
            Ok(())
        } else {
            Err(StepError::Fail(format!(
                "POST /v1/test/expiry_hold {{\"hold_s\":{hold_s}}}: status {}, expected 204",
                obs.status
            )))
        }
    }

    async fn digest(&mut self, label: &str) -> Result<String, StepError> {
        let p = Prepared {
            via: Via::Primary,
            method: Method::Get,
            target: "/v1/test/digest".into(),
            principal: Principal::Admin,
            headers: Vec::new(),
            literal_auth: false,
            body: None,
        };
        let client = self.target.client.clone();
        let obs = self.send(&client, &p, label).await?;
        if obs.status != 200 {
            return Err(StepError::Fail(format!(
                "GET /v1/test/digest: status {}",
                obs.status
            )));
        }
        obs.json()
            .ok()
            .and_then(|j| j.get("digest").and_then(Value::as_str).map(str::to_owned))
            .ok_or_else(|| StepError::Fail("GET /v1/test/digest: no `digest` string".into()))
    }

    /// Every object ID `principal` owns: sandboxes, and snapshots when advertised.
    async fn owned(
        &mut self,
        principal: Principal,
        label: &str,
    ) -> Result<BTreeSet<String>, StepError> {
        let client = self.target.client.clone();
        let mut ids = self
            .list_ids(&client, principal, "/v1/sandboxes", label)
            .await?;
        if self.target.capabilities.has("snapshots") {
            ids.extend(
                self.list_ids(&client, principal, "/v1/snapshots", label)
                    .await?,
            );
        }
        Ok(ids)
    }

    /// Follows a list's pages and returns every `data[*].id`.
    async fn list_ids(
        &mut self,
        client: &reqwest::Client,
        principal: Principal,
        path: &str,
        label: &str,
    ) -> Result<BTreeSet<String>, StepError> {
        let mut ids = BTreeSet::new();
        let mut page_token: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let mut query = vec![("limit".to_owned(), "100".to_owned())];
            if let Some(t) = &page_token {
                query.push(("page_token".into(), t.clone()));
            }
            let p = Prepared {
                via: Via::Primary,
                method: Method::Get,
                target: with_query(path, &query),
                principal,
                headers: Vec::new(),
                literal_auth: false,
                body: None,
            };
            let obs = self.send(client, &p, label).await?;
            if obs.status != 200 {
                return Err(StepError::Fail(format!(
                    "GET {path}: status {}",
                    obs.status
                )));
            }
            let json = obs
                .json()
                .map_err(|e| StepError::Fail(format!("GET {path}: {e}")))?;
            let data = json
                .get("data")
                .and_then(Value::as_array)
                .ok_or_else(|| StepError::Fail(format!("GET {path}: no `data` array")))?;
            for item in data {
                if let Some(id) = item.get("id").and_then(Value::as_str) {
                    ids.insert(id.to_owned());
                }
            }
            match json.get("next_page_token").and_then(Value::as_str) {
                Some(t) => page_token = Some(t.to_owned()),
                None => return Ok(ids),
            }
        }
        Err(StepError::Fail(format!(
            "GET {path}: more than {MAX_PAGES} pages"
        )))
    }

    /// Sends the group once, or (with `within_s`) until its tallies hold.
    async fn parallel(&mut self, p: &Parallel, label: &str) -> Result<(), StepError> {
        let Some(within_s) = &p.within_s else {
            return self.parallel_once(p, label, false).await;
        };
        let within = Duration::from_secs(u64::try_from(self.vars.num(within_s)?).unwrap_or(0));
        let every = Duration::from_millis(p.every_ms.as_ref().map_or(1000, |e| e.value));
        let deadline = Instant::now() + within;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            match self.parallel_once(p, label, true).await {
                Ok(()) => return Ok(()),
                Err(StepError::Fail(msg)) if Instant::now() + every <= deadline => {
                    self.note(format!("{label}: attempt {attempts} did not hold: {msg}"));
                }
                Err(StepError::Fail(msg)) => {
                    return Err(StepError::Fail(format!(
                        "still not holding after {attempts} attempts in {}s: {msg}",
                        within.as_secs()
                    )));
                }
                Err(other) => return Err(other),
            }
            tokio::time::sleep(every).await;
        }
    }

    /// One attempt of a `parallel` group. `close_streams`: a granted event stream is judged
    /// on its status and headers and then closed instead of being read to its end.
    async fn parallel_once(
        &mut self,
        p: &Parallel,
        label: &str,
        close_streams: bool,
    ) -> Result<(), StepError> {
        let mut prepared = Vec::new();
        if let Some(r) = &p.request {
            let n = p
                .repeat
                .as_ref()
                .map(|n| self.vars.num(n))
                .transpose()?
                .unwrap_or(1);
            for _ in 0..n.clamp(0, 1000) {
                prepared.push(self.prepare(r)?);
            }
        }
        for r in &p.requests {
            prepared.push(self.prepare(r)?);
        }
        let client = self.target.client.clone();
        let limit = self.target.request_timeout;
        let futures = prepared.iter().map(|pr| {
            let b = self.builder(&client, pr);
            async move {
                let sent = Instant::now();
                let r = exchange(b, limit, close_streams).await;
                (r, sent.elapsed())
            }
        });
        let at_ms = self.at();
        let results = futures_util::future::join_all(futures).await;
        let before = self.ledger.len();
        let mut observed = Vec::new();
        for (pr, (result, took)) in prepared.iter().zip(results) {
            let mut exchange = HttpExchange {
                step: label.to_owned(),
                at_ms,
                credential: self.credential(pr),
                method: pr.method.as_str().to_owned(),
                target: pr.target.clone(),
                request_headers: pr
                    .headers
                    .iter()
                    .filter(|(k, _)| !k.eq_ignore_ascii_case("authorization"))
                    .cloned()
                    .collect(),
                request_body: pr.body.as_ref().map(|(b, _)| Body::of(b)),
                status: None,
                response_headers: Vec::new(),
                response_body: None,
                duration_ms: ms(took),
                error: None,
            };
            match result {
                Ok(obs) => {
                    exchange.status = Some(obs.status);
                    exchange.response_headers = record_headers(&obs.headers);
                    exchange.response_body = Some(Body::of(&obs.body));
                    if (200..300).contains(&obs.status) {
                        self.saw_success = true;
                    }
                    self.remember_created(pr, &obs);
                    observed.push(obs);
                }
                Err((reason, connect)) => {
                    exchange.error = Some(reason.clone());
                    self.transcript.push(Entry::Http(exchange));
                    return Err(if connect {
                        StepError::Error(reason)
                    } else {
                        StepError::Fail(format!("no response: {reason}"))
                    });
                }
            }
            self.transcript.push(Entry::Http(exchange));
        }
        if p.removed_by_sweep {
            for created in &mut self.ledger[before..] {
                created.by_sweep = true;
            }
        }
        let failures = judge_tallies(&p.expect, &observed, &self.vars)?;
        if failures.is_empty() {
            Ok(())
        } else {
            Err(StepError::Fail(failures.join("; ")))
        }
    }

    async fn absent(&mut self, a: &Absent, label: &str) -> Result<(), StepError> {
        let path = self.vars.render(&a.path)?;
        let list = self.vars.render(&a.list)?;
        let id = self.vars.render(&a.id)?;
        // A fresh client: no pooled connection or cache can hide the object's state.
        let client = self
            .target
            .fresh_client()
            .map_err(|e| StepError::Error(e.to_string()))?;
        let p = Prepared {
            via: Via::Primary,
            method: Method::Get,
            target: path.clone(),
            principal: a.principal,
            headers: Vec::new(),
            literal_auth: false,
            body: None,
        };
        let obs = self.send(&client, &p, label).await?;
        let mut failures = Vec::new();
        if obs.status != 404 {
            failures.push(format!("GET {path}: status {}, expected 404", obs.status));
        } else if obs
            .json()
            .ok()
            .and_then(|j| j.get("code").and_then(Value::as_str).map(str::to_owned))
            .as_deref()
            != Some("not_found")
        {
            failures.push(format!("GET {path}: 404 without problem code `not_found`"));
        }
        let ids = self.list_ids(&client, a.principal, &list, label).await?;
        if ids.contains(&id) {
            failures.push(format!("{id} is still listed by GET {list}"));
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(StepError::Fail(failures.join("; ")))
        }
    }
}

/// Sends a request and reads its whole response, each wait bounded by `limit`: the response
/// headers (connecting included), then every read of the body. The error is a reason and
/// whether the target could not be connected to at all.
async fn exchange(
    builder: reqwest::RequestBuilder,
    limit: Duration,
    close_streams: bool,
) -> Result<Observed, (String, bool)> {
    let secs = limit.as_secs_f64();
    let mut response = match tokio::time::timeout(limit, builder.send()).await {
        Err(_) => {
            return Err((
                format!("headers not received within {secs}s (--request-timeout)"),
                false,
            ));
        }
        Ok(Err(e)) => return Err((describe_reqwest(&e), e.is_connect())),
        Ok(Ok(r)) => r,
    };
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let stream = headers
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    if close_streams && stream && response.status().is_success() {
        // Dropping the response closes its connection.
        drop(response);
        return Ok(Observed {
            status,
            headers,
            body: Default::default(),
        });
    }
    let mut body = Vec::new();
    loop {
        match tokio::time::timeout(limit, response.chunk()).await {
            Err(_) => {
                return Err((
                    format!(
                        "the response body stalled: no bytes for {secs}s after {} bytes (--request-timeout)",
                        body.len()
                    ),
                    false,
                ));
            }
            Ok(Err(e)) => return Err((describe_reqwest(&e), false)),
            Ok(Ok(None)) => break,
            Ok(Ok(Some(chunk))) => body.extend_from_slice(&chunk),
        }
    }
    Ok(Observed {
        status,
        headers,
        body: body.into(),
    })
}

/// Judges the responses of a `parallel` step against its tallies: each `exactly` tally must
/// count exactly that many responses (status, and `code` when given), the `rest` tally takes
/// every response not counted by another, and every response a tally counts must pass its
/// header checks. Returns the failures.
fn judge_tallies(
    tallies: &[crate::scenario::Tally],
    observed: &[Observed],
    vars: &Vars<'_>,
) -> Result<Vec<String>, StepError> {
    let keys: Vec<(u16, Option<String>)> = observed
        .iter()
        .map(|o| (o.status, problem_code(o)))
        .collect();
    let matches = |t: &crate::scenario::Tally, k: &(u16, Option<String>)| {
        t.status == k.0 && t.code.as_ref().is_none_or(|c| Some(c) == k.1.as_ref())
    };
    let describe = |t: &crate::scenario::Tally| {
        format!(
            "status {}{}",
            t.status,
            t.code.as_ref().map(|c| format!(" {c}")).unwrap_or_default()
        )
    };
    // Which tally counted each response.
    let mut counted: Vec<Option<usize>> = vec![None; keys.len()];
    let mut failures = Vec::new();
    for (ti, tally) in tallies.iter().enumerate().filter(|(_, t)| !t.rest) {
        let want = tally
            .exactly
            .as_ref()
            .map(|n| vars.num(n))
            .transpose()?
            .unwrap_or(0);
        let mut got = 0i64;
        for (i, k) in keys.iter().enumerate() {
            if counted[i].is_none() && matches(tally, k) {
                counted[i] = Some(ti);
                got += 1;
            }
        }
        if got != want {
            failures.push(format!(
                "{got} responses with {}, expected {want}",
                describe(tally)
            ));
        }
    }
    let rest = tallies.iter().position(|t| t.rest);
    for (i, k) in keys.iter().enumerate() {
        if counted[i].is_some() {
            continue;
        }
        match rest {
            Some(ti) if matches(&tallies[ti], k) => counted[i] = Some(ti),
            _ => failures.push(format!(
                "unexpected response: status {}{}",
                k.0,
                k.1.as_ref().map(|c| format!(" {c}")).unwrap_or_default()
            )),
        }
    }
    for (i, obs) in observed.iter().enumerate() {
        let Some(ti) = counted[i] else { continue };
        for msg in check_headers(&tallies[ti].headers, obs, vars) {
            failures.push(format!("response #{i} ({}): {msg}", describe(&tallies[ti])));
        }
    }
    Ok(failures)
}

/// A status mismatch message, with the problem code when the response has one.
fn with_problem(msg: String, obs: &Observed) -> String {
    match problem_code(obs) {
        Some(code) => format!("{msg} ({code})"),
        None => msg,
    }
}

/// `path?k=v&...` with the values percent-encoded.
/// The bytes a prepared body sends (none: empty).
fn p_body(body: &Option<(Vec<u8>, String)>) -> &[u8] {
    body.as_ref().map_or(&[], |(b, _)| b.as_slice())
}

fn with_query(path: &str, query: &[(String, String)]) -> String {
    if query.is_empty() {
        return path.to_owned();
    }
    let mut url = reqwest::Url::parse("http://x/").expect("static URL");
    url.query_pairs_mut().extend_pairs(query);
    format!(
        "{path}{}{}",
        if path.contains('?') { "&" } else { "?" },
        url.query().unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observed(status: u16, code: Option<&str>, retry_after: Option<&str>) -> Observed {
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(v) = retry_after {
            headers.insert("retry-after", v.parse().unwrap());
        }
        let body = match code {
            Some(code) => {
                headers.insert(
                    reqwest::header::CONTENT_TYPE,
                    "application/problem+json".parse().unwrap(),
                );
                serde_json::json!({"status": status, "code": code}).to_string()
            }
            None => String::new(),
        };
        Observed {
            status,
            headers,
            body: body.into(),
        }
    }

    #[test]
    fn tallies_count_statuses_and_check_headers_of_what_they_count() {
        let caps = crate::target::Capabilities::from_json(serde_json::json!({
            "providers": [{"name": "local", "default": true}],
            "features": [],
            "limits": {"max_streams_per_principal": 2},
            "retention": {}
        }))
        .unwrap();
        let vars = Vars::new("run", &caps, "canary");
        let tallies: Vec<crate::scenario::Tally> = serde_saphyr::from_str(
            "- {status: 200, exactly: limits.max_streams_per_principal}\n\
             - {status: 429, code: too_many_streams, rest: true, headers: [{name: Retry-After, matches: '^[0-9]+$'}]}\n",
        )
        .unwrap();
        let good = [
            observed(200, None, None),
            observed(429, Some("too_many_streams"), Some("1")),
            observed(200, None, None),
        ];
        assert!(judge_tallies(&tallies, &good, &vars).unwrap().is_empty());
        // A 429 without Retry-After fails its tally's header check.
        let bare = [
            observed(200, None, None),
            observed(200, None, None),
            observed(429, Some("too_many_streams"), None),
        ];
        let failures = judge_tallies(&tallies, &bare, &vars).unwrap();
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(
            failures[0]
                .starts_with("response #2 (status 429 too_many_streams): header retry-after"),
            "{failures:?}"
        );
        // One 200 too many (a quota not enforced) and none refused.
        let over = [
            observed(200, None, None),
            observed(200, None, None),
            observed(200, None, None),
        ];
        let failures = judge_tallies(&tallies, &over, &vars).unwrap();
        assert_eq!(failures, ["3 responses with status 200, expected 2"]);
    }

    #[test]
    fn query_strings_are_encoded() {
        assert_eq!(with_query("/v1/x", &[]), "/v1/x");
        assert_eq!(
            with_query(
                "/v1/sandboxes/a/files",
                &[
                    ("path".into(), "../etc/passwd".into()),
                    ("q".into(), "a b&c".into())
                ]
            ),
            "/v1/sandboxes/a/files?path=..%2Fetc%2Fpasswd&q=a+b%26c"
        );
    }
}
