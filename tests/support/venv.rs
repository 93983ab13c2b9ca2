//! Pinned PyPI packages in a virtualenv of their own, for tests that drive real third-party
//! software. Shared by the test binaries of both crates (the reference server's include it by
//! path).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

/// The executable `exe` of the virtualenv `name` with the pinned `packages` (see [`pinned`]),
/// under the test binary's `CARGO_TARGET_TMPDIR`; `None` as with [`pinned`].
pub fn executable(name: &str, packages: &[&str], exe: &str) -> Option<PathBuf> {
    let venv = pinned(env!("CARGO_TARGET_TMPDIR"), name, packages)?;
    Some(venv.join("bin").join(exe))
}

/// A virtualenv named `name` under `target_tmp` (the test's `CARGO_TARGET_TMPDIR`) with the
/// pinned `packages` installed, made once and reused while its marker says that the same
/// packages were installed completely. `None` when it cannot be had: a visible skip, except
/// under `CI=true`, where it is a failure. Returns the virtualenv's directory.
pub fn pinned(target_tmp: &str, name: &str, packages: &[&str]) -> Option<PathBuf> {
    // The tests of one binary that need the same virtualenv wait for the one that installs it;
    // other virtualenvs install beside it.
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
    let venv = Path::new(target_tmp).join(name);
    let marker = venv.join("sandspec-installed");
    if std::fs::read_to_string(&marker).is_ok_and(|m| m == what) {
        return Some(venv);
    }
    // Half an install, or one of other versions: start again.
    let _ = std::fs::remove_dir_all(&venv);
    match Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
    {
        Ok(s) if s.success() => {}
        other => return unavailable(format!("python3 -m venv failed: {other:?}")),
    }
    let pip = Command::new(venv.join("bin").join("pip"))
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .args(packages)
        .status();
    match pip {
        Ok(s) if s.success() => {}
        other => {
            let _ = std::fs::remove_dir_all(&venv);
            return unavailable(format!("pip install {what} failed: {other:?}"));
        }
    }
    std::fs::write(&marker, &what).expect("write the install marker");
    Some(venv)
}
