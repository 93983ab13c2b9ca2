//! The runner's commands: `sandspec run`, `sandspec list` and `sandspec sweep`, what a run
//! selects ([`plan`]) and what it prints ([`console`]), and `sandspec evidence diff` and
//! `merge`. Their arguments and exit codes are
//! [`crate::cli`]'s.

pub mod console;
mod evidence;
mod list;
pub mod plan;
mod run;
mod sweep;

pub use evidence::{diff, merge};
pub use list::list;
pub use run::{run, run_blocking};
pub use sweep::sweep_blocking;
