//! `sandspec evidence diff OLD NEW`: two verified run folders compared for a release review.
//! What regressed and what was fixed, scenarios added or removed, verdicts and the gate that
//! changed, MUST clauses newly covered or no longer covered, and scenarios whose time changed
//! beyond the runs' own spread. Read from the receipts alone, which `evidence verify` checks
//! first: a folder that does not verify is refused.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::receipt::{OutcomeLabel, Receipt, ScenarioResult, Statement};

/// One run of the two, as the diff names it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunRef {
    pub dir: String,
    pub run_id: String,
    pub started_at: String,
    pub suite_commit: String,
    pub target: String,
    /// The verdict of `all`.
    pub verdict: String,
}

/// A scenario whose outcome changed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Change {
    pub id: String,
    pub level: String,
    pub old: OutcomeLabel,
    pub new: OutcomeLabel,
    /// Why it did not plainly pass in the new run.
    pub reason: Option<String>,
}

/// A verdict (of a family, `all`, or the gate) that changed; `None` where the run had none.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VerdictChange {
    pub of: String,
    pub old: Option<String>,
    pub new: Option<String>,
}

/// A scenario whose time changed beyond the runs' own spread.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimeChange {
    pub id: String,
    pub old_ms: u64,
    pub new_ms: u64,
    pub ratio: f64,
}

/// The comparison, as `--json` writes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diff {
    pub old: RunRef,
    pub new: RunRef,
    /// Passed (or flaky) before, failed or errored now.
    pub regressions: Vec<Change>,
    /// Failed or errored before, passed now.
    pub fixes: Vec<Change>,
    /// Every other outcome that changed (a pass now skipped, a failure now flaky, ...).
    pub changed: Vec<Change>,
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub verdicts: Vec<VerdictChange>,
    /// MUST clauses of `docs/protocol.md` a scenario judged in the new run but not the old.
    pub clauses_covered: Vec<String>,
    /// MUST clauses judged in the old run but not the new.
    pub clauses_lost: Vec<String>,
    pub timing: Vec<TimeChange>,
    /// How timing changes were judged: the median of the duration ratios (new/old) of the
    /// scenarios that passed in both, and how far from it a ratio must be to count.
    pub timing_spread: Option<Spread>,
}

/// The runs' own spread of duration ratios.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    pub scenarios: usize,
    pub median_ratio: f64,
    /// A ratio counts when it is beyond `median × factor` or below `median / factor`.
    pub factor: f64,
}

/// A time change counts only when the durations differ by at least this much: shorter
/// scenarios vary with a machine's load more than they tell.
const MIN_TIME_CHANGE_MS: u64 = 1000;

impl Diff {
    /// Reads and verifies both folders, and compares them.
    pub fn of(old_dir: &Path, new_dir: &Path) -> Result<Diff, String> {
        let read = |dir: &Path| {
            super::verify::load_verified(dir)
                .map(|(statement, _)| statement)
                .map_err(|problems| {
                    format!(
                        "{} does not verify, so it cannot be compared:\n  {}",
                        dir.display(),
                        problems.join("\n  ")
                    )
                })
        };
        let old = read(old_dir)?;
        let new = read(new_dir)?;
        Ok(Diff::compare((old_dir, &old), (new_dir, &new)))
    }

