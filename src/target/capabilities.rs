//! What a target supports: the capability document of `GET /v1/capabilities`, the names a
//! scenario may require, and the run's overrides (`--assume-capability`,
//! `--drop-capability`).

use std::collections::BTreeMap;
use std::time::Duration;

use super::conn::describe_reqwest;
use super::error::TargetError;
use super::read::{ReadLimits, read_body};
use super::throttle::send_patiently;
use super::usage::Usage;

/// Capabilities a scenario may require. Features come from `capabilities.features`
/// ([`FEATURES`]); `two_providers` means at least two providers are advertised (for
/// `{{provider.other}}`); `peer` and `admin_token` are what the runner was given (a second
/// endpoint, the test-controls admin token); `server_control` and `database_control` are
/// what the runner itself started and may therefore kill, restart, stop and start (the
/// reference server's processes, the private PostgreSQL cluster of its database);
/// `isolation` means `capabilities.isolation.namespaces` holds user, mount, pid and network;
/// `memory_limit` means `capabilities.isolation.enforced` holds `memory`.
pub const CAPABILITIES: &[&str] = &[
    "pause",
    "snapshots",
    "previews",
    "test_controls",
    "sessions",
    "fixture_models",
    "expiry_hold",
    "two_providers",
    "peer",
    "admin_token",
    "server_control",
    "database_control",
    "restart",
    "isolation",
    "memory_limit",
];

/// Capabilities a target advertises in `capabilities.features`: the optional parts of the
/// contract, and what only a test deployment offers (test controls, the fixture model
/// scripts, the expiry hold).
pub const FEATURES: &[&str] = &[
    "pause",
    "snapshots",
    "previews",
    "test_controls",
    "sessions",
    "fixture_models",
    "expiry_hold",
];

/// One provider as advertised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provider {
    pub name: String,
    pub default: bool,
}

/// What the target says it supports (`GET /v1/capabilities`).
#[derive(Debug, Clone, Default)]
pub struct Capabilities {
    pub features: Vec<String>,
    pub providers: Vec<Provider>,
    pub limits: BTreeMap<String, i64>,
    pub retention: BTreeMap<String, i64>,
    pub server_name: Option<String>,
    pub server_version: Option<String>,
    /// The directory a profile without `/v1/capabilities` confines files to, as scenarios
    /// see it (`{{base_dir}}`): the launched service's, or `--base-dir`.
    pub base_dir: Option<String>,
    /// The document as received, for the report.
    pub raw: serde_json::Value,
}

impl Capabilities {
    /// Reads the capability document; a body that is not the documented shape is an error.
    pub fn from_json(raw: serde_json::Value) -> Result<Self, String> {
        let features = raw
            .get("features")
            .and_then(|f| f.as_array())
            .ok_or("`features` is missing or not an array")?
            .iter()
            .map(|f| {
                f.as_str()
                    .map(str::to_owned)
                    .ok_or("a feature is not a string")
            })
            .collect::<Result<Vec<_>, _>>()?;
        let providers = raw
            .get("providers")
            .and_then(|p| p.as_array())
            .ok_or("`providers` is missing or not an array")?
            .iter()
            .map(|p| {
                let name = p
                    .get("name")
                    .and_then(|n| n.as_str())
                    .ok_or("a provider has no name")?;
                Ok(Provider {
                    name: name.to_owned(),
                    default: p.get("default").and_then(|d| d.as_bool()).unwrap_or(false),
                })
            })
            .collect::<Result<Vec<_>, &str>>()?;
        if providers.is_empty() {
            return Err("no providers advertised".into());
        }
        let numbers = |key: &str| -> BTreeMap<String, i64> {
            raw.get(key)
                .and_then(|m| m.as_object())
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, v)| v.as_i64().map(|n| (k.clone(), n)))
                        .collect()
                })
                .unwrap_or_default()
        };
        let server = raw.get("server");
        Ok(Capabilities {
            features,
            providers,
            limits: numbers("limits"),
            retention: numbers("retention"),
            server_name: server
                .and_then(|s| s.get("name"))
                .and_then(|n| n.as_str())
                .map(str::to_owned),
            server_version: server
                .and_then(|s| s.get("version"))
                .and_then(|n| n.as_str())
                .map(str::to_owned),
            base_dir: None,
            raw,
        })
    }

    /// Applies command-line overrides: features to treat as advertised, and features to
    /// treat as missing (their scenarios are skipped). Only feature names are accepted.
    pub fn override_features(&mut self, assume: &[String], drop: &[String]) -> Result<(), String> {
        for name in assume.iter().chain(drop) {
            if !FEATURES.contains(&name.as_str()) {
                return Err(format!(
                    "unknown capability `{name}` (known: {})",
                    FEATURES.join(", ")
                ));
            }
        }
        for name in assume {
            if !self.features.contains(name) {
                self.features.push(name.clone());
            }
        }
        self.features.retain(|f| !drop.contains(f));
        Ok(())
    }

    pub fn has(&self, capability: &str) -> bool {
        match capability {
            "two_providers" => self.providers.len() >= 2,
            "isolation" => ["user", "mount", "pid", "network"]
                .iter()
                .all(|ns| self.isolation_lists("namespaces", ns)),
            "memory_limit" => self.isolation_lists("enforced", "memory"),
            feature => self.features.iter().any(|f| f == feature),
        }
    }

    /// Whether the advertised `isolation.<key>` array holds `item`.
    fn isolation_lists(&self, key: &str, item: &str) -> bool {
        self.raw
            .get("isolation")
            .and_then(|i| i.get(key))
            .and_then(|v| v.as_array())
            .is_some_and(|a| a.iter().any(|v| v.as_str() == Some(item)))
    }

    pub fn default_provider(&self) -> &str {
        self.providers
            .iter()
            .find(|p| p.default)
            .unwrap_or(&self.providers[0])
            .name
            .as_str()
    }

    /// A provider other than the default one, if there is one.
    pub fn other_provider(&self) -> Option<&str> {
        let default = self.default_provider();
        self.providers
            .iter()
            .map(|p| p.name.as_str())
            .find(|n| *n != default)
    }
}

