//! Live runs against targets that cost money: the loopback guard, the end-of-run sweep of
//! everything tagged with the run's ID, and `sandspec sweep` for leftovers of earlier,
//! interrupted runs.
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

use crate::engine::Leftover;
use crate::target::{Target, describe_reqwest};

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

/// One list of the end-of-run sweep, as one principal.
pub(crate) struct Listed<'a> {
    /// `owner` or `other`.
    pub principal: &'a str,
    pub token: &'a str,
    /// The list, as the receipt names it.
    pub list: &'a str,
    /// Whether the list was asked to filter by the run's tag.
    pub filtered: bool,
    /// Where a record holds its ID.
    pub id_field: &'a str,
    /// A record is removed at `<remove_prefix>/<id>`.
    pub remove_prefix: &'a str,
}

impl RunSweep {
    /// Removes each of `records` whose own record carries `run_id` (confirming it is gone)
    /// as a leftover, and counts the others as ignored, never touching them.
    pub(crate) async fn take(
        &mut self,
        target: &Target,
        run_id: &str,
        listed: &Listed<'_>,
        records: &[Value],
    ) {
        let mut ignored = 0;
        for record in records {
            match record.get(listed.id_field).and_then(Value::as_str) {
                Some(id) if tag_of(record) == Some(run_id) => {
                    let path = format!("{}/{}", listed.remove_prefix, urlencode(id));
                    let removed = remove(target, listed.token, &path).await;
                    self.found.push(Leftover { path, removed });
                }
                _ => ignored += 1,
            }
        }
        if ignored > 0 {
            self.ignored.push(Ignored {
                principal: listed.principal.to_owned(),
                list: listed.list.to_owned(),
                filtered: listed.filtered,
                count: ignored,
            });
        }
    }
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

/// The lists a sweep walks, sessions first (deleting a session removes the sandbox it
/// owns), and whether the protocol lets them filter by metadata (§3.2 for sandboxes;
/// sessions have no such filter).
const LISTS: &[(&str, bool)] = &[("/v1/sessions", false), ("/v1/sandboxes", true)];

/// How long a session's removal may take to show: its delete completes in the background
/// (SES-8.13: 10 s plus a provider's delay).
pub(crate) const SESSION_GONE_WITHIN: Duration = Duration::from_secs(30);

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

/// Every record of a list as `token`, following pages to the end.
async fn list_all(
    target: &Target,
    token: &str,
    path: &str,
    filter: Option<(&str, &str)>,
) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    let mut page_token: Option<String> = None;
    for _ in 0..1000 {
        let mut url = reqwest::Url::parse(&format!("{}{path}", target.base_url))
            .map_err(|e| format!("GET {path}: {e}"))?;
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("limit", "100");
            if let Some((k, v)) = filter {
                q.append_pair(&format!("metadata.{k}"), v);
            }
            if let Some(t) = &page_token {
                q.append_pair("page_token", t);
            }
        }
        let req = target
            .client
            .get(url)
            .bearer_auth(token)
            .timeout(target.request_timeout);
        let resp = req
            .send()
            .await
            .map_err(|e| format!("GET {path}: {}", why(target, &e)))?;
        if !resp.status().is_success() {
            return Err(format!("GET {path}: status {}", resp.status()));
        }
        let page: Value = resp
            .json()
            .await
            .map_err(|e| format!("GET {path}: {}", why(target, &e)))?;
        let items = page
            .get("data")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("GET {path}: no `data` array"))?;
        out.extend(items.iter().cloned());
        match page.get("next_page_token").and_then(Value::as_str) {
            Some(t) => page_token = Some(t.to_owned()),
            None => return Ok(out),
        }
    }
    Err(format!("GET {path}: more than 1000 pages"))
}

/// Why a sweep request failed, in the words the engine uses for the same failure.
fn why(target: &Target, e: &reqwest::Error) -> String {
    if e.is_timeout() {
        format!(
            "no response: not received within {}s (--request-timeout)",
            target.request_timeout.as_secs_f64()
        )
    } else {
        describe_reqwest(e)
    }
}

