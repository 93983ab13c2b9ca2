//! The E2B profile: E2B's control plane (`/sandboxes`, `/v2/sandboxes`) and envd, the daemon
//! in each sandbox (Connect-RPC services and `/files`). Its clauses are
//! `docs/profiles/e2b.md`'s; a principal's token is a team's API key in `X-API-Key`; E2B has
//! no capabilities endpoint, so a target supports what the run is told; a run's sandboxes are
//! swept from `GET /v2/sandboxes`. envd is reached as E2B's SDK reaches it ([`envd_route`]).

use std::time::Duration;

use futures_util::future::BoxFuture;
use serde_json::Value;

use crate::live::{
    RUN_TAG, RunSweep, Swept, SweptList, get_json, sweep_older_over, sweep_run_over,
};
use crate::profile::api::Api;
use crate::profile::binding::{Clauses, CreatedKind, Creation, Profile};
use crate::profile::clauses::{ClauseTable, RowLevels};
use crate::sdk::{Journeys, SdkMatrix, SdkSpec, SdkTarget};
use crate::target::{Conn, Tokens};

/// The clause document: every clause is a guarantee of E2B's own contract, a MUST.
pub const CLAUSES: ClauseTable = ClauseTable {
    prefix: "E2B-",
    path: "docs/profiles/e2b.md",
    text: include_str!("../../../docs/profiles/e2b.md"),
    levels: RowLevels::AllMust,
};

/// envd's port, the one `E2b-Sandbox-Port` and the host form name.
pub const ENVD_PORT: u16 = 49983;

/// The list the sweeps walk: the team's running and paused sandboxes, filtered by metadata.
const SANDBOXES: SweptList = SweptList {
    list: "/v2/sandboxes",
    filtered: true,
    id_field: "sandboxID",
    time_field: "startedAt",
    remove_prefix: "/sandboxes",
};

/// How a request reaches the envd of `sandbox`: at E2B's host form
/// `https://49983-<sandbox>.<domain>` (the base URL it returns) when the run names an envd
/// domain (`--envd-domain`), else on the target's own base URL with the routing headers
/// `E2b-Sandbox-Id` and `E2b-Sandbox-Port` (self-hosted and compatible platforms, the
/// reference server).
pub fn envd_route(
    sandbox: &str,
    envd_domain: Option<&str>,
) -> (Option<String>, Vec<(String, String)>) {
    port_route(sandbox, ENVD_PORT, envd_domain)
}

/// How a port of a sandbox is reached, as the SDK's `get_host` names it: at
/// `https://<port>-<sandbox>.<domain>` with an envd domain, else on the target's own URL with
/// the routing headers for that port.
pub fn port_route(
    sandbox: &str,
    port: u16,
    envd_domain: Option<&str>,
) -> (Option<String>, Vec<(String, String)>) {
    match envd_domain {
        Some(domain) => (
            Some(format!("https://{port}-{sandbox}.{domain}")),
            Vec::new(),
        ),
        None => (
            None,
            vec![
                ("E2b-Sandbox-Id".to_owned(), sandbox.to_owned()),
                ("E2b-Sandbox-Port".to_owned(), port.to_string()),
            ],
        ),
    }
}

