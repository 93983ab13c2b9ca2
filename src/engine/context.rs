//! What every step kind shares: the state of one scenario run ([`Ctx`]), a request ready to
//! send ([`Prepared`]), how a step goes wrong ([`StepError`]), and sending and recording a
//! request. Step kinds live in [`super::steps`]; this module knows none of them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::created::Created;
use super::expect::{Observed, problem_code};
use super::outcome::Outcome;
use super::transcript::{Body, Credential, Entry, HttpExchange, Note, record_headers};
use super::vars::{VarError, Vars};
use crate::live::Leftover;
use crate::profile::CreatedKind;
use crate::scenario::{Method, Principal, Via};
use crate::target::{BoundedBody, ReadError, ReadLimits, Target, describe_reqwest, read_body};

/// The header that carries the run's canary secret on every request.
pub const CANARY_HEADER: &str = "X-Sandspec-Canary";

/// Pages an absence check or snapshot reads at most.
const MAX_PAGES: usize = 50;

/// Whether a header carries a credential in some profile (`Authorization`, `X-API-Key`):
/// a scenario that sets one sends it instead of the principal's, and it is never recorded.
pub(super) fn is_credential_header(name: &str) -> bool {
    name.eq_ignore_ascii_case("authorization") || name.eq_ignore_ascii_case("x-api-key")
}

pub(super) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// How a step went wrong.
#[derive(Debug)]
pub(crate) enum StepError {
    /// The target misbehaved.
    Fail(String),
    /// The harness could not carry on.
    Error(String),
    Var(VarError),
}

impl StepError {
    pub(super) fn into_outcome(self, step: String) -> Outcome {
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

/// State of one scenario run.
pub(crate) struct Ctx<'a> {
    pub(super) target: &'a Target,
    pub(super) vars: Vars<'a>,
    pub(super) started: Instant,
    pub(super) transcript: Vec<Entry>,
    pub(super) measurements: BTreeMap<String, f64>,
    pub(super) digests: BTreeMap<String, String>,
    /// Named API-level snapshots: principal and the set of object IDs it owned.
    pub(super) snapshots: BTreeMap<String, (Principal, BTreeSet<String>)>,
    /// Everything this scenario created (from the target's 201 responses).
    pub(super) ledger: Vec<Created>,
    /// What the leak check found, and whether the sweep removed it.
    pub(super) leftovers: Vec<Leftover>,
    /// Whether any request was answered 2xx (for the vacuity rule).
    pub(super) saw_success: bool,
    /// Values of captures marked secret.
    pub(super) secrets: Vec<String>,
    /// Whether this run holds the target's background expiry (from its first `digest` step
    /// until after cleanup).
    pub(super) expiry_held: bool,
    /// The MCP server processes of the run by session name (MCP profile); the steps end
    /// them, and whatever a failed step left running is ended before the cleanup.
    pub(super) mcp_sessions: BTreeMap<String, crate::mcp::RunSession>,
    /// The faults the scenario injected, each with the steps that passed after it.
    pub(super) faults: Vec<FaultRecord>,
    /// When the part being run (the steps, the cleanup, the leak check) must be done: a
    /// throttle wait must fit before it.
    pub(super) deadline: Option<Instant>,
    /// The statuses the running step's expectations name: a throttling answer with one of
    /// them is judged as it is, never waited out.
    pub(super) names: Vec<u16>,
    /// Throttle waits so far, and the time they took (taken from the wait budget).
    pub(super) throttle_waits: u32,
    pub(super) throttled_for: Duration,
}

/// One injected fault as the receipt records it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRecord {
    /// The step that injected it (its label).
    pub step: String,
    /// `kill_server`, `restart_server`, `stop_database` or `start_database`.
    pub kind: String,
    /// What it acted on: `primary`, `peer` or `database`.
    pub on: String,
    /// Milliseconds from the scenario's start to the fault.
    pub at_ms: u64,
    /// How long injecting it took (a restart until the server listened again).
    pub took_ms: u64,
    /// The steps that passed after it and before the next fault: what was checked after it.
    pub checked_after: Vec<String>,
}

impl Ctx<'_> {
    /// Records that `label` passed: after a fault, it is part of what was checked after it.
    pub(super) fn passed(&mut self, label: &str) {
        if let Some(last) = self.faults.last_mut()
            && last.step != label
        {
            last.checked_after.push(label.to_owned());
        }
    }
}

/// A request sent but not yet recorded: its transcript entry so far and what came back.
pub(super) struct Sent {
    exchange: HttpExchange,
    outcome: Result<Observed, Failed>,
}

