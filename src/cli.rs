//! `sandspec run` and `sandspec list`: argument parsing, scenario selection, running with
//! `--jobs`, progress, the verdict table, JUnit and `report.json`.
//!
//! Exit codes: 0 conformant, 1 not conformant, 2 usage error (bad flags, broken scenario
//! file), 3 harness error (target unreachable, reference server would not start, a scenario
//! the harness could not judge).

use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use clap::Args;

use crate::engine::{Outcome, run_with_retries};
use crate::report::{RunReport, ScenarioReport, TargetInfo, Verdict, junit_xml};
use crate::scenario::{LoadedScenario, ParseError, load_dir};
use crate::target::{ReferenceOptions, Target, TargetError};

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
  0  conformant: every MUST scenario of the profile ran and passed
  1  not conformant: a MUST scenario failed, was skipped, or none ran
  2  usage error: bad flags (--certify with --filter, --shard or --profile) or a
     broken scenario file
  3  harness error: target unreachable, reference server would not start,
     or a scenario the harness could not judge
  130  interrupted (Ctrl-C): running scenarios finished and cleaned up, evidence
     written with the scenarios that never ran";

/// The MCP server of an `--api mcp` run and its tool map; `None` for other profiles.
fn mcp_server(args: &RunArgs) -> Result<Option<crate::mcp::McpServer>, RunError> {
    if args.api != crate::profile::Api::Mcp {
        return match args.mcp_server {
            Some(_) => Err(RunError::Usage("--mcp-server needs --api mcp".into())),
            None => Ok(None),
        };
    }
    let line = args
        .mcp_server
        .as_deref()
        .ok_or_else(|| RunError::Usage("--api mcp needs --mcp-server \"<command line>\"".into()))?;
    let command = crate::mcp::ServerCommand::parse(line)
        .map_err(|e| RunError::Usage(format!("failed to {e}")))?;
    let map = crate::mcp::ToolMap::load(&args.tool_map)
        .map_err(|e| RunError::Usage(format!("failed to {e}")))?;
    Ok(Some(crate::mcp::McpServer { command, map }))
}

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
    /// `$SANDSPEC_OTHER_TOKEN`) and `$SANDSPEC_BASE_DIR`; the run waits for `GET /health`
    /// and stops the command's process group at the end.
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
    /// Profile to judge: a family folder name, or `all`.
    #[arg(long, default_value = "all")]
    pub profile: String,
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
    /// Write JUnit XML to this file.
    #[arg(long, value_name = "FILE")]
    pub junit: Option<PathBuf>,
    /// Sign the receipt with this Ed25519 private key (PKCS#8 PEM, as `openssl genpkey
    /// -algorithm ed25519` writes it): the folder gets `receipt.dsse.json`, a DSSE envelope
    /// that `sandspec evidence verify --key PUBFILE` checks.
    #[arg(long, value_name = "FILE")]
    pub sign_key: Option<PathBuf>,
    /// Certification run: the whole catalog (no --filter, --shard or --profile), and any skip
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
    /// Allow a target that is not on loopback without asking.
    #[arg(long)]
    pub live: bool,
}

/// `sandspec sweep` from a synchronous `main`.
pub fn sweep_blocking(args: SweepArgs) -> ExitCode {
    match tokio::runtime::Runtime::new() {
        Ok(runtime) => ExitCode::from(runtime.block_on(sweep(args))),
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            ExitCode::from(EXIT_HARNESS)
        }
    }
}

