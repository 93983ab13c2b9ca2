//! `sandspec evidence verify <dir> [--key PUBFILE]`: what a reviewer runs on a run folder.
//!
//! It proves: every file the manifest lists is there with the listed SHA-256 and nothing else
//! is; the receipt satisfies the published schema and agrees with itself and the folder
//! (counts, the digests of the transcripts and views it names, no file it does not name, every
//! profile verdict judged again from the scenario outcomes with the run's own rules, the
//! selection's scope, the clause coverage); no file holds a credential shape (bearer and basic
//! credentials, API-key shapes, JWTs, private keys, passwords in URLs, unredacted credential
//! headers, parameters and fields). With a key, also that `receipt.dsse.json` holds that key's
//! signature over `receipt.json`, which makes the whole folder the key holder's. Without one it
//! cannot prove who wrote the folder; it cannot prove the catalog size a receipt states, and it
//! cannot find run-time secrets that have no recognisable shape, because their values are not
//! known after the run.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use super::folder::{MANIFEST, Manifest, RECEIPT, sha256_hex};
use super::receipt::{Coverage, OutcomeLabel, Receipt, Statement, suite_commit};
use super::sanitize::Sanitizer;
use super::schema::validate_receipt;
use super::sign::{ENVELOPE, Envelope, VerifyingKey, envelope_problems};
use crate::gate::{Gate, GateRow};
use crate::report::{ALL, Judged, RunFacts, judge};
use crate::scenario::Level;

/// One reason a folder does not verify.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// The folder or a file in it cannot be read.
    Unreadable { file: String, detail: String },
    /// `manifest.json` is missing or malformed.
    Manifest(String),
    /// Listed in the manifest, not in the folder.
    Missing(String),
    /// In the folder, not in the manifest.
    Unlisted(String),
    /// Content differs from the manifest's digest.
    DigestMismatch(String),
    /// `receipt.json` breaks the schema.
    Schema(String),
    /// The receipt contradicts itself or the folder.
    Inconsistent(String),
    /// The envelope is malformed, or (with a key) missing or not signed by it.
    Signature(String),
    /// A credential shape in a file (the value is never shown).
    Secret {
        file: String,
        line: usize,
        what: String,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Unreadable { file, detail } => write!(f, "cannot read {file}: {detail}"),
            Problem::Manifest(d) => write!(f, "manifest: {d}"),
            Problem::Missing(p) => {
                write!(f, "missing: {p} is listed in the manifest but not present")
            }
            Problem::Unlisted(p) => write!(f, "unlisted: {p} is present but not in the manifest"),
            Problem::DigestMismatch(p) => {
                write!(f, "digest mismatch: {p} differs from its manifest SHA-256")
            }
            Problem::Schema(d) => write!(f, "receipt schema: {d}"),
            Problem::Inconsistent(d) => write!(f, "receipt inconsistent: {d}"),
            Problem::Signature(d) => write!(f, "signature: {d}"),
            Problem::Secret { file, line, what } => {
                write!(f, "secret: {file}:{line} holds a {what}")
            }
        }
    }
}

/// What `verify` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    pub dir: PathBuf,
    pub files_checked: usize,
    /// The folder holds a signed receipt (`receipt.dsse.json`).
    pub signed: bool,
    /// The key whose signature was checked and held, by key ID.
    pub signature_by: Option<String>,
    pub problems: Vec<Problem>,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Checks a run folder. Every check runs, so one report lists every problem.
pub fn verify(dir: &Path) -> VerifyReport {
    verify_with_key(dir, None)
}

