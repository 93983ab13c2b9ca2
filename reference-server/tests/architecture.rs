//! The Architecture Invariants of `docs/architecture.md` about the server's module structure,
//! checked by reading `src/`: `domain` imports nothing else of the crate; `sandbox` reaches
//! no HTTP layer, even through other modules; the modules below the HTTP layers use no HTTP
//! crate; and no file imports from a file that imports it back.
//!
//! The scan is a small tokenizer, not a Rust parser. A file depends on another when it names
//! an item defined there: through a `use`, or a path in the code that starts with `crate`,
//! `super`, `self`, a child module or a name the file imported. Re-exports (`pub use` in a
//! `mod.rs`, globs included) are followed to the file that defines the item.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The modules that speak HTTP: handlers, routes, the SSE response, the server and its
/// command line, and the MCP server's control-plane client.
const HTTP_LAYERS: &[&str] = &[
    "api/",
    "gateway/",
    "e2b/",
    "mcp/",
    "stream/sse.rs",
    "server.rs",
    "cli.rs",
];

#[test]
fn domain_imports_nothing_else_of_the_crate() {
    let graph = Graph::of(&server_src());
    let outside: Vec<_> = graph
        .edges()
        .filter(|(from, to)| from.starts_with("domain/") && !to.starts_with("domain/"))
        .collect();
    assert!(outside.is_empty(), "domain imports {outside:?}");
}

#[test]
fn sandbox_reaches_no_http_layer() {
    let graph = Graph::of(&server_src());
    let sandbox: BTreeSet<&str> = graph
        .files()
        .filter(|f| f.starts_with("sandbox/"))
        .flat_map(|f| reach(&graph.deps, f))
        .collect();
    let http: Vec<_> = sandbox
        .iter()
        .filter(|f| HTTP_LAYERS.iter().any(|h| f.starts_with(h)))
        .collect();
    assert!(http.is_empty(), "sandbox reaches {http:?}");
    assert!(sandbox.contains("store/model.rs"), "{sandbox:?}");
}

