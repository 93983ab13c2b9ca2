//! `cargo test` over the scenario catalog: every scenario against the reference server on
//! SQLite (`sqlite::<ID>`) and on PostgreSQL (`postgres::<ID>`, skipped at run time when
//! PostgreSQL is not installed), and every (scenario, defect) pair against a SQLite server
//! started with that defect, where the scenario must FAIL at the step it names for that defect
//! (`defect::<ID>::<defect>`); `controls::every-defect-caught` checks that every defect of the
//! reference server is some MUST scenario's control. The E2B catalog (`scenarios/e2b/`) runs
//! the same way against the reference speaking E2B, its trials named `e2b::sqlite::<ID>`,
//! `e2b::postgres::<ID>` and `e2b::defect::<ID>::<defect>`. The MCP catalog (`scenarios/mcp/`)
//! drives the reference MCP server `sandspec mcp` over the reference speaking E2B, on SQLite,
//! over both of MCP's transports: on stdio, a server process per session (`mcp::sqlite::<ID>`,
//! `mcp::defect::<ID>::<defect>`), and over streamable HTTP, one `sandspec mcp --listen` per
//! control plane with an HTTP session per scenario session (`mcp::http::sqlite::<ID>`,
//! `mcp::http::defect::<ID>::<defect>`). A defect is the MCP server's (`sandspec mcp
//! --defect`) and the control plane is clean. An exclusive MCP scenario over HTTP runs on a
//! control plane and MCP server of its own, since the server keeps the control plane it was
//! started with.
//!
//! A scenario that requires a peer (a second server process on the same database) can only
//! run on PostgreSQL, where the reference target starts two processes: its `sqlite::` trial is
//! reported ignored with the skip's reason, and its defect trials run on PostgreSQL (ignored
//! like the `postgres::` trials when PostgreSQL is not installed). So do those of a scenario
//! that requires `database_control`, whose database server only PostgreSQL has.
//!
//! A scenario that injects faults (`server_control`, `database_control`) runs on a deployment
//! the engine starts for it alone, like the shared server but with its own processes (and its
//! own PostgreSQL cluster for `database_control`), so no other trial sees the faults.
//!
//! `proxy::whole-catalog` runs the `/v1` catalog as `sandspec run` does, against a reference
//! server of its own behind the test reverse proxy (`support/proxy.rs`), and must be
//! conformant.
//!
//! Clean servers are started once per process and shared, one per store. Each negative control
//! gets a server of its own with its defect, so what another scenario left behind cannot make
//! it fail earlier than the step it names. A scenario marked `exclusive` runs on a deployment
//! the engine starts for it alone (`Target::isolates_exclusive`, which the harness asserts of
//! every shared server), so nothing else runs beside it there.

#[path = "support/listening.rs"]
mod listening;
#[expect(
    dead_code,
    reason = "the harness stops its MCP servers by dropping them"
)]
#[path = "support/mcp_http.rs"]
mod mcp_http;
#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/runtime.rs"]
mod runtime;
#[path = "support/serve.rs"]
mod serve;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};

use libtest_mimic::{Arguments, Completion, Failed, Trial};
use reference_server::defects::Defect;
use runtime::RUNTIME;
use sandspec::engine::{Outcome, run_scenario};
use sandspec::profile::Api;
use sandspec::report::{RunFacts, ScenarioReport, Verdict, verdict};
use sandspec::scenario::{
    Atom, DefectRef, Expr, Level, LoadedScenario, Scenario, Step, load_dir, load_dir_partial,
};
use sandspec::target::{ReferenceOptions, ReferenceServer, Target};

/// Started servers by store key; dropped before exit so the child processes are killed.
static SERVERS: LazyLock<Mutex<HashMap<String, Arc<Deployed>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// A target, and the MCP server over HTTP that drives its control plane, when there is one:
/// it lives as long as the target.
struct Deployed {
    target: Target,
    _mcp: Option<mcp_http::McpHttp>,
}

