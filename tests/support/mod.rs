//! Helpers shared by the runner's integration tests (`tests/integration.rs`). The conformance
//! harness and the reference server's tests include the one or two they need by path.

pub mod cloud;
pub mod command;
pub mod faulty_proxy;
pub mod hostile;
pub mod http;
pub mod listening;
pub mod mcp_http;
pub mod modules;
pub mod npm;
pub mod owner;
pub mod receipt;
pub mod runtime;
pub mod serve;
pub mod venv;
