//! Extractors: the caller's identity and scope, JSON bodies that are strict and never echoed,
//! raw bodies with a size cap, query strings, and idempotency keys.

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method, header};
use serde::de::DeserializeOwned;

use crate::config::Scope;

use super::error::ApiError;
use super::state::AppState;

/// The authenticated principal, with the scope the operation needs already checked: `read`
/// for GET, `write` for everything else.
#[derive(Debug, Clone)]
pub struct Caller {
    pub principal: String,
}

fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or(ApiError::Unauthenticated)?;
    let value = value.to_str().map_err(|_| ApiError::Unauthenticated)?;
    let (scheme, token) = value.split_once(' ').ok_or(ApiError::Unauthenticated)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() || token.contains(' ') {
        return Err(ApiError::Unauthenticated);
    }
    Ok(token)
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = bearer(&parts.headers)?;
        let principal = state
            .config
            .principal_by_token(token)
            .ok_or(ApiError::Unauthenticated)?;
        let needed = if parts.method == Method::GET || parts.method == Method::HEAD {
            Scope::Read
        } else {
            Scope::Write
        };
        if !principal.has_scope(needed) {
            return Err(ApiError::PermissionDenied);
        }
        Ok(Caller {
            principal: principal.name.clone(),
        })
    }
}

/// Path parameters. A parameter that cannot be decoded (invalid percent-encoding) names
/// nothing that exists: 404, like any other unknown ID.
#[derive(Debug)]
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Path(value)),
            Err(_) => Err(ApiError::NotFound),
        }
    }
}

/// The test-control administrator: 404 when test controls are off, 401 without a token,
/// 403 with a principal's token.
#[derive(Debug, Clone, Copy)]
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        if !state.config.test_controls || state.config.admin_token.is_none() {
            return Err(ApiError::NotFound);
        }
        let token = bearer(&parts.headers)?;
        if state.config.is_admin_token(token) {
            Ok(Admin)
        } else if state.config.principal_by_token(token).is_some() {
            Err(ApiError::PermissionDenied)
        } else {
            Err(ApiError::Unauthenticated)
        }
    }
}

/// Reads a whole body, refusing it with 413 beyond `limit` bytes.
pub async fn read_body(headers: &HeaderMap, body: Body, limit: u64) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::PayloadTooLarge);
    }
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_large = std::error::Error::source(&e)
            .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
        if too_large {
            ApiError::PayloadTooLarge
        } else {
            ApiError::invalid("body", "the request body could not be read")
        }
    })
}

pub(crate) fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let mime = value
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

/// Parses JSON strictly. Errors never quote the body: bad syntax says so, a wrong field names
/// the field (as `param`) and nothing else.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(&mut de);
    if parsed.is_ok() && de.end().is_err() {
        return Err(ApiError::InvalidArgument {
            detail: "the request body is not valid JSON".into(),
            param: None,
        });
    }
    parsed.map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::InvalidArgument {
                detail: "the request body is not valid JSON".into(),
                param: None,
            };
        }
        let message = inner.to_string();
        let quoted = message.split('`').nth(1).map(str::to_owned);
        let (detail, param) = if message.starts_with("unknown field") {
            let field = quoted.unwrap_or_default();
            let param = match path.as_str() {
                "." | "" => field.clone(),
                p if p.ends_with(&field) => p.to_owned(),
                p => format!("{p}.{field}"),
            };
            (format!("unknown field `{field}`"), param)
        } else if message.starts_with("missing field") {
            let field = quoted.unwrap_or_default();
            let param = if path == "." {
                field.clone()
            } else {
                format!("{path}.{field}")
            };
            (format!("missing field `{field}`"), param)
        } else {
            ("a field has the wrong type or value".to_owned(), path)
        };
        let param = if param.is_empty() || param == "." {
            None
        } else {
            Some(param)
        };
        ApiError::InvalidArgument { detail, param }
    })
}

/// A JSON body (required), with the raw bytes kept for idempotency hashing.
#[derive(Debug)]
pub struct Json<T> {
    pub value: T,
    pub raw: Bytes,
}

impl<T: DeserializeOwned + Send> FromRequest<AppState> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let (parts, body) = req.into_parts();
        if !is_json(&parts.headers) {
            return Err(ApiError::UnsupportedMediaType);
        }
        let raw = read_body(&parts.headers, body, state.config.limits.max_body_bytes).await?;
        Ok(Json {
            value: parse_json(&raw)?,
            raw,
        })
    }
}

