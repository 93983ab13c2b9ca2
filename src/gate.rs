//! Expected failures (`--expected-failures FILE`): a baseline of the failures a platform team
//! knows of, and the *gate* a CI job decides on. The gate passes when every failure of the run
//! is expected and nothing else keeps the run from conformance; an entry whose scenario now
//! passes is *stale* and fails the gate, as does an expired entry or a failure at another step
//! than the one listed, so the list can only shrink. The verdict is never changed by it: a run
//! with expected failures stays `non-conformant`, and its evidence says both.
//!
//! The file is YAML, a list of entries:
//!
//! ```yaml
//! - id: ASB-SSE-003
//!   step: steps[2] 33 subscribers at once      # optional: where it must fail
//!   reason: the stream limit is off by one      # required
//!   link: https://tracker.example/issues/12     # optional
//!   expires: 2027-03-31                          # optional: the gate fails from that day on
//! ```

use std::collections::BTreeSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::report::{FamilyVerdict, Judged, Label, RunFacts, Verdict, judge};
use crate::scenario::{Located, Pos};

/// One known failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expected {
    /// The scenario's ID.
    pub id: String,
    /// The step it fails at, as outcomes name it (`steps[2] create`); any step when absent.
    #[serde(default)]
    pub step: Option<String>,
    /// Why it fails, for the reader of the evidence.
    pub reason: String,
    /// Where the fix is tracked.
    #[serde(default)]
    pub link: Option<String>,
    /// The last day (`YYYY-MM-DD`, UTC) the entry holds; from the next day on it fails the
    /// gate.
    #[serde(default)]
    pub expires: Option<String>,
}

/// A baseline file, as read and checked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Baseline {
    /// The file's name as given (for the reader; the digest identifies it).
    pub file: String,
    /// SHA-256 of the file's bytes.
    pub sha256: String,
    pub entries: Vec<Expected>,
}

/// Why a baseline file cannot be used: a usage error, found before anything runs.
#[derive(Debug, thiserror::Error)]
pub enum BaselineError {
    #[error("cannot read {file}: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}:{line}:{col}: {message}")]
    Invalid {
        file: String,
        line: u64,
        col: u64,
        message: String,
    },
}

/// An entry as written, with where.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Written {
    id: Located<String>,
    #[serde(default)]
    step: Option<String>,
    reason: Located<String>,
    #[serde(default)]
    link: Option<String>,
    #[serde(default)]
    expires: Option<Located<String>>,
}

impl Baseline {
    /// Reads and checks `path`: every entry names a scenario of `catalog` once, gives a
    /// reason, and an expiry date that is a date.
    pub fn read(path: &Path, catalog: &BTreeSet<&str>) -> Result<Baseline, BaselineError> {
        let file = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| BaselineError::Read {
            file: file.clone(),
            source,
        })?;
        let invalid = |pos: Pos, message: String| BaselineError::Invalid {
            file: file.clone(),
            line: pos.line,
            col: pos.col,
            message,
        };
        let text = String::from_utf8_lossy(&bytes);
        let written: Vec<Written> = if text.trim().is_empty() {
            Vec::new()
        } else {
            serde_saphyr::from_str(&text).map_err(|e| {
                let pos = e
                    .location()
                    .map(|l| Pos {
                        line: l.line(),
                        col: l.column(),
                    })
                    .unwrap_or_default();
                invalid(pos, crate::scenario::first_line(&e.to_string()))
            })?
        };
        let mut seen = BTreeSet::new();
        let mut entries = Vec::with_capacity(written.len());
        for w in written {
            let at = Pos::of(&w.id);
            if !catalog.contains(w.id.value.as_str()) {
                return Err(invalid(
                    at,
                    format!(
                        "`{}` is no scenario of the catalog: a fixed or removed scenario leaves the baseline",
                        w.id.value
                    ),
                ));
            }
            if !seen.insert(w.id.value.clone()) {
                return Err(invalid(at, format!("`{}` is listed twice", w.id.value)));
            }
            if w.reason.value.trim().is_empty() {
                return Err(invalid(
                    Pos::of(&w.reason),
                    format!("`{}` needs a reason", w.id.value),
                ));
            }
            if let Some(expires) = &w.expires
                && parse_date(&expires.value).is_none()
            {
                return Err(invalid(
                    Pos::of(expires),
                    format!("`expires: {}` is not a date (YYYY-MM-DD)", expires.value),
                ));
            }
            entries.push(Expected {
                id: w.id.value,
                step: w.step,
                reason: w.reason.value,
                link: w.link,
                expires: w.expires.map(|e| e.value),
            });
        }
        Ok(Baseline {
            file: path
                .file_name()
                .map_or_else(|| file.clone(), |n| n.to_string_lossy().into_owned()),
            sha256: crate::evidence::sha256_hex(&bytes),
            entries,
        })
    }
}

