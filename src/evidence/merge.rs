//! `sandspec evidence merge DIR... --out DIR`: the folders of `--shard 1/n ... n/n`, the shards
//! of one run, become one verified folder: one receipt naming the shards, one verdict judged
//! over their union with the run's own rules, one report. Shards of one run share the suite
//! commit and version, the selection (family, filters, retries, certification, label) and the
//! target (the embedded reference server at one build digest is one target, even on several
//! machines); every shard of `n` is there, once. Anything else is refused, with what differs.
//!
//! Nothing is re-run or re-sanitized: the transcripts are the shards' own bytes, already
//! scanned, and the merged folder is scanned and verified again before it is put in place.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::folder::{RECEIPT, sha256_hex};
use super::receipt::{
    Cleanup, Counts, Coverage, OutcomeLabel, ProfileResult, Receipt, RunSweepRecord,
    ScenarioResult, ShardRef, Statement,
};
use super::sanitize::Sanitizer;
use super::sign::SigningKey;
use crate::engine::Outcome;
use crate::gate::{Gate, GateRow};
use crate::report::{ALL, FamilyVerdict, Judged, RunFacts, RunReport, ScenarioReport, Scope};
use crate::scenario::Level;

/// Why shards were not merged.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// They are not the shards of one run, or one does not verify: a usage error.
    #[error("{0}")]
    Refused(String),
    /// The merged folder could not be written.
    #[error("cannot write the merged folder: {0}")]
    Write(String),
}

/// A shard as read: where, its receipt, its files and its index.
struct Shard {
    dir: PathBuf,
    statement: Statement,
    files: BTreeMap<String, Vec<u8>>,
    index: usize,
    count: usize,
}

/// A merged folder: where, and its receipt.
#[derive(Debug)]
pub struct Merged {
    pub dir: PathBuf,
    pub statement: Statement,
}

/// Merges the shard folders `dirs` into a new folder at `out` (which must not exist, or be
/// empty), signed with `key` when given. `Err` says why the shards are not one run's, or why
/// the merged folder could not be written.
pub fn merge(dirs: &[PathBuf], out: &Path, key: Option<&SigningKey>) -> Result<Merged, MergeError> {
    if dirs.is_empty() {
        return Err(MergeError::Refused("no shard folder given".into()));
    }
    let mut shards = Vec::with_capacity(dirs.len());
    for dir in dirs {
        let (statement, files) = super::verify::load_verified(dir).map_err(|problems| {
            MergeError::Refused(format!(
                "{} does not verify, so it cannot be merged:\n  {}",
                dir.display(),
                problems.join("\n  ")
            ))
        })?;
        let Some(shard) = statement.predicate.selection.shard.clone() else {
            return Err(MergeError::Refused(format!(
                "{} is not a shard: its run had no --shard",
                dir.display()
            )));
        };
        let (index, count) = shard
            .split_once('/')
            .and_then(|(i, n)| Some((i.parse().ok()?, n.parse().ok()?)))
            .ok_or_else(|| {
                MergeError::Refused(format!("{}: shard `{shard}` is not `i/n`", dir.display()))
            })?;
        shards.push(Shard {
            dir: dir.clone(),
            statement,
            files,
            index,
            count,
        });
    }
    shards.sort_by_key(|s| s.index);
    one_run(&shards).map_err(MergeError::Refused)?;
    let statement = merged_statement(&shards).map_err(MergeError::Refused)?;
    let mut files = BTreeMap::new();
    for shard in &shards {
        for s in &shard.statement.predicate.scenarios {
            if let Some(t) = &s.transcript {
                files.insert(t.path.clone(), shard.files[&t.path].clone());
            }
        }
    }
    let junit = crate::report::junit_xml(
        &junit_report(&statement.predicate),
        &super::writer::expected_failures(statement.predicate.gate.as_ref()),
    );
    // The shards' secrets are not known here; the scan still looks for every credential
    // shape the sanitizer knows.
    let scanner = Sanitizer::new();
    let files = super::writer::finish(statement.clone(), files, &junit, &scanner, key)
        .map_err(|e| MergeError::Write(e.to_string()))?;
    super::writer::write_atomically(out, &files).map_err(|e| MergeError::Write(e.to_string()))?;
    Ok(Merged {
        dir: out.to_path_buf(),
        statement,
    })
}

