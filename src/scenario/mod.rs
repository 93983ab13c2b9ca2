//! Scenario files: the model, `{{var}}` templates, the strict parser, and the protocol
//! clauses a scenario may cite.

mod clauses;
mod model;
mod parse;
mod template;

pub use clauses::{Clause, PROTOCOL_MD, clause, must_clauses, parse_clauses, protocol_clauses};
pub use model::*;
pub use parse::{
    CAPABILITIES, FEATURES, LIMIT_KEYS, LoadedScenario, MAX_SLEEP_MS, ParseError, RETENTION_KEYS,
    load_dir, load_dir_partial, parse_str,
};
pub use template::{Atom, Expr, Op, Part, Template, is_var_name, parse_parts};

#[cfg(test)]
mod tests;
