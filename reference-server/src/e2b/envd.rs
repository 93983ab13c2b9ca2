//! envd on this server's base URL: which sandbox a request is for (the `E2b-Sandbox-Id` and
//! `E2b-Sandbox-Port` headers the SDK sends when `E2B_SANDBOX_URL` is set, or E2B's host form
//! `49983-<id>.<domain>`), the access token of secure sandboxes, and envd's plain HTTP
//! endpoints: `GET /health`, `GET /envs`, `GET` and `POST /files`.
//!
//! Paths: the sandbox's root directory is the E2B user's home, `/home/user`. Absolute paths
//! must lie below it; relative paths are relative to it, as envd resolves them against the
//! user's home. Commands run on the host, so inside a command the root has its host path.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::api::AppState;
use crate::api::extract::{QueryPairs, read_body};
use crate::api::lookup::split;
use crate::api::sandboxes::{env_of, sandbox_of};
use crate::defects::Defect;
use crate::domain::SandboxState;
use crate::sandbox::{FileError, LocalProvider, SandboxFiles};
use crate::store::{Kind, Record, Scope};

use super::connect::ConnectError;
use super::ids;
use super::records::e2b_state;

/// The port envd listens on inside an E2B sandbox; the only port served here.
pub const ENVD_PORT: u16 = 49983;
/// The home directory of the E2B user, which is the sandbox's root directory here.
pub const HOME: &str = "/home/user";
/// The extended-attribute namespace of an entry's user metadata (envd 0.6.2 and later):
/// written by `POST /files`, read back by it and by the filesystem service's entry info.
pub const METADATA_PREFIX: &str = "user.e2b.";

/// A plain (non-Connect) error of the envd surface: `{code, message}` with the HTTP status
/// as the code, as envd and E2B's proxy answer.
#[derive(Debug)]
pub struct EnvdError {
    pub status: StatusCode,
    pub message: String,
    /// Set for the proxy's own answers, which name the sandbox.
    pub sandbox_id: Option<String>,
}

impl EnvdError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            sandbox_id: None,
        }
    }
}

impl IntoResponse for EnvdError {
    fn into_response(self) -> Response {
        let mut body = json!({"code": self.status.as_u16(), "message": self.message});
        if let Some(id) = self.sandbox_id {
            body["sandboxId"] = json!(id);
        }
        (self.status, Json(body)).into_response()
    }
}

impl From<FileError> for EnvdError {
    fn from(e: FileError) -> Self {
        match e {
            FileError::NotFound => EnvdError::new(StatusCode::NOT_FOUND, "path not found"),
            FileError::InvalidPath => EnvdError::new(
                StatusCode::BAD_REQUEST,
                format!("the path is outside the sandbox's filesystem ({HOME})"),
            ),
            FileError::WrongKind => {
                EnvdError::new(StatusCode::BAD_REQUEST, "the path names a directory")
            }
            FileError::Io(e) => {
                tracing::error!(error = %e, "envd file I/O failed");
                EnvdError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
            }
        }
    }
}

impl From<ConnectError> for EnvdError {
    fn from(e: ConnectError) -> Self {
        EnvdError::new(e.code.status(), e.message)
    }
}

/// The running sandbox an envd request is for.
pub struct EnvdSandbox {
    pub rec: Record,
    /// The server's deliberate defects, for handlers that have some.
    pub defects: crate::defects::Defects,
    pub provider: Arc<LocalProvider>,
    pub local: String,
}

impl EnvdSandbox {
    pub fn files(&self) -> Result<SandboxFiles, ConnectError> {
        Ok(self.provider.files(&self.local)?)
    }

    pub fn env(&self) -> BTreeMap<String, String> {
        env_of(&self.rec)
    }
}

/// The running sandbox an envd request is routed to, its access token checked: the opening of
/// every envd handler but `/health` (no token) and `/files` (a signature may stand in for the
/// token).
impl FromRequestParts<AppState> for EnvdSandbox {
    type Rejection = EnvdError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, EnvdError> {
        sandbox_for(state, &parts.headers, Access::Token).await
    }
}

/// The sandbox ID and port a request is routed by: the headers first, else the host form.
fn route_of(headers: &HeaderMap) -> Option<(String, Option<String>)> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(|s| s.trim().to_owned())
    };
    if let Some(id) = header("e2b-sandbox-id") {
        return Some((id, header("e2b-sandbox-port")));
    }
    let host = header("host")?;
    let label = host.split('.').next()?;
    let (port, id) = label.split_once('-')?;
    if port.bytes().all(|b| b.is_ascii_digit()) && !id.is_empty() && host.contains('.') {
        return Some((id.to_owned(), Some(port.to_owned())));
    }
    None
}

