//! The scenario file model: what one YAML scenario file may say, and nothing more.
//!
//! Every struct denies unknown fields, and step kinds are an externally tagged enum, so a
//! misspelt key is an error at its line rather than a silently ignored assertion. Values that
//! later checks need to point at (templates, JSON bodies, IDs) keep their source position.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use serde_saphyr::Spanned;

use super::template::{Expr, Template};

/// A position in a scenario file (1-based line and column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Pos {
    pub line: u64,
    pub col: u64,
}

impl Pos {
    pub fn of<T>(spanned: &Spanned<T>) -> Self {
        Pos {
            line: spanned.referenced.line(),
            col: spanned.referenced.column(),
        }
    }
}

/// A string value together with where it was written.
pub type Located<T> = Spanned<T>;

/// One scenario file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Stable literal ID, e.g. `SBX-LIFE-001`; never a position number.
    pub id: Located<String>,
    pub title: String,
    /// Protocol clause IDs from `docs/protocol.md`, e.g. `SBX-3.4`.
    pub clauses: Vec<Located<String>>,
    pub level: Level,
    /// Capabilities the target must advertise, else the scenario is skipped.
    #[serde(default)]
    pub requires: Vec<Located<String>>,
    #[serde(default)]
    pub tags: Vec<String>,
    /// Reference-server defects this scenario must catch (negative controls), each with the
    /// step at which it must fail.
    #[serde(default)]
    pub defects: Vec<DefectRef>,
    /// Run alone, with no other scenario in flight (digest scenarios compare global state).
    #[serde(default)]
    pub exclusive: bool,
    pub steps: Vec<Step>,
    /// Always run, whatever happened in `steps`.
    #[serde(default)]
    pub cleanup: Vec<Step>,
}

/// One negative control: a deliberate defect of the reference server and the step of
/// `steps` that must be the first to fail against a server with it switched on.
#[derive(Debug, Clone)]
pub struct DefectRef {
    /// The defect's stable name (`reference-server/src/defects.rs`).
    pub defect: Located<String>,
    /// The failing step, by its label ([`Step::label`]): its `name`, or for a step without
    /// one what the engine calls it (`GET /v1/sandboxes/{{sbx}}`, `expect_digest_unchanged`).
    pub fails_at: Located<String>,
}

/// By hand, so that a bare defect name (the form before controls named their step) is refused
/// with the form to write instead of a generic "expected mapping".
impl<'de> Deserialize<'de> for DefectRef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = DefectRef;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("`{defect: <name>, fails_at: <label of the step that must fail>}`")
            }
            fn visit_str<E: de::Error>(self, name: &str) -> Result<DefectRef, E> {
                Err(E::custom(format!(
                    "write `{{defect: {name}, fails_at: <step>}}`: a negative control names the step that must fail"
                )))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<DefectRef, A::Error> {
                const FIELDS: &[&str] = &["defect", "fails_at"];
                let mut defect = None;
                let mut fails_at = None;
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "defect" if defect.is_none() => defect = Some(map.next_value()?),
                        "fails_at" if fails_at.is_none() => fails_at = Some(map.next_value()?),
                        "defect" | "fails_at" => return Err(de::Error::duplicate_field(FIELDS[0])),
                        other => return Err(de::Error::unknown_field(other, FIELDS)),
                    }
                }
                Ok(DefectRef {
                    defect: defect.ok_or_else(|| de::Error::missing_field("defect"))?,
                    fails_at: fails_at.ok_or_else(|| de::Error::missing_field("fails_at"))?,
                })
            }
        }
        deserializer.deserialize_any(V)
    }
}

impl Scenario {
    /// The indexes of the steps (not cleanup) whose label is `label`.
    pub fn steps_labelled(&self, label: &str) -> Vec<usize> {
        self.steps
            .iter()
            .enumerate()
            .filter(|(_, step)| step.label() == label)
            .map(|(i, _)| i)
            .collect()
    }

    /// The step a negative control must fail at, as an outcome names it
    /// (`steps[3] get as the other principal`); `None` when `fails_at` names no single step
    /// (the parser refuses such a file).
    pub fn fails_at(&self, control: &DefectRef) -> Option<String> {
        match self.steps_labelled(&control.fails_at.value).as_slice() {
            [i] => Some(step_label("steps", *i, &self.steps[*i])),
            _ => None,
        }
    }
}

