//! The evidence receipt: an in-toto Statement v1 whose sandspec predicate says which build
//! was tested, what ran, what it concluded and what was measured.
//!
//! The types mirror `evidence/schema/receipt.schema.json` field for field; they deserialize
//! strictly (`deny_unknown_fields`) so `evidence verify` can also read a receipt back.
//!
//! Honesty rules that live here: outcomes are copied from the run, never re-labelled (a FAIL
//! stays `fail`, an ERROR stays `error`); every outcome other than `pass` carries its reason;
//! an interrupted run says so and lists what never ran.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::placeholders::Placeholders;
use crate::engine::{Entry, Frame, Outcome};
use crate::gate::Gate;
use crate::report::{RunReport, ScenarioReport, TargetInfo, Verdict};
use crate::sdk::SdkMatrix;

/// `_type` of an in-toto Statement v1.
pub const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
/// `predicateType` of a sandspec receipt; the major version is part of the URI.
pub const PREDICATE_TYPE: &str = "https://sandspec.dev/receipt/v1";

/// The in-toto Statement that `receipt.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Statement {
    #[serde(rename = "_type")]
    pub type_: String,
    pub subject: Vec<ResourceDescriptor>,
    #[serde(rename = "predicateType")]
    pub predicate_type: String,
    pub predicate: Receipt,
}

/// An in-toto ResourceDescriptor reduced to what a receipt needs: the tested build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceDescriptor {
    pub name: String,
    pub digest: Digest,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Digest {
    /// Lowercase hex.
    pub sha256: String,
}

/// What the subject's digest is a digest of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SubjectSource {
    /// The `sandspec` binary that served as the embedded reference server.
    ReferenceBinary,
    /// A build digest the target reported in its capabilities document.
    ReportedBuild,
    /// No build digest is known: the digest of the target's capabilities document, the
    /// closest thing to an identity a remote endpoint offers.
    CapabilitiesDocument,
}

/// The tested build, before it becomes the Statement's subject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    pub name: String,
    pub sha256: String,
    pub source: SubjectSource,
}

impl Subject {
    /// The embedded reference server: the SHA-256 of the binary that served it.
    pub fn reference_binary(path: &Path) -> std::io::Result<Subject> {
        let bytes = std::fs::read(path)?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "sandspec".to_owned());
        Ok(Subject {
            name,
            sha256: super::folder::sha256_hex(&bytes),
            source: SubjectSource::ReferenceBinary,
        })
    }

    /// The subject of a run: the running `sandspec` binary for the reference target (it is
    /// what serves as the reference server), [`Subject::url_target`] otherwise.
    pub fn for_target(target: &TargetInfo) -> std::io::Result<Subject> {
        if target.kind == "reference" {
            Subject::reference_binary(&std::env::current_exe()?)
        } else {
            Ok(Subject::url_target(target))
        }
    }

    /// A URL target: its base URL (without credentials) and the build digest it reports, or
    /// else the digest of its capabilities document.
    pub fn url_target(target: &TargetInfo) -> Subject {
        let name = strip_userinfo(&target.url);
        match reported_build_digest(&target.capabilities) {
            Some(sha256) => Subject {
                name,
                sha256,
                source: SubjectSource::ReportedBuild,
            },
            None => {
                let doc = serde_json::to_vec(&target.capabilities).unwrap_or_default();
                Subject {
                    name,
                    sha256: super::folder::sha256_hex(&doc),
                    source: SubjectSource::CapabilitiesDocument,
                }
            }
        }
    }
}

