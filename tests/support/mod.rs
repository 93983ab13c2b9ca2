//! Helpers shared by the runner's integration tests.

pub mod proxy;
