//! Types and rules of the API: IDs, resources, sandboxes, processes. No HTTP, no SQL.

mod ids;
mod model;

pub use ids::{IdError, IdKind, LocalId, QualifiedId, new_local_id, new_token};
pub use model::*;
