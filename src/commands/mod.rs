//! The runner's commands: `sandspec run`, `sandspec list` and `sandspec sweep`, what a run
//! selects ([`plan`]) and what it prints ([`console`]). Their arguments and exit codes are
//! [`crate::cli`]'s.

pub mod console;
mod list;
pub mod plan;
mod run;
mod sweep;

pub use list::list;
pub use run::{run, run_blocking};
pub use sweep::sweep_blocking;