fn parse_date(text: &str) -> Option<time::Date> {
    time::Date::parse(
        text,
        &time::macros::format_description!("[year]-[month]-[day]"),
    )
    .ok()
}

/// One scenario as the gate sees it: what the verdict sees, and the step it failed at.
#[derive(Debug, Clone, Copy)]
pub struct GateRow<'a> {
    pub judged: Judged<'a>,
    pub failed_step: Option<&'a str>,
}

/// The gate's decision, as the receipt records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gate {
    pub baseline: Baseline,
    /// `pass` or `fail`.
    pub result: String,
    /// Failures the baseline lists, at the step it lists.
    pub expected: Vec<String>,
    /// Failures (and harness errors, which are never expected) the baseline does not list.
    pub unexpected: Vec<String>,
    /// Entries whose scenario passed: the baseline must lose them.
    pub stale: Vec<String>,
    /// Entries past their expiry date on the day the run ended.
    pub expired: Vec<String>,
    /// Failures the baseline lists at another step: `<id>: failed at <step>, listed at
    /// <step>`.
    pub wrong_step: Vec<String>,
    /// Why the gate failed, each in a line; empty when it passed.
    pub reasons: Vec<String>,
}

impl Gate {
    pub fn passed(&self) -> bool {
        self.result == "pass"
    }

