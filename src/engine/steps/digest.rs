//! `digest` and `expect_digest_unchanged`: the reference target's durable-state digest
//! (an admin-only test endpoint), taken and compared.

use serde_json::Value;

use super::StepKind;
use crate::engine::context::{Ctx, Prepared, StepError};
use crate::scenario::{Digest, Method, Principal, SinceName, Via};

impl StepKind for Digest {
    const KIND: &'static str = "digest";

    fn uses_admin(&self) -> bool {
        true
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        let digest = ctx.digest(label).await?;
        ctx.digests.insert(self.into.value.clone(), digest);
        Ok(())
    }
}

/// `expect_digest_unchanged`: the digest equals the one taken under `since`.
pub(super) struct Unchanged<'s>(pub(super) &'s SinceName);

impl StepKind for Unchanged<'_> {
    const KIND: &'static str = "expect_digest_unchanged";

    fn uses_admin(&self) -> bool {
        true
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        let since = self.0;
        let now = ctx.digest(label).await?;
        let before = &ctx.digests[&since.since.value];
        if &now == before {
            Ok(())
        } else {
            Err(StepError::Fail(format!(
                "durable-state digest changed since `{}`",
                since.since.value
            )))
        }
    }
}

impl Ctx<'_> {
    async fn digest(&mut self, label: &str) -> Result<String, StepError> {
        let p = Prepared {
            via: Via::Primary,
            method: Method::Get,
            target: "/v1/test/digest".into(),
            principal: Principal::Admin,
            headers: Vec::new(),
            literal_auth: false,
            body: None,
        };
        let client = self.target.client.clone();
        let obs = self.send(&client, &p, label).await?;
        if obs.status != 200 {
            return Err(StepError::Fail(format!(
                "GET /v1/test/digest: status {}",
                obs.status
            )));
        }
        obs.json()
            .ok()
            .and_then(|j| j.get("digest").and_then(Value::as_str).map(str::to_owned))
            .ok_or_else(|| StepError::Fail("GET /v1/test/digest: no `digest` string".into()))
    }
}
