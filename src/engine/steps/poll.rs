//! `poll`: one request repeated until its expectations hold or its window closes.

use std::time::{Duration, Instant};

use serde::Deserialize;

use super::kind::{StepKind, expects_2xx, secs};
use super::request::Request;
use crate::engine::context::{Ctx, StepError};
use crate::scenario::{CheckCtx, Checker, NumExpr, Principal, Scope};

/// Repeat a request until its expectations hold or the deadline passes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Poll {
    pub request: Request,
    /// Deadline in seconds: a number or an expression such as `limits.heartbeat_interval_s * 2`.
    pub within_s: NumExpr,
    /// Pause between attempts; 200 ms unless given.
    #[serde(default)]
    pub every_ms: Option<u64>,
}

impl StepKind for Poll {
    fn label(&self) -> String {
        format!("poll {}", self.request.label())
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        // The poll's deadline is computed before its request is first sent, so it cannot
        // use what that request captures.
        c.num(&self.within_s, scope, ctx);
        self.request.check(c, scope, ctx);
    }

    fn deadline(&self) -> Option<&NumExpr> {
        Some(&self.within_s)
    }

    fn waits(&self, ctx: &Ctx<'_>) -> Duration {
        secs(ctx.vars.num(&self.within_s)) + ctx.target.request_timeout
    }

    fn expects_success(&self) -> bool {
        expects_2xx(&self.request.expect)
    }

    fn uses_admin(&self) -> bool {
        self.request.principal == Principal::Admin
    }

    fn names_statuses(&self) -> Vec<u16> {
        self.request.names_statuses()
    }

    /// A poll sends its request until it holds: a create polled counts once (it is retried
    /// only while it does not succeed).
    fn sandboxes(
        &self,
        vars: &crate::engine::vars::Vars<'_>,
        profile: &dyn crate::profile::Profile,
    ) -> u64 {
        self.request.sandboxes(vars, profile)
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        ctx.poll(self, label).await
    }
}

impl Ctx<'_> {
    async fn poll(&mut self, p: &Poll, label: &str) -> Result<(), StepError> {
        let within = Duration::from_secs(u64::try_from(self.vars.num(&p.within_s)?).unwrap_or(0));
        let every = Duration::from_millis(p.every_ms.unwrap_or(200));
        let deadline = Instant::now() + within;
        let client = self.target.client.clone();
        let mut attempts = 0u32;
        // The first reason it did not hold: when later attempts fail differently (the output
        // expired while it was polled, say), the first one is what tells a reader why.
        let mut first: Option<String> = None;
        loop {
            attempts += 1;
            let prepared = self.prepare(&p.request)?;
            let recorded = self.transcript.len();
            let reading = p.request.reading(&self.vars)?;
            let obs = self
                .send_reading(&client, &prepared, label, reading)
                .await?;
            match self.judge(&p.request, &obs) {
                Ok(()) => return Ok(()),
                Err(StepError::Fail(msg)) => {
                    if Instant::now() + every > deadline {
                        return Err(StepError::Fail(not_holding(
                            attempts,
                            within,
                            first.as_deref(),
                            &msg,
                        )));
                    }
                    first.get_or_insert(msg);
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
}

/// Why a poll gave up: the last attempt's reason, and the first one's when it differs.
fn not_holding(attempts: u32, within: Duration, first: Option<&str>, last: &str) -> String {
    let earlier = match first {
        Some(first) if first != last => format!(" (first attempt: {first})"),
        _ => String::new(),
    };
    format!(
        "still not holding after {attempts} attempts in {}s: {last}{earlier}",
        within.as_secs()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poll_that_gives_up_names_the_first_reason_when_it_changed() {
        let within = Duration::from_secs(10);
        assert_eq!(
            not_holding(
                3,
                within,
                Some("/stdout: got \"\""),
                "status 410, expected 200"
            ),
            "still not holding after 3 attempts in 10s: status 410, expected 200 \
             (first attempt: /stdout: got \"\")"
        );
        assert_eq!(
            not_holding(3, within, Some("status 404"), "status 404"),
            "still not holding after 3 attempts in 10s: status 404"
        );
        assert_eq!(
            not_holding(1, within, None, "status 404"),
            "still not holding after 1 attempts in 10s: status 404"
        );
    }
}