/// How an envd request to a secure sandbox proves that it may reach it.
pub enum Access<'a> {
    /// No proof (`/health`).
    Exempt,
    /// The sandbox's access token in `X-Access-Token`.
    Token,
    /// The token, or else a signature of the file operation made with it (`/files`, the
    /// SDK's `upload_url` and `download_url`).
    TokenOrSignature(&'a FileSignature),
}

/// What a signed `/files` URL signs: envd's v1 signature is
/// `v1_` + unpadded base64 of SHA-256 over `path:operation:username:token[:expiration]`.
pub struct FileSignature {
    pub path: String,
    /// `read` (GET) or `write` (POST).
    pub operation: &'static str,
    pub username: String,
    pub signature: Option<String>,
    pub expiration: Option<String>,
}

impl FileSignature {
    fn of(query: &QueryPairs, path: &str, operation: &'static str) -> Self {
        FileSignature {
            path: path.to_owned(),
            operation,
            username: query.get("username").unwrap_or_default().to_owned(),
            signature: query.get("signature").map(str::to_owned),
            expiration: query.get("signature_expiration").map(str::to_owned),
        }
    }

    /// Why the signature does not admit the request, if it does not.
    fn check(&self, token: &str, now_unix: i64) -> Result<(), &'static str> {
        let Some(given) = &self.signature else {
            return Err("invalid or missing access token (X-Access-Token) or signature");
        };
        let mut raw = format!("{}:{}:{}:{token}", self.path, self.operation, self.username);
        let expiration = match &self.expiration {
            None => None,
            Some(e) => Some(
                e.parse::<i64>()
                    .map_err(|_| "signature_expiration is not a number")?,
            ),
        };
        if let Some(e) = expiration {
            raw.push_str(&format!(":{e}"));
        }
        use base64::Engine as _;
        use sha2::Digest as _;
        let expected = format!(
            "v1_{}",
            base64::engine::general_purpose::STANDARD_NO_PAD.encode(sha2::Sha256::digest(raw))
        );
        if !constant_time_eq(expected.as_bytes(), given.as_bytes()) {
            return Err("invalid signature");
        }
        if expiration.is_some_and(|e| e < now_unix) {
            return Err("signature is already expired");
        }
        Ok(())
    }
}

/// Resolves the sandbox of an envd request and checks that it may reach it (`access`).
pub async fn sandbox_for(
    state: &AppState,
    headers: &HeaderMap,
    access: Access<'_>,
) -> Result<EnvdSandbox, EnvdError> {
    let Some((id, port)) = route_of(headers) else {
        return Err(EnvdError::new(
            StatusCode::NOT_FOUND,
            "envd requests name their sandbox with E2b-Sandbox-Id and E2b-Sandbox-Port",
        ));
    };
    let not_found = || EnvdError {
        status: StatusCode::BAD_GATEWAY,
        message: "The sandbox was not found".into(),
        sandbox_id: Some(id.clone()),
    };
    match port.as_deref() {
        Some(p) if p == ENVD_PORT.to_string() => {}
        Some(_) => {
            return Err(EnvdError {
                status: StatusCode::BAD_GATEWAY,
                message: format!(
                    "The sandbox is running but port is not open (only envd's port {ENVD_PORT} is served)"
                ),
                sandbox_id: Some(id.clone()),
            });
        }
        None => {
            return Err(EnvdError::new(
                StatusCode::BAD_REQUEST,
                "E2b-Sandbox-Port is required with E2b-Sandbox-Id",
            ));
        }
    }
    let providers: Vec<String> = state
        .config
        .providers
        .iter()
        .map(|p| p.name.clone())
        .collect();
    let qualified = ids::from_e2b(&providers, &id).ok_or_else(not_found)?;
    // The sandbox ID is the address, as it is behind E2B's proxy: no team is involved, and a
    // secure sandbox is guarded by its access token.
    let rec = state
        .store
        .get(Kind::Sandbox, Scope::System, &qualified)
        .await
        .map_err(|e| EnvdError::from(ConnectError::from(crate::api::ApiError::from(e))))?
        .ok_or_else(not_found)?;
    let sandbox = sandbox_of(&rec).map_err(|e| EnvdError::from(ConnectError::from(e)))?;
    if sandbox.state != SandboxState::Running {
        return Err(not_found());
    }
    let e2b = e2b_state(&rec);
    let checked = !matches!(access, Access::Exempt)
        && e2b.secure
        && !state.config.defects.has(Defect::E2bAccessTokenUnchecked);
    if checked {
        let given = headers.get("x-access-token").and_then(|v| v.to_str().ok());
        let expected = e2b.access_token.as_deref().unwrap_or("");
        let unauthorized = |why: &str| EnvdError::new(StatusCode::UNAUTHORIZED, why);
        match (given, &access) {
            _ if expected.is_empty() => {
                return Err(unauthorized("the sandbox has no access token"));
            }
            (Some(given), _) => {
                if !constant_time_eq(given.as_bytes(), expected.as_bytes()) {
                    return Err(unauthorized("invalid access token (X-Access-Token)"));
                }
            }
            (None, Access::TokenOrSignature(signed)) => {
                let now = if state.config.defects.has(Defect::E2bSignatureExpiryIgnored) {
                    i64::MIN
                } else {
                    time::OffsetDateTime::now_utc().unix_timestamp()
                };
                signed.check(expected, now).map_err(unauthorized)?;
            }
            (None, _) => {
                return Err(unauthorized("missing access token (X-Access-Token)"));
            }
        }
    }
    let (provider, local) = split(&rec.id).map_err(|e| EnvdError::from(ConnectError::from(e)))?;
    let provider = state
        .providers
        .get(provider)
        .cloned()
        .ok_or_else(not_found)?;
    let local = local.to_owned();
    Ok(EnvdSandbox {
        rec,
        defects: state.config.defects.clone(),
        provider,
        local,
    })
}