    /// Judges a run's scenarios against `baseline` on `day` (the day the run ended): the
    /// run's verdict with every expected failure set aside must be conformant, with nothing
    /// else failed, and no entry may be stale, expired or at another step.
    pub fn judge(baseline: &Baseline, rows: &[GateRow<'_>], facts: &RunFacts, day: &str) -> Gate {
        let today = parse_date(day);
        let mut gate = Gate {
            baseline: baseline.clone(),
            result: String::new(),
            expected: Vec::new(),
            unexpected: Vec::new(),
            stale: Vec::new(),
            expired: Vec::new(),
            wrong_step: Vec::new(),
            reasons: Vec::new(),
        };
        for entry in &baseline.entries {
            if let (Some(until), Some(today)) =
                (entry.expires.as_deref().and_then(parse_date), today)
                && today > until
            {
                gate.expired.push(entry.id.clone());
            }
        }
        let mut set_aside = Vec::with_capacity(rows.len());
        for row in rows {
            let entry = baseline.entries.iter().find(|e| e.id == row.judged.id);
            let mut judged = row.judged;
            match (row.judged.outcome, entry) {
                (Label::Fail, Some(e)) => match (&e.step, row.failed_step) {
                    (Some(listed), Some(failed)) if listed != failed => {
                        gate.wrong_step.push(format!(
                            "{}: failed at `{failed}`, listed at `{listed}`",
                            e.id
                        ));
                    }
                    _ => {
                        gate.expected.push(e.id.clone());
                        judged.outcome = Label::Pass;
                    }
                },
                (Label::Fail | Label::Error, _) => gate.unexpected.push(row.judged.id.to_owned()),
                (Label::Pass | Label::Flaky, Some(e)) => gate.stale.push(e.id.clone()),
                (Label::Pass | Label::Flaky | Label::Skip, _) => {}
            }
            set_aside.push(judged);
        }
        if !gate.unexpected.is_empty() {
            gate.reasons.push(format!(
                "unexpected failure: {}",
                gate.unexpected.join(", ")
            ));
        }
        if !gate.wrong_step.is_empty() {
            gate.reasons.push(format!(
                "failed at another step than listed: {}",
                gate.wrong_step.join("; ")
            ));
        }
        if !gate.stale.is_empty() {
            gate.reasons.push(format!(
                "stale (passes now; remove it from the baseline): {}",
                gate.stale.join(", ")
            ));
        }
        if !gate.expired.is_empty() {
            gate.reasons
                .push(format!("expired: {}", gate.expired.join(", ")));
        }
        // Everything else that keeps a run from conformance keeps the gate closed too: a
        // skipped MUST, nothing judged, what the run left behind, an interruption.
        let all: Option<FamilyVerdict> = judge(&set_aside, facts).pop();
        if let Some(all) = all
            && all.verdict != Verdict::Conformant
            && gate.unexpected.is_empty()
            && gate.wrong_step.is_empty()
        {
            gate.reasons.push(format!(
                "with the expected failures set aside, the run is {}: {}",
                all.verdict,
                all.reason.unwrap_or_default()
            ));
        }
        gate.result = if gate.reasons.is_empty() {
            "pass"
        } else {
            "fail"
        }
        .to_owned();
        gate
    }

    /// The gate as printed and rendered: `pass (2 expected failures)` or `FAIL: ...`.
    pub fn line(&self) -> String {
        if self.passed() {
            format!(
                "pass ({} expected failure(s) of {} listed)",
                self.expected.len(),
                self.baseline.entries.len()
            )
        } else {
            format!("FAIL: {}", self.reasons.join("; "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Level;

    fn baseline(entries: &[(&str, Option<&str>, Option<&str>)]) -> Baseline {
        Baseline {
            file: "b.yaml".into(),
            sha256: "0".repeat(64),
            entries: entries
                .iter()
                .map(|(id, step, expires)| Expected {
                    id: (*id).to_owned(),
                    step: step.map(str::to_owned),
                    reason: "known".into(),
                    link: None,
                    expires: expires.map(str::to_owned),
                })
                .collect(),
        }
    }

    fn row<'a>(id: &'a str, level: Level, outcome: Label, step: Option<&'a str>) -> GateRow<'a> {
        GateRow {
            judged: Judged {
                id,
                family: "f",
                level,
                outcome,
            },
            failed_step: step,
        }
    }

    fn facts(n: usize) -> RunFacts {
        RunFacts::whole_catalog(std::iter::repeat_n("f", n))
    }

    #[test]
    fn every_failure_expected_passes_the_gate() {
        let b = baseline(&[("A-002", Some("steps[1] x"), None), ("A-003", None, None)]);
        let rows = [
            row("A-001", Level::Must, Label::Pass, None),
            row("A-002", Level::Must, Label::Fail, Some("steps[1] x")),
            row("A-003", Level::Should, Label::Fail, Some("steps[0] y")),
        ];
        let gate = Gate::judge(&b, &rows, &facts(3), "2026-12-05");
        assert!(gate.passed(), "{gate:?}");
        assert_eq!(gate.expected, ["A-002", "A-003"]);
        assert_eq!(gate.line(), "pass (2 expected failure(s) of 2 listed)");
    }

    #[test]
    fn an_unexpected_failure_fails_the_gate() {
        let b = baseline(&[("A-002", None, None)]);
        let rows = [
            row("A-001", Level::Must, Label::Fail, Some("steps[0] z")),
            row("A-002", Level::Must, Label::Fail, Some("steps[1] x")),
            row("A-003", Level::Should, Label::Error, None),
        ];
        let gate = Gate::judge(&b, &rows, &facts(3), "2026-12-05");
        assert!(!gate.passed());
        assert_eq!(gate.unexpected, ["A-001", "A-003"]);
        assert_eq!(gate.reasons, ["unexpected failure: A-001, A-003"]);
    }

    #[test]
    fn a_stale_entry_fails_the_gate() {
        let b = baseline(&[("A-001", None, None)]);
        let rows = [row("A-001", Level::Must, Label::Pass, None)];
        let gate = Gate::judge(&b, &rows, &facts(1), "2026-12-05");
        assert!(!gate.passed());
        assert_eq!(gate.stale, ["A-001"]);
    }

    #[test]
    fn an_expired_entry_fails_the_gate_from_the_next_day() {
        let b = baseline(&[("A-001", None, Some("2026-12-05"))]);
        let rows = [row("A-001", Level::Must, Label::Fail, Some("steps[0] x"))];
        assert!(Gate::judge(&b, &rows, &facts(1), "2026-12-05").passed());
        let gate = Gate::judge(&b, &rows, &facts(1), "2026-12-06");
        assert!(!gate.passed());
        assert_eq!(gate.expired, ["A-001"]);
    }

    #[test]
    fn a_failure_at_another_step_fails_the_gate() {
        let b = baseline(&[("A-001", Some("steps[1] x"), None)]);
        let rows = [row("A-001", Level::Must, Label::Fail, Some("steps[0] y"))];
        let gate = Gate::judge(&b, &rows, &facts(1), "2026-12-05");
        assert!(!gate.passed());
        assert_eq!(
            gate.wrong_step,
            ["A-001: failed at `steps[0] y`, listed at `steps[1] x`"]
        );
    }

    #[test]
    fn a_skipped_must_keeps_the_gate_closed() {
        let b = baseline(&[("A-001", None, None)]);
        let rows = [
            row("A-001", Level::Must, Label::Fail, Some("steps[0] x")),
            row("A-002", Level::Must, Label::Skip, None),
        ];
        let gate = Gate::judge(&b, &rows, &facts(2), "2026-12-05");
        assert!(!gate.passed());
        assert_eq!(
            gate.reasons,
            ["with the expected failures set aside, the run is partial: MUST skipped: A-002"]
        );
    }

    #[test]
    fn a_baseline_file_is_checked_before_the_run() {
        let dir = tempfile::tempdir().unwrap();
        let catalog: BTreeSet<&str> = ["A-001", "A-002"].into_iter().collect();
        let write = |text: &str| {
            let path = dir.path().join("baseline.yaml");
            std::fs::write(&path, text).unwrap();
            Baseline::read(&path, &catalog)
        };
        let ok = write(
            "- id: A-001\n  reason: known\n  step: steps[0] x\n  expires: 2027-01-31\n  link: https://t/1\n",
        )
        .unwrap();
        assert_eq!(ok.entries.len(), 1);
        assert_eq!(ok.entries[0].expires.as_deref(), Some("2027-01-31"));
        assert_eq!(write("").unwrap().entries, []);
        for (text, message) in [
            (
                "- id: B-001\n  reason: r\n",
                "1:7: `B-001` is no scenario of the catalog",
            ),
            (
                "- id: A-001\n  reason: r\n- id: A-001\n  reason: r\n",
                "3:7: `A-001` is listed twice",
            ),
            ("- id: A-001\n  reason: ' '\n", "`A-001` needs a reason"),
            (
                "- id: A-001\n  reason: r\n  expires: next week\n",
                "3:12: `expires: next week` is not a date",
            ),
            (
                "- id: A-001\n  reason: r\n  why: x\n",
                "unknown field `why`",
            ),
            ("- id: A-001\n", "missing field `reason`"),
        ] {
            let err = write(text).unwrap_err().to_string();
            assert!(err.contains(message), "{text:?}: {err}");
        }
    }
}