/// The `sandspec_run` tag in a record's own `metadata`, if it has one.
pub(crate) fn tag_of(record: &Value) -> Option<&str> {
    record.get("metadata")?.get(RUN_TAG)?.as_str()
}

/// Deletes `path` as `token`, then confirms that a GET answers 404 (waiting a bounded time,
/// [`gone_within`], for a delete that completes in the background).
pub(crate) async fn remove(target: &Target, token: &str, path: &str) -> bool {
    let url = format!("{}{path}", target.base_url);
    let deleted = target
        .client
        .delete(&url)
        .header(
            target.api.credential(token).0,
            target.api.credential(token).1,
        )
        .timeout(target.request_timeout)
        .send()
        .await;
    if !matches!(deleted, Ok(r) if r.status().is_success() || r.status().as_u16() == 404) {
        return false;
    }
    let since = std::time::Instant::now();
    loop {
        let status = target
            .client
            .get(&url)
            .header(
                target.api.credential(token).0,
                target.api.credential(token).1,
            )
            .timeout(target.request_timeout)
            .send()
            .await
            .map(|r| r.status().as_u16());
        match status {
            Ok(404) => return true,
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

/// The end-of-run sweep: for every principal the run used, lists sessions and sandboxes and
/// removes each whose own record carries `metadata.sandspec_run = run_id`, confirming it is
/// gone. The sandbox list is asked to filter by the tag, but only the record decides:
/// records without the tag are counted as ignored and never touched. Anything found is a
/// cleanup failure of the run.
pub async fn sweep_run(target: &Target, run_id: &str) -> RunSweep {
    if target.api.speaks_e2b() {
        return sweep_run_e2b(target, run_id).await;
    }
    if target.api == crate::profile::Api::AgentSandbox {
        return crate::agent_sandbox::sweep_run(target, run_id).await;
    }
    let mut sweep = RunSweep::default();
    let mut errors = Vec::new();
    let principals = [
        ("owner", target.tokens.owner.as_str()),
        ("other", target.tokens.other.as_str()),
    ];
    for (principal, token) in principals {
        for &(list, filtered) in LISTS {
            let filter = filtered.then_some((RUN_TAG, run_id));
            let records = match list_all(target, token, list, filter).await {
                Ok(r) => r,
                Err(e) => {
                    errors.push(format!("{e} (as {principal})"));
                    continue;
                }
            };
            let listed = Listed {
                principal,
                token,
                list,
                filtered,
                id_field: "id",
                remove_prefix: list,
            };
            sweep.take(target, run_id, &listed, &records).await;
        }
    }
    if !errors.is_empty() {
        sweep.error = Some(errors.join("; "));
    }
    sweep
}

/// The end-of-run sweep of an E2B target: for every principal, the running and paused
/// sandboxes `GET /v2/sandboxes` lists with the run's `sandspec_run` metadata; only a
/// record's own metadata decides, and each one found is killed and confirmed gone.
async fn sweep_run_e2b(target: &Target, run_id: &str) -> RunSweep {
    const LIST: &str = "/v2/sandboxes";
    let mut sweep = RunSweep::default();
    let mut errors = Vec::new();
    let principals = [
        ("owner", target.tokens.owner.as_str()),
        ("other", target.tokens.other.as_str()),
    ];
    for (principal, token) in principals {
        let records = match list_all_e2b(target, token, Some(run_id)).await {
            Ok(r) => r,
            Err(e) => {
                errors.push(format!("{e} (as {principal})"));
                continue;
            }
        };
        let listed = Listed {
            principal,
            token,
            list: LIST,
            filtered: true,
            id_field: "sandboxID",
            remove_prefix: "/sandboxes",
        };
        sweep.take(target, run_id, &listed, &records).await;
    }
    if !errors.is_empty() {
        sweep.error = Some(errors.join("; "));
    }
    sweep
}

/// Every page of `GET /v2/sandboxes` (running and paused), as `token`: filtered by the
/// run's tag when given one, else everything the team has.
async fn list_all_e2b(
    target: &Target,
    token: &str,
    run_id: Option<&str>,
) -> Result<Vec<Value>, String> {
    const LIST: &str = "/v2/sandboxes";
    let mut out = Vec::new();
    let mut next: Option<String> = None;
    for _ in 0..1000 {
        let mut url = reqwest::Url::parse(&format!("{}{LIST}", target.base_url))
            .map_err(|e| format!("GET {LIST}: {e}"))?;
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("limit", "100");
            q.append_pair("state", "running,paused");
            if let Some(run_id) = run_id {
                q.append_pair("metadata", &format!("{RUN_TAG}={run_id}"));
            }
            if let Some(t) = &next {
                q.append_pair("nextToken", t);
            }
        }
        let resp = target
            .client
            .get(url)
            .header("X-API-Key", token)
            .timeout(target.request_timeout)
            .send()
            .await
            .map_err(|e| format!("GET {LIST}: {}", why(target, &e)))?;
        if !resp.status().is_success() {
            return Err(format!("GET {LIST}: status {}", resp.status()));
        }
        next = resp
            .headers()
            .get("x-next-token")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .map(str::to_owned);
        let page: Value = resp
            .json()
            .await
            .map_err(|e| format!("GET {LIST}: {}", why(target, &e)))?;
        let items = page
            .as_array()
            .ok_or_else(|| format!("GET {LIST}: not an array"))?;
        out.extend(items.iter().cloned());
        if next.is_none() {
            return Ok(out);
        }
    }
    Err(format!("GET {LIST}: more than 1000 pages"))
}

/// `sandspec sweep`: removes the sessions and sandboxes visible to `token` whose own record
/// carries a `sandspec_run` tag (of any run) and that were created before
/// `now - older_than` (leftovers of interrupted runs). With `dry_run`, only lists them.
pub async fn sweep_older_than(
    target: &Target,
    token: &str,
    older_than: Duration,
    dry_run: bool,
) -> Result<Vec<Swept>, String> {
    let cutoff = OffsetDateTime::now_utc() - older_than;
    if target.api == crate::profile::Api::E2b {
        return sweep_older_than_e2b(target, token, cutoff, dry_run).await;
    }
    let mut swept = Vec::new();
    for &(list, _) in LISTS {
        for record in list_all(target, token, list, None).await? {
            if let Some((run, id)) = tagged_before(&record, "created_at", "id", cutoff) {
                let path = format!("{list}/{}", urlencode(id));
                swept.push(sweep_one(target, token, path, run, dry_run).await);
            }
        }
    }
    Ok(swept)
}

/// `sandspec sweep --api e2b`: every sandbox `GET /v2/sandboxes` lists for the team, running
/// or paused, whose own `metadata` carries a `sandspec_run` tag and whose `startedAt` is
/// before `cutoff`, is killed (`DELETE /sandboxes/{id}`) and confirmed gone by a 404.
async fn sweep_older_than_e2b(
    target: &Target,
    token: &str,
    cutoff: OffsetDateTime,
    dry_run: bool,
) -> Result<Vec<Swept>, String> {
    let mut swept = Vec::new();
    for record in list_all_e2b(target, token, None).await? {
        if let Some((run, id)) = tagged_before(&record, "startedAt", "sandboxID", cutoff) {
            let path = format!("/sandboxes/{}", urlencode(id));
            swept.push(sweep_one(target, token, path, run, dry_run).await);
        }
    }
    Ok(swept)
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
async fn sweep_one(target: &Target, token: &str, path: String, run: &str, dry_run: bool) -> Swept {
    let removed = !dry_run && remove(target, token, &path).await;
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
