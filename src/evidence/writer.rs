//! Writes a run folder: `receipt.json`, `summary.md`, `junit.xml`, `report.html`, one
//! transcript per scenario, `manifest.json`, and with a signing key `receipt.dsse.json`.
//!
//! Order of work, and why: (1) a sanitized deep copy of the report; (2) every file rendered in
//! memory from that copy (the views, `summary.md` and `report.html`, from the receipt and the
//! transcripts alone; the receipt then records the views' digests, and is signed last);
//! (3) every rendered file scanned for leftovers, with the run's
//! canary added to the secrets looked for; (4) only then, files written to a temporary
//! directory next to the destination, checked there with [`super::verify`] as a reviewer
//! would check them, and renamed into place. A leftover at step 3 stops
//! everything: no partial folder, and the error names the file and the kind of secret but
//! never its value.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::clean::Cleaner;
use super::folder::{
    ENVELOPE, JUNIT, MANIFEST, Manifest, ManifestEntry, RECEIPT, REPORT, SUMMARY, sha256_hex,
};
use super::receipt::{Environment, FileRef, ReceiptInput, SanitizerInfo, Statement, Subject};
use super::sanitize::{Sanitizer, SecretError};
use super::schema::validate_receipt;
use super::sign::SigningKey;
use super::verify::scanned_leaks;
use crate::gate::Gate;
use crate::report::{RunReport, junit_xml};

/// What the writer needs besides the report and the sanitizer.
#[derive(Debug, Clone)]
pub struct WriteOptions {
    /// The run's canary. It must travel with the run's requests and must NOT be registered
    /// in the sanitizer: it is a tripwire that is looked for, never redacted.
    pub canary: String,
    /// The tested build (the Statement's subject).
    pub subject: Subject,
    /// The run was interrupted before every selected scenario ran.
    pub interrupted: bool,
    /// IDs of the selected scenarios that never ran.
    pub not_run: Vec<String>,
    /// Sign the receipt with this key (`receipt.dsse.json`).
    pub sign_key: Option<SigningKey>,
    /// The gate of a run given a baseline of expected failures (`--expected-failures`).
    pub gate: Option<Gate>,
}