/// envd's v1 signature of a file URL, as the SDK's `download_url` and `upload_url` make it:
/// `v1_` and the unpadded base64 of SHA-256 over `path:operation:user:token`, with
/// `:expiration` (Unix seconds) when the URL expires.
pub fn file_signature(
    path: &str,
    operation: &str,
    user: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    use base64::Engine as _;
    use sha2::Digest as _;
    let mut raw = format!("{path}:{operation}:{user}:{token}");
    if let Some(e) = expiration {
        raw.push_str(&format!(":{e}"));
    }
    let digest = sha2::Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// The E2B profile.
pub struct E2b;

impl Profile for E2b {
    fn api(&self) -> Api {
        Api::E2b
    }

    fn catalog_folder(&self) -> Option<&'static str> {
        Some("e2b")
    }

    fn clauses(&self) -> Clauses {
        Clauses::Table(CLAUSES)
    }

    fn credential(&self, token: &str) -> (&'static str, String) {
        api_key(token)
    }

    fn created(&self, method: &str, path: &str, status: u16, body: &Value) -> Vec<Creation> {
        created(method, path, status, body)
    }

    fn creates_sandbox(&self, method: &str, path: &str) -> bool {
        creates_sandbox(method, path)
    }

    fn sweep_run<'a>(
        &'a self,
        conn: &'a Conn<'a>,
        tokens: &'a Tokens,
        run_id: &'a str,
    ) -> BoxFuture<'a, RunSweep> {
        sweep_run(conn, tokens, run_id)
    }

    fn sweep_older_than<'a>(
        &'a self,
        conn: &'a Conn<'a>,
        token: &'a str,
        older_than: Duration,
        dry_run: bool,
    ) -> BoxFuture<'a, Result<Vec<Swept>, String>> {
        sweep_older_than(conn, token, older_than, dry_run)
    }

    fn sdk_journeys(&self) -> Option<&'static Journeys> {
        Some(&super::journeys::JOURNEYS)
    }

    fn sdk_matrix<'a>(
        &'a self,
        target: SdkTarget<'a>,
        client: reqwest::Client,
        specs: &'a [SdkSpec],
        cache: &'a std::path::Path,
    ) -> BoxFuture<'a, SdkMatrix> {
        super::journeys::run(target, client, specs, cache)
    }
}

/// A team's API key, as the SDK sends it.
pub(crate) fn api_key(token: &str) -> (&'static str, String) {
    ("X-API-Key", token.to_owned())
}

/// E2B's creates name the sandbox `sandboxID`; it is gone when `GET /sandboxes/{id}` answers
/// 404. Resume and connect answer 201 for a sandbox that exists already: not creations.
pub(crate) fn created(method: &str, path: &str, status: u16, body: &Value) -> Vec<Creation> {
    if method != "POST" || status != 201 || !matches!(path, "/sandboxes" | "/v2/sandboxes") {
        return Vec::new();
    }
    match body.get("sandboxID").and_then(Value::as_str) {
        Some(id) => vec![Creation::at(
            CreatedKind::Sandbox,
            format!("/sandboxes/{id}"),
        )],
        None => Vec::new(),
    }
}

/// A sandbox create of E2B's control plane (`POST /sandboxes`, `POST /v2/sandboxes`).
pub(crate) fn creates_sandbox(method: &str, path: &str) -> bool {
    method == "POST" && matches!(path, "/sandboxes" | "/v2/sandboxes")
}

/// The end-of-run sweep of an E2B control plane: for every principal, the running and paused
/// sandboxes `GET /v2/sandboxes` lists with the run's `sandspec_run` metadata; only a
/// record's own metadata decides, and each one found is killed and confirmed gone.
pub(crate) fn sweep_run<'a>(
    conn: &'a Conn<'a>,
    tokens: &'a Tokens,
    run_id: &'a str,
) -> BoxFuture<'a, RunSweep> {
    Box::pin(sweep_run_over(
        conn,
        tokens,
        run_id,
        api_key,
        &[SANDBOXES],
        move |token, _, run| list_all(conn, token, run),
    ))
}

/// `sandspec sweep --api e2b`: every sandbox `GET /v2/sandboxes` lists for the team, running
/// or paused, whose own `metadata` carries a `sandspec_run` tag and whose `startedAt` is
/// before the cutoff, is killed (`DELETE /sandboxes/{id}`) and confirmed gone by a 404.
pub(crate) fn sweep_older_than<'a>(
    conn: &'a Conn<'a>,
    token: &'a str,
    older_than: Duration,
    dry_run: bool,
) -> BoxFuture<'a, Result<Vec<Swept>, String>> {
    Box::pin(async move {
        let credential = api_key(token);
        sweep_older_over(conn, &credential, older_than, dry_run, &[SANDBOXES], |_| {
            list_all(conn, token, None)
        })
        .await
    })
}