/// [`verify`], and with `key` also that the receipt is signed by it.
pub fn verify_with_key(dir: &Path, key: Option<&VerifyingKey>) -> VerifyReport {
    let mut problems = Vec::new();
    let mut present = BTreeMap::new();
    if let Err(e) = collect(dir, dir, &mut present) {
        problems.push(Problem::Unreadable {
            file: dir.display().to_string(),
            detail: e.to_string(),
        });
    }
    let files_checked = present.len();

    // Manifest: digests, nothing missing, nothing extra.
    match present
        .get(MANIFEST)
        .map(|b| serde_json::from_slice::<Manifest>(b))
    {
        None => problems.push(Problem::Manifest(format!("{MANIFEST} is missing"))),
        Some(Err(e)) => problems.push(Problem::Manifest(format!(
            "not a valid manifest ({})",
            json_error(&e)
        ))),
        Some(Ok(manifest)) => {
            let mut listed = BTreeSet::new();
            for entry in &manifest.files {
                if !listed.insert(entry.path.as_str()) {
                    problems.push(Problem::Manifest(format!("{} is listed twice", entry.path)));
                }
                match present.get(&entry.path) {
                    None => problems.push(Problem::Missing(entry.path.clone())),
                    Some(bytes)
                        if sha256_hex(bytes) != entry.sha256
                            || bytes.len() as u64 != entry.bytes =>
                    {
                        problems.push(Problem::DigestMismatch(entry.path.clone()));
                    }
                    Some(_) => {}
                }
            }
            for path in present
                .keys()
                .filter(|p| p.as_str() != MANIFEST && !listed.contains(p.as_str()))
            {
                problems.push(Problem::Unlisted(path.clone()));
            }
        }
    }

    // Receipt: schema, then the cross-checks the schema cannot express.
    match present
        .get(RECEIPT)
        .map(|b| serde_json::from_slice::<serde_json::Value>(b))
    {
        None => problems.push(Problem::Schema(format!("{RECEIPT} is missing"))),
        Some(Err(_)) => problems.push(Problem::Schema(format!("{RECEIPT} is not JSON"))),
        Some(Ok(value)) => match validate_receipt(&value) {
            Err(errors) => problems.extend(errors.into_iter().map(Problem::Schema)),
            Ok(()) => match serde_json::from_value::<Statement>(value) {
                Err(e) => problems.push(Problem::Schema(format!(
                    "does not read back ({})",
                    json_error(&e)
                ))),
                Ok(statement) => problems.extend(consistency(&statement, &present)),
            },
        },
    }

    // The envelope: its form whenever it is there; the signature when a key is given.
    let signed = present.contains_key(ENVELOPE);
    let mut signature_by = None;
    match (present.get(ENVELOPE), key) {
        (None, None) => {}
        (None, Some(_)) => problems.push(Problem::Signature(format!(
            "the receipt is not signed ({ENVELOPE} is missing)"
        ))),
        (Some(bytes), key) => match serde_json::from_slice::<Envelope>(bytes) {
            Err(e) => problems.push(Problem::Signature(format!(
                "{ENVELOPE} is not a DSSE envelope ({})",
                json_error(&e)
            ))),
            Ok(envelope) => {
                let receipt = present.get(RECEIPT).map(Vec::as_slice).unwrap_or_default();
                let form = envelope_problems(&envelope, receipt);
                problems.extend(
                    form.iter()
                        .map(|p| Problem::Signature(format!("{ENVELOPE}: {p}"))),
                );
                if let Some(key) = key {
                    if key.verifies(&envelope) {
                        if form.is_empty() {
                            signature_by = Some(key.keyid().to_owned());
                        }
                    } else {
                        problems.push(Problem::Signature(format!(
                            "no signature in {ENVELOPE} verifies with key {}",
                            key.keyid()
                        )));
                    }
                }
            }
        },
    }

    // Secret shapes in every file, the manifest included.
    let scanner = Sanitizer::new();
    for (name, bytes) in &present {
        for (line, what) in scanned_leaks(&scanner, name, bytes) {
            problems.push(Problem::Secret {
                file: name.clone(),
                line,
                what,
            });
        }
    }
    VerifyReport {
        dir: dir.to_path_buf(),
        files_checked,
        signed,
        signature_by,
        problems,
    }
}

