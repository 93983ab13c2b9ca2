//! `snapshot` and `expect_snapshot_unchanged`: the set of object IDs a principal owns, as
//! the API lists them, taken and compared.

use std::collections::BTreeSet;

use serde::Deserialize;

use super::kind::{StepKind, named};
use crate::engine::context::{Ctx, StepError};
use crate::scenario::{CheckCtx, Checker, Located, Pos, Principal, Scope, SinceName};

/// List everything a principal owns (sandboxes, snapshots) into a named set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// A short name for messages, the transcript and `fails_at`.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(rename = "as", default)]
    pub principal: Principal,
    pub into: Located<String>,
}

/// Compare what a principal owns against an earlier `snapshot`.
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct ExpectSnapshotUnchanged(pub SinceName);

impl StepKind for Snapshot {
    fn label(&self) -> String {
        named(self.name.as_deref(), || "snapshot".to_owned())
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        c.principal(self.principal, Pos::of(&self.into), ctx);
        scope.snapshots.insert(self.into.value.clone());
    }

    fn uses_admin(&self) -> bool {
        self.principal == Principal::Admin
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        let set = ctx.owned(self.principal, label).await?;
        ctx.snapshots
            .insert(self.into.value.clone(), (self.principal, set));
        Ok(())
    }
}

/// `expect_snapshot_unchanged`: what the principal owns equals the snapshot `since`.
impl StepKind for ExpectSnapshotUnchanged {
    fn label(&self) -> String {
        named(self.0.name.as_deref(), || {
            "expect_snapshot_unchanged".to_owned()
        })
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        let since = &self.0.since;
        if ctx.cleanup {
            c.err(
                Pos::of(since),
                format!(
                    "`expect_snapshot_unchanged` cannot be a cleanup step: snapshot `{}` may never have been taken (steps stop at the first failure, every cleanup step runs)",
                    since.value
                ),
            );
        } else if !scope.snapshots.contains(&since.value) {
            c.err(
                Pos::of(since),
                format!("no earlier `snapshot` named `{}`", since.value),
            );
        }
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        let since = &self.0;
        let (principal, before) = ctx.snapshots[&since.since.value].clone();
        let now = ctx.owned(principal, label).await?;
        let added: Vec<_> = now.difference(&before).cloned().collect();
        let removed: Vec<_> = before.difference(&now).cloned().collect();
        if added.is_empty() && removed.is_empty() {
            Ok(())
        } else {
            Err(StepError::Fail(format!(
                "what {principal} owns changed since `{}`: added {added:?}, removed {removed:?}",
                since.since.value
            )))
        }
    }
}

impl Ctx<'_> {
    /// Every object ID `principal` owns: sandboxes, and snapshots when advertised.
    async fn owned(
        &mut self,
        principal: Principal,
        label: &str,
    ) -> Result<BTreeSet<String>, StepError> {
        let client = self.target.client.clone();
        let mut ids = self
            .list_ids(&client, principal, "/v1/sandboxes", label)
            .await?;
        if self.target.capabilities.has("snapshots") {
            ids.extend(
                self.list_ids(&client, principal, "/v1/snapshots", label)
                    .await?,
            );
        }
        Ok(ids)
    }
}
