//! The command line of the runner: the arguments of `sandspec run`, `sandspec list` and
//! `sandspec sweep`, and the exit codes. What the commands do is [`crate::commands`]'.
//!
//! Exit codes: 0 conformant, 1 not conformant, 2 usage error (bad flags, broken scenario
//! file), 3 harness error (target unreachable, reference server would not start, a scenario
//! the harness could not judge).

use std::path::PathBuf;

use clap::Args;

/// Exit code: every MUST scenario of the profile ran and passed.
pub const EXIT_CONFORMANT: u8 = 0;
/// Exit code: the profile is partial or non-conformant.
pub const EXIT_NOT_CONFORMANT: u8 = 1;
/// Exit code: bad flags (`--certify` with a narrowed selection among them) or a broken
/// scenario file.
pub const EXIT_USAGE: u8 = 2;
/// Exit code: the harness could not do its job (target unreachable, server would not start).
pub const EXIT_HARNESS: u8 = 3;
/// Exit code: interrupted with Ctrl-C; the evidence folder was written and says so.
pub const EXIT_INTERRUPTED: u8 = 130;

const EXIT_CODES_HELP: &str = "Exit codes:
  0  conformant: every MUST scenario of the profile ran and passed (with
     --expected-failures: the gate passed)
  1  not conformant: a MUST scenario failed, was skipped, or none ran, or the run
     left something behind (with --expected-failures: the gate failed)
  2  usage error: bad flags (--certify with --filter, --shard or --family) or a
     broken scenario file
  3  harness error: target unreachable, reference server would not start,
     or a scenario the harness could not judge
  130  interrupted (Ctrl-C): running scenarios finished and cleaned up, evidence
     written with the scenarios that never ran";

/// The built-in catalog: `scenarios/` of this crate's source tree.
fn default_scenarios_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios")
}

