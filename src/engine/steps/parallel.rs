//! `parallel`: requests sent at once, their responses judged together by tallies.

use std::time::{Duration, Instant};

use serde::Deserialize;

use super::kind::{StepKind, named, secs};
use super::request::Request;

use crate::engine::context::{
    Ctx, Failed, Prepared, StepError, exchange_holding, is_credential_header, ms, p_body,
};
use crate::engine::expect::{Observed, check_headers, problem_code};
use crate::engine::throttle::OnThrottle;
use crate::engine::transcript::{Body, Entry, HttpExchange, record_headers};
use crate::engine::vars::Vars;
use crate::scenario::{CheckCtx, Checker, HeaderCheck, Located, NumExpr, Pos, Principal, Scope};

/// Requests sent concurrently, judged together.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Parallel {
    /// A short name for messages, the transcript and `fails_at`.
    #[serde(default)]
    pub name: Option<String>,
    /// Distinct requests to send at once.
    #[serde(default)]
    pub requests: Vec<Request>,
    /// Or one request sent this many times at once.
    #[serde(default)]
    pub request: Option<Request>,
    #[serde(default)]
    pub repeat: Option<NumExpr>,
    /// How the responses must be distributed.
    pub expect: Vec<Tally>,
    /// Send the group again until its tallies hold, for at most this many seconds (a number
    /// or an expression): for counts that settle a moment later, such as a stream slot
    /// released once the server sees a close. With it, a granted event stream is judged on
    /// its status and headers and then closed, not read to its end.
    #[serde(default)]
    pub within_s: Option<NumExpr>,
    /// Pause between attempts (with `within_s`); 1000 ms unless given.
    #[serde(default)]
    pub every_ms: Option<Located<u64>>,
    /// What these requests create cannot be captured, so no cleanup step can name it: with
    /// `true`, the engine removes it after cleanup (each delete confirmed by a 404) instead
    /// of the leak check failing on it.
    #[serde(default)]
    pub removed_by_sweep: bool,
}

/// "exactly N responses with this status (and code)", or "all the rest".
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tally {
    pub status: u16,
    #[serde(default)]
    pub code: Option<String>,
    #[serde(default)]
    pub exactly: Option<NumExpr>,
    /// Every response not counted by another tally.
    #[serde(default)]
    pub rest: bool,
    /// Checks every response this tally counts must also pass (e.g. `Retry-After` on each
    /// 429).
    #[serde(default)]
    pub headers: Vec<HeaderCheck>,
}

impl StepKind for Parallel {
    fn label(&self) -> String {
        named(self.name.as_deref(), || "parallel".to_owned())
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        let single = self.request.iter().count();
        match (single, self.requests.is_empty(), &self.repeat) {
            (1, true, Some(n)) => c.num(n, scope, ctx),
            (0, false, None) => {}
            _ => c.err(
                self.expect
                    .first()
                    .map(|_| Pos::default())
                    .unwrap_or_default(),
                "`parallel` takes either `requests: [...]` or `request` with `repeat`",
            ),
        }
        for r in self.request.iter().chain(&self.requests) {
            r.check_as(c, scope, ctx, true);
        }
        match (&self.within_s, &self.every_ms) {
            (Some(n), _) => c.num(n, scope, ctx),
            (None, Some(every)) => c.err(
                Pos::of(every),
                "`every_ms` paces the attempts of `within_s`, which is not given",
            ),
            (None, None) => {}
        }
        let rests = self.expect.iter().filter(|t| t.rest).count();
        if rests > 1 {
            c.err(
                Pos::default(),
                "`parallel` may have at most one `rest` tally",
            );
        }
        for t in &self.expect {
            for h in &t.headers {
                c.header_check(h, scope, ctx);
            }
            match (&t.exactly, t.rest) {
                (Some(n), false) => c.num(n, scope, ctx),
                (None, true) => {}
                _ => c.err(
                    t.exactly.as_ref().map(|n| n.pos).unwrap_or_default(),
                    "a tally takes exactly one of `exactly: N` and `rest: true`",
                ),
            }
        }
    }

    fn deadline(&self) -> Option<&NumExpr> {
        self.within_s.as_ref()
    }

    fn uses_admin(&self) -> bool {
        self.request
            .iter()
            .chain(&self.requests)
            .any(|r| r.principal == Principal::Admin)
    }

    /// Event streams sent in parallel are read to their end: at most the advertised stream
    /// duration (and, retried, for at most `within_s` more).
    fn waits(&self, ctx: &Ctx<'_>) -> Duration {
        let mut total = Duration::ZERO;
        if self.request.iter().chain(&self.requests).any(is_stream) {
            let limit = ctx.target.capabilities.limits.get("max_stream_duration_s");
            total += secs(Ok(limit.copied().unwrap_or(0))) + ctx.target.request_timeout;
        }
        if let Some(w) = &self.within_s {
            total += secs(ctx.vars.num(w));
        }
        total
    }

    fn names_statuses(&self) -> Vec<u16> {
        self.expect.iter().map(|t| t.status).collect()
    }

