//! Live runs against targets that cost money: the loopback guard, and what every profile's
//! sweeps share (the end-of-run sweep of everything tagged with the run's ID, and `sandspec
//! sweep` for leftovers of earlier, interrupted runs): the records they keep, removing an
//! object and confirming it gone, and reading a record's tag and age. Which lists a sweep
//! walks is each profile's own business (`crate::profile`).
//!
//! Every sandbox and session a scenario creates carries `metadata.sandspec_run = <run id>`.
//! The sweeps remove only objects whose own record, as the target returned it, carries the
//! tag: a list's filter only narrows what is read, so a target that ignores the filter
//! still loses nothing a run did not create.

use std::io::{BufRead as _, IsTerminal as _, Write as _};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use time::OffsetDateTime;

use crate::target::{Conn, Tokens, describe_reqwest};

/// The metadata key that tags every resource with the run that created it.
pub const RUN_TAG: &str = "sandspec_run";

/// Why a target may not be used without more consent.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GuardError {
    #[error(
        "refusing to run against non-loopback target {0} without --live (no terminal to confirm on)"
    )]
    NeedsLive(String),
    #[error("not confirmed: nothing was run against {0}")]
    Declined(String),
}

/// Whether `url`'s host is a loopback address (or `localhost`).
pub fn is_loopback(url: &reqwest::Url) -> bool {
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Allows a run against `url`: always with `live`, always on loopback; otherwise asks on a
/// terminal and refuses in CI (the `CI` variable set, or no terminal on stdin).
pub fn guard(url: &str, live: bool) -> Result<(), GuardError> {
    let in_ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "false");
    let can_ask = !in_ci && std::io::stdin().is_terminal();
    decide(url, live, can_ask, ask_on_terminal)
}

/// The guard's rule, with the question passed in.
pub fn decide(
    url: &str,
    live: bool,
    can_ask: bool,
    ask: impl FnOnce(&str) -> bool,
) -> Result<(), GuardError> {
    let parsed = reqwest::Url::parse(url).map_err(|_| GuardError::NeedsLive(url.to_owned()))?;
    if live || is_loopback(&parsed) {
        Ok(())
    } else if !can_ask {
        Err(GuardError::NeedsLive(url.to_owned()))
    } else if ask(url) {
        Ok(())
    } else {
        Err(GuardError::Declined(url.to_owned()))
    }
}

fn ask_on_terminal(url: &str) -> bool {
    eprint!(
        "{url} is not a loopback address: the suite creates and deletes real resources there.\nRun it? Pass --live to skip this question. [y/N] "
    );
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    let _ = std::io::stdin().lock().read_line(&mut answer);
    matches!(answer.trim(), "y" | "Y" | "yes")
}

/// Something a scenario (or the whole run) left behind, and whether the sweep removed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Leftover {
    /// The object's path, e.g. `/v1/sandboxes/local:sbx_...`.
    pub path: String,
    /// The sweep removed it and a GET afterwards answered 404.
    pub removed: bool,
}

/// A resource found by `sandspec sweep`, and whether removing it worked.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Swept {
    /// Its path, e.g. `/v1/sandboxes/local:sbx_...` or `/v1/sessions/ses_...`.
    pub path: String,
    /// The run that tagged it.
    pub run: String,
    /// Removed, and a GET afterwards answered 404.
    pub removed: bool,
}

/// What the end-of-run sweep did, for the report and the receipt.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSweep {
    /// Objects whose own record carried this run's tag after every scenario had finished
    /// (each a cleanup failure of the run), and whether each was then removed.
    pub found: Vec<Leftover>,
    /// Records a list returned without this run's tag: never touched, only counted.
    pub ignored: Vec<Ignored>,
    /// Why the sweep could not finish, when it could not.
    pub error: Option<String>,
}

/// One list a profile's sweeps walk.
#[derive(Debug, Clone, Copy)]
pub struct SweptList {
    /// The list, as the receipt names it, e.g. `/v1/sandboxes`.
    pub list: &'static str,
    /// Whether the end-of-run sweep asks it to filter by the run's tag.
    pub filtered: bool,
    /// Where a record holds its ID.
    pub id_field: &'static str,
    /// Where a record holds when it was created (RFC 3339), for `sandspec sweep`.
    pub time_field: &'static str,
    /// A record is removed at `<remove_prefix>/<id>`.
    pub remove_prefix: &'static str,
}

