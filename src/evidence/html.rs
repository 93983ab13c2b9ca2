//! `report.html`: the run folder as a reviewer reads it at a glance, in one self-contained
//! page (no scripts, no network, a strict Content-Security-Policy).
//!
//! It is rendered from the sanitized receipt and the transcript files the writer produced,
//! nothing else, so it can never hold more than they do; the writer scans it for secrets like
//! every other file. Values reach the page only through askama's HTML escaping.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use askama::Template;
use base64::Engine as _;
use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use super::receipt::{OutcomeLabel, Receipt, ScenarioResult, Statement};

/// The page's only style sheet, inlined; the CSP allows exactly this text by its hash.
const CSS: &str = include_str!("../../templates/report.css");

/// Characters of a body shown in the page; the transcript file has the rest.
const MAX_SHOWN_BODY: usize = 8 * 1024;
/// SSE frames shown per stream.
const MAX_SHOWN_FRAMES: usize = 50;

#[derive(Debug, thiserror::Error)]
pub enum HtmlError {
    #[error("read transcript `{path}` for the report")]
    Transcript {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("render report.html")]
    Render(#[from] askama::Error),
}

/// Renders `report.html` from the receipt and the folder's transcript files (path → bytes).
pub(crate) fn render(
    statement: &Statement,
    transcripts: &BTreeMap<String, Vec<u8>>,
) -> Result<String, HtmlError> {
    let r = &statement.predicate;
    let overall = r
        .profiles
        .iter()
        .find(|p| p.profile == r.selection.profile)
        .or_else(|| r.profiles.iter().find(|p| p.profile == "all"))
        .or_else(|| r.profiles.first())
        .map(profile_row)
        .unwrap_or_else(|| ProfileRow {
            profile: r.selection.profile.clone(),
            verdict: "non-conformant".to_owned(),
            reason: Some("no profile was judged".to_owned()),
            counts: [0; 5],
            must_run: 0,
        });
    let mut failures = Vec::new();
    for s in r
        .scenarios
        .iter()
        .filter(|s| matches!(s.outcome, OutcomeLabel::Fail | OutcomeLabel::Error))
    {
        failures.push(failure(s, transcripts)?);
    }
    let reason_of = |s: &ScenarioResult| s.reason.clone().unwrap_or_default();
    let skips = r
        .scenarios
        .iter()
        .filter(|s| s.outcome == OutcomeLabel::Skip)
        .map(|s| SkipRow {
            id: s.id.clone(),
            title: s.title.clone(),
            level: s.level.clone(),
            reason: reason_of(s),
        })
        .collect();
    let flaky: Vec<SkipRow> = r
        .scenarios
        .iter()
        .filter(|s| s.outcome == OutcomeLabel::Flaky)
        .map(|s| SkipRow {
            id: s.id.clone(),
            title: s.title.clone(),
            level: s.level.clone(),
            reason: reason_of(s),
        })
        .collect();
    let page = Page {
        csp: csp(),
        css: CSS,
        run_id: &r.run_id,
        target_line: format!(
            "{} target {} · {} scenarios · {}",
            r.target.kind,
            r.target.base_url,
            r.counts.total,
            seconds(r.duration_ms)
        ),
        counts_line: counts_line(r),
        interrupted: r.interrupted,
        not_run: &r.not_run,
        notes: notes(r),
        identity: identity(statement),
        profiles: r.profiles.iter().map(profile_row).collect(),
        overall,
        flaky_count: flaky.len(),
        failures,
        skips,
        flaky,
        not_applicable: r
            .selection
            .not_applicable
            .iter()
            .map(|n| (n.id.clone(), n.reason.clone()))
            .collect(),
        scenarios: r.scenarios.iter().map(scenario_row).collect(),
        coverage: coverage(r),
        uncovered: uncovered_must_clauses(r),
        legend: LEGEND,
        timeline_total: seconds(timeline_total_ms(r)),
        bars: bars(r),
        figures: figures(r),
        streams: r
            .streams
            .iter()
            .map(|s| {
                (
                    s.scenario.clone(),
                    s.step.clone(),
                    opt(s.status.map(u64::from)),
                    s.events.to_string(),
                    opt_ms(s.first_frame_ms),
                    opt_ms(s.eof_ms),
                    s.end.clone(),
                )
            })
            .collect(),
        measurements: r
            .measurements
            .iter()
            .map(|m| {
                (
                    m.scenario.clone(),
                    m.name.clone(),
                    format!("{:.3}", m.seconds),
                )
            })
            .collect(),
        swept: r
            .cleanup
            .swept
            .iter()
            .map(|s| (s.scenario.clone(), s.path.clone()))
            .collect(),
        absent: r
            .cleanup
            .confirmed_absent
            .iter()
            .map(|a| (a.scenario.clone(), a.path.clone(), a.step.clone()))
            .collect(),
        sdk: r.sdk_matrix.as_ref().map(sdk_table),
    };
    Ok(page.render()?)
}

/// The page's policy: nothing may load or run; only the inline style sheet, by its hash.
fn csp() -> String {
    let hash = base64::engine::general_purpose::STANDARD.encode(Sha256::digest(CSS.as_bytes()));
    format!(
        "default-src 'none'; style-src 'sha256-{hash}'; img-src 'none'; base-uri 'none'; form-action 'none'"
    )
}

/// The text a reader sees in HTML, for the secret scan: askama's escapes turned back, so a
/// value cannot hide from the scanner behind `&#34;`.
pub(crate) fn unescape(html: &str) -> String {
    html.replace("&#34;", "\"")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&lt;", "<")
        .replace("&#60;", "<")
        .replace("&gt;", ">")
        .replace("&#62;", ">")
        .replace("&amp;", "&")
        .replace("&#38;", "&")
}

/// MUST clauses of the contract that no scenario of the run checked, as the receipt's coverage
/// section records them; the page shows them under the coverage table.
fn uncovered_must_clauses(receipt: &Receipt) -> Vec<String> {
    receipt.coverage.unchecked.clone()
}

#[derive(Template)]
#[template(path = "report.html")]
struct Page<'a> {
    csp: String,
    css: &'a str,
    run_id: &'a str,
    target_line: String,
    counts_line: String,
    interrupted: bool,
    not_run: &'a [String],
    notes: Vec<String>,
    /// (label, value, monospace).
    identity: Vec<(String, String, bool)>,
    profiles: Vec<ProfileRow>,
    overall: ProfileRow,
    flaky_count: usize,
    failures: Vec<FailureCard>,
    skips: Vec<SkipRow>,
    flaky: Vec<SkipRow>,
    not_applicable: Vec<(String, String)>,
    scenarios: Vec<ScenarioRow>,
    coverage: Vec<ClauseRow>,
    uncovered: Vec<String>,
    legend: &'static [(&'static str, &'static str)],
    timeline_total: String,
    bars: Vec<Bar>,
    figures: Vec<(String, String)>,
    /// (scenario, step, status, events, first frame, EOF, end).
    streams: Vec<(String, String, String, String, String, String, String)>,
    measurements: Vec<(String, String, String)>,
    swept: Vec<(String, String)>,
    absent: Vec<(String, String, String)>,
    sdk: Option<SdkTable>,
}

