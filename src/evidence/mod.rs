//! Evidence: the receipt model, the one sanitizer, the run-folder writer (with its HTML
//! report and optional signature), its verifier, and what is done with verified folders: two
//! compared for a release review (`compare`), the shards of one run merged (`merge`).
//!
//! **Architecture Invariant:** nothing writes evidence except [`write_run_folder`] and
//! [`merge`], and both render every file in memory, scan the result for any secret (a run's
//! folder also for its canary), verify it, and write nothing at all if one survives.

mod clean;
mod compare;
mod folder;
mod html;
mod merge;
mod normalize;
mod operations;
mod placeholders;
mod receipt;
mod sanitize;
mod schema;
mod sign;
mod summary;
mod verify;
mod writer;

pub use clean::sanitized_report;
pub use compare::{Change, Diff, RunRef, Spread, TimeChange, VerdictChange};
pub use folder::sha256_hex;
pub use merge::{MergeError, Merged, merge};
pub use normalize::normalize;
pub use operations::{OperationCoverage, OperationRow};
pub use placeholders::Placeholders;
pub use receipt::{
    AbsenceConfirmation, ClauseCoverage, Cleanup, Counts, Coverage, Digest, Environment, FileRef,
    Measurement, OutcomeLabel, PREDICATE_TYPE, ProfileResult, Receipt, ResourceDescriptor,
    STATEMENT_TYPE, SanitizerInfo, ScenarioResult, Selection, ShardRef, Statement, StreamTiming,
    Subject, SubjectSource, Suite, SweptResource, TargetIdentity, suite_commit,
};
pub use sanitize::{
    Leak, MIN_SECRET_LEN, REDACTED, Sanitizer, SecretError, for_tokens, new_canary,
};
pub use schema::{RECEIPT_SCHEMA, validate_receipt};
pub use sign::{
    ENVELOPE, Envelope, EnvelopeSignature, KeyError, PAYLOAD_TYPE, SigningKey, VerifyingKey, pae,
};
pub use verify::{Problem, VerifyReport, load_verified, verify, verify_cli, verify_with_key};
pub use writer::{
    EvidenceError, WriteOptions, default_run_dir, expected_failures, write_run_folder,
};