async fn sweep(args: SweepArgs) -> u8 {
    if let Err(e) = crate::live::guard(&args.target, args.live) {
        eprintln!("error: {e}");
        return EXIT_USAGE;
    }
    let mut envs = vec![args.owner_token_env.clone()];
    envs.extend(args.other_token_env.clone());
    let mut failed = false;
    for env in &envs {
        let target = match Target::connect_url_for(
            args.api,
            &args.target,
            env,
            env,
            None,
            args.ca_file.as_deref(),
        )
        .await
        {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: {e}");
                return if e.is_usage() {
                    EXIT_USAGE
                } else {
                    EXIT_HARNESS
                };
            }
        };
        let token = target.tokens.owner.clone();
        match crate::live::sweep_older_than(&target, &token, args.older_than, args.dry_run).await {
            Ok(found) => {
                for s in &found {
                    let what = match (args.dry_run, s.removed) {
                        (true, _) => "would remove",
                        (false, true) => "removed",
                        (false, false) => "could NOT remove",
                    };
                    println!("{what} {} (run {}, principal from ${env})", s.path, s.run);
                    failed |= !args.dry_run && !s.removed;
                }
                if found.is_empty() {
                    println!("nothing to sweep for the principal from ${env}");
                }
            }
            Err(e) => {
                eprintln!("error: {e}");
                return EXIT_HARNESS;
            }
        }
    }
    if failed {
        EXIT_NOT_CONFORMANT
    } else {
        EXIT_CONFORMANT
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

/// Whether a scenario matches any filter (no filters: everything matches).
pub fn matches_filters(s: &LoadedScenario, filters: &[String]) -> bool {
    filters.is_empty()
        || filters.iter().any(|f| {
            let f = f.to_lowercase();
            let sc = &s.scenario;
            sc.id.value.to_lowercase().contains(&f)
                || sc.title.to_lowercase().contains(&f)
                || s.family.to_lowercase().contains(&f)
                || sc.tags.iter().any(|t| t.to_lowercase().contains(&f))
        })
}

/// Selects the scenarios of one shard: positions `index-1, index-1+n, ...` of the list
/// sorted by ID, so shards are disjoint and together cover the list.
pub fn select_shard<T>(items: Vec<T>, shard: Option<Shard>) -> Vec<T> {
    match shard {
        None => items,
        Some(Shard { index, count }) => items
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % count == index - 1)
            .map(|(_, s)| s)
            .collect(),
    }
}

fn print_parse_errors(errors: &[ParseError]) {
    for e in errors {
        eprintln!("error: {e}");
    }
}

/// `sandspec list`: ID, level, clauses, title; then the MUST clauses no listed scenario cites.
pub fn list(args: &ListArgs) -> ExitCode {
    let scenarios = match load_dir(&args.api.catalog(&args.scenarios)) {
        Ok(s) => s,
        Err(errors) => {
            print_parse_errors(&errors);
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let mut must = 0;
    let mut should = 0;
    for s in scenarios
        .iter()
        .filter(|s| matches_filters(s, &args.filter))
    {
        let sc = &s.scenario;
        match sc.level {
            crate::scenario::Level::Must => must += 1,
            crate::scenario::Level::Should => should += 1,
        }
        let clauses: Vec<&str> = sc.clauses.iter().map(|c| c.value.as_str()).collect();
        println!(
            "{:<16} {:<6} {:<24} {}",
            sc.id.value,
            sc.level,
            clauses.join(","),
            sc.title
        );
    }
    println!("{} scenarios ({must} MUST, {should} SHOULD)", must + should);
    // Clause coverage of what was listed: the MUST clauses of docs/protocol.md none cites.
    // Another profile's catalog cites its own document's clauses, not these.
    if args.api != crate::profile::Api::V1 {
        return ExitCode::from(EXIT_CONFORMANT);
    }
    let cited: std::collections::BTreeSet<&str> = scenarios
        .iter()
        .filter(|s| matches_filters(s, &args.filter))
        .flat_map(|s| s.scenario.clauses.iter().map(|c| c.value.as_str()))
        .collect();
    let musts: Vec<&str> = crate::scenario::must_clauses().collect();
    let uncited: Vec<&str> = musts
        .iter()
        .copied()
        .filter(|c| !cited.contains(c))
        .collect();
    println!(
        "{} of {} MUST clauses of docs/protocol.md cited; by none of these scenarios: {}",
        musts.len() - uncited.len(),
        musts.len(),
        if uncited.is_empty() {
            "none".to_owned()
        } else {
            uncited.join(", ")
        }
    );
    ExitCode::from(EXIT_CONFORMANT)
}

/// `sandspec run` from a synchronous `main`: builds a tokio runtime and runs [`run`].
pub fn run_blocking(args: RunArgs) -> ExitCode {
    match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime.block_on(run(args)),
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            ExitCode::from(EXIT_HARNESS)
        }
    }
}