/// How outcomes and transcripts name a step: `steps[2] create` or `cleanup[0] DELETE /v1/...`.
pub fn step_label(section: &str, index: usize, step: &Step) -> String {
    format!("{section}[{index}] {}", step.label())
}

/// Requirement level of the clauses a scenario checks.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize, serde::Serialize,
)]
pub enum Level {
    #[serde(rename = "MUST")]
    Must,
    #[serde(rename = "SHOULD")]
    Should,
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Level::Must => "MUST",
            Level::Should => "SHOULD",
        })
    }
}

/// Who a request authenticates as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Principal {
    /// The principal that owns what the scenario creates.
    #[default]
    Owner,
    /// A second, unrelated principal.
    Other,
    /// The test-controls admin token.
    Admin,
    /// No Authorization header at all (unless `headers` sets one).
    Anonymous,
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Principal::Owner => "owner",
            Principal::Other => "other",
            Principal::Admin => "admin",
            Principal::Anonymous => "anonymous",
        })
    }
}

/// Which endpoint of the deployment a step talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// The target's base URL.
    #[default]
    Primary,
    /// The target's peer: another server process of the same deployment (needs
    /// `requires: [peer]`).
    Peer,
}

/// One step. The key names the kind: `- request: {...}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Step {
    Request(Request),
    Sse(Sse),
    Poll(Poll),
    Digest(Digest),
    ExpectDigestUnchanged(SinceName),
    Snapshot(Snapshot),
    ExpectSnapshotUnchanged(SinceName),
    Parallel(Parallel),
    Sleep(Sleep),
    /// Lets time pass on the target: moves its test clock (TC-9.12) on a deployment of the
    /// scenario's own, else waits it out.
    AdvanceClock(AdvanceClock),
    Absent(Absent),
    Connect(Connect),
    Mcp(Mcp),
    /// SIGKILL to a server process of a deployment the runner controls.
    KillServer(Located<Fault>),
    /// Starts a server process again on its data directory, database and port.
    RestartServer(Located<Fault>),
    /// Stops the deployment's database server abruptly.
    StopDatabase(Located<Fault>),
    /// Starts the deployment's database server again.
    StartDatabase(Located<Fault>),
    Restart(Restart),
}

impl Step {
    /// What messages call the step: its `name`, else the method and path of its request
    /// (`poll ` before a poll's), `sse <path>` for a stream, or its kind (`absent`); `(via peer)` is
    /// added when it goes to the peer. Negative controls name steps by this label.
    pub fn label(&self) -> String {
        let via = |v: Via| if v == Via::Peer { " (via peer)" } else { "" };
        let req = |r: &Request| match &r.name {
            Some(n) => format!("{n}{}", via(r.via)),
            None => format!("{} {}{}", r.method.as_str(), r.path.raw, via(r.via)),
        };
        match self {
            Step::Request(r) => req(r),
            Step::Poll(p) => format!("poll {}", req(&p.request)),
            Step::Sse(s) => {
                let name = s
                    .name
                    .clone()
                    .unwrap_or_else(|| format!("sse {}", s.path.raw));
                format!("{name}{}", via(s.via))
            }
            Step::Connect(c) => c
                .name
                .clone()
                .unwrap_or_else(|| format!("connect {}", c.rpc.value)),
            Step::Mcp(m) => m
                .name
                .clone()
                .unwrap_or_else(|| format!("mcp {} ({})", m.action.name(), m.session)),
            Step::KillServer(f) | Step::RestartServer(f) => {
                let name = f.value.name.as_deref().unwrap_or(self.kind());
                format!("{name}{}", via(f.value.via))
            }
            other => other.name().unwrap_or(other.kind()).to_owned(),
        }
    }

    /// The step's deadline, for the steps that wait for something to happen: a poll's, a
    /// stream's or a parallel step's `within_s`.
    pub fn deadline(&self) -> Option<&NumExpr> {
        match self {
            Step::Poll(p) => Some(&p.within_s),
            Step::Sse(s) => s.within_s.as_ref(),
            Step::Parallel(p) => p.within_s.as_ref(),
            _ => None,
        }
    }

