//! HTTP handlers, wire types, and the one mapping from errors to problem bodies.
//!
//! Architecture invariant: only the HTTP areas (this module, the gateway's handlers and `e2b`)
//! know status codes and headers, and every ID a client sends is resolved with the client's
//! principal as the owner (`lookup`).

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
