//! The scenario's ledger of what it created, and the `leak check` that ends every scenario:
//! after cleanup, each object the scenario created must be gone. What is still there fails
//! the scenario, named; the sweep then removes it and confirms it is gone (404).
//!
//! The ledger is filled from the target's own 201 responses to the scenario's requests, so
//! it names only objects this scenario created: sandboxes, snapshots, processes, previews,
//! sessions and the sandboxes sessions create for themselves. Connections, submissions,
//! operations and artifacts live inside a sandbox or a session and go with it.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::context::{Ctx, Prepared, StepError};
use crate::engine::expect::Observed;
use crate::engine::outcome::Outcome;
// How long the leak check waits for a session in state `deleting` to go: the sweep's wait.
use crate::live::SESSION_GONE_WITHIN;
use crate::scenario::{Method, Principal, Via};

/// The step name under which leftovers fail a scenario.
pub const LEAK_CHECK: &str = "leak check";

/// Something a scenario (or the whole run) left behind, and whether the sweep removed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Leftover {
    /// The object's path, e.g. `/v1/sandboxes/local:sbx_...`.
    pub path: String,
    /// The sweep removed it and a GET afterwards answered 404.
    pub removed: bool,
}

/// What kind of object a ledger entry is, which says how to see it and how to remove it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Sandbox,
    Snapshot,
    Session,
    /// Removed with its sandbox.
    Process,
    /// Removed with its sandbox; seen through its proxy path (403 once it is gone).
    Preview,
}

/// One object the scenario created.
pub(super) struct Created {
    pub kind: Kind,
    /// `GET` of this path answers 404 once the object is gone (for a preview, the proxy
    /// path, which answers 403).
    pub path: String,
    /// Who created it, and so who can see it.
    pub principal: Principal,
    /// For a process or a preview: the sandbox it lives in.
    pub sandbox: Option<String>,
    /// For a preview: its token (registered with the sanitizer).
    pub token: Option<String>,
    /// Created by a `parallel` step marked `removed_by_sweep`: removing it after cleanup is
    /// the scenario's declared plan, not a leak.
    pub by_sweep: bool,
}

/// The ledger entries a successful create adds: `method target` answered `obs`.
pub(super) fn created_by(
    method: Method,
    target: &str,
    principal: Principal,
    obs: &Observed,
) -> Vec<Created> {
    if method != Method::Post || obs.status != 201 {
        return Vec::new();
    }
    let Ok(json) = obs.json() else {
        return Vec::new();
    };
    let path = target.split('?').next().unwrap_or_default();
    // E2B's creates (the E2B profile) name the sandbox `sandboxID`; it is gone when
    // `GET /sandboxes/{id}` answers 404. Resume and connect answer 201 for an existing one.
    if matches!(path, "/sandboxes" | "/v2/sandboxes")
        && let Some(id) = json.get("sandboxID").and_then(Value::as_str)
    {
        return vec![Created {
            kind: Kind::Sandbox,
            path: format!("/sandboxes/{id}"),
            principal,
            sandbox: None,
            token: None,
            by_sweep: false,
        }];
    }
    let Some(id) = json.get("id").and_then(Value::as_str) else {
        return Vec::new();
    };
    let entry = |kind, path: String, sandbox: Option<String>| Created {
        kind,
        path,
        principal,
        sandbox,
        token: None,
        by_sweep: false,
    };
    if path == "/v1/sandboxes" {
        return vec![entry(Kind::Sandbox, format!("/v1/sandboxes/{id}"), None)];
    }
    if path == "/v1/sessions" {
        let mut out = vec![entry(Kind::Session, format!("/v1/sessions/{id}"), None)];
        // An owned sandbox is the session's own creation; a borrowed one is already listed.
        if json.get("sandbox_ownership").and_then(Value::as_str) == Some("owned")
            && let Some(sbx) = json.get("sandbox_id").and_then(Value::as_str)
        {
            out.push(entry(Kind::Sandbox, format!("/v1/sandboxes/{sbx}"), None));
        }
        return out;
    }
    let Some(rest) = path.strip_prefix("/v1/sandboxes/") else {
        return Vec::new();
    };
    let Some((sandbox, child)) = rest.split_once('/') else {
        return Vec::new();
    };
    let sandbox = Some(format!("/v1/sandboxes/{sandbox}"));
    match child {
        "snapshots" => vec![entry(Kind::Snapshot, format!("/v1/snapshots/{id}"), None)],
        "processes" => vec![entry(Kind::Process, format!("/v1/processes/{id}"), sandbox)],
        "previews" => {
            let token = json
                .get("url")
                .and_then(Value::as_str)
                .and_then(|u| reqwest::Url::parse(u).ok())
                .and_then(|u| {
                    u.query_pairs()
                        .find(|(k, _)| k == "preview_token")
                        .map(|(_, v)| v.into_owned())
                });
            vec![Created {
                token,
                ..entry(Kind::Preview, format!("/previews/{id}/"), sandbox)
            }]
        }
        _ => Vec::new(),
    }
}

