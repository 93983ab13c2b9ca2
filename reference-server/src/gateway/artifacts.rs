//! Artifacts (§8.6): the regular files below `artifacts/` of the sandbox root that a turn
//! created or changed, copied when the turn ends so later changes do not affect them.
//!
//! What a turn changed is decided against a manifest (path → SHA-256) taken when it started;
//! without one (this server process restarted meanwhile) every file counts as changed.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use time::OffsetDateTime;

use crate::sandbox::{FileError, SandboxFiles};

/// The directory, relative to the sandbox root, whose files become artifacts.
pub const DIR: &str = "artifacts";
/// Files visited at most per scan, so a runaway turn cannot make a scan unbounded.
const MAX_FILES: usize = 1000;

/// Path (relative to the root) → SHA-256 hex of every regular file below [`DIR`].
pub type Manifest = BTreeMap<String, String>;

/// One regular file below [`DIR`] and its content.
pub struct Found {
    pub path: String,
    pub bytes: Vec<u8>,
    pub sha256: String,
}

/// Every regular file below [`DIR`], with its content. Symlinks are not followed; a missing
/// directory is no files.
pub fn scan(files: &SandboxFiles) -> Result<Vec<Found>, FileError> {
    let mut out = Vec::new();
    let mut dirs = vec![DIR.to_owned()];
    while let Some(dir) = dirs.pop() {
        let entries = match files.list(&dir) {
            Ok(e) => e,
            Err(FileError::NotFound | FileError::WrongKind) => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let path = format!("{dir}/{}", entry.name);
            match entry.kind {
                "dir" => dirs.push(path),
                "file" if out.len() < MAX_FILES => {
                    let bytes = files.read(&path)?;
                    let sha256 = hex::encode(Sha256::digest(&bytes));
                    out.push(Found {
                        path,
                        bytes,
                        sha256,
                    });
                }
                _ => {}
            }
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

pub fn manifest(found: &[Found]) -> Manifest {
    found
        .iter()
        .map(|f| (f.path.clone(), f.sha256.clone()))
        .collect()
}

/// The files of `now` that are new or different from `before` (all of them without `before`).
pub fn changed(now: Vec<Found>, before: Option<&Manifest>) -> Vec<Found> {
    now.into_iter()
        .filter(|f| before.is_none_or(|m| m.get(&f.path) != Some(&f.sha256)))
        .collect()
}

/// An artifact as stored and sent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ArtifactDoc {
    pub id: String,
    pub session_id: String,
    pub submission_id: String,
    pub path: String,
    pub size: u64,
    pub sha256: String,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    pub expires_at: OffsetDateTime,
}

impl ArtifactDoc {
    pub fn view(&self) -> Value {
        json!(self)
    }
}

/// Where artifact contents are kept: outside every sandbox, below the data directory.
pub fn content_path(data_dir: &std::path::Path, id: &str) -> PathBuf {
    data_dir.join("artifacts").join(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(path: &str, sha: &str) -> Found {
        Found {
            path: path.into(),
            bytes: Vec::new(),
            sha256: sha.into(),
        }
    }

    #[test]
    fn only_new_or_changed_files_count() {
        let before: Manifest = [
            ("artifacts/a".to_owned(), "1".to_owned()),
            ("artifacts/b".to_owned(), "2".to_owned()),
        ]
        .into_iter()
        .collect();
        let now = vec![
            found("artifacts/a", "1"),
            found("artifacts/b", "3"),
            found("artifacts/c", "4"),
        ];
        let paths: Vec<String> = changed(now, Some(&before))
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(paths, ["artifacts/b", "artifacts/c"]);
        let all: Vec<String> = changed(vec![found("artifacts/a", "1")], None)
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(all, ["artifacts/a"]);
    }
}