#[derive(Debug, thiserror::Error)]
pub enum EvidenceError {
    #[error(
        "write evidence: `{file}` would still contain a secret ({what}) after sanitizing; nothing was written"
    )]
    Leak { file: String, what: String },
    #[error(
        "write evidence: the canary is registered for redaction, so it could no longer reveal a leak"
    )]
    CanaryDisarmed,
    #[error("write evidence: unusable canary")]
    BadCanary(#[source] SecretError),
    #[error("write evidence: `not_run` lists scenarios but the run is not marked interrupted")]
    NotRunWithoutInterruption,
    #[error("write evidence: the receipt does not satisfy its schema: {}", .0.join("; "))]
    Schema(Vec<String>),
    #[error("write evidence: the folder did not verify before it was put in place: {}", .0.join("; "))]
    SelfCheck(Vec<String>),
    #[error("write evidence: `{0}` already exists and is not empty")]
    Exists(PathBuf),
    #[error("write evidence to `{path}`")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("serialize evidence")]
    Json(#[from] serde_json::Error),
    #[error("write evidence: report.html")]
    Report(#[from] super::html::HtmlError),
}

/// The failures a gate expected, by scenario ID, with the baseline's reason: what JUnit
/// reports as skipped.
pub fn expected_failures(gate: Option<&Gate>) -> BTreeMap<String, String> {
    let Some(gate) = gate else {
        return BTreeMap::new();
    };
    gate.expected
        .iter()
        .filter_map(|id| {
            let entry = gate.baseline.entries.iter().find(|e| &e.id == id)?;
            Some((id.clone(), entry.reason.clone()))
        })
        .collect()
}

/// `<root>/evidence/runs/<run-id>`, the default destination.
pub fn default_run_dir(root: &Path, run_id: &str) -> PathBuf {
    root.join("evidence").join("runs").join(run_id)
}

/// Writes the run folder at `dest` (which must not exist, or be empty) and returns it.
pub fn write_run_folder(
    dest: &Path,
    report: &RunReport,
    sanitizer: &Sanitizer,
    options: &WriteOptions,
) -> Result<PathBuf, EvidenceError> {
    let files = render(report, sanitizer, options)?;
    write_atomically(dest, &files)?;
    Ok(dest.to_path_buf())
}

/// Every file of the folder, relative path → bytes, sanitized and scanned.
pub(crate) fn render(
    report: &RunReport,
    sanitizer: &Sanitizer,
    options: &WriteOptions,
) -> Result<BTreeMap<String, Vec<u8>>, EvidenceError> {
    if sanitizer.knows(&options.canary) {
        return Err(EvidenceError::CanaryDisarmed);
    }
    if !options.interrupted && !options.not_run.is_empty() {
        return Err(EvidenceError::NotRunWithoutInterruption);
    }
    let mut scanner = sanitizer.clone();
    scanner
        .add_secret(&options.canary, "canary")
        .map_err(EvidenceError::BadCanary)?;

    let mut cleaner = Cleaner::new(sanitizer, &scanner);
    let clean = cleaner.report(report);
    if let Some((file, what)) = cleaner.hidden.first() {
        return Err(EvidenceError::Leak {
            file: file.clone(),
            what: what.clone(),
        });
    }

    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut refs = Vec::with_capacity(clean.scenarios.len());
    for (s, name) in clean.scenarios.iter().zip(transcript_names(&clean)) {
        let doc = serde_json::json!({
            "scenario": s.id,
            "title": s.title,
            "outcome": s.outcome.label(),
            "attempts": s.attempts,
            "entries": s.transcript,
        });
        let bytes = pretty(&doc)?;
        refs.push(Some(FileRef {
            path: name.clone(),
            sha256: sha256_hex(&bytes),
        }));
        files.insert(name, bytes);
    }

    let not_run: Vec<String> = options
        .not_run
        .iter()
        .map(|id| sanitizer.text(id).into_owned())
        .collect();
    let input = ReceiptInput {
        subject: &options.subject,
        interrupted: options.interrupted,
        not_run: &not_run,
        environment: Environment::current(),
        sanitizer: SanitizerInfo {
            secrets_registered: sanitizer.secret_count(),
            canary_checked: true,
        },
        transcripts: &refs,
        gate: options.gate.as_ref().map(|g| cleaner.gate(g)),
    };
    let statement = Statement::build(&clean, &input);
    let junit = junit_xml(
        &clean,
        &expected_failures(statement.predicate.gate.as_ref()),
    );
    finish(
        statement,
        files,
        &junit,
        &scanner,
        options.sign_key.as_ref(),
    )
}

/// The rest of a folder around its transcripts: the views rendered from the receipt (and the
/// transcripts), the receipt naming them, validated against its schema and signed with `key`,
/// every file scanned with `scanner`, and the manifest.
pub(crate) fn finish(
    mut statement: Statement,
    mut files: BTreeMap<String, Vec<u8>>,
    junit: &str,
    scanner: &Sanitizer,
    key: Option<&SigningKey>,
) -> Result<BTreeMap<String, Vec<u8>>, EvidenceError> {
    // The views are rendered from the receipt (and the transcripts) before it names them.
    let views = [
        (SUMMARY, super::summary::render(&statement).into_bytes()),
        (JUNIT, junit.as_bytes().to_vec()),
        (
            REPORT,
            super::html::render(&statement, &files)?.into_bytes(),
        ),
    ];
    statement.predicate.documents = views
        .iter()
        .map(|(path, bytes)| FileRef {
            path: (*path).to_owned(),
            sha256: sha256_hex(bytes),
        })
        .collect();
    files.extend(views.map(|(path, bytes)| (path.to_owned(), bytes)));
    let receipt = serde_json::to_value(&statement)?;
    validate_receipt(&receipt).map_err(EvidenceError::Schema)?;
    let receipt = pretty(&receipt)?;
    if let Some(key) = key {
        files.insert(ENVELOPE.to_owned(), pretty(&key.sign(&receipt))?);
    }
    files.insert(RECEIPT.to_owned(), receipt);

    // Transcripts first, then the receipt, then its views: a leak is named where it arose.
    let mut order: Vec<(&String, &Vec<u8>)> = files.iter().collect();
    order.sort_by_key(|(name, _)| {
        (
            !name.starts_with("transcripts/"),
            name.as_str() != RECEIPT,
            name.as_str(),
        )
    });
    for (name, bytes) in order {
        scan(scanner, name, bytes)?;
    }
    let manifest = Manifest {
        files: files
            .iter()
            .map(|(path, bytes)| ManifestEntry {
                path: path.clone(),
                sha256: sha256_hex(bytes),
                bytes: bytes.len() as u64,
            })
            .collect(),
    };
    files.insert(MANIFEST.to_owned(), pretty(&manifest)?);
    Ok(files)
}

/// Fails on the first leftover in `bytes`, naming the file, the line and the kind.
fn scan(scanner: &Sanitizer, name: &str, bytes: &[u8]) -> Result<(), EvidenceError> {
    match scanned_leaks(scanner, name, bytes).into_iter().next() {
        None => Ok(()),
        Some((line, what)) => Err(EvidenceError::Leak {
            file: format!("{name}:{line}"),
            what,
        }),
    }
}

/// `transcripts/<ID>.json`, with characters a file name should not hold replaced and
/// duplicates numbered.
fn transcript_names(report: &RunReport) -> Vec<String> {
    let mut used: BTreeMap<String, usize> = BTreeMap::new();
    report
        .scenarios
        .iter()
        .map(|s| {
            let mut stem: String =
                s.id.chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || "._-".contains(c) {
                            c
                        } else {
                            '_'
                        }
                    })
                    .collect();
            if stem.is_empty() || stem.starts_with('.') {
                stem.insert(0, '_');
            }
            let n = used.entry(stem.clone()).or_default();
            *n += 1;
            if *n > 1 {
                stem = format!("{stem}-{n}");
            }
            format!("transcripts/{stem}.json")
        })
        .collect()
}