/// A JSON body that may be left out entirely (an empty body): then `T::default()`.
#[derive(Debug)]
pub struct OptionalJson<T> {
    pub value: T,
    pub raw: Bytes,
}

impl<T: DeserializeOwned + Default + Send> FromRequest<AppState> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let (parts, body) = req.into_parts();
        let raw = read_body(&parts.headers, body, state.config.limits.max_body_bytes).await?;
        if raw.is_empty() {
            return Ok(OptionalJson {
                value: T::default(),
                raw,
            });
        }
        if !is_json(&parts.headers) {
            return Err(ApiError::UnsupportedMediaType);
        }
        Ok(OptionalJson {
            value: parse_json(&raw)?,
            raw,
        })
    }
}

/// The decoded query string, in order; unknown parameters are ignored by handlers.
#[derive(Debug, Clone, Default)]
pub struct QueryPairs(pub Vec<(String, String)>);

impl QueryPairs {
    pub fn parse(raw: Option<&str>) -> Self {
        let pairs = raw
            .unwrap_or("")
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (percent_decode(k), percent_decode(v))
            })
            .collect();
        QueryPairs(pairs)
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

impl<S: Send + Sync> FromRequestParts<S> for QueryPairs {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        Ok(QueryPairs::parse(parts.uri.query()))
    }
}

/// Decodes `%XX` escapes and `+`; invalid escapes are kept literally.
pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len()
                && bytes[i + 1].is_ascii_hexdigit()
                && bytes[i + 2].is_ascii_hexdigit() =>
            {
                let hex = |b: u8| (b as char).to_digit(16).unwrap_or(0) as u8;
                out.push(hex(bytes[i + 1]) * 16 + hex(bytes[i + 2]));
                i += 3;
                continue;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The optional `Idempotency-Key` header: 1 to 255 visible ASCII characters.
#[derive(Debug, Clone)]
pub struct IdempotencyKey(pub Option<String>);

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        idempotency_key(&parts.headers).map(IdempotencyKey)
    }
}

/// The `Idempotency-Key` header, if any, validated.
pub(crate) fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let bad = || {
        ApiError::invalid(
            "Idempotency-Key",
            "the idempotency key must be 1 to 255 visible ASCII characters",
        )
    };
    let key = value.to_str().map_err(|_| bad())?;
    if key.is_empty() || key.len() > 255 || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad());
    }
    Ok(Some(key.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[expect(dead_code, reason = "fields are only deserialized")]
    struct Outer {
        a: Option<u32>,
        inner: Option<Inner>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[expect(dead_code, reason = "fields are only deserialized")]
    struct Inner {
        b: u32,
    }

    fn param(body: &str) -> Option<String> {
        match parse_json::<Outer>(body.as_bytes()) {
            Err(ApiError::InvalidArgument { param, .. }) => param,
            other => panic!("expected invalid_argument for {body}, got {other:?}"),
        }
    }

    #[test]
    fn json_errors_name_the_field_and_never_the_value() {
        assert_eq!(param(r#"{"zzz": 1}"#).as_deref(), Some("zzz"));
        assert_eq!(
            param(r#"{"inner": {"b": 1, "c": 2}}"#).as_deref(),
            Some("inner.c")
        );
        assert_eq!(param(r#"{"a": "secret"}"#).as_deref(), Some("a"));
        assert_eq!(param(r#"{"inner": {}}"#).as_deref(), Some("inner.b"));
        assert_eq!(param(r#"{"a": 1"#), None);
        assert_eq!(param(r#"{"a": 1} x"#), None);
        let Err(err) = parse_json::<Outer>(br#"{"a": "secret"}"#) else {
            panic!()
        };
        assert!(!err.to_string().contains("secret"));
    }

    #[test]
    fn query_decoding() {
        let q = QueryPairs::parse(Some("path=a%2Fb+c&metadata.k=v%zz&x"));
        assert_eq!(q.get("path"), Some("a/b c"));
        assert_eq!(q.get("metadata.k"), Some("v%zz"));
        assert_eq!(q.get("x"), Some(""));
    }
}