/// The SDK matrix: one column per SDK, one row per journey.
struct SdkTable {
    columns: Vec<String>,
    rows: Vec<SdkRow>,
}

struct SdkRow {
    journey: String,
    title: String,
    /// (outcome class, label, detail) per SDK, in column order.
    cells: Vec<(&'static str, &'static str, String)>,
}

fn sdk_table(m: &crate::sdk::SdkMatrix) -> SdkTable {
    use crate::sdk::CellOutcome;
    SdkTable {
        columns: m
            .sdks
            .iter()
            .map(|c| {
                if c.judged {
                    format!("{} (judges)", c.sdk)
                } else {
                    c.sdk.clone()
                }
            })
            .collect(),
        rows: m
            .journeys
            .iter()
            .map(|row| SdkRow {
                journey: row.journey.clone(),
                title: row.title.clone(),
                cells: m
                    .sdks
                    .iter()
                    .map(|col| match m.cell(&row.journey, &col.sdk) {
                        None => ("skip", "NOT RUN", String::new()),
                        Some(c) => {
                            let (class, label) = match c.outcome {
                                CellOutcome::Pass => ("pass", "PASS"),
                                CellOutcome::Skip => ("skip", "SKIP"),
                                CellOutcome::Fail => ("fail", "FAIL"),
                                CellOutcome::Error => ("error", "ERROR"),
                            };
                            (class, label, c.detail.clone().unwrap_or_default())
                        }
                    })
                    .collect(),
            })
            .collect(),
    }
}

