//! `absent`: an independent check that an object is gone: a fresh client, GET by path
//! expecting 404 `not_found`, and the ID in no page of its list.

use serde_json::Value;

use super::StepKind;
use crate::engine::context::{Ctx, Prepared, StepError};
use crate::scenario::{Absent, Method, Principal, Via};

impl StepKind for Absent {
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