/// `GET /v1/capabilities` as the owner, its answer read under `limits`, throttling waited
/// out; counted in `usage`.
pub async fn fetch_capabilities(
    client: &reqwest::Client,
    base_url: &str,
    token: &str,
    limits: ReadLimits,
    usage: &Usage,
) -> Result<Capabilities, TargetError> {
    let url = format!("{base_url}/v1/capabilities");
    let request = client
        .get(&url)
        .bearer_auth(token)
        .timeout(Duration::from_secs(15));
    let response = send_patiently(request, usage)
        .await
        .map_err(|e| TargetError::Unreachable {
            url: url.clone(),
            reason: describe_reqwest(&e),
        })?;
    let status = response.status();
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let body = read_body(response, limits, None)
        .await
        .map_err(|e| TargetError::Unreachable {
            url: url.clone(),
            reason: e.to_string(),
        })?;
    usage.received(body.len() as u64);
    if !status.is_success() {
        return Err(TargetError::BadCapabilities {
            url,
            reason: format!("status {status}"),
        });
    }
    let json: serde_json::Value =
        serde_json::from_slice(&body).map_err(|_| TargetError::BadCapabilities {
            url: url.clone(),
            reason: format!("body is not JSON (content-type `{content_type}`)"),
        })?;
    Capabilities::from_json(json).map_err(|reason| TargetError::BadCapabilities { url, reason })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_parse_and_answer() {
        let caps = Capabilities::from_json(serde_json::json!({
            "api_version": "v1",
            "server": {"name": "sandspec-reference", "version": "0.1.0"},
            "providers": [{"name": "local", "default": true}, {"name": "local-b", "default": false}],
            "features": ["pause", "snapshots"],
            "limits": {"heartbeat_interval_s": 15},
            "retention": {"process_output_s": 3600}
        }))
        .unwrap();
        assert!(caps.has("pause") && caps.has("two_providers") && !caps.has("previews"));
        assert_eq!(caps.default_provider(), "local");
        assert_eq!(caps.other_provider(), Some("local-b"));
        assert_eq!(caps.limits["heartbeat_interval_s"], 15);
        assert!(Capabilities::from_json(serde_json::json!({"features": []})).is_err());
        let mut caps = caps;
        caps.override_features(&["previews".into()], &["pause".into()])
            .unwrap();
        assert!(caps.has("previews") && !caps.has("pause") && caps.has("snapshots"));
        assert!(
            caps.override_features(&["teleport".into()], &[])
                .unwrap_err()
                .contains("unknown capability")
        );
    }
}
