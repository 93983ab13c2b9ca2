//! Build script: records the git commit the runner is built from, so evidence receipts can
//! name the suite's exact source. `SANDSPEC_GIT_COMMIT` set in the environment wins (for
//! builds from a source archive); without git or a repository the receipt says `unknown`.

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=SANDSPEC_GIT_COMMIT");
    if std::env::var_os("SANDSPEC_GIT_COMMIT").is_some() {
        return;
    }
    // Only paths that exist: cargo re-runs the script on every build for a missing one.
    for path in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"] {
        if Path::new(path).exists() {
            println!("cargo::rerun-if-changed={path}");
        }
    }
    let Ok(out) = Command::new("git").args(["rev-parse", "HEAD"]).output() else {
        return;
    };
    let commit = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if out.status.success() && commit.len() == 40 && commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        println!("cargo::rustc-env=SANDSPEC_GIT_COMMIT={commit}");
    }
}