/// Whether an object is still there.
enum Seen {
    Gone,
    There,
    /// A session still `deleting` when the wait given to [`Ctx::seen`] ran out.
    StillDeleting,
    /// The target's answer says neither (the reason).
    Unknown(String),
}

impl<'a> Ctx<'a> {
    /// Adds what a successful create made to the ledger (once per object).
    pub(super) fn remember_created(&mut self, p: &Prepared, obs: &Observed) {
        for entry in created_by(p.method, &p.target, p.principal, obs) {
            if let Some(token) = &entry.token
                && !self.secrets.contains(token)
            {
                self.secrets.push(token.clone());
            }
            if !self.ledger.iter().any(|c| c.path == entry.path) {
                self.ledger.push(entry);
            }
        }
    }

    /// A GET of `path` as `principal` (or, for a preview, anonymously with its token).
    fn probe(&self, c: &Created, method: Method) -> Prepared {
        let mut headers = Vec::new();
        let principal = match (c.kind, &c.token) {
            (Kind::Preview, Some(token)) => {
                headers.push(("X-Preview-Token".to_owned(), token.clone()));
                Principal::Anonymous
            }
            _ => c.principal,
        };
        Prepared {
            envd_host: None,
            via: Via::Primary,
            method,
            target: c.path.clone(),
            principal,
            headers,
            literal_auth: false,
            body: None,
        }
    }