/// Counts agree with the scenarios; every transcript the receipt names exists with its digest.
fn consistency(statement: &Statement, present: &BTreeMap<String, Vec<u8>>) -> Vec<Problem> {
    let r = &statement.predicate;
    let mut out = Vec::new();
    let tally = |label: OutcomeLabel| r.scenarios.iter().filter(|s| s.outcome == label).count();
    let c = &r.counts;
    let expected = [
        ("total", c.total, r.scenarios.len()),
        ("pass", c.pass, tally(OutcomeLabel::Pass)),
        ("flaky", c.flaky, tally(OutcomeLabel::Flaky)),
        ("skip", c.skip, tally(OutcomeLabel::Skip)),
        ("fail", c.fail, tally(OutcomeLabel::Fail)),
        ("error", c.error, tally(OutcomeLabel::Error)),
        ("not_run", c.not_run, r.not_run.len()),
    ];
    for (name, stated, actual) in expected {
        if stated != actual {
            out.push(Problem::Inconsistent(format!(
                "counts.{name} is {stated} but the scenarios give {actual}"
            )));
        }
    }
    out.extend(verdicts_follow(r));
    out.extend(coverage_follows(statement));
    // Every file is one the receipt accounts for: itself, its envelope, the manifest, and the
    // transcripts and views it names with their digests.
    let mut named: BTreeSet<&str> = [RECEIPT, ENVELOPE, MANIFEST].into_iter().collect();
    for d in &r.documents {
        named.insert(d.path.as_str());
        match present.get(&d.path) {
            None => out.push(Problem::Inconsistent(format!("{} is missing", d.path))),
            Some(bytes) if sha256_hex(bytes) != d.sha256 => out.push(Problem::Inconsistent(
                format!("{} differs from the receipt's digest", d.path),
            )),
            Some(_) => {}
        }
    }
    named.extend(
        r.scenarios
            .iter()
            .filter_map(|s| s.transcript.as_ref().map(|t| t.path.as_str())),
    );
    for path in present.keys().filter(|p| !named.contains(p.as_str())) {
        out.push(Problem::Inconsistent(format!(
            "{path} is in the folder but the receipt does not name it"
        )));
    }
    for s in &r.scenarios {
        if r.not_run.contains(&s.id) {
            out.push(Problem::Inconsistent(format!(
                "{} is both reported and listed as never run",
                s.id
            )));
        }
        if let Some(t) = &s.transcript {
            match present.get(&t.path) {
                None => out.push(Problem::Inconsistent(format!(
                    "{}: transcript {} is missing",
                    s.id, t.path
                ))),
                Some(bytes) if sha256_hex(bytes) != t.sha256 => {
                    out.push(Problem::Inconsistent(format!(
                        "{}: transcript {} differs from the receipt's digest",
                        s.id, t.path
                    )));
                }
                Some(_) => {}
            }
        }
    }
    out
}

