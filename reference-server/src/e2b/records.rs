//! What the E2B surface keeps in the `/v1` records it shares with the rest of the server: the
//! `e2b` object of a sandbox's body, and a snapshot's E2B name and whether sandboxes made from
//! it serve the code interpreter; with the lookups by them that the control plane, the
//! templates and envd all make. It imports no other file of `e2b` but `ids`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::api::error::ApiError;
use crate::api::sandboxes::list_matching;
use crate::api::state::AppState;
use crate::store::{Kind, ListQuery, Record, Scope};

use super::ids;

/// What the E2B surface keeps in a sandbox record's body.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct E2bState {
    pub secure: bool,
    /// The envd access token of a secure sandbox (returned to its team, checked by envd).
    pub access_token: Option<String>,
    /// `allow_internet_access` as the create asked for it (`None`: not asked).
    #[serde(default)]
    pub allow_internet_access: Option<bool>,
    /// The egress configuration the sandbox was created or last updated with (`None`: none).
    #[serde(default)]
    pub network: Option<Value>,
    /// Made from the code interpreter's template (or a snapshot or fork of such a sandbox):
    /// it serves the code interpreter on its port 49999.
    #[serde(default)]
    pub code_interpreter: bool,
}

pub fn e2b_state(rec: &Record) -> E2bState {
    rec.body
        .get("e2b")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default()
}

pub fn provider_names(state: &AppState) -> Vec<String> {
    state
        .config
        .providers
        .iter()
        .map(|p| p.name.clone())
        .collect()
}

/// The name a snapshot was given through E2B, if any.
pub fn name_of(rec: &Record) -> Option<&str> {
    rec.body.get("e2b_name").and_then(Value::as_str)
}

/// The snapshot of the team `principal` that `template` names: its E2B snapshot ID, its
/// name, or its full name (`<team>/<name>` with or without `:default`). Another team's is
/// not found.
pub async fn snapshot_named(
    state: &AppState,
    principal: &str,
    template: &str,
) -> Result<Option<String>, ApiError> {
    if let Some(qualified) = ids::snapshot_from_e2b(&provider_names(state), template) {
        return Ok(state
            .store
            .get(Kind::Snapshot, Scope::Owner(principal), &qualified)
            .await?
            .map(|r| r.id));
    }
    let bare = template.strip_suffix(":default").unwrap_or(template);
    let bare = bare.strip_prefix(&format!("{principal}/")).unwrap_or(bare);
    let q = ListQuery::new(Kind::Snapshot, Scope::Owner(principal));
    let found = list_matching(state, q, 1, |r| name_of(r) == Some(bare)).await?;
    Ok(found.into_iter().next().map(|r| r.id))
}

/// Whether sandboxes made from the snapshot (a qualified ID) serve the code interpreter: it
/// was taken of a sandbox that did. Its kernels are not in it (files only).
pub async fn serves_code_interpreter(state: &AppState, snapshot: &str) -> Result<bool, ApiError> {
    Ok(state
        .store
        .get(Kind::Snapshot, Scope::System, snapshot)
        .await?
        .is_some_and(|r| r.body.get("e2b_code_interpreter") == Some(&Value::Bool(true))))
}