/// A request ready to send.
#[derive(Clone)]
pub(super) struct Prepared {
    /// The endpoint it goes to.
    pub(super) via: Via,
    pub(super) method: Method,
    pub(super) target: String,
    pub(super) principal: Principal,
    pub(super) headers: Vec<(String, String)>,
    pub(super) literal_auth: bool,
    pub(super) body: Option<(Vec<u8>, String)>,
    /// E2B's envd host form (`https://49983-<sandbox>.<domain>`), for a request to a
    /// sandbox's envd when the run names an envd domain; it replaces the endpoint's URL.
    pub(super) envd_host: Option<String>,
}

impl<'a> Ctx<'a> {
    pub(super) fn at(&self) -> u64 {
        ms(self.started.elapsed())
    }

    pub(super) fn note(&mut self, text: String) {
        let at_ms = self.at();
        self.transcript.push(Entry::Note(Note { at_ms, text }));
    }

    /// The base URL of `via`. A scenario that sends anything through the peer requires one
    /// (the parser insists), and is skipped when the target has none.
    pub(super) fn base(&self, via: Via) -> &str {
        match (via, &self.target.peer) {
            (Via::Peer, Some(peer)) => &peer.base_url,
            _ => &self.target.base_url,
        }
    }

    pub(super) fn token(&self, principal: Principal) -> Option<&str> {
        match principal {
            Principal::Owner => Some(&self.target.tokens.owner),
            Principal::Other => Some(&self.target.tokens.other),
            Principal::Admin => self.target.tokens.admin.as_deref(),
            Principal::Anonymous => None,
            Principal::Unscoped => self.target.tokens.unscoped.as_deref(),
        }
    }

