//! `digest` and `expect_digest_unchanged`: the reference target's durable-state digest
//! (an admin-only test endpoint), taken and compared.

use serde_json::Value;

use serde::Deserialize;

use super::kind::{StepKind, named};
use crate::engine::context::{Ctx, Prepared, StepError};
use crate::scenario::{CheckCtx, Checker, Located, Method, Pos, Principal, Scope, SinceName, Via};

/// Record `GET /v1/test/digest` (needs `test_controls`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Digest {
    /// A short name for messages, the transcript and `fails_at`.
    #[serde(default)]
    pub name: Option<String>,
    pub into: Located<String>,
}

/// Compare the durable-state digest against the one an earlier `digest` step took.
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct ExpectDigestUnchanged(pub SinceName);

/// How long a digest scenario holds background expiry at most: released after its cleanup
/// (`engine::run`), and ending by itself if the runner never gets that far.
const HOLD_EXPIRY_S: u64 = 300;

impl StepKind for Digest {
    fn label(&self) -> String {
        named(self.name.as_deref(), || "digest".to_owned())
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        // The digest is a test control read with the admin token, and a comparison holds
        // background expiry so that only the scenario's own requests count.
        let missing: Vec<&str> = ["test_controls", "expiry_hold", "admin_token"]
            .into_iter()
            .filter(|c| !ctx.requires.contains(c))
            .collect();
        if !missing.is_empty() {
            c.err(
                Pos::of(&self.into),
                format!(
                    "a `digest` step needs `requires: [test_controls, expiry_hold, admin_token]` (missing: {})",
                    missing.join(", ")
                ),
            );
        }
        scope.digests.insert(self.into.value.clone());
    }

    fn uses_admin(&self) -> bool {
        true
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        if !ctx.expiry_held {
            ctx.hold_expiry(HOLD_EXPIRY_S, label).await?;
            ctx.expiry_held = true;
        }
        let digest = ctx.digest(label).await?;
        ctx.digests.insert(self.into.value.clone(), digest);
        Ok(())
    }
}

/// `expect_digest_unchanged`: the digest equals the one taken under `since`.
impl StepKind for ExpectDigestUnchanged {
    fn label(&self) -> String {
        named(self.0.name.as_deref(), || {
            "expect_digest_unchanged".to_owned()
        })
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        let since = &self.0.since;
        if ctx.cleanup {
            c.err(
                Pos::of(since),
                format!(
                    "`expect_digest_unchanged` cannot be a cleanup step: digest `{}` may never have been taken (steps stop at the first failure, every cleanup step runs)",
                    since.value
                ),
            );
        } else if !scope.digests.contains(&since.value) {
            c.err(
                Pos::of(since),
                format!("no earlier `digest` named `{}`", since.value),
            );
        }
    }

    fn uses_admin(&self) -> bool {
        true
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        let since = &self.0;
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
    /// `POST /v1/test/expiry_hold` (TC-9.11): background expiry waits `hold_s` seconds (0
    /// releases it), so that a digest comparison sees only what the scenario did.
    pub(in crate::engine) async fn hold_expiry(
        &mut self,
        hold_s: u64,
        label: &str,
    ) -> Result<(), StepError> {
        let body = serde_json::to_vec(&serde_json::json!({ "hold_s": hold_s }))
            .expect("a JSON object serializes");
        let p = Prepared {
            envd_host: None,
            via: Via::Primary,
            method: Method::Post,
            target: "/v1/test/expiry_hold".into(),
            principal: Principal::Admin,
            headers: Vec::new(),
            literal_auth: false,
            body: Some((body, "application/json".into())),
        };
        let client = self.target.client.clone();
        let obs = self.send(&client, &p, label).await?;
        if obs.status == 204 {
            Ok(())
        } else {
            Err(StepError::Fail(format!(
                "POST /v1/test/expiry_hold {{\"hold_s\":{hold_s}}}: status {}, expected 204",
                obs.status
            )))
        }
    }

    async fn digest(&mut self, label: &str) -> Result<String, StepError> {
        let p = Prepared {
            envd_host: None,
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
