//! Loading scenario files: YAML parsing, then the checks serde cannot make (ID patterns,
//! known capabilities and defects, variables defined before use), all reported as
//! `file:line:col: message`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use regex::Regex;

use super::check::{CheckCtx, Checker, ParseError, Scope, first_line};
use super::model::Scenario;
use super::pos::Pos;
use crate::profile::{Defects, Level};

/// A scenario with where it came from.
#[derive(Debug, Clone)]
pub struct LoadedScenario {
    pub scenario: Scenario,
    pub file: PathBuf,
    /// The folder below the scenarios root, e.g. `lifecycle`: the profile it belongs to.
    pub family: String,
}

impl LoadedScenario {
    pub fn id(&self) -> &str {
        &self.scenario.id.value
    }
}

/// Parses and checks one scenario file's text.
pub fn parse_str(file: &Path, text: &str) -> Result<Scenario, Vec<ParseError>> {
    let scenario: Scenario = serde_saphyr::from_str(text).map_err(|e| {
        let pos = e
            .location()
            .map(|l| Pos {
                line: l.line(),
                col: l.column(),
            })
            .unwrap_or_default();
        vec![ParseError {
            file: file.to_owned(),
            pos,
            message: first_line(&e.to_string()),
        }]
    })?;
    let mut checker = Checker::new(file);
    check_scenario(&mut checker, &scenario);
    if checker.errors.is_empty() {
        let mut scenario = scenario;
        scenario.builtins = checker.builtins;
        Ok(scenario)
    } else {
        checker.errors.sort_by_key(|e| e.pos);
        Err(checker.errors)
    }
}

/// Loads every `*.yaml` file below `root`; the first folder level is the family.
pub fn load_dir(root: &Path) -> Result<Vec<LoadedScenario>, Vec<ParseError>> {
    let (loaded, errors) = load_dir_partial(root);
    if errors.is_empty() {
        Ok(loaded)
    } else {
        Err(errors)
    }
}

/// Loads what it can: the good scenarios (sorted by ID) and every error. A scenario whose
/// ID is a duplicate is reported and left out, as is every file that does not parse.
pub fn load_dir_partial(root: &Path) -> (Vec<LoadedScenario>, Vec<ParseError>) {
    let mut files = Vec::new();
    if let Err(e) = collect_yaml(root, &mut files) {
        let error = ParseError {
            file: root.to_owned(),
            pos: Pos::default(),
            message: format!("cannot read: {e}"),
        };
        return (Vec::new(), vec![error]);
    }
    files.sort();
    let mut loaded = Vec::new();
    let mut errors = Vec::new();
    for file in files {
        let text = match std::fs::read_to_string(&file) {
            Ok(text) => text,
            Err(e) => {
                errors.push(ParseError {
                    file,
                    pos: Pos::default(),
                    message: format!("cannot read: {e}"),
                });
                continue;
            }
        };
        let family = file
            .strip_prefix(root)
            .ok()
            .and_then(|rel| rel.components().next())
            .filter(|_| file.parent() != Some(root))
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .unwrap_or_else(|| "misc".to_owned());
        match parse_str(&file, &text) {
            Ok(scenario) => loaded.push(LoadedScenario {
                scenario,
                file,
                family,
            }),
            Err(mut e) => errors.append(&mut e),
        }
    }
    let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut unique = Vec::with_capacity(loaded.len());
    for s in loaded {
        if let Some(first) = seen.get(s.id()) {
            errors.push(ParseError {
                file: s.file.clone(),
                pos: Pos::of(&s.scenario.id),
                message: format!(
                    "duplicate scenario id `{}` (also in {})",
                    s.id(),
                    first.display()
                ),
            });
        } else {
            seen.insert(s.id().to_owned(), s.file.clone());
            unique.push(s);
        }
    }
    unique.sort_by(|a, b| a.id().cmp(b.id()));
    (unique, errors)
}

fn collect_yaml(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    collect_yaml_in(dir, true, out)
}