    /// Compares two receipts.
    pub fn compare(old: (&Path, &Statement), new: (&Path, &Statement)) -> Diff {
        let (o, n) = (&old.1.predicate, &new.1.predicate);
        let by_id = |r: &Receipt| -> BTreeMap<String, ScenarioResult> {
            r.scenarios
                .iter()
                .map(|s| (s.id.clone(), s.clone()))
                .collect()
        };
        let (before, after) = (by_id(o), by_id(n));
        let mut diff = Diff {
            old: run_ref(old.0, o),
            new: run_ref(new.0, n),
            regressions: Vec::new(),
            fixes: Vec::new(),
            changed: Vec::new(),
            added: after
                .keys()
                .filter(|id| !before.contains_key(*id))
                .cloned()
                .collect(),
            removed: before
                .keys()
                .filter(|id| !after.contains_key(*id))
                .cloned()
                .collect(),
            verdicts: Vec::new(),
            clauses_covered: Vec::new(),
            clauses_lost: Vec::new(),
            timing: Vec::new(),
            timing_spread: None,
        };
        for (id, was) in &before {
            let Some(is) = after.get(id) else { continue };
            if was.outcome == is.outcome {
                continue;
            }
            let change = Change {
                id: id.clone(),
                level: is.level.clone(),
                old: was.outcome,
                new: is.outcome,
                reason: is.reason.clone(),
            };
            use OutcomeLabel::{Error, Fail, Flaky, Pass};
            match (was.outcome, is.outcome) {
                (Pass | Flaky, Fail | Error) => diff.regressions.push(change),
                (Fail | Error, Pass) => diff.fixes.push(change),
                _ => diff.changed.push(change),
            }
        }
        let verdicts = |r: &Receipt| -> BTreeMap<String, String> {
            r.profiles
                .iter()
                .map(|p| (p.profile.clone(), p.verdict.clone()))
                .collect()
        };
        let (vo, vn) = (verdicts(o), verdicts(n));
        let families: BTreeSet<&String> = vo.keys().chain(vn.keys()).collect();
        for family in families {
            let (a, b) = (vo.get(family).cloned(), vn.get(family).cloned());
            if a != b {
                diff.verdicts.push(VerdictChange {
                    of: family.clone(),
                    old: a,
                    new: b,
                });
            }
        }
        let gate = |r: &Receipt| r.gate.as_ref().map(|g| g.result.clone());
        if gate(o) != gate(n) {
            diff.verdicts.push(VerdictChange {
                of: "gate".to_owned(),
                old: gate(o),
                new: gate(n),
            });
        }
        let checked = |r: &Receipt| -> BTreeSet<String> {
            r.coverage
                .clauses
                .iter()
                .filter(|c| c.checked)
                .map(|c| c.clause.clone())
                .collect()
        };
        let (co, cn) = (checked(o), checked(n));
        diff.clauses_covered = cn.difference(&co).cloned().collect();
        diff.clauses_lost = co.difference(&cn).cloned().collect();
        diff.timing(&before, &after);
        diff
    }

    /// Scenarios that passed in both runs whose duration ratio lies beyond the runs' own
    /// spread: more than three scaled median absolute deviations (of the log ratios) from the
    /// median ratio, and at least [`MIN_TIME_CHANGE_MS`] apart.
    fn timing(
        &mut self,
        before: &BTreeMap<String, ScenarioResult>,
        after: &BTreeMap<String, ScenarioResult>,
    ) {
        let pairs: Vec<(&String, u64, u64)> =
            before
                .iter()
                .filter_map(|(id, was)| {
                    let is = after.get(id)?;
                    (was.outcome == OutcomeLabel::Pass && is.outcome == OutcomeLabel::Pass)
                        .then_some((id, was.duration_ms.max(1), is.duration_ms.max(1)))
                })
                .collect();
        if pairs.len() < 3 {
            return;
        }
        let logs: Vec<f64> = pairs
            .iter()
            .map(|(_, a, b)| (*b as f64 / *a as f64).ln())
            .collect();
        let center = median(&logs);
        let deviations: Vec<f64> = logs.iter().map(|l| (l - center).abs()).collect();
        // 1.4826 scales the MAD to a standard deviation for normal data; a floor of ln 1.25
        // keeps a run of identical timings from flagging every small wobble.
        let width = (3.0 * 1.4826 * median(&deviations)).max(1.25f64.ln());
        self.timing_spread = Some(Spread {
            scenarios: pairs.len(),
            median_ratio: center.exp(),
            factor: width.exp(),
        });
        for ((id, a, b), log) in pairs.iter().zip(&logs) {
            if (log - center).abs() > width && a.abs_diff(*b) >= MIN_TIME_CHANGE_MS {
                self.timing.push(TimeChange {
                    id: (*id).clone(),
                    old_ms: *a,
                    new_ms: *b,
                    ratio: *b as f64 / *a as f64,
                });
            }
        }
    }

    /// Whether the new run is worse: a regression, or a verdict (or the gate) that went from
    /// conformant (or pass) to anything else.
    pub fn worse(&self) -> bool {
        !self.regressions.is_empty()
            || self.verdicts.iter().any(|v| {
                matches!(v.old.as_deref(), Some("conformant" | "pass"))
                    && v.new.as_deref() != v.old.as_deref()
            })
    }