/// Refuses shards that are not all of one run: what must agree, and every index of `n` once.
fn one_run(shards: &[Shard]) -> Result<(), String> {
    let first = &shards[0];
    let r0 = &first.statement.predicate;
    for s in &shards[1..] {
        let r = &s.statement.predicate;
        let mut differ = Vec::new();
        if s.count != first.count {
            differ.push(format!("shard count {} vs {}", s.count, first.count));
        }
        if r.suite != r0.suite {
            differ.push(format!(
                "suite {} {} vs {} {}",
                r.suite.version, r.suite.commit, r0.suite.version, r0.suite.commit
            ));
        }
        if s.statement.subject != first.statement.subject {
            differ.push("the tested build (subject digest)".to_owned());
        }
        if (r.target.kind.as_str(), r.target.defects.as_slice())
            != (r0.target.kind.as_str(), r0.target.defects.as_slice())
            || (r.target.kind != "reference" && r.target.base_url != r0.target.base_url)
        {
            differ.push(format!(
                "target {} ({}) vs {} ({})",
                r.target.base_url, r.target.kind, r0.target.base_url, r0.target.kind
            ));
        }
        let selection = |r: &Receipt| {
            (
                r.selection.profile.clone(),
                r.selection.filters.clone(),
                r.selection.retries,
                r.selection.certify,
                r.selection.label.clone(),
                r.selection.catalog,
            )
        };
        if selection(r) != selection(r0) {
            differ.push(
                "the selection (family, filters, retries, --certify, --label or the catalog)"
                    .to_owned(),
            );
        }
        if r.gate.as_ref().map(|g| &g.baseline) != r0.gate.as_ref().map(|g| &g.baseline) {
            differ.push("the baseline of expected failures".to_owned());
        }
        if !differ.is_empty() {
            return Err(format!(
                "{} is not a shard of the same run as {}: {}",
                s.dir.display(),
                first.dir.display(),
                differ.join("; ")
            ));
        }
    }
    let mut seen: BTreeMap<usize, &Path> = BTreeMap::new();
    for s in shards {
        if let Some(other) = seen.insert(s.index, &s.dir) {
            return Err(format!(
                "shard {}/{} is given twice: {} and {}",
                s.index,
                s.count,
                other.display(),
                s.dir.display()
            ));
        }
    }
    let missing: Vec<String> = (1..=first.count)
        .filter(|i| !seen.contains_key(i))
        .map(|i| format!("{i}/{}", first.count))
        .collect();
    if !missing.is_empty() {
        return Err(format!("shard(s) missing: {}", missing.join(", ")));
    }
    Ok(())
}