    /// The `name` a step without a request of its own was given.
    fn name(&self) -> Option<&str> {
        match self {
            Step::Digest(d) => d.name.as_deref(),
            Step::ExpectDigestUnchanged(s) | Step::ExpectSnapshotUnchanged(s) => s.name.as_deref(),
            Step::Snapshot(s) => s.name.as_deref(),
            Step::Parallel(p) => p.name.as_deref(),
            Step::AdvanceClock(a) => a.name.as_deref(),
            Step::Absent(a) => a.name.as_deref(),
            Step::KillServer(f)
            | Step::RestartServer(f)
            | Step::StopDatabase(f)
            | Step::StartDatabase(f) => f.value.name.as_deref(),
            Step::Restart(r) => Some(r.name.value.as_str()),
            Step::Request(_)
            | Step::Poll(_)
            | Step::Sse(_)
            | Step::Sleep(_)
            | Step::Connect(_)
            | Step::Mcp(_) => None,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Step::Request(_) => "request",
            Step::Sse(_) => "sse",
            Step::Poll(_) => "poll",
            Step::Digest(_) => "digest",
            Step::ExpectDigestUnchanged(_) => "expect_digest_unchanged",
            Step::Snapshot(_) => "snapshot",
            Step::ExpectSnapshotUnchanged(_) => "expect_snapshot_unchanged",
            Step::Parallel(_) => "parallel",
            Step::Sleep(_) => "sleep",
            Step::AdvanceClock(_) => "advance_clock",
            Step::Absent(_) => "absent",
            Step::Connect(_) => "connect",
            Step::Mcp(_) => "mcp",
            Step::KillServer(_) => "kill_server",
            Step::RestartServer(_) => "restart_server",
            Step::StopDatabase(_) => "stop_database",
            Step::StartDatabase(_) => "start_database",
            Step::Restart(_) => "restart",
        }
    }
}

/// HTTP methods a scenario may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Method {
    #[serde(rename = "GET")]
    Get,
    #[serde(rename = "POST")]
    Post,
    #[serde(rename = "PUT")]
    Put,
    #[serde(rename = "PATCH")]
    Patch,
    #[serde(rename = "DELETE")]
    Delete,
    #[serde(rename = "HEAD")]
    Head,
    #[serde(rename = "OPTIONS")]
    Options,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Post => "POST",
            Method::Put => "PUT",
            Method::Patch => "PATCH",
            Method::Delete => "DELETE",
            Method::Head => "HEAD",
            Method::Options => "OPTIONS",
        }
    }
}

/// An HTTP request with its expectations and captures.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// A short name for the transcript and failure messages.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(rename = "as", default)]
    pub principal: Principal,
    /// The endpoint to send it to: `primary` unless given.
    #[serde(default)]
    pub via: Via,
    /// E2B profile: send it to this sandbox's envd (its E2B ID), as `connect` steps reach
    /// it: the routing headers on the target's URL, or E2B's host form with `--envd-domain`.
    #[serde(default)]
    pub envd: Option<Template>,
    /// Raw headers. An `Authorization` header here replaces the principal's token.
    #[serde(default)]
    pub headers: BTreeMap<String, Template>,
    pub method: Method,
    pub path: Template,
    #[serde(default)]
    pub query: BTreeMap<String, Template>,
    /// A JSON body (sent as `application/json`). Strings inside may hold `{{var}}`.
    #[serde(default, deserialize_with = "present")]
    pub json: Option<Located<serde_json::Value>>,
    /// A raw text body.
    #[serde(default)]
    pub body_text: Option<Template>,
    /// A raw binary body, base64-encoded in the file.
    #[serde(default)]
    pub body_base64: Option<Located<String>>,
    /// Overrides the Content-Type the body kind implies.
    #[serde(default)]
    pub content_type: Option<String>,
    #[serde(default)]
    pub expect: Expect,
    /// Variables taken from the response, usable by later steps as `{{name}}`.
    #[serde(default)]
    pub capture: BTreeMap<String, Located<Capture>>,
    /// Sign the request as a worker of the private bridge does (protocol §8.8).
    #[serde(default)]
    pub bridge_signature: Option<BridgeSignature>,
}

