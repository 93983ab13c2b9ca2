//! `sleep`: waits a fixed time (for what a target does on its own clock).

use std::time::Duration;

use super::StepKind;
use crate::engine::context::{Ctx, StepError};
use crate::scenario::Sleep;

impl StepKind for Sleep {
    fn waits(&self, _ctx: &Ctx<'_>) -> Duration {
        Duration::from_millis(self.ms.value)
    }

    async fn run(&self, _ctx: &mut Ctx<'_>, _label: &str) -> Result<(), StepError> {
        tokio::time::sleep(Duration::from_millis(self.ms.value)).await;
        Ok(())
    }
}
