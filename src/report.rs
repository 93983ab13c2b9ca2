//! The run report (what the evidence writer consumes), profile verdicts, and JUnit XML.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::engine::{Entry, Outcome, ScenarioRun};
use crate::live::Leftover;
use crate::scenario::{Level, LoadedScenario};

/// One scenario's result with its catalog metadata.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    pub id: String,
    pub title: String,
    pub family: String,
    pub file: String,
    pub level: Level,
    pub clauses: Vec<String>,
    pub tags: Vec<String>,
    pub defects: Vec<String>,
    pub outcome: Outcome,
    /// Milliseconds from the run's start to the scenario's start.
    pub started_ms: u64,
    pub duration_ms: u64,
    pub attempts: u32,
    pub measurements: BTreeMap<String, f64>,
    /// What the scenario's leak check found, and whether the sweep then removed it.
    pub swept: Vec<Leftover>,
    /// The faults the scenario injected, with what was checked after each.
    pub faults: Vec<crate::engine::FaultRecord>,
    /// The throttling answers it waited out.
    pub throttled: crate::engine::Throttled,
    pub transcript: Vec<Entry>,
}

impl ScenarioReport {
    pub fn new(s: &LoadedScenario, run: ScenarioRun) -> Self {
        let sc = &s.scenario;
        ScenarioReport {
            id: sc.id.value.clone(),
            title: sc.title.clone(),
            family: s.family.clone(),
            file: s.file.display().to_string(),
            level: sc.level,
            clauses: sc.clauses.iter().map(|c| c.value.clone()).collect(),
            tags: sc.tags.clone(),
            defects: sc.defects.iter().map(|d| d.defect.value.clone()).collect(),
            outcome: run.outcome,
            started_ms: run.started_ms,
            duration_ms: run.duration_ms,
            attempts: run.attempts,
            measurements: run.measurements,
            swept: run.swept,
            faults: run.faults,
            throttled: run.throttled,
            transcript: run.transcript,
        }
    }
}

/// A profile's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// Every MUST scenario ran and passed on its first attempt.
    Conformant,
    /// No MUST failed, but one was skipped or passed only on retry, or the run was stopped
    /// before every selected scenario ran.
    Partial,
    /// A MUST failed or errored, the run left something behind or could not confirm it left
    /// nothing, or (with `--certify`) something skipped.
    NonConformant,
    /// No MUST scenario of it ran (each was skipped, with its reason): nothing was judged,
    /// which is not conformance either.
    NotTested,
}

impl Verdict {
    /// The word the receipt and every report use.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Conformant => "conformant",
            Verdict::Partial => "partial",
            Verdict::NonConformant => "non-conformant",
            Verdict::NotTested => "not-tested",
        }
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How much of the catalog a verdict speaks for: the scenarios the selection (`--profile`,
/// `--filter`, `--shard`) chose, out of those the catalog holds, both within the profile.
/// Scenarios left out as not applicable, or never run after an interruption, were selected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Scope {
    pub selected: usize,
    pub catalog: usize,
}

impl Scope {
    /// The verdict covers only part of the catalog and must say so.
    pub fn is_subset(&self) -> bool {
        self.selected < self.catalog
    }

    /// `subset: 3 of 95 scenarios`, or nothing for the whole catalog.
    pub fn qualifier(&self) -> Option<String> {
        self.is_subset()
            .then(|| format!("subset: {} of {} scenarios", self.selected, self.catalog))
    }
}

/// A verdict with its scope: `conformant`, or `conformant (subset: 3 of 95 scenarios)`.
pub fn verdict_line(verdict: &str, scope: Scope) -> String {
    match scope.qualifier() {
        Some(q) => format!("{verdict} ({q})"),
        None => verdict.to_owned(),
    }
}

/// Counts and verdict for one scenario family (or `all` of them).
#[derive(Debug, Clone, Serialize)]
pub struct FamilyVerdict {
    pub profile: String,
    pub verdict: Verdict,
    pub reason: Option<String>,
    pub counts: BTreeMap<&'static str, usize>,
    pub must_run: usize,
    pub scope: Scope,
}

impl FamilyVerdict {
    /// The verdict as printed: `conformant (subset: 3 of 95 scenarios)`; a conformant one
    /// with SHOULD failures names them, `conformant, 2 SHOULD failed: A, B`.
    pub fn line(&self) -> String {
        match (&self.verdict, &self.reason) {
            (Verdict::Conformant, Some(reason)) => {
                verdict_line(&format!("conformant, {reason}"), self.scope)
            }
            _ => verdict_line(self.verdict.as_str(), self.scope),
        }
    }
}

