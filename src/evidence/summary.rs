//! `summary.md`: the receipt as a reviewer reads it. Rendered from the receipt alone, so it
//! can say nothing the receipt does not.

use std::fmt::Write as _;

use super::receipt::{OutcomeLabel, Statement};

/// A Markdown table cell: pipes escaped, line breaks flattened.
fn cell(text: &str) -> String {
    text.replace('\\', "\\\\")
        .replace('|', "\\|")
        .replace(['\r', '\n'], " ")
}

fn label(o: OutcomeLabel) -> &'static str {
    match o {
        OutcomeLabel::Pass => "PASS",
        OutcomeLabel::Flaky => "FLAKY",
        OutcomeLabel::Skip => "SKIP",
        OutcomeLabel::Fail => "FAIL",
        OutcomeLabel::Error => "ERROR",
    }
}

pub(crate) fn render(statement: &Statement) -> String {
    let r = &statement.predicate;
    let mut md = String::new();
    let _ = writeln!(md, "# sandspec run `{}`\n", r.run_id);
    if r.interrupted {
        let why = if r.consumption.budget_ended {
            "Its sandbox-seconds budget (--max-sandbox-seconds) ended the run"
        } else {
            "The run was stopped"
        };
        let _ = writeln!(
            md,
            "> **Interrupted.** {why} before every selected scenario ran; {} never ran: {}.\n",
            r.not_run.len(),
            if r.not_run.is_empty() {
                "none".to_owned()
            } else {
                r.not_run.join(", ")
            }
        );
    }
    let server = match (&r.target.server_name, &r.target.server_version) {
        (Some(n), Some(v)) => format!("{n} {v}"),
        (Some(n), None) => n.clone(),
        _ => "unknown server".to_owned(),
    };
    let _ = writeln!(md, "| | |\n|---|---|");
    let _ = writeln!(
        md,
        "| target | {} ({}) |",
        cell(&r.target.base_url),
        cell(&r.target.kind)
    );
    let _ = writeln!(
        md,
        "| server | {}, API {} |",
        cell(&server),
        cell(r.target.api_version.as_deref().unwrap_or("unknown"))
    );
    for s in &statement.subject {
        let _ = writeln!(
            md,
            "| tested build | `{}` sha256 `{}` |",
            cell(&s.name),
            s.digest.sha256
        );
    }
    if !r.target.defects.is_empty() {
        let _ = writeln!(
            md,
            "| deliberate defects | {} |",
            cell(&r.target.defects.join(", "))
        );
    }
    let _ = writeln!(
        md,
        "| suite | {} {} (commit `{}`) |",
        r.suite.name,
        cell(&r.suite.version),
        r.suite.commit
    );
    let _ = writeln!(md, "| started | {} |", r.started_at);
    let _ = writeln!(
        md,
        "| ended | {} ({:.1} s) |",
        r.ended_at,
        r.duration_ms as f64 / 1000.0
    );
    let _ = writeln!(
        md,
        "| environment | {} {} ({} CPUs){} |",
        cell(&r.environment.os),
        cell(&r.environment.arch),
        r.environment.cpu_count,
        r.environment
            .os_release
            .as_deref()
            .map(|v| format!(", {}", cell(v)))
            .unwrap_or_default()
    );

    md.push_str("\n## Verdicts\n\n");
    if r.selection.subset {
        let _ = writeln!(
            md,
            "> **Subset.** The selection ran {} of the catalog's {} scenarios; no verdict below speaks for the rest.\n",
            r.selection.selected, r.selection.catalog
        );
    }
    md.push_str("| profile | verdict | PASS | FLAKY | SKIP | FAIL | ERROR | MUST run | reason |\n");
    md.push_str("|---|---|---:|---:|---:|---:|---:|---:|---|\n");
    for p in &r.profiles {
        let c = |k: &str| p.counts.get(k).copied().unwrap_or(0);
        let scope = crate::report::Scope {
            selected: p.selected,
            catalog: p.catalog,
        };
        let verdict = match scope.qualifier() {
            Some(q) => format!("**{}** ({q})", p.verdict),
            None => format!("**{}**", p.verdict),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            cell(&p.profile),
            verdict,
            c("PASS"),
            c("FLAKY"),
            c("SKIP"),
            c("FAIL"),
            c("ERROR"),
            p.must_run,
            cell(p.reason.as_deref().unwrap_or(""))
        );
    }

    if let Some(gate) = &r.gate {
        let _ = writeln!(
            md,
            "\n## Gate\n\nAgainst the baseline `{}` (sha256 `{}`, {} entries): **{}**. The verdicts above are unchanged by it.\n",
            cell(&gate.baseline.file),
            gate.baseline.sha256,
            gate.baseline.entries.len(),
            cell(&gate.line())
        );
        if !gate.baseline.entries.is_empty() {
            md.push_str("| scenario | at step | reason | link | expires | this run |\n|---|---|---|---|---|---|\n");
            for e in &gate.baseline.entries {
                let this_run = if gate.expected.contains(&e.id) {
                    "failed as expected"
                } else if gate.stale.contains(&e.id) {
                    "passed: stale"
                } else if gate
                    .wrong_step
                    .iter()
                    .any(|w| w.starts_with(&format!("{}:", e.id)))
                {
                    "failed at another step"
                } else {
                    "not judged"
                };
                let this_run = if gate.expired.contains(&e.id) {
                    format!("{this_run}; expired")
                } else {
                    this_run.to_owned()
                };
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} |",
                    cell(&e.id),
                    cell(e.step.as_deref().unwrap_or("any")),
                    cell(&e.reason),
                    cell(e.link.as_deref().unwrap_or("")),
                    cell(e.expires.as_deref().unwrap_or("")),
                    this_run
                );
            }
        }
    }

    let c = &r.counts;
    md.push_str("\n## Counts\n\n| scenarios | pass | flaky | skip | fail | error | never ran | requests | 2xx responses | 401/403 responses |\n");
    md.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    let _ = writeln!(
        md,
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
        c.total,
        c.pass,
        c.flaky,
        c.skip,
        c.fail,
        c.error,
        c.not_run,
        c.requests,
        c.positive_operations,
        c.authentication_rejections
    );

    consumption(&mut md, &r.consumption);

    let failures: Vec<_> = r
        .scenarios
        .iter()
        .filter(|s| matches!(s.outcome, OutcomeLabel::Fail | OutcomeLabel::Error))
        .collect();
    md.push_str("\n## Failures\n\n");
    if failures.is_empty() {
        md.push_str("None.\n");
    }
    for s in failures {
        let _ = writeln!(
            md,
            "- **{}** `{}` {} ({}; clauses {}): {}",
            label(s.outcome),
            s.id,
            s.title,
            s.level,
            s.clauses.join(", "),
            s.reason.as_deref().unwrap_or("")
        );
    }
    let skips: Vec<_> = r
        .scenarios
        .iter()
        .filter(|s| s.outcome == OutcomeLabel::Skip)
        .collect();
    md.push_str("\n## Skips\n\n");
    if skips.is_empty() {
        md.push_str("None.\n");
    }
    for s in skips {
        let _ = writeln!(
            md,
            "- `{}` {} ({}): {}",
            s.id,
            s.title,
            s.level,
            s.reason.as_deref().unwrap_or("")
        );
    }
    if !r.selection.not_applicable.is_empty() {
        md.push_str("\n## Not applicable to this target\n\n");
        for n in &r.selection.not_applicable {
            let _ = writeln!(md, "- `{}`: {}", n.id, n.reason);
        }
    }
    if !r.not_run.is_empty() {
        md.push_str("\n## Never ran\n\n");
        for id in &r.not_run {
            let _ = writeln!(md, "- `{id}`");
        }
    }

    md.push_str("\n## Scenarios\n\n| ID | level | outcome | ms | attempts | clauses | title |\n|---|---|---|---:|---:|---|---|\n");
    for s in &r.scenarios {
        let outcome = match s.throttled.waits {
            0 => label(s.outcome).to_owned(),
            n => format!(
                "{} (throttled: {n} waits, {:.1} s)",
                label(s.outcome),
                s.throttled.waited_ms as f64 / 1000.0
            ),
        };
        let _ = writeln!(
            md,
            "| `{}` | {} | {} | {} | {} | {} | {} |",
            s.id,
            s.level,
            outcome,
            s.duration_ms,
            s.attempts,
            cell(&s.clauses.join(", ")),
            cell(&s.title)
        );
    }

    if let Some(m) = &r.sdk_matrix {
        sdk_matrix(&mut md, m);
    }

    coverage(&mut md, statement);

    md.push_str("\n## Timings\n\n");
    if r.measurements.is_empty() && r.streams.is_empty() {
        md.push_str("No measurements.\n");
    }
    if !r.measurements.is_empty() {
        md.push_str("| scenario | measurement | seconds |\n|---|---|---:|\n");
        for m in &r.measurements {
            let _ = writeln!(
                md,
                "| `{}` | {} | {:.3} |",
                m.scenario,
                cell(&m.name),
                m.seconds
            );
        }
    }
    if !r.streams.is_empty() {
        md.push_str("\n| scenario | SSE step | status | events | first frame ms | EOF ms | end |\n|---|---|---:|---:|---:|---:|---|\n");
        let opt = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".to_owned());
        for s in &r.streams {
            let _ = writeln!(
                md,
                "| `{}` | {} | {} | {} | {} | {} | {} |",
                s.scenario,
                cell(&s.step),
                s.status
                    .map(|v| v.to_string())
                    .unwrap_or_else(|| "-".to_owned()),
                s.events,
                opt(s.first_frame_ms),
                opt(s.eof_ms),
                cell(&s.end)
            );
        }
    }

    md.push_str("\n## Cleanup\n\n");
    let _ = writeln!(
        md,
        "{} absence checks confirmed (404 `not_found` and absent from every list page); {} leftovers found by leak checks and the end-of-run sweep.\n",
        r.cleanup.confirmed_absent.len(),
        r.cleanup.swept.len()
    );
    for a in &r.cleanup.confirmed_absent {
        let _ = writeln!(
            md,
            "- confirmed absent: `{}` {} ({})",
            a.scenario, a.path, a.step
        );
    }
    for s in &r.cleanup.swept {
        let _ = writeln!(
            md,
            "- left behind: `{}` {} ({})",
            s.scenario,
            s.path,
            if s.removed {
                "removed by the sweep"
            } else {
                "the sweep could NOT remove it"
            }
        );
    }
    for i in &r.cleanup.run_sweep.ignored {
        let _ = writeln!(
            md,
            "- {}: {} record(s) of `{}` (as {}) without this run's tag, left alone{}",
            if i.filtered { "warning" } else { "ignored" },
            i.count,
            i.list,
            i.principal,
            if i.filtered {
                " although the list was asked to filter by the tag"
            } else {
                ""
            }
        );
    }
    if let Some(e) = &r.cleanup.run_sweep.error {
        let _ = writeln!(md, "- the end-of-run sweep could not finish: {}", cell(e));
    }
    md
}

