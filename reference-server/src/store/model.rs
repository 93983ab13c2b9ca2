//! What a store keeps (records, event logs, idempotency keys) and the [`Store`] trait that
//! both stores implement.

use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use time::OffsetDateTime;

/// The kinds of stored objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Sandbox,
    Connection,
    Snapshot,
    Process,
    Preview,
    Session,
    Submission,
    Operation,
    Artifact,
}

impl Kind {
    pub const ALL: &'static [Kind] = &[
        Kind::Sandbox,
        Kind::Connection,
        Kind::Snapshot,
        Kind::Process,
        Kind::Preview,
        Kind::Session,
        Kind::Submission,
        Kind::Operation,
        Kind::Artifact,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Sandbox => "sandbox",
            Kind::Connection => "connection",
            Kind::Snapshot => "snapshot",
            Kind::Process => "process",
            Kind::Preview => "preview",
            Kind::Session => "session",
            Kind::Submission => "submission",
            Kind::Operation => "operation",
            Kind::Artifact => "artifact",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.iter().copied().find(|k| k.as_str() == s)
    }
}

/// One stored object.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub kind: Kind,
    /// Unique per kind (for provider-qualified objects, the qualified ID).
    pub id: String,
    /// The principal that owns it.
    pub owner: String,
    /// The object it belongs to (a process's sandbox, a submission's session), if any.
    pub parent: Option<String>,
    /// The state, duplicated out of the body so lists can filter on it.
    pub state: String,
    pub body: Value,
    /// Starts at 1; every update bumps it. Updates are compare-and-swap on it, which is how
    /// writes from a stale worker or a racing server process are fenced.
    pub version: i64,
    /// Microsecond precision; lists are ordered by `(created_at, id)`.
    pub created_at: OffsetDateTime,
    /// When a reaper must look at it next (TTL, retention), if ever.
    pub due_at: Option<OffsetDateTime>,
}

/// Whose objects a lookup may see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope<'a> {
    /// Only objects this principal owns.
    Owner(&'a str),
    /// Everything: reapers and test controls only.
    System,
}

/// A list query. Results are ordered by `(created_at, id)` ascending.
#[derive(Debug, Clone)]
pub struct ListQuery<'a> {
    pub kind: Kind,
    pub scope: Scope<'a>,
    pub parent: Option<&'a str>,
    pub state: Option<&'a str>,
    /// Records in any of these states (as well as `state`); no condition when empty.
    pub states: &'a [&'a str],
    /// Keyset cursor: only records strictly after `(created_at, id)`.
    pub after: Option<(OffsetDateTime, String)>,
    /// At most this many records; `None` for all.
    pub limit: Option<u32>,
}

impl<'a> ListQuery<'a> {
    pub fn new(kind: Kind, scope: Scope<'a>) -> Self {
        Self {
            kind,
            scope,
            parent: None,
            state: None,
            states: &[],
            after: None,
            limit: None,
        }
    }
}

/// One event of a stream's durable log.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub stream: String,
    /// Gap-free per stream, starting at 1.
    pub seq: i64,
    pub kind: String,
    pub data: Value,
    pub at: OffsetDateTime,
}

/// What a stream's log holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamBounds {
    /// The last sequence number ever appended (0 when none).
    pub last_seq: i64,
    /// Every event with `seq <= purged_through` has been dropped by retention.
    pub purged_through: i64,
}

