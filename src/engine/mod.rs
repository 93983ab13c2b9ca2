//! The scenario engine: runs a parsed scenario against a target and says what happened.

mod bridge;
mod context;
mod created;
mod expect;
mod ledger;
mod outcome;
mod run;
mod schedule;
pub(crate) mod steps;
mod throttle;
mod transcript;
mod vars;
pub mod waits;

pub use context::{CANARY_HEADER, FaultRecord};
pub use ledger::LEAK_CHECK;
pub use outcome::Outcome;
pub use run::{ScenarioRun, run_scenario, run_with_retries, skip_reason};
pub use schedule::{Pace, default_jobs, run_all, run_until_stopped, sandboxes_of};
pub use throttle::Throttled;
pub use transcript::{Body, Credential, Entry, Frame, HttpExchange, Note, SseExchange};
pub use vars::{VarError, Vars};