const LEGEND: &[(&str, &str)] = &[
    ("pass", "PASS"),
    ("flaky", "FLAKY"),
    ("skip", "SKIP"),
    ("fail", "FAIL"),
    ("error", "ERROR"),
];

struct ProfileRow {
    profile: String,
    verdict: String,
    reason: Option<String>,
    /// PASS, FLAKY, SKIP, FAIL, ERROR.
    counts: [usize; 5],
    must_run: usize,
}

fn profile_row(p: &super::receipt::ProfileResult) -> ProfileRow {
    let c = |k: &str| p.counts.get(k).copied().unwrap_or(0);
    ProfileRow {
        profile: p.profile.clone(),
        verdict: p.verdict.clone(),
        reason: p.reason.clone(),
        counts: [c("PASS"), c("FLAKY"), c("SKIP"), c("FAIL"), c("ERROR")],
        must_run: p.must_run,
    }
}

struct FailureCard {
    id: String,
    title: String,
    outcome: &'static str,
    label: &'static str,
    card_class: &'static str,
    reason: String,
    level: String,
    family: String,
    failed_step: Option<String>,
    clauses: Vec<String>,
    attempts: u32,
    duration: String,
    transcript: Option<TranscriptView>,
}

struct SkipRow {
    id: String,
    title: String,
    level: String,
    reason: String,
}

struct ScenarioRow {
    id: String,
    title: String,
    outcome: &'static str,
    label: &'static str,
    level: String,
    start: String,
    duration: String,
    clauses: String,
    transcript: Option<String>,
    /// `throttled: 3 waits, 4.0 s` when it waited out throttling answers.
    throttled: Option<String>,
}

struct ClauseRow {
    clause: String,
    status: &'static str,
    status_class: &'static str,
    /// (scenario, outcome class, tooltip).
    scenarios: Vec<(String, &'static str, String)>,
}

struct Bar {
    id: String,
    outcome: &'static str,
    x: String,
    width: String,
    duration: String,
    tip: String,
}

struct TranscriptView {
    path: String,
    entries: Vec<EntryView>,
}

struct EntryView {
    step: String,
    at_ms: u64,
    failed: bool,
    line: String,
    /// (caption, preformatted text).
    parts: Vec<(String, String)>,
    /// (caption, header pairs), shown as tables: a header per row, so that no value runs
    /// into the next header's name as one line of text would.
    headers: Vec<(String, Vec<(String, String)>)>,
}

pub(crate) fn outcome_class(o: OutcomeLabel) -> &'static str {
    match o {
        OutcomeLabel::Pass => "pass",
        OutcomeLabel::Flaky => "flaky",
        OutcomeLabel::Skip => "skip",
        OutcomeLabel::Fail => "fail",
        OutcomeLabel::Error => "error",
    }
}

fn outcome_label(o: OutcomeLabel) -> &'static str {
    match o {
        OutcomeLabel::Pass => "PASS",
        OutcomeLabel::Flaky => "FLAKY",
        OutcomeLabel::Skip => "SKIP",
        OutcomeLabel::Fail => "FAIL",
        OutcomeLabel::Error => "ERROR",
    }
}

