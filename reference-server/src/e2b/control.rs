//! E2B's control plane over this server's sandboxes: create, list, get, kill, timeout,
//! refresh, pause, resume and connect, authenticated by `X-API-Key` (a principal's token),
//! with E2B's error body `{code, message}`.
//!
//! The sandbox records are the `/v1` ones; the E2B surface adds an `e2b` object to the record
//! body (whether the sandbox is secure, its envd access token) and speaks E2B's shapes and
//! status codes over them. Another team's sandbox is always 404, never 403.

use std::collections::BTreeMap;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use time::OffsetDateTime;

use crate::api::error::ApiError;
use crate::api::extract::{Path, QueryPairs};
use crate::api::idempotency::{self, Created, IdemRequest};
use crate::api::pagination::PageRequest;
use crate::api::sandboxes::{
    destroy, list_matching, pause_sandbox, sandbox_of, secs, store_into, update_sandbox,
    validate_env, validate_metadata,
};
use crate::api::state::AppState;
use crate::clock::now;
use crate::config::Scope as Needed;
use crate::defects::Defect;
use crate::domain::new_token;
use crate::domain::{IdKind, OnTimeout, Owner, QualifiedId, Resources, Sandbox, SandboxState};
use crate::store::{Kind, ListQuery, Record, Scope};

use super::ids;
use super::interpreter;
use super::records::{
    E2bState, e2b_state, provider_names, serves_code_interpreter, snapshot_named,
};

/// The envd version this server's envd surface answers as. It decides which features the
/// SDK uses: stdin (0.3.0), the default user (0.4.0), closing stdin (0.5.2), octet-stream
/// uploads (0.5.7), file metadata as extended attributes (0.6.2), entry info in watch events
/// (0.6.3) and watching with network mounts allowed (0.6.4) are all served.
pub const ENVD_VERSION: &str = "0.6.4";
/// The only template: the same one `/v1` serves.
const TEMPLATE: &str = "base";
/// What E2B calls `clientID` (deprecated upstream, still required in its responses).
const CLIENT_ID: &str = "sandspec-reference";
/// E2B's list page size: default and maximum (`paginationLimit` in the upstream spec).
const PAGE_LIMIT: u32 = 100;
/// The longest refresh E2B accepts, in seconds (`/sandboxes/{id}/refreshes`).
const MAX_REFRESH_S: u64 = 3600;
/// The disk size reported for every sandbox: a directory on the host has no quota of its own.
const DISK_SIZE_MB: u64 = 0;

/// An error of the E2B control plane: the status and E2B's `{code, message}` body.
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    fn not_found(id: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("sandbox \"{id}\" not found"))
    }

    fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = json!({"code": self.status.as_u16(), "message": self.message});
        (self.status, Json(body)).into_response()
    }
}

impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> Self {
        let status = match &e {
            ApiError::Unauthenticated => StatusCode::UNAUTHORIZED,
            ApiError::PermissionDenied => StatusCode::FORBIDDEN,
            ApiError::NotFound | ApiError::PathNotFound => StatusCode::NOT_FOUND,
            ApiError::InvalidArgument { .. }
            | ApiError::InvalidPath
            | ApiError::InvalidPageToken => StatusCode::BAD_REQUEST,
            ApiError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::InvalidState(_) | ApiError::ProcessExited => StatusCode::CONFLICT,
            ApiError::QuotaExceeded(_) | ApiError::TooManyStreams { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::ResourcesUnsatisfiable(_) | ApiError::IdempotencyKeyReused => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            ApiError::IdempotencyKeyInUse => StatusCode::CONFLICT,
            ApiError::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(details) => {
                tracing::error!(error = %details, "internal error");
                return E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error");
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        E2bError::new(status, e.to_string())
    }
}

impl From<crate::store::StoreError> for E2bError {
    fn from(e: crate::store::StoreError) -> Self {
        ApiError::from(e).into()
    }
}

impl From<crate::sandbox::ProviderError> for E2bError {
    fn from(e: crate::sandbox::ProviderError) -> Self {
        ApiError::from(e).into()
    }
}

/// The team (principal) an E2B API key belongs to. `X-API-Key` is E2B's header; the
/// deprecated `Authorization: Bearer` form is accepted too. Reading needs the `read` scope,
/// everything else `write`.
#[derive(Debug, Clone)]
pub struct Team {
    pub principal: String,
}

impl FromRequestParts<AppState> for Team {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, E2bError> {
        let unauthenticated = || E2bError::new(StatusCode::UNAUTHORIZED, "invalid API key");
        let key = match parts.headers.get("x-api-key") {
            Some(v) => v.to_str().map_err(|_| unauthenticated())?.trim().to_owned(),
            // The defect: no key at all is taken as the first team's.
            None if parts.headers.get(header::AUTHORIZATION).is_none()
                && state.config.defects.has(Defect::E2bMissingKeyAccepted) =>
            {
                let first = state
                    .config
                    .principals
                    .first()
                    .ok_or_else(unauthenticated)?;
                return Ok(Team {
                    principal: first.name.clone(),
                });
            }
            None => {
                let value = parts
                    .headers
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .ok_or_else(|| {
                        E2bError::new(StatusCode::UNAUTHORIZED, "missing API key (X-API-Key)")
                    })?;
                match value.split_once(' ') {
                    Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => {
                        token.trim().to_owned()
                    }
                    _ => return Err(unauthenticated()),
                }
            }
        };
        let principal = state
            .config
            .principal_by_token(&key)
            .ok_or_else(unauthenticated)?;
        let needed = if parts.method == Method::GET || parts.method == Method::HEAD {
            Needed::Read
        } else {
            Needed::Write
        };
        if !principal.has_scope(needed) {
            return Err(E2bError::new(
                StatusCode::FORBIDDEN,
                "the API key may not do this",
            ));
        }
        Ok(Team {
            principal: principal.name.clone(),
        })
    }
}

/// A JSON body: empty means `{}`, anything else must parse as `T`.
pub fn body<T: DeserializeOwned + Default>(
    headers: &HeaderMap,
    raw: &Bytes,
) -> Result<T, E2bError> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    if !crate::api::extract::is_json(headers) {
        return Err(E2bError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "the body must be application/json",
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(raw);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            E2bError::bad_request(format!("invalid body: {inner}"))
        } else {
            E2bError::bad_request(format!("invalid body at {path}: {inner}"))
        }
    })
}

