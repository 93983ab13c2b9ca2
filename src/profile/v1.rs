//! The `/v1` profile: sandspec's own contract. Its clauses are `docs/protocol.md`'s, embedded
//! as the document was when the runner was built; a principal's token is a bearer token; a
//! target says what it supports at `GET /v1/capabilities`; a run's sessions and sandboxes are
//! swept from `/v1/sessions` and `/v1/sandboxes`.

use std::sync::LazyLock;
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde_json::Value;

use super::api::Api;
use super::binding::{CapabilitySource, Clauses, CreatedKind, Creation, Profile};
use super::clauses::{Clause, Level, parse_clauses};
use crate::live::{
    RUN_TAG, RunSweep, Swept, SweptList, get_json, sweep_older_over, sweep_run_over,
};
use crate::target::{Capabilities, Conn, Tokens};

/// The normative document, embedded so the runner and its checks agree with the text.
pub const PROTOCOL_MD: &str = include_str!("../../docs/protocol.md");

static CLAUSES: LazyLock<Vec<Clause>> = LazyLock::new(|| parse_clauses(PROTOCOL_MD));

/// Every clause of `docs/protocol.md`, in document order.
pub fn protocol_clauses() -> &'static [Clause] {
    &CLAUSES
}

/// The clause with this ID, if the protocol has one.
pub fn clause(id: &str) -> Option<&'static Clause> {
    CLAUSES.iter().find(|c| c.id == id)
}

/// IDs of the MUST clauses in force (not withdrawn), in document order.
pub fn must_clauses() -> impl Iterator<Item = &'static str> {
    CLAUSES
        .iter()
        .filter(|c| c.level == Level::Must && !c.withdrawn)
        .map(|c| c.id.as_str())
}

/// The lists the sweeps walk, sessions first (deleting a session removes the sandbox it
/// owns), and whether the protocol lets them filter by metadata (§3.2 for sandboxes;
/// sessions have no such filter).
const LISTS: [SweptList; 2] = [
    SweptList {
        list: "/v1/sessions",
        filtered: false,
        id_field: "id",
        time_field: "created_at",
        remove_prefix: "/v1/sessions",
    },
    SweptList {
        list: "/v1/sandboxes",
        filtered: true,
        id_field: "id",
        time_field: "created_at",
        remove_prefix: "/v1/sandboxes",
    },
];

/// The `/v1` profile.
pub struct V1;

impl Profile for V1 {
    fn api(&self) -> Api {
        Api::V1
    }

