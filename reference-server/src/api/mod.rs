//! HTTP handlers, wire types, and the one mapping from errors to problem bodies.
//!
//! Architecture invariant: only this module knows status codes and JSON wire shapes, and
//! every store lookup made for a client passes the client's principal as the owner.

pub(crate) mod error;
pub(crate) mod extract;
mod files;
pub(crate) mod idempotency;
pub(crate) mod lookup;
mod meta;
pub(crate) mod pagination;
mod previews;
mod processes;
mod request_id;
mod routes;
pub(crate) mod sandboxes;
mod snapshots;
pub(crate) mod state;

pub use error::{ApiError, Problem};
pub use request_id::RequestId;
pub use routes::{routes, shared_handling};
pub use sandboxes::{destroy as destroy_sandbox, pause_sandbox};
pub use state::{AppState, Inner};
