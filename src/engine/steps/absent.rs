//! `absent`: an independent check that an object is gone: a fresh client, GET by path
//! expecting 404 `not_found`, and the ID in no page of its list.

use serde_json::Value;

use serde::Deserialize;

use super::kind::{StepKind, named};
use crate::engine::context::{Ctx, Prepared, StepError};
use crate::scenario::{CheckCtx, Checker, Method, Principal, Scope, Template, Via};

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

impl StepKind for Absent {
    fn label(&self) -> String {
        named(self.name.as_deref(), || "absent".to_owned())
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        c.principal(self.principal, self.path.pos, ctx);
        for t in [&self.path, &self.list, &self.id] {
            c.template(t, scope, ctx);
        }
    }

    fn uses_admin(&self) -> bool {
        self.principal == Principal::Admin
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        ctx.absent(self, label).await
    }
}

impl Ctx<'_> {
    async fn absent(&mut self, a: &Absent, label: &str) -> Result<(), StepError> {
        let path = self.vars.render(&a.path)?;
        let list = self.vars.render(&a.list)?;
        let id = self.vars.render(&a.id)?;
        // A fresh client: no pooled connection or cache can hide the object's state.
        let client = self
            .target
            .fresh_client()
            .map_err(|e| StepError::Error(e.to_string()))?;
        let p = Prepared {
            envd_host: None,
            via: Via::Primary,
            method: Method::Get,
            target: path.clone(),
            principal: a.principal,
            headers: Vec::new(),
            literal_auth: false,
            body: None,
        };
        let obs = self.send(&client, &p, label).await?;
        let mut failures = Vec::new();
        if obs.status != 404 {
            failures.push(format!("GET {path}: status {}, expected 404", obs.status));
        } else if obs
            .json()
            .ok()
            .and_then(|j| j.get("code").and_then(Value::as_str).map(str::to_owned))
            .as_deref()
            != Some("not_found")
        {
            failures.push(format!("GET {path}: 404 without problem code `not_found`"));
        }
        let ids = self.list_ids(&client, a.principal, &list, label).await?;
        if ids.contains(&id) {
            failures.push(format!("{id} is still listed by GET {list}"));
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(StepError::Fail(failures.join("; ")))
        }
    }
}
