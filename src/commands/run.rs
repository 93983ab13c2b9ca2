//! `sandspec run` as a straight line: the arguments become a [`TargetSpec`] (checked before
//! anything starts), the catalog and the selection a [`RunPlan`], the target is opened, the
//! engine's scheduler runs the plan, and the results become the report, the printed summary,
//! the evidence folder and the exit code.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::console::{Progress, print_over_budget, print_summary};
use super::plan::SDK_FAMILY;
use super::plan::{RunPlan, Selection};
use crate::cli::{
    EXIT_CONFORMANT, EXIT_HARNESS, EXIT_INTERRUPTED, EXIT_NOT_CONFORMANT, EXIT_USAGE, RunArgs,
};
use crate::engine::{Outcome, Pace, default_jobs, run_until_stopped};
use crate::evidence::{Subject, WriteOptions};
use crate::gate::{Baseline, Gate, GateRow};
use crate::mcp::McpServerSpec;
use crate::report::{RunReport, ScenarioReport, TargetInfo, Verdict, junit_xml};
use crate::scenario::{LoadedScenario, ParseError, load_dir};
use crate::sdk::{CellOutcome, Journeys, SdkMatrix, SdkSpec, SdkTarget};
use crate::target::{Endpoint, ReferenceOptions, Target, TargetError, TargetSpec, UrlEndpoint};

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
            super::plan::print_parse_errors(&errors);
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

/// The target the arguments name.
fn target_spec(args: &RunArgs) -> Result<TargetSpec, RunError> {
    let endpoint = match (&args.target, &args.launch) {
        (Some(url), _) => Endpoint::Url(UrlEndpoint {
            url: url.clone(),
            owner_token_env: args
                .owner_token_env
                .clone()
                .ok_or_else(|| RunError::Usage("--target needs --owner-token-env".into()))?,
            other_token_env: args
                .other_token_env
                .clone()
                .ok_or_else(|| RunError::Usage("--target needs --other-token-env".into()))?,
            admin_token_env: args.admin_token_env.clone(),
            unscoped_token_env: args.unscoped_token_env.clone(),
            ca_file: args.ca_file.clone(),
            peer_url: args.peer_url.clone(),
            base_dir: args.base_dir.clone(),
            live: args.live,
        }),
        (None, Some(command)) => Endpoint::Launch(command.clone()),
        (None, None) => Endpoint::Reference(ReferenceOptions {
            binary: std::env::current_exe()
                .map_err(|e| RunError::Harness(format!("cannot find the sandspec binary: {e}")))?,
            defects: args.defect.clone(),
            database_url: args.database_url.clone(),
            extra_args: Vec::new(),
            serve_defaults: false,
        }),
    };
    Ok(TargetSpec {
        assume: args.assume_capability.clone(),
        drop: args.drop_capability.clone(),
        request_timeout: args.request_timeout,
        wait_budget: args.max_wait.0,
        limits: args.read_limits(),
        mcp_server: match (&args.mcp_server, &args.mcp_url) {
            (Some(line), _) => Some(McpServerSpec::Command(line.clone())),
            (None, Some(url)) => Some(McpServerSpec::Url {
                url: url.clone(),
                token_env: args.mcp_token_env.clone(),
            }),
            (None, None) => None,
        },
        tool_map: args.tool_map.clone(),
        envd_domain: args.envd_domain.clone(),
        ..TargetSpec::new(args.api, endpoint)
    })
}