/// What a trial speaks: a profile, and for the MCP profile how the server under test is
/// reached (`http`: streamable HTTP, else stdio).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Flavor {
    api: Api,
    http: bool,
}

impl Flavor {
    fn of(api: Api) -> Flavor {
        Flavor { api, http: false }
    }
}

/// Which server a trial runs against.
#[derive(Clone, Copy)]
enum Store<'a> {
    Sqlite,
    Postgres,
    /// SQLite with this defect switched on.
    Defect(&'a str),
    /// PostgreSQL (two server processes) with this defect switched on.
    PostgresDefect(&'a str),
}

/// The skip reason of a PostgreSQL trial when PostgreSQL is not installed.
const NO_POSTGRES: &str = "PostgreSQL is not installed";

/// Starts (once) the reference server for a clean `store`; `None` when PostgreSQL is not
/// installed.
fn server(store: Store<'_>, flavor: Flavor) -> Option<Arc<Deployed>> {
    let key = match store {
        Store::Sqlite => "sqlite".to_owned(),
        Store::Postgres => "postgres".to_owned(),
        Store::Defect(d) => format!("defect:{d}"),
        Store::PostgresDefect(d) => format!("postgres-defect:{d}"),
    };
    let key = format!("{}:{}:{key}", flavor.api.name(), flavor.http);
    let mut servers = SERVERS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(t) = servers.get(&key) {
        return Some(t.clone());
    }
    let target = Arc::new(start(store, flavor)?);
    servers.insert(key, target.clone());
    Some(target)
}

/// Starts a reference server for `store`; `None` when PostgreSQL is not installed. For the
/// MCP profile it is the control plane, clean, and the MCP server under test carries the
/// defect: a command line per session on stdio, or `sandspec mcp --listen` started here.
fn start(store: Store<'_>, flavor: Flavor) -> Option<Deployed> {
    let database_url = match store {
        Store::Postgres | Store::PostgresDefect(_) => {
            Some(pg_cluster::PgCluster::shared_or_skip()?.fresh_database_blocking())
        }
        Store::Sqlite | Store::Defect(_) => None,
    };
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_sandspec"));
    let defect = match store {
        Store::Defect(d) | Store::PostgresDefect(d) => Some(d),
        Store::Sqlite | Store::Postgres => None,
    };
    let mcp_profile = flavor.api == Api::Mcp;
    let options = ReferenceOptions {
        binary: binary.clone(),
        defects: match defect {
            Some(d) if !mcp_profile => vec![d.to_owned()],
            _ => vec![],
        },
        database_url,
        extra_args: vec![],
        serve_defaults: false,
    };
    RUNTIME.block_on(async {
        let target = Target::start_reference(&options)
            .await
            .unwrap_or_else(|e| panic!("failed to start the reference server: {e}"))
            .speaking(flavor.api);
        if !mcp_profile {
            return Some(Deployed { target, _mcp: None });
        }
        let map = sandspec::mcp::ToolMap::reference();
        let binary = binary.display().to_string();
        if flavor.http {
            let mcp = mcp_http::McpHttp::start(
                &binary,
                &target.base_url,
                &target.tokens.owner,
                defect.as_slice(),
                &[],
            )
            .await;
            let transport = sandspec::mcp::McpTransport::Http(mcp.server());
            let target = target
                .driving(sandspec::mcp::McpServer { transport, map }, false)
                .unwrap_or_else(|e| panic!("the MCP server at {}: {e}", mcp.url));
            return Some(Deployed {
                target,
                _mcp: Some(mcp),
            });
        }
        let mut argv = vec![binary, "mcp".to_owned()];
        if let Some(d) = defect {
            argv.extend(["--defect".to_owned(), d.to_owned()]);
        }
        let command = sandspec::mcp::ServerCommand { argv, env: vec![] };
        let transport = sandspec::mcp::McpTransport::Stdio(command);
        let target = target
            .driving(sandspec::mcp::McpServer { transport, map }, false)
            .unwrap_or_else(|e| panic!("the MCP server: {e}"));
        Some(Deployed { target, _mcp: None })
    })
}

/// Runs `scenario` on the shared clean server of `store`.
fn run(scenario: &LoadedScenario, store: Store<'_>, flavor: Flavor) -> Outcome {
    let Some(deployed) = server(store, flavor) else {
        return Outcome::Skip {
            reason: NO_POSTGRES.into(),
        };
    };
    let target = &deployed.target;
    // The engine runs an exclusive scenario on a deployment of its own, so nothing on the
    // shared server needs to wait for it; this harness has no other way to keep it alone. An
    // MCP server over HTTP stays on its own control plane, so there the scenario gets both.
    if scenario.scenario.exclusive && !target.isolates_exclusive() {
        assert!(
            flavor.http,
            "the shared server cannot give exclusive scenarios a deployment of their own"
        );
        return run_alone(scenario, store, flavor);
    }
    run_on(target, scenario)
}

/// Runs `scenario` on a server of its own, stopped afterwards: a negative control must fail
/// where it says, whatever other scenarios left on a server with the same defect.
fn run_alone(scenario: &LoadedScenario, store: Store<'_>, flavor: Flavor) -> Outcome {
    let Some(deployed) = start(store, flavor) else {
        return Outcome::Skip {
            reason: NO_POSTGRES.into(),
        };
    };
    let outcome = run_on(&deployed.target, scenario);
    RUNTIME.block_on(async move { drop(deployed) });
    outcome
}

fn run_on(target: &Target, scenario: &LoadedScenario) -> Outcome {
    let run_id = format!("test{}", ulid::Ulid::new().to_string().to_lowercase());
    RUNTIME
        .block_on(run_scenario(target, &scenario.scenario, &run_id))
        .outcome
}

/// A trial that must pass (a skip is reported as ignored, with its reason).
fn must_pass(
    name: String,
    scenario: LoadedScenario,
    store: Store<'static>,
    flavor: Flavor,
) -> Trial {
    Trial::ignorable_test(name, move || match run(&scenario, store, flavor) {
        Outcome::Pass => Ok(Completion::Completed),
        Outcome::Skip { reason } => Ok(Completion::ignored_with(reason)),
        other => Err(Failed::from(other.to_string())),
    })
}

/// A negative control: the scenario must FAIL against a server with `defect`, at the step
/// the scenario names for it and not earlier (on PostgreSQL when `postgres`, where a missing
/// PostgreSQL makes the trial ignored; any other skip fails).
fn must_fail(
    scenario: LoadedScenario,
    control: DefectRef,
    postgres: bool,
    flavor: Flavor,
) -> Trial {
    let defect = control.defect.value.clone();
    let name = format!("{}defect::{}::{}", prefix(flavor), scenario.id(), defect);
    Trial::ignorable_test(name, move || {
        let expected = scenario.scenario.fails_at(&control).ok_or_else(|| {
            format!(
                "`fails_at: {}` names no single step",
                control.fails_at.value
            )
        })?;
        let store = if postgres {
            Store::PostgresDefect(&defect)
        } else {
            Store::Defect(&defect)
        };
        match run_alone(&scenario, store, flavor) {
            Outcome::Fail { step, reason } => {
                // `SANDSPEC_SHOW_REASONS=1` shows why each control failed, to review that it
                // failed for the reason the defect implies.
                if std::env::var_os("SANDSPEC_SHOW_REASONS").is_some() {
                    eprintln!("{defect}: {step}: {reason}");
                }
                // The steps stop at the first failure: failing at the named step means every
                // earlier one passed.
                if step == expected {
                    Ok(Completion::Completed)
                } else {
                    Err(Failed::from(format!(
                        "against a server with `{defect}` the scenario must fail at `{expected}`, \
                         it failed at `{step}`: {reason}"
                    )))
                }
            }
            Outcome::Skip { reason } if postgres && reason == NO_POSTGRES => {
                Ok(Completion::ignored_with(reason))
            }
            other => Err(Failed::from(format!(
                "expected FAIL against a server with `{defect}`, got {other}"
            ))),
        }
    })
}

/// The defects of the reference server that no MUST scenario among `scenarios` names.
fn uncaught(scenarios: &[LoadedScenario]) -> Vec<&'static str> {
    let caught: BTreeSet<&str> = scenarios
        .iter()
        .filter(|s| s.scenario.level == Level::Must)
        .flat_map(|s| s.scenario.defects.iter().map(|c| c.defect.value.as_str()))
        .collect();
    Defect::ALL
        .iter()
        .map(|d| d.name())
        .filter(|name| !caught.contains(name))
        .collect()
}

