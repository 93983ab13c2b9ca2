//! `advance_clock`: lets time pass on the target. On a deployment of the scenario's own that
//! advertises `test_clock`, it moves the target's clock (`POST /v1/test/clock`, TC-9.12);
//! anywhere else it waits the time out, within the run's wait budget like a `sleep`.

use std::time::Duration;

use super::{StepKind, secs};
use crate::engine::context::{Ctx, Prepared, StepError};
use crate::scenario::{AdvanceClock, Method, Principal, Via};

impl StepKind for AdvanceClock {
    fn waits(&self, ctx: &Ctx<'_>) -> Duration {
        if ctx.target.clock_movable() {
            ctx.target.request_timeout
        } else {
            secs(ctx.vars.num(&self.s))
        }
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        let seconds = ctx.vars.num(&self.s)?;
        let seconds = u64::try_from(seconds).map_err(|_| {
            StepError::Fail(format!(
                "advance_clock {} is {seconds} s: time cannot go back",
                self.s.expr
            ))
        })?;
        if seconds == 0 {
            return Ok(());
        }
        if !ctx.target.clock_movable() {
            tokio::time::sleep(Duration::from_secs(seconds)).await;
            return Ok(());
        }
        let advance_ms = seconds.saturating_mul(1000);
        let body = serde_json::to_vec(&serde_json::json!({ "advance_ms": advance_ms }))
            .expect("a JSON object serializes");
        let p = Prepared {
            envd_host: None,
            via: Via::Primary,
            method: Method::Post,
            target: "/v1/test/clock".into(),
            principal: Principal::Admin,
            headers: Vec::new(),
            literal_auth: false,
            body: Some((body, "application/json".into())),
        };
        let client = ctx.target.client.clone();
        let obs = ctx.send(&client, &p, label).await?;
        if obs.status == 200 {
            Ok(())
        } else {
            Err(StepError::Fail(format!(
                "POST /v1/test/clock {{\"advance_ms\":{advance_ms}}}: status {}, expected 200",
                obs.status
            )))
        }
    }
}
