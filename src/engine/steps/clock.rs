//! `advance_clock`: lets time pass on the target. On a deployment of the scenario's own that
//! advertises `test_clock`, it moves the target's clock (`POST /v1/test/clock`, TC-9.12);
//! anywhere else it waits the time out, within the run's wait budget like a `sleep`.

use std::time::Duration;

use serde::Deserialize;

use super::kind::{StepKind, named, secs};
use crate::engine::context::{Ctx, Prepared, StepError};
use crate::engine::vars::Vars;
use crate::scenario::{CheckCtx, Checker, Method, NumExpr, Principal, Scope, Via};

/// Time passing on the target's clock: `s` seconds (a number or an expression over advertised
/// limits, `retention.events_s + 1`). On a deployment the runner started for the scenario
/// alone, and which advertises `test_clock`, the runner moves the target's clock (TC-9.12);
/// anywhere else it waits the time out, as a `sleep` would.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdvanceClock {
    #[serde(default)]
    pub name: Option<String>,
    pub s: NumExpr,
}

impl StepKind for AdvanceClock {
    fn label(&self) -> String {
        named(self.name.as_deref(), || "advance_clock".to_owned())
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        c.num(&self.s, scope, ctx);
    }

    /// Time waited out, unless the runner moves the target's clock instead.
    fn advertised_wait(&self, vars: &Vars<'_>, clock_movable: bool) -> Option<(String, u64)> {
        if clock_movable {
            return None;
        }
        let seconds = vars.num(&self.s).ok()?;
        Some((
            format!("advance_clock {} = {seconds} s", self.s.expr),
            u64::try_from(seconds).unwrap_or(0),
        ))
    }

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