    /// The group's creates that its tallies let succeed: the `exactly` of its 2xx tallies
    /// (a quota check's creates beyond the quota are refused on a correct target), or every
    /// one when a 2xx tally takes the `rest` or no tally is given.
    fn sandboxes(&self, vars: &Vars<'_>, profile: &dyn crate::profile::Profile) -> u64 {
        let count = |n: &NumExpr| {
            vars.num(n)
                .ok()
                .and_then(|n| u64::try_from(n.clamp(0, 1000)).ok())
                .unwrap_or(0)
        };
        let repeat = self.repeat.as_ref().map_or(1, count);
        let creating =
            |r: &Request| u64::from(profile.creates_sandbox(r.method.as_str(), &r.path.raw));
        let all: u64 = repeat * self.request.iter().map(creating).sum::<u64>()
            + self.requests.iter().map(creating).sum::<u64>();
        let successes: Vec<&Tally> = self
            .expect
            .iter()
            .filter(|t| (200..300).contains(&t.status))
            .collect();
        if self.expect.is_empty() || successes.iter().any(|t| t.rest) {
            return all;
        }
        all.min(
            successes
                .iter()
                .filter_map(|t| t.exactly.as_ref())
                .map(count)
                .sum(),
        )
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        ctx.parallel(self, label).await
    }
}

/// Whether a request asks for an event stream.
fn is_stream(r: &Request) -> bool {
    r.headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("accept") && v.raw.contains("text/event-stream"))
}

impl Ctx<'_> {
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
    /// on its status and headers and then closed instead of being read to its end; it is held
    /// open until every request of the group has its answer, so that the group's streams are
    /// open together however late a loaded machine sends the last request. A request answered
    /// with a throttling answer the tallies do not name is sent again once the longest such
    /// wait of the group is over.
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
        let what = |pr: &Prepared| format!("{} {}", pr.method.as_str(), pr.target);
        let client = self.target.client.clone();
        let limit = self.target.request_timeout;
        let limits = self.target.limits;
        let patience = self.patience();
        let usage = self.target.usage.clone();
        // Each request waits out its own throttling answers while the others are in flight,
        // so that the group stays one group: a request sent again meets the others' streams
        // still open.
        let futures = prepared.iter().map(|pr| {
            let builder = self.builder(&client, pr);
            let (what, patience, usage) = (what(pr), patience.clone(), usage.clone());
            let body = p_body(&pr.body).len() as u64;
            async move {
                let mut throttled = Vec::new();
                let mut waited = Duration::ZERO;
                let mut attempt = 1;
                loop {
                    let b = builder.try_clone().expect("a request with a body of bytes");
                    usage.sent(body);
                    let sent = Instant::now();
                    let r = exchange_holding(b, limit, limits, close_streams).await;
                    let took = sent.elapsed();
                    let decision = match &r {
                        Ok((obs, _)) => {
                            patience.on(&what, obs.status, &obs.headers, attempt, waited)
                        }
                        Err(_) => OnThrottle::Judge,
                    };
                    match decision {
                        OnThrottle::Wait(t) => {
                            tokio::time::sleep(t.wait).await;
                            waited += t.wait;
                            throttled.push((r.map(|(o, _)| o), took, t));
                            attempt += 1;
                        }
                        OnThrottle::Judge => return (r, took, throttled, waited, None),
                        OnThrottle::GiveUp(why) => return (r, took, throttled, waited, Some(why)),
                    }
                }
            }
        });
        let at_ms = self.at();
        let results = futures_util::future::join_all(futures).await;
        // Granted streams stay open until every request of the group has its answer; then
        // they close together.
        let mut holding = Vec::new();
        let mut answers: Vec<(Result<Observed, Failed>, Duration)> = Vec::new();
        let mut longest = Duration::ZERO;
        let mut gave_up = None;
        for (pr, (result, took, throttled, waited, why)) in prepared.iter().zip(results) {
            for (answer, took, t) in throttled {
                self.record(label, at_ms, pr, &answer, took);
                self.record_wait(label, &what(pr), &t);
            }
            longest = longest.max(waited);
            let result = result.map(|(observed, held)| {
                holding.extend(held);
                observed
            });
            if let Some(why) = why {
                self.record(label, at_ms, pr, &result, took);
                gave_up.get_or_insert(why);
                answers.push((Err(Failed::given_up()), took));
            } else {
                answers.push((result, took));
            }
        }
        drop(holding);
        self.spent_waiting(longest);
        if let Some(why) = gave_up {
            return Err(StepError::Error(why));
        }
        let at_ms = self.at();
        let before = self.ledger.len();
        let mut observed = Vec::new();
        for (pr, (result, took)) in prepared.iter().zip(answers) {
            self.record(label, at_ms, pr, &result, took);
            match result {
                Ok(obs) => {
                    if (200..300).contains(&obs.status) {
                        self.saw_success = true;
                    }
                    self.observed(pr, &obs);
                    observed.push(obs);
                }
                Err(failed) => {
                    let reason = failed.reason;
                    return Err(if failed.connect {
                        StepError::Error(reason)
                    } else if let Some((status, _)) = failed.head {
                        StepError::Fail(format!("status {status}, but {reason}"))
                    } else {
                        StepError::Fail(format!("no response: {reason}"))
                    });
                }
            }
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

    /// Records one request of the group and its answer in the transcript.
    fn record(
        &mut self,
        label: &str,
        at_ms: u64,
        pr: &Prepared,
        result: &Result<Observed, Failed>,
        took: Duration,
    ) {
        let mut exchange = HttpExchange {
            step: label.to_owned(),
            at_ms,
            credential: self.credential(pr),
            method: pr.method.as_str().to_owned(),
            target: pr.target.clone(),
            request_headers: pr
                .headers
                .iter()
                .filter(|(k, _)| !is_credential_header(k))
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
            }
            Err(failed) => {
                exchange.error = Some(failed.reason.clone());
                if let Some((status, headers)) = &failed.head {
                    exchange.status = Some(*status);
                    exchange.response_headers = record_headers(headers);
                }
            }
        }
        self.transcript.push(Entry::Http(exchange));
    }
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
}