/// What the run consumed of the target's account, and the limits it was given.
fn consumption(md: &mut String, c: &crate::target::Consumption) {
    let limit = |v: Option<u64>| v.map_or_else(|| "none".to_owned(), |v| v.to_string());
    let by_status: Vec<String> = c
        .throttles
        .by_status
        .iter()
        .map(|(status, n)| format!("{n}× {status}"))
        .collect();
    md.push_str("\n## Consumption\n\n| sandboxes created | sessions created | most held at once | sandbox-seconds | requests | bytes sent | bytes received | throttle waits | waited |\n");
    md.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    let _ = writeln!(
        md,
        "| {} | {} | {} | {:.1} | {} | {} | {} | {}{} | {:.1} s |",
        c.sandboxes_created,
        c.sessions_created,
        c.peak_sandboxes,
        c.sandbox_seconds,
        c.requests,
        c.bytes_sent,
        c.bytes_received,
        c.throttles.waits,
        if by_status.is_empty() {
            String::new()
        } else {
            format!(" ({})", by_status.join(", "))
        },
        c.throttles.waited_ms as f64 / 1000.0
    );
    let _ = writeln!(
        md,
        "\nAccount limits: --max-sandboxes {}, --max-sandbox-seconds {}{}.",
        limit(c.limits.max_sandboxes),
        limit(c.limits.max_sandbox_seconds),
        if c.budget_ended {
            "; the sandbox-seconds budget ended the run"
        } else {
            ""
        }
    );
}