    /// Looks at ledger entry `i`, waiting up to `deleting_for` for a session in state
    /// `deleting` to go.
    async fn seen(&mut self, i: usize, deleting_for: Duration) -> Seen {
        let client = self.target.client.clone();
        let kind = self.ledger[i].kind;
        let get = self.probe(&self.ledger[i], Method::Get);
        let waited = Instant::now();
        loop {
            let obs = match self.send(&client, &get, LEAK_CHECK).await {
                Ok(obs) => obs,
                Err(StepError::Fail(r) | StepError::Error(r)) => return Seen::Unknown(r),
                Err(StepError::Var(e)) => return Seen::Unknown(e.to_string()),
            };
            return match (kind, obs.status) {
                (Kind::Preview, 403) | (_, 404) => Seen::Gone,
                (Kind::Preview, _) => Seen::There,
                // A session being deleted goes on its own, shortly.
                (Kind::Session, 200)
                    if obs.json().ok().and_then(|j| {
                        j.get("state").and_then(Value::as_str).map(str::to_owned)
                    }) == Some("deleting".into()) =>
                {
                    if waited.elapsed() >= deleting_for {
                        return Seen::StillDeleting;
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    continue;
                }
                (_, 200) => Seen::There,
                (_, status) => Seen::Unknown(format!("GET {}: status {status}", get.target)),
            };
        }
    }

    /// The `leak check`: every object in the ledger must be gone. Leftovers fail the
    /// scenario, named; the sweep then removes them, newest first, and confirms each is gone.
    pub(super) async fn leak_check(&mut self) -> Outcome {
        let mut left = Vec::new();
        let mut unknown = Vec::new();
        // Sessions that stayed `deleting` through the whole wait: the sweep's delete of one
        // changes nothing (SES-8.7), so it is not waited for a second time.
        let mut stuck = Vec::new();
        for i in 0..self.ledger.len() {
            match self.seen(i, SESSION_GONE_WITHIN).await {
                Seen::Gone => {}
                Seen::There => left.push(i),
                Seen::StillDeleting => {
                    left.push(i);
                    stuck.push(i);
                }
                Seen::Unknown(reason) => {
                    unknown.push(format!("{} ({reason})", self.ledger[i].path))
                }
            }
        }
        if left.is_empty() && unknown.is_empty() {
            return Outcome::Pass;
        }
        let named: Vec<String> = left
            .iter()
            .filter(|&&i| !self.ledger[i].by_sweep)
            .map(|&i| self.ledger[i].path.clone())
            .collect();
        // Newest first, so that a sandbox cloned from a snapshot goes before the snapshot.
        for &i in left.iter().rev() {
            self.remove(i).await;
        }
        // Processes and previews go with their sandboxes: look again at everything.
        let mut not_removed = Vec::new();
        for &i in &left {
            let wait = if stuck.contains(&i) {
                Duration::ZERO
            } else {
                SESSION_GONE_WITHIN
            };
            let removed = matches!(self.seen(i, wait).await, Seen::Gone);
            let path = self.ledger[i].path.clone();
            self.note(format!(
                "sweep: {path} {}",
                if removed {
                    "removed"
                } else {
                    "could NOT be removed"
                }
            ));
            if !removed {
                not_removed.push(path.clone());
            }
            if !self.ledger[i].by_sweep {
                self.leftovers.push(Leftover { path, removed });
            }
        }
        if named.is_empty() && unknown.is_empty() && not_removed.is_empty() {
            return Outcome::Pass;
        }
        let mut reason = Vec::new();
        if !named.is_empty() {
            reason.push(format!("left behind after cleanup: {}", named.join(", ")));
        }
        if !unknown.is_empty() {
            reason.push(format!("could not confirm gone: {}", unknown.join(", ")));
        }
        if !not_removed.is_empty() {
            reason.push(format!(
                "the sweep could not remove: {}",
                not_removed.join(", ")
            ));
        }
        Outcome::Fail {
            step: LEAK_CHECK.into(),
            reason: reason.join("; "),
        }
    }

    /// Removes one leftover: sandboxes, snapshots and sessions are deleted; a process or a
    /// preview goes with its sandbox.
    async fn remove(&mut self, i: usize) {
        let client = self.target.client.clone();
        let c = &self.ledger[i];
        let path = match c.kind {
            Kind::Sandbox | Kind::Snapshot | Kind::Session => c.path.clone(),
            Kind::Process | Kind::Preview => match &c.sandbox {
                Some(sbx) => sbx.clone(),
                None => return,
            },
        };
        let label = if c.by_sweep {
            "removed_by_sweep"
        } else {
            "sweep"
        };
        let delete = Prepared {
            envd_host: None,
            via: Via::Primary,
            method: Method::Delete,
            target: path,
            principal: c.principal,
            headers: Vec::new(),
            literal_auth: false,
            body: None,
        };
        let _ = self.send(&client, &delete, label).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn created(status: u16, body: Value) -> Observed {
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(
            reqwest::header::CONTENT_TYPE,
            "application/json".parse().unwrap(),
        );
        Observed {
            status,
            headers,
            body: body.to_string().into(),
        }
    }

    fn paths(method: Method, target: &str, obs: &Observed) -> Vec<(Kind, String, Option<String>)> {
        created_by(method, target, Principal::Owner, obs)
            .into_iter()
            .map(|c| (c.kind, c.path, c.sandbox))
            .collect()
    }

    #[test]
    fn the_ledger_knows_e2b_creates_and_not_resumes() {
        let sbx = created(201, serde_json::json!({"sandboxID": "abc1"}));
        for create in ["/sandboxes", "/v2/sandboxes"] {
            assert_eq!(
                paths(Method::Post, create, &sbx),
                [(Kind::Sandbox, "/sandboxes/abc1".into(), None)]
            );
        }
        assert!(paths(Method::Post, "/sandboxes/abc1/connect", &sbx).is_empty());
        assert!(paths(Method::Post, "/sandboxes/abc1/resume", &sbx).is_empty());
    }

    #[test]
    fn the_ledger_knows_every_kind_of_creation() {
        let sbx = created(201, serde_json::json!({"id": "local:sbx_1"}));
        assert_eq!(
            paths(Method::Post, "/v1/sandboxes", &sbx),
            [(Kind::Sandbox, "/v1/sandboxes/local:sbx_1".into(), None)]
        );
        let snp = created(201, serde_json::json!({"id": "local:snp_1"}));
        assert_eq!(
            paths(Method::Post, "/v1/sandboxes/local:sbx_1/snapshots", &snp),
            [(Kind::Snapshot, "/v1/snapshots/local:snp_1".into(), None)]
        );
        let prc = created(201, serde_json::json!({"id": "local:prc_1"}));
        assert_eq!(
            paths(Method::Post, "/v1/sandboxes/local:sbx_1/processes", &prc),
            [(
                Kind::Process,
                "/v1/processes/local:prc_1".into(),
                Some("/v1/sandboxes/local:sbx_1".into())
            )]
        );
        let prv = created(
            201,
            serde_json::json!({"id": "prv_1", "url": "http://h/previews/prv_1/?preview_token=tok"}),
        );
        let entries = created_by(
            Method::Post,
            "/v1/sandboxes/s/previews",
            Principal::Owner,
            &prv,
        );
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].path, "/previews/prv_1/");
        assert_eq!(entries[0].token.as_deref(), Some("tok"));
        let owned = created(
            201,
            serde_json::json!({"id": "ses_1", "sandbox_id": "local:sbx_2", "sandbox_ownership": "owned"}),
        );
        assert_eq!(
            paths(Method::Post, "/v1/sessions", &owned),
            [
                (Kind::Session, "/v1/sessions/ses_1".into(), None),
                (Kind::Sandbox, "/v1/sandboxes/local:sbx_2".into(), None)
            ]
        );
        let borrowed = created(
            201,
            serde_json::json!({"id": "ses_2", "sandbox_id": "local:sbx_1", "sandbox_ownership": "borrowed"}),
        );
        assert_eq!(
            paths(Method::Post, "/v1/sessions", &borrowed),
            [(Kind::Session, "/v1/sessions/ses_2".into(), None)]
        );
        // Not a creation: another status, another method, another path, no id.
        assert!(
            paths(
                Method::Post,
                "/v1/sandboxes",
                &created(200, serde_json::json!({"id": "x"}))
            )
            .is_empty()
        );
        assert!(paths(Method::Get, "/v1/sandboxes", &sbx).is_empty());
        assert!(paths(Method::Post, "/v1/sandboxes/s/connections", &sbx).is_empty());
        assert!(
            paths(
                Method::Post,
                "/v1/sandboxes",
                &created(201, serde_json::json!({}))
            )
            .is_empty()
        );
    }
}