    fn catalog_folder(&self) -> Option<&'static str> {
        None
    }

    fn clauses(&self) -> Clauses {
        Clauses::Protocol
    }

    fn credential(&self, token: &str) -> (&'static str, String) {
        bearer(token)
    }

    fn capability_source(&self) -> CapabilitySource {
        CapabilitySource::Advertised
    }

    fn reference_capabilities(&self, advertised: Capabilities) -> Capabilities {
        advertised
    }

    fn created(&self, method: &str, path: &str, status: u16, body: &Value) -> Vec<Creation> {
        if method != "POST" || status != 201 {
            return Vec::new();
        }
        let Some(id) = body.get("id").and_then(Value::as_str) else {
            return Vec::new();
        };
        if path == "/v1/sandboxes" {
            return vec![Creation::at(
                CreatedKind::Sandbox,
                format!("/v1/sandboxes/{id}"),
            )];
        }
        if path == "/v1/sessions" {
            let mut out = vec![Creation::at(
                CreatedKind::Session,
                format!("/v1/sessions/{id}"),
            )];
            // An owned sandbox is the session's own creation; a borrowed one is already listed.
            if body.get("sandbox_ownership").and_then(Value::as_str) == Some("owned")
                && let Some(sbx) = body.get("sandbox_id").and_then(Value::as_str)
            {
                out.push(Creation::at(
                    CreatedKind::Sandbox,
                    format!("/v1/sandboxes/{sbx}"),
                ));
            }
            return out;
        }
        let Some((sandbox, child)) = path
            .strip_prefix("/v1/sandboxes/")
            .and_then(|rest| rest.split_once('/'))
        else {
            return Vec::new();
        };
        let sandbox = Some(format!("/v1/sandboxes/{sandbox}"));
        match child {
            "snapshots" => vec![Creation::at(
                CreatedKind::Snapshot,
                format!("/v1/snapshots/{id}"),
            )],
            "processes" => vec![Creation {
                sandbox,
                ..Creation::at(CreatedKind::Process, format!("/v1/processes/{id}"))
            }],
            "previews" => {
                let token = body
                    .get("url")
                    .and_then(Value::as_str)
                    .and_then(|u| reqwest::Url::parse(u).ok())
                    .and_then(|u| {
                        u.query_pairs()
                            .find(|(k, _)| k == "preview_token")
                            .map(|(_, v)| v.into_owned())
                    });
                vec![Creation {
                    sandbox,
                    token,
                    ..Creation::at(CreatedKind::Preview, format!("/previews/{id}/"))
                }]
            }
            _ => Vec::new(),
        }
    }

    /// A sandbox create, and a session's (which makes a sandbox of its own unless it attaches
    /// to one).
    fn creates_sandbox(&self, method: &str, path: &str) -> bool {
        method == "POST" && matches!(path, "/v1/sandboxes" | "/v1/sessions")
    }

    fn sweep_run<'a>(
        &'a self,
        conn: &'a Conn<'a>,
        tokens: &'a Tokens,
        run_id: &'a str,
    ) -> BoxFuture<'a, RunSweep> {
        Box::pin(sweep_run_over(
            conn,
            tokens,
            run_id,
            bearer,
            &LISTS,
            move |token, list, run| list_all(conn, token, list.list, run),
        ))
    }

    fn sweep_older_than<'a>(
        &'a self,
        conn: &'a Conn<'a>,
        token: &'a str,
        older_than: Duration,
        dry_run: bool,
    ) -> BoxFuture<'a, Result<Vec<Swept>, String>> {
        Box::pin(async move {
            let credential = bearer(token);
            sweep_older_over(conn, &credential, older_than, dry_run, &LISTS, |list| {
                list_all(conn, token, list.list, None)
            })
            .await
        })
    }

    fn listed_coverage(&self) -> Option<(&'static str, Vec<&'static str>)> {
        Some(("docs/protocol.md", must_clauses().collect()))
    }
}

fn bearer(token: &str) -> (&'static str, String) {
    ("Authorization", format!("Bearer {token}"))
}