/// `controls::every-defect-caught`: every defect the reference server can switch on is the
/// negative control of at least one MUST scenario, so none exists without a scenario that
/// proves it is caught. `controls::uncaught-defect-is-named` shows the check can fail: without
/// the scenarios that catch one defect, that defect is reported.
fn every_defect_is_caught(scenarios: &[LoadedScenario]) -> Vec<Trial> {
    let all = scenarios.to_vec();
    let every = Trial::test("controls::every-defect-caught", move || {
        let missed = uncaught(&all);
        if missed.is_empty() {
            Ok(())
        } else {
            Err(Failed::from(format!(
                "no MUST scenario catches: {}",
                missed.join(", ")
            )))
        }
    });
    let all = scenarios.to_vec();
    let named = Trial::test("controls::uncaught-defect-is-named", move || {
        let dropped = Defect::ALL[0].name();
        let without: Vec<LoadedScenario> = all
            .iter()
            .filter(|s| !s.scenario.defects.iter().any(|c| c.defect.value == dropped))
            .cloned()
            .collect();
        let missed = uncaught(&without);
        if missed.contains(&dropped) {
            Ok(())
        } else {
            Err(Failed::from(format!(
                "without the scenarios catching `{dropped}` it should be reported, got {missed:?}"
            )))
        }
    });
    vec![every, named]
}

