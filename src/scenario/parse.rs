//! Loading scenario files: YAML parsing, then the checks serde cannot make (ID patterns,
//! known capabilities and defects, variables defined before use), all reported as
//! `file:line:col: message`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use regex::Regex;

use super::model::{
    Capture, Expect, HeaderCheck, JsonCheck, Level, Located, NumExpr, Pos, Principal, Request,
    Scenario, Step, Via,
};
use super::template::{Template, parse_parts};

/// Limit keys a scenario may refer to as `{{limits.<key>}}`.
pub const LIMIT_KEYS: &[&str] = &[
    "max_body_bytes",
    "max_file_bytes",
    "default_page_size",
    "max_page_size",
    "max_streams_per_principal",
    "heartbeat_interval_s",
    "max_stream_duration_s",
    "max_sandboxes_per_principal",
    "max_timeout_s",
    "default_timeout_s",
    "max_queue_depth",
    "max_process_output_bytes",
];

/// Retention keys a scenario may refer to as `{{retention.<key>}}`.
pub const RETENTION_KEYS: &[&str] = &["process_output_s", "result_s", "events_s", "idempotency_s"];

/// How a clause of another profile is checked: another profile's clauses are its own
/// document's, and the ID's prefix picks the document.
type ProfileClauses = (&'static str, fn(&str) -> bool, &'static str);

const PROFILE_CLAUSE_DOCS: [ProfileClauses; 3] = [
    (
        "MCP-",
        crate::profile::is_mcp_clause,
        "docs/profiles/mcp.md",
    ),
    (
        "ASB-",
        crate::agent_sandbox::is_clause,
        "docs/profiles/agent-sandbox.md",
    ),
    (
        "E2B-",
        crate::profile::is_e2b_clause,
        "docs/profiles/e2b.md",
    ),
];

/// Capabilities a scenario may require. Features come from `capabilities.features`
/// ([`FEATURES`]); `two_providers` means at least two providers are advertised (for
/// `{{provider.other}}`); `peer` and `admin_token` are what the runner was given (a second
/// endpoint, the test-controls admin token); `server_control` and `database_control` are
/// what the runner itself started and may therefore kill, restart, stop and start (the
/// reference server's processes, the private PostgreSQL cluster of its database);
/// `isolation` means `capabilities.isolation.namespaces` holds user, mount, pid and network;
/// `memory_limit` means `capabilities.isolation.enforced` holds `memory`.
pub const CAPABILITIES: &[&str] = &[
    "pause",
    "snapshots",
    "previews",
    "test_controls",
    "sessions",
    "fixture_models",
    "expiry_hold",
    "two_providers",
    "peer",
    "admin_token",
    "server_control",
    "database_control",
    "restart",
    "isolation",
    "memory_limit",
];

/// Capabilities a target advertises in `capabilities.features`: the optional parts of the
/// contract, and what only a test deployment offers (test controls, the fixture model
/// scripts, the expiry hold).
pub const FEATURES: &[&str] = &[
    "pause",
    "snapshots",
    "previews",
    "test_controls",
    "sessions",
    "fixture_models",
    "expiry_hold",
];

/// Longest `sleep` a scenario may ask for.
pub const MAX_SLEEP_MS: u64 = 10_000;

/// A scenario file that cannot be used, with the place that is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    pub file: PathBuf,
    pub pos: Pos,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file.display(),
            self.pos.line,
            self.pos.col,
            self.message
        )
    }
}

impl std::error::Error for ParseError {}

/// A scenario with where it came from.
#[derive(Debug, Clone)]
pub struct LoadedScenario {
    pub scenario: Scenario,
    pub file: PathBuf,
    /// The folder below the scenarios root, e.g. `lifecycle`: the profile it belongs to.
    pub family: String,
}

impl LoadedScenario {
    pub fn id(&self) -> &str {
        &self.scenario.id.value
    }
}

/// Parses and checks one scenario file's text.
pub fn parse_str(file: &Path, text: &str) -> Result<Scenario, Vec<ParseError>> {
    let scenario: Scenario = serde_saphyr::from_str(text).map_err(|e| {
        let pos = e
            .location()
            .map(|l| Pos {
                line: l.line(),
                col: l.column(),
            })
            .unwrap_or_default();
        vec![ParseError {
            file: file.to_owned(),
            pos,
            message: first_line(&e.to_string()),
        }]
    })?;
    let mut checker = Checker {
        file,
        errors: Vec::new(),
    };
    checker.scenario(&scenario);
    if checker.errors.is_empty() {
        Ok(scenario)
    } else {
        checker.errors.sort_by_key(|e| e.pos);
        Err(checker.errors)
    }
}

