//! Why a target could not be set up.

use std::path::PathBuf;

/// Why a target could not be set up. These are harness errors (exit code 3), except where
/// the user's flags are wrong (exit code 2, [`TargetError::is_usage`]).
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("{0}")]
    Usage(String),
    #[error("environment variable `{0}` (named by a --*-token-env flag) is not set")]
    MissingTokenEnv(String),
    #[error("cannot read CA file {path}: {source}")]
    CaFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("CA file {0} holds no usable PEM certificate")]
    BadCa(PathBuf),
    #[error("invalid target URL `{0}`")]
    BadUrl(String),
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    #[error("cannot start the reference server ({binary}): {reason}")]
    Spawn { binary: String, reason: String },
    #[error("{url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{url}: capabilities are not usable: {reason}")]
    BadCapabilities { url: String, reason: String },
}

impl TargetError {
    /// A mistake in the flags rather than a broken target.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            TargetError::Usage(_)
                | TargetError::MissingTokenEnv(_)
                | TargetError::BadUrl(_)
                | TargetError::CaFile { .. }
                | TargetError::BadCa(_)
        )
    }
}