/// How to sign a bridge request: `X-Sandspec-Timestamp` (now) and `X-Sandspec-Signature` over
/// the method, the request target as sent, the body and the timestamp.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeSignature {
    /// The session's bridge secret: a literal (a wrong key, on purpose) or captures marked
    /// `secret: true`. The engine also registers the value with the evidence sanitizer.
    pub secret: Template,
}

/// Where a captured value comes from: exactly one of `json` (a JSON pointer into the body),
/// `header` (a response header, case-insensitive) and `body: true` (the raw body as text),
/// optionally narrowed by `regex`
/// (the first capture group, or the whole match when the regex has no group).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capture {
    #[serde(default)]
    pub json: Option<String>,
    #[serde(default)]
    pub header: Option<String>,
    /// `true`: the whole response body, as text.
    #[serde(default)]
    pub body: Option<bool>,
    #[serde(default)]
    pub regex: Option<String>,
    /// The value is a credential (a preview token, an API key): the evidence writer redacts
    /// it everywhere.
    #[serde(default)]
    pub secret: bool,
}

/// What a response must look like. With no `status`, any 2xx is required.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    #[serde(default)]
    pub status: Option<u16>,
    /// Any of these statuses.
    #[serde(default)]
    pub status_in: Vec<u16>,
    /// The problem `code`; also requires `application/problem+json` and a matching `status`
    /// field in the body.
    #[serde(default)]
    pub code: Option<String>,
    /// Prefix of the response Content-Type (parameters ignored).
    #[serde(default)]
    pub content_type: Option<String>,
    #[serde(default)]
    pub json: Vec<JsonCheck>,
    #[serde(default)]
    pub headers: Vec<HeaderCheck>,
    /// The exact raw body, as text.
    #[serde(default)]
    pub body_text: Option<Template>,
    /// The exact raw body, base64-encoded in the file.
    #[serde(default)]
    pub body_base64: Option<Located<String>>,
}

/// One assertion on a JSON pointer. Exactly one of the checks must be given.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonCheck {
    pub pointer: Template,
    /// Equal to this JSON value (strings may hold `{{var}}`).
    #[serde(default, deserialize_with = "present")]
    pub equals: Option<Located<serde_json::Value>>,
    #[serde(default, deserialize_with = "present")]
    pub not_equals: Option<Located<serde_json::Value>>,
    /// `true`: the pointer resolves (to anything, `null` included).
    #[serde(default)]
    pub exists: Option<bool>,
    /// `true`: the pointer does not resolve.
    #[serde(default)]
    pub absent: Option<bool>,
    /// The value is a string matching this regular expression.
    #[serde(default)]
    pub matches: Option<Located<String>>,
    /// The value is an array (or string, or object) of this length.
    #[serde(default)]
    pub length: Option<NumExpr>,
    /// The value is a number >= this.
    #[serde(default)]
    pub gte: Option<NumExpr>,
    /// The value is a number <= this.
    #[serde(default)]
    pub lte: Option<NumExpr>,
    /// The value is an array with an element that contains this value (objects match when
    /// every key given matches; other values must be equal).
    #[serde(default, deserialize_with = "present")]
    pub includes: Option<Located<serde_json::Value>>,
    /// The value is an array with no element that contains this value.
    #[serde(default, deserialize_with = "present")]
    pub excludes: Option<Located<serde_json::Value>>,
}

/// One assertion on a response header. Exactly one check must be given.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderCheck {
    pub name: Located<String>,
    #[serde(default)]
    pub present: Option<bool>,
    #[serde(default)]
    pub absent: Option<bool>,
    #[serde(default)]
    pub equals: Option<Template>,
    #[serde(default)]
    pub matches: Option<Located<String>>,
}

