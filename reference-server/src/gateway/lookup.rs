//! The caller's sessions, submissions, operations and artifacts by ID, for the handlers: a
//! malformed, unknown and foreign ID are the same 404.

use serde::de::DeserializeOwned;

use crate::api::ApiError;
use crate::store::{Kind, Record, Scope};

use super::artifacts::ArtifactDoc;
use super::core::{Gateway, Loaded, decode};
use super::http::ApiResult;
use super::model::{OperationDoc, SubmissionDoc, plausible_id};

/// The caller's session, or 404 (malformed, unknown and foreign alike).
pub async fn owned_session(gw: &Gateway, principal: &str, sid: &str) -> ApiResult<Loaded> {
    if !plausible_id(sid, "ses_") {
        return Err(ApiError::NotFound);
    }
    gw.session(Scope::Owner(principal), sid)
        .await?
        .ok_or(ApiError::NotFound)
}

/// The caller's object of `kind` whose IDs start with `prefix`, decoded, or 404.
async fn owned<T: DeserializeOwned>(
    gw: &Gateway,
    kind: Kind,
    prefix: &str,
    principal: &str,
    id: &str,
) -> ApiResult<(Record, T)> {
    if !plausible_id(id, prefix) {
        return Err(ApiError::NotFound);
    }
    let rec = gw
        .state
        .store
        .get(kind, Scope::Owner(principal), id)
        .await?
        .ok_or(ApiError::NotFound)?;
    let doc = decode(&rec)?;
    Ok((rec, doc))
}

/// The caller's submission, or 404.
pub async fn owned_submission(
    gw: &Gateway,
    principal: &str,
    id: &str,
) -> ApiResult<(Record, SubmissionDoc)> {
    owned(gw, Kind::Submission, "sub_", principal, id).await
}

/// The caller's operation, or 404.
pub async fn owned_operation(
    gw: &Gateway,
    principal: &str,
    id: &str,
) -> ApiResult<(Record, OperationDoc)> {
    owned(gw, Kind::Operation, "op_", principal, id).await
}

/// The caller's artifact, or 404.
pub async fn owned_artifact(
    gw: &Gateway,
    principal: &str,
    id: &str,
) -> ApiResult<(Record, ArtifactDoc)> {
    owned(gw, Kind::Artifact, "art_", principal, id).await
}