    /// The comparison for a reviewer, in Markdown.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let _ = writeln!(md, "# sandspec evidence diff\n");
        let _ = writeln!(md, "| | old | new |\n|---|---|---|");
        for (what, a, b) in [
            ("folder", &self.old.dir, &self.new.dir),
            ("run", &self.old.run_id, &self.new.run_id),
            ("started", &self.old.started_at, &self.new.started_at),
            (
                "suite commit",
                &self.old.suite_commit,
                &self.new.suite_commit,
            ),
            ("target", &self.old.target, &self.new.target),
            ("verdict of all", &self.old.verdict, &self.new.verdict),
        ] {
            let _ = writeln!(md, "| {what} | {} | {} |", cell(a), cell(b));
        }
        let changes = |md: &mut String, title: &str, list: &[Change]| {
            let _ = writeln!(md, "\n## {title} ({})\n", list.len());
            if list.is_empty() {
                md.push_str("none\n");
                return;
            }
            md.push_str("| scenario | level | old | new | reason now |\n|---|---|---|---|---|\n");
            for c in list {
                let _ = writeln!(
                    md,
                    "| {} | {} | {:?} | {:?} | {} |",
                    cell(&c.id),
                    c.level,
                    c.old,
                    c.new,
                    cell(c.reason.as_deref().unwrap_or(""))
                );
            }
        };
        changes(&mut md, "Regressions", &self.regressions);
        changes(&mut md, "Fixes", &self.fixes);
        changes(&mut md, "Other outcome changes", &self.changed);
        let list = |md: &mut String, title: &str, ids: &[String]| {
            let _ = writeln!(md, "\n## {title} ({})\n", ids.len());
            let _ = writeln!(
                md,
                "{}",
                if ids.is_empty() {
                    "none".to_owned()
                } else {
                    ids.join(", ")
                }
            );
        };
        list(&mut md, "Scenarios added", &self.added);
        list(&mut md, "Scenarios removed", &self.removed);
        let _ = writeln!(md, "\n## Verdicts that changed ({})\n", self.verdicts.len());
        if self.verdicts.is_empty() {
            md.push_str("none\n");
        } else {
            md.push_str("| of | old | new |\n|---|---|---|\n");
            for v in &self.verdicts {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} |",
                    cell(&v.of),
                    v.old.as_deref().unwrap_or("(none)"),
                    v.new.as_deref().unwrap_or("(none)")
                );
            }
        }
        list(&mut md, "MUST clauses newly covered", &self.clauses_covered);
        list(
            &mut md,
            "MUST clauses no longer covered",
            &self.clauses_lost,
        );
        let _ = writeln!(
            md,
            "\n## Time beyond the runs' spread ({})\n",
            self.timing.len()
        );
        match &self.timing_spread {
            None => md.push_str("fewer than three scenarios passed in both runs: not judged\n"),
            Some(s) => {
                let _ = writeln!(
                    md,
                    "Over the {} scenarios that passed in both, durations changed by a median factor of {:.2}; a scenario counts when its factor is beyond {:.2}× of that, and it moved by at least {} ms.\n",
                    s.scenarios, s.median_ratio, s.factor, MIN_TIME_CHANGE_MS
                );
                if self.timing.is_empty() {
                    md.push_str("none\n");
                } else {
                    md.push_str("| scenario | old ms | new ms | factor |\n|---|---:|---:|---:|\n");
                    for t in &self.timing {
                        let _ = writeln!(
                            md,
                            "| {} | {} | {} | {:.2} |",
                            cell(&t.id),
                            t.old_ms,
                            t.new_ms,
                            t.ratio
                        );
                    }
                }
            }
        }
        md
    }
}

fn run_ref(dir: &Path, r: &Receipt) -> RunRef {
    RunRef {
        dir: dir.display().to_string(),
        run_id: r.run_id.clone(),
        started_at: r.started_at.clone(),
        suite_commit: r.suite.commit.clone(),
        target: format!("{} ({})", r.target.base_url, r.target.kind),
        verdict: r
            .profiles
            .iter()
            .find(|p| p.profile == crate::report::ALL)
            .map_or_else(String::new, |p| p.verdict.clone()),
    }
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    }
}

/// A Markdown table cell: pipes escaped, line breaks flattened.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace(['\r', '\n'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_odd_and_even_lists() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
