//! `sse`: reads a server-sent event stream with the strict parser (and, when enabled, an
//! interop client at the same time), then judges its framing, events, end and timings.

use std::time::{Duration, Instant};

use serde_json::Value;

use std::collections::BTreeMap;

use serde::Deserialize;

use super::kind::{StepKind, expects_2xx, named_statuses, secs};

use crate::engine::context::{
    CANARY_HEADER, Ctx, FaultRecord, Prepared, StepError, is_credential_header, ms, with_problem,
    with_query,
};
use crate::engine::expect::{Observed, check_response, json_check, status_ok};
use crate::engine::throttle::OnThrottle;
use crate::engine::transcript::{Entry, Frame, SseExchange, record_headers};
use crate::scenario::{
    CheckCtx, Checker, Expect, JsonCheck, Located, Method, NumExpr, Pos, Principal, Scope,
    Template, Via,
};
use crate::sse::{EndReason, Framing, Item, Stop, read_stream_signalling};
use crate::target::{ReadError, describe_reqwest, read_body};

/// What a stream's action did while it was open.
enum Acted {
    /// The database was stopped: when, and how long it took.
    Stopped(Result<(u64, u64), String>),
    /// The request went out (recorded and judged once the stream is read).
    Sent(Box<crate::engine::context::Sent>),
}

/// A stream's response, its headers judged worth reading.
struct Opened {
    exchange: SseExchange,
    response: reqwest::Response,
    /// When its request was sent.
    sent: Instant,
    status: u16,
    headers: reqwest::header::HeaderMap,
}

/// `(event type, id)` per event, as an interop probe saw them.
type Seen = Vec<(String, Option<String>)>;

/// What an interop probe returned: `None` when it did not run.
type Probed = Option<Result<Seen, String>>;

/// Default deadline of an `sse` step.
const DEFAULT_SSE_DEADLINE_S: i64 = 30;

/// Open a server-sent event stream and check what it delivers.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sse {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(rename = "as", default)]
    pub principal: Principal,
    /// The endpoint to open the stream on: `primary` unless given.
    #[serde(default)]
    pub via: Via,
    #[serde(default)]
    pub headers: BTreeMap<String, Template>,
    pub path: Template,
    #[serde(default)]
    pub query: BTreeMap<String, Template>,
    /// Sent as the `Last-Event-ID` header.
    #[serde(default)]
    pub last_event_id: Option<Template>,
    /// The Accept header; `text/event-stream` unless given.
    #[serde(default)]
    pub accept: Option<String>,
    /// Response expectations (status defaults to 200). When the status is not 200 the body
    /// is not read as a stream.
    #[serde(default)]
    pub expect: Expect,
    /// When to stop reading; `eof` unless given.
    #[serde(default)]
    pub until: Until,
    /// Deadline for the whole read, in seconds (a number or an expression).
    #[serde(default)]
    pub within_s: Option<NumExpr>,
    /// Checks on the received events, in order: the n-th check applies to the n-th event.
    #[serde(default)]
    pub events: Vec<EventCheck>,
    /// Checks on the data of every received event but `stream.end`.
    #[serde(default)]
    pub each_event: Vec<JsonCheck>,
    /// Checks on the last event received, `stream.end` included.
    #[serde(default)]
    pub last_event: Option<EventCheck>,
    /// No more events than `events` lists.
    #[serde(default)]
    pub exact: bool,
    /// The stream must deliver no event at all. Without it, a stream that delivered nothing
    /// fails.
    #[serde(default)]
    pub expect_none: bool,
    /// Drop the connection after this many events.
    #[serde(default)]
    pub cut_after: Option<u32>,
    /// Stop the deployment's database once this many events arrived, and go on reading:
    /// what an open stream does during an outage (needs `database_control`).
    #[serde(default)]
    pub stop_database_after: Option<u32>,
    /// Send this request once this many events arrived, and go on reading: what an open
    /// stream does when the object behind it changes or goes (a session deleted under its
    /// event stream).
    #[serde(default)]
    pub request_after: Option<RequestAfter>,
    /// When the stream ends for its bound (`stream.end` with `max_duration`, or a reason the
    /// runner does not know), reconnect from the cursor it names, as a client does, until the
    /// step's end condition or its deadline: the events of all connections are judged as
    /// one stream, without the `stream.end` events between them. For a step that reads a
    /// subject to its end, which may take longer than the target's stream duration.
    #[serde(default)]
    pub follow: bool,
    /// Capture the id of the last event received.
    #[serde(default)]
    pub capture_last_id: Option<Located<String>>,
    /// Record the time to the first frame under this measurement name.
    #[serde(default)]
    pub measure_first_frame: Option<String>,
    /// Record the time to EOF under this measurement name.
    #[serde(default)]
    pub measure_eof: Option<String>,
    /// The stream must not end (EOF) sooner than this many seconds after it was requested:
    /// a stream bounded by `max_stream_duration_s` must not end early.
    #[serde(default)]
    pub min_duration_s: Option<NumExpr>,
    /// While idle, a comment must arrive at least this often (seconds).
    #[serde(default)]
    pub expect_heartbeat_within_s: Option<NumExpr>,
    /// Framing rules: every event has an `id`, one-line JSON `data` whose `seq` equals the
    /// id, and ids increase. On unless set to `false`.
    #[serde(default = "yes")]
    pub strict_framing: bool,
    /// The stream is a filtered view of a log (SSE-7.6): ids must increase but may skip
    /// numbers.
    #[serde(default)]
    pub id_gaps: bool,
    /// Framing checks the ids only, not a `seq` in the data (profiles whose events carry
    /// none, such as the Agent Sandbox's).
    #[serde(default)]
    pub ids_only: bool,
    /// Also read the stream with the `eventsource-client` crate and require the same event
    /// types and ids. On unless set to `false` (for a step where a second concurrent stream
    /// would change the outcome, such as a stream-quota check).
    #[serde(default = "yes")]
    pub interop: bool,
}