/// The E2B ID of a stored sandbox (records without one never reach these views).
pub fn e2b_id(state: &AppState, rec: &Record) -> String {
    ids::to_e2b(&provider_names(state), &rec.id).unwrap_or_default()
}

/// The caller's sandbox named by an E2B ID; 404 for a malformed, missing or foreign one.
pub async fn owned(state: &AppState, team: &Team, id: &str) -> Result<Record, E2bError> {
    let qualified =
        ids::from_e2b(&provider_names(state), id).ok_or_else(|| E2bError::not_found(id))?;
    if let Some(rec) = state
        .store
        .get(Kind::Sandbox, Scope::Owner(&team.principal), &qualified)
        .await?
    {
        return Ok(rec);
    }
    if state.config.defects.has(Defect::E2bForeignSandbox403)
        && state
            .store
            .get(Kind::Sandbox, Scope::System, &qualified)
            .await?
            .is_some()
    {
        return Err(E2bError::new(
            StatusCode::FORBIDDEN,
            format!("you do not have access to sandbox \"{id}\""),
        ));
    }
    Err(E2bError::not_found(id))
}

pub fn e2b_state_name(sandbox: &Sandbox) -> &'static str {
    match sandbox.state {
        SandboxState::Paused => "paused",
        _ => "running",
    }
}

/// The `domain` of a sandbox: the domain of the host this server was reached at, where envd is
/// served too, without E2B's `api.` label (the control plane is `api.<domain>` and a sandbox's
/// port `<port>-<id>.<domain>`). Null when the server was reached at an IP address, under
/// which no host name can be formed: the SDK then keeps the domain it was configured with.
fn domain(headers: &HeaderMap, state: &AppState) -> Value {
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| state.local_addr.to_string());
    let name = host
        .rsplit_once(':')
        .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
        .map_or(host.as_str(), |(name, _)| name);
    let literal = name.starts_with('[') || name.parse::<std::net::IpAddr>().is_ok();
    if literal {
        return Value::Null;
    }
    Value::String(host.strip_prefix("api.").unwrap_or(&host).to_owned())
}

/// What a sandbox here can honour of an egress configuration. Its network namespace has only
/// a loopback interface, so nothing outside the machine is reachable from it: what denies
/// traffic is honoured as asked, and what would let traffic out (`allowOut`, per-domain
/// `rules`, an egress proxy, `allow_internet_access: true`) or hides the sandbox behind a token
/// or a host mask cannot be, and is refused rather than stored and ignored. Without a network
/// namespace of its own (sandboxes on the host's network) nothing can be denied either.
/// Returns the configuration to store.
fn honourable_network(
    state: &AppState,
    allow_internet_access: Option<bool>,
    network: Option<&Value>,
) -> Result<Option<Value>, E2bError> {
    let network = match network {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) if m.is_empty() => None,
        Some(Value::Object(m)) => Some(m.clone()),
        Some(_) => return Err(E2bError::bad_request("network must be an object")),
    };
    if allow_internet_access == Some(true) {
        return Err(E2bError::bad_request(
            "allow_internet_access: true cannot be honoured: sandboxes here reach nothing outside this machine",
        ));
    }
    if let Some(m) = &network {
        for (key, value) in m {
            let empty = match value {
                Value::Null => true,
                Value::Array(a) => a.is_empty(),
                Value::Object(o) => o.is_empty(),
                Value::String(s) => s.is_empty(),
                _ => false,
            };
            match key.as_str() {
                "denyOut" => {
                    let entries = value.as_array().map(Vec::as_slice).unwrap_or_default();
                    if !value.is_array() || entries.iter().any(|e| !e.is_string()) {
                        return Err(E2bError::bad_request(
                            "network.denyOut is a list of strings",
                        ));
                    }
                }
                "allowPublicTraffic" if value == &Value::Bool(true) => {}
                "allowOut" | "rules" | "egressProxy" | "maskRequestHost" | "dnsServers"
                    if empty => {}
                other => {
                    return Err(E2bError::bad_request(format!(
                        "network.{other} cannot be honoured: sandboxes here reach nothing outside this machine, and their ports only through envd"
                    )));
                }
            }
        }
    }
    let denies = allow_internet_access == Some(false) || network.is_some();
    if denies {
        let provider = state
            .providers
            .get(state.providers.default_name())
            .ok_or_else(|| ApiError::internal("no default provider"))?;
        if provider.isolation_report().network != "loopback" {
            return Err(E2bError::bad_request(
                "egress cannot be denied here: sandboxes share the host's network (no network namespace)",
            ));
        }
    }
    Ok(network.map(Value::Object))
}

