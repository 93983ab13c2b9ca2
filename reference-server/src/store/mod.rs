//! Durable state behind one trait. Objects are stored as records (a few indexed columns and a
//! JSON body); streams are gap-free event logs; idempotency keys are remembered per principal.
//!
//! Architecture invariant: every read of records by ID or by list takes a [`Scope`]. An ID a
//! client sends is resolved as `Scope::Owner`; `Scope::System` reads what such a lookup has
//! already resolved, or serves callers that are not principals (reapers, test controls, the
//! preview proxy, the private bridge, E2B's envd).
//!
//! Both stores keep times as whole microseconds since the epoch and order text by bytes, so
//! they return the same records in the same order and compute the same [`Store::digest`] for
//! the same state. Several server processes may share one database (PostgreSQL, or one SQLite
//! file): appends, compare-and-swap updates and idempotency claims are atomic across them.
//! Schemas live in `migrations/{sqlite,postgres}/` and are applied when a store opens.

mod model;
mod postgres;
mod rows;
mod sql;
mod sqlite;
#[cfg(feature = "store-suite")]
pub mod suite;

use std::sync::Arc;

pub use model::{
    Event, ForeignAppend, IdemClaim, Kind, ListQuery, Record, Result, Scope, SlotClaim, Store,
    StoreError, StoreLock, StreamBounds,
};
pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;

use crate::config::Database;

/// Opens the configured store and runs its migrations.
pub async fn open(db: &Database) -> Result<Arc<dyn Store>> {
    Ok(match db {
        Database::Sqlite(path) => Arc::new(SqliteStore::open(path.as_deref()).await?),
        Database::Postgres(url) => Arc::new(PostgresStore::connect(url).await?),
    })
}