/// The clause coverage table: every MUST clause with the scenarios citing it and their
/// outcomes, then the clauses nothing in the run judged.
/// The SDK matrix: a row per journey, a column per SDK, and what each cell that did not pass
/// said.
fn sdk_matrix(md: &mut String, m: &crate::sdk::SdkMatrix) {
    use crate::sdk::CellOutcome;
    let _ = writeln!(
        md,
        "\n## SDK matrix\n\nEach journey drives the target through a real SDK at a pinned version; the newest release of each language judges the target (its journeys are the `E2B-SDK-…` scenarios above).\n"
    );
    md.push_str("| journey |");
    for c in &m.sdks {
        let judged = if c.judged { " (judges)" } else { "" };
        let _ = write!(md, " `{}`{judged} |", cell(&c.sdk));
    }
    md.push_str("\n|---|");
    md.push_str(&"---|".repeat(m.sdks.len()));
    md.push('\n');
    let mut notes = Vec::new();
    for row in &m.journeys {
        let _ = write!(md, "| `{}` {} |", row.journey, cell(&row.title));
        for col in &m.sdks {
            let shown = match m.cell(&row.journey, &col.sdk) {
                None => "not run",
                Some(c) => {
                    if let Some(d) = &c.detail {
                        notes.push(format!("`{}` with `{}`: {}", row.journey, col.sdk, d));
                    }
                    match c.outcome {
                        CellOutcome::Pass => "PASS",
                        CellOutcome::Skip => "SKIP",
                        CellOutcome::Fail => "FAIL",
                        CellOutcome::Error => "ERROR",
                    }
                }
            };
            let _ = write!(md, " {shown} |");
        }
        md.push('\n');
    }
    if !notes.is_empty() {
        md.push('\n');
        for n in notes {
            let _ = writeln!(md, "- {}", cell(&n));
        }
    }
}

