//! The runner's integration tests, one module per file of `tests/`, built and run as one
//! binary: one link instead of eleven, and `cargo test` runs their tests side by side instead
//! of one binary after another. `cargo test --test integration evidence::` runs one file's.
//! The scenario catalog's trials are the other binary, `tests/conformance.rs`.
//!
//! Every `tests/*.rs` is a module here or the conformance harness (the package sets
//! `autotests = false`); `every_test_file_is_built` fails on one that is neither.

mod support;

mod agent_sandbox;
mod cli_run;
mod evidence;
mod fuzz;
mod isolation;
mod live;
mod mcp;
mod multiprocess;
mod proxy;
mod report;
mod tls;

/// A file of `tests/` that is neither a module here nor the conformance harness would never be
/// compiled, and its tests would silently not run.
#[test]
fn every_test_file_is_built() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let this = std::fs::read_to_string(root.join("integration.rs")).unwrap();
    let mut strays = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let Some(module) = name.strip_suffix(".rs") else {
            continue;
        };
        if !matches!(module, "integration" | "conformance")
            && !this.contains(&format!("\nmod {module};\n"))
        {
            strays.push(name);
        }
    }
    assert!(
        strays.is_empty(),
        "not built by any test target: {strays:?}"
    );
}