/// `sandspec run`.
#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub struct RunArgs {
    /// The protocol to certify: sandspec's `/v1`, or E2B's control plane and envd (its
    /// catalog is the `e2b/` folder of the scenario directory; credentials go in
    /// `X-API-Key`; the target's support is what `--assume-capability` says).
    #[arg(long, value_enum, default_value_t = crate::profile::Api::V1)]
    pub api: crate::profile::Api,
    /// E2B's envd domain: reach envd at `https://49983-<sandboxID>.<DOMAIN>`, as the SDK does
    /// against E2B's cloud (`e2b.app`). Without it envd is reached on `--target` with the
    /// `E2b-Sandbox-Id` and `E2b-Sandbox-Port` headers.
    #[arg(long, value_name = "DOMAIN", requires = "target")]
    pub envd_domain: Option<String>,
    /// With `--api mcp`: the command line that starts the sandbox MCP server under test on
    /// stdio (split on whitespace; single and double quotes group), e.g. `"sandspec mcp"`.
    #[arg(long, value_name = "COMMAND")]
    pub mcp_server: Option<String>,
    /// With `--api mcp` and --target: the URL of a sandbox MCP server already running, driven
    /// over MCP's streamable HTTP transport (one HTTP session per scenario session, ended by
    /// `DELETE`); --target is the E2B control plane that server uses.
    #[arg(long, value_name = "URL", conflicts_with = "mcp_server")]
    pub mcp_url: Option<String>,
    /// With --mcp-url: the environment variable holding the server's bearer token (sent as
    /// `Authorization: Bearer`).
    #[arg(long, value_name = "NAME", requires = "mcp_url")]
    pub mcp_token_env: Option<String>,
    /// With `--api mcp`: the server's tool map, a built-in name (`reference`,
    /// `agent-sandbox-client`) or a YAML file (`docs/profiles/mcp.md`).
    #[arg(long, value_name = "NAME|FILE", default_value = "reference")]
    pub tool_map: String,
    /// Base URL of the implementation under test. Without it the runner starts the reference
    /// server itself (SQLite in a temporary directory, port 0, test controls on).
    #[arg(long, value_name = "URL")]
    pub target: Option<String>,
    /// Start the service under test with this command (`sh -c`), for `--api agent-sandbox`:
    /// it gets `$SANDSPEC_PORT` (a free loopback port), `$SANDSPEC_POLICY` (a policy file
    /// naming two principals whose fresh tokens are in `$SANDSPEC_OWNER_TOKEN` and
    /// `$SANDSPEC_OTHER_TOKEN`, and a third without rights, `$SANDSPEC_UNSCOPED_TOKEN`) and
    /// `$SANDSPEC_BASE_DIR`; the run waits for `GET /health` and stops the command's process
    /// group at the end.
    #[arg(long, value_name = "COMMAND", conflicts_with = "target")]
    pub launch: Option<String>,
    /// The directory the target confines files to, for `--api agent-sandbox` with --target
    /// (scenarios see it as `{{base_dir}}`).
    #[arg(long, value_name = "DIR", requires = "target")]
    pub base_dir: Option<String>,
    /// Environment variable holding the owner principal's token (with --target).
    #[arg(long, value_name = "NAME", requires = "target")]
    pub owner_token_env: Option<String>,
    /// Environment variable holding the other principal's token (with --target).
    #[arg(long, value_name = "NAME", requires = "target")]
    pub other_token_env: Option<String>,
    /// Environment variable holding the test-controls admin token (with --target).
    #[arg(long, value_name = "NAME", requires = "target")]
    pub admin_token_env: Option<String>,
    /// Environment variable holding the token of a principal the target knows that holds
    /// none of the rights its operations need (with --target), for the scenarios that check a
    /// valid token without the right is refused.
    #[arg(long, value_name = "NAME", requires = "target")]
    pub unscoped_token_env: Option<String>,
    /// PEM file of a private CA to trust (only it) for an https target.
    #[arg(long, value_name = "FILE", requires = "target")]
    pub ca_file: Option<PathBuf>,
    /// Base URL of a second endpoint of the same deployment (another server process on the
    /// same database, taking the same tokens), for scenarios that require a peer.
    #[arg(long, value_name = "URL", requires = "target")]
    pub peer_url: Option<String>,
    /// Treat this feature as advertised even if the target does not say so (repeatable).
    #[arg(long, value_name = "FEATURE")]
    pub assume_capability: Vec<String>,
    /// Treat this feature as missing: its scenarios are skipped (repeatable).
    #[arg(long, value_name = "FEATURE")]
    pub drop_capability: Vec<String>,
    /// Scenario family to run: a folder of the profile's catalog (`lifecycle`, `streaming`),
    /// or `all`. (`--profile` is the older name of this flag.)
    #[arg(long, alias = "profile", value_name = "FAMILY", default_value = "all")]
    pub family: String,
    /// Run only scenarios whose ID, title, family or tags contain this text (repeatable; any
    /// match selects).
    #[arg(long, value_name = "SUBSTR")]
    pub filter: Vec<String>,
    /// Scenarios run at once [default: 8 against the reference server the runner starts, 4
    /// against --target or --launch]. An exclusive scenario runs alone: on a deployment of its
    /// own beside the others where the runner can start one, otherwise after them.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub jobs: Option<u32>,
    /// Run only shard i of n (1-based), e.g. `2/4`.
    #[arg(long, value_name = "I/N", value_parser = parse_shard)]
    pub shard: Option<Shard>,
    /// Write the evidence folder here instead of `evidence/runs/<run-id>/` (it must not exist
    /// or be empty).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// With `--api e2b`: run the profile's SDK journeys with this real SDK, installed at this
    /// exact version (`python:e2b==2.63.0`, `node:e2b@2.51.0`; repeatable; `default` stands for
    /// the newest Python and JavaScript releases and one older major). The newest release of
    /// each language judges the target; older ones are reported in the matrix. A sharded run
    /// runs the matrix in its first shard.
    #[arg(long, value_name = "SPEC")]
    pub sdk: Vec<String>,
    /// Where `--sdk` installs SDKs (virtualenvs, npm prefixes), reused by later runs
    /// [default: $XDG_CACHE_HOME/sandspec/sdk or ~/.cache/sandspec/sdk].
    #[arg(long, value_name = "DIR")]
    pub sdk_cache: Option<PathBuf>,
    /// A label recorded in the receipt's selection, the same for every shard of one run
    /// (e.g. the CI pipeline's ID): what `sandspec evidence merge` ties the shards by.
    #[arg(long, value_name = "TEXT")]
    pub label: Option<String>,
    /// Write JUnit XML to this file.
    #[arg(long, value_name = "FILE")]
    pub junit: Option<PathBuf>,
    /// Sign the receipt with this Ed25519 private key (PKCS#8 PEM, as `openssl genpkey
    /// -algorithm ed25519` writes it): the folder gets `receipt.dsse.json`, a DSSE envelope
    /// that `sandspec evidence verify --key PUBFILE` checks.
    #[arg(long, value_name = "FILE")]
    pub sign_key: Option<PathBuf>,
    /// A baseline of known failures (YAML: `id`, optional `step`, `reason`, optional `link`
    /// and `expires`): the exit code is then the gate's, which passes when every failure is
    /// one the baseline lists, at its step, and fails on any other failure, on an entry whose
    /// scenario now passes (stale) and on an expired entry. The verdict is unchanged.
    #[arg(long, value_name = "FILE")]
    pub expected_failures: Option<PathBuf>,
    /// Certification run: the whole catalog (no --filter, --shard or --family), and any skip
    /// makes the run non-conformant.
    #[arg(long)]
    pub certify: bool,
    /// Re-run a failed scenario up to N times; a later pass is reported FLAKY.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub retries: u32,
    /// Wait budget per scenario (`90s`, `2m`, `1h`, or `none` to wait everything out): a
    /// scenario whose advertised waits (retention, stream duration, ... from the target's
    /// capabilities, and its own sleeps) exceed it is skipped, with the numbers.
    #[arg(long, value_name = "DURATION", default_value = "2m", value_parser = parse_max_wait)]
    pub max_wait: MaxWait,
    /// How long a request may wait for its response headers, and then for each read of its
    /// body (`30s`, `2m`); a stream waits as long as its step declares.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_timeout)]
    pub request_timeout: std::time::Duration,
    /// The most a response body may hold, an event stream's and a Connect stream's included
    /// (`65536`, `64K`, `16M`, `1G`): read as it arrives, the step that reads more fails, with
    /// the size, and its connection is closed [default: 64M].
    #[arg(long, value_name = "BYTES", value_parser = crate::target::parse_size)]
    pub max_body_bytes: Option<u64>,
    /// The most one SSE line or event, one Connect message or one MCP message may hold
    /// [default: 16M].
    #[arg(long, value_name = "BYTES", value_parser = crate::target::parse_size)]
    pub max_event_bytes: Option<u64>,
    /// Sandboxes the run may hold at once (an account's limit): a scenario starts only when
    /// what its steps may create fits beside those running, and one that may hold more than N
    /// is skipped.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_sandboxes: Option<u64>,
    /// Sandbox-seconds the run may use (what a platform bills): once its sandboxes have been
    /// held that long in all, no further scenario starts; the running ones finish and clean
    /// up, the run is swept, and its verdict says the budget ended it.
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_sandbox_seconds: Option<u64>,
    /// Allow a target that is not on loopback without asking: a live run against a real
    /// deployment, whose resources are tagged with the run ID and swept at the end.
    #[arg(long, requires = "target")]
    pub live: bool,
    /// Start the reference server with this deliberate defect (reference target only).
    #[arg(long, value_name = "NAME", conflicts_with = "target")]
    pub defect: Vec<String>,
    /// Database for the reference server (reference target only).
    #[arg(long, value_name = "URL", conflicts_with = "target")]
    pub database_url: Option<String>,
    /// Scenario catalog directory.
    #[arg(long, value_name = "DIR", default_value_os_t = default_scenarios_dir())]
    pub scenarios: PathBuf,
}

