//! What a run says about its target before anything is started or connected to: the protocol,
//! where the target is (the reference server the runner starts, a URL, or a service it
//! launches), and how the run treats it. [`super::Target::open`] turns it into a target.

use std::path::PathBuf;
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::capabilities::Capabilities;
use super::error::TargetError;
use super::read::ReadLimits;
use super::reference::ReferenceOptions;
use crate::mcp::{McpServer, McpServerSpec};
use crate::profile::{Api, Launched};

/// A target to open.
#[derive(Debug, Clone)]
pub struct TargetSpec {
    /// The protocol the run speaks.
    pub api: Api,
    pub endpoint: Endpoint,
    /// Features to treat as advertised even if the target does not say so.
    pub assume: Vec<String>,
    /// Features to treat as missing.
    pub drop: Vec<String>,
    /// How long a plain request may wait for its response headers, and then for each read of
    /// its body (`--request-timeout`).
    pub request_timeout: Duration,
    /// The run's wait budget (`--max-wait`); `None` waits everything out.
    pub wait_budget: Option<Duration>,
    /// The caps on what the target sends (`--max-body-bytes`, `--max-event-bytes`).
    pub limits: ReadLimits,
    /// With `--api mcp`: the sandbox MCP server under test (a command line, or a URL and the
    /// variable holding its token) and its tool map (a built-in name or a file).
    pub mcp_server: Option<McpServerSpec>,
    pub tool_map: String,
    /// E2B's envd domain (`--envd-domain`).
    pub envd_domain: Option<String>,
}

/// Where the target is.
#[derive(Debug, Clone)]
pub enum Endpoint {
    /// The reference server, started by the runner.
    Reference(ReferenceOptions),
    /// A deployment at a URL.
    Url(UrlEndpoint),
    /// The service under test, started by the runner with this command (`sh -c`).
    Launch(String),
}

/// A deployment at a URL, with the environment variables that hold its principals' tokens.
#[derive(Debug, Clone)]
pub struct UrlEndpoint {
    pub url: String,
    pub owner_token_env: String,
    pub other_token_env: String,
    pub admin_token_env: Option<String>,
    /// The variable holding the token of a principal without the operations' rights.
    pub unscoped_token_env: Option<String>,
    /// A private CA to trust, and only it.
    pub ca_file: Option<PathBuf>,
    /// A second endpoint of the same deployment.
    pub peer_url: Option<String>,
    /// The directory the target confines files to, as scenarios see it (`{{base_dir}}`).
    pub base_dir: Option<String>,
    /// A target that is not on loopback may be used without asking.
    pub live: bool,
}

impl UrlEndpoint {
    /// A deployment at `url` on loopback, or one the run has consent for already, with the
    /// principals' tokens in the named variables and nothing else given.
    pub fn new(url: &str, owner_token_env: &str, other_token_env: &str) -> Self {
        UrlEndpoint {
            url: url.to_owned(),
            owner_token_env: owner_token_env.to_owned(),
            other_token_env: other_token_env.to_owned(),
            admin_token_env: None,
            unscoped_token_env: None,
            ca_file: None,
            peer_url: None,
            base_dir: None,
            live: false,
        }
    }
}

impl TargetSpec {
    /// A spec for `endpoint` speaking `api`, with the runner's defaults: nothing assumed or
    /// dropped, the default request timeout, no wait budget, the reference tool map.
    pub fn new(api: Api, endpoint: Endpoint) -> Self {
        TargetSpec {
            api,
            endpoint,
            assume: Vec::new(),
            drop: Vec::new(),
            request_timeout: super::conn::DEFAULT_REQUEST_TIMEOUT,
            wait_budget: None,
            limits: ReadLimits::default(),
            mcp_server: None,
            tool_map: "reference".to_owned(),
            envd_domain: None,
        }
    }

    /// Checks everything about the spec that can be checked before anything starts: the
    /// capability overrides, and the flags that belong to one profile (an MCP server to
    /// drive, a service to launch, a target the reference server does not serve).
    pub fn check(self) -> Result<CheckedSpec, TargetError> {
        let profile = self.api.profile();
        Capabilities::default()
            .override_features(&self.assume, &self.drop)
            .map_err(TargetError::Usage)?;
        let mcp = profile
            .mcp_server(self.mcp_server.as_ref(), &self.tool_map)
            .map_err(TargetError::Usage)?;
        // A server already running was told its control plane by whoever started it: the run
        // must check on that one, which only --target can name.
        if mcp.as_ref().is_some_and(|m| !m.follows_deployment())
            && !matches!(self.endpoint, Endpoint::Url(_))
        {
            return Err(TargetError::Usage(
                "--mcp-url needs --target URL: the E2B control plane the MCP server at that URL \
                 uses, with --owner-token-env naming the API key it was given (the runner \
                 cannot point a server it did not start at a control plane of its own)"
                    .into(),
            ));
        }
        let opening = match self.endpoint {
            Endpoint::Launch(command) => Opening::Launch(profile.launch(&command).ok_or_else(|| {
                TargetError::Usage(
                    "--launch starts the service of `--api agent-sandbox`; other profiles take --target or the reference server".into(),
                )
            })?),
            Endpoint::Reference(_) if !profile.served_by_reference() => {
                return Err(TargetError::Usage(format!(
                    "--api {} needs --launch COMMAND or --target URL: the reference server does not serve it",
                    self.api.name()
                )));
            }
            Endpoint::Reference(options) => Opening::Reference(options),
            Endpoint::Url(url) => Opening::Url(url),
        };
        Ok(CheckedSpec {
            api: self.api,
            opening,
            assume: self.assume,
            drop: self.drop,
            request_timeout: self.request_timeout,
            wait_budget: self.wait_budget,
            limits: self.limits,
            envd_domain: self.envd_domain,
            mcp,
        })
    }
}

/// A spec whose flags fit its profile, ready for [`super::Target::open`].
pub struct CheckedSpec {
    pub(super) api: Api,
    pub(super) opening: Opening,
    pub(super) assume: Vec<String>,
    pub(super) drop: Vec<String>,
    pub(super) request_timeout: Duration,
    pub(super) wait_budget: Option<Duration>,
    pub(super) limits: ReadLimits,
    pub(super) envd_domain: Option<String>,
    /// The MCP server the profile drives, with its tool map loaded.
    pub(super) mcp: Option<McpServer>,
}

/// How a checked spec's target is reached.
pub(super) enum Opening {
    Reference(ReferenceOptions),
    Url(UrlEndpoint),
    /// The profile's start of the service `--launch` names; it runs when awaited.
    Launch(BoxFuture<'static, Result<Launched, TargetError>>),
}