fn yes() -> bool {
    true
}

/// When an `sse` step stops reading.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Until {
    /// The server ends the stream.
    #[default]
    Eof,
    /// This many events were received.
    Events(u32),
    /// An event of this type was received.
    Event(String),
}

impl Until {
    /// Where a connection stops reading, when the stream's earlier connections delivered
    /// `received` events already.
    fn stop(&self, received: usize) -> Stop {
        match self {
            Until::Eof => Stop::Eof,
            Until::Events(n) => Stop::Events((*n as usize).saturating_sub(received)),
            Until::Event(t) => Stop::Event(t.clone()),
        }
    }
}

/// A request sent while the stream is open, after its first `events` events; judged by its
/// own `expect`, recorded in the transcript between the stream's frames.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestAfter {
    pub events: u32,
    pub request: Box<super::request::Request>,
}

/// Checks on one received event.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventCheck {
    #[serde(default)]
    pub event: Option<String>,
    #[serde(default)]
    pub id: Option<Template>,
    /// Checks on the event's JSON data.
    #[serde(default)]
    pub data: Vec<JsonCheck>,
}

impl StepKind for Sse {
    fn label(&self) -> String {
        let name = self
            .name
            .clone()
            .unwrap_or_else(|| format!("sse {}", self.path.raw));
        format!("{name}{}", self.via.label_suffix())
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        c.via(self.via, self.path.pos, ctx);
        c.principal(self.principal, self.path.pos, ctx);
        c.test_control(&self.path, ctx);
        c.template(&self.path, scope, ctx);
        for t in self.headers.values().chain(self.query.values()) {
            c.template(t, scope, ctx);
        }
        if let Some(t) = &self.last_event_id {
            c.template(t, scope, ctx);
        }
        c.expect(&self.expect, scope, ctx);
        for n in [
            &self.within_s,
            &self.expect_heartbeat_within_s,
            &self.min_duration_s,
        ]
        .into_iter()
        .flatten()
        {
            c.num(n, scope, ctx);
        }
        for ev in self.events.iter().chain(&self.last_event) {
            if let Some(t) = &ev.id {
                c.template(t, scope, ctx);
            }
            for check in &ev.data {
                c.json_check(check, scope, ctx);
            }
        }
        for check in &self.each_event {
            c.json_check(check, scope, ctx);
        }
        if self.id_gaps && !self.strict_framing {
            c.err(
                self.path.pos,
                "`id_gaps` loosens `strict_framing`, which is off",
            );
        }
        if self.expect_none
            && (!self.events.is_empty() || !self.each_event.is_empty() || self.last_event.is_some())
        {
            c.err(self.path.pos, "`expect_none` contradicts `events`");
        }
        if self.follow {
            let clashes = [
                ("cut_after", self.cut_after.is_some()),
                ("stop_database_after", self.stop_database_after.is_some()),
                ("request_after", self.request_after.is_some()),
                ("min_duration_s", self.min_duration_s.is_some()),
                ("measure_eof", self.measure_eof.is_some()),
                ("expect_none", self.expect_none),
            ];
            for (field, set) in clashes {
                if set {
                    c.err(
                        self.path.pos,
                        format!(
                            "`follow` reads the stream over several connections: not with `{field}`"
                        ),
                    );
                }
            }
        }
        if let Some(name) = &self.capture_last_id {
            c.define_capture(&name.value, Pos::of(name), scope);
        }
        if let Some(after) = &self.request_after {
            after.request.check_as(c, scope, ctx, false);
            if !after.request.capture.is_empty() {
                c.err(
                    after.request.path.pos,
                    "`request_after` takes no `capture`: it goes out while the stream is read",
                );
            }
            if self.stop_database_after.is_some() {
                c.err(
                    after.request.path.pos,
                    "a stream takes one action while it is open: `stop_database_after` or `request_after`",
                );
            }
        }
    }

