//! `sandspec evidence diff` and `sandspec evidence merge`: what is done with verified run
//! folders, with their output and exit codes (the work is [`crate::evidence`]'s).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::cli::{EXIT_CONFORMANT, EXIT_HARNESS, EXIT_NOT_CONFORMANT, EXIT_USAGE};
use crate::evidence::{Diff, MergeError, SigningKey};

/// Compares `old` with `new`: Markdown on standard output (or to `markdown`), JSON to `json`;
/// exit code 1 when the new run is worse, 2 when a folder is refused.
pub fn diff(old: &Path, new: &Path, json: Option<&Path>, markdown: Option<&Path>) -> ExitCode {
    let diff = match Diff::of(old, new) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let text = diff.markdown();
    let written = match markdown {
        Some(file) => std::fs::write(file, &text).map_err(|e| (file.to_path_buf(), e)),
        None => {
            print!("{text}");
            Ok(())
        }
    }
    .and_then(|()| match json {
        Some(file) => {
            let bytes = serde_json::to_vec_pretty(&diff).expect("a diff serializes");
            std::fs::write(file, bytes).map_err(|e| (file.to_path_buf(), e))
        }
        None => Ok(()),
    });
    if let Err((file, e)) = written {
        eprintln!("error: cannot write {}: {e}", file.display());
        return ExitCode::from(EXIT_HARNESS);
    }
    ExitCode::from(if diff.worse() {
        EXIT_NOT_CONFORMANT
    } else {
        EXIT_CONFORMANT
    })
}

/// Merges the shard folders `dirs` into `out`, signed with the key at `sign_key` when given.
/// The exit code is the merged run's, as `sandspec run` would have ended it: 0 conformant (or
/// its gate passed), 1 not (or its gate failed), 2 refused shards, 3 not written.
pub fn merge(dirs: &[PathBuf], out: &Path, sign_key: Option<&Path>) -> ExitCode {
    let key = match sign_key.map(SigningKey::from_file).transpose() {
        Ok(k) => k,
        Err(e) => {
            eprintln!("error: --sign-key: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match crate::evidence::merge(dirs, out, key.as_ref()) {
        Ok(merged) => {
            let r = &merged.statement.predicate;
            let all = r.profiles.iter().find(|p| p.profile == crate::report::ALL);
            if let Some(all) = all {
                println!(
                    "all: {}{}",
                    all.verdict,
                    all.reason
                        .as_deref()
                        .map(|r| format!(" ({r})"))
                        .unwrap_or_default()
                );
            }
            if let Some(gate) = &r.gate {
                println!("gate: {}", gate.line());
            }
            eprintln!("merged: {}", merged.dir.display());
            let passed = match &r.gate {
                Some(gate) => gate.passed(),
                None => all.is_some_and(|a| a.verdict == "conformant"),
            };
            ExitCode::from(if passed {
                EXIT_CONFORMANT
            } else {
                EXIT_NOT_CONFORMANT
            })
        }
        Err(e @ MergeError::Write(_)) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_HARNESS)
        }
        Err(e @ MergeError::Refused(_)) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}