/// The receipt of the whole run: the shards' scenarios, cleanup and measurements together,
/// the verdicts and the gate judged again over all of them.
fn merged_statement(shards: &[Shard]) -> Result<Statement, String> {
    let parts: Vec<&Receipt> = shards.iter().map(|s| &s.statement.predicate).collect();
    let first = parts[0];
    let mut scenarios: Vec<ScenarioResult> = parts
        .iter()
        .flat_map(|r| r.scenarios.iter().cloned())
        .collect();
    scenarios.sort_by(|a, b| a.id.cmp(&b.id));
    let ids: BTreeSet<&str> = scenarios.iter().map(|s| s.id.as_str()).collect();
    if ids.len() != scenarios.len() {
        return Err("a scenario ran in two shards: these are not shards of one selection".into());
    }
    let concat = |f: fn(&Receipt) -> Vec<String>| -> Vec<String> {
        parts.iter().flat_map(|r| f(r)).collect()
    };
    let not_run = concat(|r| r.not_run.clone());
    let mut selection = first.selection.clone();
    selection.shard = None;
    selection.not_applicable = parts
        .iter()
        .flat_map(|r| r.selection.not_applicable.iter().cloned())
        .collect();
    selection.selected = parts.iter().map(|r| r.selection.selected).sum();
    selection.subset = selection.selected < selection.catalog;
    let mut cleanup = Cleanup {
        run_sweep: RunSweepRecord::default(),
        ..Cleanup::default()
    };
    let mut errors = Vec::new();
    for r in &parts {
        cleanup
            .confirmed_absent
            .extend(r.cleanup.confirmed_absent.iter().cloned());
        cleanup.swept.extend(r.cleanup.swept.iter().cloned());
        cleanup
            .run_sweep
            .ignored
            .extend(r.cleanup.run_sweep.ignored.iter().cloned());
        errors.extend(r.cleanup.run_sweep.error.iter().cloned());
    }
    cleanup.run_sweep.error = (!errors.is_empty()).then(|| errors.join("; "));
    let mut counts = Counts::default();
    for r in &parts {
        let c = &r.counts;
        counts.total += c.total;
        counts.pass += c.pass;
        counts.flaky += c.flaky;
        counts.skip += c.skip;
        counts.fail += c.fail;
        counts.error += c.error;
        counts.not_run += c.not_run;
        counts.requests += c.requests;
        counts.positive_operations += c.positive_operations;
        counts.authentication_rejections += c.authentication_rejections;
    }
    let consumption = crate::target::Consumption::of_shards(parts.iter().map(|r| &r.consumption));
    // The verdicts, judged again with the run's rules over every shard's scenarios.
    let mut facts = RunFacts {
        certify: selection.certify,
        never_ran: not_run.len(),
        budget_ended: consumption.budget_ended,
        left_behind: cleanup
            .swept
            .iter()
            .filter(|s| s.scenario == super::receipt::RUN_SWEEP)
            .count(),
        sweep_error: cleanup.run_sweep.error.clone(),
        ..RunFacts::default()
    };
    for r in &parts {
        for p in r.profiles.iter().filter(|p| p.profile != ALL) {
            *facts.selected.entry(p.profile.clone()).or_default() += p.selected;
            facts.catalog.insert(p.profile.clone(), p.catalog);
        }
    }
    let families: usize = facts.selected.values().sum();
    let family_catalog: usize = facts.catalog.values().sum();
    facts
        .selected
        .insert(String::new(), selection.selected.saturating_sub(families));
    facts.catalog.insert(
        String::new(),
        selection.catalog.saturating_sub(family_catalog),
    );
    let rows: Vec<Judged<'_>> = scenarios
        .iter()
        .map(|s| {
            Ok(Judged {
                id: &s.id,
                family: &s.family,
                level: level(&s.level)?,
                outcome: s.outcome.judged(),
            })
        })
        .collect::<Result<_, String>>()?;
    let verdicts = crate::report::judge(&rows, &facts);
    let profiles: Vec<ProfileResult> = verdicts.iter().map(profile_result).collect();
    let gate = first.gate.as_ref().map(|g| {
        let gate_rows: Vec<GateRow<'_>> = rows
            .iter()
            .zip(&scenarios)
            .map(|(judged, s)| GateRow {
                judged: *judged,
                failed_step: s.failed_step.as_deref(),
            })
            .collect();
        Gate::judge(
            &g.baseline,
            &gate_rows,
            &facts,
            &last(&parts).ended_at[..10],
        )
    });
    let clauses: Vec<&str> = first
        .coverage
        .clauses
        .iter()
        .map(|c| c.clause.as_str())
        .collect();
    let coverage = Coverage::of(clauses, &scenarios);
    let started_at = parts
        .iter()
        .map(|r| r.started_at.clone())
        .min()
        .unwrap_or_default();
    let ended_at = last(&parts).ended_at.clone();
    let merged_from = shards
        .iter()
        .map(|s| {
            let r = &s.statement.predicate;
            ShardRef {
                shard: format!("{}/{}", s.index, s.count),
                run_id: r.run_id.clone(),
                started_at: r.started_at.clone(),
                ended_at: r.ended_at.clone(),
                receipt_sha256: sha256_hex(&s.files[RECEIPT]),
                environment: r.environment.clone(),
            }
        })
        .collect();
    let mut sanitizer = first.sanitizer.clone();
    sanitizer.secrets_registered = parts.iter().map(|r| r.sanitizer.secrets_registered).sum();
    sanitizer.canary_checked = parts.iter().all(|r| r.sanitizer.canary_checked);
    let predicate = Receipt {
        run_id: format!("{}-merged", first.run_id),
        started_at: started_at.clone(),
        ended_at: ended_at.clone(),
        duration_ms: span_ms(&started_at, &ended_at)
            .unwrap_or_else(|| parts.iter().map(|r| r.duration_ms).max().unwrap_or(0)),
        interrupted: parts.iter().any(|r| r.interrupted),
        not_run,
        suite: first.suite.clone(),
        target: first.target.clone(),
        selection,
        scenarios,
        profiles,
        coverage,
        counts,
        measurements: parts
            .iter()
            .flat_map(|r| r.measurements.iter().cloned())
            .collect(),
        streams: parts
            .iter()
            .flat_map(|r| r.streams.iter().cloned())
            .collect(),
        cleanup,
        consumption,
        environment: first.environment.clone(),
        sanitizer,
        sdk_matrix: parts.iter().find_map(|r| r.sdk_matrix.clone()),
        merged_from,
        gate,
        documents: Vec::new(),
    };
    Ok(Statement {
        predicate,
        ..shards[0].statement.clone()
    })
}

/// The shard that ended last.
fn last<'a>(parts: &[&'a Receipt]) -> &'a Receipt {
    parts
        .iter()
        .max_by(|a, b| a.ended_at.cmp(&b.ended_at))
        .copied()
        .expect("at least one shard")
}