/// The sandspec predicate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    pub run_id: String,
    pub started_at: String,
    pub ended_at: String,
    pub duration_ms: u64,
    /// The run was stopped (Ctrl-C) before every selected scenario ran.
    pub interrupted: bool,
    /// IDs of selected scenarios that never ran; empty unless `interrupted`.
    pub not_run: Vec<String>,
    pub suite: Suite,
    pub target: TargetIdentity,
    pub selection: Selection,
    pub scenarios: Vec<ScenarioResult>,
    pub profiles: Vec<ProfileResult>,
    pub coverage: Coverage,
    pub counts: Counts,
    pub measurements: Vec<Measurement>,
    pub streams: Vec<StreamTiming>,
    pub cleanup: Cleanup,
    /// What the run consumed of the target's account, and the limits it was given.
    pub consumption: crate::target::Consumption,
    pub environment: Environment,
    pub sanitizer: SanitizerInfo,
    /// The SDK version matrix (`--sdk`): every journey with every SDK, the judged ones also
    /// among `scenarios`. Absent without `--sdk`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sdk_matrix: Option<SdkMatrix>,
    /// The shards this folder was merged from (`sandspec evidence merge`), in shard order;
    /// empty for a folder a run wrote.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merged_from: Vec<ShardRef>,
    /// The gate of a run given a baseline of expected failures (`--expected-failures`): the
    /// baseline, and whether every failure was expected. Absent without a baseline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<Gate>,
    /// `summary.md`, `junit.xml` and `report.html` with their SHA-256, so that a signature
    /// over the receipt covers the views of it too. Filled in by the writer once they are
    /// rendered (they are rendered from the receipt without this list).
    pub documents: Vec<FileRef>,
}

