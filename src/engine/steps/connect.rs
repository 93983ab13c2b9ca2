//! `connect`: a Connect-RPC call (JSON codec) to envd inside a sandbox, for the E2B profile.
//! envd is reached the two ways E2B's SDK reaches it: on the target's own base URL with the
//! routing headers `E2b-Sandbox-Id` and `E2b-Sandbox-Port` (self-hosted and compatible
//! platforms, the reference server), or at E2B's host form
//! `https://49983-<sandboxID>.<domain>` when the run names an envd domain (`--envd-domain`).
//! A server stream is parsed by the strict envelope parser; any framing fault fails the step.

use std::time::{Duration, Instant};

use serde_json::Value;

use std::collections::BTreeMap;

use regex::Regex;
use serde::Deserialize;

use super::kind::{StepKind, secs};

use crate::connect::{self, Item};
use crate::engine::context::{CANARY_HEADER, Ctx, Failed, StepError, exchange, ms};
use crate::engine::expect::{Observed, json_check};
use crate::engine::transcript::{Body, Credential, Entry, HttpExchange, record_headers};
use crate::profile::e2b::envd_route;
use crate::scenario::{
    Capture, CheckCtx, Checker, JsonCheck, Located, NumExpr, Pos, Scope, Template, present,
};
use crate::target::{BoundedBody, ReadError, ReadLimits};

/// A Connect-RPC call (JSON codec) to envd inside a sandbox, for the E2B profile: unary, or
/// a server stream read to its end-of-stream message.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Connect {
    #[serde(default)]
    pub name: Option<String>,
    /// The E2B ID of the sandbox whose envd answers.
    pub sandbox: Template,
    /// `package.Service/Method`, e.g. `process.Process/Start`.
    pub rpc: Located<String>,
    /// A server-streaming RPC (`application/connect+json` envelopes).
    #[serde(default)]
    pub stream: bool,
    /// The request message; `{}` when absent.
    #[serde(default, deserialize_with = "present")]
    pub message: Option<Located<serde_json::Value>>,
    /// A client stream's messages (`process.Process/StreamInput`), sent as envelopes in
    /// order in one request body; instead of `message`, with `stream: true`.
    #[serde(default)]
    pub messages: Option<Located<Vec<serde_json::Value>>>,
    /// The sandbox's envd access token (`X-Access-Token`), for a secure sandbox.
    #[serde(default)]
    pub access_token: Option<Template>,
    /// More request headers, as an SDK sends them (`Connect-Timeout-Ms` for a command's
    /// timeout, `Keepalive-Ping-Interval`). The protocol's own headers are the step's.
    #[serde(default)]
    pub headers: BTreeMap<String, Template>,
    /// How long the whole call (a stream: to its end) may take; the request timeout when
    /// absent.
    #[serde(default)]
    pub within_s: Option<NumExpr>,
    /// The Connect error code expected (`not_found`, ...); absent: success.
    #[serde(default)]
    pub error: Option<String>,
    /// A stream read only until one message holds every one of these checks, then closed
    /// by the client (a background process keeps running: closing never ends it). The
    /// stream ending first fails the step.
    #[serde(default)]
    pub until: Vec<JsonCheck>,
    /// Checks on the response message (unary); for a stream, each check must hold in some
    /// message.
    #[serde(default)]
    pub json: Vec<JsonCheck>,
    /// Captures by JSON pointer: from the response (unary) or from the first message the
    /// pointer resolves in (a stream).
    #[serde(default)]
    pub capture: BTreeMap<String, Located<Capture>>,
    /// Checks on a stream's output as a whole: the protobuf `bytes` (base64) at `pointer` in
    /// every message that has one, decoded and joined in order, as an SDK joins a process's
    /// output (which can arrive in any chunks).
    #[serde(default)]
    pub output: Vec<OutputCheck>,
}

/// A check on a stream's joined output: it `contains` or `equals` a text.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputCheck {
    /// Where each message carries its bytes, e.g. `/event/data/stdout`.
    pub pointer: Located<String>,
    #[serde(default)]
    pub contains: Option<Template>,
    #[serde(default)]
    pub equals: Option<Template>,
}