/// Every verdict is judged again, with the run's own rules, from the scenario outcomes the
/// receipt records; the selection's scope must agree with what the receipt holds.
fn verdicts_follow(r: &Receipt) -> Vec<Problem> {
    let mut out = Vec::new();
    let sel = &r.selection;
    let mut bad = |msg: String| out.push(Problem::Inconsistent(msg));

    // The scope: what was selected, out of what, and whether that is the whole catalog.
    let accounted = r.scenarios.len() + sel.not_applicable.len() + r.not_run.len();
    if sel.selected != accounted {
        bad(format!(
            "selection.selected is {} but the receipt accounts for {accounted} scenarios (reported, not applicable, never run)",
            sel.selected
        ));
    }
    if sel.selected > sel.catalog {
        bad(format!(
            "selection.selected ({}) exceeds selection.catalog ({})",
            sel.selected, sel.catalog
        ));
    }
    if sel.subset != (sel.selected < sel.catalog) {
        bad(format!(
            "selection.subset is {} but {} of {} scenarios were selected",
            sel.subset, sel.selected, sel.catalog
        ));
    }
    let narrowed = !sel.filters.is_empty() || sel.shard.is_some() || sel.profile != ALL;
    if !narrowed && sel.subset {
        bad(
            "selection.subset is true but neither --family, --filter nor --shard narrowed the run"
                .to_owned(),
        );
    }
    if sel.certify && (narrowed || sel.subset) {
        bad("a --certify run covers the whole catalog, but this selection is narrowed".to_owned());
    }

    // The verdicts: the same rules, fed the receipt's rows and the stated scope per profile.
    let mut rows = Vec::with_capacity(r.scenarios.len());
    for s in &r.scenarios {
        let level = match s.level.as_str() {
            "MUST" => Level::Must,
            "SHOULD" => Level::Should,
            other => {
                bad(format!("{}: unknown level `{other}`", s.id));
                continue;
            }
        };
        rows.push(Judged {
            id: &s.id,
            family: &s.family,
            level,
            outcome: s.outcome.judged(),
        });
    }
    let mut facts = RunFacts {
        certify: sel.certify,
        never_ran: r.not_run.len(),
        left_behind: r
            .cleanup
            .swept
            .iter()
            .filter(|s| s.scenario == super::receipt::RUN_SWEEP)
            .count(),
        sweep_error: r.cleanup.run_sweep.error.clone(),
        budget_ended: r.consumption.budget_ended,
        ..RunFacts::default()
    };
    for p in r.profiles.iter().filter(|p| p.profile != ALL) {
        facts.selected.insert(p.profile.clone(), p.selected);
        facts.catalog.insert(p.profile.clone(), p.catalog);
    }
    let families: usize = facts.selected.values().sum();
    let family_catalog: usize = facts.catalog.values().sum();
    // `all` spans families with no reported scenario too; they carry the remainder.
    facts
        .selected
        .insert(String::new(), sel.selected.saturating_sub(families));
    facts
        .catalog
        .insert(String::new(), sel.catalog.saturating_sub(family_catalog));
    if families > sel.selected || family_catalog > sel.catalog {
        bad("the profiles' scopes add up to more than the selection's".to_owned());
    }
    let expected = judge(&rows, &facts);
    let stated_names: Vec<&str> = r.profiles.iter().map(|p| p.profile.as_str()).collect();
    let expected_names: Vec<&str> = expected.iter().map(|p| p.profile.as_str()).collect();
    if stated_names != expected_names {
        bad(format!(
            "profiles are [{}] but the scenarios' families give [{}]",
            stated_names.join(", "),
            expected_names.join(", ")
        ));
    }
    for want in &expected {
        let Some(got) = r.profiles.iter().find(|p| p.profile == want.profile) else {
            continue;
        };
        let counts: BTreeMap<String, usize> = want
            .counts
            .iter()
            .map(|(k, v)| ((*k).to_owned(), *v))
            .collect();
        let rejudged = (
            want.verdict.as_str(),
            want.reason.as_deref(),
            &counts,
            want.must_run,
        );
        let stated = (
            got.verdict.as_str(),
            got.reason.as_deref(),
            &got.counts,
            got.must_run,
        );
        if rejudged != stated {
            bad(format!(
                "profile `{}`: the receipt says {} ({}) but its scenario outcomes give {} ({})",
                want.profile,
                got.verdict,
                got.reason.as_deref().unwrap_or("no reason"),
                want.verdict,
                want.reason.as_deref().unwrap_or("no reason"),
            ));
        }
        let in_family = if want.profile == ALL {
            r.scenarios.len()
        } else {
            rows.iter().filter(|s| s.family == want.profile).count()
        };
        if got.subset != (got.selected < got.catalog)
            || (got.subset && !narrowed)
            || got.selected > got.catalog
            || got.selected < in_family
            || (want.profile == ALL && (got.selected, got.catalog) != (sel.selected, sel.catalog))
        {
            bad(format!(
                "profile `{}`: scope {} of {} (subset {}) does not follow from the selection and its {in_family} reported scenarios",
                want.profile, got.selected, got.catalog, got.subset
            ));
        }
    }
    // The gate: the same rules, fed the receipt's rows, its baseline and the day it ended.
    if let Some(stated) = &r.gate {
        let gate_rows: Vec<GateRow<'_>> = rows
            .iter()
            .zip(&r.scenarios)
            .map(|(judged, s)| GateRow {
                judged: *judged,
                failed_step: s.failed_step.as_deref(),
            })
            .collect();
        let day = r.ended_at.get(..10).unwrap_or_default();
        let rejudged = Gate::judge(&stated.baseline, &gate_rows, &facts, day);
        if &rejudged != stated {
            bad(format!(
                "the gate says {} but the scenario outcomes and the baseline give {}",
                stated.line(),
                rejudged.line()
            ));
        }
    }
    out
}

/// The coverage table agrees with the scenarios' citations and outcomes. Its clause list is
/// compared with this build's `docs/protocol.md` only when the receipt was written by the
/// same commit: an older suite may have known fewer clauses.
fn coverage_follows(statement: &Statement) -> Vec<Problem> {
    let r = &statement.predicate;
    let mut out = Vec::new();
    let stated: Vec<&str> = r
        .coverage
        .clauses
        .iter()
        .map(|c| c.clause.as_str())
        .collect();
    let recomputed = Coverage::of(stated.iter().copied(), &r.scenarios);
    if recomputed != r.coverage {
        let wrong: Vec<&str> = recomputed
            .clauses
            .iter()
            .zip(&r.coverage.clauses)
            .filter(|(a, b)| a != b)
            .map(|(a, _)| a.clause.as_str())
            .collect();
        out.push(Problem::Inconsistent(format!(
            "coverage does not follow from the scenarios' clauses and outcomes{}",
            if wrong.is_empty() {
                " (its totals or its unchecked list)".to_owned()
            } else {
                format!(" (rows {})", wrong.join(", "))
            }
        )));
    }
    let commit = suite_commit();
    if commit != "unknown" && r.suite.commit == commit {
        let known: Vec<&str> = crate::profile::v1::must_clauses().collect();
        if stated != known {
            out.push(Problem::Inconsistent(format!(
                "coverage lists {} MUST clauses; docs/protocol.md of this suite's commit has {}",
                stated.len(),
                known.len()
            )));
        }
    }
    out
}