/// Open a server-sent event stream and check what it delivers.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sse {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(rename = "as", default)]
    pub principal: Principal,
    /// The endpoint to open the stream on: `primary` unless given.
    #[serde(default)]
    pub via: Via,
    #[serde(default)]
    pub headers: BTreeMap<String, Template>,
    pub path: Template,
    #[serde(default)]
    pub query: BTreeMap<String, Template>,
    /// Sent as the `Last-Event-ID` header.
    #[serde(default)]
    pub last_event_id: Option<Template>,
    /// The Accept header; `text/event-stream` unless given.
    #[serde(default)]
    pub accept: Option<String>,
    /// Response expectations (status defaults to 200). When the status is not 200 the body
    /// is not read as a stream.
    #[serde(default)]
    pub expect: Expect,
    /// When to stop reading; `eof` unless given.
    #[serde(default)]
    pub until: Until,
    /// Deadline for the whole read, in seconds (a number or an expression).
    #[serde(default)]
    pub within_s: Option<NumExpr>,
    /// Checks on the received events, in order: the n-th check applies to the n-th event.
    #[serde(default)]
    pub events: Vec<EventCheck>,
    /// Checks on the data of every received event but `stream.end`.
    #[serde(default)]
    pub each_event: Vec<JsonCheck>,
    /// Checks on the last event received, `stream.end` included.
    #[serde(default)]
    pub last_event: Option<EventCheck>,
    /// No more events than `events` lists.
    #[serde(default)]
    pub exact: bool,
    /// The stream must deliver no event at all. Without it, a stream that delivered nothing
    /// fails.
    #[serde(default)]
    pub expect_none: bool,
    /// Drop the connection after this many events.
    #[serde(default)]
    pub cut_after: Option<u32>,
    /// Stop the deployment's database once this many events arrived, and go on reading:
    /// what an open stream does during an outage (needs `database_control`).
    #[serde(default)]
    pub stop_database_after: Option<u32>,
    /// Capture the id of the last event received.
    #[serde(default)]
    pub capture_last_id: Option<Located<String>>,
    /// Record the time to the first frame under this measurement name.
    #[serde(default)]
    pub measure_first_frame: Option<String>,
    /// Record the time to EOF under this measurement name.
    #[serde(default)]
    pub measure_eof: Option<String>,
    /// The stream must not end (EOF) sooner than this many seconds after it was requested:
    /// a stream bounded by `max_stream_duration_s` must not end early.
    #[serde(default)]
    pub min_duration_s: Option<NumExpr>,
    /// While idle, a comment must arrive at least this often (seconds).
    #[serde(default)]
    pub expect_heartbeat_within_s: Option<NumExpr>,
    /// Framing rules: every event has an `id`, one-line JSON `data` whose `seq` equals the
    /// id, and ids increase. On unless set to `false`.
    #[serde(default = "yes")]
    pub strict_framing: bool,
    /// The stream is a filtered view of a log (SSE-7.6): ids must increase but may skip
    /// numbers.
    #[serde(default)]
    pub id_gaps: bool,
    /// Framing checks the ids only, not a `seq` in the data (profiles whose events carry
    /// none, such as the Agent Sandbox's).
    #[serde(default)]
    pub ids_only: bool,
    /// Also read the stream with the `eventsource-client` crate and require the same event
    /// types and ids. On unless set to `false` (for a step where a second concurrent stream
    /// would change the outcome, such as a stream-quota check).
    #[serde(default = "yes")]
    pub interop: bool,
}

fn yes() -> bool {
    true
}

/// When an `sse` step stops reading.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Until {
    /// The server ends the stream.
    #[default]
    Eof,
    /// This many events were received.
    Events(u32),
    /// An event of this type was received.
    Event(String),
}

/// Checks on one received event.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventCheck {
    #[serde(default)]
    pub event: Option<String>,
    #[serde(default)]
    pub id: Option<Template>,
    /// Checks on the event's JSON data.
    #[serde(default)]
    pub data: Vec<JsonCheck>,
}

/// Repeat a request until its expectations hold or the deadline passes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Poll {
    pub request: Request,
    /// Deadline in seconds: a number or an expression such as `limits.heartbeat_interval_s * 2`.
    pub within_s: NumExpr,
    /// Pause between attempts; 200 ms unless given.
    #[serde(default)]
    pub every_ms: Option<u64>,
}

/// Record `GET /v1/test/digest` (needs `test_controls`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Digest {
    /// A short name for messages, the transcript and `fails_at`.
    #[serde(default)]
    pub name: Option<String>,
    pub into: Located<String>,
}

/// Compare against an earlier `digest` or `snapshot`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinceName {
    /// A short name for messages, the transcript and `fails_at`.
    #[serde(default)]
    pub name: Option<String>,
    pub since: Located<String>,
}

