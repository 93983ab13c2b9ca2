//! `sandspec run --api e2b --sdk ...`: the SDK version matrix with real E2B SDKs from PyPI and
//! npm, installed by the run into its cache, against the embedded reference server. The
//! newest release of each language judges the target, an older major is reported only; a
//! defect of the reference fails the journeys that meet it, with the SDK's own words.
//!
//! Outside CI an SDK that cannot be installed (no registry) is a visible skip; under `CI=true`
//! it fails the test.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use crate::support::receipt;

const PYTHON: &str = "python:e2b==2.63.0";
const NODE: &str = "node:e2b@2.51.0";
const PYTHON_1: &str = "python:e2b==1.11.1";

const JOURNEYS: [&str; 8] = [
    "create",
    "run_and_stream",
    "files",
    "list_pages",
    "pause_connect",
    "timeouts",
    "kill",
    "secure_access",
];

/// The cache the matrix installs into, shared by the tests of this binary.
fn cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("sdk-cache")
}

/// `sandspec run --api e2b --family sdk` with these SDKs and flags, evidence in `out`.
fn run_matrix(sdks: &[&str], extra: &[&str], out: &Path) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandspec"));
    cmd.args(["run", "--api", "e2b", "--family", "sdk", "--sdk-cache"])
        .arg(cache())
        .arg("--out")
        .arg(out);
    for sdk in sdks {
        cmd.args(["--sdk", sdk]);
    }
    cmd.args(extra);
    cmd.output().expect("sandspec run starts")
}

/// The matrix of the receipt in `out`, or `None` (a visible skip outside CI) when an SDK could
/// not be installed.
fn matrix_of(out: &Path, output: &Output) -> Option<Value> {
    let stderr = String::from_utf8_lossy(&output.stderr);
    let report = receipt::predicate(out);
    let matrix = report["sdk_matrix"].clone();
    let uninstallable: Vec<&Value> = matrix["cells"]
        .as_array()
        .expect("the receipt has the matrix's cells")
        .iter()
        .filter(|c| {
            c["outcome"] == "error"
                && c["detail"]
                    .as_str()
                    .is_some_and(|d| d.contains("could not be installed"))
        })
        .collect();
    if let Some(cell) = uninstallable.first() {
        let in_ci = std::env::var("CI").is_ok_and(|v| v == "true");
        assert!(!in_ci, "an SDK is required in CI: {cell}\n{stderr}");
        eprintln!("SKIPPED: an SDK is unavailable: {}", cell["detail"]);
        return None;
    }
    Some(matrix)
}

fn outcome<'a>(matrix: &'a Value, journey: &str, sdk: &str) -> &'a str {
    matrix["cells"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["journey"] == journey && c["sdk"] == sdk)
        .unwrap_or_else(|| panic!("no cell {journey} × {sdk}"))["outcome"]
        .as_str()
        .unwrap()
}

#[test]
fn three_sdks_drive_the_reference_and_the_matrix_is_in_the_evidence() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("evidence");
    let output = run_matrix(&[PYTHON, NODE, PYTHON_1], &[], &out);
    let Some(matrix) = matrix_of(&out, &output) else {
        return;
    };
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let columns: Vec<(&str, bool)> = matrix["sdks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["sdk"].as_str().unwrap(), c["judged"].as_bool().unwrap()))
        .collect();
    assert_eq!(columns, [(PYTHON, true), (NODE, true), (PYTHON_1, false)]);
    let rows: Vec<&str> = matrix["journeys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["journey"].as_str().unwrap())
        .collect();
    assert_eq!(rows, JOURNEYS);
    for journey in JOURNEYS {
        for sdk in [PYTHON, NODE] {
            assert_eq!(
                outcome(&matrix, journey, sdk),
                "pass",
                "{journey} × {sdk}\n{stderr}"
            );
        }
        // The 1.x releases have no pause: that journey is a skip with its reason.
        let old = if journey == "pause_connect" {
            "skip"
        } else {
            "pass"
        };
        assert_eq!(
            outcome(&matrix, journey, PYTHON_1),
            old,
            "{journey} × {PYTHON_1}\n{stderr}"
        );
    }
    // The judged journeys are scenarios of the run, MUST, in the family `sdk`; the older
    // major's are not.
    let report = receipt::predicate(&out);
    let ids: Vec<&str> = receipt::scenarios(&report)
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 16, "{ids:?}");
    assert!(ids.contains(&"E2B-SDK-PYTHON-FILES") && ids.contains(&"E2B-SDK-NODE-FILES"));
    let files = receipt::scenario(&report, "E2B-SDK-NODE-FILES");
    assert_eq!(
        (files["level"].as_str(), files["family"].as_str()),
        (Some("MUST"), Some("sdk"))
    );
    assert!(!files["clauses"].as_array().unwrap().is_empty());
    assert_eq!(receipt::verdict(&report), "conformant");
    // The views show the table, and the folder verifies.
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(summary.contains("## SDK matrix"), "{summary}");
    assert!(summary.contains(&format!("`{PYTHON_1}`")));
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("id=\"sdk-matrix\"") && html.contains("journey-secure_access"));
    assert_eq!(sandspec::evidence::verify_cli(&out, None), 0);
}

/// The control: a reference whose timeout calls can extend a sandbox's end but never move it
/// earlier fails the `timeouts` journey of the judged SDK at its step, naming the SDK and with
/// the SDK's own words; the same failure of the older major is reported and not judged.
#[test]
fn a_defect_fails_the_judged_journey_and_the_older_major_is_only_reported() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("evidence");
    let output = run_matrix(
        &[PYTHON, PYTHON_1],
        &["--defect", "e2b-timeout-only-extends"],
        &out,
    );
    let Some(matrix) = matrix_of(&out, &output) else {
        return;
    };
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert_eq!(outcome(&matrix, "timeouts", PYTHON), "fail");
    assert_eq!(outcome(&matrix, "timeouts", PYTHON_1), "fail");
    assert_eq!(outcome(&matrix, "files", PYTHON), "pass");
    let report = receipt::predicate(&out);
    assert_eq!(receipt::verdict(&report), "non-conformant");
    let failed: Vec<(&str, &str)> = receipt::scenarios(&report)
        .iter()
        .filter(|s| s["outcome"] == "fail")
        .map(|s| {
            let id = s["id"].as_str().unwrap();
            (id, s["reason"].as_str().unwrap_or_default())
        })
        .collect();
    let ids: Vec<&str> = failed.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, ["E2B-SDK-PYTHON-TIMEOUTS"], "{failed:#?}\n{stderr}");
    let timeouts = receipt::scenario(&report, "E2B-SDK-PYTHON-TIMEOUTS");
    assert_eq!(
        timeouts["failed_step"].as_str(),
        Some(format!("journey timeouts with {PYTHON}").as_str())
    );
    let reason = timeouts["reason"].as_str().unwrap();
    assert!(
        reason.contains("set_timeout moves the end earlier"),
        "{reason}"
    );
}