/// Every record of a `/v1` list as `token`, following pages to the end; with `run`, asked to
/// filter by the run's tag (`metadata.sandspec_run=<run>`).
async fn list_all(
    conn: &Conn<'_>,
    token: &str,
    path: &str,
    run: Option<&str>,
) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    let mut page_token: Option<String> = None;
    for _ in 0..1000 {
        let mut url = reqwest::Url::parse(&format!("{}{path}", conn.base_url))
            .map_err(|e| format!("GET {path}: {e}"))?;
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("limit", "100");
            if let Some(run) = run {
                q.append_pair(&format!("metadata.{RUN_TAG}"), run);
            }
            if let Some(t) = &page_token {
                q.append_pair("page_token", t);
            }
        }
        let (name, value) = bearer(token);
        let (_, page) = get_json(conn, (name, &value), url, &format!("GET {path}")).await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(method: &str, path: &str, status: u16, body: Value) -> Vec<(CreatedKind, String)> {
        V1.created(method, path, status, &body)
            .into_iter()
            .map(|c| (c.kind, c.path))
            .collect()
    }

    #[test]
    fn every_kind_of_creation_is_recognised() {
        let sbx = serde_json::json!({"id": "local:sbx_1"});
        assert_eq!(
            paths("POST", "/v1/sandboxes", 201, sbx.clone()),
            [(CreatedKind::Sandbox, "/v1/sandboxes/local:sbx_1".into())]
        );
        assert_eq!(
            paths(
                "POST",
                "/v1/sandboxes/local:sbx_1/snapshots",
                201,
                serde_json::json!({"id": "local:snp_1"})
            ),
            [(CreatedKind::Snapshot, "/v1/snapshots/local:snp_1".into())]
        );
        let process = V1.created(
            "POST",
            "/v1/sandboxes/local:sbx_1/processes",
            201,
            &serde_json::json!({"id": "local:prc_1"}),
        );
        assert_eq!(process.len(), 1);
        assert_eq!(process[0].path, "/v1/processes/local:prc_1");
        assert_eq!(
            process[0].sandbox.as_deref(),
            Some("/v1/sandboxes/local:sbx_1")
        );
        let preview = V1.created(
            "POST",
            "/v1/sandboxes/s/previews",
            201,
            &serde_json::json!({"id": "prv_1", "url": "http://h/previews/prv_1/?preview_token=tok"}),
        );
        assert_eq!(preview.len(), 1);
        assert_eq!(preview[0].path, "/previews/prv_1/");
        assert_eq!(preview[0].token.as_deref(), Some("tok"));
        assert_eq!(
            paths(
                "POST",
                "/v1/sessions",
                201,
                serde_json::json!({"id": "ses_1", "sandbox_id": "local:sbx_2", "sandbox_ownership": "owned"})
            ),
            [
                (CreatedKind::Session, "/v1/sessions/ses_1".into()),
                (CreatedKind::Sandbox, "/v1/sandboxes/local:sbx_2".into())
            ]
        );
        assert_eq!(
            paths(
                "POST",
                "/v1/sessions",
                201,
                serde_json::json!({"id": "ses_2", "sandbox_id": "local:sbx_1", "sandbox_ownership": "borrowed"})
            ),
            [(CreatedKind::Session, "/v1/sessions/ses_2".into())]
        );
        // Not a creation: another status, another method, another path, no id, an E2B create.
        assert!(paths("POST", "/v1/sandboxes", 200, serde_json::json!({"id": "x"})).is_empty());
        assert!(paths("GET", "/v1/sandboxes", 201, sbx.clone()).is_empty());
        assert!(paths("POST", "/v1/sandboxes/s/connections", 201, sbx).is_empty());
        assert!(paths("POST", "/v1/sandboxes", 201, serde_json::json!({})).is_empty());
        assert!(
            paths(
                "POST",
                "/sandboxes",
                201,
                serde_json::json!({"sandboxID": "abc"})
            )
            .is_empty()
        );
    }

    /// The clause lines and the document's own clause index agree: same IDs, same levels,
    /// same order, and the totals its heading states.
    #[test]
    fn the_protocol_clauses_match_its_clause_index() {
        let (_, index) = PROTOCOL_MD
            .split_once("\n## Clause index\n")
            .expect("docs/protocol.md has a clause index");
        let rows: Vec<(String, Level)> = index
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                let level = match cells.get(2) {
                    Some(&"MUST") => Level::Must,
                    Some(&"SHOULD") => Level::Should,
                    _ => return None,
                };
                Some((cells[1].to_owned(), level))
            })
            .collect();
        let clauses: Vec<(String, Level)> = protocol_clauses()
            .iter()
            .map(|c| (c.id.clone(), c.level))
            .collect();
        assert_eq!(clauses, rows);
        let must = clauses.iter().filter(|c| c.1 == Level::Must).count();
        let stated = format!(
            "{} clauses: {must} MUST, {} SHOULD.",
            clauses.len(),
            clauses.len() - must
        );
        assert!(index.contains(&stated), "the index heading says {stated}");
        assert_eq!(must_clauses().count(), must);
        assert!(clause("SBX-3.4").is_some_and(|c| c.level == Level::Must));
        assert!(clause("SBX-3.99").is_none());
    }
}