/// The message of a rendered error, without the location and snippet the YAML crate adds.
fn first_line(rendered: &str) -> String {
    let line = rendered.lines().next().unwrap_or(rendered).trim();
    let line = line.strip_prefix("error: ").unwrap_or(line);
    // The crate appends " at line L column C"; the location is reported separately.
    let line = match line.rfind(" at line ") {
        Some(i) => &line[..i],
        None => line,
    };
    // ... or prefixes "line L column C: ".
    match line
        .strip_prefix("line ")
        .and_then(|rest| rest.split_once(": "))
    {
        Some((coords, message)) if coords.contains(" column ") => message.to_owned(),
        _ => line.to_owned(),
    }
}

/// Loads every `*.yaml` file below `root`; the first folder level is the family.
pub fn load_dir(root: &Path) -> Result<Vec<LoadedScenario>, Vec<ParseError>> {
    let (loaded, errors) = load_dir_partial(root);
    if errors.is_empty() {
        Ok(loaded)
    } else {
        Err(errors)
    }
}

/// Loads what it can: the good scenarios (sorted by ID) and every error. A scenario whose
/// ID is a duplicate is reported and left out, as is every file that does not parse.
pub fn load_dir_partial(root: &Path) -> (Vec<LoadedScenario>, Vec<ParseError>) {
    let mut files = Vec::new();
    if let Err(e) = collect_yaml(root, &mut files) {
        let error = ParseError {
            file: root.to_owned(),
            pos: Pos::default(),
            message: format!("cannot read: {e}"),
        };
        return (Vec::new(), vec![error]);
    }
    files.sort();
    let mut loaded = Vec::new();
    let mut errors = Vec::new();
    for file in files {
        let text = match std::fs::read_to_string(&file) {
            Ok(text) => text,
            Err(e) => {
                errors.push(ParseError {
                    file,
                    pos: Pos::default(),
                    message: format!("cannot read: {e}"),
                });
                continue;
            }
        };
        let family = file
            .strip_prefix(root)
            .ok()
            .and_then(|rel| rel.components().next())
            .filter(|_| file.parent() != Some(root))
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .unwrap_or_else(|| "misc".to_owned());
        match parse_str(&file, &text) {
            Ok(scenario) => loaded.push(LoadedScenario {
                scenario,
                file,
                family,
            }),
            Err(mut e) => errors.append(&mut e),
        }
    }
    let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut unique = Vec::with_capacity(loaded.len());
    for s in loaded {
        if let Some(first) = seen.get(s.id()) {
            errors.push(ParseError {
                file: s.file.clone(),
                pos: Pos::of(&s.scenario.id),
                message: format!(
                    "duplicate scenario id `{}` (also in {})",
                    s.id(),
                    first.display()
                ),
            });
        } else {
            seen.insert(s.id().to_owned(), s.file.clone());
            unique.push(s);
        }
    }
    unique.sort_by(|a, b| a.id().cmp(b.id()));
    (unique, errors)
}

fn collect_yaml(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    collect_yaml_in(dir, true, out)
}

/// At the catalog root, the folders of other protocol profiles (`e2b/`) are their own
/// catalogs and are left out.
fn collect_yaml_in(dir: &Path, root: bool, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            let profile_folder = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| crate::profile::Api::profile_folders().contains(&n));
            if !(root && profile_folder) {
                collect_yaml_in(&path, false, out)?;
            }
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(path);
        }
    }
    Ok(())
}

/// Post-parse checks, collecting every error rather than stopping at the first.
struct Checker<'a> {
    file: &'a Path,
    errors: Vec<ParseError>,
}

/// Names defined so far while walking the steps.
#[derive(Default, Clone)]
struct Scope {
    captures: BTreeSet<String>,
    /// Captures marked `secret: true`.
    secrets: BTreeSet<String>,
    digests: BTreeSet<String>,
    snapshots: BTreeSet<String>,
}

