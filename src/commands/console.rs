//! What a run prints: a progress bar on a terminal (one line per scenario otherwise, for CI
//! logs), the verdict table, and the scenarios the wait budget left out.

use std::io::IsTerminal as _;

use crate::cli::MaxWait;
use crate::engine::{Outcome, ScenarioRun};
use crate::report::{RunReport, Verdict};
use crate::scenario::LoadedScenario;

/// A progress bar on a terminal, one line per scenario otherwise (CI logs).
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    pub fn new(total: usize) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total as u64);
            if let Ok(style) =
                indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {elapsed} {msg}")
            {
                bar.set_style(style);
            }
            bar
        });
        Progress { bar }
    }

    pub fn done(&self, s: &LoadedScenario, r: &ScenarioRun) {
        let line = match r.outcome.reason() {
            Some(reason) => format!(
                "{:<5} {} ({} ms): {reason}",
                r.outcome.label(),
                s.id(),
                r.duration_ms
            ),
            None => format!("{:<5} {} ({} ms)", r.outcome.label(), s.id(), r.duration_ms),
        };
        match &self.bar {
            Some(bar) => {
                if !r.outcome.passed() {
                    bar.println(line);
                }
                bar.set_message(s.id().to_owned());
                bar.inc(1);
            }
            None => eprintln!("{line}"),
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

pub fn print_summary(report: &RunReport) {
    println!();
    println!(
        "{:<14} {:<16} {:>5} {:>5} {:>5} {:>5} {:>5} {:>5}  scope",
        "family", "verdict", "PASS", "FLAKY", "SKIP", "FAIL", "ERROR", "MUST"
    );
    for p in &report.profiles {
        let c = |k: &str| p.counts.get(k).copied().unwrap_or(0);
        println!(
            "{:<14} {:<16} {:>5} {:>5} {:>5} {:>5} {:>5} {:>5}  {}",
            p.profile,
            p.verdict.to_string(),
            c("PASS"),
            c("FLAKY"),
            c("SKIP"),
            c("FAIL"),
            c("ERROR"),
            p.must_run,
            p.scope
                .qualifier()
                .unwrap_or_else(|| format!("catalog: {} scenarios", p.scope.catalog))
        );
    }
    for p in report
        .profiles
        .iter()
        .filter(|p| p.profile == crate::report::ALL)
    {
        println!("\n{}: {}", p.profile, p.line());
        if let Some(reason) = p
            .reason
            .as_ref()
            .filter(|_| p.verdict != Verdict::Conformant)
        {
            println!("{}: {reason}", p.verdict);
        }
    }
    let failed: Vec<&str> = report
        .scenarios
        .iter()
        .filter(|s| matches!(s.outcome, Outcome::Fail { .. } | Outcome::Error { .. }))
        .map(|s| s.id.as_str())
        .collect();
    if !failed.is_empty() {
        println!("failed: {}", failed.join(" "));
    }
}

/// Names every scenario the wait budget skipped (each one's reason has the numbers).
pub fn print_over_budget(report: &RunReport, max_wait: MaxWait) {
    let over: Vec<&str> = report
        .scenarios
        .iter()
        .filter(|s| {
            matches!(&s.outcome, Outcome::Skip { reason }
                if reason.starts_with(crate::engine::waits::OVER_BUDGET))
        })
        .map(|s| s.id.as_str())
        .collect();
    if !over.is_empty() {
        println!(
            "skipped over the wait budget (--max-wait {}; `--max-wait none` waits them out): {}",
            crate::engine::waits::format_budget(max_wait.0),
            over.join(" ")
        );
    }
}