/// E2B's `Sandbox` (create, resume, connect).
pub fn sandbox_view(
    state: &AppState,
    rec: &Record,
    headers: &HeaderMap,
) -> Result<Value, E2bError> {
    let sandbox = sandbox_of(rec)?;
    let e2b = e2b_state(rec);
    let mut out = json!({
        "templateID": sandbox.template,
        "sandboxID": e2b_id(state, rec),
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "trafficAccessToken": null,
        "domain": domain(headers, state),
    });
    if let Some(token) = e2b.access_token {
        out["envdAccessToken"] = Value::String(token);
    }
    Ok(out)
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// E2B's `ListedSandbox`; `detail` adds what `SandboxDetail` has on top.
fn listed_view(
    state: &AppState,
    rec: &Record,
    detail: Option<&HeaderMap>,
) -> Result<Value, E2bError> {
    let sandbox = sandbox_of(rec)?;
    let mut out = json!({
        "templateID": sandbox.template,
        "sandboxID": e2b_id(state, rec),
        "clientID": CLIENT_ID,
        "startedAt": rfc3339(sandbox.created_at),
        "endAt": rfc3339(sandbox.expires_at),
        "cpuCount": (sandbox.resources.cpu.ceil() as u64).max(1),
        "memoryMB": sandbox.resources.memory_mb,
        "diskSizeMB": DISK_SIZE_MB,
        "state": e2b_state_name(&sandbox),
        "envdVersion": ENVD_VERSION,
        "metadata": sandbox.metadata,
    });
    if let Some(headers) = detail {
        out["domain"] = domain(headers, state);
        out["lifecycle"] = json!({
            "autoResume": false,
            "onTimeout": match sandbox.on_timeout {
                OnTimeout::Kill => "kill",
                OnTimeout::Pause => "pause",
            },
        });
        let e2b = e2b_state(rec);
        if let Some(token) = e2b.access_token {
            out["envdAccessToken"] = Value::String(token);
        }
        out["allowInternetAccess"] = json!(e2b.allow_internet_access);
        if let Some(network) = e2b.network {
            out["network"] = network;
        }
    }
    Ok(out)
}

/// `POST /sandboxes` (`NewSandbox`) and `POST /v2/sandboxes` (`NewSandboxV2`). Fields of the
/// upstream schema this server cannot honour are refused when set, never ignored silently.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<i64>,
    auto_pause: Option<bool>,
    /// Only `true` (a memory snapshot) is what this server's pause does.
    auto_pause_memory: Option<bool>,
    auto_resume: Option<Value>,
    secure: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    network: Option<Value>,
    metadata: Option<BTreeMap<String, String>>,
    env_vars: Option<BTreeMap<String, String>>,
    mcp: Option<Value>,
    iam: Option<Value>,
    volume_mounts: Option<Vec<Value>>,
}

fn is_empty_object(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Object(m)) => m.is_empty(),
        Some(_) => false,
    }
}

impl NewSandbox {
    fn refuse_unsupported(&self) -> Result<(), E2bError> {
        let unsupported =
            |what: &str| E2bError::bad_request(format!("{what} is not supported by this server"));
        if self
            .auto_resume
            .as_ref()
            .and_then(|v| v.get("enabled"))
            .and_then(Value::as_bool)
            == Some(true)
        {
            return Err(unsupported("autoResume"));
        }
        if self.auto_pause_memory == Some(false) {
            return Err(unsupported("autoPauseMemory: false"));
        }
        if !is_empty_object(&self.mcp) {
            return Err(unsupported("mcp"));
        }
        if !is_empty_object(&self.iam) {
            return Err(unsupported("iam"));
        }
        if self.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
            return Err(unsupported("volumeMounts"));
        }
        Ok(())
    }
}

fn parse_timeout(state: &AppState, raw: Option<i64>, default: u64) -> Result<u64, E2bError> {
    parse_timeout_from(state, raw, default, 1)
}

/// A timeout in seconds between `min` and `limits.max_timeout_s`, `default` when absent.
fn parse_timeout_from(
    state: &AppState,
    raw: Option<i64>,
    default: u64,
    min: i64,
) -> Result<u64, E2bError> {
    let max = state.config.limits.max_timeout_s;
    match raw {
        None => Ok(default.min(max)),
        Some(t) if t >= min && (t as u64) <= max => Ok(t as u64),
        Some(_) => Err(E2bError::bad_request(format!(
            "timeout must be between {min} and {max} seconds"
        ))),
    }
}

pub async fn create_v1(
    State(state): State<AppState>,
    team: Team,
    headers: HeaderMap,
    raw: Bytes,
) -> Result<Response, E2bError> {
    let req: NewSandbox = body(&headers, &raw)?;
    let secure = req.secure.unwrap_or(false);
    // `NewSandbox.timeout` defaults to 15 s upstream.
    let creating = create(
        state.clone(),
        team.clone(),
        headers.clone(),
        req,
        secure,
        15,
    );
    idempotent(&state, &team, headers, "/sandboxes", &raw, creating).await
}

pub async fn create_v2(
    State(state): State<AppState>,
    team: Team,
    headers: HeaderMap,
    raw: Bytes,
) -> Result<Response, E2bError> {
    if state.config.defects.has(Defect::E2bV2CreateMissing) {
        return Err(E2bError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed",
        ));
    }
    let req: NewSandbox = body(&headers, &raw)?;
    if req.secure.is_some() {
        return Err(E2bError::bad_request(
            "secure is not a field of /v2/sandboxes: every sandbox it creates is secure",
        ));
    }
    // `NewSandboxV2`: always secured, timeout 300 s by default.
    let creating = create(state.clone(), team.clone(), headers.clone(), req, true, 300);
    idempotent(&state, &team, headers, "/v2/sandboxes", &raw, creating).await
}

