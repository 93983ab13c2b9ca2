//! A correct server behind an ordinary reverse proxy stays conformant: the whole catalog runs
//! against the reference server through the test proxy of `support/proxy.rs`, which adds
//! latency and holds its upstream connections a moment after their clients have gone.

use crate::support;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sandspec::cli::run_all;
use sandspec::engine::Outcome;
use sandspec::report::{RunFacts, ScenarioReport, Verdict, verdict};
use sandspec::scenario::load_dir;
use sandspec::target::{ReferenceOptions, ReferenceServer, Target};
use support::proxy::Proxy;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_whole_catalog_through_a_reverse_proxy_is_conformant() {
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        ..ReferenceOptions::default()
    };
    let server = ReferenceServer::start(&options).await.unwrap();
    let proxy = Proxy::start(&server.url).await;
    let target = Target::connect_with_tokens(&proxy.url, server.tokens.clone(), None)
        .await
        .unwrap();
    assert_eq!(
        target.base_url, proxy.url,
        "every request goes through the proxy"
    );
    // On SQLite the reference server is one process: the scenarios that need a second one
    // are not applicable here, as in the main job. Nor are those that inject faults: they run
    // on server processes the runner starts for them, which the proxy is not in front of.
    let (scenarios, left_out): (Vec<_>, Vec<_>) =
        load_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios"))
            .unwrap()
            .into_iter()
            .partition(|s| {
                !s.scenario.requires.iter().any(|r| {
                    matches!(
                        r.value.as_str(),
                        "peer" | "server_control" | "database_control"
                    )
                })
            });
    assert!(left_out.len() <= 5, "almost the whole catalog runs");
    let run_id = ulid::Ulid::new().to_string().to_lowercase();
    let results = run_all(&Arc::new(target), &scenarios, &run_id, 8, 0).await;
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
    assert!(
        not_passed.is_empty(),
        "behind the proxy:\n{}",
        not_passed.join("\n")
    );
    let rows: Vec<_> = reports.iter().map(ScenarioReport::judged).collect();
    let facts = RunFacts::whole_catalog(reports.iter().map(|r| r.family.as_str()));
    assert_eq!(verdict("all", &rows, &facts).verdict, Verdict::Conformant);
}