/// Trial names of the `/v1` profile are bare (`sqlite::<ID>`); other profiles' carry the
/// profile's name first (`e2b::sqlite::<ID>`), and the MCP profile's over HTTP `http` after it
/// (`mcp::http::sqlite::<ID>`).
fn prefix(flavor: Flavor) -> String {
    match (flavor.api, flavor.http) {
        (Api::V1, _) => String::new(),
        (other, false) => format!("{}::", other.name()),
        (other, true) => format!("{}::http::", other.name()),
    }
}

/// Whether a loaded scenario belongs to `api`'s catalog.
fn in_catalog(s: &LoadedScenario, root: &std::path::Path, api: Api) -> bool {
    let own = |a: Api| s.file.starts_with(a.catalog(root));
    match api {
        Api::V1 => !own(Api::E2b) && !own(Api::Mcp),
        other => own(other),
    }
}

/// `proxy::whole-catalog`: a correct server behind an ordinary reverse proxy stays conformant.
/// The `/v1` catalog runs, as `sandspec run` runs it, against the reference server through the
/// test proxy of `support/proxy.rs`, which adds latency and holds its upstream connections a
/// moment after their clients have gone. The server is its own, and the runner did not start
/// it, so nothing moves its clock: the retention scenarios wait in real time, which makes this
/// one of the longest trials, queued first. So its retentions are shorter than the reference
/// target's minute ([`sandspec::target::REFERENCE_FAST_SETTINGS`]): process output and results
/// 3 s, session events 20 s. The scenarios that compare digests around a session, which an
/// event purge inside their window would fail, run here alone after the others (the runner
/// cannot give them a deployment of their own behind a URL) and take well under a second.
fn through_a_proxy() -> Trial {
    Trial::test("proxy::whole-catalog", || {
        RUNTIME.block_on(async {
            let retention = ["process_output_s=3", "result_s=3", "events_s=20"];
            let options = ReferenceOptions {
                binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
                extra_args: retention
                    .iter()
                    .flat_map(|r| ["--retention".to_owned(), (*r).to_owned()])
                    .collect(),
                ..ReferenceOptions::default()
            };
            let server = ReferenceServer::start(&options)
                .await
                .map_err(|e| format!("failed to start the reference server: {e}"))?;
            let proxy = proxy::Proxy::start(&server.url).await;
            let target = Target::connect_with_tokens(&proxy.url, server.tokens.clone(), None)
                .await
                .map_err(|e| format!("the proxy's target: {e}"))?;
            if target.base_url != proxy.url {
                return Err(Failed::from("a request would bypass the proxy"));
            }
            // On SQLite the reference server is one process: the scenarios that need a second
            // one are not applicable here, as in the main job. Nor are those that inject
            // faults: they run on server processes the runner starts for them, which the proxy
            // is not in front of.
            let (scenarios, left_out): (Vec<_>, Vec<_>) =
                load_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios"))
                    .map_err(|errors| {
                        errors
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join("\n")
                    })?
                    .into_iter()
                    .partition(|s| {
                        !s.scenario.requires.iter().any(|r| {
                            matches!(
                                r.value.as_str(),
                                "peer" | "server_control" | "database_control"
                            )
                        })
                    });
            if left_out.len() > 5 {
                return Err(Failed::from(format!(
                    "{} scenarios left out; almost the whole catalog must run",
                    left_out.len()
                )));
            }
            let run_id = ulid::Ulid::new().to_string().to_lowercase();
            let results =
                sandspec::engine::run_all(&Arc::new(target), &scenarios, &run_id, 8, 0).await;
            let reports: Vec<ScenarioReport> = scenarios
                .iter()
                .zip(results)
                .map(|(s, r)| ScenarioReport::new(s, r))
                .collect();
            let not_passed: Vec<String> = reports
                .iter()
                .filter(|r| r.outcome != Outcome::Pass)
                .map(|r| format!("{} {}: {:?}", r.outcome.label(), r.id, r.outcome.reason()))
                .collect();
            if !not_passed.is_empty() {
                return Err(Failed::from(format!(
                    "behind the proxy:\n{}",
                    not_passed.join("\n")
                )));
            }
            let rows: Vec<_> = reports.iter().map(ScenarioReport::judged).collect();
            let facts = RunFacts::whole_catalog(reports.iter().map(|r| r.family.as_str()));
            match verdict("all", &rows, &facts).verdict {
                Verdict::Conformant => Ok(()),
                other => Err(Failed::from(format!(
                    "behind the proxy the verdict is {other:?}"
                ))),
            }
        })
    })
}