/// List everything a principal owns (sandboxes, snapshots) into a named set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// A short name for messages, the transcript and `fails_at`.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(rename = "as", default)]
    pub principal: Principal,
    pub into: Located<String>,
}

/// Requests sent concurrently, judged together.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Parallel {
    /// A short name for messages, the transcript and `fails_at`.
    #[serde(default)]
    pub name: Option<String>,
    /// Distinct requests to send at once.
    #[serde(default)]
    pub requests: Vec<Request>,
    /// Or one request sent this many times at once.
    #[serde(default)]
    pub request: Option<Request>,
    #[serde(default)]
    pub repeat: Option<NumExpr>,
    /// How the responses must be distributed.
    pub expect: Vec<Tally>,
    /// Send the group again until its tallies hold, for at most this many seconds (a number
    /// or an expression): for counts that settle a moment later, such as a stream slot
    /// released once the server sees a close. With it, a granted event stream is judged on
    /// its status and headers and then closed, not read to its end.
    #[serde(default)]
    pub within_s: Option<NumExpr>,
    /// Pause between attempts (with `within_s`); 1000 ms unless given.
    #[serde(default)]
    pub every_ms: Option<Located<u64>>,
    /// What these requests create cannot be captured, so no cleanup step can name it: with
    /// `true`, the engine removes it after cleanup (each delete confirmed by a 404) instead
    /// of the leak check failing on it.
    #[serde(default)]
    pub removed_by_sweep: bool,
}

/// "exactly N responses with this status (and code)", or "all the rest".
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tally {
    pub status: u16,
    #[serde(default)]
    pub code: Option<String>,
    #[serde(default)]
    pub exactly: Option<NumExpr>,
    /// Every response not counted by another tally.
    #[serde(default)]
    pub rest: bool,
    /// Checks every response this tally counts must also pass (e.g. `Retry-After` on each
    /// 429).
    #[serde(default)]
    pub headers: Vec<HeaderCheck>,
}

/// A fault the runner injects into a deployment it started (`kill_server`, `restart_server`,
/// `stop_database`, `start_database`): written `- kill_server: {}`, or with a name, or
/// `via: peer` for the peer's server process.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    pub name: Option<String>,
    /// Which server process; the database steps take none.
    #[serde(default)]
    pub via: Via,
}

/// Stop the service under test and start it again, with the same port, principals and
/// directories, once it is healthy. Only a service the runner launched can be restarted: a
/// scenario with this step must `require: [restart]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Restart {
    /// A short name for messages, the transcript and `fails_at` (required: a restart is a
    /// moment the scenario's later steps are read against).
    pub name: Located<String>,
}

/// A bounded pause. Prefer `poll`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sleep {
    pub ms: Located<u64>,
}

/// Time passing on the target's clock: `s` seconds (a number or an expression over advertised
/// limits, `retention.events_s + 1`). On a deployment the runner started for the scenario
/// alone, and which advertises `test_clock`, the runner moves the target's clock (TC-9.12);
/// anywhere else it waits the time out, as a `sleep` would.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdvanceClock {
    #[serde(default)]
    pub name: Option<String>,
    pub s: NumExpr,
}

/// A Connect-RPC call (JSON codec) to envd inside a sandbox, for the E2B profile: unary, or
/// a server stream read to its end-of-stream message.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Connect {
    #[serde(default)]
    pub name: Option<String>,
    /// The E2B ID of the sandbox whose envd answers.
    pub sandbox: Template,
    /// `package.Service/Method`, e.g. `process.Process/Start`.
    pub rpc: Located<String>,
    /// A server-streaming RPC (`application/connect+json` envelopes).
    #[serde(default)]
    pub stream: bool,
    /// The request message; `{}` when absent.
    #[serde(default, deserialize_with = "present")]
    pub message: Option<Located<serde_json::Value>>,
    /// The sandbox's envd access token (`X-Access-Token`), for a secure sandbox.
    #[serde(default)]
    pub access_token: Option<Template>,
    /// How long the whole call (a stream: to its end) may take; the request timeout when
    /// absent.
    #[serde(default)]
    pub within_s: Option<NumExpr>,
    /// The Connect error code expected (`not_found`, ...); absent: success.
    #[serde(default)]
    pub error: Option<String>,
    /// A stream read only until one message holds every one of these checks, then closed
    /// by the client (a background process keeps running: closing never ends it). The
    /// stream ending first fails the step.
    #[serde(default)]
    pub until: Vec<JsonCheck>,
    /// Checks on the response message (unary); for a stream, each check must hold in some
    /// message.
    #[serde(default)]
    pub json: Vec<JsonCheck>,
    /// Captures by JSON pointer: from the response (unary) or from the first message the
    /// pointer resolves in (a stream).
    #[serde(default)]
    pub capture: BTreeMap<String, Located<Capture>>,
}

