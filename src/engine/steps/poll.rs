//! `poll`: one request repeated until its expectations hold or its window closes.

use std::time::{Duration, Instant};

use super::{StepKind, expects_2xx, secs};
use crate::engine::context::{Ctx, StepError};
use crate::scenario::{Poll, Principal};

impl StepKind for Poll {
    fn waits(&self, ctx: &Ctx<'_>) -> Duration {
        secs(ctx.vars.num(&self.within_s)) + ctx.target.request_timeout
    }

    fn expects_success(&self) -> bool {
        expects_2xx(&self.request.expect)
    }

    fn uses_admin(&self) -> bool {
        self.request.principal == Principal::Admin
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
}