impl StepKind for Connect {
    fn label(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| format!("connect {}", self.rpc.value))
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        c.template(&self.sandbox, scope, ctx);
        if let Some(t) = &self.access_token {
            c.template(t, scope, ctx);
        }
        if let Some(n) = &self.within_s {
            c.num(n, scope, ctx);
        }
        for (name, value) in &self.headers {
            c.template(value, scope, ctx);
            let own = [
                "content-type",
                "connect-protocol-version",
                "x-access-token",
                "e2b-sandbox-id",
                "e2b-sandbox-port",
            ];
            if own.contains(&name.to_ascii_lowercase().as_str()) {
                c.err(
                    value.pos,
                    format!("`{name}` is the step's own header: give it with the step's fields"),
                );
            } else if reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
                c.err(value.pos, format!("`{name}` is not a header name"));
            }
        }
        let rpc_re = Regex::new(
            r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*\.[A-Z][A-Za-z0-9]*/[A-Z][A-Za-z0-9]*$",
        )
        .expect("static regex");
        if !rpc_re.is_match(&self.rpc.value) {
            c.err(
                Pos::of(&self.rpc),
                format!(
                    "rpc `{}` must look like `process.Process/Start`",
                    self.rpc.value
                ),
            );
        }
        for check in &self.json {
            c.json_check(check, scope, ctx);
        }
        if let Some(first) = self.until.first() {
            let pos = first.pointer.pos;
            if !self.stream {
                c.err(pos, "`until` reads a stream: it needs `stream: true`");
            }
            if self.error.is_some() {
                c.err(
                    pos,
                    "`until` stops at a message, `error` waits for the stream's end: give one",
                );
            }
        }
        for check in &self.until {
            c.json_check(check, scope, ctx);
        }
        if let Some(messages) = &self.messages {
            if self.message.is_some() {
                c.err(
                    Pos::of(messages),
                    "give `message` (one) or `messages` (a client stream), not both",
                );
            }
            if !self.stream {
                c.err(
                    Pos::of(messages),
                    "`messages` is a client stream: it needs `stream: true`",
                );
            }
            if messages.value.is_empty() {
                c.err(Pos::of(messages), "`messages` needs at least one message");
            }
        }
        for check in &self.output {
            let pos = Pos::of(&check.pointer);
            if !self.stream || !self.until.is_empty() {
                c.err(
                    pos,
                    "`output` joins a whole stream: it needs `stream: true` without `until`",
                );
            }
            if !check.pointer.value.starts_with('/') {
                c.err(pos, "`output` pointer must start with `/`");
            }
            match (&check.contains, &check.equals) {
                (Some(t), None) | (None, Some(t)) => c.template(t, scope, ctx),
                _ => c.err(pos, "an `output` check takes one of `contains` or `equals`"),
            }
        }
        for (name, cap) in &self.capture {
            if cap.value.json.is_none()
                || cap.value.header.is_some()
                || cap.value.body.is_some()
                || cap.value.regex.is_some()
            {
                c.err(
                    Pos::of(cap),
                    "a `connect` capture takes only `json: <pointer>`",
                );
            }
            if cap.value.secret {
                scope.secrets.insert(name.clone());
            }
            c.define_capture(name, Pos::of(cap), scope);
        }
    }

    fn waits(&self, ctx: &Ctx<'_>) -> Duration {
        self.within_s
            .as_ref()
            .map_or(Duration::ZERO, |n| secs(ctx.vars.num(n)))
    }

    fn expects_success(&self) -> bool {
        self.error.is_none()
    }

    /// A Connect error the step expects has its HTTP status: `resource_exhausted` is a 429,
    /// `unavailable` a 503.
    fn names_statuses(&self) -> Vec<u16> {
        match self.error.as_deref() {
            Some("resource_exhausted") => vec![429],
            Some("unavailable") => vec![503],
            _ => Vec::new(),
        }
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        ctx.connect(self, label).await
    }
}

