//! A command a test runs to its end and needs to succeed.

use std::process::{Command, Output};

/// Runs `command` to its end and returns its output once it exited 0; panics naming `what`,
/// with the exit status and both streams, when it could not start or did not succeed.
pub fn succeeded(command: &mut Command, what: &str) -> Output {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{what} did not start: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({})\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