fn level(text: &str) -> Result<Level, String> {
    match text {
        "MUST" => Ok(Level::Must),
        "SHOULD" => Ok(Level::Should),
        other => Err(format!("unknown level `{other}`")),
    }
}

/// Milliseconds from `start` to `end` (RFC 3339).
fn span_ms(start: &str, end: &str) -> Option<u64> {
    use time::format_description::well_known::Rfc3339;
    let s = time::OffsetDateTime::parse(start, &Rfc3339).ok()?;
    let e = time::OffsetDateTime::parse(end, &Rfc3339).ok()?;
    u64::try_from((e - s).whole_milliseconds()).ok()
}

fn profile_result(p: &FamilyVerdict) -> ProfileResult {
    ProfileResult {
        profile: p.profile.clone(),
        verdict: p.verdict.as_str().to_owned(),
        reason: p.reason.clone(),
        counts: p
            .counts
            .iter()
            .map(|(k, v)| ((*k).to_owned(), *v))
            .collect(),
        must_run: p.must_run,
        selected: p.scope.selected,
        catalog: p.scope.catalog,
        subset: p.scope.is_subset(),
    }
}

/// What JUnit is rendered from, rebuilt from a receipt: each scenario's outcome as the run had
/// it, and the verdicts.
fn junit_report(r: &Receipt) -> RunReport {
    let verdict = |text: &str| match text {
        "conformant" => crate::report::Verdict::Conformant,
        "partial" => crate::report::Verdict::Partial,
        "not-tested" => crate::report::Verdict::NotTested,
        _ => crate::report::Verdict::NonConformant,
    };
    RunReport {
        run_id: r.run_id.clone(),
        suite_version: r.suite.version.clone(),
        started_at: r.started_at.clone(),
        finished_at: r.ended_at.clone(),
        duration_ms: r.duration_ms,
        target: crate::report::TargetInfo {
            kind: r.target.kind.clone(),
            url: r.target.base_url.clone(),
            server_name: r.target.server_name.clone(),
            server_version: r.target.server_version.clone(),
            defects: r.target.defects.clone(),
            capabilities: serde_json::Value::Null,
        },
        profile: r.selection.profile.clone(),
        filters: r.selection.filters.clone(),
        shard: None,
        label: r.selection.label.clone(),
        retries: r.selection.retries,
        certify: r.selection.certify,
        scenarios: r
            .scenarios
            .iter()
            .map(|s| ScenarioReport {
                id: s.id.clone(),
                title: s.title.clone(),
                family: s.family.clone(),
                file: String::new(),
                level: level(&s.level).unwrap_or(Level::Must),
                clauses: s.clauses.clone(),
                tags: Vec::new(),
                defects: Vec::new(),
                outcome: outcome_of(s),
                started_ms: s.started_ms,
                duration_ms: s.duration_ms,
                attempts: s.attempts,
                measurements: s.measurements.clone(),
                swept: Vec::new(),
                faults: s.faults.clone(),
                throttled: s.throttled,
                transcript: Vec::new(),
            })
            .collect(),
        profiles: r
            .profiles
            .iter()
            .map(|p| FamilyVerdict {
                profile: p.profile.clone(),
                verdict: verdict(&p.verdict),
                reason: p.reason.clone(),
                counts: BTreeMap::new(),
                must_run: p.must_run,
                scope: Scope {
                    selected: p.selected,
                    catalog: p.catalog,
                },
            })
            .collect(),
        run_sweep: crate::live::RunSweep::default(),
        not_applicable: r.selection.not_applicable.clone(),
        sdk_matrix: r.sdk_matrix.clone(),
        consumption: r.consumption.clone(),
    }
}

/// A scenario's outcome as the run had it, from the receipt's label, reason and failed step
/// (the receipt writes a failure's reason as `<step>: <reason>`, a flaky pass's as `passed on
/// attempt <n>; first failure: <reason>`).
fn outcome_of(s: &ScenarioResult) -> Outcome {
    let reason = s.reason.clone().unwrap_or_default();
    match s.outcome {
        OutcomeLabel::Pass => Outcome::Pass,
        OutcomeLabel::Flaky => Outcome::Flaky {
            attempts: s.attempts,
            first_failure: reason
                .split_once("; first failure: ")
                .map_or(reason.clone(), |(_, first)| first.to_owned()),
        },
        OutcomeLabel::Skip => Outcome::Skip { reason },
        OutcomeLabel::Error => Outcome::Error { reason },
        OutcomeLabel::Fail => {
            let step = s.failed_step.clone().unwrap_or_default();
            let reason = reason
                .strip_prefix(&format!("{step}: "))
                .map_or(reason.clone(), str::to_owned);
            Outcome::Fail { step, reason }
        }
    }
}
