//! The scenario engine: runs a parsed scenario against a target and says what happened.

mod bridge;
mod context;
mod expect;
mod ledger;
mod outcome;
mod run;
mod steps;
mod transcript;
mod vars;
pub mod waits;

pub use context::{CANARY_HEADER, FaultRecord};
pub use ledger::{LEAK_CHECK, Leftover};
pub use outcome::Outcome;
pub use run::{ScenarioRun, run_scenario, run_with_retries, skip_reason};
pub use transcript::{Body, Credential, Entry, Frame, HttpExchange, Note, SseExchange};
pub use vars::{VarError, Vars};