    pub(super) fn builder(
        &self,
        client: &reqwest::Client,
        p: &Prepared,
    ) -> reqwest::RequestBuilder {
        let method =
            reqwest::Method::from_bytes(p.method.as_str().as_bytes()).expect("known method");
        let base = p.envd_host.as_deref().unwrap_or(self.base(p.via));
        let mut b = client.request(method, format!("{base}{}", p.target));
        if !p.literal_auth
            && let Some(token) = self.token(p.principal)
        {
            // The admin token opens the test controls, which are on the native surface
            // (`/v1/test/...`) whatever the profile: it always goes as `/v1` sends it.
            let api = match p.principal {
                Principal::Admin => crate::profile::Api::V1,
                _ => self.target.api,
            };
            let (name, value) = api.credential(token);
            b = b.header(name, value);
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

    pub(super) fn credential(&self, p: &Prepared) -> Credential {
        if p.literal_auth {
            Credential::ScenarioLiteral
        } else if p.principal == Principal::Anonymous {
            Credential::None
        } else {
            Credential::Principal(p.principal)
        }
    }

    /// Sends a prepared request and records it, waiting out throttling answers the step does
    /// not name (each sending and each wait recorded). Transport errors are classified here.
    pub(super) async fn send(
        &mut self,
        client: &reqwest::Client,
        p: &Prepared,
        label: &str,
    ) -> Result<Observed, StepError> {
        self.send_reading(client, p, label, Reading::default())
            .await
    }

    /// [`Ctx::send`], each sending read as `reading` says: for at most a while before the
    /// client goes away, or with a deadline for the whole answer.
    pub(super) async fn send_reading(
        &mut self,
        client: &reqwest::Client,
        p: &Prepared,
        label: &str,
        reading: Reading,
    ) -> Result<Observed, StepError> {
        let what = format!("{} {}", p.method.as_str(), p.target);
        let mut attempt = 1;
        loop {
            let obs = self.send_once(client, p, label, reading).await?;
            match self
                .wait_out(label, &what, obs.status, &obs.headers, attempt)
                .await
            {
                Ok(true) => attempt += 1,
                Ok(false) => return Ok(obs),
                Err(reason) => return Err(StepError::Error(reason)),
            }
        }
    }

    /// Sends a prepared request once and records it.
    async fn send_once(
        &mut self,
        client: &reqwest::Client,
        p: &Prepared,
        label: &str,
        reading: Reading,
    ) -> Result<Observed, StepError> {
        let sent = self.send_detached(client, p, label, reading).await;
        self.record_sent(p, sent)
    }

    /// Sends a prepared request once without touching the run's state, so that it can go out
    /// while another part of a step holds the context (a request while a stream is open); the
    /// answer is recorded and judged afterwards with [`Ctx::record_sent`].
    pub(super) async fn send_detached(
        &self,
        client: &reqwest::Client,
        p: &Prepared,
        label: &str,
        reading: Reading,
    ) -> Sent {
        let at_ms = self.at();
        let started = Instant::now();
        self.target.usage.sent(p_body(&p.body).len() as u64);
        let builder = self.builder(client, p);
        let (mut timeout, limits) = (self.target.request_timeout, self.target.limits);
        // A step's own bound on the answer may be longer than the request timeout.
        if let Some(within) = reading.within {
            timeout = timeout.max(within);
        }
        let read = async {
            match reading.leave_after {
                None => exchange(builder, timeout, limits).await,
                Some(d) => exchange_leaving(builder, timeout, limits, d).await,
            }
        };
        let outcome = match reading.within {
            None => read.await,
            Some(within) => match tokio::time::timeout(within, read).await {
                Ok(outcome) => outcome,
                Err(_) => Err(Failed::before_head(
                    format!(
                        "no whole answer within {}s (the step's within_s)",
                        within.as_secs_f64()
                    ),
                    false,
                )),
            },
        };
        let exchange = HttpExchange {
            step: label.to_owned(),
            at_ms,
            credential: self.credential(p),
            method: p.method.as_str().to_owned(),
            target: p.target.clone(),
            request_headers: p
                .headers
                .iter()
                .filter(|(k, _)| !is_credential_header(k))
                .cloned()
                .collect(),
            request_body: p.body.as_ref().map(|(b, _)| Body::of(b)),
            status: None,
            response_headers: Vec::new(),
            response_body: None,
            duration_ms: ms(started.elapsed()),
            error: None,
        };
        Sent { exchange, outcome }
    }

    /// Records a request sent with [`Ctx::send_detached`] and classifies its outcome.
    pub(super) fn record_sent(&mut self, p: &Prepared, sent: Sent) -> Result<Observed, StepError> {
        let Sent {
            mut exchange,
            outcome,
        } = sent;
        let result = match outcome {
            Ok(obs) => {
                exchange.status = Some(obs.status);
                exchange.response_headers = record_headers(&obs.headers);
                exchange.response_body = Some(Body::of(&obs.body));
                if (200..300).contains(&obs.status) {
                    self.saw_success = true;
                }
                self.observed(p, &obs);
                Ok(obs)
            }
            Err(failed) => {
                let reason = failed.reason;
                exchange.error = Some(reason.clone());
                if let Some((status, headers)) = &failed.head {
                    exchange.status = Some(*status);
                    exchange.response_headers = record_headers(headers);
                }
                if failed.connect {
                    Err(StepError::Error(format!("{}: {reason}", self.base(p.via))))
                } else if let Some((status, _)) = failed.head {
                    Err(StepError::Fail(format!("status {status}, but {reason}")))
                } else {
                    Err(StepError::Fail(format!("no response: {reason}")))
                }
            }
        };
        self.transcript.push(Entry::Http(exchange));
        result
    }

    /// What an answer tells the run's account: bytes received, what it created (added to
    /// the ledger), and a sandbox seen gone (its delete answered, or a 404 for it).
    pub(super) fn observed(&mut self, p: &Prepared, obs: &Observed) {
        let usage = &self.target.usage;
        usage.received(obs.body.len() as u64);
        let path = p.target.split('?').next().unwrap_or_default();
        if obs.status == 404 || (p.method == Method::Delete && (200..300).contains(&obs.status)) {
            usage.gone(path);
        }
        self.remember_created(p, obs);
    }

    /// Adds what a successful create made to the ledger (once per object).
    pub(super) fn remember_created(&mut self, p: &Prepared, obs: &Observed) {
        if p.method != Method::Post || obs.status != 201 {
            return;
        }
        let Ok(json) = obs.json() else {
            return;
        };
        let path = p.target.split('?').next().unwrap_or_default();
        let created = self
            .target
            .profile()
            .created(p.method.as_str(), path, obs.status, &json);
        for creation in created {
            if let Some(token) = &creation.token
                && !self.secrets.contains(token)
            {
                self.secrets.push(token.clone());
            }
            if !self.ledger.iter().any(|c| c.creation.path == creation.path) {
                match creation.kind {
                    CreatedKind::Sandbox => self.target.usage.sandbox_created(&creation.path),
                    CreatedKind::Session => self.target.usage.session_created(),
                    _ => {}
                }
                self.ledger.push(Created {
                    creation,
                    principal: p.principal,
                    by_sweep: false,
                });
            }
        }
    }

    /// Follows a list's pages and returns every `data[*].id`.
    pub(super) async fn list_ids(
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
                envd_host: None,
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
}

/// Why an exchange ended without a whole response: the reason, whether the target could not
/// be connected to at all, and the status and headers when they had arrived (a body that
/// broke, stalled or crossed its cap).
#[derive(Debug)]
pub(super) struct Failed {
    pub(super) reason: String,
    pub(super) connect: bool,
    pub(super) head: Option<(u16, reqwest::header::HeaderMap)>,
}

/// How one sending of a request reads its answer.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Reading {
    /// Read the body for at most this long from when the request was sent, then close the
    /// connection (a client that goes away); what was read by then is the answer.
    pub leave_after: Option<Duration>,
    /// The whole answer must have come this long after the request was sent; a later one
    /// fails the step, the connection closed at the deadline.
    pub within: Option<Duration>,
}

impl Failed {
    /// A request whose throttling could not be waited out (the step ends in ERROR).
    pub(super) fn given_up() -> Failed {
        Failed::before_head("throttled".to_owned(), false)
    }

    fn before_head(reason: String, connect: bool) -> Failed {
        Failed {
            reason,
            connect,
            head: None,
        }
    }
}

/// Sends a request and reads its whole response, each wait bounded by `limit`: the response
/// headers (connecting included), then every read of the body; the body under the run's caps
/// (`limits`).
pub(super) async fn exchange(
    builder: reqwest::RequestBuilder,
    limit: Duration,
    limits: ReadLimits,
) -> Result<Observed, Failed> {
    exchange_holding(builder, limit, limits, false)
        .await
        .map(|(observed, _)| observed)
}

/// [`exchange`], but with `hold_streams` a granted event stream is judged on its status and
/// headers and not read: its response comes back open, and dropping it closes its connection.
pub(super) async fn exchange_holding(
    builder: reqwest::RequestBuilder,
    limit: Duration,
    limits: ReadLimits,
    hold_streams: bool,
) -> Result<(Observed, Option<reqwest::Response>), Failed> {
    let secs = limit.as_secs_f64();
    let response = match tokio::time::timeout(limit, builder.send()).await {
        Err(_) => {
            return Err(Failed::before_head(
                format!("headers not received within {secs}s (--request-timeout)"),
                false,
            ));
        }
        Ok(Err(e)) => return Err(Failed::before_head(describe_reqwest(&e), e.is_connect())),
        Ok(Ok(r)) => r,
    };
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let stream = headers
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    if hold_streams && stream && response.status().is_success() {
        let observed = Observed {
            status,
            headers,
            body: Default::default(),
        };
        return Ok((observed, Some(response)));
    }
    let failed = |reason: String| Failed {
        reason,
        connect: false,
        head: Some((status, headers.clone())),
    };
    let body = match read_body(response, limits, Some(limit)).await {
        Ok(body) => body,
        Err(ReadError::Stalled { read, .. }) => {
            return Err(failed(format!(
                "the response body stalled: no bytes for {secs}s after {read} bytes (--request-timeout)"
            )));
        }
        Err(e) => return Err(failed(e.to_string())),
    };
    let observed = Observed {
        status,
        headers,
        body,
    };
    Ok((observed, None))
}

/// [`exchange`], but the body is read only until `leave_after` has passed since its head
/// arrived (or it ends); the response is then dropped, which closes its connection. The head
/// itself is bounded by the request timeout alone: on a loaded machine it may come late, and
/// the client is to go away only once it has been answered for a while.
async fn exchange_leaving(
    builder: reqwest::RequestBuilder,
    limit: Duration,
    limits: ReadLimits,
    leave_after: Duration,
) -> Result<Observed, Failed> {
    let secs = limit.as_secs_f64();
    let response = match tokio::time::timeout(limit, builder.send()).await {
        Err(_) => {
            return Err(Failed::before_head(
                format!("headers not received within {secs}s (--request-timeout)"),
                false,
            ));
        }
        Ok(Err(e)) => return Err(Failed::before_head(describe_reqwest(&e), e.is_connect())),
        Ok(Ok(r)) => r,
    };
    let until = tokio::time::Instant::now() + leave_after;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let failed = |reason: String| Failed {
        reason,
        connect: false,
        head: Some((status, headers.clone())),
    };
    let mut body = BoundedBody::new(response, limits).map_err(|e| failed(e.to_string()))?;
    let mut read = Vec::new();
    loop {
        match tokio::time::timeout_at(until, body.next_within(limit)).await {
            Err(_) | Ok(None) => break,
            Ok(Some(Ok(chunk))) => read.extend_from_slice(&chunk),
            Ok(Some(Err(ReadError::Stalled { read: n, .. }))) => {
                return Err(failed(format!(
                    "the response body stalled: no bytes for {secs}s after {n} bytes (--request-timeout)"
                )));
            }
            Ok(Some(Err(e))) => return Err(failed(e.to_string())),
        }
    }
    drop(body);
    Ok(Observed {
        status,
        headers,
        body: read.into(),
    })
}

/// A status mismatch message, with the problem code when the response has one.
pub(super) fn with_problem(msg: String, obs: &Observed) -> String {
    match problem_code(obs) {
        Some(code) => format!("{msg} ({code})"),
        None => msg,
    }
}

/// `path?k=v&...` with the values percent-encoded.
/// The bytes a prepared body sends (none: empty).
pub(super) fn p_body(body: &Option<(Vec<u8>, String)>) -> &[u8] {
    body.as_ref().map_or(&[], |(b, _)| b.as_slice())
}

pub(super) fn with_query(path: &str, query: &[(String, String)]) -> String {
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
