//! Live runs against targets that cost money: the loopback guard, the end-of-run sweep of
//! everything tagged with the run's ID, and `sandspec sweep` for leftovers of earlier,
//! interrupted runs.
//!
//! Every resource a scenario creates carries `metadata.sandspec_run = <run id>`; that tag is
//! the only thing the sweeps trust, so they never touch what a run did not create.

use std::io::{BufRead as _, IsTerminal as _, Write as _};
use std::time::Duration;

use serde_json::Value;
use time::OffsetDateTime;

use crate::target::Target;

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

/// A resource found by a sweep, and whether removing it worked.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Swept {
    pub id: String,
    pub run: String,
    pub removed: bool,
}

/// Every sandbox the owner can list, following pages to the end.
async fn list_all(
    target: &Target,
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
            .bearer_auth(&target.tokens.owner)
            .timeout(Duration::from_secs(30));
        let resp = req.send().await.map_err(|e| format!("GET {path}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("GET {path}: status {}", resp.status()));
        }
        let page: Value = resp.json().await.map_err(|e| format!("GET {path}: {e}"))?;
        if let Some(items) = page.get("data").and_then(Value::as_array) {
            out.extend(items.iter().cloned());
        }
        match page.get("next_page_token").and_then(Value::as_str) {
            Some(t) => page_token = Some(t.to_owned()),
            None => return Ok(out),
        }
    }
    Err(format!("GET {path}: more than 1000 pages"))
}

async fn kill(target: &Target, id: &str) -> bool {
    let url = format!("{}/v1/sandboxes/{}", target.base_url, urlencode(id));
    match target
        .client
        .delete(url)
        .bearer_auth(&target.tokens.owner)
        .timeout(Duration::from_secs(60))
        .send()
        .await
    {
        Ok(r) => r.status().as_u16() == 204 || r.status().as_u16() == 404,
        Err(_) => false,
    }
}

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

/// The end-of-run sweep: removes every sandbox of the owner still tagged with `run_id`.
/// Anything it finds is a cleanup failure of the run, reported as such.
pub async fn sweep_run(target: &Target, run_id: &str) -> Result<Vec<Swept>, String> {
    let left = list_all(target, "/v1/sandboxes", Some((RUN_TAG, run_id))).await?;
    let mut swept = Vec::new();
    for sbx in left {
        let Some(id) = sbx.get("id").and_then(Value::as_str) else {
            continue;
        };
        swept.push(Swept {
            id: id.to_owned(),
            run: run_id.to_owned(),
            removed: kill(target, id).await,
        });
    }
    Ok(swept)
}

/// `sandspec sweep`: removes sandboxes tagged by any sandspec run and created before
/// `now - older_than` (leftovers of interrupted runs). With `dry_run`, only lists them.
pub async fn sweep_older_than(
    target: &Target,
    older_than: Duration,
    dry_run: bool,
) -> Result<Vec<Swept>, String> {
    let cutoff = OffsetDateTime::now_utc() - older_than;
    let all = list_all(target, "/v1/sandboxes", None).await?;
    let mut swept = Vec::new();
    for sbx in all {
        let Some(run) = sbx
            .pointer(&format!("/metadata/{RUN_TAG}"))
            .and_then(Value::as_str)
        else {
            continue;
        };
        let created = sbx.get("created_at").and_then(Value::as_str).and_then(|t| {
            OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()
        });
        if created.is_none_or(|c| c >= cutoff) {
            continue;
        }
        let Some(id) = sbx.get("id").and_then(Value::as_str) else {
            continue;
        };
        let removed = !dry_run && kill(target, id).await;
        swept.push(Swept {
            id: id.to_owned(),
            run: run.to_owned(),
            removed,
        });
    }
    Ok(swept)
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