    fn deadline(&self) -> Option<&NumExpr> {
        self.within_s.as_ref()
    }

    fn waits(&self, ctx: &Ctx<'_>) -> Duration {
        let stream = match &self.within_s {
            Some(n) => secs(ctx.vars.num(n)),
            None => secs(Ok(DEFAULT_SSE_DEADLINE_S)),
        };
        // The request sent while the stream is open may wait longer than the stream.
        let action = self
            .request_after
            .as_ref()
            .map_or(Duration::ZERO, |a| a.request.waits(ctx));
        stream.max(action)
    }

    fn expects_success(&self) -> bool {
        expects_2xx(&self.expect)
    }

    fn uses_admin(&self) -> bool {
        self.principal == Principal::Admin
    }

    fn names_statuses(&self) -> Vec<u16> {
        named_statuses(&self.expect)
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        ctx.sse(self, label).await
    }
}

impl Ctx<'_> {
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
            literal_auth |= is_credential_header(k);
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
            envd_host: None,
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
        let Opened {
            mut exchange,
            response,
            sent,
            status,
            headers,
        } = self
            .open_stream(&prepared, last_event_id.clone(), deadline, label)
            .await?;
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
            // Not a stream: judge the response like any other, its body under the body cap.
            let body = match read_body(
                response,
                self.target.limits,
                Some(self.target.request_timeout),
            )
            .await
            {
                Ok(body) => {
                    self.target.usage.received(body.len() as u64);
                    body
                }
                Err(ReadError::TooLarge(t)) => {
                    exchange.end = format!("not a stream: {t}");
                    self.transcript.push(Entry::Sse(exchange));
                    return Err(StepError::Fail(format!("status {status}, but {t}")));
                }
                Err(_) => bytes::Bytes::new(),
            };
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
        let stop = s.until.stop(0);
        // The interop probe reads the same stream at the same time, so it costs no time.
        // A stream the database is stopped under is read once: a second one would see the
        // outage at another point.
        let probe = if s.stop_database_after.is_some() || s.request_after.is_some() {
            None
        } else {
            Some(self.interop_probe(s, &prepared, last_event_id.clone(), stop.clone(), deadline))
        };
        let probe = async move {
            match probe {
                Some(p) => p.await,
                None => None,
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let signal = s
            .stop_database_after
            .or(s.request_after.as_ref().map(|a| a.events))
            .map(|n| (n as usize, tx));
        let action = s
            .request_after
            .as_ref()
            .map(|a| {
                let reading = a.request.reading(&self.vars)?;
                self.prepare(&a.request)
                    .map(|p| (p, a.request.label(), reading))
            })
            .transpose()?;
        let strict = read_stream_signalling(
            response,
            self.target.limits,
            sent,
            stop,
            s.cut_after.map(|n| n as usize),
            deadline,
            signal,
        );
        // The action: once the stream has delivered its events, the database stops, or the
        // request goes out, while it is open (a stream that never gets there does neither).
        let client = self.target.client.clone();
        let outage = async {
            if rx.await.is_err() {
                return None;
            }
            if let Some((p, request_label, reading)) = &action {
                let sent = self
                    .send_detached(&client, p, request_label, *reading)
                    .await;
                return Some(Acted::Sent(Box::new(sent)));
            }
            let at = self.at();
            let began = Instant::now();
            let done = match self.target.control.as_ref() {
                Some(control) => control.stop_database().await,
                None => Err("the runner holds no database of this target".to_owned()),
            };
            Some(Acted::Stopped(done.map(|()| (at, ms(began.elapsed())))))
        };
        let (record, probed, stopped) = tokio::join!(strict, probe, outage);
        self.target.usage.received(record.bytes);
        let stopped = match stopped {
            Some(Acted::Sent(sent)) => {
                let (p, request_label, _) = action.as_ref().expect("a request was sent");
                let after = s.request_after.as_ref().expect("a request was sent");
                let judged = self
                    .record_sent(p, *sent)
                    .and_then(|obs| self.judge(&after.request, &obs));
                match judged {
                    Ok(()) => {}
                    Err(StepError::Fail(reason)) => {
                        failures.push(format!("{request_label}: {reason}"));
                    }
                    Err(other) => return Err(other),
                }
                None
            }
            Some(Acted::Stopped(done)) => Some(done),
            None if s.request_after.is_some() => {
                failures.push(format!(
                    "the stream ended before the {} events after which the request goes",
                    s.request_after.as_ref().map_or(0, |a| a.events)
                ));
                None
            }
            None => None,
        };
        match stopped {
            Some(Ok((at_ms, took_ms))) => {
                self.note(format!(
                    "{label}: stop_database on the database done in {took_ms} ms, with the stream open"
                ));
                self.faults.push(FaultRecord {
                    step: label.to_owned(),
                    kind: "stop_database".to_owned(),
                    on: "database".to_owned(),
                    at_ms,
                    took_ms,
                    checked_after: Vec::new(),
                });
            }
            Some(Err(e)) => return Err(StepError::Error(format!("stop_database: {e}"))),
            None if s.stop_database_after.is_some() => failures.push(format!(
                "the stream ended before the {} events after which the database stops",
                s.stop_database_after.unwrap_or(0)
            )),
            None => {}
        }
        let mut framing = Framing::after(resume_after);
        if s.id_gaps {
            framing = framing.allowing_gaps();
        }
        if s.ids_only {
            framing = framing.ids_only();
        }
        let mut events = take_frames(&mut exchange, &record, &mut framing, s, &mut failures);
        self.transcript.push(Entry::Sse(exchange));
        let first_frame = record.first_frame;
        let mut followed = false;
        let mut longest_silence = record.longest_silence;
        let mut record = record;
        while s.follow && record.end == EndReason::Eof {
            // A stream that ended for its bound (not for its subject, nor for lagging) is
            // resumed from the cursor its `stream.end` names, as a client does (§7).
            let Some(resume) = events.last().and_then(followable_end) else {
                break;
            };
            let left = deadline.saturating_sub(sent.elapsed());
            if left.is_zero() {
                break;
            }
            self.note(format!(
                "{label}: the stream ended for its bound after {} events; following it from {resume}",
                events.len() - 1
            ));
            let mut again = prepared.clone();
            again.headers.retain(|(k, _)| k != "Last-Event-ID");
            again
                .headers
                .push(("Last-Event-ID".to_owned(), resume.to_string()));
            let opened = match self
                .open_stream(&again, Some(resume.to_string()), left, label)
                .await
            {
                Ok(opened) => opened,
                Err(StepError::Fail(reason)) => {
                    failures.push(format!("following the stream from {resume}: {reason}"));
                    break;
                }
                Err(other) => return Err(other),
            };
            // The end between two connections is not one of the stream's events.
            events.pop();
            followed = true;
            let Opened {
                mut exchange,
                response,
                sent: resent,
                status,
                ..
            } = opened;
            if status != 200 {
                exchange.end = "not a stream".into();
                self.transcript.push(Entry::Sse(exchange));
                failures.push(format!(
                    "following the stream from {resume} after its bound: status {status}"
                ));
                break;
            }
            let stop = s.until.stop(events.len());
            record =
                crate::sse::read_stream(response, self.target.limits, resent, stop, None, left)
                    .await;
            self.target.usage.received(record.bytes);
            longest_silence = longest_silence.max(record.longest_silence);
            events.extend(take_frames(
                &mut exchange,
                &record,
                &mut framing,
                s,
                &mut failures,
            ));
            self.transcript.push(Entry::Sse(exchange));
        }
        match (&record.end, &s.until, s.cut_after) {
            (EndReason::BodyError(e), _, _) => failures.push(format!("stream broke: {e}")),
            (EndReason::TooLarge(t), _, _) => failures.push(format!("stream refused: {t}")),
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
            if longest_silence > limit {
                failures.push(format!(
                    "silent for {:.1}s, heartbeats due every {}s",
                    longest_silence.as_secs_f64(),
                    limit.as_secs()
                ));
            }
        }
        // The interop probe read the first connection only, at the same time, and its own
        // connection reached its bound at another moment: compared only when not followed.
        if let Some(seen) = probed
            && !followed
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
            match first_frame {
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
            // A stream's own end says why it ended.
            let why = if event.event == "stream.end" {
                format!(" ({})", event.data)
            } else {
                String::new()
            };
            failures.push(format!(
                "{label} is `{}`{why}, expected `{want}`",
                event.event
            ));
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

    /// Sends the stream's request, waiting out throttling, until a response that is judged:
    /// its headers must come within `deadline`.
    async fn open_stream(
        &mut self,
        prepared: &Prepared,
        last_event_id: Option<String>,
        deadline: Duration,
        label: &str,
    ) -> Result<Opened, StepError> {
        let what = format!("GET {}", prepared.target);
        let mut attempt = 1;
        loop {
            let at_ms = self.at();
            let sent = Instant::now();
            self.target.usage.sent(0);
            // The response headers, like the stream after them, must come within the step's
            // deadline; no request timeout beyond that.
            let result =
                tokio::time::timeout(deadline, self.builder(&self.target.client, prepared).send())
                    .await;
            let mut exchange = SseExchange {
                step: label.to_owned(),
                at_ms,
                credential: self.credential(prepared),
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
                    let within = if deadline.subsec_millis() == 0 {
                        format!("{}s", deadline.as_secs())
                    } else {
                        format!("{:.1}s", deadline.as_secs_f64())
                    };
                    let reason = format!(
                        "no response: headers not received within {within} (the step's deadline)"
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
            match self.throttle(&what, status, &headers, attempt) {
                OnThrottle::Judge => {
                    return Ok(Opened {
                        exchange,
                        response,
                        sent,
                        status,
                        headers,
                    });
                }
                OnThrottle::GiveUp(reason) => {
                    exchange.end = "throttled".into();
                    self.transcript.push(Entry::Sse(exchange));
                    return Err(StepError::Error(reason));
                }
                OnThrottle::Wait(t) => {
                    drop(response);
                    exchange.end = "throttled".into();
                    self.transcript.push(Entry::Sse(exchange));
                    self.spent_waiting(t.wait);
                    self.record_wait(label, &what, &t);
                    tokio::time::sleep(t.wait).await;
                    attempt += 1;
                }
            }
        }
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
        if enabled {
            // A second request for the same stream: what the run sent counts it.
            self.target.usage.sent(0);
        }
        let url = format!("{}{}", self.base(p.via), p.target);
        let bearer = self.token(p.principal).map(str::to_owned);
        let cut_after = s.cut_after.map(|n| n as usize);
        let limits = self.target.limits;
        async move {
            if !enabled {
                return None;
            }
            #[cfg(feature = "interop")]
            {
                Some(
                    crate::sse::interop::consume(
                        url,
                        limits,
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
                let _ = (
                    url,
                    limits,
                    bearer,
                    last_event_id,
                    stop,
                    cut_after,
                    deadline,
                );
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
}

/// The cursor to follow a stream from, when `event` is a `stream.end` for the stream's bound:
/// `max_duration`, or a reason this runner does not know, which clients treat alike (§7). Not
/// for `lagging`, whose cursor has already expired.
fn followable_end(event: &crate::sse::Event) -> Option<u64> {
    if event.event != "stream.end" {
        return None;
    }
    let data: Value = serde_json::from_str(&event.data).ok()?;
    if data.get("reason").and_then(Value::as_str) == Some("lagging") {
        return None;
    }
    data.get("resume_after").and_then(Value::as_u64)
}

/// Records what one connection of a stream delivered in its transcript entry, checks its
/// framing (continuing from the connections before it) and returns its events.
fn take_frames(
    exchange: &mut SseExchange,
    record: &crate::sse::StreamRecord,
    framing: &mut Framing,
    s: &Sse,
    failures: &mut Vec<String>,
) -> Vec<crate::sse::Event> {
    exchange.first_frame_ms = record.first_frame.map(ms);
    exchange.eof_ms = record.eof.map(ms);
    exchange.end = match &record.end {
        EndReason::TooLarge(t) => format!("TooLarge: {t}"),
        end => format!("{end:?}"),
    };
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
    events
}