/// `sandspec list`.
#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub struct ListArgs {
    /// The protocol profile whose catalog to list.
    #[arg(long, value_enum, default_value_t = crate::profile::Api::V1)]
    pub api: crate::profile::Api,
    /// Scenario catalog directory.
    #[arg(long, value_name = "DIR", default_value_os_t = default_scenarios_dir())]
    pub scenarios: PathBuf,
    /// Only scenarios matching this text (repeatable).
    #[arg(long, value_name = "SUBSTR")]
    pub filter: Vec<String>,
}

/// `sandspec sweep`: removes test resources left by earlier, interrupted runs.
#[derive(Debug, Clone, Args)]
#[command(after_help = "Exit codes:
  0  every leftover found was removed (or none was found)
  1  a leftover could not be removed
  2  usage error
  3  the target could not be reached")]
pub struct SweepArgs {
    /// The protocol the target speaks: `v1` sweeps `/v1` sessions and sandboxes, `e2b` the
    /// sandboxes of E2B's control plane (the token is the team's API key).
    #[arg(long, value_enum, default_value_t = crate::profile::Api::V1)]
    pub api: crate::profile::Api,
    /// Base URL of the target.
    #[arg(long, value_name = "URL")]
    pub target: String,
    /// Environment variable holding a principal's token whose leftovers are swept.
    #[arg(long, value_name = "NAME")]
    pub owner_token_env: String,
    /// Environment variable holding a second principal's token, swept too.
    #[arg(long, value_name = "NAME")]
    pub other_token_env: Option<String>,
    /// PEM file of a private CA to trust (only it) for an https target.
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
    /// Only resources created at least this long ago (`30m`, `2h`, `1d`), so that a run in
    /// progress is left alone.
    #[arg(long, value_name = "AGE", default_value = "30m", value_parser = crate::live::parse_age)]
    pub older_than: std::time::Duration,
    /// List what would be removed without removing it.
    #[arg(long)]
    pub dry_run: bool,
    /// The most a list's answer may hold (`16M`, `1G`) [default: 64M].
    #[arg(long, value_name = "BYTES", value_parser = crate::target::parse_size)]
    pub max_body_bytes: Option<u64>,
    /// Allow a target that is not on loopback without asking.
    #[arg(long)]
    pub live: bool,
}

