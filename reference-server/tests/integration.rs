//! The reference server's integration tests, one module per file of `tests/`, built and run
//! as one binary: one link instead of four, and `cargo test` runs their tests side by side.
//! `cargo test -p reference-server --test integration sessions::` runs one file's. The test
//! clock is one per process, so `tests/clock.rs`, which moves it, is a binary of its own.
//!
//! Every `tests/*.rs` is a module here or `clock.rs` (the package sets `autotests = false`);
//! the runner's `every_test_file_is_built` fails on one that is neither.

mod support;

mod api;
mod architecture;
mod code_interpreter;
mod e2b;
mod sessions;
mod store;
