//! `snapshot` and `expect_snapshot_unchanged`: the set of object IDs a principal owns, as
//! the API lists them, taken and compared.

use std::collections::BTreeSet;

use super::StepKind;
use crate::engine::context::{Ctx, StepError};
use crate::scenario::{Principal, SinceName, Snapshot};

impl StepKind for Snapshot {
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
pub(super) struct Unchanged<'s>(pub(super) &'s SinceName);

impl StepKind for Unchanged<'_> {
    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        let since = self.0;
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
