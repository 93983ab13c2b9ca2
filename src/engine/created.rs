//! What one scenario run created, as its ledger holds it: each object the run's profile
//! recognised in the target's answers, who created it, and whether the scenario declared that
//! the sweep removes it.

use crate::profile::Creation;
use crate::scenario::Principal;

/// One object the scenario created.
pub(crate) struct Created {
    /// What it is and where: recognised by the run's profile from the target's answer.
    pub creation: Creation,
    /// Who created it, and so who can see it.
    pub principal: Principal,
    /// Created by a `parallel` step marked `removed_by_sweep`: removing it after cleanup is
    /// the scenario's declared plan, not a leak.
    pub by_sweep: bool,
}