/// One scenario as the verdict rules see it. The receipt holds exactly this much of every
/// scenario, so `evidence verify` can judge a run folder again with the same rules.
#[derive(Debug, Clone, Copy)]
pub struct Judged<'a> {
    pub id: &'a str,
    pub family: &'a str,
    pub level: Level,
    pub outcome: Label,
}

/// An outcome without its details: what a verdict depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Label {
    Pass,
    Flaky,
    Skip,
    Fail,
    Error,
}

impl Label {
    pub fn of(outcome: &Outcome) -> Label {
        match outcome {
            Outcome::Pass => Label::Pass,
            Outcome::Flaky { .. } => Label::Flaky,
            Outcome::Skip { .. } => Label::Skip,
            Outcome::Fail { .. } => Label::Fail,
            Outcome::Error { .. } => Label::Error,
        }
    }

    /// `PASS`, `FLAKY`, ...: the keys of a profile's counts.
    pub fn as_str(self) -> &'static str {
        match self {
            Label::Pass => "PASS",
            Label::Flaky => "FLAKY",
            Label::Skip => "SKIP",
            Label::Fail => "FAIL",
            Label::Error => "ERROR",
        }
    }
}

/// What the verdicts depend on besides the scenario outcomes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunFacts {
    /// `--certify`: any skip is non-conformant.
    pub certify: bool,
    /// Selected scenarios that never ran (the run was interrupted).
    pub never_ran: usize,
    /// What ended the run before they ran was its sandbox-seconds budget
    /// (`--max-sandbox-seconds`), not an interrupt.
    pub budget_ended: bool,
    /// Scenarios the selection chose, per family (not-applicable and never-run ones included).
    pub selected: BTreeMap<String, usize>,
    /// Scenarios of the whole catalog, per family.
    pub catalog: BTreeMap<String, usize>,
    /// What the end-of-run sweep found still tagged with the run's ID after every scenario:
    /// each a cleanup failure of the run.
    pub left_behind: usize,
    /// Why the end-of-run sweep could not finish: then the run cannot confirm it left
    /// nothing behind.
    pub sweep_error: Option<String>,
}

impl RunFacts {
    /// A run of the whole catalog that consisted of exactly these scenarios.
    pub fn whole_catalog<'a>(families: impl IntoIterator<Item = &'a str>) -> RunFacts {
        let mut selected: BTreeMap<String, usize> = BTreeMap::new();
        for f in families {
            *selected.entry(f.to_owned()).or_default() += 1;
        }
        RunFacts {
            catalog: selected.clone(),
            selected,
            ..RunFacts::default()
        }
    }

    fn scope(&self, family: Option<&str>) -> Scope {
        let count = |m: &BTreeMap<String, usize>| match family {
            Some(f) => m.get(f).copied().unwrap_or(0),
            None => m.values().sum(),
        };
        Scope {
            selected: count(&self.selected),
            catalog: count(&self.catalog),
        }
    }
}