/// Every page of `GET /v2/sandboxes` (running and paused), as `token`: filtered by the
/// run's tag when given one, else everything the team has.
async fn list_all(
    conn: &Conn<'_>,
    token: &str,
    run_id: Option<&str>,
) -> Result<Vec<Value>, String> {
    let list = SANDBOXES.list;
    let mut out = Vec::new();
    let mut next: Option<String> = None;
    for _ in 0..1000 {
        let mut url = reqwest::Url::parse(&format!("{}{list}", conn.base_url))
            .map_err(|e| format!("GET {list}: {e}"))?;
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
        let (headers, page) =
            get_json(conn, ("X-API-Key", token), url, &format!("GET {list}")).await?;
        next = headers
            .get("x-next-token")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .map(str::to_owned);
        let items = page
            .as_array()
            .ok_or_else(|| format!("GET {list}: not an array"))?;
        out.extend(items.iter().cloned());
        if next.is_none() {
            return Ok(out);
        }
    }
    Err(format!("GET {list}: more than 1000 pages"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_defines_clauses_and_only_those_count() {
        assert!(CLAUSES.ids().count() >= 10);
        assert!(CLAUSES.level("E2B-AUTH-1").is_some());
        assert!(CLAUSES.level("E2B-AUTH-999").is_none());
        assert!(CLAUSES.level("SBX-3.1").is_none());
        // The catalog's table further down names scenarios, not clauses.
        assert!(CLAUSES.level("E2B-LIFE-001").is_none());
    }

    #[test]
    fn creates_are_recognised_and_resumes_are_not() {
        let sbx = serde_json::json!({"sandboxID": "abc1"});
        for create in ["/sandboxes", "/v2/sandboxes"] {
            let found = created("POST", create, 201, &sbx);
            assert_eq!(
                found,
                [Creation::at(CreatedKind::Sandbox, "/sandboxes/abc1".into())]
            );
        }
        assert!(created("POST", "/sandboxes/abc1/connect", 201, &sbx).is_empty());
        assert!(created("POST", "/sandboxes/abc1/resume", 201, &sbx).is_empty());
        assert!(created("POST", "/sandboxes", 200, &sbx).is_empty());
        assert!(
            created(
                "POST",
                "/v1/sandboxes",
                201,
                &serde_json::json!({"id": "x"})
            )
            .is_empty()
        );
    }

    /// The values the SDK's `get_signature` gives for the same fields (computed with
    /// Python's hashlib and base64, as it does).
    #[test]
    fn file_signatures_are_envds_v1() {
        assert_eq!(
            file_signature("signed.txt", "read", "", "tok", None),
            "v1_naf9vweu1UYYFJNcvUcv3mEgsh+/LghSuKF2ljfQUCI"
        );
        assert_eq!(
            file_signature("signed.txt", "write", "user", "tok", Some(1_700_000_000)),
            "v1_y8mcbFWSQQgpZIRQqxHrl3YQmoJlsR/PzPneNqaHTdY"
        );
    }

    #[test]
    fn envd_is_reached_by_headers_or_by_host() {
        let (base, headers) = envd_route("abc", None);
        assert_eq!(base, None);
        assert_eq!(
            headers,
            [
                ("E2b-Sandbox-Id".to_owned(), "abc".to_owned()),
                ("E2b-Sandbox-Port".to_owned(), "49983".to_owned())
            ]
        );
        let (base, headers) = envd_route("abc", Some("e2b.app"));
        assert_eq!(base.as_deref(), Some("https://49983-abc.e2b.app"));
        assert!(headers.is_empty());
    }
}