fn seconds(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

fn opt(v: Option<u64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".to_owned())
}

fn opt_ms(v: Option<u64>) -> String {
    v.map(|v| format!("{v} ms"))
        .unwrap_or_else(|| "-".to_owned())
}

fn counts_line(r: &Receipt) -> String {
    let c = &r.counts;
    let mut line = format!(
        "{} scenarios: {} pass, {} flaky, {} skip, {} fail, {} error",
        c.total, c.pass, c.flaky, c.skip, c.fail, c.error
    );
    if c.not_run > 0 {
        let _ = write!(line, ", {} never ran", c.not_run);
    }
    line
}

/// What narrows or qualifies the verdict: a subset of the catalog, retries, certification.
fn notes(r: &Receipt) -> Vec<String> {
    let s = &r.selection;
    let mut notes = Vec::new();
    let mut narrowed = Vec::new();
    if s.profile != "all" {
        narrowed.push(format!("profile {}", s.profile));
    }
    if !s.filters.is_empty() {
        narrowed.push(format!("filters {}", s.filters.join(", ")));
    }
    if let Some(shard) = &s.shard {
        narrowed.push(format!("shard {shard}"));
    }
    if !narrowed.is_empty() {
        notes.push(format!(
            "Subset: {} scenarios selected by {}; the verdict covers them only.",
            r.counts.total + r.counts.not_run,
            narrowed.join("; ")
        ));
    }
    if !s.not_applicable.is_empty() {
        notes.push(format!(
            "{} selected scenario(s) are not applicable to this target and did not run (listed under Skips).",
            s.not_applicable.len()
        ));
    }
    if s.retries > 0 {
        notes.push(format!(
            "Failed scenarios were retried up to {} time(s); a pass on a retry is FLAKY, never PASS.",
            s.retries
        ));
    }
    if s.certify {
        notes.push("Certification run: any skip makes the verdict non-conformant.".to_owned());
    }
    if let Some(gate) = &r.gate {
        notes.push(format!(
            "Gate against the baseline {} ({} entries): {}. The verdict above is unchanged by it.",
            gate.baseline.file,
            gate.baseline.entries.len(),
            gate.line()
        ));
    }
    let c = &r.consumption;
    notes.push(format!(
        "Consumed: {} sandboxes (at most {} at once), {:.1} sandbox-seconds, {} sessions, {} requests, {} bytes received; {} throttle waits ({:.1} s).{}",
        c.sandboxes_created,
        c.peak_sandboxes,
        c.sandbox_seconds,
        c.sessions_created,
        c.requests,
        c.bytes_received,
        c.throttles.waits,
        c.throttles.waited_ms as f64 / 1000.0,
        if c.budget_ended {
            " The sandbox-seconds budget (--max-sandbox-seconds) ended the run."
        } else {
            ""
        }
    ));
    notes
}

fn identity(statement: &Statement) -> Vec<(String, String, bool)> {
    let r = &statement.predicate;
    let t = &r.target;
    let mut rows = vec![
        (
            "target".to_owned(),
            format!("{} ({})", t.base_url, t.kind),
            false,
        ),
        (
            "server".to_owned(),
            format!(
                "{} {}, API {}",
                t.server_name.as_deref().unwrap_or("unknown server"),
                t.server_version.as_deref().unwrap_or(""),
                t.api_version.as_deref().unwrap_or("unknown")
            ),
            false,
        ),
    ];
    for s in &statement.subject {
        rows.push((
            "tested build".to_owned(),
            format!("{} sha256:{}", s.name, s.digest.sha256),
            true,
        ));
    }
    let source = match t.subject_source {
        super::receipt::SubjectSource::ReferenceBinary => {
            "the sandspec binary that served as the reference server"
        }
        super::receipt::SubjectSource::ReportedBuild => "the build digest the target reports",
        super::receipt::SubjectSource::CapabilitiesDocument => {
            "the target's capabilities document (it reports no build digest)"
        }
    };
    rows.push(("build digest of".to_owned(), source.to_owned(), false));
    if let Some(d) = &t.build_digest {
        rows.push(("reported build".to_owned(), d.clone(), true));
    }
    if !t.defects.is_empty() {
        rows.push(("deliberate defects".to_owned(), t.defects.join(", "), false));
    }
    rows.push((
        "suite".to_owned(),
        format!(
            "{} {} commit {}",
            r.suite.name, r.suite.version, r.suite.commit
        ),
        true,
    ));
    rows.push((
        "run".to_owned(),
        format!(
            "{} to {} ({})",
            r.started_at,
            r.ended_at,
            seconds(r.duration_ms)
        ),
        false,
    ));
    let e = &r.environment;
    rows.push((
        "environment".to_owned(),
        format!(
            "{} {}, {} CPUs{}",
            e.os,
            e.arch,
            e.cpu_count,
            e.os_release
                .as_deref()
                .map(|v| format!(", {v}"))
                .unwrap_or_default()
        ),
        false,
    ));
    rows
}

fn scenario_row(s: &ScenarioResult) -> ScenarioRow {
    ScenarioRow {
        id: s.id.clone(),
        title: s.title.clone(),
        outcome: outcome_class(s.outcome),
        label: outcome_label(s.outcome),
        level: s.level.clone(),
        start: seconds(s.started_ms),
        duration: seconds(s.duration_ms),
        clauses: s.clauses.join(", "),
        transcript: s.transcript.as_ref().map(|t| t.path.clone()),
        throttled: (s.throttled.waits > 0).then(|| {
            format!(
                "throttled: {} waits, {:.1} s",
                s.throttled.waits,
                s.throttled.waited_ms as f64 / 1000.0
            )
        }),
    }
}

fn failure(
    s: &ScenarioResult,
    transcripts: &BTreeMap<String, Vec<u8>>,
) -> Result<FailureCard, HtmlError> {
    let transcript = match &s.transcript {
        None => None,
        Some(t) => match transcripts.get(&t.path) {
            None => None,
            Some(bytes) => Some(TranscriptView {
                path: t.path.clone(),
                entries: transcript_entries(&t.path, bytes, s.failed_step.as_deref())?,
            }),
        },
    };
    Ok(FailureCard {
        id: s.id.clone(),
        title: s.title.clone(),
        outcome: outcome_class(s.outcome),
        label: outcome_label(s.outcome),
        card_class: if s.outcome == OutcomeLabel::Error {
            "o-error-card"
        } else {
            ""
        },
        reason: s.reason.clone().unwrap_or_default(),
        level: s.level.clone(),
        family: s.family.clone(),
        failed_step: s.failed_step.clone(),
        clauses: s.clauses.clone(),
        attempts: s.attempts,
        duration: seconds(s.duration_ms),
        transcript,
    })
}

/// Clauses in natural order (`SBX-2.10` after `SBX-2.9`), each with its scenarios.
fn coverage(r: &Receipt) -> Vec<ClauseRow> {
    let mut by_clause: BTreeMap<Vec<NaturalPart>, (String, Vec<&ScenarioResult>)> = BTreeMap::new();
    for s in &r.scenarios {
        for c in &s.clauses {
            by_clause
                .entry(natural_key(c))
                .or_insert_with(|| (c.clone(), Vec::new()))
                .1
                .push(s);
        }
    }
    by_clause
        .into_values()
        .map(|(clause, scenarios)| {
            let any = |f: &dyn Fn(OutcomeLabel) -> bool| scenarios.iter().any(|s| f(s.outcome));
            let (status, status_class) =
                if any(&|o| matches!(o, OutcomeLabel::Fail | OutcomeLabel::Error)) {
                    ("failing", "o-fail")
                } else if any(&|o| matches!(o, OutcomeLabel::Pass | OutcomeLabel::Flaky)) {
                    ("checked", "o-pass")
                } else {
                    ("not checked", "o-skip")
                };
            ClauseRow {
                clause,
                status,
                status_class,
                scenarios: scenarios
                    .iter()
                    .map(|s| {
                        (
                            s.id.clone(),
                            outcome_class(s.outcome),
                            format!("{} {} ({})", outcome_label(s.outcome), s.title, s.level),
                        )
                    })
                    .collect(),
            }
        })
        .collect()
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum NaturalPart {
    Number(u64),
    Text(String),
}

fn natural_key(s: &str) -> Vec<NaturalPart> {
    let mut parts = Vec::new();
    let mut digits = String::new();
    let mut text = String::new();
    for ch in s.chars() {
        if ch.is_ascii_digit() {
            if !text.is_empty() {
                parts.push(NaturalPart::Text(std::mem::take(&mut text)));
            }
            digits.push(ch);
        } else {
            if !digits.is_empty() {
                parts.push(NaturalPart::Number(
                    std::mem::take(&mut digits).parse().unwrap_or(u64::MAX),
                ));
            }
            text.push(ch);
        }
    }
    if !digits.is_empty() {
        parts.push(NaturalPart::Number(digits.parse().unwrap_or(u64::MAX)));
    }
    if !text.is_empty() {
        parts.push(NaturalPart::Text(text));
    }
    parts
}

/// The axis of the timeline: the run's wall time, or the last scenario's end if later.
fn timeline_total_ms(r: &Receipt) -> u64 {
    r.scenarios
        .iter()
        .map(|s| s.started_ms.saturating_add(s.duration_ms))
        .max()
        .unwrap_or(0)
        .max(r.duration_ms)
        .max(1)
}

/// One bar per scenario in order of start, on a 1000-unit axis.
fn bars(r: &Receipt) -> Vec<Bar> {
    let total = timeline_total_ms(r) as f64;
    let mut scenarios: Vec<&ScenarioResult> = r.scenarios.iter().collect();
    scenarios.sort_by_key(|s| (s.started_ms, s.id.clone()));
    scenarios
        .into_iter()
        .map(|s| {
            let x = (s.started_ms as f64 / total * 1000.0).min(1000.0);
            // A skip takes no time; it still gets a sliver, so it can be seen.
            let width = (s.duration_ms as f64 / total * 1000.0)
                .max(2.0)
                .min(1000.0 - x + 2.0);
            Bar {
                id: s.id.clone(),
                outcome: outcome_class(s.outcome),
                x: format!("{x:.2}"),
                width: format!("{width:.2}"),
                duration: seconds(s.duration_ms),
                tip: format!(
                    "{} {} from +{} for {}",
                    s.id,
                    outcome_label(s.outcome),
                    seconds(s.started_ms),
                    seconds(s.duration_ms)
                ),
            }
        })
        .collect()
}

/// The figures a review quotes: stream latencies and cleanup confirmations.
fn figures(r: &Receipt) -> Vec<(String, String)> {
    let mut rows = Vec::new();
    let first: Vec<u64> = r.streams.iter().filter_map(|s| s.first_frame_ms).collect();
    let eof: Vec<u64> = r.streams.iter().filter_map(|s| s.eof_ms).collect();
    rows.push((
        "SSE streams".to_owned(),
        format!(
            "{} opened, {} events received",
            r.streams.len(),
            r.streams.iter().map(|s| s.events).sum::<usize>()
        ),
    ));
    rows.push(("time to first frame".to_owned(), spread(&first)));
    rows.push(("time to EOF".to_owned(), spread(&eof)));
    rows.push((
        "requests".to_owned(),
        format!(
            "{} sent, {} 2xx responses, {} 401/403 responses",
            r.counts.requests, r.counts.positive_operations, r.counts.authentication_rejections
        ),
    ));
    rows.push((
        "cleanup".to_owned(),
        format!(
            "{} absence checks confirmed (404 not_found and absent from every list page); {} leftovers removed by the sweep",
            r.cleanup.confirmed_absent.len(),
            r.cleanup.swept.len()
        ),
    ));
    rows
}

/// `median 12 ms, max 40 ms (n = 7)`, or `none measured`.
fn spread(values: &[u64]) -> String {
    if values.is_empty() {
        return "none measured".to_owned();
    }
    let mut v = values.to_vec();
    v.sort_unstable();
    let median = v[v.len() / 2];
    let max = v[v.len() - 1];
    format!("median {median} ms, max {max} ms (n = {})", v.len())
}

// The transcript file as the writer wrote it (`writer::render`): read leniently, since the page
// only shows it.

#[derive(Deserialize)]
struct TranscriptFile {
    entries: Vec<EntryFile>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum EntryFile {
    Http(HttpFile),
    Sse(SseFile),
    Note(NoteFile),
}

#[derive(Deserialize)]
struct HttpFile {
    step: String,
    at_ms: u64,
    credential: serde_json::Value,
    method: String,
    target: String,
    request_headers: Vec<(String, String)>,
    request_body: Option<BodyFile>,
    status: Option<u16>,
    response_headers: Vec<(String, String)>,
    response_body: Option<BodyFile>,
    duration_ms: u64,
    error: Option<String>,
}

#[derive(Deserialize)]
struct SseFile {
    step: String,
    at_ms: u64,
    credential: serde_json::Value,
    target: String,
    last_event_id: Option<String>,
    status: Option<u16>,
    frames: Vec<serde_json::Value>,
    first_frame_ms: Option<u64>,
    eof_ms: Option<u64>,
    end: String,
}

#[derive(Deserialize)]
struct NoteFile {
    at_ms: u64,
    text: String,
}

#[derive(Deserialize)]
struct BodyFile {
    len: usize,
    text: Option<String>,
    base64: Option<String>,
    truncated: bool,
}

fn transcript_entries(
    path: &str,
    bytes: &[u8],
    failed_step: Option<&str>,
) -> Result<Vec<EntryView>, HtmlError> {
    let file: TranscriptFile =
        serde_json::from_slice(bytes).map_err(|source| HtmlError::Transcript {
            path: path.to_owned(),
            source,
        })?;
    Ok(file
        .entries
        .into_iter()
        .map(|e| match e {
            EntryFile::Http(h) => {
                let mut parts = Vec::new();
                if let Some(b) = &h.request_body {
                    parts.push(("request body".to_owned(), body(b, path)));
                }
                if let Some(b) = &h.response_body {
                    parts.push(("response body".to_owned(), body(b, path)));
                }
                let headers = [
                    ("request headers", h.request_headers),
                    ("response headers", h.response_headers),
                ]
                .into_iter()
                .filter(|(_, pairs)| !pairs.is_empty())
                .map(|(caption, pairs)| (caption.to_owned(), pairs))
                .collect();
                let answer = match (&h.status, &h.error) {
                    (_, Some(err)) => format!("error: {err}"),
                    (Some(status), None) => status.to_string(),
                    (None, None) => "no response".to_owned(),
                };
                EntryView {
                    failed: failed_step == Some(h.step.as_str()),
                    line: format!(
                        "{} {} {} → {answer} in {} ms",
                        h.method,
                        h.target,
                        credential(&h.credential),
                        h.duration_ms
                    ),
                    step: h.step,
                    at_ms: h.at_ms,
                    parts,
                    headers,
                }
            }
            EntryFile::Sse(s) => {
                let mut frames = String::new();
                for f in s.frames.iter().take(MAX_SHOWN_FRAMES) {
                    let _ = writeln!(frames, "{}", frame(f));
                }
                if s.frames.len() > MAX_SHOWN_FRAMES {
                    let _ = writeln!(
                        frames,
                        "… {} more frames in {path}",
                        s.frames.len() - MAX_SHOWN_FRAMES
                    );
                }
                EntryView {
                    failed: failed_step == Some(s.step.as_str()),
                    line: format!(
                        "SSE GET {} {}{} → {} · first frame {} · EOF {} · end {}",
                        s.target,
                        credential(&s.credential),
                        s.last_event_id
                            .as_deref()
                            .map(|id| format!(" (Last-Event-ID {id})"))
                            .unwrap_or_default(),
                        opt(s.status.map(u64::from)),
                        opt_ms(s.first_frame_ms),
                        opt_ms(s.eof_ms),
                        s.end
                    ),
                    step: s.step,
                    at_ms: s.at_ms,
                    parts: if frames.is_empty() {
                        Vec::new()
                    } else {
                        vec![(format!("{} frames", s.frames.len()), frames)]
                    },
                    headers: Vec::new(),
                }
            }
            EntryFile::Note(n) => EntryView {
                step: "note".to_owned(),
                at_ms: n.at_ms,
                failed: false,
                line: n.text,
                parts: Vec::new(),
                headers: Vec::new(),
            },
        })
        .collect())
}

/// How a request authenticated, as the transcript records it (never a token).
fn credential(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) if s == "none" => "without a credential".to_owned(),
        serde_json::Value::String(s) if s == "scenario_literal" => {
            "with a literal Authorization header".to_owned()
        }
        serde_json::Value::Object(m) => match m.get("principal").and_then(|p| p.as_str()) {
            Some(p) => format!("as {p}"),
            None => format!("as {v}"),
        },
        other => format!("as {other}"),
    }
}

fn body(b: &BodyFile, path: &str) -> String {
    let mut out = match (&b.text, &b.base64) {
        (Some(text), _) => shorten(text, path),
        (None, Some(_)) => format!("({} bytes, not text: base64 in {path})", b.len),
        (None, None) => format!("({} bytes)", b.len),
    };
    if b.truncated {
        let _ = write!(out, "\n… cut at recording; {} bytes in all", b.len);
    }
    out
}

fn shorten(text: &str, path: &str) -> String {
    if text.len() <= MAX_SHOWN_BODY {
        return text.to_owned();
    }
    let mut end = MAX_SHOWN_BODY;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}\n… {} more bytes in {path}",
        &text[..end],
        text.len() - end
    )
}