/// Judges the scenarios of one profile. The verdict rules live here and nowhere else: the
/// run, and `evidence verify` re-judging a folder, both call it.
pub fn verdict(profile: &str, scenarios: &[Judged<'_>], facts: &RunFacts) -> FamilyVerdict {
    let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();
    for s in scenarios {
        *counts.entry(s.outcome.as_str()).or_default() += 1;
    }
    let ids = |level: Option<Level>, labels: &[Label]| -> Vec<&str> {
        scenarios
            .iter()
            .filter(|s| level.is_none_or(|l| s.level == l) && labels.contains(&s.outcome))
            .map(|s| s.id)
            .collect()
    };
    let must = Some(Level::Must);
    let must_run = scenarios
        .iter()
        .filter(|s| s.level == Level::Must && s.outcome != Label::Skip)
        .count();
    let failed = ids(must, &[Label::Fail, Label::Error]);
    let skipped = ids(None, &[Label::Skip]);
    let must_skipped = ids(must, &[Label::Skip]);
    let flaky = ids(must, &[Label::Flaky]);
    // Cleanup is a MUST of every profile: what the run as a whole left behind, or could not
    // confirm it did not, is judged with all of it.
    let mut against = Vec::new();
    if !failed.is_empty() {
        against.push(format!("MUST failed: {}", failed.join(", ")));
    }
    if profile == ALL && facts.left_behind > 0 {
        against.push(format!(
            "the run left {} resource(s) behind",
            facts.left_behind
        ));
    }
    if profile == ALL
        && let Some(e) = &facts.sweep_error
    {
        against.push(format!(
            "cleanup could not be confirmed: the end-of-run sweep could not finish: {e}"
        ));
    }
    let (verdict, reason) = if !against.is_empty() {
        (Verdict::NonConformant, Some(against.join("; ")))
    } else if must_run == 0 {
        let why = if must_skipped.is_empty() {
            "no MUST scenario ran".to_owned()
        } else {
            format!("no MUST scenario ran; skipped: {}", must_skipped.join(", "))
        };
        (Verdict::NotTested, Some(why))
    } else if facts.certify && !skipped.is_empty() {
        (
            Verdict::NonConformant,
            Some(format!("--certify forbids skips: {}", skipped.join(", "))),
        )
    } else if !must_skipped.is_empty() {
        (
            Verdict::Partial,
            Some(format!("MUST skipped: {}", must_skipped.join(", "))),
        )
    } else if !flaky.is_empty() {
        (
            Verdict::Partial,
            Some(format!("MUST passed only on retry: {}", flaky.join(", "))),
        )
    } else if facts.never_ran > 0 {
        // What never ran was not judged: an interrupted run claims no conformance.
        let why = if facts.budget_ended {
            "the sandbox-seconds budget (--max-sandbox-seconds) ended the run"
        } else {
            "interrupted"
        };
        (
            Verdict::Partial,
            Some(format!(
                "{why}: {} selected scenario(s) never ran",
                facts.never_ran
            )),
        )
    } else {
        (Verdict::Conformant, None)
    };
    // A SHOULD failure changes no verdict, and is never out of sight: it is named beside it.
    let should_failed = ids(Some(Level::Should), &[Label::Fail, Label::Error]);
    let reason = match (reason, should_failed.is_empty()) {
        (reason, true) => reason,
        (None, false) => Some(format!(
            "{} SHOULD failed: {}",
            should_failed.len(),
            should_failed.join(", ")
        )),
        (Some(r), false) => Some(format!(
            "{r}; {} SHOULD failed: {}",
            should_failed.len(),
            should_failed.join(", ")
        )),
    };
    FamilyVerdict {
        profile: profile.to_owned(),
        verdict,
        reason,
        counts,
        must_run,
        scope: facts.scope((profile != ALL).then_some(profile)),
    }
}

/// The name of the profile that judges every scenario of the run.
pub const ALL: &str = "all";

/// Per-family verdicts (one per family with a judged scenario, in name order), then `all`.
pub fn judge(scenarios: &[Judged<'_>], facts: &RunFacts) -> Vec<FamilyVerdict> {
    let mut families: BTreeMap<&str, Vec<Judged<'_>>> = BTreeMap::new();
    for s in scenarios {
        families.entry(s.family).or_default().push(*s);
    }
    let mut out: Vec<FamilyVerdict> = families
        .iter()
        .map(|(f, list)| verdict(f, list, facts))
        .collect();
    out.push(verdict(ALL, scenarios, facts));
    out
}

/// Where the run went.
#[derive(Debug, Clone, Serialize)]
pub struct TargetInfo {
    /// `reference` or `url`.
    pub kind: String,
    /// Base URL (never with credentials).
    pub url: String,
    pub server_name: Option<String>,
    pub server_version: Option<String>,
    pub defects: Vec<String>,
    pub capabilities: serde_json::Value,
}

/// The whole run, for `report.json` and the evidence writer.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    pub run_id: String,
    pub suite_version: String,
    pub started_at: String,
    pub finished_at: String,
    pub duration_ms: u64,
    pub target: TargetInfo,
    pub profile: String,
    pub filters: Vec<String>,
    pub shard: Option<String>,
    /// A label the run was given (`--label`): what ties the shards of one run together.
    pub label: Option<String>,
    pub retries: u32,
    pub certify: bool,
    pub scenarios: Vec<ScenarioReport>,
    /// One per family present in the run, plus `all`.
    pub profiles: Vec<FamilyVerdict>,
    /// The end-of-run sweep: objects still tagged with this run's ID after every scenario
    /// finished (each a cleanup failure of the run), records it left alone, and whether it
    /// could finish.
    #[serde(default)]
    pub run_sweep: crate::live::RunSweep,
    /// Selected scenarios left out because they cannot apply to this target (with why), so
    /// that the evidence says they did not run. Never counted as passed or skipped.
    #[serde(default)]
    pub not_applicable: Vec<NotApplicable>,
    /// The SDK version matrix (`--sdk`), when the run had one.
    pub sdk_matrix: Option<crate::sdk::SdkMatrix>,
    /// What the run consumed of the target's account: sandboxes, sessions, sandbox-seconds,
    /// requests, bytes, throttles.
    #[serde(default)]
    pub consumption: crate::target::Consumption,
}

/// A selected scenario that was not run because it cannot apply to the target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NotApplicable {
    pub id: String,
    pub reason: String,
}

