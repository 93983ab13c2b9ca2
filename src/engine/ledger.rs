//! The scenario's ledger of what it created, and the `leak check` that ends every scenario:
//! after cleanup, each object the scenario created must be gone. What is still there fails
//! the scenario, named; the sweep then removes it and confirms it is gone (404).
//!
//! The ledger is filled from the target's own answers to the scenario's requests, as the
//! run's profile recognises creations in them (`/v1`: sandboxes, snapshots, processes,
//! previews, sessions and the sandboxes sessions create for themselves; E2B: sandboxes), so
//! it names only objects this scenario created. Connections, submissions, operations and
//! artifacts live inside a sandbox or a session and go with it.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::context::{Ctx, Prepared, StepError};
use super::created::Created;
use crate::engine::outcome::Outcome;
// How long the leak check waits for a session in state `deleting` to go: the sweep's wait.
use crate::live::{Leftover, SESSION_GONE_WITHIN};
use crate::profile::CreatedKind as Kind;
use crate::scenario::{Method, Principal, Via};

/// The step name under which leftovers fail a scenario.
pub const LEAK_CHECK: &str = "leak check";

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
    /// A GET of `path` as `principal` (or, for a preview, anonymously with its token).
    fn probe(&self, c: &Created, method: Method) -> Prepared {
        let mut headers = Vec::new();
        let principal = match (c.creation.kind, &c.creation.token) {
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
            target: c.creation.path.clone(),
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
        let kind = self.ledger[i].creation.kind;
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
                    unknown.push(format!("{} ({reason})", self.ledger[i].creation.path))
                }
            }
        }
        if left.is_empty() && unknown.is_empty() {
            return Outcome::Pass;
        }
        let named: Vec<String> = left
            .iter()
            .filter(|&&i| !self.ledger[i].by_sweep)
            .map(|&i| self.ledger[i].creation.path.clone())
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
            let path = self.ledger[i].creation.path.clone();
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
        let path = match c.creation.kind {
            Kind::Sandbox | Kind::Snapshot | Kind::Session => c.creation.path.clone(),
            Kind::Process | Kind::Preview => match &c.creation.sandbox {
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
