//! `restart`: stops the service the runner launched and starts it again (durability).

use super::StepKind;
use crate::engine::context::{Ctx, StepError};
use crate::scenario::Restart;

impl StepKind for Restart {
    async fn run(&self, ctx: &mut Ctx<'_>, _label: &str) -> Result<(), StepError> {
        ctx.target.restart().await.map_err(StepError::Error)
    }
}