/// `Idempotency-Key` on a create (the SDK sends one): the first request with a key creates;
/// a repeat by the same team with the same key and body answers that sandbox again, as it is
/// now, instead of creating another; the same key with another body is 422, and a repeat
/// while the first is still creating is 409. The same rules as `/v1` (`api::idempotency`).
async fn idempotent(
    state: &AppState,
    team: &Team,
    headers: HeaderMap,
    path: &str,
    raw: &[u8],
    creating: impl Future<Output = Result<Created, E2bError>> + Send + 'static,
) -> Result<Response, E2bError> {
    let key = crate::api::extract::idempotency_key(&headers)?;
    let req = IdemRequest {
        principal: &team.principal,
        method: "POST",
        path,
        key,
        body: raw,
    };
    let replay_state = state.clone();
    let principal = team.principal.clone();
    let replay = move |id: String| async move {
        let rec = replay_state
            .store
            .get(Kind::Sandbox, Scope::Owner(&principal), &id)
            .await?;
        rec.map(|rec| {
            let body = sandbox_view(&replay_state, &rec, &headers)?;
            Ok(Created::new(StatusCode::CREATED, id, body))
        })
        .transpose()
    };
    idempotency::run(state, req, move || creating, replay).await
}

async fn create(
    state: AppState,
    team: Team,
    headers: HeaderMap,
    mut req: NewSandbox,
    secure: bool,
    default_timeout: u64,
) -> Result<Created, E2bError> {
    let template = req
        .template_id
        .clone()
        .ok_or_else(|| E2bError::bad_request("templateID is required"))?;
    let (from_snapshot, code_interpreter) = if template == TEMPLATE {
        (None, false)
    } else if template == interpreter::TEMPLATE {
        (None, true)
    } else {
        match snapshot_named(&state, &team.principal, &template).await? {
            Some(snapshot) => {
                let serves = serves_code_interpreter(&state, &snapshot).await?;
                (Some(snapshot), serves)
            }
            None => {
                return Err(E2bError::new(
                    StatusCode::NOT_FOUND,
                    format!(
                        "template \"{template}\" not found (this server has \"{TEMPLATE}\", \"{}\" and the team's snapshots)",
                        interpreter::TEMPLATE
                    ),
                ));
            }
        }
    };
    req.refuse_unsupported()?;
    // `allow_internet_access: true` at create is E2B's default, which the 1.x SDKs send on
    // every create: it is taken as the default is (no sandbox here reaches outside either
    // way). Asked for in a network update it would lift a denial, and is refused there.
    if req.allow_internet_access == Some(true) {
        req.allow_internet_access = None;
    }
    let network = honourable_network(&state, req.allow_internet_access, req.network.as_ref())?;
    let timeout_s = parse_timeout(&state, req.timeout, default_timeout)?;
    let metadata = req.metadata.clone().unwrap_or_default();
    validate_metadata(&metadata)?;
    let env = req.env_vars.clone().unwrap_or_default();
    validate_env(&env)?;
    let spec = Spec {
        template,
        from_snapshot,
        timeout_s,
        metadata,
        env,
        auto_pause: req.auto_pause.unwrap_or(false),
        secure,
        allow_internet_access: req.allow_internet_access,
        network,
        code_interpreter,
    };
    let rec = create_sandbox(&state, &team, spec).await?;
    let body = sandbox_view(&state, &rec, &headers)?;
    Ok(Created::new(StatusCode::CREATED, rec.id, body))
}

/// What a new sandbox is made of, once its request is checked.
pub struct Spec {
    /// What `templateID` answers: `base`, or the snapshot it started from.
    pub template: String,
    /// The qualified ID of the snapshot whose files it starts with.
    pub from_snapshot: Option<String>,
    pub timeout_s: u64,
    pub metadata: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    pub auto_pause: bool,
    pub secure: bool,
    pub allow_internet_access: Option<bool>,
    pub network: Option<Value>,
    /// It serves the code interpreter (port 49999).
    pub code_interpreter: bool,
}

