//! What a run will run: the profile's catalog, the selection out of it (`--family`,
//! `--filter`, `--shard`), what the verdicts speak for, and the scenarios that do not apply
//! to the target and are left out, said so.

use std::collections::{BTreeMap, BTreeSet};

use crate::cli::Shard;
use crate::report::{NotApplicable, RunFacts};
use crate::scenario::LoadedScenario;
use crate::target::Target;

/// How the run selects scenarios from its profile's catalog.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// A family (a folder of the catalog), or `all`.
    pub family: String,
    /// Any of these texts in a scenario's ID, title, family or tags selects it (none: all).
    pub filters: Vec<String>,
    pub shard: Option<Shard>,
    /// `--certify`: the whole catalog, and not-applicable scenarios are not left out.
    pub certify: bool,
    /// The run adds SDK journeys (`--sdk`), the family `sdk`, which is not in the catalog:
    /// `--family sdk` selects them alone.
    pub journeys: bool,
}

/// The family of SDK journeys, which a run with `--sdk` adds to the catalog's.
pub const SDK_FAMILY: &str = "sdk";

/// The scenarios a run runs, and what its verdicts speak for.
#[derive(Debug)]
pub struct RunPlan {
    /// What runs, in ID order.
    pub selected: Vec<LoadedScenario>,
    /// Selected scenarios left out because they do not apply to the target.
    pub not_applicable: Vec<NotApplicable>,
    /// The selection and the catalog, family by family, for the verdicts' scope.
    pub facts: RunFacts,
    /// SDK journeys run beside the selected scenarios.
    pub journeys: bool,
}

impl RunPlan {
    /// The selection out of `catalog`; a usage error when it names an unknown family,
    /// narrows a certification run, or selects nothing.
    pub fn select(catalog: &[LoadedScenario], selection: &Selection) -> Result<RunPlan, String> {
        if selection.certify
            && (!selection.filters.is_empty()
                || selection.shard.is_some()
                || selection.family != "all")
        {
            return Err(
                "--certify runs the whole catalog: drop --filter, --shard and --family".into(),
            );
        }
        let families: BTreeSet<&str> = catalog.iter().map(|s| s.family.as_str()).collect();
        let journeys_alone = selection.journeys && selection.family == SDK_FAMILY;
        if selection.journeys && !journeys_alone && selection.family != "all" {
            return Err(format!(
                "--sdk runs the family `{SDK_FAMILY}`: with --family {} it would not run (use --family all or --family {SDK_FAMILY})",
                selection.family
            ));
        }
        if selection.family != "all"
            && !journeys_alone
            && !families.contains(selection.family.as_str())
        {
            let mut known: Vec<&str> = families.iter().copied().collect();
            if selection.journeys {
                known.push(SDK_FAMILY);
            }
            return Err(format!(
                "unknown family `{}` (known: all, {})",
                selection.family,
                known.join(", ")
            ));
        }
        let selected: Vec<LoadedScenario> = catalog
            .iter()
            .filter(|_| !journeys_alone)
            .filter(|s| selection.family == "all" || s.family == selection.family)
            .filter(|s| matches_filters(s, &selection.filters))
            .cloned()
            .collect();
        let selected = select_shard(selected, selection.shard);
        if selected.is_empty() && !selection.journeys {
            return Err("no scenario selected".into());
        }
        // What the verdicts speak for: the selection out of the catalog, family by family.
        let per_family = |list: &mut dyn Iterator<Item = &LoadedScenario>| {
            let mut counts: BTreeMap<String, usize> =
                families.iter().map(|f| ((*f).to_owned(), 0)).collect();
            for s in list {
                *counts.entry(s.family.clone()).or_default() += 1;
            }
            counts
        };
        let facts = RunFacts {
            certify: selection.certify,
            selected: per_family(&mut selected.iter()),
            catalog: per_family(&mut catalog.iter()),
            ..RunFacts::default()
        };
        Ok(RunPlan {
            selected,
            not_applicable: Vec::new(),
            facts,
            journeys: selection.journeys,
        })
    }