/// The outcome of claiming an idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdemClaim {
    /// The key was free and is now claimed by this request.
    Claimed,
    /// Another request holds the key and has not finished.
    InFlight { request_hash: String },
    /// A request with this key finished earlier.
    Done {
        request_hash: String,
        status: u16,
        resource_id: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An insert whose ID exists, or an update whose version is stale.
    #[error("conflicting write")]
    Conflict,
    /// An update or delete of a record that does not exist.
    #[error("record not found")]
    NotFound,
    /// The database could not be reached or answered with an error.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A stored body could not be decoded.
    #[error("corrupt record: {0}")]
    Corrupt(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Conflict,
            sqlx::Error::RowNotFound => StoreError::NotFound,
            sqlx::Error::ColumnDecode { .. }
            | sqlx::Error::Decode(_)
            | sqlx::Error::ColumnNotFound(_) => StoreError::Corrupt(e.to_string()),
            _ => StoreError::Unavailable(e.to_string()),
        }
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// An append made by another server process sharing the database: `(stream, seq)`.
pub type ForeignAppend = (String, i64);

/// A lock that excludes every other holder of the same key in every server process sharing
/// the database, held until dropped. For PostgreSQL it is a transaction holding an advisory
/// lock (a dropped guard rolls back, which releases it; so does a lost connection); the SQLite
/// store serves one server process and its lock is empty (callers serialize in memory too).
pub struct StoreLock {
    _held: Option<Box<dyn std::any::Any + Send>>,
}

impl StoreLock {
    pub fn none() -> Self {
        Self { _held: None }
    }

    pub(super) fn held(inner: impl std::any::Any + Send) -> Self {
        Self {
            _held: Some(Box::new(inner)),
        }
    }
}

/// Durable state. Implemented for SQLite and PostgreSQL; both pass the shared store suite (`store::suite`).
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Whether the database answers (health checks).
    async fn ping(&self) -> Result<()>;

    /// Stores a new record with `version = 1` (whatever `rec.version` says). `Conflict` when
    /// the (kind, id) exists. Times are kept to the microsecond.
    async fn insert(&self, rec: &Record) -> Result<()>;

    /// One record, if it exists and is visible in `scope`.
    async fn get(&self, kind: Kind, scope: Scope<'_>, id: &str) -> Result<Option<Record>>;

    /// Replaces a record if its stored version still equals `rec.version`; returns the record
    /// as stored (version bumped). `Conflict` on a stale version, `NotFound` when gone.
    /// `parent`, `state`, `body` and `due_at` are replaced; `owner` and `created_at` are fixed
    /// at insert (list order and ownership never change).
    async fn update(&self, rec: &Record) -> Result<Record>;

    /// Removes a record; false when it did not exist.
    async fn delete(&self, kind: Kind, id: &str) -> Result<bool>;

    async fn list(&self, q: &ListQuery<'_>) -> Result<Vec<Record>>;

    /// Records of `kind` whose `due_at` is at or before `now`, any owner, oldest due first.
    async fn due(&self, kind: Kind, now: OffsetDateTime, limit: u32) -> Result<Vec<Record>>;

    /// Appends an event with the stream's next sequence number (gap-free, concurrency-safe).
    async fn append_event(&self, stream: &str, kind: &str, data: &Value) -> Result<Event>;

    /// Events with `seq > after`, ascending, at most `limit`.
    async fn events_after(&self, stream: &str, after: i64, limit: u32) -> Result<Vec<Event>>;

    async fn stream_bounds(&self, stream: &str) -> Result<StreamBounds>;

    /// Drops every event of the stream with `seq <= through` (retention) and records it.
    /// `purged_through` never goes down, nor past `last_seq`; an unknown stream is left alone.
    async fn purge_events(&self, stream: &str, through: i64) -> Result<()>;

    /// Removes a stream and its events altogether (its owner is gone); its bounds read as
    /// zero again.
    async fn drop_stream(&self, stream: &str) -> Result<()>;

    /// Claims `key` for `principal` (the key already includes the operation) unless it is
    /// held or was used; keys (of every principal) claimed before `expire_before` are
    /// forgotten first. Atomic across server processes: of concurrent claims, one wins.
    async fn idem_claim(
        &self,
        principal: &str,
        key: &str,
        request_hash: &str,
        expire_before: OffsetDateTime,
    ) -> Result<IdemClaim>;

    /// Marks a claimed key finished with the response it produced. A key forgotten meanwhile
    /// stays forgotten.
    async fn idem_complete(
        &self,
        principal: &str,
        key: &str,
        status: u16,
        resource_id: &str,
    ) -> Result<()>;

    /// Releases a claimed key whose request failed, so that nothing is recorded for it. A key
    /// already completed is kept.
    async fn idem_release(&self, principal: &str, key: &str) -> Result<()>;

    /// SHA-256 (hex) over every durable row in a canonical order: records, events, stream
    /// bounds and idempotency keys. Equal digests mean equal durable state.
    async fn digest(&self) -> Result<String>;

    // ----- several server processes on one database -----

    /// This server process's identity among the processes sharing the database, fixed when
    /// the store opens.
    fn instance(&self) -> &str;

    /// Whether the server process `instance` is alive. PostgreSQL answers from the advisory
    /// lock each process holds on a connection of its own for as long as it runs (a killed
    /// process's connection closes and its lock goes with it). A SQLite database serves one
    /// server process at a time, so any other instance is a previous run: not alive.
    async fn instance_alive(&self, instance: &str) -> Result<bool>;

    /// How long another instance must be seen dead before its work is taken over: a process
    /// whose instance lock is briefly gone (a database restart) reclaims it within this time.
    fn takeover_grace(&self) -> Duration {
        Duration::ZERO
    }

    /// Takes the cross-process lock on `key`, waiting for other holders.
    async fn lock(&self, key: &str) -> Result<StoreLock>;

    /// A 32-byte key shared by every server process on the database (created by the first
    /// that asks, with `fresh`). Kept apart from the state [`Store::digest`] covers.
    async fn shared_key(&self, name: &str, fresh: [u8; 32]) -> Result<[u8; 32]>;

    /// Appends made by other server processes, as they commit (PostgreSQL LISTEN/NOTIFY).
    /// Only a wake-up: a lost notification is made good by the next read of the log. `None`
    /// when no other process can append (SQLite).
    fn foreign_appends(&self) -> Option<tokio::sync::broadcast::Receiver<ForeignAppend>> {
        None
    }

    /// Claims one of `principal`'s `limit` concurrent stream slots across every server process
    /// sharing the database; slots of processes that died are forgotten first. `Local` when
    /// the store serves one process (SQLite), whose in-memory count is the whole truth.
    async fn claim_stream_slot(&self, _principal: &str, _limit: u32) -> Result<SlotClaim> {
        Ok(SlotClaim::Local)
    }

    /// Gives back a slot [`Store::claim_stream_slot`] answered `Held` for.
    async fn release_stream_slot(&self, _id: &str) -> Result<()> {
        Ok(())
    }
}

/// The answer of [`Store::claim_stream_slot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotClaim {
    /// Only this process streams from the database: nothing is kept in the store.
    Local,
    /// A slot kept in the store under this ID until released.
    Held(String),
    /// Every slot of the principal is taken.
    Full,
}
