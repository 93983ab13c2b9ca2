//! `request`: one HTTP request, judged by its `expect` block, with captures.

use super::{StepKind, expects_2xx};
use crate::engine::context::{Ctx, StepError, with_problem};
use crate::engine::expect::{Observed, capture, check_response, status_ok};
use crate::scenario::{Principal, Request};

impl StepKind for Request {
    fn expects_success(&self) -> bool {
        expects_2xx(&self.expect)
    }

    fn uses_admin(&self) -> bool {
        self.principal == Principal::Admin
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        ctx.request(self, label).await
    }
}

impl Ctx<'_> {
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
        let obs = self.send(&client, &p, label).await?;
        self.judge(r, &obs)
    }
}