/// Creates a running sandbox in the default provider (and, for a snapshot, the snapshot's
/// provider, which must be the default one): its record first, counted against the team's
/// limit, then its files and limits.
pub async fn create_sandbox(state: &AppState, team: &Team, spec: Spec) -> Result<Record, E2bError> {
    let provider_name = state.providers.default_name().to_owned();
    let provider = state
        .providers
        .get(&provider_name)
        .cloned()
        .ok_or_else(|| ApiError::internal("no default provider"))?;
    let snapshot_local = match &spec.from_snapshot {
        None => None,
        // The defect: the snapshot is named and found, but its files are not copied.
        Some(_) if state.config.defects.has(Defect::E2bSnapshotWithoutFiles) => None,
        Some(qualified) => match crate::api::lookup::split(qualified)? {
            (p, local) if p == provider_name => Some(local.to_owned()),
            _ => {
                return Err(E2bError::bad_request(
                    "the snapshot is not in the provider E2B sandboxes are created in",
                ));
            }
        },
    };
    let local = provider.allocate_local_id(IdKind::Sandbox);
    let requested = Resources {
        cpu: 1.0,
        memory_mb: 512,
    };
    let created_at = now();
    let sandbox = Sandbox {
        id: QualifiedId::new(&provider_name, &local).to_string(),
        provider: provider_name.clone(),
        state: SandboxState::Starting,
        template: spec.template.clone(),
        requested,
        resources: requested,
        metadata: spec.metadata.clone(),
        created_at,
        expires_at: created_at + secs(spec.timeout_s),
        on_timeout: if spec.auto_pause && !state.config.defects.has(Defect::E2bAutoPauseIgnored) {
            OnTimeout::Pause
        } else {
            OnTimeout::Kill
        },
        owner: Owner {
            principal: team.principal.clone(),
            session_id: None,
        },
    };
    let e2b = E2bState {
        secure: spec.secure,
        access_token: spec.secure.then(new_token),
        allow_internet_access: spec.allow_internet_access,
        network: spec.network.clone(),
        code_interpreter: spec.code_interpreter,
    };
    let mut record = Record {
        kind: Kind::Sandbox,
        id: sandbox.id.clone(),
        owner: team.principal.clone(),
        parent: None,
        state: String::new(),
        body: json!({"env": spec.env, "timeout_s": spec.timeout_s, "e2b": e2b}),
        version: 1,
        created_at,
        due_at: None,
    };
    store_into(&mut record, &sandbox)?;
    {
        let _serial = state.create_lock.lock().await;
        let live = state
            .store
            .list(&ListQuery::new(
                Kind::Sandbox,
                Scope::Owner(&team.principal),
            ))
            .await?
            .len();
        if live >= state.config.limits.max_sandboxes_per_principal as usize {
            return Err(E2bError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too many live sandboxes",
            ));
        }
        state.store.insert(&record).await?;
    }
    let granted = match provider
        .create(&local, &requested, snapshot_local.as_deref())
        .await
    {
        Ok(granted) => granted,
        Err(e) => {
            if let Err(e) = state.store.delete(Kind::Sandbox, &record.id).await {
                tracing::warn!(error = %e, "could not remove the record of a failed create");
            }
            return Err(e.into());
        }
    };
    let started = now();
    let Some(rec) = state
        .store
        .get(Kind::Sandbox, Scope::System, &record.id)
        .await?
    else {
        let _ = provider.destroy(&local).await;
        return Err(E2bError::not_found(&record.id));
    };
    let timeout_s = spec.timeout_s;
    Ok(update_sandbox(state, rec, |sbx, _| {
        sbx.state = SandboxState::Running;
        sbx.resources = granted;
        sbx.expires_at = started + secs(timeout_s);
        Ok(())
    })
    .await?)
}

/// `metadata` of the list endpoints: one query parameter holding `key=value` pairs joined by
/// `&`, each percent-encoded (upstream `SandboxMetadata` query parameter).
fn metadata_filter(query: &QueryPairs) -> Result<Vec<(String, String)>, E2bError> {
    let Some(raw) = query.get("metadata") else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for pair in raw.split('&').filter(|p| !p.is_empty()) {
        let Some((k, v)) = pair.split_once('=') else {
            return Err(E2bError::bad_request(
                "metadata is key=value pairs joined by &",
            ));
        };
        let decoded = QueryPairs::parse(Some(&format!("{k}={v}")));
        let (k, v) = decoded.0.into_iter().next().unwrap_or_default();
        out.push((k, v));
    }
    out.sort();
    Ok(out)
}

fn matches_metadata(rec: &Record, metadata: &[(String, String)]) -> bool {
    metadata.iter().all(|(k, v)| {
        rec.body
            .get("metadata")
            .and_then(|m| m.get(k))
            .and_then(Value::as_str)
            == Some(v.as_str())
    })
}

/// Where a team's list looks: its own sandboxes (every team's under the defect
/// `e2b-list-shows-other-teams`).
fn list_scope<'a>(state: &AppState, team: &'a Team) -> Scope<'a> {
    if state.config.defects.has(Defect::E2bListShowsOtherTeams) {
        Scope::System
    } else {
        Scope::Owner(&team.principal)
    }
}

fn on_e2b_surface(state: &AppState, rec: &Record) -> bool {
    ids::to_e2b(&provider_names(state), &rec.id).is_some()
}

/// `GET /sandboxes`: the team's running sandboxes, optionally filtered by metadata.
pub async fn list_v1(
    State(state): State<AppState>,
    team: Team,
    query: QueryPairs,
) -> Result<Response, E2bError> {
    let metadata = metadata_filter(&query)?;
    let mut q = ListQuery::new(Kind::Sandbox, list_scope(&state, &team));
    q.state = Some(SandboxState::Running.as_str());
    let records = list_matching(&state, q, usize::MAX, |rec| {
        on_e2b_surface(&state, rec) && matches_metadata(rec, &metadata)
    })
    .await?;
    let views = records
        .iter()
        .map(|r| listed_view(&state, r, None))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Json(views).into_response())
}

