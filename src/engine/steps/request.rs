//! `request`: one HTTP request, judged by its `expect` block, with captures.

use std::collections::BTreeMap;
use std::time::Duration;

use regex::Regex;
use serde::Deserialize;

use super::kind::{StepKind, expects_2xx, named_statuses, secs};
use crate::engine::bridge;
use crate::engine::context::{
    CANARY_HEADER, Ctx, Prepared, Reading, StepError, is_credential_header, p_body, with_problem,
    with_query,
};
use crate::engine::expect::{Observed, capture, check_response, status_ok};
use crate::engine::vars::Vars;
use crate::profile::Profile;
use crate::profile::e2b::{ENVD_PORT, file_signature, port_route};
use crate::scenario::{
    Capture, CheckCtx, Checker, Expect, Located, Method, NumExpr, Pos, Principal, Scope, Template,
    Via, first_line, present,
};

/// An HTTP request with its expectations and captures.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// A short name for the transcript and failure messages.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(rename = "as", default)]
    pub principal: Principal,
    /// The endpoint to send it to: `primary` unless given.
    #[serde(default)]
    pub via: Via,
    /// E2B profile: send it to this sandbox's envd (its E2B ID), as `connect` steps reach
    /// it: the routing headers on the target's URL, or E2B's host form with `--envd-domain`.
    #[serde(default)]
    pub envd: Option<Template>,
    /// With `envd`: another port of that sandbox, reached as the SDK's `get_host` names it
    /// (the routing headers with that port, or `<port>-<sandbox>.<domain>`); the code
    /// interpreter's service is on 49999.
    #[serde(default)]
    pub port: Option<Located<u16>>,
    /// Read the response body for at most this many milliseconds from when its head arrived,
    /// then close the connection, as a client that goes away does; the expectations judge
    /// what was read by then (a body that ends sooner is read whole).
    #[serde(default)]
    pub leave_after_ms: Option<u64>,
    /// The whole answer must come within this many seconds of the request being sent (a
    /// number or an expression): a later one fails the step, as a bound on how long an
    /// operation may take. Waits for throttling are not counted.
    #[serde(default)]
    pub within_s: Option<NumExpr>,
    /// Raw headers. An `Authorization` header here replaces the principal's token.
    #[serde(default)]
    pub headers: BTreeMap<String, Template>,
    pub method: Method,
    pub path: Template,
    #[serde(default)]
    pub query: BTreeMap<String, Template>,
    /// A JSON body (sent as `application/json`). Strings inside may hold `{{var}}`.
    #[serde(default, deserialize_with = "present")]
    pub json: Option<Located<serde_json::Value>>,
    /// A raw text body.
    #[serde(default)]
    pub body_text: Option<Template>,
    /// A raw binary body, base64-encoded in the file.
    #[serde(default)]
    pub body_base64: Option<Located<String>>,
    /// Overrides the Content-Type the body kind implies.
    #[serde(default)]
    pub content_type: Option<String>,
    #[serde(default)]
    pub expect: Expect,
    /// Variables taken from the response, usable by later steps as `{{name}}`.
    #[serde(default)]
    pub capture: BTreeMap<String, Located<Capture>>,
    /// Sign the request as a worker of the private bridge does (protocol §8.8).
    #[serde(default)]
    pub bridge_signature: Option<BridgeSignature>,
    /// E2B profile: sign a `/files` request as the SDK's `download_url` and `upload_url` do,
    /// with the sandbox's access token instead of sending it.
    #[serde(default)]
    pub envd_signature: Option<EnvdSignature>,
}

/// What an envd file URL signs (`signature` and `signature_expiration` in its query): the
/// path and user as the query names them, the operation, the token and the expiry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvdSignature {
    /// `read` (a download) or `write` (an upload).
    pub operation: Located<String>,
    /// The sandbox's envd access token: a capture marked `secret: true`.
    pub token: Template,
    /// The signature expires this many seconds from now (negative: already expired); none
    /// without.
    #[serde(default)]
    pub expires_in_s: Option<i64>,
}

/// How to sign a bridge request: `X-Sandspec-Timestamp` (now) and `X-Sandspec-Signature` over
/// the method, the request target as sent, the body and the timestamp.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeSignature {
    /// The session's bridge secret: a literal (a wrong key, on purpose) or captures marked
    /// `secret: true`. The engine also registers the value with the evidence sanitizer.
    pub secret: Template,
}

impl Request {
    /// How each sending reads its answer: `leave_after_ms` and `within_s`.
    pub(super) fn reading(&self, vars: &Vars<'_>) -> Result<Reading, StepError> {
        Ok(Reading {
            leave_after: self.leave_after_ms.map(Duration::from_millis),
            within: match &self.within_s {
                Some(n) => match vars.num(n)? {
                    s @ 1.. => Some(secs(Ok(s))),
                    s => {
                        return Err(StepError::Error(format!(
                            "`within_s` is {s}: a positive number of seconds is meant"
                        )));
                    }
                },
                None => None,
            },
        })
    }