/// How long a negative control may wait, in seconds, to order the queue: the window of the
/// step it must fail at, which a defect that makes nothing happen waits out, and the windows
/// of the cleanup that runs after it, which a defect may make it wait out too. Only windows
/// written as numbers count: the negative controls' servers move their clocks instead of
/// waiting out an advertised retention.
fn control_wait_s(scenario: &Scenario, control: &DefectRef) -> i64 {
    let literal = |step: &Step| match step.deadline().map(|n| &n.expr) {
        Some(
            expr @ Expr {
                atom: Atom::Int(n), ..
            },
        ) => expr.apply(*n).unwrap_or(0),
        _ => 0,
    };
    let failing = match scenario.steps_labelled(&control.fails_at.value).as_slice() {
        [i] => literal(&scenario.steps[*i]),
        _ => 0,
    };
    failing + scenario.cleanup.iter().map(literal).sum::<i64>()
}

/// How many trials run at once unless `--test-threads` or `SANDSPEC_TEST_THREADS` says: a
/// trial spends most of its time waiting on a server (streams, timers, processes), not on a
/// core. Not `RUST_TEST_THREADS`, which `.cargo/config.toml` sets lower for the binaries whose
/// tests compute more.
const DEFAULT_THREADS: usize = 16;

fn main() {
    let mut args = Arguments::from_args();
    if args.test_threads.is_none() {
        args.test_threads = Some(
            std::env::var("SANDSPEC_TEST_THREADS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEFAULT_THREADS),
        );
    }
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    // A broken file becomes a failing `parse::<file>` test; the rest still run. Each
    // profile's catalog is loaded on its own (the `/v1` one leaves the others' folders out).
    let (mut scenarios, mut errors) = load_dir_partial(&dir);
    let (e2b, e2b_errors) = load_dir_partial(&Api::E2b.catalog(&dir));
    scenarios.extend(e2b);
    errors.extend(e2b_errors);
    let (mcp, mcp_errors) = load_dir_partial(&Api::Mcp.catalog(&dir));
    scenarios.extend(mcp);
    errors.extend(mcp_errors);
    let mut trials = Vec::new();
    // The longest trials are queued first, so that they start while the shared servers'
    // short ones fill the other threads, not at the end: the catalog through the proxy, then
    // the negative controls (each starts a server of its own, and many wait out a poll's
    // whole window, the defect being that nothing happens), those that may wait longest
    // first.
    let mut first = vec![through_a_proxy()];
    let mut controls = Vec::new();
    for e in errors {
        let file = e
            .file
            .strip_prefix(&dir)
            .unwrap_or(&e.file)
            .display()
            .to_string();
        let message = e.to_string();
        trials.push(Trial::test(format!("parse::{file}"), move || {
            Err(Failed::from(message))
        }));
    }
    let flavors = [
        Flavor::of(Api::V1),
        Flavor::of(Api::E2b),
        Flavor::of(Api::Mcp),
        Flavor {
            api: Api::Mcp,
            http: true,
        },
    ];
    for flavor in flavors {
        let api = flavor.api;
        for s in scenarios.iter().filter(|s| in_catalog(s, &dir, api)) {
            trials.push(must_pass(
                format!("{}sqlite::{}", prefix(flavor), s.id()),
                s.clone(),
                Store::Sqlite,
                flavor,
            ));
            // The MCP server under test holds no state of its own in the database: its
            // scenarios run on SQLite only.
            if api != Api::Mcp {
                trials.push(must_pass(
                    format!("{}postgres::{}", prefix(flavor), s.id()),
                    s.clone(),
                    Store::Postgres,
                    flavor,
                ));
            }
            // A peer, or a database server to stop, exists only on PostgreSQL.
            let needs_postgres = s
                .scenario
                .requires
                .iter()
                .any(|r| r.value == "peer" || r.value == "database_control");
            for control in &s.scenario.defects {
                controls.push((
                    control_wait_s(&s.scenario, control),
                    must_fail(s.clone(), control.clone(), needs_postgres, flavor),
                ));
            }
        }
    }
    trials.extend(every_defect_is_caught(&scenarios));
    // Longest wait first; a stable sort keeps the catalog's order among equals.
    controls.sort_by_key(|(wait, _)| std::cmp::Reverse(*wait));
    first.extend(controls.into_iter().map(|(_, trial)| trial));
    first.extend(trials);
    let trials = first;
    let conclusion = libtest_mimic::run(&args, trials);
    // Kill the servers before exiting (statics are never dropped).
    let servers: Vec<Arc<Deployed>> = SERVERS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .drain()
        .map(|(_, t)| t)
        .collect();
    RUNTIME.block_on(async move { drop(servers) });
    conclusion.exit();
}