/// `GET /v2/sandboxes`: `state` (comma-separated `running`, `paused`; both by default),
/// `metadata`, `limit` (1 to 100) and `nextToken`; the next page's token comes back in
/// `X-Next-Token`.
pub async fn list_v2(
    State(state): State<AppState>,
    team: Team,
    query: QueryPairs,
) -> Result<Response, E2bError> {
    let metadata = metadata_filter(&query)?;
    let mut states: Vec<&str> = Vec::new();
    if let Some(raw) = query.get("state") {
        for s in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match s {
                "running" | "paused" => states.push(s),
                other => {
                    return Err(E2bError::bad_request(format!(
                        "unknown state \"{other}\" (running or paused)"
                    )));
                }
            }
        }
    }
    if states.is_empty() {
        states = vec!["running", "paused"];
    }
    states.sort();
    states.dedup();
    let limit = match query.get("limit") {
        None => PAGE_LIMIT,
        Some(raw) => raw
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=PAGE_LIMIT).contains(n))
            .ok_or_else(|| {
                E2bError::bad_request(format!("limit must be between 1 and {PAGE_LIMIT}"))
            })?,
    };
    let descending = match query.get("order") {
        None | Some("desc") => true,
        // The defect: `asc` is taken and ignored.
        Some("asc") => state.config.defects.has(Defect::E2bListOrderIgnored),
        Some(other) => {
            return Err(E2bError::bad_request(format!(
                "unknown order \"{other}\" (asc or desc)"
            )));
        }
    };
    let started_after = match query.get("startedAfter") {
        None => None,
        Some(raw) => Some(
            OffsetDateTime::parse(raw, &time::format_description::well_known::Rfc3339)
                .map_err(|_| E2bError::bad_request("startedAfter must be an RFC 3339 time"))?,
        ),
    };
    let template = query.get("template").map(str::to_owned);
    let mut filters = format!(
        "e2b-sandboxes&state={}&order={}",
        states.join(","),
        if descending { "desc" } else { "asc" }
    );
    for (k, v) in &metadata {
        filters.push_str(&format!("&metadata.{k}={v}"));
    }
    if let Some(t) = started_after {
        filters.push_str(&format!("&startedAfter={}", t.unix_timestamp_nanos()));
    }
    if let Some(t) = &template {
        filters.push_str(&format!("&template={t}"));
    }
    let page = PageRequest::from_parts(
        &state,
        Some(&limit.to_string()),
        query.get("nextToken"),
        &team.principal,
        filters,
    )
    .map_err(|e| match e {
        ApiError::InvalidPageToken => E2bError::bad_request("invalid nextToken"),
        other => other.into(),
    })?;
    // The team's sandboxes are few (at most `max_sandboxes_per_principal`), so the whole
    // list is read and ordered here: newest first by default, as upstream.
    let q = ListQuery::new(Kind::Sandbox, list_scope(&state, &team));
    let mut records = list_matching(&state, q, usize::MAX, |rec| {
        states.contains(&rec.state.as_str())
            && on_e2b_surface(&state, rec)
            && matches_metadata(rec, &metadata)
            && sandbox_of(rec).is_ok_and(|sbx| {
                started_after.is_none_or(|t| sbx.created_at >= t)
                    && template.as_ref().is_none_or(|t| &sbx.template == t)
            })
    })
    .await?;
    let key = |r: &Record| (r.created_at, r.id.clone());
    records.sort_by_key(key);
    if descending {
        records.reverse();
    }
    if let Some(after) = &page.after
        && !state.config.defects.has(Defect::E2bNextTokenIgnored)
    {
        records.retain(|r| {
            if descending {
                key(r) < *after
            } else {
                key(r) > *after
            }
        });
    }
    records.truncate(limit as usize + 1);
    let page = page.page(&state, records, |r| listed_view(&state, r, None))?;
    let mut response = Json(page.data).into_response();
    if let Some(token) = page.next_page_token
        && let Ok(value) = HeaderValue::from_str(&token)
    {
        response.headers_mut().insert("x-next-token", value);
    }
    Ok(response)
}