    /// The request's checks; in a `parallel` step the tallies judge its answer, so it takes
    /// no `expect` or `capture` of its own.
    pub fn check_as(
        &self,
        c: &mut Checker<'_>,
        scope: &mut Scope,
        ctx: &CheckCtx<'_>,
        in_parallel: bool,
    ) {
        let r = self;
        c.via(r.via, r.path.pos, ctx);
        c.principal(r.principal, r.path.pos, ctx);
        c.test_control(&r.path, ctx);
        if let Some(json) = &r.json
            && names_a_model(&json.value)
            && !ctx.requires.contains("fixture_models")
        {
            c.err(
                Pos::of(json),
                "`agent.model` names a fixture model script: needs `requires: [fixture_models]`",
            );
        }
        c.template(&r.path, scope, ctx);
        if let Some(t) = &r.envd {
            c.template(t, scope, ctx);
            if r.via == Via::Peer {
                c.err(
                    t.pos,
                    "`envd` names the sandbox's envd: it cannot go `via: peer`",
                );
            }
        }
        if let Some(port) = &r.port
            && r.envd.is_none()
        {
            c.err(
                Pos::of(port),
                "`port` is a port of the sandbox `envd` names: give `envd` too",
            );
        }
        if let Some(n) = &r.within_s {
            c.num(n, scope, ctx);
            if in_parallel || r.leave_after_ms.is_some() {
                c.err(
                    r.path.pos,
                    "`within_s` bounds a request's whole answer: not in `parallel`, nor with `leave_after_ms`",
                );
            }
        }
        if r.leave_after_ms == Some(0) || (in_parallel && r.leave_after_ms.is_some()) {
            c.err(
                r.path.pos,
                "`leave_after_ms` is a positive number of milliseconds, outside `parallel`",
            );
        }
        for t in r.headers.values().chain(r.query.values()) {
            c.template(t, scope, ctx);
        }
        let bodies = usize::from(r.json.is_some())
            + usize::from(r.body_text.is_some())
            + usize::from(r.body_base64.is_some());
        if bodies > 1 {
            c.err(
                r.path.pos,
                "a request takes at most one of `json`, `body_text`, `body_base64`",
            );
        }
        if let Some(json) = &r.json {
            c.json_value(json, scope, ctx);
        }
        if let Some(t) = &r.body_text {
            c.template(t, scope, ctx);
        }
        if let Some(b) = &r.body_base64 {
            c.base64(b);
        }
        if let Some(sign) = &r.envd_signature {
            c.template(&sign.token, scope, ctx);
            if !matches!(sign.operation.value.as_str(), "read" | "write") {
                c.err(
                    Pos::of(&sign.operation),
                    "an envd signature's operation is `read` or `write`",
                );
            }
            if r.envd.is_none() {
                c.err(
                    sign.token.pos,
                    "`envd_signature` signs an envd request: give `envd`",
                );
            }
            for own in ["signature", "signature_expiration"] {
                if r.query.contains_key(own) {
                    c.err(
                        sign.token.pos,
                        format!("`envd_signature` sets `{own}`; do not give it in `query`"),
                    );
                }
            }
        }
        if let Some(sign) = &r.bridge_signature {
            c.template(&sign.secret, scope, ctx);
            for var in sign.secret.vars() {
                if scope.captures.contains(var) && !scope.secrets.contains(var) {
                    c.err(
                        sign.secret.pos,
                        format!(
                            "`{var}` signs bridge requests: capture it with `secret: true` so evidence never holds it"
                        ),
                    );
                }
            }
            for name in r.headers.keys() {
                if name.eq_ignore_ascii_case("x-sandspec-timestamp")
                    || name.eq_ignore_ascii_case("x-sandspec-signature")
                {
                    c.err(
                        r.path.pos,
                        format!("`bridge_signature` sets `{name}`; do not give it in `headers`"),
                    );
                }
            }
        }
        if in_parallel {
            if !r.capture.is_empty() || has_expectations(&r.expect) {
                c.err(
                    r.path.pos,
                    "requests in `parallel` take no `expect` or `capture`: the tallies judge them",
                );
            }
            return;
        }
        c.expect(&r.expect, scope, ctx);
        for (name, capture) in &r.capture {
            let cap: &Capture = &capture.value;
            let sources = usize::from(cap.json.is_some())
                + usize::from(cap.header.is_some())
                + usize::from(cap.body == Some(true));
            if sources != 1 || cap.body == Some(false) {
                c.err(
                    Pos::of(capture),
                    format!(
                        "capture `{name}` takes exactly one of `json`, `header` and `body: true`"
                    ),
                );
            }
            if let Some(pointer) = &cap.json
                && !(pointer.is_empty() || pointer.starts_with('/'))
            {
                c.err(
                    Pos::of(capture),
                    format!("capture `{name}`: JSON pointer `{pointer}` must start with `/`"),
                );
            }
            if let Some(re) = &cap.regex
                && let Err(e) = Regex::new(re)
            {
                c.err(
                    Pos::of(capture),
                    format!(
                        "capture `{name}`: invalid regex: {}",
                        first_line(&e.to_string())
                    ),
                );
            }
            c.define_capture(name, Pos::of(capture), scope);
            if cap.secret {
                scope.secrets.insert(name.clone());
            } else {
                scope.secrets.remove(name);
            }
        }
    }
}

