//! Scenario files: the model, `{{var}}` templates, the strict parser and the checks it makes.
//! Each step kind's own model and checks live with its run, in `crate::engine::steps`; the
//! parts they share are here.

mod check;
mod fields;
mod model;
mod parse;
mod pos;
mod template;

pub use crate::engine::steps::{
    Absent, AdvanceClock, BridgeSignature, Connect, Digest, EventCheck, ExpectDigestUnchanged,
    ExpectSnapshotUnchanged, Fault, KillServer, Mcp, Parallel, Poll, Request, Restart,
    RestartServer, Sleep, Snapshot, Sse, StartDatabase, Step, StopDatabase, Tally, Until,
};
pub use check::{CheckCtx, Checker, LIMIT_KEYS, ParseError, RETENTION_KEYS, Scope, first_line};
pub use fields::{
    Capture, Expect, HeaderCheck, JsonCheck, Method, NumExpr, Principal, SinceName, Via, present,
};
pub use model::{DefectRef, Scenario, step_label};
pub use parse::{LoadedScenario, load_dir, load_dir_partial, parse_str};
pub use pos::{Located, Pos};
pub use template::{Atom, Expr, Op, Part, Template, is_var_name, parse_parts};

pub use crate::profile::Level;

#[cfg(test)]
mod tests;