/// At the catalog root, the folders of other protocol profiles (`e2b/`) are their own
/// catalogs and are left out.
fn collect_yaml_in(dir: &Path, root: bool, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            let profile_folder = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| crate::profile::profile_folders().any(|f| f == n));
            if !(root && profile_folder) {
                collect_yaml_in(&path, false, out)?;
            }
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(path);
        }
    }
    Ok(())
}

/// The checks of a whole scenario: its ID, clauses, requirements and negative controls, then
/// each step by its kind, in order, with the captures of the steps before it.
fn check_scenario(c: &mut Checker<'_>, s: &Scenario) {
    let id_re = Regex::new(r"^[A-Z][A-Z0-9]*(-[A-Z][A-Z0-9]*)*-[0-9]{3}$").expect("static regex");
    if !id_re.is_match(&s.id.value) {
        c.err(
            Pos::of(&s.id),
            format!("scenario id `{}` must look like `SBX-LIFE-001`", s.id.value),
        );
    }
    if s.clauses.is_empty() {
        c.err(
            Pos::of(&s.id),
            "`clauses` must name at least one protocol clause",
        );
    }
    // Each clause is judged by its own profile's document.
    let mut cites_must = false;
    for clause in &s.clauses {
        match crate::profile::clause_level(&clause.value) {
            Ok(level) => cites_must |= level == Level::Must,
            Err(message) => c.err(Pos::of(clause), message),
        }
    }
    if s.level == Level::Must && !s.clauses.is_empty() && !cites_must {
        c.err(
            Pos::of(&s.clauses[0]),
            "a MUST scenario must cite at least one MUST clause",
        );
    }
    let requires: BTreeSet<&str> = s.requires.iter().map(|r| r.value.as_str()).collect();
    for cap in &s.requires {
        if !crate::target::CAPABILITIES.contains(&cap.value.as_str()) {
            c.err(
                Pos::of(cap),
                format!(
                    "unknown capability `{}` (known: {})",
                    cap.value,
                    crate::target::CAPABILITIES.join(", ")
                ),
            );
        }
    }
    let mut named = BTreeSet::new();
    // A profile judged through a stand-in (a service sandspec did not write) names the
    // stand-in's defects, not the reference server's.
    let defects = crate::profile::defects_for(s.clauses.iter().map(|c| c.value.as_str()));
    let stand_in = matches!(defects, Defects::StandIn(_));
    for control in &s.defects {
        let defect = &control.defect;
        let known = match defects {
            Defects::StandIn(names) => names.contains(&defect.value.as_str()),
            Defects::Reference => defect.value.parse::<sandspec_defects::Defect>().is_ok(),
        };
        if !known {
            c.err(
                Pos::of(defect),
                format!("unknown defect `{}`", defect.value),
            );
        } else if !named.insert(defect.value.as_str()) {
            c.err(
                Pos::of(defect),
                format!("defect `{}` is named twice", defect.value),
            );
        }
        let at = &control.fails_at;
        match s.steps_labelled(&at.value).len() {
            1 => {}
            0 => c.err(
                Pos::of(at),
                format!(
                    "`fails_at: {}` names no step (a step's `name`, or its method and path when it has none)",
                    at.value
                ),
            ),
            n => c.err(
                Pos::of(at),
                format!(
                    "`fails_at: {}` names {n} steps; give the failing one a unique `name`",
                    at.value
                ),
            ),
        }
    }
    // A scenario judged through a stand-in that fails against the real service shows by
    // that that it can fail; `tests/agent_sandbox.rs` requires every MUST one without a
    // defect to.
    if s.level == Level::Must && s.defects.is_empty() && !stand_in {
        c.err(
            Pos::of(&s.id),
            "a MUST scenario must name the defects it catches, each with the step it fails at",
        );
    }
    if s.steps.is_empty() {
        c.err(Pos::of(&s.id), "`steps` must not be empty");
    }
    let mut scope = Scope::default();
    let ctx = CheckCtx {
        requires: &requires,
        cleanup: false,
    };
    for step in &s.steps {
        step.check(c, &mut scope, &ctx);
    }
    // Cleanup may use any capture: a capture that never happened skips the cleanup step.
    let ctx = CheckCtx {
        requires: &requires,
        cleanup: true,
    };
    for step in &s.cleanup {
        step.check(c, &mut scope, &ctx);
    }
}