impl RunArgs {
    /// The caps on what the target sends, from `--max-body-bytes` and `--max-event-bytes`.
    pub fn read_limits(&self) -> crate::target::ReadLimits {
        let default = crate::target::ReadLimits::default();
        crate::target::ReadLimits {
            body: self.max_body_bytes.unwrap_or(default.body),
            event: self.max_event_bytes.unwrap_or(default.event),
        }
    }
}

/// `--max-wait`: the wait budget of one scenario; `None` waits everything out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxWait(pub Option<std::time::Duration>);

fn parse_max_wait(s: &str) -> Result<MaxWait, String> {
    crate::engine::waits::parse_max_wait(s).map(MaxWait)
}

/// `--request-timeout`: an age such as `30s` or `2m`, more than zero.
fn parse_timeout(s: &str) -> Result<std::time::Duration, String> {
    let d = crate::live::parse_age(s)?;
    if d.is_zero() {
        return Err("the request timeout must be more than 0s".into());
    }
    Ok(d)
}

/// `--shard i/n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// Parses `i/n` with 1 <= i <= n.
pub fn parse_shard(s: &str) -> Result<Shard, String> {
    let (i, n) = s.split_once('/').ok_or("expected I/N, e.g. 2/4")?;
    let index: usize = i
        .trim()
        .parse()
        .map_err(|_| format!("`{i}` is not a number"))?;
    let count: usize = n
        .trim()
        .parse()
        .map_err(|_| format!("`{n}` is not a number"))?;
    if count == 0 || index == 0 || index > count {
        return Err(format!("shard {index}/{count}: need 1 <= I <= N"));
    }
    Ok(Shard { index, count })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_parsing() {
        assert_eq!(parse_shard("2/4"), Ok(Shard { index: 2, count: 4 }));
        assert!(parse_shard("0/4").is_err());
        assert!(parse_shard("5/4").is_err());
        assert!(parse_shard("1/0").is_err());
        assert!(parse_shard("x").is_err());
    }
}