impl Ctx<'_> {
    async fn connect(&mut self, c: &Connect, label: &str) -> Result<(), StepError> {
        let sandbox = self.vars.render(&c.sandbox)?;
        let messages = match (&c.messages, &c.message) {
            (Some(list), _) => list
                .value
                .iter()
                .map(|m| self.vars.render_json(m))
                .collect::<Result<Vec<_>, _>>()?,
            (None, Some(m)) => vec![self.vars.render_json(&m.value)?],
            (None, None) => vec![Value::Object(Default::default())],
        };
        let (body, content_type) = if c.stream {
            let mut body = Vec::new();
            for m in &messages {
                let json = serde_json::to_vec(m).expect("JSON values serialize");
                body.extend(connect::envelope(0, &json));
            }
            (body, "application/connect+json")
        } else {
            let json = serde_json::to_vec(&messages[0]).expect("JSON values serialize");
            (json, "application/json")
        };
        let mut headers = vec![
            (CANARY_HEADER.to_owned(), self.target.canary.clone()),
            ("Content-Type".to_owned(), content_type.to_owned()),
            ("Connect-Protocol-Version".to_owned(), "1".to_owned()),
        ];
        let (host, routing) = envd_route(&sandbox, self.target.envd_domain.as_deref());
        headers.extend(routing);
        let url = format!(
            "{}/{}",
            host.as_deref().unwrap_or(&self.target.base_url),
            c.rpc.value
        );
        if let Some(t) = &c.access_token {
            headers.push(("X-Access-Token".to_owned(), self.vars.render(t)?));
        }
        for (name, value) in &c.headers {
            headers.push((name.clone(), self.vars.render(value)?));
        }
        let limit = match &c.within_s {
            Some(n) => Duration::from_secs(u64::try_from(self.vars.num(n)?).unwrap_or(0)),
            None => self.target.request_timeout,
        };
        let what = format!("POST /{}", c.rpc.value);
        let mut attempt = 1;
        let (obs, stopped) = loop {
            let mut builder = self.target.client.post(&url).body(body.clone());
            for (k, v) in &headers {
                builder = builder.header(k.as_str(), v.as_str());
            }
            let at_ms = self.at();
            let sent = Instant::now();
            self.target.usage.sent(body.len() as u64);
            let reading = async {
                if c.stream && !c.until.is_empty() {
                    read_until(builder, limit, self.target.limits, &c.until, &self.vars).await
                } else {
                    exchange(builder, limit, self.target.limits)
                        .await
                        .map(|o| (o, false))
                }
            };
            let (result, stopped) = match tokio::time::timeout(limit, reading).await {
                Ok(Ok((obs, stopped))) => (Ok(obs), stopped),
                Ok(Err(e)) => (Err(e), false),
                Err(_) if !c.until.is_empty() => (
                    Err(Failed {
                        reason: format!(
                            "no message held `until` within {}s, and the stream did not end",
                            limit.as_secs()
                        ),
                        connect: false,
                        head: None,
                    }),
                    false,
                ),
                Err(_) => (
                    Err(Failed {
                        reason: format!("the call did not complete within {}s", limit.as_secs()),
                        connect: false,
                        head: None,
                    }),
                    false,
                ),
            };
            let mut record = HttpExchange {
                step: label.to_owned(),
                at_ms,
                credential: Credential::None,
                method: "POST".to_owned(),
                target: url
                    .strip_prefix(&self.target.base_url)
                    .unwrap_or(&url)
                    .to_owned(),
                request_headers: headers.clone(),
                request_body: Some(Body::of(&body)),
                status: None,
                response_headers: Vec::new(),
                response_body: None,
                duration_ms: ms(sent.elapsed()),
                error: None,
            };
            let obs = match result {
                Ok(obs) => obs,
                Err(failed) => {
                    let reason = failed.reason;
                    record.error = Some(reason.clone());
                    if let Some((status, headers)) = &failed.head {
                        record.status = Some(*status);
                        record.response_headers = record_headers(headers);
                    }
                    self.transcript.push(Entry::Http(record));
                    return Err(if failed.connect {
                        StepError::Error(reason)
                    } else if let Some((status, _)) = failed.head {
                        StepError::Fail(format!("status {status}, but {reason}"))
                    } else {
                        StepError::Fail(format!("no response: {reason}"))
                    });
                }
            };
            self.target.usage.received(obs.body.len() as u64);
            record.status = Some(obs.status);
            record.response_headers = record_headers(&obs.headers);
            record.response_body = Some(Body::of(&obs.body));
            self.transcript.push(Entry::Http(record));
            match self
                .wait_out(label, &what, obs.status, &obs.headers, attempt)
                .await
            {
                Ok(true) => attempt += 1,
                Ok(false) => break (obs, stopped),
                Err(reason) => return Err(StepError::Error(reason)),
            }
        };
        let messages = if !c.until.is_empty() {
            Some(self.judge_until(&obs, stopped)?)
        } else if c.stream {
            self.judge_stream(c, &obs)?
        } else {
            self.judge_unary(c, &obs)?
        };
        let Some(messages) = messages else {
            return Ok(());
        };
        self.saw_success = true;
        let mut failures = Vec::new();
        for check in &c.json {
            let results: Vec<Result<(), String>> = messages
                .iter()
                .map(|m| json_check(check, m, &self.vars))
                .collect();
            if !results.iter().any(Result::is_ok) {
                let last = results
                    .into_iter()
                    .rev()
                    .find_map(Result::err)
                    .unwrap_or_else(|| "no message".into());
                failures.push(if c.stream {
                    format!("no message of {} holds: {last}", messages.len())
                } else {
                    last
                });
            }
        }
        for check in &c.output {
            match self.output_check(check, &messages) {
                Ok(()) => {}
                Err(StepError::Fail(why)) => failures.push(why),
                Err(other) => return Err(other),
            }
        }
        if !failures.is_empty() {
            return Err(StepError::Fail(failures.join("; ")));
        }
        for (name, cap) in &c.capture {
            let pointer = cap.value.json.as_deref().unwrap_or_default();
            let value = messages
                .iter()
                .find_map(|m| m.pointer(pointer).cloned())
                .ok_or_else(|| {
                    StepError::Fail(format!("capture `{name}`: nothing at {pointer}"))
                })?;
            if cap.value.secret {
                self.secrets.push(crate::engine::vars::scalar_text(&value));
            }
            self.vars.captures.insert(name.clone(), value);
        }
        Ok(())
    }

    /// One `output` check over a stream's messages.
    fn output_check(&self, check: &OutputCheck, messages: &[Value]) -> Result<(), StepError> {
        use base64::Engine as _;
        let pointer = &check.pointer.value;
        let mut joined = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            let Some(value) = m.pointer(pointer) else {
                continue;
            };
            let text = value.as_str().ok_or_else(|| {
                StepError::Fail(format!(
                    "message {i}: {pointer} is not base64 bytes: {value}"
                ))
            })?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(text)
                .map_err(|e| {
                    StepError::Fail(format!("message {i}: {pointer} is not base64: {e}"))
                })?;
            joined.extend(bytes);
        }
        let joined = String::from_utf8_lossy(&joined);
        let shown = || {
            let mut s: String = joined.chars().take(300).collect();
            if joined.chars().count() > 300 {
                s.push('…');
            }
            format!("{s:?}")
        };
        match (&check.contains, &check.equals) {
            (Some(t), _) => {
                let want = self.vars.render(t)?;
                if !joined.contains(&want) {
                    return Err(StepError::Fail(format!(
                        "the output at {pointer} does not contain {want:?}: {}",
                        shown()
                    )));
                }
            }
            (None, Some(t)) => {
                let want = self.vars.render(t)?;
                if joined != want {
                    return Err(StepError::Fail(format!(
                        "the output at {pointer} is {}, expected {want:?}",
                        shown()
                    )));
                }
            }
            (None, None) => {}
        }
        Ok(())
    }

    /// A unary answer: the response message when it succeeded as expected, `None` when it
    /// failed as expected.
    fn judge_unary(&self, c: &Connect, obs: &Observed) -> Result<Option<Vec<Value>>, StepError> {
        let json = obs.json().ok();
        let code = json
            .as_ref()
            .and_then(|j| j.get("code"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        match (&c.error, obs.status) {
            (None, 200) => {
                let ct = obs.content_type();
                if !ct.starts_with("application/json") {
                    return Err(StepError::Fail(format!(
                        "content-type `{ct}`, expected application/json"
                    )));
                }
                json.map(|j| Some(vec![j]))
                    .ok_or_else(|| StepError::Fail("the response is not JSON".into()))
            }
            (None, status) => Err(StepError::Fail(format!(
                "status {status} ({}), expected success",
                code.as_deref().unwrap_or("no Connect error code")
            ))),
            (Some(want), 200) => Err(StepError::Fail(format!(
                "succeeded, expected the Connect error `{want}`"
            ))),
            (Some(want), status) if code.as_deref() == Some(want.as_str()) => {
                let _ = status;
                Ok(None)
            }
            (Some(want), status) => Err(StepError::Fail(format!(
                "status {status} with Connect error {code:?}, expected `{want}`"
            ))),
        }
    }

    /// A stream read until a message held `until`: the messages up to that one, or why the
    /// stream failed or ended before one did.
    fn judge_until(&self, obs: &Observed, stopped: bool) -> Result<Vec<Value>, StepError> {
        if obs.status != 200 {
            return Err(StepError::Fail(format!(
                "status {}, a Connect stream answers 200",
                obs.status
            )));
        }
        let ct = obs.content_type();
        if !ct.starts_with("application/connect+json") {
            return Err(StepError::Fail(format!(
                "content-type `{ct}`, expected application/connect+json"
            )));
        }
        let mut parser = connect::Parser::new();
        let mut items = parser.push(&obs.body);
        if !stopped {
            items.extend(parser.finish().map(Item::Fault));
        }
        let mut messages = Vec::new();
        let mut faults = Vec::new();
        let mut error = None;
        for item in items {
            match item {
                Item::Message(m) => messages.push(m),
                Item::End(e) => {
                    error = e.get("error").map(|e| {
                        e.get("code")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned()
                    });
                }
                Item::Fault(f) => faults.push(format!("framing: {f}")),
            }
        }
        if !faults.is_empty() {
            return Err(StepError::Fail(faults.join("; ")));
        }
        if stopped {
            return Ok(messages);
        }
        Err(StepError::Fail(match error {
            Some(code) => format!(
                "the stream ended with the Connect error `{code}` after {} messages, none holding `until`",
                messages.len()
            ),
            None => format!(
                "the stream ended after {} messages, none holding `until`",
                messages.len()
            ),
        }))
    }

    /// A server stream: its messages when it ended cleanly as expected, `None` when its
    /// end-of-stream message carried the expected error.
    fn judge_stream(&self, c: &Connect, obs: &Observed) -> Result<Option<Vec<Value>>, StepError> {
        if obs.status != 200 {
            return Err(StepError::Fail(format!(
                "status {}, a Connect stream answers 200",
                obs.status
            )));
        }
        let ct = obs.content_type();
        if !ct.starts_with("application/connect+json") {
            return Err(StepError::Fail(format!(
                "content-type `{ct}`, expected application/connect+json"
            )));
        }
        let mut messages = Vec::new();
        let mut end = None;
        let mut faults = Vec::new();
        for item in connect::parse_all(&obs.body) {
            match item {
                Item::Message(m) => messages.push(m),
                Item::End(e) => end = Some(e),
                Item::Fault(f) => faults.push(format!("framing: {f}")),
            }
        }
        if !faults.is_empty() {
            return Err(StepError::Fail(faults.join("; ")));
        }
        let error = end.as_ref().and_then(|e| e.get("error")).map(|e| {
            e.get("code")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned()
        });
        match (&c.error, error) {
            (None, None) => Ok(Some(messages)),
            (None, Some(code)) => Err(StepError::Fail(format!(
                "the stream ended with the Connect error `{code}` after {} messages",
                messages.len()
            ))),
            (Some(want), None) => Err(StepError::Fail(format!(
                "the stream ended cleanly after {} messages, expected the Connect error `{want}`",
                messages.len()
            ))),
            (Some(want), Some(code)) if &code == want => Ok(None),
            (Some(want), Some(code)) => Err(StepError::Fail(format!(
                "the stream ended with the Connect error `{code}`, expected `{want}`"
            ))),
        }
    }
}

/// Sends a stream request and reads its envelopes until a message holds every `until`
/// check; then the response is dropped, which closes the stream. The body read so far, and
/// whether a message held them. A response that is not a 200 Connect stream is read whole,
/// for the judge to report.
async fn read_until(
    builder: reqwest::RequestBuilder,
    limit: Duration,
    limits: ReadLimits,
    until: &[crate::scenario::JsonCheck],
    vars: &crate::engine::vars::Vars<'_>,
) -> Result<(Observed, bool), Failed> {
    let secs = limit.as_secs_f64();
    let response = match builder.timeout(limit).send().await {
        Ok(r) => r,
        Err(e) => {
            return Err(Failed {
                reason: crate::target::describe_reqwest(&e),
                connect: e.is_connect(),
                head: None,
            });
        }
    };
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let failed = |reason: String| Failed {
        reason,
        connect: false,
        head: Some((status, headers.clone())),
    };
    let streamed = status == 200
        && headers
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("application/connect+json"));
    let mut reader = BoundedBody::new(response, limits).map_err(|t| failed(t.to_string()))?;
    let mut parser = connect::Parser::new();
    let mut body = Vec::new();
    let mut stopped = false;
    loop {
        let chunk = match reader.next().await {
            Some(Ok(chunk)) => chunk,
            None => break,
            Some(Err(ReadError::Transport(e))) if e.is_timeout() => {
                return Err(failed(format!(
                    "the stream stalled after {} bytes within {secs}s",
                    body.len()
                )));
            }
            Some(Err(e)) => return Err(failed(e.to_string())),
        };
        body.extend_from_slice(&chunk);
        if !streamed {
            continue;
        }
        let held = parser.push(&chunk).iter().any(|item| {
            matches!(item, Item::Message(m)
                if until.iter().all(|check| json_check(check, m, vars).is_ok()))
        });
        if held {
            stopped = true;
            break;
        }
    }
    drop(reader);
    Ok((
        Observed {
            status,
            headers,
            body: body.into(),
        },
        stopped,
    ))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;
    use crate::engine::Vars;
    use crate::scenario::{JsonCheck, Step, parse_str};
    use crate::target::Capabilities;

    /// The `until` checks of a one-step scenario, parsed as a scenario file would be.
    fn until(checks: &str) -> Vec<JsonCheck> {
        let text = format!(
            "id: E2B-PRC-001\ntitle: t\nclauses: [E2B-PRC-1]\nlevel: SHOULD\nsteps:\n  - connect: {{sandbox: x, rpc: process.Process/Start, stream: true, until: {checks}}}\n"
        );
        match &parse_str(Path::new("t.yaml"), &text).unwrap().steps[0] {
            Step::Connect(c) => c.until.clone(),
            other => panic!("not a connect step: {other:?}"),
        }
    }

    /// A one-connection server answering a Connect stream of `messages`, then the end of the
    /// stream when `end`, else holding the connection open until the client leaves.
    async fn stream_server(messages: Vec<serde_json::Value>, end: bool) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = sock.read(&mut buf).await;
            let mut out = b"HTTP/1.1 200 OK\r\ncontent-type: application/connect+json\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
            let mut chunk = |bytes: Vec<u8>| {
                out.extend_from_slice(format!("{:x}\r\n", bytes.len()).as_bytes());
                out.extend_from_slice(&bytes);
                out.extend_from_slice(b"\r\n");
            };
            for m in &messages {
                chunk(connect::envelope(0, m.to_string().as_bytes()));
            }
            if end {
                chunk(connect::envelope(2, b"{}"));
                out.extend_from_slice(b"0\r\n\r\n");
            }
            sock.write_all(&out).await.unwrap();
            // Held open: the read ends when the client closes its side.
            let _ = sock.read(&mut buf).await;
        });
        url
    }

    async fn read(url: &str, checks: &[JsonCheck]) -> (Observed, bool) {
        let caps = Capabilities::default();
        let vars = Vars::new("run", &caps, "canary");
        let builder = crate::target::build_client(None)
            .unwrap()
            .post(url)
            .body("x");
        read_until(
            builder,
            Duration::from_secs(30),
            ReadLimits::default(),
            checks,
            &vars,
        )
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn a_stream_that_stays_open_is_left_at_the_first_message_holding_until() {
        let url = stream_server(
            vec![
                json!({"event": {"start": {"pid": 7}}}),
                json!({"event": {"data": {"stdout": "aGkK"}}}),
            ],
            false,
        )
        .await;
        let (obs, stopped) =
            read(&url, &until("[{pointer: /event/start/pid, exists: true}]")).await;
        assert!(stopped);
        let items = connect::Parser::new().push(&obs.body);
        assert_eq!(
            items.first(),
            Some(&Item::Message(json!({"event": {"start": {"pid": 7}}})))
        );
    }

    #[tokio::test]
    async fn a_stream_that_ends_first_is_read_to_its_end_and_not_stopped() {
        let url = stream_server(vec![json!({"event": {"start": {"pid": 7}}})], true).await;
        let (obs, stopped) = read(&url, &until("[{pointer: /event/end, exists: true}]")).await;
        assert!(!stopped);
        assert!(matches!(
            connect::parse_all(&obs.body).last(),
            Some(Item::End(_))
        ));
    }
}
