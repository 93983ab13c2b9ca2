//! Protocol profiles: which API a run speaks (`--api`). Each profile is one module that owns
//! what makes its protocol for the runner ([`Profile`]): [`v1`] (sandspec's own contract),
//! [`e2b`] (E2B's control plane and envd), [`mcp`] (sandbox MCP servers, judged on an E2B
//! control plane) and [`agent_sandbox`] (the Agent Sandbox runtime service). Adding a profile
//! is a module here and a value of [`Api`] with its line in the registry, plus its catalog
//! folder, clause document, fixtures and tests.
//!
//! A profile is not a scenario family: a family is a folder of a profile's catalog
//! (`lifecycle`, `streaming`), chosen with `--family`.

pub mod agent_sandbox;
mod api;
mod binding;
mod clauses;
pub mod e2b;
pub mod mcp;
mod operations;
mod registry;
pub mod v1;

pub use api::Api;
pub use binding::{CapabilitySource, Clauses, CreatedKind, Creation, Defects, Launched, Profile};
pub use clauses::{Clause, ClauseTable, Level, RowLevels, parse_clauses};
pub use operations::{Operation, from_openapi, from_tables, operation_of};
pub use registry::{clause_level, defects_for, profile_folders};