/// One shard of a merged folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardRef {
    /// `i/n`.
    pub shard: String,
    pub run_id: String,
    pub started_at: String,
    pub ended_at: String,
    /// SHA-256 of the shard's `receipt.json`.
    pub receipt_sha256: String,
    /// The machine that ran the shard.
    pub environment: Environment,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Suite {
    pub name: String,
    pub version: String,
    /// The git commit the runner was built from, or `unknown`.
    pub commit: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetIdentity {
    /// `reference` or `url`.
    pub kind: String,
    /// Never with credentials.
    pub base_url: String,
    pub api_version: Option<String>,
    pub server_name: Option<String>,
    pub server_version: Option<String>,
    /// The build digest the target reported (`sha256:<hex>`), if any.
    pub build_digest: Option<String>,
    pub subject_source: SubjectSource,
    /// Deliberate defects the reference server was started with (empty for a URL target).
    pub defects: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Selection {
    pub profile: String,
    pub filters: Vec<String>,
    pub shard: Option<String>,
    /// The run's `--label`, when it was given one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    pub retries: u32,
    pub certify: bool,
    /// Selected scenarios left out because they cannot apply to the target, with why.
    pub not_applicable: Vec<crate::report::NotApplicable>,
    /// Scenarios the selection chose (reported, not applicable and never run alike).
    pub selected: usize,
    /// Scenarios in the catalog the selection was made from.
    pub catalog: usize,
    /// `selected < catalog`: every verdict of the run speaks for part of the catalog only.
    pub subset: bool,
}

/// A scenario's outcome as the receipt spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeLabel {
    Pass,
    /// Passed only on a retry: never counted as a plain pass.
    Flaky,
    Skip,
    Fail,
    /// The harness could not judge (for example the target was unreachable). Counted on its
    /// own and never as a pass.
    Error,
}

impl OutcomeLabel {
    /// What the verdict rules see of this outcome.
    pub fn judged(self) -> crate::report::Label {
        use crate::report::Label;
        match self {
            OutcomeLabel::Pass => Label::Pass,
            OutcomeLabel::Flaky => Label::Flaky,
            OutcomeLabel::Skip => Label::Skip,
            OutcomeLabel::Fail => Label::Fail,
            OutcomeLabel::Error => Label::Error,
        }
    }

    pub fn of(outcome: &Outcome) -> OutcomeLabel {
        match outcome {
            Outcome::Pass => OutcomeLabel::Pass,
            Outcome::Flaky { .. } => OutcomeLabel::Flaky,
            Outcome::Skip { .. } => OutcomeLabel::Skip,
            Outcome::Fail { .. } => OutcomeLabel::Fail,
            Outcome::Error { .. } => OutcomeLabel::Error,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioResult {
    pub id: String,
    pub title: String,
    pub family: String,
    /// `MUST` or `SHOULD`.
    pub level: String,
    pub clauses: Vec<String>,
    pub outcome: OutcomeLabel,
    /// Why it did not plainly pass; `null` only for `pass`.
    pub reason: Option<String>,
    /// The step that failed, for `fail`.
    pub failed_step: Option<String>,
    /// Milliseconds from the run's start (`started_at`) to the scenario's start.
    pub started_ms: u64,
    pub duration_ms: u64,
    pub attempts: u32,
    /// Named measurements in seconds.
    pub measurements: BTreeMap<String, f64>,
    /// The faults the scenario injected (server processes killed and restarted, the
    /// database stopped and started), each with its time and the steps checked after it.
    pub faults: Vec<crate::engine::FaultRecord>,
    /// The throttling answers (429, or 503 with `Retry-After`) it waited out.
    pub throttled: crate::engine::Throttled,
    /// The transcript file and its digest; `null` when nothing was sent (a skip).
    pub transcript: Option<FileRef>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRef {
    pub path: String,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileResult {
    pub profile: String,
    /// `conformant`, `partial`, `non-conformant` or `not-tested`.
    pub verdict: String,
    pub reason: Option<String>,
    /// Scenarios per outcome label (`PASS`, `FAIL`, ...).
    pub counts: BTreeMap<String, usize>,
    pub must_run: usize,
    /// Scenarios of this profile the selection chose, and the catalog holds.
    pub selected: usize,
    pub catalog: usize,
    /// `selected < catalog`: the verdict is `<verdict> (subset: <selected> of <catalog>
    /// scenarios)`.
    pub subset: bool,
}

/// Which MUST clauses of `docs/protocol.md` the run's scenarios check.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Coverage {
    /// MUST clauses in force in the protocol the suite was built with.
    pub must_clauses: usize,
    /// Clauses that at least one scenario of the run judged (it passed, was flaky or failed;
    /// a skip or a harness error judged nothing).
    pub checked: usize,
    /// Every MUST clause, in protocol order.
    pub clauses: Vec<ClauseCoverage>,
    /// The MUST clauses no scenario of the run checked, in protocol order.
    pub unchecked: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClauseCoverage {
    pub clause: String,
    /// Scenarios of the run that cite the clause, in the order of `scenarios`.
    pub scenarios: Vec<String>,
    /// One of them judged the clause: its outcome is `pass`, `flaky` or `fail`.
    pub checked: bool,
}

impl Coverage {
    /// Coverage of `must` (clause IDs in protocol order) by the scenarios' citations.
    pub fn of<'a>(must: impl IntoIterator<Item = &'a str>, scenarios: &[ScenarioResult]) -> Self {
        let clauses: Vec<ClauseCoverage> = must
            .into_iter()
            .map(|clause| {
                let citing: Vec<&ScenarioResult> = scenarios
                    .iter()
                    .filter(|s| s.clauses.iter().any(|c| c == clause))
                    .collect();
                ClauseCoverage {
                    clause: clause.to_owned(),
                    scenarios: citing.iter().map(|s| s.id.clone()).collect(),
                    checked: citing.iter().any(|s| {
                        matches!(
                            s.outcome,
                            OutcomeLabel::Pass | OutcomeLabel::Flaky | OutcomeLabel::Fail
                        )
                    }),
                }
            })
            .collect();
        Coverage {
            must_clauses: clauses.len(),
            checked: clauses.iter().filter(|c| c.checked).count(),
            unchecked: clauses
                .iter()
                .filter(|c| !c.checked)
                .map(|c| c.clause.clone())
                .collect(),
            clauses,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Counts {
    /// Scenarios that ran or were skipped (not those in `not_run`).
    pub total: usize,
    pub pass: usize,
    pub flaky: usize,
    pub skip: usize,
    pub fail: usize,
    pub error: usize,
    pub not_run: usize,
    /// HTTP requests and SSE streams sent.
    pub requests: usize,
    /// Responses with a 2xx status: operations the target carried out.
    pub positive_operations: usize,
    /// Responses with status 401 or 403: authentication and authorization rejections.
    pub authentication_rejections: usize,
}

/// One named measurement of one scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measurement {
    pub scenario: String,
    pub name: String,
    pub seconds: f64,
}

/// One SSE stream's timings as observed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamTiming {
    pub scenario: String,
    pub step: String,
    pub status: Option<u16>,
    /// Events received (heartbeat comments are not counted: their number depends on timing).
    pub events: usize,
    /// Milliseconds from opening the stream to its first frame.
    pub first_frame_ms: Option<u64>,
    /// Milliseconds from opening the stream to its end.
    pub eof_ms: Option<u64>,
    pub end: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cleanup {
    /// Absence checks that held: GET answered 404 `not_found` and no list page held the ID.
    pub confirmed_absent: Vec<AbsenceConfirmation>,
    /// What scenarios' leak checks (and, as `RUN-SWEEP`, the end-of-run sweep) found left
    /// behind, and whether the sweep then removed each.
    pub swept: Vec<SweptResource>,
    /// The end-of-run sweep: records it left alone, and why it could not finish.
    pub run_sweep: RunSweepRecord,
}

/// What the end-of-run sweep did besides removing what it found.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSweepRecord {
    /// Per list and principal, how many records lacked the run's tag and were left alone.
    pub ignored: Vec<crate::live::Ignored>,
    /// Why the sweep could not finish, or `null`.
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbsenceConfirmation {
    pub scenario: String,
    pub step: String,
    /// The object's path with IDs replaced by placeholders (`<sbx-1>`).
    pub path: String,
}

/// The name under which the end-of-run sweep's findings are recorded.
pub const RUN_SWEEP: &str = "RUN-SWEEP";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweptResource {
    pub scenario: String,
    pub path: String,
    /// The sweep removed it and a GET afterwards answered 404.
    pub removed: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Environment {
    pub os: String,
    pub os_release: Option<String>,
    pub arch: String,
    pub cpu_count: usize,
}

impl Environment {
    pub fn current() -> Environment {
        Environment {
            os: std::env::consts::OS.to_owned(),
            os_release: os_release(),
            arch: std::env::consts::ARCH.to_owned(),
            cpu_count: std::thread::available_parallelism()
                .map(usize::from)
                .unwrap_or(1),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SanitizerInfo {
    /// Secret values redacted by value (tokens and configured secrets; not the canary).
    pub secrets_registered: usize,
    /// Every file was scanned for the run's canary before anything was written.
    pub canary_checked: bool,
}

/// The commit the runner was built from (`SANDSPEC_GIT_COMMIT` at build time), or `unknown`.
pub fn suite_commit() -> &'static str {
    option_env!("SANDSPEC_GIT_COMMIT").unwrap_or("unknown")
}

/// What the writer knows besides the report.
pub(crate) struct ReceiptInput<'a> {
    pub subject: &'a Subject,
    pub interrupted: bool,
    pub not_run: &'a [String],
    pub environment: Environment,
    pub sanitizer: SanitizerInfo,
    /// Transcript path and digest per scenario index.
    pub transcripts: &'a [Option<FileRef>],
    /// The run's gate, sanitized.
    pub gate: Option<Gate>,
}

impl Statement {
    /// Builds the Statement from an already sanitized report.
    pub(crate) fn build(report: &RunReport, input: &ReceiptInput<'_>) -> Statement {
        let mut placeholders = Placeholders::new();
        let scenarios: Vec<ScenarioResult> = report
            .scenarios
            .iter()
            .enumerate()
            .map(|(i, s)| scenario_result(s, input.transcripts.get(i).cloned().flatten()))
            .collect();
        let mut counts = Counts {
            total: report.scenarios.len(),
            not_run: input.not_run.len(),
            ..Counts::default()
        };
        for s in &scenarios {
            match s.outcome {
                OutcomeLabel::Pass => counts.pass += 1,
                OutcomeLabel::Flaky => counts.flaky += 1,
                OutcomeLabel::Skip => counts.skip += 1,
                OutcomeLabel::Fail => counts.fail += 1,
                OutcomeLabel::Error => counts.error += 1,
            }
        }
        let mut streams = Vec::new();
        let mut cleanup = Cleanup::default();
        for s in &report.scenarios {
            for entry in &s.transcript {
                let status = match entry {
                    Entry::Http(h) => h.status,
                    Entry::Sse(e) => e.status,
                    Entry::Note(_) => continue,
                };
                counts.requests += 1;
                match status {
                    Some(200..=299) => counts.positive_operations += 1,
                    Some(401 | 403) => counts.authentication_rejections += 1,
                    _ => {}
                }
                if let Entry::Sse(e) = entry {
                    streams.push(StreamTiming {
                        scenario: s.id.clone(),
                        step: e.step.clone(),
                        status: e.status,
                        events: e
                            .frames
                            .iter()
                            .filter(|f| matches!(f, Frame::Event { .. }))
                            .count(),
                        first_frame_ms: e.first_frame_ms,
                        eof_ms: e.eof_ms,
                        end: e.end.clone(),
                    });
                }
            }
            cleanup
                .confirmed_absent
                .extend(confirmed_absent(s, &mut placeholders));
            cleanup.swept.extend(s.swept.iter().map(|l| SweptResource {
                scenario: s.id.clone(),
                path: placeholders.apply(&l.path),
                removed: l.removed,
            }));
        }
        // The end-of-run sweep's findings: left behind by the run, whichever scenario it was.
        cleanup
            .swept
            .extend(report.run_sweep.found.iter().map(|l| SweptResource {
                scenario: RUN_SWEEP.to_owned(),
                path: placeholders.apply(&l.path),
                removed: l.removed,
            }));
        cleanup.run_sweep = RunSweepRecord {
            ignored: report.run_sweep.ignored.clone(),
            error: report.run_sweep.error.clone(),
        };
        let measurements = report
            .scenarios
            .iter()
            .flat_map(|s| {
                s.measurements
                    .iter()
                    .filter(|(_, v)| v.is_finite())
                    .map(|(name, seconds)| Measurement {
                        scenario: s.id.clone(),
                        name: name.clone(),
                        seconds: *seconds,
                    })
            })
            .collect();
        let profiles = report
            .profiles
            .iter()
            .map(|p| ProfileResult {
                profile: p.profile.clone(),
                verdict: verdict_label(p.verdict).to_owned(),
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
            })
            .collect();
        let run_scope = report
            .profiles
            .iter()
            .find(|p| p.profile == crate::report::ALL)
            .map(|p| p.scope)
            .unwrap_or(crate::report::Scope {
                selected: 0,
                catalog: 0,
            });
        let coverage = Coverage::of(crate::profile::v1::must_clauses(), &scenarios);
        let caps = &report.target.capabilities;
        let target = TargetIdentity {
            kind: report.target.kind.clone(),
            base_url: strip_userinfo(&report.target.url),
            api_version: caps
                .get("api_version")
                .and_then(|v| v.as_str())
                .map(str::to_owned),
            server_name: report.target.server_name.clone(),
            server_version: report.target.server_version.clone(),
            build_digest: reported_build_digest(caps).map(|h| format!("sha256:{h}")),
            subject_source: input.subject.source,
            defects: report.target.defects.clone(),
        };
        Statement {
            type_: STATEMENT_TYPE.to_owned(),
            subject: vec![ResourceDescriptor {
                name: input.subject.name.clone(),
                digest: Digest {
                    sha256: input.subject.sha256.clone(),
                },
            }],
            predicate_type: PREDICATE_TYPE.to_owned(),
            predicate: Receipt {
                run_id: report.run_id.clone(),
                started_at: report.started_at.clone(),
                ended_at: report.finished_at.clone(),
                duration_ms: report.duration_ms,
                interrupted: input.interrupted,
                not_run: input.not_run.to_vec(),
                suite: Suite {
                    name: "sandspec".to_owned(),
                    version: report.suite_version.clone(),
                    commit: suite_commit().to_owned(),
                },
                target,
                selection: Selection {
                    profile: report.profile.clone(),
                    filters: report.filters.clone(),
                    shard: report.shard.clone(),
                    label: report.label.clone(),
                    retries: report.retries,
                    certify: report.certify,
                    not_applicable: report.not_applicable.clone(),
                    selected: run_scope.selected,
                    catalog: run_scope.catalog,
                    subset: run_scope.is_subset(),
                },
                scenarios,
                profiles,
                coverage,
                counts,
                measurements,
                streams,
                cleanup,
                consumption: report.consumption.clone(),
                environment: input.environment.clone(),
                sanitizer: input.sanitizer.clone(),
                sdk_matrix: report.sdk_matrix.clone(),
                merged_from: Vec::new(),
                gate: input.gate.clone(),
                documents: Vec::new(),
            },
        }
    }
}

fn scenario_result(s: &ScenarioReport, transcript: Option<FileRef>) -> ScenarioResult {
    ScenarioResult {
        id: s.id.clone(),
        title: s.title.clone(),
        family: s.family.clone(),
        level: s.level.to_string(),
        clauses: s.clauses.clone(),
        outcome: OutcomeLabel::of(&s.outcome),
        reason: s.outcome.reason(),
        failed_step: match &s.outcome {
            Outcome::Fail { step, .. } => Some(step.clone()),
            _ => None,
        },
        started_ms: s.started_ms,
        duration_ms: s.duration_ms,
        attempts: s.attempts,
        measurements: s
            .measurements
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(k, v)| (k.clone(), *v))
            .collect(),
        faults: s.faults.clone(),
        throttled: s.throttled,
        transcript,
    }
}

fn verdict_label(v: Verdict) -> &'static str {
    v.as_str()
}

/// Absence checks of a scenario that held. Only a scenario that passed proves every one of
/// its absence checks held: after a failure the engine keeps the first reason, so a later
/// failed check could hide behind it.
fn confirmed_absent(
    s: &ScenarioReport,
    placeholders: &mut Placeholders,
) -> Vec<AbsenceConfirmation> {
    if !s.outcome.passed() {
        return Vec::new();
    }
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for entry in &s.transcript {
        let Entry::Http(h) = entry else { continue };
        // The engine labels the step `steps[i] absent` / `cleanup[i] absent`; its first request
        // is the GET of the object itself.
        if !h.step.ends_with(" absent") || seen.contains(&h.step) {
            continue;
        }
        seen.push(h.step.clone());
        if h.status == Some(404) {
            let path = h.target.split('?').next().unwrap_or_default();
            out.push(AbsenceConfirmation {
                scenario: s.id.clone(),
                step: h.step.clone(),
                path: placeholders.apply(path),
            });
        }
    }
    out
}

/// `https://user:pw@host/x` → `https://host/x`.
pub(crate) fn strip_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://{host}{tail}"),
        None => url.to_owned(),
    }
}

/// A build digest the target reported: `server.build_digest` (or `server.digest`) as
/// `sha256:<hex>` or bare hex. Returns the lowercase hex.
fn reported_build_digest(caps: &serde_json::Value) -> Option<String> {
    let server = caps.get("server")?;
    let raw = server
        .get("build_digest")
        .or_else(|| server.get("digest"))?
        .as_str()?;
    let hex = raw
        .strip_prefix("sha256:")
        .unwrap_or(raw)
        .to_ascii_lowercase();
    (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(hex)
}

/// `PRETTY_NAME` from `/etc/os-release`, when there is one.
fn os_release() -> Option<String> {
    let text = std::fs::read_to_string("/etc/os-release").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim_matches('"').to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userinfo_is_stripped() {
        let cases = [
            (
                "https://u:p@host:8443/base?x=1",
                "https://host:8443/base?x=1",
            ),
            ("http://127.0.0.1:3000", "http://127.0.0.1:3000"),
            ("http://token@host/", "http://host/"),
            ("http://host/path@x", "http://host/path@x"),
            ("not a url", "not a url"),
        ];
        for (input, want) in cases {
            assert_eq!(strip_userinfo(input), want, "{input}");
        }
    }

    #[test]
    fn build_digest_is_read_from_capabilities() {
        let hex = "ab".repeat(32);
        let caps = serde_json::json!({"server": {"name": "x", "build_digest": format!("sha256:{}", hex.to_uppercase())}});
        assert_eq!(reported_build_digest(&caps), Some(hex.clone()));
        assert_eq!(
            reported_build_digest(&serde_json::json!({"server": {"digest": hex}})).map(|h| h.len()),
            Some(64)
        );
        assert_eq!(
            reported_build_digest(&serde_json::json!({"server": {"digest": "sha256:short"}})),
            None
        );
        assert_eq!(
            reported_build_digest(&serde_json::json!({"api_version": "v1"})),
            None
        );
    }

    #[test]
    fn outcome_labels_are_never_upgraded() {
        let cases = [
            (Outcome::Pass, OutcomeLabel::Pass),
            (
                Outcome::Flaky {
                    attempts: 2,
                    first_failure: "x".into(),
                },
                OutcomeLabel::Flaky,
            ),
            (Outcome::Skip { reason: "r".into() }, OutcomeLabel::Skip),
            (
                Outcome::Fail {
                    step: "s".into(),
                    reason: "r".into(),
                },
                OutcomeLabel::Fail,
            ),
            (Outcome::Error { reason: "r".into() }, OutcomeLabel::Error),
        ];
        for (outcome, label) in cases {
            assert_eq!(OutcomeLabel::of(&outcome), label);
        }
    }
}