async fn run_inner(args: RunArgs) -> Result<u8, RunError> {
    let sdks = SdkRun::of(&args)?;
    let selection = Selection {
        family: args.family.clone(),
        filters: args.filter.clone(),
        shard: args.shard,
        certify: args.certify,
        journeys: sdks.is_some(),
    };
    // A key that cannot sign, a flag that does not fit the profile, and a catalog that does
    // not parse are usage errors found before anything starts.
    let sign_key = args
        .sign_key
        .as_deref()
        .map(crate::evidence::SigningKey::from_file)
        .transpose()
        .map_err(|e| RunError::Usage(format!("--sign-key: {e}")))?;
    let spec = target_spec(&args)?.check()?;
    let catalog = load_dir(&args.api.catalog(&args.scenarios)).map_err(RunError::Parse)?;
    let mut plan = RunPlan::select(&catalog, &selection).map_err(RunError::Usage)?;
    let baseline = match &args.expected_failures {
        Some(file) => {
            let judged_journeys = sdks.as_ref().map(SdkRun::judged_ids).unwrap_or_default();
            let ids: BTreeSet<&str> = catalog
                .iter()
                .map(LoadedScenario::id)
                .chain(judged_journeys.iter().map(String::as_str))
                .collect();
            Some(Baseline::read(file, &ids).map_err(|e| RunError::Usage(e.to_string()))?)
        }
        None => None,
    };
    let started_at = now_rfc3339();
    let started = Instant::now();
    let target = Target::open(spec).await?;
    plan.drop_not_applicable(&target).map_err(RunError::Usage)?;
    let run_id = ulid::Ulid::new().to_string().to_lowercase();
    let target = Arc::new(target);
    // The first Ctrl-C lets running scenarios finish (their cleanup included) and starts no
    // more; the receipt then says the run was interrupted and lists what never ran. A second
    // Ctrl-C aborts at once.
    let stop = Arc::new(AtomicBool::new(false));
    let ctrl_c = Arc::new(AtomicBool::new(false));
    let watcher = tokio::spawn({
        let (stop, ctrl_c) = (stop.clone(), ctrl_c.clone());
        async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                ctrl_c.store(true, Ordering::SeqCst);
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
    // The sandbox-seconds budget: once the run has held its sandboxes that long, no further
    // scenario starts, as after a first Ctrl-C.
    let budget_hit = Arc::new(AtomicBool::new(false));
    let budget = args.max_sandbox_seconds.map(|limit| {
        let (stop, hit, usage) = (stop.clone(), budget_hit.clone(), target.usage.clone());
        tokio::spawn(async move {
            loop {
                if usage.sandbox_seconds() >= limit as f64 {
                    hit.store(true, Ordering::SeqCst);
                    stop.store(true, Ordering::SeqCst);
                    eprintln!(
                        "budget: the run has held its sandboxes for {limit} s (--max-sandbox-seconds): \
                         no further scenario starts; the running ones finish and clean up"
                    );
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        })
    });
    let progress = Progress::new(plan.selected.len());
    let outcomes = run_until_stopped(
        &target,
        &plan.selected,
        &run_id,
        Pace {
            jobs: args
                .jobs
                .map_or_else(|| default_jobs(&target), |j| j as usize),
            retries: args.retries,
            stop: &stop,
            epoch: started,
            max_sandboxes: args.max_sandboxes,
        },
        |s, r| progress.done(s, r),
    )
    .await;
    progress.finish();
    if let Some(budget) = budget {
        budget.abort();
    }
    let not_run: Vec<String> = plan
        .selected
        .iter()
        .zip(&outcomes)
        .filter(|(_, r)| r.is_none())
        .map(|(s, _)| s.scenario.id.value.clone())
        .collect();
    let by_user = ctrl_c.load(Ordering::SeqCst);
    // The budget ended the run when it kept scenarios from starting.
    let budget_ended = budget_hit.load(Ordering::SeqCst) && !not_run.is_empty() && !by_user;
    let interrupted = by_user || budget_ended;
    let (selected, results): (Vec<LoadedScenario>, Vec<crate::engine::ScenarioRun>) = plan
        .selected
        .into_iter()
        .zip(outcomes)
        .filter_map(|(s, r)| r.map(|r| (s, r)))
        .unzip();
    // Values captured as secrets are known only now; the sanitizer must remove them too.
    let captured_secrets: Vec<String> = results
        .iter()
        .flat_map(|r| r.secrets.iter().cloned())
        .collect();
    let mut scenarios: Vec<ScenarioReport> = selected
        .iter()
        .zip(results)
        .map(|(s, r)| ScenarioReport::new(s, r))
        .collect();
    let mut facts = plan.facts;
    // The SDK matrix, after the scenarios and before the sweep, which finds what it left.
    let sdk_matrix = match &sdks {
        Some(sdks) if !interrupted => {
            let matrix = sdks.run(&target, &run_id).await;
            let judged = sdks.judged_scenarios(&matrix);
            *facts.selected.entry(SDK_FAMILY.to_owned()).or_default() += judged.len();
            *facts.catalog.entry(SDK_FAMILY.to_owned()).or_default() += judged.len();
            scenarios.extend(judged);
            Some(matrix)
        }
        _ => None,
    };
    // Anything still tagged with this run's ID is a cleanup failure of the run. A sweep that
    // cannot finish is a harness error, reported after the evidence is written.
    let run_sweep = target
        .profile()
        .sweep_run(&target.conn(), &target.tokens, &run_id)
        .await;
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
    facts.left_behind = run_sweep.found.len();
    facts.sweep_error.clone_from(&run_sweep.error);
    facts.budget_ended = budget_ended;
    let profiles = RunReport::judge(&scenarios, &facts);
    let report = RunReport {
        run_id,
        suite_version: env!("CARGO_PKG_VERSION").to_owned(),
        started_at,
        finished_at: now_rfc3339(),
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        target: TargetInfo {
            kind: target.kind.to_owned(),
            url: target.base_url.clone(),
            server_name: target.capabilities.server_name.clone(),
            server_version: target.capabilities.server_version.clone(),
            defects: args.defect.clone(),
            capabilities: target.capabilities.raw.clone(),
        },
        profile: args.family.clone(),
        filters: args.filter.clone(),
        shard: args.shard.map(|s| s.to_string()),
        label: args.label.clone(),
        retries: args.retries,
        certify: args.certify,
        scenarios,
        profiles,
        run_sweep,
        not_applicable: plan.not_applicable,
        operations: target.profile().operations(),
        sdk_matrix,
        // After the sweep, whose requests count too; what is still held counts up to now.
        consumption: target.usage.consumption(
            crate::target::AccountLimits {
                max_sandboxes: args.max_sandboxes,
                max_sandbox_seconds: args.max_sandbox_seconds,
            },
            budget_ended,
        ),
    };
    let gate = baseline.map(|b| gate_of(&b, &report, &facts));
    let sanitizer = run_sanitizer(&target, &captured_secrets)?;
    print_summary(&crate::evidence::sanitized_report(&report, &sanitizer));
    print_over_budget(&report, args.max_wait);
    if let Some(gate) = &gate {
        println!("gate: {}", gate.line());
    }
    let written = write_outputs(
        &args,
        &report,
        &sanitizer,
        WriteOptions {
            canary: target.canary.clone(),
            subject: Subject::for_target(&report.target)
                .map_err(|e| RunError::Harness(format!("cannot identify the tested build: {e}")))?,
            interrupted,
            not_run: not_run.clone(),
            sign_key,
            gate: gate.clone(),
        },
    );
    watcher.abort();
    written.map_err(RunError::Harness)?;
    if budget_ended {
        eprintln!(
            "budget: --max-sandbox-seconds ended the run: {} scenario(s) never ran: {}",
            not_run.len(),
            not_run.join(" ")
        );
    }
    Ok(exit_code(&report, by_user, &not_run, gate.as_ref()))
}

/// The SDK matrix a run was asked for (`--sdk`), with what its profile's journeys are.
struct SdkRun {
    journeys: &'static Journeys,
    specs: Vec<SdkSpec>,
    cache: PathBuf,
}

impl SdkRun {
    /// The SDKs of `--sdk`, where given; a usage error for a profile without journeys, a
    /// spec that is not one, or a sharded run's shards after the first (the first runs it).
    fn of(args: &RunArgs) -> Result<Option<SdkRun>, RunError> {
        if args.sdk.is_empty() {
            return Ok(None);
        }
        let journeys = args.api.profile().sdk_journeys().ok_or_else(|| {
            RunError::Usage(format!(
                "--sdk: `--api {}` has no SDK journeys (`--api e2b` does)",
                args.api.name()
            ))
        })?;
        let specs = journeys.specs(&args.sdk).map_err(RunError::Usage)?;
        if args.shard.is_some_and(|s| s.index != 1) {
            return Ok(None);
        }
        let cache = match &args.sdk_cache {
            Some(dir) => dir.clone(),
            None => default_sdk_cache(),
        };
        Ok(Some(SdkRun {
            journeys,
            specs,
            cache,
        }))
    }

    /// The scenario IDs the judged journeys will have.
    fn judged_ids(&self) -> Vec<String> {
        crate::sdk::judged(&self.specs)
            .into_iter()
            .zip(&self.specs)
            .filter(|(judged, _)| *judged)
            .flat_map(|(_, spec)| {
                self.journeys
                    .journeys
                    .iter()
                    .map(|j| self.journeys.id(spec.language, j))
            })
            .collect()
    }

    async fn run(&self, target: &Target, run_id: &str) -> SdkMatrix {
        let sdk_target = SdkTarget {
            base_url: &target.base_url,
            envd_domain: target.envd_domain.as_deref(),
            api_key: &target.tokens.owner,
            run_id,
        };
        target
            .profile()
            .sdk_matrix(sdk_target, target.client.clone(), &self.specs, &self.cache)
            .await
    }

    /// The journeys of the judged SDKs, as scenarios of the run: a failure fails the clauses
    /// the journey exercises.
    fn judged_scenarios(&self, matrix: &SdkMatrix) -> Vec<ScenarioReport> {
        let mut out = Vec::new();
        for (spec, column) in self.specs.iter().zip(&matrix.sdks) {
            if !column.judged {
                continue;
            }
            for journey in self.journeys.journeys {
                let Some(cell) = matrix.cell(journey.name, &column.sdk) else {
                    continue;
                };
                let detail = cell.detail.clone().unwrap_or_default();
                let outcome = match cell.outcome {
                    CellOutcome::Pass => Outcome::Pass,
                    CellOutcome::Fail => Outcome::Fail {
                        step: format!("journey {} with {}", journey.name, column.sdk),
                        reason: detail,
                    },
                    CellOutcome::Skip => Outcome::Skip { reason: detail },
                    CellOutcome::Error => Outcome::Error { reason: detail },
                };
                out.push(ScenarioReport {
                    id: self.journeys.id(spec.language, journey),
                    title: format!("SDK journey: {} ({})", journey.title, column.sdk),
                    family: SDK_FAMILY.to_owned(),
                    file: format!("sdk journeys of {}", column.sdk),
                    level: crate::scenario::Level::Must,
                    clauses: journey.clauses.iter().map(|c| (*c).to_owned()).collect(),
                    tags: vec!["sdk".to_owned()],
                    defects: Vec::new(),
                    outcome,
                    started_ms: 0,
                    duration_ms: cell.ms,
                    attempts: 1,
                    measurements: Default::default(),
                    swept: Vec::new(),
                    faults: Vec::new(),
                    throttled: Default::default(),
                    transcript: Vec::new(),
                });
            }
        }
        out
    }
}

/// Where SDKs are installed without `--sdk-cache`: `$XDG_CACHE_HOME/sandspec/sdk`, else
/// `~/.cache/sandspec/sdk`, else a folder of the system's temporary directory.
fn default_sdk_cache() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("sandspec").join("sdk")
}

/// The gate of a finished run against its baseline, judged on the day the run ended.
fn gate_of(baseline: &Baseline, report: &RunReport, facts: &crate::report::RunFacts) -> Gate {
    let rows: Vec<GateRow<'_>> = report
        .scenarios
        .iter()
        .map(|s| GateRow {
            judged: s.judged(),
            failed_step: match &s.outcome {
                Outcome::Fail { step, .. } => Some(step.as_str()),
                _ => None,
            },
        })
        .collect();
    let day = report.finished_at.get(..10).unwrap_or_default();
    Gate::judge(baseline, &rows, facts, day)
}

/// The exit code a finished run ends with (docs/runner.md): with a baseline, the gate's.
fn exit_code(report: &RunReport, interrupted: bool, not_run: &[String], gate: Option<&Gate>) -> u8 {
    if let Some(e) = &report.run_sweep.error {
        eprintln!("not conformant: the end-of-run sweep could not finish: {e}");
    }
    if interrupted {
        eprintln!(
            "interrupted: {} scenario(s) never ran: {}",
            not_run.len(),
            not_run.join(" ")
        );
        return EXIT_INTERRUPTED;
    }
    if report
        .scenarios
        .iter()
        .any(|s| matches!(s.outcome, Outcome::Error { .. }))
    {
        return EXIT_HARNESS;
    }
    if let Some(gate) = gate {
        return if gate.passed() {
            EXIT_CONFORMANT
        } else {
            EXIT_NOT_CONFORMANT
        };
    }
    let judged = report
        .profiles
        .iter()
        .find(|p| p.profile == crate::report::ALL)
        .map(|p| p.verdict);
    if judged == Some(Verdict::Conformant) {
        EXIT_CONFORMANT
    } else {
        EXIT_NOT_CONFORMANT
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
    options: WriteOptions,
) -> Result<(), String> {
    use crate::evidence::{default_run_dir, expected_failures, write_run_folder};
    let dest = args
        .out
        .clone()
        .unwrap_or_else(|| default_run_dir(Path::new("."), &report.run_id));
    let expected = expected_failures(options.gate.as_ref());
    let written =
        write_run_folder(&dest, report, sanitizer, &options).map_err(|e| e.to_string())?;
    eprintln!("evidence: {}", written.display());
    if let Some(file) = &args.junit {
        let junit = junit_xml(
            &crate::evidence::sanitized_report(report, sanitizer),
            &expected,
        );
        std::fs::write(file, junit).map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    }
    Ok(())
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}