/// Whether a request body names an agent model (`{"agent": {"model": "<name>"}}`): the
/// name of a fixture model script, since no real model answers the same way twice.
fn names_a_model(body: &serde_json::Value) -> bool {
    body.get("agent")
        .and_then(|a| a.get("model"))
        .and_then(|m| m.as_str())
        .is_some_and(|m| !m.is_empty())
}

fn has_expectations(e: &Expect) -> bool {
    e.status.is_some()
        || !e.status_in.is_empty()
        || e.code.is_some()
        || e.content_type.is_some()
        || !e.json.is_empty()
        || !e.json_lines.is_empty()
        || !e.headers.is_empty()
        || e.body_text.is_some()
        || e.body_base64.is_some()
}

impl StepKind for Request {
    fn label(&self) -> String {
        match &self.name {
            Some(n) => format!("{n}{}", self.via.label_suffix()),
            None => format!(
                "{} {}{}",
                self.method.as_str(),
                self.path.raw,
                self.via.label_suffix()
            ),
        }
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        self.check_as(c, scope, ctx, false);
    }

    fn waits(&self, ctx: &Ctx<'_>) -> Duration {
        let within = self
            .within_s
            .as_ref()
            .map_or(Duration::ZERO, |n| secs(ctx.vars.num(n)));
        self.leave_after_ms
            .map(Duration::from_millis)
            .unwrap_or_default()
            .max(within)
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

    /// A create the step expects to succeed; one it expects to be refused makes nothing on a
    /// correct target.
    fn sandboxes(&self, _vars: &Vars<'_>, profile: &dyn Profile) -> u64 {
        u64::from(
            profile.creates_sandbox(self.method.as_str(), &self.path.raw)
                && expects_2xx(&self.expect),
        )
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        ctx.request(self, label).await
    }
}

impl Ctx<'_> {
    /// The request to send: variables rendered, the body encoded, and bridge requests signed
    /// (their secret is registered with the sanitizer here).
    pub(super) fn prepare(&mut self, r: &Request) -> Result<Prepared, StepError> {
        let path = self.vars.render(&r.path)?;
        let mut query = Vec::new();
        for (k, v) in &r.query {
            query.push((k.clone(), self.vars.render(v)?));
        }
        let mut headers = vec![(CANARY_HEADER.to_owned(), self.target.canary.clone())];
        let mut literal_auth = false;
        for (k, v) in &r.headers {
            if is_credential_header(k) {
                literal_auth = true;
            }
            headers.push((k.clone(), self.vars.render(v)?));
        }
        if let Some(sign) = &r.envd_signature {
            let token = self.vars.render(&sign.token)?;
            let value_of = |name: &str| {
                query
                    .iter()
                    .find(|(k, _)| k == name)
                    .map_or("", |(_, v)| v.as_str())
            };
            let expiration = sign
                .expires_in_s
                .map(|s| time::OffsetDateTime::now_utc().unix_timestamp() + s);
            let signature = file_signature(
                value_of("path"),
                &sign.operation.value,
                value_of("username"),
                &token,
                expiration,
            );
            query.push(("signature".to_owned(), signature));
            if let Some(e) = expiration {
                query.push(("signature_expiration".to_owned(), e.to_string()));
            }
            if !self.secrets.contains(&token) {
                self.secrets.push(token);
            }
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
        let mut envd_host = None;
        if let Some(sandbox) = &r.envd {
            let sandbox = self.vars.render(sandbox)?;
            let port = r.port.as_ref().map_or(ENVD_PORT, |p| p.value);
            let (host, routing) = port_route(&sandbox, port, self.target.envd_domain.as_deref());
            envd_host = host;
            headers.extend(routing);
        }
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
                bridge::signature(&secret, r.method.as_str(), &on_wire, body, &timestamp);
            headers.push((bridge::TIMESTAMP_HEADER.to_owned(), timestamp));
            headers.push((bridge::SIGNATURE_HEADER.to_owned(), signature));
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
            envd_host,
        })
    }

    /// Judges a response against the request's `expect` block and takes its captures.
    pub(super) fn judge(&mut self, r: &Request, obs: &Observed) -> Result<(), StepError> {
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
                self.secrets.push(crate::engine::vars::scalar_text(&value));
            }
            captured.push((name.clone(), value));
        }
        self.vars.captures.extend(captured);
        Ok(())
    }

    async fn request(&mut self, r: &Request, label: &str) -> Result<(), StepError> {
        let p = self.prepare(r)?;
        let client = self.target.client.clone();
        let reading = r.reading(&self.vars)?;
        let obs = self.send_reading(&client, &p, label, reading).await?;
        self.judge(r, &obs)
    }
}