impl Checker<'_> {
    fn err(&mut self, pos: Pos, message: impl Into<String>) {
        self.errors.push(ParseError {
            file: self.file.to_owned(),
            pos,
            message: message.into(),
        });
    }

    fn scenario(&mut self, s: &Scenario) {
        let id_re =
            Regex::new(r"^[A-Z][A-Z0-9]*(-[A-Z][A-Z0-9]*)*-[0-9]{3}$").expect("static regex");
        if !id_re.is_match(&s.id.value) {
            self.err(
                Pos::of(&s.id),
                format!("scenario id `{}` must look like `SBX-LIFE-001`", s.id.value),
            );
        }
        if s.clauses.is_empty() {
            self.err(
                Pos::of(&s.id),
                "`clauses` must name at least one protocol clause",
            );
        }
        for c in &s.clauses {
            if let Some((_, defined, doc)) = PROFILE_CLAUSE_DOCS
                .iter()
                .find(|(prefix, _, _)| c.value.starts_with(prefix))
            {
                if !defined(&c.value) {
                    self.err(
                        Pos::of(c),
                        format!("clause `{}` is not defined in {doc}", c.value),
                    );
                }
                continue;
            }
            match super::clauses::clause(&c.value) {
                None => self.err(
                    Pos::of(c),
                    format!(
                        "clause `{}` is not a clause of docs/protocol.md (IDs look like `SBX-3.4`)",
                        c.value
                    ),
                ),
                Some(known) if known.withdrawn => self.err(
                    Pos::of(c),
                    format!("clause `{}` is withdrawn in docs/protocol.md", c.value),
                ),
                Some(_) => {}
            }
        }
        // The E2B profile's clauses are its own document's guarantees, every one a MUST; an
        // MCP clause is a MUST when its requirement says so.
        let cites_must = s.clauses.iter().any(|c| {
            c.value.starts_with("E2B-")
                || crate::profile::is_mcp_must_clause(&c.value)
                || c.value.starts_with("ASB-")
                || super::clauses::clause(&c.value).is_some_and(|k| k.level == Level::Must)
        });
        if s.level == Level::Must && !s.clauses.is_empty() && !cites_must {
            self.err(
                Pos::of(&s.clauses[0]),
                "a MUST scenario must cite at least one MUST clause",
            );
        }
        let requires: BTreeSet<&str> = s.requires.iter().map(|r| r.value.as_str()).collect();
        for cap in &s.requires {
            if !CAPABILITIES.contains(&cap.value.as_str()) {
                self.err(
                    Pos::of(cap),
                    format!(
                        "unknown capability `{}` (known: {})",
                        cap.value,
                        CAPABILITIES.join(", ")
                    ),
                );
            }
        }
        let mut named = BTreeSet::new();
        // The Agent Sandbox profile's scenarios run against a real service: their defects
        // are its stand-in's, not the reference server's.
        let stand_in = s.clauses.iter().any(|c| c.value.starts_with("ASB-"));
        for control in &s.defects {
            let defect = &control.defect;
            let known = if stand_in {
                crate::agent_sandbox::DEFECTS.contains(&defect.value.as_str())
            } else {
                defect.value.parse::<sandspec_defects::Defect>().is_ok()
            };
            if !known {
                self.err(
                    Pos::of(defect),
                    format!("unknown defect `{}`", defect.value),
                );
            } else if !named.insert(defect.value.as_str()) {
                self.err(
                    Pos::of(defect),
                    format!("defect `{}` is named twice", defect.value),
                );
            }
            let at = &control.fails_at;
            match s.steps_labelled(&at.value).len() {
                1 => {}
                0 => self.err(
                    Pos::of(at),
                    format!(
                        "`fails_at: {}` names no step (a step's `name`, or its method and path when it has none)",
                        at.value
                    ),
                ),
                n => self.err(
                    Pos::of(at),
                    format!(
                        "`fails_at: {}` names {n} steps; give the failing one a unique `name`",
                        at.value
                    ),
                ),
            }
        }
        // An Agent Sandbox scenario that fails against the real service shows by that that it
        // can fail; `tests/agent_sandbox.rs` requires every MUST one without a defect to.
        if s.level == Level::Must && s.defects.is_empty() && !stand_in {
            self.err(
                Pos::of(&s.id),
                "a MUST scenario must name the defects it catches, each with the step it fails at",
            );
        }
        if s.steps.is_empty() {
            self.err(Pos::of(&s.id), "`steps` must not be empty");
        }
        let mut scope = Scope::default();
        let ctx = Ctx {
            requires: &requires,
            cleanup: false,
        };
        for step in &s.steps {
            self.step(step, &mut scope, &ctx);
        }
        // Cleanup may use any capture: a capture that never happened skips the cleanup step.
        let ctx = Ctx {
            requires: &requires,
            cleanup: true,
        };
        for step in &s.cleanup {
            self.step(step, &mut scope, &ctx);
        }
    }

    fn step(&mut self, step: &Step, scope: &mut Scope, ctx: &Ctx<'_>) {
        match step {
            Step::Request(r) => self.request(r, scope, ctx, false),
            Step::Poll(p) => {
                // The poll's deadline is computed before its request is first sent, so it
                // cannot use what that request captures.
                self.num(&p.within_s, scope, ctx);
                self.request(&p.request, scope, ctx, false);
            }
            Step::Sse(sse) => {
                self.via(sse.via, sse.path.pos, ctx);
                self.principal(sse.principal, sse.path.pos, ctx);
                self.test_control(&sse.path, ctx);
                self.template(&sse.path, scope, ctx);
                for t in sse.headers.values().chain(sse.query.values()) {
                    self.template(t, scope, ctx);
                }
                if let Some(t) = &sse.last_event_id {
                    self.template(t, scope, ctx);
                }
                self.expect(&sse.expect, scope, ctx);
                for n in [
                    &sse.within_s,
                    &sse.expect_heartbeat_within_s,
                    &sse.min_duration_s,
                ]
                .into_iter()
                .flatten()
                {
                    self.num(n, scope, ctx);
                }
                for ev in sse.events.iter().chain(&sse.last_event) {
                    if let Some(t) = &ev.id {
                        self.template(t, scope, ctx);
                    }
                    for check in &ev.data {
                        self.json_check(check, scope, ctx);
                    }
                }
                for check in &sse.each_event {
                    self.json_check(check, scope, ctx);
                }
                if sse.id_gaps && !sse.strict_framing {
                    self.err(
                        sse.path.pos,
                        "`id_gaps` loosens `strict_framing`, which is off",
                    );
                }
                if sse.expect_none
                    && (!sse.events.is_empty()
                        || !sse.each_event.is_empty()
                        || sse.last_event.is_some())
                {
                    self.err(sse.path.pos, "`expect_none` contradicts `events`");
                }
                if let Some(name) = &sse.capture_last_id {
                    self.define_capture(&name.value, Pos::of(name), scope);
                }
            }
            Step::Digest(d) => {
                // The digest is a test control read with the admin token, and a comparison
                // holds background expiry so that only the scenario's own requests count.
                let missing: Vec<&str> = ["test_controls", "expiry_hold", "admin_token"]
                    .into_iter()
                    .filter(|c| !ctx.requires.contains(c))
                    .collect();
                if !missing.is_empty() {
                    self.err(
                        Pos::of(&d.into),
                        format!(
                            "a `digest` step needs `requires: [test_controls, expiry_hold, admin_token]` (missing: {})",
                            missing.join(", ")
                        ),
                    );
                }
                scope.digests.insert(d.into.value.clone());
            }
            Step::ExpectDigestUnchanged(since) if ctx.cleanup => self.err(
                Pos::of(&since.since),
                format!(
                    "`expect_digest_unchanged` cannot be a cleanup step: digest `{}` may never have been taken (steps stop at the first failure, every cleanup step runs)",
                    since.since.value
                ),
            ),
            Step::ExpectDigestUnchanged(since) => {
                if !scope.digests.contains(&since.since.value) {
                    self.err(
                        Pos::of(&since.since),
                        format!("no earlier `digest` named `{}`", since.since.value),
                    );
                }
            }
            Step::Snapshot(snap) => {
                self.principal(snap.principal, Pos::of(&snap.into), ctx);
                scope.snapshots.insert(snap.into.value.clone());
            }
            Step::ExpectSnapshotUnchanged(since) if ctx.cleanup => self.err(
                Pos::of(&since.since),
                format!(
                    "`expect_snapshot_unchanged` cannot be a cleanup step: snapshot `{}` may never have been taken (steps stop at the first failure, every cleanup step runs)",
                    since.since.value
                ),
            ),
            Step::ExpectSnapshotUnchanged(since) => {
                if !scope.snapshots.contains(&since.since.value) {
                    self.err(
                        Pos::of(&since.since),
                        format!("no earlier `snapshot` named `{}`", since.since.value),
                    );
                }
            }
            Step::Parallel(p) => {
                let single = p.request.iter().count();
                match (single, p.requests.is_empty(), &p.repeat) {
                    (1, true, Some(n)) => self.num(n, scope, ctx),
                    (0, false, None) => {}
                    _ => self.err(
                        p.expect.first().map(|_| Pos::default()).unwrap_or_default(),
                        "`parallel` takes either `requests: [...]` or `request` with `repeat`",
                    ),
                }
                for r in p.request.iter().chain(&p.requests) {
                    self.request(r, scope, ctx, true);
                }
                match (&p.within_s, &p.every_ms) {
                    (Some(n), _) => self.num(n, scope, ctx),
                    (None, Some(every)) => self.err(
                        Pos::of(every),
                        "`every_ms` paces the attempts of `within_s`, which is not given",
                    ),
                    (None, None) => {}
                }
                let rests = p.expect.iter().filter(|t| t.rest).count();
                if rests > 1 {
                    self.err(
                        Pos::default(),
                        "`parallel` may have at most one `rest` tally",
                    );
                }
                for t in &p.expect {
                    for h in &t.headers {
                        self.header_check(h, scope, ctx);
                    }
                    match (&t.exactly, t.rest) {
                        (Some(n), false) => self.num(n, scope, ctx),
                        (None, true) => {}
                        _ => self.err(
                            t.exactly.as_ref().map(|n| n.pos).unwrap_or_default(),
                            "a tally takes exactly one of `exactly: N` and `rest: true`",
                        ),
                    }
                }
            }
            Step::Sleep(s) => {
                if s.ms.value > MAX_SLEEP_MS {
                    self.err(
                        Pos::of(&s.ms),
                        format!("`sleep` is bounded to {MAX_SLEEP_MS} ms; use `poll`"),
                    );
                }
            }
            Step::AdvanceClock(a) => self.num(&a.s, scope, ctx),
            Step::Restart(r) => {
                if !ctx.requires.contains("restart") {
                    self.err(
                        Pos::of(&r.name),
                        "a `restart` step needs `requires: [restart]` (only a launched service can be restarted)",
                    );
                }
            }
            Step::Absent(a) => {
                self.principal(a.principal, a.path.pos, ctx);
                for t in [&a.path, &a.list, &a.id] {
                    self.template(t, scope, ctx);
                }
            }
            Step::Mcp(m) => self.mcp(m, scope, ctx),
            Step::KillServer(f) | Step::RestartServer(f) => {
                if !ctx.requires.contains("server_control") {
                    self.err(
                        Pos::of(f),
                        format!("`{}` needs `requires: [server_control]`", step.kind()),
                    );
                }
                self.via(f.value.via, Pos::of(f), ctx);
            }
            Step::StopDatabase(f) | Step::StartDatabase(f) => {
                if !ctx.requires.contains("database_control") {
                    self.err(
                        Pos::of(f),
                        format!("`{}` needs `requires: [database_control]`", step.kind()),
                    );
                }
                if f.value.via == Via::Peer {
                    self.err(
                        Pos::of(f),
                        format!("`{}` acts on the database: it takes no `via`", step.kind()),
                    );
                }
            }
            Step::Connect(c) => {
                self.template(&c.sandbox, scope, ctx);
                if let Some(t) = &c.access_token {
                    self.template(t, scope, ctx);
                }
                if let Some(n) = &c.within_s {
                    self.num(n, scope, ctx);
                }
                let rpc_re = Regex::new(
                    r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*\.[A-Z][A-Za-z0-9]*/[A-Z][A-Za-z0-9]*$",
                )
                .expect("static regex");
                if !rpc_re.is_match(&c.rpc.value) {
                    self.err(
                        Pos::of(&c.rpc),
                        format!(
                            "rpc `{}` must look like `process.Process/Start`",
                            c.rpc.value
                        ),
                    );
                }
                for check in &c.json {
                    self.json_check(check, scope, ctx);
                }
                if let Some(first) = c.until.first() {
                    let pos = first.pointer.pos;
                    if !c.stream {
                        self.err(pos, "`until` reads a stream: it needs `stream: true`");
                    }
                    if c.error.is_some() {
                        self.err(
                            pos,
                            "`until` stops at a message, `error` waits for the stream's end: give one",
                        );
                    }
                }
                for check in &c.until {
                    self.json_check(check, scope, ctx);
                }
                for (name, cap) in &c.capture {
                    if cap.value.json.is_none()
                        || cap.value.header.is_some()
                        || cap.value.body.is_some()
                        || cap.value.regex.is_some()
                    {
                        self.err(
                            Pos::of(cap),
                            "a `connect` capture takes only `json: <pointer>`",
                        );
                    }
                    if cap.value.secret {
                        scope.secrets.insert(name.clone());
                    }
                    self.define_capture(name, Pos::of(cap), scope);
                }
            }
        }
    }

    fn mcp(&mut self, m: &crate::scenario::Mcp, scope: &mut Scope, ctx: &Ctx<'_>) {
        use crate::mcp::Action;
        let pos = m
            .params
            .as_ref()
            .map(Pos::of)
            .or(m.capture_handle.as_ref().map(Pos::of))
            .unwrap_or_default();
        if let Some(p) = &m.params {
            match &p.value {
                serde_json::Value::Object(map) => {
                    for k in map.keys() {
                        if !crate::mcp::toolmap::PARAMS.contains(&k.as_str()) {
                            self.err(
                                Pos::of(p),
                                format!(
                                    "`with` parameter `{k}` is unknown; parameters are {}",
                                    crate::mcp::toolmap::PARAMS.join(", ")
                                ),
                            );
                        }
                    }
                }
                _ => self.err(Pos::of(p), "`with` must be a mapping of parameters"),
            }
            self.json_value(p, scope, ctx);
        }
        if m.action == Action::Shutdown
            && (m.params.is_some()
                || m.refused
                || m.qualified
                || m.in_flight
                || !m.json.is_empty()
                || m.capture_handle.is_some()
                || m.capture_sandbox.is_some())
        {
            self.err(pos, "an `mcp` shutdown takes only `name` and `session`");
        }
        if m.in_flight
            && (m.action != Action::Create
                || m.refused
                || m.qualified
                || !m.json.is_empty()
                || m.capture_handle.is_some()
                || m.capture_sandbox.is_some())
        {
            self.err(
                pos,
                "`in_flight` is for a create whose answer is not awaited: nothing to check or capture",
            );
        }
        if m.refused && (m.qualified || m.capture_handle.is_some() || m.capture_sandbox.is_some()) {
            self.err(pos, "a refused call names no handle to check or capture");
        }
        for check in &m.json {
            self.json_check(check, scope, ctx);
        }
        for c in [&m.capture_handle, &m.capture_sandbox]
            .into_iter()
            .flatten()
        {
            self.define_capture(&c.value, Pos::of(c), scope);
        }
    }

    fn request(&mut self, r: &Request, scope: &mut Scope, ctx: &Ctx<'_>, in_parallel: bool) {
        self.via(r.via, r.path.pos, ctx);
        self.principal(r.principal, r.path.pos, ctx);
        self.test_control(&r.path, ctx);
        if let Some(json) = &r.json
            && names_a_model(&json.value)
            && !ctx.requires.contains("fixture_models")
        {
            self.err(
                Pos::of(json),
                "`agent.model` names a fixture model script: needs `requires: [fixture_models]`",
            );
        }
        self.template(&r.path, scope, ctx);
        if let Some(t) = &r.envd {
            self.template(t, scope, ctx);
            if r.via == Via::Peer {
                self.err(
                    t.pos,
                    "`envd` names the sandbox's envd: it cannot go `via: peer`",
                );
            }
        }
        for t in r.headers.values().chain(r.query.values()) {
            self.template(t, scope, ctx);
        }
        let bodies = usize::from(r.json.is_some())
            + usize::from(r.body_text.is_some())
            + usize::from(r.body_base64.is_some());
        if bodies > 1 {
            self.err(
                r.path.pos,
                "a request takes at most one of `json`, `body_text`, `body_base64`",
            );
        }
        if let Some(json) = &r.json {
            self.json_value(json, scope, ctx);
        }
        if let Some(t) = &r.body_text {
            self.template(t, scope, ctx);
        }
        if let Some(b) = &r.body_base64 {
            self.base64(b);
        }
        if let Some(sign) = &r.bridge_signature {
            self.template(&sign.secret, scope, ctx);
            for var in sign.secret.vars() {
                if scope.captures.contains(var) && !scope.secrets.contains(var) {
                    self.err(
                        sign.secret.pos,
                        format!(
                            "`{var}` signs bridge requests: capture it with `secret: true` so evidence never holds it"
                        ),
                    );
                }
            }
            for name in r.headers.keys() {
                if name.eq_ignore_ascii_case("x-sandspec-timestamp")
                    || name.eq_ignore_ascii_case("x-sandspec-signature")
                {
                    self.err(
                        r.path.pos,
                        format!("`bridge_signature` sets `{name}`; do not give it in `headers`"),
                    );
                }
            }
        }
        if in_parallel {
            if !r.capture.is_empty() || has_expectations(&r.expect) {
                self.err(
                    r.path.pos,
                    "requests in `parallel` take no `expect` or `capture`: the tallies judge them",
                );
            }
            return;
        }
        self.expect(&r.expect, scope, ctx);
        for (name, capture) in &r.capture {
            let c: &Capture = &capture.value;
            let sources = usize::from(c.json.is_some())
                + usize::from(c.header.is_some())
                + usize::from(c.body == Some(true));
            if sources != 1 || c.body == Some(false) {
                self.err(
                    Pos::of(capture),
                    format!(
                        "capture `{name}` takes exactly one of `json`, `header` and `body: true`"
                    ),
                );
            }
            if let Some(pointer) = &c.json
                && !(pointer.is_empty() || pointer.starts_with('/'))
            {
                self.err(
                    Pos::of(capture),
                    format!("capture `{name}`: JSON pointer `{pointer}` must start with `/`"),
                );
            }
            if let Some(re) = &c.regex
                && let Err(e) = Regex::new(re)
            {
                self.err(
                    Pos::of(capture),
                    format!(
                        "capture `{name}`: invalid regex: {}",
                        first_line(&e.to_string())
                    ),
                );
            }
            self.define_capture(name, Pos::of(capture), scope);
            if c.secret {
                scope.secrets.insert(name.clone());
            } else {
                scope.secrets.remove(name);
            }
        }
    }

    fn define_capture(&mut self, name: &str, pos: Pos, scope: &mut Scope) {
        let re_ok = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !re_ok {
            self.err(
                pos,
                format!("capture name `{name}` must be lower_snake_case"),
            );
        } else if builtin(name).is_some() {
            self.err(
                pos,
                format!("capture name `{name}` shadows a built-in variable"),
            );
        }
        scope.captures.insert(name.to_owned());
    }

    fn expect(&mut self, e: &Expect, scope: &Scope, ctx: &Ctx<'_>) {
        for check in &e.json {
            self.json_check(check, scope, ctx);
        }
        for h in &e.headers {
            self.header_check(h, scope, ctx);
        }
        if let Some(t) = &e.body_text {
            self.template(t, scope, ctx);
        }
        if let Some(b) = &e.body_base64 {
            self.base64(b);
        }
        if e.status.is_some() && !e.status_in.is_empty() {
            self.err(Pos::default(), "give `status` or `status_in`, not both");
        }
    }

    fn json_check(&mut self, c: &JsonCheck, scope: &Scope, ctx: &Ctx<'_>) {
        self.template(&c.pointer, scope, ctx);
        if !(c.pointer.raw.is_empty() || c.pointer.raw.starts_with('/')) {
            self.err(
                c.pointer.pos,
                format!("JSON pointer `{}` must start with `/`", c.pointer.raw),
            );
        }
        let n = [
            c.equals.is_some(),
            c.not_equals.is_some(),
            c.exists.is_some(),
            c.absent.is_some(),
            c.matches.is_some(),
            c.length.is_some(),
            c.gte.is_some(),
            c.lte.is_some(),
            c.includes.is_some(),
            c.excludes.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count();
        if n != 1 {
            self.err(
                c.pointer.pos,
                format!("check on `{}` must give exactly one of equals, not_equals, exists, absent, matches, length, gte, lte, includes, excludes", c.pointer.raw),
            );
        }
        if c.exists == Some(false) || c.absent == Some(false) {
            self.err(
                c.pointer.pos,
                "write `absent: true` instead of `exists: false` (and vice versa)",
            );
        }
        for v in [&c.equals, &c.not_equals, &c.includes, &c.excludes]
            .into_iter()
            .flatten()
        {
            self.json_value(v, scope, ctx);
        }
        if let Some(re) = &c.matches {
            self.regex(re);
        }
        for n in [&c.length, &c.gte, &c.lte].into_iter().flatten() {
            self.num(n, scope, ctx);
        }
    }

    fn header_check(&mut self, h: &HeaderCheck, scope: &Scope, ctx: &Ctx<'_>) {
        let n = [
            h.present.is_some(),
            h.absent.is_some(),
            h.equals.is_some(),
            h.matches.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count();
        if n != 1 {
            self.err(
                Pos::of(&h.name),
                "a header check gives exactly one of present, absent, equals, matches",
            );
        }
        if let Some(t) = &h.equals {
            self.template(t, scope, ctx);
        }
        if let Some(re) = &h.matches {
            self.regex(re);
        }
    }

    fn regex(&mut self, re: &Located<String>) {
        if let Err(e) = Regex::new(&re.value) {
            self.err(
                Pos::of(re),
                format!("invalid regular expression: {}", first_line(&e.to_string())),
            );
        }
    }

    fn base64(&mut self, b: &Located<String>) {
        use base64::Engine as _;
        if base64::engine::general_purpose::STANDARD
            .decode(b.value.as_bytes())
            .is_err()
        {
            self.err(Pos::of(b), "invalid base64");
        }
    }

    fn json_value(&mut self, v: &Located<serde_json::Value>, scope: &Scope, ctx: &Ctx<'_>) {
        let pos = Pos::of(v);
        let mut strings = Vec::new();
        collect_strings(&v.value, &mut strings);
        for s in strings {
            match parse_parts(s) {
                Ok(_) => {
                    let t = Template::parse(s, pos).expect("parsed above");
                    self.template(&t, scope, ctx);
                }
                Err(e) => self.err(pos, e),
            }
        }
    }

    fn num(&mut self, n: &NumExpr, scope: &Scope, ctx: &Ctx<'_>) {
        if let Some(var) = n.expr.var() {
            self.var(var, n.pos, scope, ctx);
        }
    }

    /// Acting as the admin needs the admin token, which only some runs are given.
    fn principal(&mut self, principal: Principal, pos: Pos, ctx: &Ctx<'_>) {
        if principal == Principal::Admin && !ctx.requires.contains("admin_token") {
            self.err(pos, "`as: admin` needs `requires: [admin_token]`");
        }
    }

    /// Test controls (`/v1/test/...`, protocol §9) exist only where advertised.
    fn test_control(&mut self, path: &Template, ctx: &Ctx<'_>) {
        if path.raw.starts_with("/v1/test/") && !ctx.requires.contains("test_controls") {
            self.err(
                path.pos,
                format!(
                    "`{}` is a test control: needs `requires: [test_controls]`",
                    path.raw
                ),
            );
        }
    }

    /// A step sent through the peer needs a target that has one.
    fn via(&mut self, via: Via, pos: Pos, ctx: &Ctx<'_>) {
        if via == Via::Peer && !ctx.requires.contains("peer") {
            self.err(pos, "`via: peer` needs `requires: [peer]`");
        }
    }

    fn template(&mut self, t: &Template, scope: &Scope, ctx: &Ctx<'_>) {
        for var in t.vars() {
            self.var(var, t.pos, scope, ctx);
        }
    }

    fn var(&mut self, var: &str, pos: Pos, scope: &Scope, ctx: &Ctx<'_>) {
        match builtin(var) {
            Some(Builtin::Known) => {}
            Some(Builtin::OtherProvider) => {
                if !ctx.requires.contains("two_providers") {
                    self.err(
                        pos,
                        "`{{provider.other}}` needs `requires: [two_providers]`",
                    );
                }
            }
            Some(Builtin::UnknownKey) => self.err(
                pos,
                format!("unknown variable `{var}` (not an advertised limit or retention)"),
            ),
            None if scope.captures.contains(var) => {}
            None => {
                let when = if ctx.cleanup {
                    "in any step"
                } else {
                    "by an earlier step"
                };
                self.err(
                    pos,
                    format!("unknown variable `{var}`: not built in and not captured {when}"),
                );
            }
        }
    }
}

/// Context for variable checks.
struct Ctx<'a> {
    requires: &'a BTreeSet<&'a str>,
    cleanup: bool,
}