/// `sandspec run`. Call from an async context (the binary's tokio runtime).
pub async fn run(args: RunArgs) -> ExitCode {
    match run_inner(args).await {
        Ok(code) => ExitCode::from(code),
        Err(RunError::Usage(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(EXIT_USAGE)
        }
        Err(RunError::Parse(errors)) => {
            print_parse_errors(&errors);
            ExitCode::from(EXIT_USAGE)
        }
        Err(RunError::Harness(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(EXIT_HARNESS)
        }
    }
}

enum RunError {
    Usage(String),
    Parse(Vec<ParseError>),
    Harness(String),
}

impl From<TargetError> for RunError {
    fn from(e: TargetError) -> Self {
        if e.is_usage() {
            RunError::Usage(e.to_string())
        } else {
            RunError::Harness(e.to_string())
        }
    }
}

async fn run_inner(args: RunArgs) -> Result<u8, RunError> {
    if args.certify && (!args.filter.is_empty() || args.shard.is_some() || args.profile != "all") {
        return Err(RunError::Usage(
            "--certify runs the whole catalog: drop --filter, --shard and --profile".into(),
        ));
    }
    // A key that cannot sign is a usage error found before anything runs.
    let sign_key = args
        .sign_key
        .as_deref()
        .map(crate::evidence::SigningKey::from_file)
        .transpose()
        .map_err(|e| RunError::Usage(format!("--sign-key: {e}")))?;
    // Check the overrides before anything starts.
    crate::target::Capabilities::default()
        .override_features(&args.assume_capability, &args.drop_capability)
        .map_err(RunError::Usage)?;
    let all = load_dir(&args.api.catalog(&args.scenarios)).map_err(RunError::Parse)?;
    let families: std::collections::BTreeSet<&str> =
        all.iter().map(|s| s.family.as_str()).collect();
    if args.profile != "all" && !families.contains(args.profile.as_str()) {
        let known: Vec<&str> = families.iter().copied().collect();
        return Err(RunError::Usage(format!(
            "unknown profile `{}` (known: all, {})",
            args.profile,
            known.join(", ")
        )));
    }
    let selected: Vec<LoadedScenario> = all
        .iter()
        .filter(|s| args.profile == "all" || s.family == args.profile)
        .filter(|s| matches_filters(s, &args.filter))
        .cloned()
        .collect();
    let selected = select_shard(selected, args.shard);
    if selected.is_empty() {
        return Err(RunError::Usage("no scenario selected".into()));
    }
    // What the verdicts speak for: the selection out of the catalog, family by family.
    let per_family = |list: &[LoadedScenario]| {
        let mut counts: std::collections::BTreeMap<String, usize> =
            families.iter().map(|f| ((*f).to_owned(), 0)).collect();
        for s in list {
            *counts.entry(s.family.clone()).or_default() += 1;
        }
        counts
    };
    let mut facts = crate::report::RunFacts {
        certify: args.certify,
        never_ran: 0,
        selected: per_family(&selected),
        catalog: per_family(&all),
    };
    let started_at = now_rfc3339();
    let started = Instant::now();
    if args.launch.is_some() && args.api != crate::profile::Api::AgentSandbox {
        return Err(RunError::Usage(
            "--launch starts the service of `--api agent-sandbox`; other profiles take --target or the reference server".into(),
        ));
    }
    let (target, kind) = match (&args.target, &args.launch) {
        (None, Some(command)) => {
            let service = crate::agent_sandbox::LaunchedService::start(command).await?;
            (Target::launched(args.api, service).await?, "launched")
        }
        (Some(url), _) => {
            crate::live::guard(url, args.live).map_err(|e| RunError::Usage(e.to_string()))?;
            let owner = args
                .owner_token_env
                .as_deref()
                .ok_or_else(|| RunError::Usage("--target needs --owner-token-env".into()))?;
            let other = args
                .other_token_env
                .as_deref()
                .ok_or_else(|| RunError::Usage("--target needs --other-token-env".into()))?;
            let t = Target::connect_url_for(
                args.api,
                url,
                owner,
                other,
                args.admin_token_env.as_deref(),
                args.ca_file.as_deref(),
            )
            .await?;
            let t = match &args.peer_url {
                Some(peer) => {
                    crate::live::guard(peer, args.live)
                        .map_err(|e| RunError::Usage(e.to_string()))?;
                    t.with_peer_url(peer).await?
                }
                None => t,
            };
            let mut t = t;
            t.capabilities.base_dir.clone_from(&args.base_dir);
            (t, "url")
        }
        (None, None) if args.api == crate::profile::Api::AgentSandbox => {
            return Err(RunError::Usage(
                "--api agent-sandbox needs --launch COMMAND or --target URL".into(),
            ));
        }
        (None, None) => {
            let binary = std::env::current_exe()
                .map_err(|e| RunError::Harness(format!("cannot find the sandspec binary: {e}")))?;
            let options = ReferenceOptions {
                binary,
                defects: args.defect.clone(),
                database_url: args.database_url.clone(),
                extra_args: Vec::new(),
                serve_defaults: false,
            };
            (
                Target::start_reference(&options).await?.speaking(args.api),
                "reference",
            )
        }
    };
    let mut target = target;
    target.mcp = mcp_server(&args)?;
    target.request_timeout = args.request_timeout;
    target.envd_domain.clone_from(&args.envd_domain);
    target
        .capabilities
        .override_features(&args.assume_capability, &args.drop_capability)
        .map_err(RunError::Usage)?;
    target.wait_budget = args.max_wait.0;
    // The reference server has a peer, and a database server to stop, only on PostgreSQL:
    // on SQLite, scenarios that need one are not applicable (left out, said so, and recorded
    // in the report and the receipt) rather than skipped, which would make the reference's
    // own run partial. A URL target skips them, and so does a certification run.
    let mut not_applicable = Vec::new();
    let selected = if kind == "reference" && !args.certify {
        let mut rest = Vec::new();
        for s in selected {
            let needs = |cap: &str| s.scenario.requires.iter().any(|r| r.value == cap);
            let reason = if needs("peer") && target.peer.is_none() {
                "needs a peer; the reference server has one only on PostgreSQL (--database-url)"
            } else if needs("database_control") && !target.database_controllable() {
                "stops and starts the database; the reference server has a database server only on PostgreSQL (--database-url)"
            } else {
                rest.push(s);
                continue;
            };
            eprintln!("not applicable: {} {reason}", s.id());
            not_applicable.push(crate::report::NotApplicable {
                id: s.id().to_owned(),
                reason: reason.to_owned(),
            });
        }
        if rest.is_empty() {
            return Err(RunError::Usage(
                "no scenario selected: every selected scenario needs PostgreSQL (--database-url)"
                    .into(),
            ));
        }
        rest
    } else {
        selected
    };
    let run_id = ulid::Ulid::new().to_string().to_lowercase();
    let target = Arc::new(target);
    // The first Ctrl-C lets running scenarios finish (their cleanup included) and starts no
    // more; the receipt then says the run was interrupted and lists what never ran. A second
    // Ctrl-C aborts at once.
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = tokio::spawn({
        let stop = stop.clone();
        async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                stop.store(true, Ordering::SeqCst);
                eprintln!(
                    "interrupted: finishing the running scenarios and their cleanup; Ctrl-C again aborts"
                );
                if tokio::signal::ctrl_c().await.is_ok() {
                    std::process::exit(130);
                }
            }
        }
    });
    let outcomes = run_until_stopped(
        &target,
        &selected,
        &run_id,
        args.jobs
            .map_or_else(|| default_jobs(&target), |j| j as usize),
        args.retries,
        &stop,
        started,
    )
    .await;
    let interrupted = stop.load(Ordering::SeqCst);
    let not_run: Vec<String> = selected
        .iter()
        .zip(&outcomes)
        .filter(|(_, r)| r.is_none())
        .map(|(s, _)| s.scenario.id.value.clone())
        .collect();
    let (selected, results): (Vec<LoadedScenario>, Vec<crate::engine::ScenarioRun>) = selected
        .into_iter()
        .zip(outcomes)
        .filter_map(|(s, r)| r.map(|r| (s, r)))
        .unzip();
    // Values captured as secrets are known only now; the sanitizer must remove them too.
    let captured_secrets: Vec<String> = results
        .iter()
        .flat_map(|r| r.secrets.iter().cloned())
        .collect();
    let scenarios: Vec<ScenarioReport> = selected
        .iter()
        .zip(results)
        .map(|(s, r)| ScenarioReport::new(s, r))
        .collect();
    // Anything still tagged with this run's ID is a cleanup failure of the run. A sweep that
    // cannot finish is a harness error, reported after the evidence is written.
    let run_sweep = crate::live::sweep_run(&target, &run_id).await;
    for s in &run_sweep.found {
        eprintln!(
            "cleanup failure: {} (run {run_id}) was still there after every scenario; {}",
            s.path,
            if s.removed {
                "the sweep removed it"
            } else {
                "the sweep could NOT remove it"
            }
        );
    }
    for i in run_sweep.ignored.iter().filter(|i| i.filtered) {
        eprintln!(
            "warning: GET {} (as {}) returned {} record(s) without this run's tag although \
             it was asked to filter by it; they were left alone",
            i.list, i.principal, i.count
        );
    }
    facts.never_ran = not_run.len();
    let profiles = RunReport::judge(&scenarios, &facts);
    let report = RunReport {
        run_id,
        suite_version: env!("CARGO_PKG_VERSION").to_owned(),
        started_at,
        finished_at: now_rfc3339(),
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        target: TargetInfo {
            kind: kind.to_owned(),
            url: target.base_url.clone(),
            server_name: target.capabilities.server_name.clone(),
            server_version: target.capabilities.server_version.clone(),
            defects: args.defect.clone(),
            capabilities: target.capabilities.raw.clone(),
        },
        profile: args.profile.clone(),
        filters: args.filter.clone(),
        shard: args.shard.map(|s| s.to_string()),
        retries: args.retries,
        certify: args.certify,
        scenarios,
        profiles,
        run_sweep,
        not_applicable,
    };
    let sanitizer = run_sanitizer(&target, &captured_secrets)?;
    print_summary(&crate::evidence::sanitized_report(&report, &sanitizer));
    print_over_budget(&report, args.max_wait);
    let written = write_outputs(
        &args,
        &report,
        &sanitizer,
        &target.canary,
        sign_key,
        interrupted,
        not_run.clone(),
    );
    watcher.abort();
    written.map_err(RunError::Harness)?;
    if let Some(e) = &report.run_sweep.error {
        eprintln!("error: the end-of-run sweep could not finish: {e}");
        return Ok(EXIT_HARNESS);
    }
    if interrupted {
        eprintln!(
            "interrupted: {} scenario(s) never ran: {}",
            not_run.len(),
            not_run.join(" ")
        );
        return Ok(EXIT_INTERRUPTED);
    }
    let judged = report
        .profiles
        .iter()
        .find(|p| p.profile == "all")
        .map(|p| p.verdict);
    if report
        .scenarios
        .iter()
        .any(|s| matches!(s.outcome, Outcome::Error { .. }))
    {
        return Ok(EXIT_HARNESS);
    }
    if !report.run_sweep.found.is_empty() {
        eprintln!(
            "not conformant: the run left {} resource(s) behind",
            report.run_sweep.found.len()
        );
        return Ok(EXIT_NOT_CONFORMANT);
    }
    Ok(if judged == Some(Verdict::Conformant) {
        EXIT_CONFORMANT
    } else {
        EXIT_NOT_CONFORMANT
    })
}