/// Where a JSON document went wrong, without the offending value (it may be a secret).
fn json_error(e: &serde_json::Error) -> String {
    format!(
        "{:?} error at line {} column {}",
        e.classify(),
        e.line(),
        e.column()
    )
    .to_lowercase()
}

/// Every regular file under `dir`, by `/`-separated relative path. Symlinks and other
/// special files are refused: a folder under review holds plain files only.
fn collect(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let kind = entry.file_type()?;
        let rel = path
            .strip_prefix(root)
            .unwrap_or(&path)
            .to_string_lossy()
            .replace('\\', "/");
        if kind.is_dir() {
            collect(root, &path, out)?;
        } else if kind.is_file() {
            out.insert(rel, std::fs::read(&path)?);
        } else {
            return Err(std::io::Error::other(format!(
                "{rel} is not a regular file"
            )));
        }
    }
    Ok(())
}

/// Every file of a folder: relative path → bytes.
pub type Files = BTreeMap<String, Vec<u8>>;

/// A folder that verifies, read: its receipt and every file. `Err` lists why it does not
/// verify (or cannot be read), as `evidence verify` would print it.
pub fn load_verified(dir: &Path) -> Result<(Statement, Files), Vec<String>> {
    if !dir.is_dir() {
        return Err(vec![format!("{} is not a directory", dir.display())]);
    }
    let report = verify(dir);
    if !report.ok() {
        return Err(report.problems.iter().map(ToString::to_string).collect());
    }
    let mut files = BTreeMap::new();
    collect(dir, dir, &mut files).map_err(|e| vec![e.to_string()])?;
    let statement = files
        .get(RECEIPT)
        .ok_or_else(|| vec![format!("{RECEIPT} is missing")])
        .and_then(|bytes| {
            serde_json::from_slice::<Statement>(bytes).map_err(|e| vec![json_error(&e)])
        })?;
    Ok((statement, files))
}

/// `sandspec evidence verify <dir> [--key PUBFILE]`: prints the result; returns the exit code
/// (0 verified, 1 not verified, 2 not a directory or an unusable key file).
pub fn verify_cli(dir: &Path, key: Option<&Path>) -> i32 {
    if !dir.is_dir() {
        eprintln!("error: {} is not a directory", dir.display());
        return 2;
    }
    let key = match key.map(VerifyingKey::from_file).transpose() {
        Ok(k) => k,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let report = verify_with_key(dir, key.as_ref());
    if report.ok() {
        let signature = match (&report.signature_by, report.signed) {
            (Some(id), _) => format!(", signature by key {id}"),
            (None, true) => "; signed, but the signature was not checked: give --key".to_owned(),
            (None, false) => "; not signed".to_owned(),
        };
        println!(
            "verified: {} ({} files; manifest digests, receipt schema, verdicts, secret scan{signature})",
            dir.display(),
            report.files_checked
        );
        return 0;
    }
    for p in &report.problems {
        eprintln!("{p}");
    }
    eprintln!(
        "NOT verified: {} ({} problems)",
        dir.display(),
        report.problems.len()
    );
    1
}

/// Every leftover in one file of a folder as (line, kind). HTML is scanned as written and as
/// read, with its escapes undone. The envelope is not scanned: its payload is `receipt.json`,
/// scanned itself, and its signature field is not a credential (`verify` checks its form).
pub(crate) fn scanned_leaks(scanner: &Sanitizer, name: &str, bytes: &[u8]) -> Vec<(usize, String)> {
    if name == ENVELOPE {
        return Vec::new();
    }
    let text = String::from_utf8_lossy(bytes);
    let line_of = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
    let mut found: Vec<(usize, String)> = scanner
        .leaks(&text)
        .into_iter()
        .map(|l| (line_of(l.offset), l.what))
        .collect();
    if name.ends_with(".html") {
        // Undoing escapes keeps every line break where it was, so line numbers still hold.
        let read = super::html::unescape(&text);
        let line_of = |offset: usize| read[..offset.min(read.len())].matches('\n').count() + 1;
        for l in scanner.leaks(&read) {
            let hit = (line_of(l.offset), l.what);
            if !found.contains(&hit) {
                found.push(hit);
            }
        }
        found.sort();
    }
    found
}
