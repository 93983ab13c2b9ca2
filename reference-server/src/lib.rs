//! The sandspec reference server: a complete, honest implementation of API v1 that the
//! conformance suite runs against, with deliberate defects that can be switched on one at a time.
//!
//! # Layout
//!
//! - [`clock`]: the clock expiry is decided by (real time, moved forward by a test control),
//!   and `now()`, the time every timestamp is taken at.
//! - [`config`]: everything the server is started with (principals, providers, limits,
//!   retention, the store, test controls, defects).
//! - [`defects`]: the negative controls: realistic bugs the suite must catch.
//! - [`domain`]: types and rules of the API (IDs, sandboxes, processes). No HTTP, no SQL.
//! - [`store`]: durable state behind one trait, with SQLite and PostgreSQL implementations
//!   that pass one shared test suite.
//! - [`sandbox`]: providers that run real sandboxes: working directories, process groups,
//!   files confined with capability-based I/O, previews.
//! - [`stream`]: the durable per-stream event log, live wake-ups and the SSE response.
//! - [`gateway`]: the Agents Sessions gateway: sessions, queues, leases, the private bridge
//!   and the worker that runs turns inside each session's sandbox.
//! - `model_fixture` (private): an OpenAI-compatible model server replaying scripted responses.
//! - [`e2b`]: the E2B protocol (control plane and envd) over the same sandboxes.
//! - [`api`]: HTTP handlers, wire types and the one mapping from errors to problem bodies.
//! - [`server`]: `run(listener, config, shutdown)`, TLS, the background reapers, and the router
//!   put together from the areas' routes (`api`, `gateway`, `e2b`).
//! - [`cli`]: the `sandspec serve` command line.

pub mod api;
pub mod cli;
pub mod clock;
pub mod config;
pub mod defects;
pub mod domain;
pub mod e2b;
pub mod gateway;
pub mod mcp;
mod model_fixture;
pub mod sandbox;
pub mod server;
pub mod store;
pub mod stream;
