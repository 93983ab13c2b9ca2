//! Evidence: the receipt model, the one sanitizer, the run-folder writer (with its HTML
//! report and optional signature) and its verifier.
//!
//! **Architecture Invariant:** nothing writes evidence except [`write_run_folder`], and it
//! renders every file in memory from a sanitized copy of the run, scans the result for any
//! secret or the run's canary, and writes nothing at all if one survives.

mod clean;
mod folder;
mod html;
mod normalize;
mod placeholders;
mod receipt;
mod sanitize;
mod schema;
mod sign;
mod summary;
mod verify;
mod writer;

pub use clean::sanitized_report;
pub use folder::sha256_hex;
pub use normalize::normalize;
pub use placeholders::Placeholders;
pub use receipt::{
    AbsenceConfirmation, ClauseCoverage, Cleanup, Counts, Coverage, Digest, Environment, FileRef,
    Measurement, OutcomeLabel, PREDICATE_TYPE, ProfileResult, Receipt, ResourceDescriptor,
    STATEMENT_TYPE, SanitizerInfo, ScenarioResult, Selection, Statement, StreamTiming, Subject,
    SubjectSource, Suite, SweptResource, TargetIdentity, suite_commit,
};
pub use sanitize::{
    Leak, MIN_SECRET_LEN, REDACTED, Sanitizer, SecretError, for_tokens, new_canary,
};
pub use schema::{RECEIPT_SCHEMA, validate_receipt};
pub use sign::{
    ENVELOPE, Envelope, EnvelopeSignature, KeyError, PAYLOAD_TYPE, SigningKey, VerifyingKey, pae,
};
pub use verify::{Problem, VerifyReport, verify, verify_cli, verify_with_key};
pub use writer::{
    EvidenceError, WriteOptions, default_run_dir, expected_failures, write_run_folder,
};
