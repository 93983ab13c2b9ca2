//! The evidence folder's fixed parts: the names of its files and the manifest that lists
//! them with their digests, which the writer, the signer and the verifier share.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// The manifest's own name; it lists every other file.
pub(crate) const MANIFEST: &str = "manifest.json";
pub(crate) const RECEIPT: &str = "receipt.json";
pub(crate) const SUMMARY: &str = "summary.md";
pub(crate) const JUNIT: &str = "junit.xml";
pub(crate) const REPORT: &str = "report.html";

/// The envelope's file name in a run folder.
pub const ENVELOPE: &str = "receipt.dsse.json";

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Manifest {
    pub files: Vec<ManifestEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ManifestEntry {
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
}
/// Lowercase hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}
