//! The import graph of a crate's source tree, read from its files: which module (a file)
//! uses an item defined in which other one. Imports are followed through re-exports (`pub
//! use`) to the file that defines the item, so that a `mod.rs` which only re-exports stands
//! for nothing itself. Test code (from a file's first `#[cfg(test)]` on) and comments are
//! left out. Good enough for the house's formatting (rustfmt, one item per `use` path), not
//! a Rust parser.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use regex::Regex;

/// A module: its path from the crate root, `["engine", "steps", "request"]`.
pub type Module = Vec<String>;

/// The crate below `src`: every module's text (code only) and the modules it imports from.
pub struct Graph {
    text: BTreeMap<Module, String>,
    pub edges: BTreeMap<Module, BTreeSet<Module>>,
}

static USE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);").unwrap());
static PATH: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b(?:crate|super)(?:::[A-Za-z_][A-Za-z0-9_]*)+").unwrap());
static VISIBILITY: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"pub\(in [^)]*\)").unwrap());

impl Graph {
    pub fn read(src: &Path) -> Graph {
        let mut text = BTreeMap::new();
        // `main.rs` is the binary, a crate of its own beside the library.
        for file in rust_files(src)
            .into_iter()
            .filter(|f| !f.ends_with("main.rs"))
        {
            let raw = std::fs::read_to_string(&file).unwrap();
            let code = raw.split("#[cfg(test)]").next().unwrap_or_default();
            let code: String = code
                .lines()
                .map(|l| l.split("//").next().unwrap_or_default())
                .collect::<Vec<_>>()
                .join("\n");
            text.insert(
                module_of(src, &file),
                VISIBILITY.replace_all(&code, "pub").into(),
            );
        }
        let mut graph = Graph {
            text,
            edges: BTreeMap::new(),
        };
        let modules: Vec<Module> = graph.text.keys().cloned().collect();
        for m in modules {
            let mut found = BTreeSet::new();
            for path in graph.paths(&m) {
                if let Some(to) = graph.resolve(&path, 0)
                    && to != m
                    && !to.is_empty()
                {
                    found.insert(to);
                }
            }
            graph.edges.insert(m, found);
        }
        graph
    }

    /// Every item path module `m` names, made absolute: its `use` paths and the `crate::` and
    /// `super::` paths in its code.
    fn paths(&self, m: &Module) -> Vec<Vec<String>> {
        let text = &self.text[m];
        let mut out = Vec::new();
        for (_, used) in uses(text) {
            out.extend(self.absolute(m, &used));
        }
        for found in PATH.find_iter(text) {
            let rest = &text[found.end()..];
            if rest.starts_with("::{") || rest.starts_with("::*") {
                continue;
            }
            out.extend(self.absolute(m, found.as_str()));
        }
        out
    }