impl RunReport {
    /// Computes per-family verdicts and the `all` verdict.
    pub fn judge(scenarios: &[ScenarioReport], facts: &RunFacts) -> Vec<FamilyVerdict> {
        let rows: Vec<Judged<'_>> = scenarios.iter().map(ScenarioReport::judged).collect();
        judge(&rows, facts)
    }
}

impl ScenarioReport {
    /// What the verdict rules see of this scenario.
    pub fn judged(&self) -> Judged<'_> {
        Judged {
            id: &self.id,
            family: &self.family,
            level: self.level,
            outcome: Label::of(&self.outcome),
        }
    }
}

/// Failures the baseline does not expect.
fn count_failed(list: &[&ScenarioReport], expected: &BTreeMap<String, String>) -> usize {
    list.iter()
        .filter(|s| matches!(s.outcome, Outcome::Fail { .. }) && !expected.contains_key(&s.id))
        .count()
}

/// Escapes text for XML 1.0 attributes and content; characters XML cannot hold become U+FFFD.
pub fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

/// JUnit XML: one `<testsuite>` per family; failures, errors and skips as JUnit elements;
/// a flaky pass carries a Surefire-style `<flakyFailure>`. Each suite's `<properties>` give
/// its family's verdict and the run's, with their scope (`subset: 3 of 95 scenarios`). A
/// failure the run's baseline expects (`expected`: scenario ID to the baseline's reason) is
/// reported as skipped, with that reason and the failure, so that a CI that reads JUnit
/// gates as the run's gate does.
pub fn junit_xml(report: &RunReport, expected: &BTreeMap<String, String>) -> String {
    let mut families: BTreeMap<&str, Vec<&ScenarioReport>> = BTreeMap::new();
    for s in &report.scenarios {
        families.entry(s.family.as_str()).or_default().push(s);
    }
    let count = |list: &[&ScenarioReport], f: fn(&Outcome) -> bool| {
        list.iter().filter(|s| f(&s.outcome)).count()
    };
    let secs = |ms: u64| format!("{:.3}", ms as f64 / 1000.0);
    let mut x = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let all: Vec<&ScenarioReport> = report.scenarios.iter().collect();
    let _ = writeln!(
        x,
        "<testsuites name=\"sandspec\" tests=\"{}\" failures=\"{}\" errors=\"{}\" skipped=\"{}\" time=\"{}\">",
        all.len(),
        count_failed(&all, expected),
        count(&all, |o| matches!(o, Outcome::Error { .. })),
        count(&all, |o| matches!(o, Outcome::Skip { .. }))
            + count(&all, |o| matches!(o, Outcome::Fail { .. }))
            - count_failed(&all, expected),
        secs(report.duration_ms)
    );
    for (family, list) in &families {
        let time: u64 = list.iter().map(|s| s.duration_ms).sum();
        let _ = writeln!(
            x,
            "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{}\" errors=\"{}\" skipped=\"{}\" time=\"{}\">",
            xml_escape(family),
            list.len(),
            count_failed(list, expected),
            count(list, |o| matches!(o, Outcome::Error { .. })),
            count(list, |o| matches!(o, Outcome::Skip { .. }))
                + count(list, |o| matches!(o, Outcome::Fail { .. }))
                - count_failed(list, expected),
            secs(time)
        );
        let line = |name: &str| {
            report
                .profiles
                .iter()
                .find(|p| p.profile == name)
                .map(FamilyVerdict::line)
        };
        x.push_str("    <properties>\n");
        for (name, value) in [
            ("sandspec.verdict", line(family)),
            ("sandspec.run_verdict", line(ALL)),
        ] {
            if let Some(value) = value {
                let _ = writeln!(
                    x,
                    "      <property name=\"{name}\" value=\"{}\"/>",
                    xml_escape(&value)
                );
            }
        }
        x.push_str("    </properties>\n");
        for s in list {
            let _ = write!(
                x,
                "    <testcase classname=\"{}\" name=\"{}\" time=\"{}\"",
                xml_escape(family),
                xml_escape(&format!("{} {}", s.id, s.title)),
                secs(s.duration_ms)
            );
            match &s.outcome {
                Outcome::Pass => x.push_str("/>\n"),
                Outcome::Flaky { first_failure, .. } => {
                    let _ = write!(
                        x,
                        ">\n      <flakyFailure message=\"{}\"/>\n    </testcase>\n",
                        xml_escape(first_failure)
                    );
                }
                Outcome::Skip { reason } => {
                    let _ = write!(
                        x,
                        ">\n      <skipped message=\"{}\"/>\n    </testcase>\n",
                        xml_escape(reason)
                    );
                }
                Outcome::Fail { step, reason } if expected.contains_key(&s.id) => {
                    let _ = write!(
                        x,
                        ">\n      <skipped message=\"{}\"/>\n    </testcase>\n",
                        xml_escape(&format!(
                            "expected failure ({}): {step}: {reason}",
                            expected[&s.id]
                        ))
                    );
                }
                Outcome::Fail { step, reason } => {
                    let _ = write!(
                        x,
                        ">\n      <failure message=\"{}\" type=\"{}\">{}</failure>\n    </testcase>\n",
                        xml_escape(reason),
                        xml_escape(s.level.to_string().as_str()),
                        xml_escape(&format!(
                            "{step}: {reason}\nclauses: {}",
                            s.clauses.join(", ")
                        ))
                    );
                }
                Outcome::Error { reason } => {
                    let _ = write!(
                        x,
                        ">\n      <error message=\"{}\"/>\n    </testcase>\n",
                        xml_escape(reason)
                    );
                }
            }
        }
        x.push_str("  </testsuite>\n");
    }
    x.push_str("</testsuites>\n");
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(id: &str, family: &str, level: Level, outcome: Outcome) -> ScenarioReport {
        ScenarioReport {
            id: id.into(),
            title: "t".into(),
            family: family.into(),
            file: "f".into(),
            level,
            clauses: vec!["SBX-3.1".into()],
            tags: vec![],
            defects: vec![],
            outcome,
            started_ms: 0,
            duration_ms: 1500,
            attempts: 1,
            measurements: BTreeMap::new(),
            swept: vec![],
            faults: vec![],
            throttled: Default::default(),
            transcript: vec![],
        }
    }

    fn fail() -> Outcome {
        Outcome::Fail {
            step: "steps[0]".into(),
            reason: "status 500".into(),
        }
    }

    fn skip() -> Outcome {
        Outcome::Skip {
            reason: "no pause".into(),
        }
    }

    #[test]
    fn verdicts() {
        let v = |list: Vec<ScenarioReport>, certify: bool| {
            let rows: Vec<Judged<'_>> = list.iter().map(ScenarioReport::judged).collect();
            let facts = RunFacts {
                certify,
                ..RunFacts::whole_catalog(rows.iter().map(|r| r.family))
            };
            verdict("p", &rows, &facts).verdict
        };
        use Level::{Must, Should};
        use Verdict::*;
        assert_eq!(
            v(vec![report("A-001", "f", Must, Outcome::Pass)], false),
            Conformant
        );
        assert_eq!(
            v(
                vec![
                    report("A-001", "f", Must, Outcome::Pass),
                    report("A-002", "f", Should, fail())
                ],
                false
            ),
            Conformant
        );
        assert_eq!(
            v(
                vec![
                    report("A-001", "f", Must, Outcome::Pass),
                    report("A-002", "f", Must, skip())
                ],
                false
            ),
            Partial
        );
        assert_eq!(
            v(
                vec![
                    report("A-001", "f", Must, Outcome::Pass),
                    report("A-002", "f", Must, fail())
                ],
                false
            ),
            NonConformant
        );
        assert_eq!(
            v(
                vec![report(
                    "A-001",
                    "f",
                    Must,
                    Outcome::Error { reason: "x".into() }
                )],
                false
            ),
            NonConformant
        );
        assert_eq!(
            v(vec![report("A-001", "f", Should, Outcome::Pass)], false),
            NotTested,
            "no MUST ran"
        );
        assert_eq!(
            v(vec![report("A-001", "f", Must, skip())], false),
            NotTested,
            "no MUST ran"
        );
        assert_eq!(
            v(
                vec![
                    report("A-001", "f", Must, skip()),
                    report("A-002", "f", Should, fail())
                ],
                false
            ),
            NotTested,
            "a SHOULD failure judges no MUST"
        );
        assert_eq!(
            v(
                vec![
                    report("A-001", "f", Must, Outcome::Pass),
                    report("A-002", "f", Should, skip())
                ],
                true
            ),
            NonConformant
        );
        let flaky = Outcome::Flaky {
            attempts: 2,
            first_failure: "x".into(),
        };
        assert_eq!(v(vec![report("A-001", "f", Must, flaky)], false), Partial);
    }

    /// A SHOULD failure leaves a verdict as it is and is named beside it; nothing judged is
    /// `not-tested`, with the skipped MUST scenarios named.
    #[test]
    fn should_failures_are_named_and_nothing_judged_is_not_tested() {
        let list = [
            report("A-001", "f", Level::Must, Outcome::Pass),
            report("A-002", "f", Level::Should, fail()),
            report("A-003", "f", Level::Should, fail()),
        ];
        let rows: Vec<Judged<'_>> = list.iter().map(ScenarioReport::judged).collect();
        let facts = RunFacts::whole_catalog(rows.iter().map(|r| r.family));
        let all = judge(&rows, &facts).pop().unwrap();
        assert_eq!(all.verdict, Verdict::Conformant);
        assert_eq!(all.line(), "conformant, 2 SHOULD failed: A-002, A-003");
        let list = [
            report("A-001", "f", Level::Must, fail()),
            report("A-002", "f", Level::Should, fail()),
        ];
        let rows: Vec<Judged<'_>> = list.iter().map(ScenarioReport::judged).collect();
        let all = judge(&rows, &RunFacts::whole_catalog(["f", "f"]))
            .pop()
            .unwrap();
        assert_eq!(
            all.reason.as_deref(),
            Some("MUST failed: A-001; 1 SHOULD failed: A-002")
        );
        assert_eq!(all.line(), "non-conformant");
        let list = [report("A-001", "f", Level::Must, skip())];
        let rows: Vec<Judged<'_>> = list.iter().map(ScenarioReport::judged).collect();
        let all = judge(&rows, &RunFacts::whole_catalog(["f"])).pop().unwrap();
        assert_eq!(all.verdict, Verdict::NotTested);
        assert_eq!(
            all.reason.as_deref(),
            Some("no MUST scenario ran; skipped: A-001")
        );
    }

    /// What the run as a whole left behind, or could not confirm it did not, makes `all`
    /// non-conformant whatever its scenarios did; the families are judged on their own.
    #[test]
    fn cleanup_of_the_whole_run_is_judged_with_all() {
        let list = [report("A-001", "f", Level::Must, Outcome::Pass)];
        let rows: Vec<Judged<'_>> = list.iter().map(ScenarioReport::judged).collect();
        let facts = RunFacts {
            left_behind: 2,
            sweep_error: Some("GET /v2/sandboxes: status 405".into()),
            ..RunFacts::whole_catalog(["f"])
        };
        let verdicts = judge(&rows, &facts);
        assert_eq!(verdicts[0].verdict, Verdict::Conformant, "the family");
        let all = verdicts.last().unwrap();
        assert_eq!(all.verdict, Verdict::NonConformant);
        assert_eq!(
            all.reason.as_deref(),
            Some(
                "the run left 2 resource(s) behind; cleanup could not be confirmed: the end-of-run sweep could not finish: GET /v2/sandboxes: status 405"
            )
        );
    }

    #[test]
    fn an_interrupted_run_is_never_conformant() {
        let list = [report("A-001", "f", Level::Must, Outcome::Pass)];
        let rows: Vec<Judged<'_>> = list.iter().map(ScenarioReport::judged).collect();
        let mut facts = RunFacts::whole_catalog(["f", "f"]);
        facts.never_ran = 1;
        let all = judge(&rows, &facts).pop().unwrap();
        assert_eq!(all.verdict, Verdict::Partial);
        assert_eq!(
            all.reason.as_deref(),
            Some("interrupted: 1 selected scenario(s) never ran")
        );
        assert_eq!(all.line(), "partial", "never-run scenarios were selected");
    }

    /// A selection that leaves scenarios out says so in every verdict it narrows; a family
    /// that ran whole is not a subset even when the run is.
    #[test]
    fn a_narrowed_run_is_a_subset_in_every_narrowed_verdict() {
        let list = [
            report("A-001", "lifecycle", Level::Must, Outcome::Pass),
            report("B-001", "auth", Level::Must, Outcome::Pass),
        ];
        let rows: Vec<Judged<'_>> = list.iter().map(ScenarioReport::judged).collect();
        let facts = RunFacts {
            selected: BTreeMap::from([("lifecycle".to_owned(), 1), ("auth".to_owned(), 2)]),
            catalog: BTreeMap::from([
                ("lifecycle".to_owned(), 3),
                ("auth".to_owned(), 2),
                ("files".to_owned(), 90),
            ]),
            ..RunFacts::default()
        };
        let profiles = judge(&rows, &facts);
        let lines: Vec<(&str, String)> = profiles
            .iter()
            .map(|p| (p.profile.as_str(), p.line()))
            .collect();
        assert_eq!(
            lines,
            [
                ("auth", "conformant".to_owned()),
                (
                    "lifecycle",
                    "conformant (subset: 1 of 3 scenarios)".to_owned()
                ),
                ("all", "conformant (subset: 3 of 95 scenarios)".to_owned()),
            ]
        );
        let whole = judge(&rows, &RunFacts::whole_catalog(["lifecycle", "auth"]));
        assert!(whole.iter().all(|p| !p.scope.is_subset()));
        assert_eq!(whole.last().unwrap().line(), "conformant");
    }

    #[test]
    fn xml_escaping() {
        assert_eq!(
            xml_escape(r#"a<b>&"c" 'd'"#),
            "a&lt;b&gt;&amp;&quot;c&quot; &apos;d&apos;"
        );
        assert_eq!(xml_escape("bell\u{7} tab\t"), "bell\u{FFFD} tab\t");
        assert_eq!(xml_escape("ünï"), "ünï");
    }

    #[test]
    fn junit_has_one_element_per_outcome() {
        let scenarios = vec![
            report("A-001", "lifecycle", Level::Must, Outcome::Pass),
            report(
                "A-002",
                "lifecycle",
                Level::Must,
                Outcome::Fail {
                    step: "steps[1]".into(),
                    reason: "status <500> & \"x\"".into(),
                },
            ),
            report("B-001", "auth", Level::Should, skip()),
            report(
                "B-002",
                "auth",
                Level::Must,
                Outcome::Error {
                    reason: "unreachable".into(),
                },
            ),
        ];
        let rep = RunReport {
            run_id: "r".into(),
            suite_version: "0".into(),
            started_at: String::new(),
            finished_at: String::new(),
            duration_ms: 6000,
            target: TargetInfo {
                kind: "url".into(),
                url: "http://x".into(),
                server_name: None,
                server_version: None,
                defects: vec![],
                capabilities: serde_json::Value::Null,
            },
            profile: "all".into(),
            filters: vec![],
            shard: None,
            label: None,
            retries: 0,
            certify: false,
            profiles: RunReport::judge(
                &scenarios,
                &RunFacts::whole_catalog(scenarios.iter().map(|s| s.family.as_str())),
            ),
            scenarios,
            run_sweep: Default::default(),
            not_applicable: Vec::new(),
            sdk_matrix: None,
            consumption: Default::default(),
        };
        let xml = junit_xml(&rep, &BTreeMap::new());
        assert!(xml.contains(r#"<testsuites name="sandspec" tests="4" failures="1" errors="1" skipped="1" time="6.000">"#), "{xml}");
        assert!(
            xml.contains(
                r#"<failure message="status &lt;500&gt; &amp; &quot;x&quot;" type="MUST">"#
            ),
            "{xml}"
        );
        assert!(xml.contains(r#"<skipped message="no pause"/>"#));
        assert!(xml.contains(r#"<error message="unreachable"/>"#));
        assert!(xml.contains(r#"<testcase classname="lifecycle" name="A-001 t" time="1.500"/>"#));
        assert_eq!(xml.matches("<testsuite ").count(), 2);
    }
}
