//! Resolving client-supplied IDs to stored records, always through the caller's ownership.
//!
//! A malformed ID, an unknown provider, a missing object and another principal's object all
//! give the same 404: the caller cannot tell them apart.

use crate::defects::Defect;
use crate::domain::QualifiedId;
use crate::store::{Kind, Record, Scope};

use super::error::ApiError;
use super::state::AppState;

/// The stored IDs a client-supplied provider-qualified ID may name: the ID itself, or for a
/// bare ID, the default provider's.
fn candidates(state: &AppState, raw: &str) -> Result<Vec<String>, ApiError> {
    let (id, bare) =
        QualifiedId::parse(raw, state.providers.default_name()).map_err(|_| ApiError::NotFound)?;
    if state.providers.get(&id.provider).is_none() {
        return Err(ApiError::NotFound);
    }
    if bare && state.config.defects.has(Defect::BareIdAnyProvider) {
        return Ok(state
            .config
            .providers
            .iter()
            .map(|p| QualifiedId::new(&p.name, &id.local).to_string())
            .collect());
    }
    Ok(vec![id.to_string()])
}

/// The first of `ids` visible in `scope`; 404 otherwise.
async fn first_visible(
    state: &AppState,
    kind: Kind,
    scope: Scope<'_>,
    ids: &[String],
) -> Result<Record, ApiError> {
    for id in ids {
        if let Some(rec) = state.store.get(kind, scope, id).await? {
            return Ok(rec);
        }
    }
    if state.config.defects.has(Defect::ForeignObject403) {
        for id in ids {
            if state.store.get(kind, Scope::System, id).await?.is_some() {
                return Err(ApiError::PermissionDenied);
            }
        }
    }
    Err(ApiError::NotFound)
}

/// A provider-qualified object (sandbox, process, snapshot) of the caller's.
pub async fn qualified(
    state: &AppState,
    kind: Kind,
    principal: &str,
    raw: &str,
) -> Result<Record, ApiError> {
    qualified_in(state, kind, Scope::Owner(principal), raw).await
}

/// A provider-qualified object visible in `scope`. Handlers pass the caller as the owner;
/// only the defects that skip that check (`foreign-object-visible`, `file-list-skips-auth`,
/// `process-output-skips-auth`) pass `Scope::System`.
pub async fn qualified_in(
    state: &AppState,
    kind: Kind,
    scope: Scope<'_>,
    raw: &str,
) -> Result<Record, ApiError> {
    let ids = candidates(state, raw)?;
    first_visible(state, kind, scope, &ids).await
}

/// The sandbox a kill names. Honest: exactly the qualified ID. With `kill-ignores-provider`,
/// the local ID is looked up in every provider and the first match wins.
pub async fn sandbox_for_kill(
    state: &AppState,
    principal: &str,
    raw: &str,
) -> Result<Record, ApiError> {
    let mut ids = candidates(state, raw)?;
    if state.config.defects.has(Defect::KillIgnoresProvider)
        && let Ok((id, _)) = QualifiedId::parse(raw, state.providers.default_name())
    {
        ids = state
            .config
            .providers
            .iter()
            .map(|p| QualifiedId::new(&p.name, &id.local).to_string())
            .collect();
    }
    first_visible(state, Kind::Sandbox, Scope::Owner(principal), &ids).await
}

/// An object with an unqualified ID (connection, preview) of the caller's.
pub async fn plain(
    state: &AppState,
    kind: Kind,
    principal: &str,
    id: &str,
) -> Result<Record, ApiError> {
    let valid = !id.is_empty()
        && id.len() <= 128
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !valid {
        return Err(ApiError::NotFound);
    }
    first_visible(state, kind, Scope::Owner(principal), &[id.to_owned()]).await
}

/// Splits a stored qualified ID into provider and local ID.
pub fn split(id: &str) -> Result<(&str, &str), ApiError> {
    id.split_once(':')
        .ok_or_else(|| ApiError::internal(format!("stored id without provider: {id}")))
}