enum Builtin {
    Known,
    OtherProvider,
    UnknownKey,
}

fn builtin(name: &str) -> Option<Builtin> {
    match name {
        "run_id" | "canary" | "uuid" | "rand" | "provider.default" | "base_dir" => {
            Some(Builtin::Known)
        }
        "provider.other" => Some(Builtin::OtherProvider),
        _ => {
            if let Some(key) = name.strip_prefix("limits.") {
                Some(if LIMIT_KEYS.contains(&key) {
                    Builtin::Known
                } else {
                    Builtin::UnknownKey
                })
            } else if let Some(key) = name.strip_prefix("retention.") {
                Some(if RETENTION_KEYS.contains(&key) {
                    Builtin::Known
                } else {
                    Builtin::UnknownKey
                })
            } else if name.starts_with("provider.") {
                Some(Builtin::UnknownKey)
            } else {
                None
            }
        }
    }
}

fn collect_strings<'v>(v: &'v serde_json::Value, out: &mut Vec<&'v str>) {
    match v {
        serde_json::Value::String(s) => out.push(s),
        serde_json::Value::Array(items) => items.iter().for_each(|i| collect_strings(i, out)),
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                out.push(k);
                collect_strings(v, out);
            }
        }
        _ => {}
    }
}

/// Whether a request body names an agent model (`{"agent": {"model": "<name>"}}`): the
/// name of a fixture model script, since no real model answers the same way twice.
fn names_a_model(body: &serde_json::Value) -> bool {
    body.get("agent")
        .and_then(|a| a.get("model"))
        .and_then(|m| m.as_str())
        .is_some_and(|m| !m.is_empty())
}

fn has_expectations(e: &Expect) -> bool {
    e.status.is_some()
        || !e.status_in.is_empty()
        || e.code.is_some()
        || e.content_type.is_some()
        || !e.json.is_empty()
        || !e.headers.is_empty()
        || e.body_text.is_some()
        || e.body_base64.is_some()
}
