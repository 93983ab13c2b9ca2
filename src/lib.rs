//! The sandspec runner as a library: scenario files, the engine that runs them against a
//! target, the strict SSE client, targets, reports and the command line.
//!
//! # Layout
//!
//! - [`scenario`]: the scenario file model (YAML) and its strict parser. Unknown keys, unknown
//!   variables and malformed IDs are errors that point at `file:line:col`.
//! - [`sse`]: an incremental, spec-strict server-sent events parser over raw bytes, and a
//!   client that reads a stream with timings.
//! - [`connect`]: the Connect protocol's server-stream envelopes (JSON codec), parsed
//!   incrementally and strictly, each framing fault located.
//! - [`engine`]: runs one parsed scenario against a [`target::Target`]: steps, expectations,
//!   captures, the transcript, cleanup, and the outcome.
//! - [`target`]: where scenarios run: the reference server started as a child process, or a
//!   base URL with tokens taken from environment variables.
//! - [`report`]: the run report (outcomes, durations, measurements, transcripts), profile
//!   verdicts and the JUnit XML writer.
//! - [`evidence`]: the evidence receipt, the one sanitizer, the run-folder writer and its
//!   verifier.
//! - [`gate`]: expected failures (`--expected-failures`) and the gate a CI job decides on.
//! - [`live`]: the guard for non-loopback targets, the end-of-run sweep of everything tagged
//!   with the run's ID, and `sandspec sweep` for leftovers of interrupted runs.
//! - [`profile`]: protocol profiles (`--api v1|e2b|mcp|agent-sandbox`), one module each: its
//!   catalog, clause document, credential header, how a target's support is learned, how a
//!   target is set up (a launched service, an MCP server) and how a run is swept.
//! - [`mcp`]: the MCP client session that drives a sandbox MCP server under test over its
//!   stdio (the official `rmcp` SDK), and the transcript of what was exchanged.
//! - [`sdk`]: the SDK version matrix (`--sdk`): real client SDKs installed at pinned versions
//!   run a profile's journeys against the target.
//! - [`cli`]: the arguments of `sandspec run`, `sandspec list` and `sandspec sweep`, and the
//!   exit codes; [`commands`]: what those commands do (`run` as a straight line from the
//!   arguments to a target, a plan, the scheduler and the report).
//!
//! **Architecture Invariant:** the engine talks to a target only over HTTP; it never reaches
//! into the reference server's process or store.
//!
//! **Architecture Invariant:** transcripts never hold a credential: requests record which
//! principal authenticated them, not the token.

pub mod cli;
pub mod commands;
pub mod connect;
pub mod engine;
pub mod evidence;
pub mod gate;
pub mod live;
pub mod mcp;
pub mod profile;
pub mod report;
pub mod scenario;
pub mod sdk;
pub mod sse;
pub mod target;
