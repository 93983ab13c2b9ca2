//! The Architecture Invariant lines of `docs/architecture.md` that a test can check, checked
//! over the runner's own source (`src/`): no module imports one that imports it back, no
//! decision on the protocol outside the profile modules, every step kind registered once, and
//! the runner library without the reference server.

use std::path::Path;

use crate::support::modules::Graph;

fn src() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `*.rs` below `dir` with its text, test code left out.
fn sources(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap().to_owned();
            let name = path.strip_prefix(src()).unwrap().display().to_string();
            out.push((name, code));
        }
    }
    out
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let graph = Graph::read(&src());
    assert!(
        graph.edges.len() > 50,
        "the graph was read: {} modules",
        graph.edges.len()
    );
    // The reading follows re-exports: the engine's context is known to use the transcript.
    assert!(
        !graph
            .imports(&["engine", "context"], &["engine", "transcript"])
            .is_empty(),
        "{:?}",
        graph
            .edges
            .get(&vec!["engine".to_owned(), "context".to_owned()])
    );
    assert_eq!(graph.cycles(), Vec::<Vec<String>>::new());
}

/// A ring of three modules is found, and so is a pair, through a `mod.rs` that only
/// re-exports: the check can fail.
#[test]
fn the_cycle_check_sees_a_ring_through_re_exports() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("lib.rs", "mod a;\nmod b;\nmod c;\nmod d;\n");
    write("a/mod.rs", "mod inner;\npub use inner::Thing;\n");
    write(
        "a/inner.rs",
        "use crate::b::Other;\npub struct Thing(Other);\n",
    );
    write(
        "b.rs",
        "pub struct Other;\nfn f() -> crate::c::Third { todo!() }\n",
    );
    write("c.rs", "use crate::a::Thing;\npub struct Third(Thing);\n");
    write(
        "d.rs",
        "use super::a::Thing;\npub struct Fourth;\n#[cfg(test)]\nmod tests { use crate::b::Other; }\n",
    );
    let cycles = Graph::read(dir.path()).cycles();
    assert_eq!(cycles, [vec!["a::inner", "b", "c"]]);
}

/// No module outside `src/profile/` decides anything by which protocol the run speaks: such
/// a decision is a method of the profiles.
#[test]
fn only_the_profile_modules_compare_protocols() {
    let compare = regex::Regex::new(
        r"(==|!=)\s*(crate::profile::)?Api::|Api::\w+\s*(==|!=)|matches!\([^;]*Api::",
    )
    .unwrap();
    let found: Vec<String> = sources(&src())
        .into_iter()
        .filter(|(name, _)| !name.starts_with("profile/"))
        .filter(|(_, code)| compare.is_match(code))
        .map(|(name, _)| name)
        .collect();
    assert_eq!(found, Vec::<String>::new());
    assert!(compare.is_match("if args.api != crate::profile::Api::Mcp {"));
    assert!(compare.is_match("if target.api == Api::E2b {"));
}

/// Every module of `src/engine/steps/` but the trait's own is a step kind with its line in
/// the registry, and every registry line names a module that implements the trait.
#[test]
fn every_step_kind_is_one_module_with_one_registry_line() {
    let steps = src().join("engine/steps");
    let registry = std::fs::read_to_string(src().join("engine/steps.rs")).unwrap();
    let line = regex::Regex::new(r#"(?m)^    "([a-z_]+)" => (\w+)\((\w+)::(\w+)\),$"#).unwrap();
    let lines: Vec<(String, String, String)> = line
        .captures_iter(&registry)
        .map(|c| (c[1].to_owned(), c[3].to_owned(), c[4].to_owned()))
        .collect();
    assert!(lines.len() >= 15, "{lines:?}");
    for entry in std::fs::read_dir(&steps).unwrap() {
        let path = entry.unwrap().path();
        let module = path.file_stem().unwrap().to_str().unwrap().to_owned();
        if module == "kind" {
            continue;
        }
        assert!(
            lines.iter().any(|(_, m, _)| *m == module),
            "src/engine/steps/{module}.rs has no line in the registry"
        );
        assert!(
            registry.contains(&format!("\nmod {module};\n")),
            "src/engine/steps/{module}.rs is not a module of the registry"
        );
    }
    for (key, module, kind) in &lines {
        let text = std::fs::read_to_string(steps.join(format!("{module}.rs"))).unwrap();
        assert!(
            text.contains(&format!("pub struct {kind}"))
                || text.contains(&format!("    {kind} => ")),
            "`{key}`: {module}.rs defines no `{kind}`"
        );
        assert!(
            text.contains(&format!("impl StepKind for {kind} {{"))
                || text.contains("impl StepKind for $step {"),
            "`{key}`: {module}.rs does not implement the step kind for `{kind}`"
        );
    }
}

/// The runner library never uses the reference server's crate: only the binary's `serve`,
/// `mcp` and `worker` commands do (`.ci/run` also checks the dependency tree).
#[test]
fn the_runner_library_does_not_use_the_reference_server() {
    let found: Vec<String> = sources(&src())
        .into_iter()
        .filter(|(name, _)| name != "main.rs")
        .filter(|(_, code)| code.contains("reference_server"))
        .map(|(name, _)| name)
        .collect();
    assert_eq!(found, Vec::<String>::new());
}

/// Every read of what a target sends goes through the one meter of `target/read.rs`: no other
/// module reads a response body, a stream or a child's output by itself, where nothing would
/// bound it.
#[test]
fn every_read_of_a_target_goes_through_the_meter() {
    let unbounded = regex::Regex::new(
        r"\.chunk\(\)|\.bytes\(\)\s*\.await|\.text\(\)\s*\.await|\.json(::<[^>]*>)?\(\)\s*\.await|bytes_stream\(\)|\.next_line\(\)|\.read_to_end\(|\.read_line\(",
    )
    .unwrap();
    let mut found: Vec<String> = sources(&src())
        .into_iter()
        .filter(|(name, _)| name != "target/read.rs")
        .filter(|(_, code)| unbounded.is_match(code))
        .map(|(name, _)| name)
        .collect();
    found.sort();
    // The exceptions: the E2B router passes the target's answers on to an SDK chunk by chunk
    // as they come, keeping none of them (the SDK reads them), and the live guard reads the
    // user's answer from the terminal.
    assert_eq!(found, ["live.rs", "profile/e2b/router.rs"]);
    let live = std::fs::read_to_string(src().join("live.rs")).unwrap();
    assert_eq!(
        unbounded.find_iter(&live).count(),
        1,
        "live.rs reads only stdin"
    );
    for call in [
        "response.bytes().await",
        "let v = r.json::<Value>().await",
        "body.bytes_stream()",
        "lines.next_line().await",
    ] {
        assert!(unbounded.is_match(call), "{call}");
    }
}