/// How many scenarios run at once without `--jobs`: the reference server the runner started
/// waits far more than it computes, so eight; a deployment of someone else's, four, to stay
/// gentle on a live platform's rate limits.
fn default_jobs(target: &Target) -> usize {
    if target.launcher.is_some() { 8 } else { 4 }
}

/// Runs scenarios `jobs` at a time, exclusive ones among them where each gets a deployment of
/// its own ([`Target::isolates_exclusive`]), otherwise after the others, one at a time;
/// results come back in the order of `scenarios`.
pub async fn run_all(
    target: &Arc<Target>,
    scenarios: &[LoadedScenario],
    run_id: &str,
    jobs: usize,
    retries: u32,
) -> Vec<crate::engine::ScenarioRun> {
    let never = AtomicBool::new(false);
    run_until_stopped(
        target,
        scenarios,
        run_id,
        jobs,
        retries,
        &never,
        Instant::now(),
    )
    .await
    .into_iter()
    .map(|r| r.expect("every scenario ran"))
    .collect()
}

/// Like [`run_all`], but once `stop` is set no further scenario starts; those already
/// running finish, cleanup included. `None` marks a scenario that never ran. Each result's
/// `started_ms` is measured from `epoch`, the run's start.
pub async fn run_until_stopped(
    target: &Arc<Target>,
    scenarios: &[LoadedScenario],
    run_id: &str,
    jobs: usize,
    retries: u32,
    stop: &AtomicBool,
    epoch: Instant,
) -> Vec<Option<crate::engine::ScenarioRun>> {
    let since_epoch = move || u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
    let progress = Progress::new(scenarios.len());
    let mut results: Vec<Option<crate::engine::ScenarioRun>> = vec![None; scenarios.len()];
    let semaphore = Arc::new(tokio::sync::Semaphore::new(jobs.max(1)));
    let mut set = tokio::task::JoinSet::new();
    let isolated = target.isolates_exclusive();
    let alone = |s: &LoadedScenario| s.scenario.exclusive && !isolated;
    // The scenarios that wait longest (a retention or a stream's bound waited out in real
    // time) start first, so that their waits overlap the others instead of ending the run.
    let mut pool: Vec<(usize, &LoadedScenario)> = scenarios
        .iter()
        .enumerate()
        .filter(|(_, s)| !alone(s))
        .collect();
    let clock_movable = target.clock_movable_here_or_own();
    pool.sort_by_cached_key(|(_, s)| {
        use crate::engine::waits::{total_s, waits};
        std::cmp::Reverse(total_s(&waits(
            &s.scenario,
            &target.capabilities,
            clock_movable,
        )))
    });
    for (i, s) in pool {
        let permit = semaphore
            .clone()
            .acquire_owned()
            .await
            .expect("semaphore is never closed");
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let target = target.clone();
        let scenario = s.scenario.clone();
        let run_id = run_id.to_owned();
        set.spawn(async move {
            let started_ms = since_epoch();
            let mut r = run_with_retries(&target, &scenario, &run_id, retries).await;
            r.started_ms = started_ms;
            drop(permit);
            (i, r)
        });
        while let Some(done) = set.try_join_next() {
            let (i, r) = done.expect("scenario task panicked");
            progress.done(&scenarios[i], &r);
            results[i] = Some(r);
        }
    }
    while let Some(done) = set.join_next().await {
        let (i, r) = done.expect("scenario task panicked");
        progress.done(&scenarios[i], &r);
        results[i] = Some(r);
    }
    for (i, s) in scenarios.iter().enumerate().filter(|(_, s)| alone(s)) {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let started_ms = since_epoch();
        let mut r = run_with_retries(target, &s.scenario, run_id, retries).await;
        r.started_ms = started_ms;
        progress.done(s, &r);
        results[i] = Some(r);
    }
    progress.finish();
    results
}

