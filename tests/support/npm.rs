//! Pinned npm packages in a prefix of their own, for tests that drive real third-party
//! JavaScript software with node: the npm counterpart of `venv.rs`, beside which it lives so
//! that either crate's tests can include it by path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

/// An npm prefix named `name` under `target_tmp` (the test's `CARGO_TARGET_TMPDIR`) with the
/// pinned `packages` (`name@version`) installed, made once and reused while its marker says
/// that the same packages were installed completely. `None` when node or the packages cannot
/// be had: a visible skip, except under `CI=true`, where it is a failure. Returns the prefix.
pub fn pinned(target_tmp: &str, name: &str, packages: &[&str]) -> Option<PathBuf> {
    // The tests of one binary that need the same prefix wait for the one that installs it.
    static INSTALLS: Mutex<BTreeMap<String, Arc<Mutex<()>>>> = Mutex::new(BTreeMap::new());
    let install = INSTALLS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(name.to_owned())
        .or_default()
        .clone();
    let _guard = install.lock().unwrap_or_else(|p| p.into_inner());
    let in_ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let what = packages.join(" ");
    let unavailable = |why: String| {
        assert!(!in_ci, "{what} is required in CI: {why}");
        eprintln!("SKIPPED: {what} is unavailable: {why}");
        None
    };
    match Command::new("node").arg("--version").output() {
        Ok(out) if out.status.success() => {}
        other => return unavailable(format!("node cannot be run: {other:?}")),
    }
    let prefix = Path::new(target_tmp).join(name);
    let marker = prefix.join("sandspec-installed");
    if std::fs::read_to_string(&marker).is_ok_and(|m| m == what) {
        return Some(prefix);
    }
    // Half an install, or one of other versions: start again.
    let _ = std::fs::remove_dir_all(&prefix);
    if let Err(e) = std::fs::create_dir_all(&prefix) {
        return unavailable(format!("cannot make {}: {e}", prefix.display()));
    }
    let npm = Command::new("npm")
        .args([
            "install",
            "--no-audit",
            "--no-fund",
            "--no-save",
            "--prefix",
        ])
        .arg(&prefix)
        .args(packages)
        .status();
    match npm {
        Ok(s) if s.success() => {}
        other => {
            let _ = std::fs::remove_dir_all(&prefix);
            return unavailable(format!("npm install {what} failed: {other:?}"));
        }
    }
    std::fs::write(&marker, &what).expect("write the install marker");
    Some(prefix)
}