fn frame(f: &serde_json::Value) -> String {
    let Some((kind, body)) = f.as_object().and_then(|m| m.iter().next()) else {
        return f.to_string();
    };
    let at = body.get("at_ms").and_then(|v| v.as_u64()).unwrap_or(0);
    let field = |k: &str| body.get(k).and_then(|v| v.as_str()).unwrap_or("");
    match kind.as_str() {
        "event" => {
            let data = field("data");
            let data = if data.len() > 200 {
                let mut end = 200;
                while !data.is_char_boundary(end) {
                    end -= 1;
                }
                format!("{}…", &data[..end])
            } else {
                data.to_owned()
            };
            format!(
                "+{at} ms event {} id {}: {data}",
                field("event"),
                body.get("id").and_then(|v| v.as_str()).unwrap_or("-")
            )
        }
        "comment" => format!("+{at} ms comment {}", field("text")),
        "retry" => format!(
            "+{at} ms retry {}",
            body.get("ms").and_then(|v| v.as_u64()).unwrap_or(0)
        ),
        "fault" => format!("+{at} ms fault {}", field("fault")),
        other => format!("+{at} ms {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clauses_sort_naturally() {
        let mut v = vec!["SBX-2.10", "SBX-2.9", "AUTH-1.1", "SBX-2.9a"];
        v.sort_by_key(|c| natural_key(c));
        assert_eq!(v, ["AUTH-1.1", "SBX-2.9", "SBX-2.9a", "SBX-2.10"]);
    }

    #[test]
    fn unescape_undoes_what_the_template_escapes() {
        let escaped = "&#34;password&#34;: &#34;x&amp;y&#34; &lt;b&gt; &#39;";
        assert_eq!(unescape(escaped), r#""password": "x&y" <b> '"#);
    }

    #[test]
    fn the_policy_allows_the_style_sheet_and_nothing_else() {
        let policy = csp();
        assert!(policy.starts_with("default-src 'none'; style-src 'sha256-"));
        assert!(!policy.contains("unsafe") && !policy.contains("script-src"));
    }

    #[test]
    fn spread_reports_median_and_max() {
        assert_eq!(spread(&[]), "none measured");
        assert_eq!(spread(&[30, 10, 20]), "median 20 ms, max 30 ms (n = 3)");
    }
}
