//! `restart`: stops the service the runner launched and starts it again (durability).

use serde::Deserialize;

use super::kind::StepKind;
use crate::engine::context::{Ctx, StepError};
use crate::scenario::{CheckCtx, Checker, Located, Pos, Scope};

/// Stop the service under test and start it again, with the same port, principals and
/// directories, once it is healthy. Only a service the runner launched can be restarted: a
/// scenario with this step must `require: [restart]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Restart {
    /// A short name for messages, the transcript and `fails_at` (required: a restart is a
    /// moment the scenario's later steps are read against).
    pub name: Located<String>,
}

impl StepKind for Restart {
    fn label(&self) -> String {
        self.name.value.clone()
    }

    fn check(&self, c: &mut Checker<'_>, _scope: &mut Scope, ctx: &CheckCtx<'_>) {
        if !ctx.requires.contains("restart") {
            c.err(
                Pos::of(&self.name),
                "a `restart` step needs `requires: [restart]` (only a launched service can be restarted)",
            );
        }
    }

    async fn run(&self, ctx: &mut Ctx<'_>, _label: &str) -> Result<(), StepError> {
        ctx.target.restart().await.map_err(StepError::Error)
    }
}
