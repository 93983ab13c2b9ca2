//! Talking to a target: the HTTP client every request goes through (TLS verification on, no
//! redirects followed), the principals' tokens, and what a profile needs to reach the target
//! outside a scenario ([`Conn`]).

use std::path::Path;
use std::sync::Once;
use std::time::Duration;

use super::error::TargetError;
pub use super::read::describe_reqwest;

/// The default of `--request-timeout`.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Bearer tokens for the principals a scenario can act as.
#[derive(Clone)]
pub struct Tokens {
    pub owner: String,
    pub other: String,
    pub admin: Option<String>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokens { .. }")
    }
}

/// What a profile's sweeps need of the target: where it is, the run's client, and how long
/// a request may take.
pub struct Conn<'a> {
    /// Base URL without a trailing slash.
    pub base_url: &'a str,
    pub client: &'a reqwest::Client,
    pub request_timeout: Duration,
    /// The caps on what the target sends.
    pub limits: super::read::ReadLimits,
    /// What the run consumed: a sweep's requests count too.
    pub usage: &'a super::usage::Usage,
}

/// Installs the ring crypto provider for rustls once per process (reqwest is built with
/// `rustls-no-provider`).
pub fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Another part of the process may have installed one already; either is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Builds an HTTP client: TLS verification on; with `ca`, only that root is trusted.
pub fn build_client(ca: Option<&reqwest::Certificate>) -> Result<reqwest::Client, TargetError> {
    install_crypto_provider();
    let mut builder = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("sandspec/", env!("CARGO_PKG_VERSION")));
    if let Some(ca) = ca {
        builder = builder.tls_certs_only([ca.clone()]);
    }
    builder
        .build()
        .map_err(|e| TargetError::Client(e.to_string()))
}

/// The private CA of `--ca-file`.
pub fn read_ca(path: &Path) -> Result<reqwest::Certificate, TargetError> {
    let pem = std::fs::read(path).map_err(|source| TargetError::CaFile {
        path: path.to_owned(),
        source,
    })?;
    reqwest::Certificate::from_pem(&pem).map_err(|_| TargetError::BadCa(path.to_owned()))
}

/// An `http`/`https` URL without credentials, without its trailing slash.
pub fn checked_base_url(base_url: &str) -> Result<String, TargetError> {
    let url =
        reqwest::Url::parse(base_url).map_err(|_| TargetError::BadUrl(base_url.to_owned()))?;
    if !matches!(url.scheme(), "http" | "https")
        || !url.username().is_empty()
        || url.password().is_some()
    {
        return Err(TargetError::BadUrl(base_url.to_owned()));
    }
    Ok(base_url.trim_end_matches('/').to_owned())
}

/// 32 random bytes, hex-encoded, with a recognisable prefix for the sanitizer.
pub fn random_token() -> String {
    use rand::Rng as _;
    let bytes: [u8; 32] = rand::rng().random();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("sst_{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_fresh_and_never_printed() {
        let a = random_token();
        assert_ne!(a, random_token());
        assert_eq!(a.len(), 4 + 64);
        let tokens = Tokens {
            owner: "o".into(),
            other: "b".into(),
            admin: Some("a".into()),
        };
        assert_eq!(format!("{tokens:?}"), "Tokens { .. }");
    }

    #[test]
    fn base_urls_are_http_without_credentials() {
        assert_eq!(
            checked_base_url("http://127.0.0.1:1/").unwrap(),
            "http://127.0.0.1:1"
        );
        for bad in ["ftp://x", "not a url", "http://user:pw@127.0.0.1:1"] {
            assert!(checked_base_url(bad).unwrap_err().is_usage(), "{bad}");
        }
    }
}