/// A progress bar on a terminal, one line per scenario otherwise (CI logs).
struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    fn new(total: usize) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total as u64);
            if let Ok(style) =
                indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {elapsed} {msg}")
            {
                bar.set_style(style);
            }
            bar
        });
        Progress { bar }
    }

    fn done(&self, s: &LoadedScenario, r: &crate::engine::ScenarioRun) {
        let line = match r.outcome.reason() {
            Some(reason) => format!(
                "{:<5} {} ({} ms): {reason}",
                r.outcome.label(),
                s.id(),
                r.duration_ms
            ),
            None => format!("{:<5} {} ({} ms)", r.outcome.label(), s.id(), r.duration_ms),
        };
        match &self.bar {
            Some(bar) => {
                if !r.outcome.passed() {
                    bar.println(line);
                }
                bar.set_message(s.id().to_owned());
                bar.inc(1);
            }
            None => eprintln!("{line}"),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn print_summary(report: &RunReport) {
    println!();
    println!(
        "{:<14} {:<16} {:>5} {:>5} {:>5} {:>5} {:>5} {:>5}  scope",
        "profile", "verdict", "PASS", "FLAKY", "SKIP", "FAIL", "ERROR", "MUST"
    );
    for p in &report.profiles {
        let c = |k: &str| p.counts.get(k).copied().unwrap_or(0);
        println!(
            "{:<14} {:<16} {:>5} {:>5} {:>5} {:>5} {:>5} {:>5}  {}",
            p.profile,
            p.verdict.to_string(),
            c("PASS"),
            c("FLAKY"),
            c("SKIP"),
            c("FAIL"),
            c("ERROR"),
            p.must_run,
            p.scope
                .qualifier()
                .unwrap_or_else(|| format!("catalog: {} scenarios", p.scope.catalog))
        );
    }
    for p in report
        .profiles
        .iter()
        .filter(|p| p.profile == crate::report::ALL)
    {
        println!("\n{}: {}", p.profile, p.line());
        if let Some(reason) = &p.reason {
            println!("{}: {reason}", p.verdict);
        }
    }
    let failed: Vec<&str> = report
        .scenarios
        .iter()
        .filter(|s| matches!(s.outcome, Outcome::Fail { .. } | Outcome::Error { .. }))
        .map(|s| s.id.as_str())
        .collect();
    if !failed.is_empty() {
        println!("failed: {}", failed.join(" "));
    }
}

/// Names every scenario the wait budget skipped (each one's reason has the numbers).
fn print_over_budget(report: &RunReport, max_wait: MaxWait) {
    let over: Vec<&str> = report
        .scenarios
        .iter()
        .filter(|s| {
            matches!(&s.outcome, Outcome::Skip { reason }
                if reason.starts_with(crate::engine::waits::OVER_BUDGET))
        })
        .map(|s| s.id.as_str())
        .collect();
    if !over.is_empty() {
        println!(
            "skipped over the wait budget (--max-wait {}; `--max-wait none` waits them out): {}",
            crate::engine::waits::format_budget(max_wait.0),
            over.join(" ")
        );
    }
}

/// The run's sanitizer: the principals' tokens and every value captured as a secret.
fn run_sanitizer(
    target: &Target,
    captured: &[String],
) -> Result<crate::evidence::Sanitizer, RunError> {
    let mut sanitizer = crate::evidence::for_tokens(&target.tokens).map_err(|e| {
        RunError::Usage(format!(
            "cannot protect the target's tokens in evidence: {e}"
        ))
    })?;
    for (i, value) in captured.iter().enumerate() {
        // A captured secret too short to redact reliably is refused by the sanitizer; the
        // leak scan still runs over everything that is written.
        if sanitizer
            .add_secret(value, &format!("captured-secret-{i}"))
            .is_err()
        {
            eprintln!("warning: a captured secret is too short to be redacted by value");
        }
    }
    Ok(sanitizer)
}

/// Writes the evidence folder (always: `--out`, or `evidence/runs/<run-id>/`) and the
/// optional JUnit file. Everything goes through the sanitizer; the writer refuses to write a
/// folder in which a secret or the run's canary survives.
fn write_outputs(
    args: &RunArgs,
    report: &RunReport,
    sanitizer: &crate::evidence::Sanitizer,
    canary: &str,
    sign_key: Option<crate::evidence::SigningKey>,
    interrupted: bool,
    not_run: Vec<String>,
) -> Result<(), String> {
    use crate::evidence::{Subject, WriteOptions, default_run_dir, write_run_folder};
    let dest = args
        .out
        .clone()
        .unwrap_or_else(|| default_run_dir(Path::new("."), &report.run_id));
    let subject = Subject::for_target(&report.target)
        .map_err(|e| format!("cannot identify the tested build: {e}"))?;
    let options = WriteOptions {
        canary: canary.to_owned(),
        subject,
        interrupted,
        not_run,
        sign_key,
    };
    let written =
        write_run_folder(&dest, report, sanitizer, &options).map_err(|e| e.to_string())?;
    eprintln!("evidence: {}", written.display());
    if let Some(file) = &args.junit {
        let junit = junit_xml(&crate::evidence::sanitized_report(report, sanitizer));
        std::fs::write(file, junit).map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    }
    Ok(())
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
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

    #[test]
    fn shards_are_disjoint_and_cover_everything() {
        let items: Vec<u32> = (0..11).collect();
        let mut seen = Vec::new();
        for index in 1..=3 {
            let part = select_shard(items.clone(), Some(Shard { index, count: 3 }));
            assert!(part.len() == 3 || part.len() == 4);
            seen.extend(part);
        }
        seen.sort_unstable();
        assert_eq!(seen, items);
        assert_eq!(
            select_shard(items.clone(), Some(Shard { index: 2, count: 3 })),
            vec![1, 4, 7, 10]
        );
        assert_eq!(select_shard(items.clone(), None), items);
    }
}
