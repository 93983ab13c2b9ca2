//! The SQLite store: the embedded default, in a file or in memory.

use std::path::Path;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use sqlx::migrate::Migrator;
use sqlx::sqlite::{
    Sqlite, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool,
    SqlitePoolOptions, SqliteQueryResult, SqliteSynchronous,
};
use sqlx::{Connection as _, Row as _};
use time::OffsetDateTime;

use super::rows::{RawIdem, json_text, micros};
use super::sql::{self, SqlStore};
use super::{IdemClaim, Result, StoreError, StoreLock};

/// How long a writer waits for another connection (or another server process) to release the
/// database lock before the store reports itself unavailable.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

pub struct SqliteStore {
    pool: SqlitePool,
    /// Keeps an in-memory database alive: SQLite drops it with its last connection, and the
    /// pool may close and reopen its connection. Never used for queries. `None` for a file.
    _memory_anchor: Option<Mutex<SqliteConnection>>,
    /// This server process's instance ID.
    instance: String,
}

fn migrator() -> Migrator {
    sql::migrator(&[
        (
            1,
            "initial",
            include_str!("../../migrations/sqlite/0001_initial.sql"),
        ),
        (
            2,
            "server keys",
            include_str!("../../migrations/sqlite/0002_server_keys.sql"),
        ),
    ])
}

impl SqliteStore {
    /// Opens the database at `path` (created with its directory if missing, in WAL mode so
    /// readers never wait for a writer), or a private in-memory database when `path` is
    /// `None`, and migrates it.
    pub async fn open(path: Option<&Path>) -> Result<Self> {
        let (pool, anchor) = match path {
            None => {
                // Every parse of `sqlite::memory:` names a new shared-cache database, so this
                // store's connections see one database that no other store sees.
                let options = SqliteConnectOptions::from_str("sqlite::memory:")?;
                let anchor = SqliteConnection::connect_with(&options).await?;
                // One connection: shared-cache connections lock whole tables and fail rather
                // than wait, so concurrent work is serialized by the pool instead.
                // A connection to a local file or memory does not go stale the way a network
                // one does, so the pool does not ping it before each query.
                let pool = SqlitePoolOptions::new()
                    .max_connections(1)
                    .min_connections(1)
                    .test_before_acquire(false)
                    .idle_timeout(None)
                    .max_lifetime(None)
                    .connect_with(options)
                    .await?;
                (pool, Some(Mutex::new(anchor)))
            }
            Some(path) => {
                if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                    std::fs::create_dir_all(parent).map_err(|e| {
                        StoreError::Unavailable(format!("creating {}: {e}", parent.display()))
                    })?;
                }
                let options = SqliteConnectOptions::new()
                    .filename(path)
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    // In WAL mode, NORMAL loses nothing when the process dies, only on power loss.
                    .synchronous(SqliteSynchronous::Normal)
                    .busy_timeout(BUSY_TIMEOUT);
                let pool = SqlitePoolOptions::new()
                    .max_connections(4)
                    .test_before_acquire(false)
                    .connect_with(options)
                    .await?;
                (pool, None)
            }
        };
        migrator()
            .run(&pool)
            .await
            .map_err(|e| StoreError::Unavailable(format!("migrating: {e}")))?;
        Ok(Self {
            pool,
            _memory_anchor: anchor,
            instance: ulid::Ulid::new().to_string().to_ascii_lowercase(),
        })
    }
}

#[async_trait]
impl SqlStore for SqliteStore {
    type DB = Sqlite;

    const GET: &'static str = "SELECT kind, id, owner, parent, state, body, version, created_at, due_at \
         FROM records WHERE kind = $1 AND id = $2 AND ($3 IS NULL OR owner = $3)";
    const PURGE: &'static str = "UPDATE streams SET purged_through = MAX(purged_through, MIN($2, last_seq)) \
         WHERE stream = $1 RETURNING purged_through";
    /// Write transactions take the database lock when they begin: a deferred transaction that
    /// later upgrades from reading to writing can fail at once with `SQLITE_BUSY`, whatever the
    /// busy timeout.
    const BEGIN_WRITE: &'static str = "BEGIN IMMEDIATE";
    /// A read transaction sees one snapshot of the database from its first read.
    const BEGIN_SNAPSHOT: &'static str = "BEGIN";

    fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    fn rows_affected(done: &SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    async fn append(
        &self,
        stream: &str,
        kind: &str,
        data: &Value,
        at: OffsetDateTime,
    ) -> Result<i64> {
        let mut tx = self.pool.begin_with(Self::BEGIN_WRITE).await?;
        let seq: i64 = sqlx::query(
            "INSERT INTO streams (stream, last_seq, purged_through) VALUES ($1, 1, 0) \
             ON CONFLICT (stream) DO UPDATE SET last_seq = last_seq + 1 RETURNING last_seq",
        )
        .bind(stream)
        .fetch_one(&mut *tx)
        .await?
        .try_get(0)?;
        sqlx::query("INSERT INTO events (stream, seq, kind, data, at) VALUES ($1, $2, $3, $4, $5)")
            .bind(stream)
            .bind(seq)
            .bind(kind)
            .bind(json_text(data))
            .bind(micros(at))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(seq)
    }

    async fn claim_key(
        &self,
        principal: &str,
        key: &str,
        request_hash: &str,
        expire_before: OffsetDateTime,
    ) -> Result<IdemClaim> {
        let mut tx = self.pool.begin_with(Self::BEGIN_WRITE).await?;
        sqlx::query("DELETE FROM idempotency WHERE created_at < $1")
            .bind(micros(expire_before))
            .execute(&mut *tx)
            .await?;
        let inserted = sqlx::query(
            "INSERT INTO idempotency (principal, key, request_hash, status, resource_id, created_at) \
             VALUES ($1, $2, $3, NULL, NULL, $4) ON CONFLICT (principal, key) DO NOTHING",
        )
        .bind(principal)
        .bind(key)
        .bind(request_hash)
        .bind(micros(crate::clock::now()))
        .execute(&mut *tx)
        .await?;
        let claim = if inserted.rows_affected() == 1 {
            IdemClaim::Claimed
        } else {
            let row = sqlx::query(
                "SELECT principal, key, request_hash, status, resource_id, created_at FROM idempotency \
                 WHERE principal = $1 AND key = $2",
            )
            .bind(principal)
            .bind(key)
            .fetch_one(&mut *tx)
            .await?;
            RawIdem::from_row(&row)?.into_claim()?
        };
        tx.commit().await?;
        Ok(claim)
    }

    fn instance_id(&self) -> &str {
        &self.instance
    }

    async fn is_alive(&self, instance: &str) -> Result<bool> {
        Ok(instance == self.instance)
    }

    async fn take_lock(&self, _key: &str) -> Result<StoreLock> {
        Ok(StoreLock::none())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::Store;

    // The shared store suite runs on SQLite (in memory and in a file) and PostgreSQL in
    // tests/store.rs; what is here is SQLite's own.

    #[tokio::test]
    async fn memory_stores_are_private() {
        let a = SqliteStore::open(None).await.unwrap();
        let b = SqliteStore::open(None).await.unwrap();
        a.append_event("s", "k", &Value::Null).await.unwrap();
        assert_eq!(a.stream_bounds("s").await.unwrap().last_seq, 1);
        assert_eq!(b.stream_bounds("s").await.unwrap().last_seq, 0);
    }

    #[tokio::test]
    async fn file_store_keeps_state_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("not-yet").join("sandspec.db");
        let digest = {
            let store = SqliteStore::open(Some(&path)).await.unwrap();
            store
                .append_event("s", "k", &serde_json::json!({"a": 1}))
                .await
                .unwrap();
            store.digest().await.unwrap()
        };
        let store = SqliteStore::open(Some(&path)).await.unwrap();
        assert_eq!(store.stream_bounds("s").await.unwrap().last_seq, 1);
        assert_eq!(store.digest().await.unwrap(), digest);
    }

    #[tokio::test]
    async fn two_pools_on_one_file_append_without_gaps() {
        // Stands in for two server processes sharing one SQLite file.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sandspec.db");
        let a: Arc<dyn Store> = Arc::new(SqliteStore::open(Some(&path)).await.unwrap());
        let b: Arc<dyn Store> = Arc::new(SqliteStore::open(Some(&path)).await.unwrap());
        let mut tasks = Vec::new();
        for i in 0..40 {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            tasks.push(tokio::spawn(async move {
                store
                    .append_event("s", "k", &Value::Null)
                    .await
                    .unwrap()
                    .seq
            }));
        }
        let mut seqs = Vec::new();
        for t in tasks {
            seqs.push(t.await.unwrap());
        }
        seqs.sort_unstable();
        assert_eq!(seqs, (1..=40).collect::<Vec<i64>>());
    }
}