    /// `path` as seen from module `m`, from the crate root; `None` for another crate's.
    fn absolute(&self, m: &Module, path: &str) -> Option<Vec<String>> {
        let segs: Vec<String> = path.split("::").map(|s| s.trim().to_owned()).collect();
        let mut base = m.clone();
        let mut rest = segs.as_slice();
        match rest.first().map(String::as_str) {
            Some("crate") => return Some(rest[1..].to_vec()),
            Some("self") => rest = &rest[1..],
            Some("super") => {
                while rest.first().map(String::as_str) == Some("super") {
                    base.pop();
                    rest = &rest[1..];
                }
            }
            Some(first) => {
                let mut child = base.clone();
                child.push(first.to_owned());
                if !self.text.contains_key(&child) {
                    return None;
                }
            }
            None => return None,
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// The module that defines what `path` names: its longest prefix that is a module, and
    /// then the item's definition there, or where a `pub use` of it leads.
    fn resolve(&self, path: &[String], depth: usize) -> Option<Module> {
        if depth > 10 {
            return None;
        }
        for split in (1..=path.len()).rev() {
            let module = path[..split].to_vec();
            let Some(text) = self.text.get(&module) else {
                continue;
            };
            let Some(name) = path.get(split) else {
                return Some(module);
            };
            if name == "*" || defines(text, name) {
                return Some(module);
            }
            for (public, used) in uses(text) {
                let Some(target) = public.then(|| self.absolute(&module, &used)).flatten() else {
                    continue;
                };
                let last = target.last().map(String::as_str);
                if last == Some(name.as_str()) {
                    return self.resolve(&target, depth + 1);
                }
                if last == Some("*") {
                    let mut through = target[..target.len() - 1].to_vec();
                    through.push(name.clone());
                    if let Some(found) = self.resolve(&through, depth + 1) {
                        return Some(found);
                    }
                }
            }
            return Some(module);
        }
        None
    }

    /// The strongly connected parts of the graph with more than one module: each is a set of
    /// modules that import each other around a ring.
    pub fn cycles(&self) -> Vec<Vec<String>> {
        let nodes: Vec<&Module> = self.edges.keys().collect();
        let index: BTreeMap<&Module, usize> =
            nodes.iter().enumerate().map(|(i, m)| (*m, i)).collect();
        let adjacency: Vec<Vec<usize>> = nodes
            .iter()
            .map(|m| {
                self.edges[*m]
                    .iter()
                    .filter_map(|to| index.get(to).copied())
                    .collect()
            })
            .collect();
        strongly_connected(&adjacency)
            .into_iter()
            .filter(|part| part.len() > 1)
            .map(|part| {
                let mut names: Vec<String> = part.iter().map(|&i| nodes[i].join("::")).collect();
                names.sort();
                names
            })
            .collect()
    }

    /// Whether module `from` (or one below it) imports anything from module `to` (or below).
    pub fn imports(&self, from: &[&str], to: &[&str]) -> Vec<String> {
        let within = |m: &Module, root: &[&str]| {
            m.len() >= root.len() && m.iter().zip(root).all(|(a, b)| a == b)
        };
        self.edges
            .iter()
            .filter(|(m, _)| within(m, from))
            .flat_map(|(m, to_set)| {
                to_set
                    .iter()
                    .filter(|t| within(t, to))
                    .map(move |t| format!("{} -> {}", m.join("::"), t.join("::")))
            })
            .collect()
    }
}

/// Tarjan's algorithm, iteratively deep enough for a source tree.
fn strongly_connected(adjacency: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        adjacency: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State<'_>, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in &s.adjacency[v] {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut part = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                part.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(part);
        }
    }
    let n = adjacency.len();
    let mut s = State {
        adjacency,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The `use` paths of a module's text, each with whether it is a re-export, braces expanded.
fn uses(text: &str) -> Vec<(bool, String)> {
    USE.captures_iter(text)
        .flat_map(|c| {
            let public = c.get(1).is_some();
            expand(&c[2]).into_iter().map(move |p| (public, p))
        })
        .collect()
}

/// `a::{b, c::{d, e}}` as `a::b`, `a::c::d`, `a::c::e`; renames (`as x`) dropped.
fn expand(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        let plain = tree.split(" as ").next().unwrap_or(tree).trim();
        return vec![plain.to_owned()];
    };
    let prefix = &tree[..open];
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, ch) in inner.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(|p| expand(p).into_iter().map(|e| format!("{prefix}{e}")))
        .map(|p| p.trim_end_matches("::self").to_owned())
        .collect()
}

/// Whether a module's text defines an item called `name`.
fn defines(text: &str, name: &str) -> bool {
    let item = Regex::new(&format!(
        r"\b(?:fn|struct|enum|trait|const|static|type|mod)\s+{}\b|macro_rules!\s*{}\b",
        regex::escape(name),
        regex::escape(name)
    ))
    .unwrap();
    item.is_match(text)
}

/// Every `*.rs` below `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// `src/engine/steps/request.rs` is `engine::steps::request`; `mod.rs`, `lib.rs` and
/// `main.rs` stand for their folder.
fn module_of(src: &Path, file: &Path) -> Module {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Module = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}