pub async fn get(
    State(state): State<AppState>,
    team: Team,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, E2bError> {
    let rec = owned(&state, &team, &id).await?;
    Ok(Json(listed_view(&state, &rec, Some(&headers))?).into_response())
}

pub async fn kill(
    State(state): State<AppState>,
    team: Team,
    Path(id): Path<String>,
) -> Result<Response, E2bError> {
    let rec = owned(&state, &team, &id).await?;
    if !state.config.defects.has(Defect::E2bKillKeepsSandbox) {
        destroy(&state, &rec).await?;
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

fn require_running(sandbox: &Sandbox, id: &str) -> Result<(), E2bError> {
    match sandbox.state {
        SandboxState::Running => Ok(()),
        SandboxState::Paused => Err(E2bError::conflict(format!("sandbox \"{id}\" is paused"))),
        other => Err(E2bError::conflict(format!(
            "sandbox \"{id}\" is {}",
            other.as_str()
        ))),
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutRequest {
    timeout: Option<i64>,
}

/// `POST /sandboxes/{id}/timeout`: the sandbox ends `timeout` seconds from now, whether that
/// is later or earlier than before.
pub async fn set_timeout(
    State(state): State<AppState>,
    team: Team,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, E2bError> {
    let req: TimeoutRequest = body(&headers, &raw)?;
    let timeout = req
        .timeout
        .ok_or_else(|| E2bError::bad_request("timeout is required"))?;
    let timeout_s = parse_timeout(&state, Some(timeout), 0)?;
    let rec = owned(&state, &team, &id).await?;
    require_running(&sandbox_of(&rec)?, &id)?;
    let only_extends = state.config.defects.has(Defect::E2bTimeoutOnlyExtends);
    update_sandbox(&state, rec, |sbx, _| {
        let end = now() + secs(timeout_s);
        if !only_extends || end > sbx.expires_at {
            sbx.expires_at = end;
        }
        Ok(())
    })
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RefreshRequest {
    duration: Option<i64>,
}

/// `POST /sandboxes/{id}/refreshes`: keeps the sandbox alive for at least `duration` more
/// seconds; never shortens it.
pub async fn refresh(
    State(state): State<AppState>,
    team: Team,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, E2bError> {
    let req: RefreshRequest = body(&headers, &raw)?;
    let duration = match req.duration {
        None => 60,
        Some(d) if (0..=MAX_REFRESH_S as i64).contains(&d) => d as u64,
        Some(_) => {
            return Err(E2bError::bad_request(format!(
                "duration must be between 0 and {MAX_REFRESH_S} seconds"
            )));
        }
    };
    let rec = owned(&state, &team, &id).await?;
    require_running(&sandbox_of(&rec)?, &id)?;
    update_sandbox(&state, rec, |sbx, _| {
        sbx.expires_at = sbx.expires_at.max(now() + secs(duration));
        Ok(())
    })
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PauseRequest {
    /// Only a memory snapshot (`true`, the default) is what this server's pause does.
    memory: Option<bool>,
    require_healthy_guest: Option<bool>,
}

/// `POST /sandboxes/{id}/pause`: 204, or 409 when the sandbox is already paused.
pub async fn pause(
    State(state): State<AppState>,
    team: Team,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, E2bError> {
    let req: PauseRequest = body(&headers, &raw)?;
    if req.memory == Some(false) {
        return Err(E2bError::bad_request(
            "memory: false (a filesystem-only snapshot) is not supported by this server",
        ));
    }
    let _ = req.require_healthy_guest;
    let rec = owned(&state, &team, &id).await?;
    let sandbox = sandbox_of(&rec)?;
    if sandbox.state == SandboxState::Paused {
        return Err(E2bError::conflict(format!(
            "sandbox \"{id}\" is already paused"
        )));
    }
    require_running(&sandbox, &id)?;
    pause_sandbox(&state, rec).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Resumes a paused sandbox so that it runs for `timeout_s` from now.
async fn resume_record(state: &AppState, rec: Record, timeout_s: u64) -> Result<Record, E2bError> {
    let (provider, local) = crate::api::lookup::split(&rec.id)?;
    let provider = state
        .providers
        .get(provider)
        .ok_or_else(|| ApiError::internal("unknown provider"))?;
    provider.resume(local).await?;
    Ok(update_sandbox(state, rec, |sbx, _| {
        sbx.state = SandboxState::Running;
        sbx.expires_at = now() + secs(timeout_s);
        Ok(())
    })
    .await?)
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResumeRequest {
    timeout: Option<i64>,
    auto_pause: Option<bool>,
}

/// `POST /sandboxes/{id}/resume` (deprecated upstream in favour of connect): 201, or 409
/// when the sandbox is already running.
pub async fn resume(
    State(state): State<AppState>,
    team: Team,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, E2bError> {
    let req: ResumeRequest = body(&headers, &raw)?;
    let timeout_s = parse_timeout(&state, req.timeout, 15)?;
    let rec = owned(&state, &team, &id).await?;
    let sandbox = sandbox_of(&rec)?;
    if sandbox.state != SandboxState::Paused {
        return Err(E2bError::conflict(format!(
            "sandbox \"{id}\" is already running"
        )));
    }
    let rec = resume_record(&state, rec, timeout_s).await?;
    let rec = match req.auto_pause {
        None => rec,
        Some(auto_pause) => {
            update_sandbox(&state, rec, |sbx, _| {
                sbx.on_timeout = if auto_pause {
                    OnTimeout::Pause
                } else {
                    OnTimeout::Kill
                };
                Ok(())
            })
            .await?
        }
    };
    Ok((
        StatusCode::CREATED,
        Json(sandbox_view(&state, &rec, &headers)?),
    )
        .into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConnectRequest {
    timeout: Option<i64>,
    /// `/v2/.../connect`: resume from the memory snapshot (`true`) or reboot (`false`).
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/connect` and `/v2/sandboxes/{id}/connect`: 200 for a running
/// sandbox (its timeout only ever extended), 201 for a paused one, which is resumed.
pub async fn connect(
    State(state): State<AppState>,
    team: Team,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, E2bError> {
    let req: ConnectRequest = body(&headers, &raw)?;
    if req.memory == Some(false) {
        return Err(E2bError::bad_request(
            "memory: false (rebooting from the filesystem) is not supported by this server",
        ));
    }
    // `ConnectSandbox.timeout` has minimum 0 upstream: 0 extends nothing.
    let timeout_s = parse_timeout_from(&state, req.timeout, 300, 0)?;
    let rec = owned(&state, &team, &id).await?;
    let sandbox = sandbox_of(&rec)?;
    match sandbox.state {
        SandboxState::Running => {
            let rec = update_sandbox(&state, rec, |sbx, _| {
                sbx.expires_at = sbx.expires_at.max(now() + secs(timeout_s));
                Ok(())
            })
            .await?;
            Ok(Json(sandbox_view(&state, &rec, &headers)?).into_response())
        }
        SandboxState::Paused => {
            let rec = if state.config.defects.has(Defect::E2bConnectDoesNotResume) {
                rec
            } else {
                resume_record(&state, rec, timeout_s).await?
            };
            Ok((
                StatusCode::CREATED,
                Json(sandbox_view(&state, &rec, &headers)?),
            )
                .into_response())
        }
        other => Err(E2bError::conflict(format!(
            "sandbox \"{id}\" is {}",
            other.as_str()
        ))),
    }
}

/// One `SandboxMetric` of a running sandbox, measured now: its CPU count and the average use
/// of them since it started, its processes' resident memory against its memory grant, and
/// its files' bytes (there is no disk quota: `diskTotal` is 0).
async fn metric_now(state: &AppState, rec: &Record) -> Result<Value, E2bError> {
    let sandbox = sandbox_of(rec)?;
    let (provider, local) = crate::api::lookup::split(&rec.id)?;
    let provider = state
        .providers
        .get(provider)
        .ok_or_else(|| ApiError::internal("unknown provider"))?;
    let usage = provider.usage(local).await?;
    let at = now();
    let cpus = (sandbox.resources.cpu.ceil() as u64).max(1);
    let alive = (at - sandbox.created_at).as_seconds_f64().max(1e-3);
    let used_pct = (usage.cpu_seconds / (alive * cpus as f64) * 100.0).clamp(0.0, 100.0);
    Ok(json!({
        "timestamp": rfc3339(at),
        "timestampUnix": at.unix_timestamp(),
        "cpuCount": cpus,
        "cpuUsedPct": used_pct,
        "memUsed": usage.memory_bytes,
        "memTotal": sandbox.resources.memory_mb * 1024 * 1024,
        "memCache": 0,
        "diskUsed": usage.disk_bytes,
        "diskTotal": DISK_SIZE_MB * 1024 * 1024,
    }))
}

/// A time bound of the metrics endpoint: Unix seconds.
fn unix_param(query: &QueryPairs, name: &str) -> Result<Option<i64>, E2bError> {
    query
        .get(name)
        .map(|raw| {
            raw.parse::<i64>()
                .map_err(|_| E2bError::bad_request(format!("{name} is Unix seconds")))
        })
        .transpose()
}

/// `GET /sandboxes/{id}/metrics`: the sandbox's metrics between `start` and `end` (Unix
/// seconds, both optional). The server keeps no history: the answer is one sample taken
/// now, when now lies in the range and the sandbox runs; otherwise none.
pub async fn metrics(
    State(state): State<AppState>,
    team: Team,
    Path(id): Path<String>,
    query: QueryPairs,
) -> Result<Response, E2bError> {
    let (start, end) = (unix_param(&query, "start")?, unix_param(&query, "end")?);
    let rec = owned(&state, &team, &id).await?;
    let sandbox = sandbox_of(&rec)?;
    let now_s = now().unix_timestamp();
    // The bounds are whole seconds; a sample taken within the second `end` names is in.
    let in_range = start.is_none_or(|s| s <= now_s) && end.is_none_or(|e| now_s <= e + 1);
    if sandbox.state != SandboxState::Running
        || !in_range
        || state.config.defects.has(Defect::E2bMetricsEmpty)
    {
        return Ok(Json(Vec::<Value>::new()).into_response());
    }
    Ok(Json(vec![metric_now(&state, &rec).await?]).into_response())
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the latest metric of each of the team's running
/// sandboxes named, by ID (`SandboxesWithMetrics`); IDs of other teams or of no sandbox are
/// left out.
pub async fn metrics_many(
    State(state): State<AppState>,
    team: Team,
    query: QueryPairs,
) -> Result<Response, E2bError> {
    let raw = query
        .get("sandbox_ids")
        .ok_or_else(|| E2bError::bad_request("sandbox_ids is required"))?;
    let mut out = serde_json::Map::new();
    for id in raw
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .take(PAGE_LIMIT as usize)
    {
        let Ok(rec) = owned(&state, &team, id).await else {
            continue;
        };
        if sandbox_of(&rec)?.state == SandboxState::Running {
            out.insert(id.to_owned(), metric_now(&state, &rec).await?);
        }
    }
    Ok(Json(json!({ "sandboxes": out })).into_response())
}

/// `SandboxNetworkUpdateConfig`: replaces the sandbox's egress configuration; omitted fields
/// are cleared.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkUpdate {
    allow_out: Option<Value>,
    deny_out: Option<Value>,
    rules: Option<Value>,
    egress_proxy: Option<Value>,
    dns_servers: Option<Value>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
}

/// `PUT /sandboxes/{id}/network`: the running sandbox's egress configuration becomes this
/// one (what denies is honoured, what would let traffic out is refused, as at create). 204;
/// 409 while paused.
pub async fn update_network(
    State(state): State<AppState>,
    team: Team,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, E2bError> {
    let req: NetworkUpdate = body(&headers, &raw)?;
    let mut network = serde_json::Map::new();
    for (key, value) in [
        ("allowOut", req.allow_out),
        ("denyOut", req.deny_out),
        ("rules", req.rules),
        ("egressProxy", req.egress_proxy),
        ("dnsServers", req.dns_servers),
    ] {
        if let Some(value) = value {
            network.insert(key.to_owned(), value);
        }
    }
    let network = honourable_network(
        &state,
        req.allow_internet_access,
        Some(&Value::Object(network)),
    )?;
    let mut rec = owned(&state, &team, &id).await?;
    // Compare and swap on the record's version, as every sandbox update does.
    for _ in 0..16 {
        require_running(&sandbox_of(&rec)?, &id)?;
        let mut e2b = e2b_state(&rec);
        e2b.allow_internet_access = req.allow_internet_access;
        e2b.network = network.clone();
        rec.body["e2b"] = serde_json::to_value(&e2b).map_err(ApiError::internal)?;
        match state.store.update(&rec).await {
            Ok(_) => return Ok(StatusCode::NO_CONTENT.into_response()),
            Err(crate::store::StoreError::Conflict) => {
                rec = owned(&state, &team, &id).await?;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(ApiError::internal(format!("sandbox {id} kept changing under an update")).into())
}
