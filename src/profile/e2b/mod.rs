//! The E2B profile: E2B's control plane and envd, its SDK journeys, and the router that lets
//! an SDK which knows only E2B's host names reach a target by its URL.

mod binding;
mod journeys;
mod router;

pub use binding::{CLAUSES, E2b, ENVD_PORT, envd_route, file_signature, port_route};
pub(super) use binding::{api_key, created, creates_sandbox, sweep_older_than, sweep_run};
pub use journeys::JOURNEYS;
pub use router::{DOMAIN, Router};
