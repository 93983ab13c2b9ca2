//! The scenario engine: runs a parsed scenario against a target and says what happened.

mod bridge;
mod expect;
mod outcome;
mod run;
mod transcript;
mod vars;
pub mod waits;

pub use outcome::Outcome;
pub use run::{LEAK_CHECK, Leftover, ScenarioRun, run_scenario, run_with_retries, skip_reason};
pub use transcript::{Body, Credential, Entry, Frame, HttpExchange, Note, SseExchange};
pub use vars::{VarError, Vars};