fn coverage(md: &mut String, statement: &Statement) {
    let r = &statement.predicate;
    let c = &r.coverage;
    let _ = writeln!(
        md,
        "\n## Clause coverage\n\n{} of {} MUST clauses of docs/protocol.md were judged by a scenario of this run; {} were not.\n",
        c.checked,
        c.must_clauses,
        c.unchecked.len()
    );
    if !c.unchecked.is_empty() {
        let _ = writeln!(
            md,
            "Not judged by any scenario of this run: {}.\n",
            c.unchecked.join(", ")
        );
    }
    md.push_str("| clause | judged | scenarios |\n|---|---|---|\n");
    for row in &c.clauses {
        let scenarios: Vec<String> = row
            .scenarios
            .iter()
            .map(|id| match r.scenarios.iter().find(|s| &s.id == id) {
                Some(s) => format!("`{id}` {}", label(s.outcome)),
                None => format!("`{id}`"),
            })
            .collect();
        let _ = writeln!(
            md,
            "| {} | {} | {} |",
            row.clause,
            if row.checked { "yes" } else { "**no**" },
            if scenarios.is_empty() {
                "none".to_owned()
            } else {
                cell(&scenarios.join(", "))
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_cannot_break_the_table() {
        assert_eq!(cell("a|b\nc"), "a\\|b c");
    }
}
