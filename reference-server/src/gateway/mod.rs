//! The Agents Sessions gateway (§8): sessions with owned or borrowed sandboxes, per-session
//! submission queues, operations, the durable session event log, and the workers that run
//! each session's turns inside its sandbox, talking back over the signed private bridge.
//!
//! # Layout
//!
//! - `artifacts`: the files a turn leaves below `artifacts/`, copied when it ends.
//! - `model`: the stored and wire shapes of sessions, submissions and operations.
//! - `core`: the engine, one type in parts: per-session serialization, persistence and
//!   transitions (`core/mod.rs`), views and artifacts (`views`), the worker launcher
//!   (`launcher`), the supervisor (`supervisor`) and the delete and cleanup state machine
//!   (`cleanup`).
//! - `sessions`, `submissions`, `events`: the `/v1` handlers.
//! - `http`: what the handlers share with `api` (extractors, bodies, idempotent creation,
//!   pages); `lookup`: the caller's sessions, submissions, operations and artifacts by ID.
//! - `routes`: the route table of all of the above.
//! - `bridge`: the private bridge and the session test controls.
//! - [`signing`]: the bridge signature, shared with the worker.
//! - `worker` (private; entered through `cli::worker_main`): the worker runtime that
//!   `sandspec-worker` and `sandspec worker` run inside a sandbox.
//!
//! Its settings (worker binary, model endpoint, lease and cancellation timings) are
//! [`crate::config::GatewayConfig`], part of the server's configuration, where the sandbox
//! provider also reads the worker binary it shows inside sandboxes.
//!
//! Architecture invariant: the gateway changes a session's state only while holding that
//! session's lock, and appends the event reporting a change before releasing it.

mod artifacts;
mod bridge;
mod core;
mod events;
mod http;
mod lookup;
mod model;
mod routes;
mod sessions;
pub mod signing;
mod submissions;
pub(crate) mod worker;

pub use routes::routes;
