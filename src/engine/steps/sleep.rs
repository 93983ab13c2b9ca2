//! `sleep`: waits a fixed time (for what a target does on its own clock).

use std::time::Duration;

use serde::Deserialize;

use super::kind::StepKind;
use crate::engine::context::{Ctx, StepError};
use crate::engine::vars::Vars;
use crate::scenario::{CheckCtx, Checker, Located, Pos, Scope};

/// Longest `sleep` a scenario may ask for.
pub const MAX_SLEEP_MS: u64 = 10_000;

/// A bounded pause. Prefer `poll`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sleep {
    pub ms: Located<u64>,
}

impl StepKind for Sleep {
    fn label(&self) -> String {
        "sleep".to_owned()
    }

    fn check(&self, c: &mut Checker<'_>, _scope: &mut Scope, _ctx: &CheckCtx<'_>) {
        if self.ms.value > MAX_SLEEP_MS {
            c.err(
                Pos::of(&self.ms),
                format!("`sleep` is bounded to {MAX_SLEEP_MS} ms; use `poll`"),
            );
        }
    }

    /// A sleep is a wait whatever its length.
    fn advertised_wait(&self, _vars: &Vars<'_>, _clock_movable: bool) -> Option<(String, u64)> {
        Some((
            format!("sleep {} ms", self.ms.value),
            self.ms.value.div_ceil(1000),
        ))
    }

    fn waits(&self, _ctx: &Ctx<'_>) -> Duration {
        Duration::from_millis(self.ms.value)
    }

    async fn run(&self, _ctx: &mut Ctx<'_>, _label: &str) -> Result<(), StepError> {
        tokio::time::sleep(Duration::from_millis(self.ms.value)).await;
        Ok(())
    }
}
