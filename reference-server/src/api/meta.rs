//! Health, capabilities, and the test controls (§9).

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use crate::domain::IdKind;

use super::error::ApiError;
use super::extract::{Admin, Caller, Json, Path};
use super::state::AppState;

pub async fn health(State(state): State<AppState>) -> Result<Response, ApiError> {
    state.store.ping().await?;
    Ok(axum::Json(json!({"status": "ok"})).into_response())
}

pub async fn capabilities(
    State(state): State<AppState>,
    _caller: Caller,
) -> Result<Response, ApiError> {
    // In configuration order: the first is the default.
    let providers: Vec<_> = state
        .config
        .providers
        .iter()
        .filter_map(|p| state.providers.get(&p.name))
        .map(|p| {
            let capacity = p.capacity();
            json!({
                "name": p.name(),
                "default": p.name() == state.providers.default_name(),
                "capacity": {"cpu": capacity.cpu, "memory_mb": capacity.memory_mb},
                "isolation": p.isolation_report(),
            })
        })
        .collect();
    let mut features = vec!["pause", "snapshots", "previews", "sessions"];
    // Workers answer `agent.model` from the fixture scripts only when no real model endpoint
    // (or model override) is configured: then scripted session scenarios apply (§8.12).
    let gateway = &state.config.gateway;
    if gateway.model_base_url.is_none() && gateway.model_override.is_none() {
        features.push("fixture_models");
    }
    if state.config.test_controls && state.config.admin_token.is_some() {
        features.extend(["test_controls", "expiry_hold", "test_clock"]);
    }
    let l = &state.config.limits;
    let r = &state.config.retention;
    Ok(axum::Json(json!({
        "api_version": "v1",
        "server": {"name": "sandspec-reference", "version": env!("CARGO_PKG_VERSION")},
        "providers": providers,
        // The default provider's, which is what a sandbox created without `provider` gets.
        "isolation": state.providers.get(state.providers.default_name()).map(|p| p.isolation_report()),
        "features": features,
        "limits": {
            "max_body_bytes": l.max_body_bytes,
            "max_file_bytes": l.max_file_bytes,
            "default_page_size": l.default_page_size,
            "max_page_size": l.max_page_size,
            "max_streams_per_principal": l.max_streams_per_principal,
            "heartbeat_interval_s": l.heartbeat_interval_s,
            "max_stream_duration_s": l.max_stream_duration_s,
            "max_sandboxes_per_principal": l.max_sandboxes_per_principal,
            "max_timeout_s": l.max_timeout_s,
            "default_timeout_s": l.default_timeout_s,
            "max_queue_depth": l.max_queue_depth,
            "max_process_output_bytes": l.max_process_output_bytes,
        },
        "retention": {
            "process_output_s": r.process_output_s,
            "result_s": r.result_s,
            "events_s": r.events_s,
            "idempotency_s": r.idempotency_s,
        },
    }))
    .into_response())
}

pub async fn digest(State(state): State<AppState>, _admin: Admin) -> Result<Response, ApiError> {
    let digest = state.store.digest().await?;
    Ok(axum::Json(json!({ "digest": digest })).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateDelay {
    delay_ms: u64,
}

pub async fn create_delay(
    State(state): State<AppState>,
    _admin: Admin,
    Path(name): Path<String>,
    body: Json<CreateDelay>,
) -> Result<Response, ApiError> {
    let provider = state.providers.get(&name).ok_or(ApiError::NotFound)?;
    provider.set_create_delay(Duration::from_millis(body.value.delay_ms));
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HoldExpiry {
    hold_s: u64,
}

/// Longest hold one request may ask for (TC-9.11).
const MAX_HOLD_S: u64 = 3600;

/// TC-9.11: holds background expiry for `hold_s` seconds (0 releases it).
pub async fn expiry_hold(
    State(state): State<AppState>,
    _admin: Admin,
    body: Json<HoldExpiry>,
) -> Result<Response, ApiError> {
    let hold_s = body.value.hold_s;
    if hold_s > MAX_HOLD_S {
        return Err(ApiError::invalid(
            "hold_s",
            format!("hold_s must be at most {MAX_HOLD_S}"),
        ));
    }
    state.expiry_hold.set(Duration::from_secs(hold_s)).await;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdvanceClock {
    advance_ms: u64,
}

/// Longest move one request may ask for (TC-9.12): a day.
const MAX_ADVANCE_MS: u64 = 86_400_000;

/// How far ahead of real time the clock may be moved in all: a year.
const MAX_OFFSET_MS: u64 = 366 * MAX_ADVANCE_MS;

/// TC-9.12: moves the clock expiry is decided by forward by `advance_ms`, and wakes the
/// background passes that act on what came due.
pub async fn advance_clock(_admin: Admin, body: Json<AdvanceClock>) -> Result<Response, ApiError> {
    let advance_ms = body.value.advance_ms;
    if !(1..=MAX_ADVANCE_MS).contains(&advance_ms) {
        return Err(ApiError::invalid(
            "advance_ms",
            format!("advance_ms must be from 1 to {MAX_ADVANCE_MS}"),
        ));
    }
    let ahead_ms = u64::try_from(crate::clock::offset().as_millis()).unwrap_or(u64::MAX);
    if ahead_ms.saturating_add(advance_ms) > MAX_OFFSET_MS {
        return Err(ApiError::invalid(
            "advance_ms",
            format!(
                "the clock is {ahead_ms} ms ahead already; it may be at most {MAX_OFFSET_MS} ms ahead"
            ),
        ));
    }
    let offset = crate::clock::advance(Duration::from_millis(advance_ms));
    let offset_ms = u64::try_from(offset.as_millis()).unwrap_or(u64::MAX);
    Ok(axum::Json(json!({ "offset_ms": offset_ms })).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
enum LocalIdKind {
    Sandbox,
    Snapshot,
    Process,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NextLocalId {
    kind: LocalIdKind,
    local_id: String,
}

pub async fn next_local_id(
    State(state): State<AppState>,
    _admin: Admin,
    Path(name): Path<String>,
    body: Json<NextLocalId>,
) -> Result<Response, ApiError> {
    let provider = state.providers.get(&name).ok_or(ApiError::NotFound)?;
    let NextLocalId { kind, local_id } = body.value;
    let kind = match kind {
        LocalIdKind::Sandbox => IdKind::Sandbox,
        LocalIdKind::Snapshot => IdKind::Snapshot,
        LocalIdKind::Process => IdKind::Process,
    };
    let valid = local_id.starts_with(kind.prefix())
        && local_id.len() <= 128
        && local_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !valid {
        return Err(ApiError::invalid(
            "local_id",
            format!("local_id must start with `{}`", kind.prefix()),
        ));
    }
    provider.set_next_local_id(kind, local_id);
    Ok(StatusCode::NO_CONTENT.into_response())
}