/// An action of an agent through the sandbox MCP server under test, for the MCP profile:
/// one tool call that the run's tool map binds to the action, or the end of the session.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mcp {
    #[serde(default)]
    pub name: Option<String>,
    /// Which MCP server process: each session name is a server of its own, started at its
    /// first action.
    #[serde(default = "main_session")]
    pub session: String,
    pub action: crate::mcp::Action,
    /// The action's parameters (`sandbox`, `timeout_s`, `cpu`, `memory_mb`, `command`);
    /// strings may hold `{{var}}`.
    #[serde(default, rename = "with", deserialize_with = "present")]
    pub params: Option<Located<serde_json::Value>>,
    /// The tool must refuse (`isError: true`); otherwise it must succeed.
    #[serde(default)]
    pub refused: bool,
    /// The handle in the result must be provider-qualified (`provider:id`).
    #[serde(default)]
    pub qualified: bool,
    /// Send the call and go on without its answer (a create in flight at a shutdown).
    #[serde(default)]
    pub in_flight: bool,
    /// Checks on the tool's result value.
    #[serde(default)]
    pub json: Vec<JsonCheck>,
    /// Captures the handle the result names.
    #[serde(default)]
    pub capture_handle: Option<Located<String>>,
    /// Captures the control plane's sandbox ID of that handle (without its provider).
    #[serde(default)]
    pub capture_sandbox: Option<Located<String>>,
}

fn main_session() -> String {
    "main".to_owned()
}

/// An independent absence check: a fresh HTTP client, GET by path expecting 404
/// `not_found`, and the ID in no page of the list.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Absent {
    /// A short name for messages, the transcript and `fails_at`.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(rename = "as", default)]
    pub principal: Principal,
    /// The object's URL path, e.g. `/v1/sandboxes/{{sbx}}`.
    pub path: Template,
    /// The list to search, e.g. `/v1/sandboxes`.
    pub list: Template,
    /// The ID that must not appear in the list's `data[*].id`.
    pub id: Template,
}

/// A JSON value that was written, `null` included (plain `Option` would read `null` as absent).
fn present<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Located<serde_json::Value>>, D::Error> {
    Located::<serde_json::Value>::deserialize(deserializer).map(Some)
}

/// A number, or an expression over advertised limits: `5`, `"limits.heartbeat_interval_s * 2"`,
/// `"retention.process_output_s + 2"`.
#[derive(Debug, Clone)]
pub struct NumExpr {
    pub expr: Expr,
    pub pos: Pos,
}

impl<'de> Deserialize<'de> for NumExpr {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = Spanned::<NumLit>::deserialize(deserializer)?;
        let pos = Pos::of(&raw);
        let expr = match raw.value {
            NumLit::Int(n) => Expr::int(n),
            NumLit::Text(text) => Expr::parse(&text).map_err(de::Error::custom)?,
        };
        Ok(NumExpr { expr, pos })
    }
}

/// A literal number or expression text, before parsing.
enum NumLit {
    Int(i64),
    Text(String),
}

impl<'de> Deserialize<'de> for NumLit {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = NumLit;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "an integer or an expression such as \"limits.heartbeat_interval_s * 2\"",
                )
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<NumLit, E> {
                Ok(NumLit::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<NumLit, E> {
                i64::try_from(v)
                    .map(NumLit::Int)
                    .map_err(|_| E::custom("number too large"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<NumLit, E> {
                Ok(NumLit::Text(v.to_owned()))
            }
        }
        deserializer.deserialize_any(V)
    }
}