/// The sandbox ID and port of a request routed to a sandbox port other than envd's (the
/// `E2b-Sandbox-Port` header, or the host form `<port>-<id>.<domain>` that the SDK's
/// `get_host` names); `None` for every other request, which goes on to the routes.
pub fn port_target(headers: &HeaderMap) -> Option<(String, u16)> {
    route_of(headers).and_then(|(id, port)| {
        let port: u16 = port?.parse().ok()?;
        (port != ENVD_PORT).then_some((id, port))
    })
}

/// E2B's proxy's answer for a sandbox port nothing listens on: 502, naming the sandbox.
pub fn port_not_open(id: &str) -> EnvdError {
    EnvdError {
        status: StatusCode::BAD_GATEWAY,
        message: "The sandbox is running but port is not open".into(),
        sandbox_id: Some(id.to_owned()),
    }
}

/// The running sandbox `id` that a request to one of its ports is for.
pub async fn port_sandbox(state: &AppState, id: &str) -> Result<EnvdSandbox, EnvdError> {
    // The port is public, as a sandbox's ports are upstream unless `allowPublicTraffic:
    // false` (which this server refuses): the sandbox ID is the address.
    let mut headers = HeaderMap::new();
    headers.insert(
        "e2b-sandbox-id",
        HeaderValue::from_str(id).map_err(|_| {
            EnvdError::new(
                StatusCode::BAD_REQUEST,
                "the sandbox ID is not a header value",
            )
        })?,
    );
    headers.insert("e2b-sandbox-port", HeaderValue::from(ENVD_PORT));
    sandbox_for(state, &headers, Access::Exempt).await
}

/// Forwards a request to `port` of the sandbox as the sandbox's own processes reach it, as
/// E2B's proxy forwards it. A port nothing listens on is the proxy's 502.
pub async fn forward_to_port(
    sbx: &EnvdSandbox,
    id: &str,
    port: u16,
    request: Request,
) -> Result<Response, EnvdError> {
    let closed = || port_not_open(id);
    let stream = sbx
        .provider
        .connect(&sbx.local, port)
        .await
        .map_err(|_| closed())?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|_| closed())?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "sandbox port connection ended");
        }
    });
    let (mut parts, body) = request.into_parts();
    // Origin form over a connection of its own; the routing headers and the caller's
    // credentials stay here.
    let target = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "/".into());
    parts.uri = target
        .parse()
        .map_err(|_| EnvdError::new(StatusCode::BAD_REQUEST, "the request target is not a URI"))?;
    parts.version = axum::http::Version::HTTP_11;
    for name in [
        "e2b-sandbox-id",
        "e2b-sandbox-port",
        "x-access-token",
        "x-api-key",
        "authorization",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "upgrade",
        "te",
        "trailer",
    ] {
        parts.headers.remove(name);
    }
    if let Ok(host) = HeaderValue::from_str(&format!("localhost:{port}")) {
        parts.headers.insert(header::HOST, host);
    }
    let response = sender
        .send_request(axum::http::Request::from_parts(parts, body))
        .await
        .map_err(|_| closed())?;
    let (parts, body) = response.into_parts();
    Ok(Response::from_parts(parts, Body::new(body)))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// An E2B path as a path relative to the sandbox root (its home), before the root's own