impl RunSweep {
    /// Removes each of `records` whose own record carries `run_id` (confirming it is gone)
    /// as a leftover, and counts the others as ignored, never touching them. `principal`
    /// (`owner` or `other`) listed them with `credential`.
    async fn take(
        &mut self,
        conn: &Conn<'_>,
        run_id: &str,
        (principal, credential): (&str, &(&'static str, String)),
        list: &SweptList,
        records: &[Value],
    ) {
        let mut ignored = 0;
        for record in records {
            match record.get(list.id_field).and_then(Value::as_str) {
                Some(id) if tag_of(record) == Some(run_id) => {
                    let path = format!("{}/{}", list.remove_prefix, urlencode(id));
                    let removed = remove(conn, credential, &path).await;
                    self.found.push(Leftover { path, removed });
                }
                _ => ignored += 1,
            }
        }
        if ignored > 0 {
            self.ignored.push(Ignored {
                principal: principal.to_owned(),
                list: list.list.to_owned(),
                filtered: list.filtered,
                count: ignored,
            });
        }
    }
}

/// The end-of-run sweep over a profile's `lists`: for every principal the run used, each list
/// as `read` gives it (with the principal's token, asked to filter by `run_id` where the list
/// is `filtered`), and each record whose own record carries the run's tag removed and
/// confirmed gone. Records without the tag are counted as ignored and never touched. A list
/// that cannot be read is the sweep's error, and the others are still swept.
pub async fn sweep_run_over<'a, Read, Listing>(
    conn: &'a Conn<'a>,
    tokens: &'a Tokens,
    run_id: &'a str,
    credential: fn(&str) -> (&'static str, String),
    lists: &'a [SweptList],
    read: Read,
) -> RunSweep
where
    Read: Fn(&'a str, &'a SweptList, Option<&'a str>) -> Listing,
    Listing: Future<Output = Result<Vec<Value>, String>>,
{
    let mut sweep = RunSweep::default();
    let mut errors = Vec::new();
    for (principal, token) in [
        ("owner", tokens.owner.as_str()),
        ("other", tokens.other.as_str()),
    ] {
        let credential = credential(token);
        for list in lists {
            let filter = list.filtered.then_some(run_id);
            match read(token, list, filter).await {
                Ok(records) => {
                    sweep
                        .take(conn, run_id, (principal, &credential), list, &records)
                        .await;
                }
                Err(e) => errors.push(format!("{e} (as {principal})")),
            }
        }
    }
    if !errors.is_empty() {
        sweep.error = Some(errors.join("; "));
    }
    sweep
}

/// `sandspec sweep` over a profile's `lists`: every record `read` gives (as `token`,
/// unfiltered) whose own record carries a `sandspec_run` tag (of any run) and that was
/// created before `now - older_than` (leftovers of interrupted runs) is removed and confirmed
/// gone; with `dry_run`, only listed.
pub async fn sweep_older_over<'a, Read, Listing>(
    conn: &'a Conn<'a>,
    credential: &(&'static str, String),
    older_than: Duration,
    dry_run: bool,
    lists: &'a [SweptList],
    read: Read,
) -> Result<Vec<Swept>, String>
where
    Read: Fn(&'a SweptList) -> Listing,
    Listing: Future<Output = Result<Vec<Value>, String>>,
{
    let cutoff = OffsetDateTime::now_utc() - older_than;
    let mut swept = Vec::new();
    for list in lists {
        for record in read(list).await? {
            if let Some((run, id)) = tagged_before(&record, list.time_field, list.id_field, cutoff)
            {
                let path = format!("{}/{}", list.remove_prefix, urlencode(id));
                swept.push(sweep_one(conn, credential, path, run, dry_run).await);
            }
        }
    }
    Ok(swept)
}

/// Records of one list, as one principal, that did not carry the run's tag.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ignored {
    /// `owner` or `other`.
    pub principal: String,
    /// The list, e.g. `/v1/sandboxes`.
    pub list: String,
    /// Whether the list was asked to filter by the tag: then every such record is one the
    /// target should not have returned (it does not apply the `metadata` filter).
    pub filtered: bool,
    pub count: usize,
}

/// How long a session's removal may take to show: its delete completes in the background
/// (SES-8.13: 10 s plus a provider's delay).
pub const SESSION_GONE_WITHIN: Duration = Duration::from_secs(30);

/// How long any other removal may take to show. A kill is synchronous (SBX-3.14, and E2B's
/// `DELETE /sandboxes/{id}`): the object is 404 from the moment the kill answers. A short
/// grace keeps a deployment that answers through a cache from being reported as unable to
/// remove what it did remove, without a target that only claims the kill holding the sweep
/// for as long as a session's cleanup may take.
const KILL_GONE_WITHIN: Duration = Duration::from_secs(3);

/// How long [`remove`] waits for `path` to answer 404 after its delete.
fn gone_within(path: &str) -> Duration {
    if path.starts_with("/v1/sessions/") {
        SESSION_GONE_WITHIN
    } else {
        KILL_GONE_WITHIN
    }
}

/// Why a sweep request failed, in the words the engine uses for the same failure.
pub fn why(conn: &Conn<'_>, e: &reqwest::Error) -> String {
    if e.is_timeout() {
        format!(
            "no response: not received within {}s (--request-timeout)",
            conn.request_timeout.as_secs_f64()
        )
    } else {
        describe_reqwest(e)
    }
}

/// `GET url` with `credential` for a sweep: the answer's headers and its body as JSON, read
/// under the run's caps; any other answer than a 2xx with a JSON body is the error, in the
/// words the engine uses (`what` names the request, e.g. `GET /v1/sandboxes`).
pub async fn get_json(
    conn: &Conn<'_>,
    credential: (&str, &str),
    url: reqwest::Url,
    what: &str,
) -> Result<(reqwest::header::HeaderMap, Value), String> {
    let request = conn
        .client
        .get(url)
        .header(credential.0, credential.1)
        .timeout(conn.request_timeout);
    let response = crate::target::send_patiently(request, conn.usage)
        .await
        .map_err(|e| format!("{what}: {}", why(conn, &e)))?;
    if !response.status().is_success() {
        return Err(format!("{what}: status {}", response.status()));
    }
    let headers = response.headers().clone();
    let body = crate::target::read_body(response, conn.limits, None)
        .await
        .map_err(|e| match e {
            crate::target::ReadError::Transport(e) => format!("{what}: {}", why(conn, &e)),
            e => format!("{what}: {e}"),
        })?;
    conn.usage.received(body.len() as u64);
    let json = serde_json::from_slice(&body)
        .map_err(|_| format!("{what}: the answer is not JSON ({} bytes)", body.len()))?;
    Ok((headers, json))
}

/// The `sandspec_run` tag in a record's own `metadata`, if it has one.
pub fn tag_of(record: &Value) -> Option<&str> {
    record.get("metadata")?.get(RUN_TAG)?.as_str()
}

/// Deletes `path` with `credential`, then confirms that a GET answers 404 (waiting a bounded
/// time, [`gone_within`], for a delete that completes in the background).
pub async fn remove(conn: &Conn<'_>, credential: &(&'static str, String), path: &str) -> bool {
    let url = format!("{}{path}", conn.base_url);
    let delete = conn
        .client
        .delete(&url)
        .header(credential.0, credential.1.as_str())
        .timeout(conn.request_timeout);
    let deleted = crate::target::send_patiently(delete, conn.usage).await;
    if !matches!(deleted, Ok(r) if r.status().is_success() || r.status().as_u16() == 404) {
        return false;
    }
    let since = std::time::Instant::now();
    loop {
        let get = conn
            .client
            .get(&url)
            .header(credential.0, credential.1.as_str())
            .timeout(conn.request_timeout);
        let status = crate::target::send_patiently(get, conn.usage)
            .await
            .map(|r| r.status().as_u16());
        match status {
            Ok(404) => {
                conn.usage.gone(path);
                return true;
            }
            Ok(_) if since.elapsed() < gone_within(path) => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            _ => return false,
        }
    }
}

/// A path segment, percent-encoded.
fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b':' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The run tag and ID of a listed record that `sandspec sweep` removes: its own
/// `sandspec_run` tag is set and its `time_field` (an RFC 3339 time) is before `cutoff`. A
/// record without a readable time is left alone.
fn tagged_before<'a>(
    record: &'a Value,
    time_field: &str,
    id_field: &str,
    cutoff: OffsetDateTime,
) -> Option<(&'a str, &'a str)> {
    let run = tag_of(record)?;
    let at = record
        .get(time_field)
        .and_then(Value::as_str)
        .and_then(|t| {
            OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()
        })?;
    if at >= cutoff {
        return None;
    }
    Some((run, record.get(id_field).and_then(Value::as_str)?))
}

/// Removes `path` (unless `dry_run`) and says what became of it.
async fn sweep_one(
    conn: &Conn<'_>,
    credential: &(&'static str, String),
    path: String,
    run: &str,
    dry_run: bool,
) -> Swept {
    let removed = !dry_run && remove(conn, credential, &path).await;
    Swept {
        path,
        run: run.to_owned(),
        removed,
    }
}

/// Parses `30m`, `2h`, `45s`, `1d`.
pub fn parse_age(s: &str) -> Result<Duration, String> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("bad age `{s}` (e.g. 30m, 2h, 1d)"))?;
    let secs = match unit {
        "s" => n,
        "m" | "" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        _ => return Err(format!("bad age `{s}` (e.g. 30m, 2h, 1d)")),
    };
    Ok(Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a session's removal completes in the background; a kill is answered when done.
    #[test]
    fn only_a_session_is_waited_for_as_long_as_its_cleanup_may_take() {
        assert_eq!(gone_within("/v1/sessions/ses_1"), SESSION_GONE_WITHIN);
        for path in [
            "/v1/sandboxes/local:sbx_1",
            "/v1/snapshots/local:snp_1",
            "/sandboxes/abc",
        ] {
            assert_eq!(gone_within(path), KILL_GONE_WITHIN, "{path}");
        }
        assert!(KILL_GONE_WITHIN < SESSION_GONE_WITHIN);
    }

    #[test]
    fn loopback_hosts() {
        for (url, want) in [
            ("http://127.0.0.1:8080", true),
            ("http://127.9.9.9", true),
            ("http://localhost:1", true),
            ("http://[::1]:80", true),
            ("https://sandbox.example.test", false),
            ("http://10.0.0.1", false),
        ] {
            assert_eq!(
                is_loopback(&reqwest::Url::parse(url).unwrap()),
                want,
                "{url}"
            );
        }
    }

    #[test]
    fn guard_decisions() {
        let never = |_: &str| -> bool { panic!("must not ask") };
        let remote = "https://sandbox.example.test";
        assert_eq!(decide("http://127.0.0.1:1", false, false, never), Ok(()));
        assert_eq!(decide(remote, true, false, never), Ok(()));
        assert_eq!(
            decide(remote, false, false, never),
            Err(GuardError::NeedsLive(remote.into()))
        );
        assert_eq!(decide(remote, false, true, |_| true), Ok(()));
        assert_eq!(
            decide(remote, false, true, |_| false),
            Err(GuardError::Declined(remote.into()))
        );
    }

    /// Every sandbox and session the catalog creates with a body carries the run's tag (a
    /// session's own sandbox too), so that the sweeps, which trust only the tag, can find it.
    #[test]
    fn every_create_in_the_catalog_is_tagged() {
        use crate::scenario::{Method, Request, Step};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        let mut catalog = crate::scenario::load_dir(&dir).expect("the catalog parses");
        catalog.extend(
            crate::scenario::load_dir(&crate::profile::Api::E2b.catalog(&dir))
                .expect("the E2B catalog parses"),
        );
        catalog.extend(
            crate::scenario::load_dir(&crate::profile::Api::AgentSandbox.catalog(&dir))
                .expect("the Agent Sandbox catalog parses"),
        );
        let tagged = |v: Option<&Value>| {
            v.and_then(|m| m.get(RUN_TAG)).and_then(Value::as_str) == Some("{{run_id}}")
        };
        let mut creates = 0;
        let mut untagged = Vec::new();
        for s in &catalog {
            let requests = s.scenario.steps.iter().flat_map(|step| match step {
                Step::Request(r) => vec![r],
                Step::Parallel(p) => p.request.iter().chain(&p.requests).collect(),
                _ => Vec::<&Request>::new(),
            });
            for r in requests {
                let wants_success = match (r.expect.status, r.expect.status_in.as_slice()) {
                    (Some(st), _) => (200..300).contains(&st),
                    (None, list) => {
                        list.is_empty() || list.iter().any(|st| (200..300).contains(st))
                    }
                };
                // A create with no body at all checks the defaults and cannot carry the tag;
                // its scenario's leak check still covers it.
                let bodiless = r.json.is_none() && r.body_text.is_none() && r.body_base64.is_none();
                if r.method != Method::Post || !wants_success || bodiless {
                    continue;
                }
                let body = r.json.as_ref().map(|j| &j.value);
                let ok = match r.path.raw.as_str() {
                    "/v1/sandboxes" | "/sandboxes" | "/v2/sandboxes" | "/v1/agents/sessions" => {
                        tagged(body.and_then(|b| b.get("metadata")))
                    }
                    "/v1/sessions" => {
                        tagged(body.and_then(|b| b.get("metadata")))
                            && body
                                .and_then(|b| b.pointer("/sandbox/create"))
                                .is_none_or(|c| tagged(c.get("metadata")))
                    }
                    _ => continue,
                };
                creates += 1;
                if !ok {
                    untagged.push(format!("{} {}", s.id(), r.path.raw));
                }
            }
        }
        assert!(creates > 50, "only {creates} creates found");
        assert!(
            untagged.is_empty(),
            "creates without the run's tag: {untagged:#?}"
        );
    }

    #[test]
    fn ages() {
        assert_eq!(parse_age("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_age("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_age("45s"), Ok(Duration::from_secs(45)));
        assert_eq!(parse_age("1d"), Ok(Duration::from_secs(86_400)));
        assert!(parse_age("x").is_err());
        assert!(parse_age("5y").is_err());
    }
}