    /// Leaves out the selected scenarios that cannot apply to `target`, each named on stderr
    /// with the way to run it, and recorded in the report and the receipt: they are not
    /// skipped, which would make a correct target's run partial, and they do not count as
    /// passed either. A usage error when nothing is left to run, SDK journeys included.
    pub fn drop_not_applicable(&mut self, target: &Target) -> Result<(), String> {
        let mut rest = Vec::new();
        for s in std::mem::take(&mut self.selected) {
            let Some(reason) = not_applicable(target, &s) else {
                rest.push(s);
                continue;
            };
            eprintln!("not applicable: {} {reason}", s.id());
            self.not_applicable.push(NotApplicable {
                id: s.id().to_owned(),
                reason: reason.to_owned(),
            });
        }
        if rest.is_empty() && !self.journeys {
            return Err(
                "no scenario selected: no selected scenario applies to this target (see above)"
                    .into(),
            );
        }
        self.selected = rest;
        Ok(())
    }
}

/// Why a scenario cannot apply to the target as the run reaches it, if it cannot: what it
/// needs is a part of the deployment the run does not have (a second server process, a
/// database server), or control over the target's processes that only a target the runner
/// started gives. Each reason names the way to run it.
fn not_applicable(target: &Target, s: &LoadedScenario) -> Option<&'static str> {
    let needs = |cap: &str| s.scenario.requires.iter().any(|r| r.value == cap);
    match target.kind {
        "reference" if needs("peer") && target.peer.is_none() => {
            Some("needs a peer; the reference server has one only on PostgreSQL (--database-url)")
        }
        "reference" if needs("database_control") && !target.database_controllable() => Some(
            "stops and starts the database; the reference server has a database server only on PostgreSQL (--database-url)",
        ),
        "reference" => None,
        _ if needs("database_control") => Some(
            "stops and starts the target's database, which the runner does only to the reference server it starts on PostgreSQL (--database-url)",
        ),
        _ if needs("peer") && target.peer.is_none() => {
            Some("needs a second server process of the same deployment: name it with --peer-url")
        }
        _ if (needs("server_control") || needs("restart")) && !target.can_restart() => Some(
            "kills and restarts the target's server, which the runner does only to one it starts: the reference server, or the service under test with --launch",
        ),
        _ => None,
    }
}

/// Prints each error of a catalog that does not parse, `file:line:col: message`.
pub fn print_parse_errors(errors: &[crate::scenario::ParseError]) {
    for e in errors {
        eprintln!("error: {e}");
    }
}

/// Whether a scenario matches any filter (no filters: everything matches).
pub fn matches_filters(s: &LoadedScenario, filters: &[String]) -> bool {
    filters.is_empty()
        || filters.iter().any(|f| {
            let f = f.to_lowercase();
            let sc = &s.scenario;
            sc.id.value.to_lowercase().contains(&f)
                || sc.title.to_lowercase().contains(&f)
                || s.family.to_lowercase().contains(&f)
                || sc.tags.iter().any(|t| t.to_lowercase().contains(&f))
        })
}

/// Selects the scenarios of one shard: positions `index-1, index-1+n, ...` of the list
/// sorted by ID, so shards are disjoint and together cover the list.
pub fn select_shard<T>(items: Vec<T>, shard: Option<Shard>) -> Vec<T> {
    match shard {
        None => items,
        Some(Shard { index, count }) => items
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % count == index - 1)
            .map(|(_, s)| s)
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_disjoint_and_cover_everything() {
        let items: Vec<u32> = (0..11).collect();
        let mut seen = Vec::new();
        for index in 1..=3 {
            let part = select_shard(items.clone(), Some(Shard { index, count: 3 }));
            assert!(part.len() == 3 || part.len() == 4);
            seen.extend(part);
        }
        seen.sort_unstable();
        assert_eq!(seen, items);
        assert_eq!(
            select_shard(items.clone(), Some(Shard { index: 2, count: 3 })),
            vec![1, 4, 7, 10]
        );
        assert_eq!(select_shard(items.clone(), None), items);
    }
}