fn pretty<T: Serialize>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let mut bytes = serde_json::to_vec_pretty(value)?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// Writes into a fresh sibling directory, verifies it, then renames it to `dest`; on any
/// error the temporary directory is removed and `dest` is untouched.
pub(crate) fn write_atomically(
    dest: &Path,
    files: &BTreeMap<String, Vec<u8>>,
) -> Result<(), EvidenceError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| EvidenceError::Io { path, source }
    };
    if dest.exists() && std::fs::read_dir(dest).map_err(io(dest))?.next().is_some() {
        return Err(EvidenceError::Exists(dest.to_path_buf()));
    }
    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(io(&parent))?;
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".to_owned());
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".partial")
        .tempdir_in(&parent)
        .map_err(io(&parent))?;
    for (rel, bytes) in files {
        let path = tmp.path().join(rel);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        std::fs::write(&path, bytes).map_err(io(&path))?;
    }
    // The folder is checked exactly as a reviewer would check it before it is put in place.
    let check = super::verify::verify(tmp.path());
    if !check.ok() {
        return Err(EvidenceError::SelfCheck(
            check.problems.iter().map(ToString::to_string).collect(),
        ));
    }
    // rename(2) replaces an empty directory, so an empty `--out` directory is fine.
    let tmp_path = tmp.keep();
    std::fs::rename(&tmp_path, dest).map_err(|source| {
        let _ = std::fs::remove_dir_all(&tmp_path);
        if dest.exists() {
            EvidenceError::Exists(dest.to_path_buf())
        } else {
            EvidenceError::Io {
                path: dest.to_path_buf(),
                source,
            }
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Body, Credential, Entry, HttpExchange, Outcome};
    use crate::report::{ScenarioReport, TargetInfo};
    use crate::scenario::Level;

    fn report_with_body(body: &str) -> RunReport {
        let scenarios = vec![ScenarioReport {
            id: "SBX-LIFE-001".into(),
            title: "t".into(),
            family: "lifecycle".into(),
            file: "f".into(),
            level: Level::Must,
            clauses: vec!["SBX-3.1".into()],
            tags: vec![],
            defects: vec![],
            outcome: Outcome::Pass,
            started_ms: 0,
            duration_ms: 1,
            attempts: 1,
            measurements: BTreeMap::new(),
            swept: vec![],
            faults: vec![],
            throttled: Default::default(),
            transcript: vec![Entry::Http(HttpExchange {
                step: "steps[0] GET /v1/x".into(),
                at_ms: 0,
                credential: Credential::None,
                method: "GET".into(),
                target: "/v1/x".into(),
                request_headers: vec![],
                request_body: None,
                status: Some(200),
                response_headers: vec![],
                response_body: Some(Body::of(body.as_bytes())),
                duration_ms: 1,
                error: None,
            })],
        }];
        RunReport {
            run_id: "r".into(),
            suite_version: "0.1.0".into(),
            started_at: "2026-01-01T00:00:00Z".into(),
            finished_at: "2026-01-01T00:00:01Z".into(),
            duration_ms: 1000,
            target: TargetInfo {
                kind: "url".into(),
                url: "http://127.0.0.1:1".into(),
                server_name: None,
                server_version: None,
                defects: vec![],
                capabilities: serde_json::json!({}),
            },
            profile: "all".into(),
            filters: vec![],
            shard: None,
            label: None,
            retries: 0,
            certify: false,
            profiles: RunReport::judge(
                &scenarios,
                &crate::report::RunFacts::whole_catalog(
                    scenarios.iter().map(|s| s.family.as_str()),
                ),
            ),
            scenarios,
            run_sweep: Default::default(),
            not_applicable: Vec::new(),
            sdk_matrix: None,
            consumption: Default::default(),
        }
    }

    fn options() -> WriteOptions {
        WriteOptions {
            canary: "sandspec-canary-0123456789abcdef".into(),
            subject: Subject::url_target(&report_with_body("").target),
            interrupted: false,
            not_run: vec![],
            sign_key: None,
            gate: None,
        }
    }

    #[test]
    fn the_scan_catches_what_a_bypassed_sanitizer_lets_through() {
        // Render with a sanitizer, then scan text that did not go through it: every kind of
        // leftover is named, and only by kind.
        let mut scanner = Sanitizer::new();
        scanner
            .add_secret("sandspec-canary-0123456789abcdef", "canary")
            .unwrap();
        let cases = [
            ("echo sandspec-canary-0123456789abcdef", "canary"),
            ("Authorization: Bearer abcdefghijklmnop", "bearer"),
            ("db postgres://u:pw123456@h/db", "url-password"),
            ("/p?preview_token=abc", "credential-parameter"),
            ("key sk-abcdefghijklmnopqrstu", "openai-key"),
        ];
        for (text, want) in cases {
            match scan(&scanner, "f.json", text.as_bytes()) {
                Err(EvidenceError::Leak { file, what }) => {
                    assert_eq!((file.as_str(), what.as_str()), ("f.json:1", want), "{text}");
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        assert!(scan(&scanner, "f.json", b"nothing here").is_ok());
    }

    #[test]
    fn a_key_shaped_secret_nobody_registered_is_still_removed() {
        let files = render(
            &report_with_body(r#"{"note": "use sk-abcdefghijklmnopqrstu"}"#),
            &Sanitizer::new(),
            &options(),
        )
        .unwrap();
        let transcript = String::from_utf8(files["transcripts/SBX-LIFE-001.json"].clone()).unwrap();
        assert!(
            !transcript.contains("sk-abcdefghijklmnopqrstu") && transcript.contains("[REDACTED]")
        );
    }

    #[test]
    fn the_manifest_lists_every_other_file() {
        let files = render(&report_with_body("ok"), &Sanitizer::new(), &options()).unwrap();
        let manifest: Manifest = serde_json::from_slice(&files[MANIFEST]).unwrap();
        let listed: Vec<&str> = manifest.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(
            listed,
            [
                "junit.xml",
                "receipt.json",
                "report.html",
                "summary.md",
                "transcripts/SBX-LIFE-001.json"
            ]
        );
        for f in &manifest.files {
            assert_eq!(f.sha256, sha256_hex(&files[&f.path]));
        }
    }

    #[test]
    fn transcript_names_are_safe_and_unique() {
        let mut r = report_with_body("");
        let mut twin = r.scenarios[0].clone();
        twin.id = "../SBX LIFE/001".into();
        r.scenarios.push(twin.clone());
        twin.id = "SBX-LIFE-001".into();
        r.scenarios.push(twin);
        assert_eq!(
            transcript_names(&r),
            [
                "transcripts/SBX-LIFE-001.json",
                "transcripts/_.._SBX_LIFE_001.json",
                "transcripts/SBX-LIFE-001-2.json"
            ]
        );
    }
}