/// normalization refuses `..` above it.
pub fn to_rel(path: &str) -> Result<String, FileError> {
    if path.contains('\0') {
        return Err(FileError::InvalidPath);
    }
    if let Some(rest) = path.strip_prefix('/') {
        let home = &HOME[1..];
        return match rest.strip_prefix(home) {
            Some("") => Ok(String::new()),
            Some(below) if below.starts_with('/') => Ok(below.trim_start_matches('/').to_owned()),
            _ => Err(FileError::InvalidPath),
        };
    }
    Ok(path.to_owned())
}

/// A root-relative path as E2B's absolute path.
pub fn to_e2b(rel: &str) -> String {
    let rel = rel.trim_matches('/');
    if rel.is_empty() {
        HOME.to_owned()
    } else {
        format!("{HOME}/{rel}")
    }
}

/// Runs blocking file I/O off the async workers.
pub async fn blocking<T: Send + 'static, E: Send + 'static + From<ConnectError>>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, E> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| E::from(ConnectError::from(crate::api::ApiError::internal(e))))?
}

/// `GET /health`: 204 while the sandbox runs.
pub async fn health(State(state): State<AppState>, headers: HeaderMap) -> Response {
    match sandbox_for(&state, &headers, Access::Exempt).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /envs`: the sandbox's environment variables.
pub async fn envs(sbx: EnvdSandbox) -> Response {
    Json(sbx.env()).into_response()
}

/// The encoding of a download: gzip when the client's `Accept-Encoding` takes it at least as
/// gladly as the identity, as envd chooses; `None` when it takes neither (406).
fn download_encoding(headers: &HeaderMap) -> Option<&'static str> {
    let Some(accept) = headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.trim().is_empty())
    else {
        return Some("identity");
    };
    let (mut gzip, mut identity, mut any) = (None, None, None);
    for item in accept.split(',') {
        let mut parts = item.split(';');
        let name = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        let q = parts
            .filter_map(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.parse::<f64>().ok())
            })
            .next()
            .unwrap_or(1.0);
        match name.as_str() {
            "gzip" => gzip = Some(q),
            "identity" => identity = Some(q),
            "*" => any = Some(q),
            _ => {}
        }
    }
    let gzip = gzip.or(any).unwrap_or(0.0);
    // The identity is acceptable unless refused by name, or by `*;q=0` without its name.
    let identity = identity.unwrap_or(if any == Some(0.0) { 0.0 } else { 1.0 });
    match (gzip > 0.0, identity > 0.0) {
        (true, _) if gzip >= identity => Some("gzip"),
        (_, true) => Some("identity"),
        (true, false) => Some("gzip"),
        (false, false) => None,
    }
}

/// `GET /files?path=`: the file's bytes, gzip-compressed when the client asks for it.
pub async fn read_file(
    State(state): State<AppState>,
    headers: HeaderMap,
    query: QueryPairs,
) -> Result<Response, EnvdError> {
    let path = query.get("path").unwrap_or_default().to_owned();
    let signed = FileSignature::of(&query, &path, "read");
    let sbx = sandbox_for(&state, &headers, Access::TokenOrSignature(&signed)).await?;
    if path.is_empty() {
        return Err(EnvdError::new(StatusCode::BAD_REQUEST, "path is required"));
    }
    let encoding = download_encoding(&headers).ok_or_else(|| {
        EnvdError::new(
            StatusCode::NOT_ACCEPTABLE,
            "Accept-Encoding takes neither gzip nor identity",
        )
    })?;
    let rel = to_rel(&path)?;
    let files = sbx.files()?;
    let bytes = blocking(move || {
        let bytes = files.read(&rel)?;
        if encoding == "gzip" {
            use std::io::Write as _;
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(&bytes)
                .and_then(|()| gz.finish())
                .map_err(|e| EnvdError::from(FileError::Io(e)))
        } else {
            Ok::<_, EnvdError>(bytes)
        }
    })
    .await?;
    let mut response = Response::new(Body::from(bytes));
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    if encoding == "gzip" {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    Ok(response)
}

/// The user metadata of an upload: each `X-Metadata-<key>` header, its key lowercased,
/// checked as envd checks it (a key and value of printable ASCII, a key not empty, at most
/// 4096 bytes with the attribute names).
fn upload_metadata(
    headers: &HeaderMap,
    defects: &crate::defects::Defects,
) -> Result<BTreeMap<String, String>, EnvdError> {
    const MAX_TOTAL: usize = 4096;
    let invalid =
        |why: String| EnvdError::new(StatusCode::BAD_REQUEST, format!("invalid metadata: {why}"));
    let printable = |s: &[u8]| s.iter().all(|b| (0x20..=0x7e).contains(b));
    let mut out = BTreeMap::new();
    let mut total = 0;
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else {
            continue;
        };
        if key.is_empty() {
            return Err(invalid("a metadata key is empty".into()));
        }
        if !printable(key.as_bytes()) || !printable(value.as_bytes()) {
            return Err(invalid(format!(
                "the value of {key} is not printable ASCII"
            )));
        }
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        total += METADATA_PREFIX.len() + key.len() + value.len();
        out.entry(key.to_owned()).or_insert(value);
    }
    if total > MAX_TOTAL {
        return Err(invalid(format!("{total} bytes exceed {MAX_TOTAL}")));
    }
    if defects.has(Defect::E2bMetadataDropped) {
        out.clear();
    }
    Ok(out)
}

/// The request body, decompressed when `Content-Encoding` is gzip; at most `limit` bytes
/// either way.
async fn upload_body(
    headers: &HeaderMap,
    body: Body,
    limit: u64,
    defects: &crate::defects::Defects,
) -> Result<Vec<u8>, EnvdError> {
    let encoding = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("identity")
        .trim()
        .to_ascii_lowercase();
    let raw = read_body(headers, body, limit)
        .await
        .map_err(|e| EnvdError::from(ConnectError::from(e)))?;
    match encoding.as_str() {
        "" | "identity" => Ok(raw.to_vec()),
        // The defect: the compressed bytes are stored as they came.
        "gzip" if defects.has(Defect::E2bGzipUploadStoredCompressed) => Ok(raw.to_vec()),
        "gzip" => {
            use std::io::Read as _;
            let mut out = Vec::new();
            let read = flate2::read::GzDecoder::new(&raw[..])
                .take(limit + 1)
                .read_to_end(&mut out);
            match read {
                Ok(n) if n as u64 > limit => Err(EnvdError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("uploads are at most {limit} bytes"),
                )),
                Ok(_) => Ok(out),
                Err(e) => Err(EnvdError::new(
                    StatusCode::BAD_REQUEST,
                    format!("error decompressing request body: {e}"),
                )),
            }
        }
        other => Err(EnvdError::new(
            StatusCode::BAD_REQUEST,
            format!("unsupported Content-Encoding: {other}, supported: gzip"),
        )),
    }
}

/// `POST /files?path=`: an `application/octet-stream` body is the file at `path`; a
/// `multipart/form-data` body holds one or more `file` parts, each written to `path` (when
/// there is one part and `path` is given) or to the part's file name. Either may be gzip
/// compressed (`Content-Encoding`); `X-Metadata-*` headers become each file's metadata,
/// replacing what it had. The answer lists what was written.
pub async fn write_file(
    State(state): State<AppState>,
    query: QueryPairs,
    request: Request,
) -> Result<Response, EnvdError> {
    let headers = request.headers().clone();
    let path = query.get("path").map(str::to_owned);
    let signed = FileSignature::of(&query, path.as_deref().unwrap_or(""), "write");
    let sbx = sandbox_for(&state, &headers, Access::TokenOrSignature(&signed)).await?;
    let metadata = upload_metadata(&headers, &state.config.defects)?;
    let limit = state.config.limits.max_file_bytes;
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let mut writes: Vec<(String, Vec<u8>)> = Vec::new();
    if content_type.starts_with("multipart/form-data")
        && state.config.defects.has(Defect::E2bMultipartUploadRefused)
    {
        // The defect: only octet-stream bodies are taken.
        return Err(EnvdError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "uploads are application/octet-stream",
        ));
    }
    if content_type.starts_with("multipart/form-data") {
        let (parts, body) = request.into_parts();
        let body = upload_body(&headers, body, limit, &state.config.defects).await?;
        let request = Request::from_parts(parts, Body::from(body));
        let mut multipart = axum::extract::Multipart::from_request(request, &state)
            .await
            .map_err(|e| EnvdError::new(StatusCode::BAD_REQUEST, e.body_text()))?;
        while let Some(field) = multipart
            .next_field()
            .await
            .map_err(|e| EnvdError::new(StatusCode::BAD_REQUEST, e.body_text()))?
        {
            if field.name() != Some("file") {
                return Err(EnvdError::new(
                    StatusCode::BAD_REQUEST,
                    "multipart parts are named `file`",
                ));
            }
            let name = field.file_name().map(str::to_owned);
            let data = field
                .bytes()
                .await
                .map_err(|e| EnvdError::new(StatusCode::BAD_REQUEST, e.body_text()))?;
            writes.push((name.unwrap_or_default(), data.to_vec()));
        }
        match (&path, writes.len()) {
            (_, 0) => {
                return Err(EnvdError::new(
                    StatusCode::BAD_REQUEST,
                    "the multipart body holds no `file` part",
                ));
            }
            (Some(path), 1) => writes[0].0 = path.to_owned(),
            _ => {}
        }
        if writes.iter().any(|(path, _)| path.is_empty()) {
            return Err(EnvdError::new(
                StatusCode::BAD_REQUEST,
                "each part needs a file name (its path) unless one part is sent with `path`",
            ));
        }
    } else if content_type.starts_with("application/octet-stream") {
        let path =
            path.ok_or_else(|| EnvdError::new(StatusCode::BAD_REQUEST, "path is required"))?;
        let bytes =
            upload_body(&headers, request.into_body(), limit, &state.config.defects).await?;
        writes.push((path, bytes));
    } else {
        return Err(EnvdError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "uploads are application/octet-stream or multipart/form-data",
        ));
    }
    let mangle = state.config.defects.has(Defect::E2bFileBytesAltered);
    let files = sbx.files()?;
    let written = blocking(move || {
        // Every path is checked before anything is written: a bad one changes nothing.
        let writes = writes
            .into_iter()
            .map(|(path, bytes)| Ok((to_rel(&path)?, bytes)))
            .collect::<Result<Vec<_>, FileError>>()?;
        let mut out = Vec::new();
        for (rel, bytes) in writes {
            let bytes = if mangle {
                // The defect: the upload is taken as text, so bytes that are not UTF-8 change.
                String::from_utf8_lossy(&bytes).into_owned().into_bytes()
            } else {
                bytes
            };
            let outcome = files.write(&rel, &bytes)?;
            files.set_attributes(&outcome.path, METADATA_PREFIX, &metadata)?;
            let name = outcome
                .path
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .to_owned();
            let mut entry = json!({"name": name, "type": "file", "path": to_e2b(&outcome.path)});
            let stored = files.attributes(&outcome.path, METADATA_PREFIX)?;
            if !stored.is_empty() {
                entry["metadata"] = json!(stored);
            }
            out.push(entry);
        }
        Ok::<_, EnvdError>(out)
    })
    .await?;
    Ok(Json(written).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2b_paths_map_to_the_root_and_back() {
        let cases: &[(&str, Option<&str>)] = &[
            ("/home/user", Some("")),
            ("/home/user/", Some("")),
            ("/home/user/a/b.txt", Some("a/b.txt")),
            ("a/b.txt", Some("a/b.txt")),
            ("/home/username/x", None),
            ("/etc/passwd", None),
            ("/", None),
            ("a\0b", None),
        ];
        for (path, rel) in cases {
            assert_eq!(to_rel(path).ok().as_deref(), *rel, "{path}");
        }
        assert_eq!(to_e2b(""), "/home/user");
        assert_eq!(to_e2b("a/b"), "/home/user/a/b");
    }

    #[test]
    fn requests_are_routed_by_headers_or_by_host() {
        let mut h = HeaderMap::new();
        h.insert("e2b-sandbox-id", HeaderValue::from_static("abc"));
        h.insert("e2b-sandbox-port", HeaderValue::from_static("49983"));
        assert_eq!(route_of(&h), Some(("abc".into(), Some("49983".into()))));
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("49983-abc.e2b.local:3000"));
        assert_eq!(route_of(&h), Some(("abc".into(), Some("49983".into()))));
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("127.0.0.1:3000"));
        assert_eq!(route_of(&h), None);
    }
}