/// Status codes, headers and requests are the HTTP layers' alone: below them, nothing names
/// an HTTP crate.
#[test]
fn the_modules_below_the_http_layers_use_no_http_crate() {
    let graph = Graph::of(&server_src());
    let below = [
        "domain/",
        "store/",
        "sandbox/",
        "stream/mod.rs",
        "config.rs",
        "clock.rs",
    ];
    let http_crates = [
        "axum",
        "http",
        "hyper",
        "hyper_util",
        "reqwest",
        "tower",
        "tower_http",
    ];
    let mut wrong = Vec::new();
    for file in graph
        .files()
        .filter(|f| below.iter().any(|b| f.starts_with(b)))
    {
        for name in graph.crates_named(file) {
            if http_crates.contains(&name) {
                wrong.push((file, name));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:?}");
    assert!(graph.crates_named("api/routes.rs").contains("axum"));
}

#[test]
fn no_file_imports_one_that_imports_it_back() {
    let graph = Graph::of(&server_src());
    let cycles = cycles(&graph.deps);
    assert!(cycles.is_empty(), "import cycles: {cycles:#?}");
}

/// The modules of `src/` depend on each other in layers: none imports, from any of its files,
/// a module that imports it back. `server` puts the HTTP areas (`api`, `gateway`, `e2b`)
/// together, so none of them imports another's routes.
#[test]
fn no_module_imports_one_that_imports_it_back() {
    let graph = Graph::of(&server_src());
    let module = |file: &str| file.split(['/', '.']).next().unwrap().to_owned();
    let mut deps = Deps::new();
    for (from, to) in graph.edges() {
        if module(from) != module(to) {
            deps.entry(module(from)).or_default().insert(module(to));
        }
    }
    assert!(
        cycles(&deps).is_empty(),
        "module cycles: {:#?}",
        cycles(&deps)
    );
    assert!(deps["server"].contains("gateway"), "{deps:?}");
}

/// The scan sees what the invariants above rest on: paths in code, `mod.rs` re-exports
/// (named and glob), and the files a `use` names; and it reports a cycle when there is one.
#[test]
fn the_scan_finds_edges_through_re_exports_and_reports_cycles() {
    let graph = Graph::of(&server_src());
    for edge in [
        // `use crate::api::{ApiError, ...}`, re-exported by `api/mod.rs` from `error.rs`.
        ("gateway/sessions.rs", "api/error.rs"),
        // `use crate::domain::{..., Sandbox, ...}`, through `pub use model::*`.
        ("api/sandboxes.rs", "domain/model.rs"),
        // `crate::store::StoreError` in code, re-exported by `store/mod.rs` from `model.rs`.
        ("sandbox/provider.rs", "store/model.rs"),
    ] {
        assert!(graph.edges().any(|e| e == edge), "the scan misses {edge:?}");
    }

    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("lib.rs", "mod a;\nmod b;\nmod c;\n");
    write("a/mod.rs", "mod inner;\npub use inner::*;\n");
    write(
        "a/inner.rs",
        "pub struct A(crate::b::B);\nfn f(_: crate::c::C) {}\n",
    );
    write("b.rs", "use super::a::A;\npub struct B;\n");
    // What comments, strings and characters say is no import, nor is a visibility path or a
    // `use<..>` bound.
    write(
        "c.rs",
        "//! crate::a::A\npub struct C;\nfn f() -> (&'static str, char) { (\"crate::a::A\", '\"') }\n\
         pub(in crate::a) fn g() -> impl Sized + use<> {}\n",
    );
    assert_eq!(
        cycles(&Graph::of(dir.path()).deps),
        vec![vec!["a/inner.rs".to_owned(), "b.rs".to_owned()]]
    );
}

fn server_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// A module path from the crate root, e.g. `["api", "error"]`.
type ModPath = Vec<String>;

/// What one module binds: the items it defines, the names it imports (`use`) and its globs.
#[derive(Default)]
struct Module {
    /// The file it is in, relative to `src/`.
    file: String,
    items: BTreeSet<String>,
    /// An imported name and the path it was imported by, as written.
    uses: BTreeMap<String, ModPathRef>,
    globs: Vec<ModPathRef>,
}

/// A path as written in a module: the module it is written in and its segments.
#[derive(Clone)]
struct ModPathRef {
    scope: ModPath,
    segments: Vec<String>,
}

/// Every module of a crate and, per file, the paths it names.
struct Graph {
    modules: BTreeMap<ModPath, Module>,
    /// Each path named in a file, with the file.
    names: Vec<(String, ModPathRef)>,
    /// The files each file depends on (without itself), from `names`.
    deps: Deps,
}

impl Graph {
    fn of(src: &Path) -> Graph {
        let mut graph = Graph {
            modules: BTreeMap::new(),
            names: Vec::new(),
            deps: BTreeMap::new(),
        };
        for (file, module) in rust_files(src) {
            let text = std::fs::read_to_string(src.join(&file)).unwrap();
            graph.scan(&file, module, &tokens(&text));
        }
        for (file, path) in &graph.names {
            if let Some(to) = graph.resolve(path, 0).filter(|to| to != file) {
                let to = to.to_owned();
                graph.deps.entry(file.clone()).or_default().insert(to);
            }
        }
        graph
    }

    /// Every file-to-file dependency.
    fn edges(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        self.deps
            .iter()
            .flat_map(|(from, tos)| tos.iter().map(move |to| (from.as_str(), to.as_str())))
    }

    /// Every file of the crate.
    fn files(&self) -> impl Iterator<Item = &str> + '_ {
        let files: BTreeSet<&str> = self.modules.values().map(|m| m.file.as_str()).collect();
        files.into_iter()
    }

    /// The first segments of the paths `file` names outside the crate (`std`, `axum`, ...).
    fn crates_named(&self, file: &str) -> BTreeSet<&str> {
        self.names
            .iter()
            .filter(|(f, path)| f == file && self.absolute(path, 0).is_none())
            .map(|(_, path)| path.segments[0].as_str())
            .collect()
    }

    /// Records the modules, items and named paths of one file.
    fn scan(&mut self, file: &str, module: ModPath, tokens: &[String]) {
        // The modules open at this point, with the brace depth inside each.
        let mut scopes = vec![(module.clone(), 0usize)];
        self.modules.entry(module).or_default().file = file.to_owned();
        let mut depth = 0;
        let mut i = 0;
        while i < tokens.len() {
            let (scope, scope_depth) = scopes.last().cloned().unwrap();
            let at = |k: usize| tokens.get(k).map_or("", String::as_str);
            match at(i) {
                "{" => depth += 1,
                "}" => {
                    depth -= 1;
                    if depth < scope_depth {
                        scopes.pop();
                    }
                }
                // `use<..>` after `impl Trait +` captures lifetimes; it imports nothing.
                "use" if at(i + 1) != "<" => {
                    let end = (i..tokens.len()).find(|&k| at(k) == ";").unwrap();
                    let mut leaves = Vec::new();
                    use_tree(&tokens[i + 1..end], &mut Vec::new(), &mut leaves);
                    for (segments, binding) in leaves {
                        let path = ModPathRef {
                            scope: scope.clone(),
                            segments,
                        };
                        let module = self.modules.entry(scope.clone()).or_default();
                        match binding {
                            Binding::Name(name) => _ = module.uses.insert(name, path.clone()),
                            Binding::Glob => module.globs.push(path.clone()),
                            Binding::Unnamed => {}
                        }
                        self.names.push((file.to_owned(), path));
                    }
                    i = end;
                }
                "mod" if is_ident(at(i + 1)) => {
                    let mut child = scope.clone();
                    child.push(at(i + 1).to_owned());
                    if at(i + 2) == "{" {
                        self.modules.entry(child.clone()).or_default().file = file.to_owned();
                        scopes.push((child, depth + 1));
                    } else {
                        self.modules.entry(child).or_default();
                    }
                }
                "fn" | "struct" | "enum" | "trait" | "type" | "const" | "static" | "union"
                    if depth == scope_depth && is_ident(at(i + 1)) =>
                {
                    let module = self.modules.entry(scope.clone()).or_default();
                    module.items.insert(at(i + 1).to_owned());
                }
                "macro_rules" if at(i + 1) == "!" => {
                    // `#[macro_export]` puts a macro at the crate root, wherever it is written.
                    let root = self.modules.entry(Vec::new()).or_default();
                    root.items.insert(at(i + 2).to_owned());
                }
                // `pub(in crate::x)` names where an item is visible, not what it uses.
                "in" if at(i.wrapping_sub(1)) == "(" => {
                    while at(i + 1) != ")" {
                        i += 1;
                    }
                }
                first if is_ident(first) && at(i + 1) == "::" && at(i.wrapping_sub(1)) != "::" => {
                    let mut segments = vec![first.to_owned()];
                    while at(i + 1) == "::" && is_ident(at(i + 2)) {
                        segments.push(at(i + 2).to_owned());
                        i += 2;
                    }
                    self.names
                        .push((file.to_owned(), ModPathRef { scope, segments }));
                }
                _ => {}
            }
            i += 1;
        }
    }

    /// The file that defines what `path` names; `None` outside the crate.
    fn resolve(&self, path: &ModPathRef, hops: u8) -> Option<&str> {
        let absolute = self.absolute(path, hops)?;
        self.find(&absolute, hops).map(|(file, _)| file)
    }

    /// `path` from the crate root, or `None` when it starts outside the crate (`std::`, a
    /// dependency, a local name).
    fn absolute(&self, path: &ModPathRef, hops: u8) -> Option<Vec<String>> {
        let (first, rest) = path.segments.split_first()?;
        let mut base = path.scope.clone();
        match first.as_str() {
            "crate" => base.clear(),
            "self" => {}
            "super" => _ = base.pop(),
            name => {
                let mut child = base.clone();
                child.push(name.to_owned());
                let hops = hops.checked_add(1).filter(|&h| h < 16)?;
                let scope = self.modules.get(&path.scope)?;
                if self.modules.contains_key(&child) {
                    base = child;
                } else if let Some(imported) = scope.uses.get(name) {
                    base = self.absolute(imported, hops)?;
                } else {
                    // A name a glob brought in (`use super::*` in a test module).
                    base = scope.globs.iter().find_map(|glob| {
                        let mut target = self.absolute(glob, hops)?;
                        target.push(name.to_owned());
                        self.find(&target, hops)?.1.then_some(target)
                    })?;
                }
            }
        }
        let mut rest = rest;
        while let Some(("super", more)) = rest.split_first().map(|(s, m)| (s.as_str(), m)) {
            base.pop();
            rest = more;
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// The file that defines the item at `path` (absolute), and whether it was found defined
    /// there rather than only reached (a module's own file for a name it does not define).
    fn find(&self, path: &[String], hops: u8) -> Option<(&str, bool)> {
        let hops = hops.checked_add(1).filter(|&h| h < 16)?;
        let mut module: ModPath = Vec::new();
        for (k, name) in path.iter().enumerate() {
            let mut child = module.clone();
            child.push(name.clone());
            if self.modules.contains_key(&child) {
                module = child;
                continue;
            }
            let here = self.modules.get(&module)?;
            if here.items.contains(name) {
                return Some((&here.file, true));
            }
            let follow = |target: Vec<String>| {
                let whole: Vec<String> = target.into_iter().chain(path[k + 1..].to_vec()).collect();
                self.find(&whole, hops)
            };
            if let Some(imported) = here.uses.get(name) {
                return self.absolute(imported, hops).and_then(follow);
            }
            for glob in &here.globs {
                let Some(mut target) = self.absolute(glob, hops) else {
                    continue;
                };
                target.push(name.clone());
                let whole: Vec<String> = target.into_iter().chain(path[k + 1..].to_vec()).collect();
                if let Some(found @ (_, true)) = self.find(&whole, hops) {
                    return Some(found);
                }
            }
            return Some((&here.file, false));
        }
        Some((&self.modules.get(&module)?.file, true))
    }
}

/// Dependencies: what each file (or module) imports from, itself left out.
type Deps = BTreeMap<String, BTreeSet<String>>;

/// Everything `start` depends on, directly or through others.
fn reach<'a>(deps: &'a Deps, start: &str) -> BTreeSet<&'a str> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![start];
    while let Some(from) = todo.pop() {
        for to in deps.get(from).into_iter().flatten() {
            if seen.insert(to.as_str()) {
                todo.push(to);
            }
        }
    }
    seen
}

/// Each group that imports each other around a ring (the strongly connected components of
/// more than one member), sorted.
fn cycles(deps: &Deps) -> Vec<Vec<String>> {
    let reachable: BTreeMap<&str, BTreeSet<&str>> = deps
        .keys()
        .map(|from| (from.as_str(), reach(deps, from)))
        .collect();
    let mut groups = BTreeSet::new();
    for (&from, from_here) in &reachable {
        let group: Vec<String> = from_here
            .iter()
            .filter(|&&other| reachable.get(other).is_some_and(|r| r.contains(from)))
            .map(|&other| other.to_owned())
            .collect();
        if group.len() > 1 {
            groups.insert(group);
        }
    }
    groups.into_iter().collect()
}

/// What a `use` leaf binds in its module.
enum Binding {
    Name(String),
    Glob,
    /// `as _`: imported for its trait methods only.
    Unnamed,
}

/// The leaves of a use tree (`a::{b, c::d as e, f::*}`) with their full paths.
fn use_tree(tokens: &[String], prefix: &mut Vec<String>, leaves: &mut Vec<(Vec<String>, Binding)>) {
    let depth = prefix.len();
    let mut i = 0;
    while i < tokens.len() {
        let next = tokens.get(i + 1).map(String::as_str);
        match tokens[i].as_str() {
            "{" => {
                let close = matching_brace(tokens, i);
                for part in split_top_level(&tokens[i + 1..close]) {
                    use_tree(part, prefix, leaves);
                }
                i = close;
            }
            "*" => leaves.push((prefix.clone(), Binding::Glob)),
            "as" => {
                let (path, _) = leaves.pop().unwrap();
                let binding = match next {
                    Some("_") => Binding::Unnamed,
                    alias => Binding::Name(alias.unwrap().to_owned()),
                };
                leaves.push((path, binding));
                i += 1;
            }
            // `a::{self, b}`: `a` itself.
            "self" if i == 0 && next.is_none() && depth > 0 => {
                let name = prefix[depth - 1].clone();
                leaves.push((prefix.clone(), Binding::Name(name)));
            }
            segment if is_ident(segment) => {
                prefix.push(segment.to_owned());
                if next != Some("::") {
                    leaves.push((prefix.clone(), Binding::Name(segment.to_owned())));
                }
            }
            _ => {}
        }
        i += 1;
    }
    prefix.truncate(depth);
}

fn matching_brace(tokens: &[String], open: usize) -> usize {
    let mut depth = 0;
    for (k, t) in tokens.iter().enumerate().skip(open) {
        match t.as_str() {
            "{" => depth += 1,
            "}" if depth == 1 => return k,
            "}" => depth -= 1,
            _ => {}
        }
    }
    panic!("unbalanced braces in a use tree")
}

fn split_top_level(tokens: &[String]) -> Vec<&[String]> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (k, t) in tokens.iter().enumerate() {
        match t.as_str() {
            "{" => depth += 1,
            "}" => depth -= 1,
            "," if depth == 0 => {
                parts.push(&tokens[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    parts.push(&tokens[start..]);
    parts.retain(|p| !p.is_empty());
    parts
}

fn is_ident(token: &str) -> bool {
    token
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
}

/// Every `.rs` file below `src` (relative) with its module path; `bin/` holds other crates.
fn rust_files(src: &Path) -> Vec<(String, ModPath)> {
    let mut out = Vec::new();
    let mut todo = vec![src.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(src).unwrap().to_str().unwrap().to_owned();
            if path.is_dir() {
                if rel != "bin" {
                    todo.push(path);
                }
                continue;
            }
            let Some(stem) = rel.strip_suffix(".rs") else {
                continue;
            };
            let mut module: ModPath = stem.split('/').map(str::to_owned).collect();
            if matches!(
                module.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                module.pop();
            }
            out.push((rel, module));
        }
    }
    out.sort();
    out
}

/// The tokens of a Rust file that matter for paths: identifiers, `::` and single punctuation
/// characters. Comments, strings, characters, lifetimes and numbers are dropped.
fn tokens(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let at = |k: usize| chars.get(k).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if at(i) == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if at(i) == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == '"' {
            i = skip_string(&chars, i + 1);
        } else if c == '\'' {
            if at(i + 1) == '\\' {
                // `'\n'`, `'\''`, `'\u{..}'`: past the escaped character, then to the quote.
                i += 3;
                while at(i) != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime or a label: its name is no path.
                i += 1;
                while at(i).is_ascii_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
            }
        } else if c.is_ascii_alphanumeric() || c == '_' {
            let start = i;
            while at(i).is_ascii_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            match (word.as_str(), at(i)) {
                ("b" | "c", '"') => i = skip_string(&chars, i + 1),
                ("b", '\'') => {
                    i += 1;
                    while at(i) != '\'' {
                        i += if at(i) == '\\' { 2 } else { 1 };
                    }
                    i += 1;
                }
                ("r" | "br" | "cr", '"' | '#')
                    if at(i) == '"' || matches!(at(i + 1), '#' | '"') =>
                {
                    let hashes = chars[i..].iter().take_while(|&&h| h == '#').count();
                    i += hashes + 1;
                    let close: Vec<char> = std::iter::once('"')
                        .chain(std::iter::repeat_n('#', hashes))
                        .collect();
                    while chars[i..].iter().take(close.len()).ne(close.iter()) {
                        i += 1;
                    }
                    i += close.len();
                }
                ("r", '#') => {} // a raw identifier: its name follows
                _ if c.is_ascii_digit() => {}
                _ => out.push(word),
            }
        } else if c == ':' && at(i + 1) == ':' {
            out.push("::".to_owned());
            i += 2;
        } else {
            out.push(c.to_string());
            i += 1;
        }
    }
    out
}

/// The index after the closing quote of a string whose body starts at `i`.
fn skip_string(chars: &[char], mut i: usize) -> usize {
    while chars[i] != '"' {
        i += if chars[i] == '\\' { 2 } else { 1 };
    }
    i + 1
}
