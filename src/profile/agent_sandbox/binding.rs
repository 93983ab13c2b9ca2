//! The Agent Sandbox profile's binding: its clause document, its stand-in's defects, the
//! service launched for a run, and the end-of-run sweep of its agent sessions.

use std::time::Duration;

use futures_util::future::BoxFuture;
use serde_json::Value;

use super::launch::{LaunchedService, bearer, capabilities_of};
use crate::live::{RunSweep, Swept, SweptList, get_json, sweep_run_over};
use crate::profile::api::Api;
use crate::profile::binding::{Clauses, Creation, Defects, Launched, Profile};
use crate::profile::clauses::{ClauseTable, RowLevels};
use crate::target::{Conn, TargetError, Tokens};

/// The profile's catalog: this folder of the catalog root.
pub const CATALOG_FOLDER: &str = "agent-sandbox";

/// The clause document: every clause is a guarantee the package makes, a MUST.
const CLAUSES: ClauseTable = ClauseTable {
    prefix: "ASB-",
    path: "docs/profiles/agent-sandbox.md",
    text: include_str!("../../../docs/profiles/agent-sandbox.md"),
    levels: RowLevels::AllMust,
};

/// The deliberate defects of the stand-in (`fixtures/agent-sandbox/defects.py`, loaded into
/// the real service with `--commands` and chosen with [`super::DEFECT_ENV`]). A MUST
/// scenario of this profile names the ones it catches; `tests/agent_sandbox.rs` proves each
/// catch.
pub const DEFECTS: &[&str] = &[
    "asb-any-token-accepted",
    "asb-sessions-shared",
    "asb-paths-unconfined",
    "asb-bad-input-500",
    "asb-turns-concurrent",
    "asb-idempotency-ignored",
    "asb-cancel-ignored",
    "asb-cancel-waits",
    "asb-no-kill",
    "asb-delete-waits-for-turn",
    "asb-no-heartbeat",
    "asb-move-copies",
    "asb-stdin-dropped",
    "asb-resize-ignored",
    "asb-check-permissive",
    "asb-code-output-lost",
    "asb-session-update-ignored",
    "asb-env-file-overwritten",
    "asb-definition-delete-keeps",
    "asb-credential-secret-shown",
    "asb-response-cancel-ignored",
    "asb-webhook-secret-shown",
    "asb-scopes-ignored-system",
    "asb-scopes-ignored-files",
    "asb-scopes-ignored-process",
    "asb-scopes-ignored-devtools",
    "asb-scopes-ignored-agents",
    "asb-delete-before-refusing",
    "asb-turns-forgotten-on-restart",
    "asb-items-forgotten-on-restart",
    "asb-terminal-shell-survives",
    "asb-stream-outlives-session",
];

/// The list the end-of-run sweep walks. Processes and files carry no metadata; scenarios
/// clean them up themselves, and a launched service's process group is stopped at the end.
const SESSIONS: SweptList = SweptList {
    list: "/v1/agents/sessions",
    filtered: false,
    id_field: "id",
    time_field: "created_at",
    remove_prefix: "/v1/agents/sessions",
};

/// The Agent Sandbox profile.
pub struct AgentSandbox;

impl Profile for AgentSandbox {
    fn api(&self) -> Api {
        Api::AgentSandbox
    }

    fn catalog_folder(&self) -> Option<&'static str> {
        Some(CATALOG_FOLDER)
    }

    fn clauses(&self) -> Clauses {
        Clauses::Table(CLAUSES)
    }

    fn defects(&self) -> Defects {
        Defects::StandIn(DEFECTS)
    }

    fn credential(&self, token: &str) -> (&'static str, String) {
        bearer(token)
    }

    /// Every endpoint of the package, as the operation table of the profile's document lists
    /// them (`tests/agent_sandbox.rs` holds the table to the installed package's own).
    fn operations(&self) -> Vec<crate::profile::Operation> {
        crate::profile::from_tables(CLAUSES.text)
    }

    fn served_by_reference(&self) -> bool {
        false
    }

    fn launch(&self, command: &str) -> Option<BoxFuture<'static, Result<Launched, TargetError>>> {
        let command = command.to_owned();
        Some(Box::pin(async move {
            let service = LaunchedService::start(&command).await?;
            let capabilities = capabilities_of(&service).await?;
            Ok(Launched {
                url: service.url.clone(),
                tokens: service.tokens.clone(),
                capabilities,
                service: Box::new(service),
            })
        }))
    }

    /// Agent sessions are swept by the run's tag; nothing else the service keeps is counted
    /// as the scenario's creation.
    fn created(&self, _method: &str, _path: &str, _status: u16, _body: &Value) -> Vec<Creation> {
        Vec::new()
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
            &[SESSIONS],
            move |token, _, _| list_sessions(conn, token),
        ))
    }

    fn sweep_older_than<'a>(
        &'a self,
        _conn: &'a Conn<'a>,
        _token: &'a str,
        _older_than: Duration,
        _dry_run: bool,
    ) -> BoxFuture<'a, Result<Vec<Swept>, String>> {
        Box::pin(async {
            Err(
                "`sandspec sweep` does not sweep an Agent Sandbox service: a run launches its \
                 own service (--launch) and stops it with everything in it"
                    .to_owned(),
            )
        })
    }
}

/// Every page of `GET /v1/agents/sessions` (`limit`, `after`, `has_more`), as `token`.
async fn list_sessions(conn: &Conn<'_>, token: &str) -> Result<Vec<Value>, String> {
    let list = SESSIONS.list;
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    for _ in 0..1000 {
        let mut url = reqwest::Url::parse(&format!("{}{list}", conn.base_url))
            .map_err(|e| format!("GET {list}: {e}"))?;
        url.query_pairs_mut().append_pair("limit", "100");
        if let Some(a) = &after {
            url.query_pairs_mut().append_pair("after", a);
        }
        let (name, value) = bearer(token);
        let (_, page) = get_json(conn, (name, &value), url, &format!("GET {list}")).await?;
        let data = page
            .get("data")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("GET {list}: no `data` array"))?;
        out.extend(data.iter().cloned());
        let more = page.get("has_more").and_then(Value::as_bool) == Some(true);
        match page.get("last_id").and_then(Value::as_str) {
            Some(last) if more => after = Some(last.to_owned()),
            _ => return Ok(out),
        }
    }
    Err(format!("GET {list}: more than 1000 pages"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_defines_clauses_and_only_those_count() {
        assert!(CLAUSES.ids().count() >= 8);
        assert!(CLAUSES.level("ASB-AUTH-1").is_some());
        assert!(CLAUSES.level("ASB-AUTH-999").is_none());
        assert!(CLAUSES.level("E2B-AUTH-1").is_none());
        // The catalog table names scenarios, not clauses.
        assert!(CLAUSES.level("ASB-AUTH-001").is_none());
    }
}
