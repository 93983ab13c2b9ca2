//! The runner's integration tests, one module per file of `tests/`, built and run as one
//! binary: one link instead of eleven, and `cargo test` runs their tests side by side instead
//! of one binary after another. `cargo test --test integration evidence::` runs one file's.
//! The scenario catalog's trials are the other binary, `tests/conformance.rs`.
//!
//! Every `tests/*.rs` is a module here or the conformance harness (the package sets
//! `autotests = false`); `every_test_file_is_built` fails on one that is neither, here and in
//! `reference-server/tests/`.

mod support;

mod agent_sandbox;
mod architecture;
mod bounds;
mod cli_run;
mod cloud;
mod evidence;
mod fuzz;
mod isolation;
mod live;
mod mcp;
mod mcp_servers;
mod multiprocess;
mod report;
mod sdk_matrix;
mod tls;

/// A file of `tests/` that is neither a module of its package's integration binary nor a
/// binary of its own (the packages set `autotests = false`) would never be compiled, and its
/// tests would silently not run.
#[test]
fn every_test_file_is_built() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut strays = Vec::new();
    for (dir, own) in [
        ("tests", "conformance"),
        ("reference-server/tests", "clock"),
    ] {
        let dir = root.join(dir);
        let modules = std::fs::read_to_string(dir.join("integration.rs")).unwrap();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let Some(module) = path
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .strip_suffix(".rs")
            else {
                continue;
            };
            if module != "integration"
                && module != own
                && !modules.contains(&format!("\nmod {module};\n"))
            {
                strays.push(path.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    assert!(
        strays.is_empty(),
        "not built by any test target: {strays:?}"
    );
}
