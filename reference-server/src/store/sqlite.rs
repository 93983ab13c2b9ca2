//! The SQLite store: the embedded default, in a file or in memory.

use std::path::Path;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Connection as _, Row as _, SqlSafeStr as _};
use time::OffsetDateTime;

use super::rows::{
    RawEvent, RawIdem, RawRecord, RawStream, Snapshot, decode_key, json_text, list_query, micros,
};
use super::{
    Event, IdemClaim, Kind, ListQuery, Record, Result, Scope, Store, StoreError, StoreLock,
    StreamBounds,
};

/// How long a writer waits for another connection (or another server process) to release the
/// database lock before the store reports itself unavailable.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Write transactions take the database lock when they begin: a deferred transaction that
/// later upgrades from reading to writing can fail at once with `SQLITE_BUSY`, whatever the
/// busy timeout.
const BEGIN_WRITE: &str = "BEGIN IMMEDIATE";

pub struct SqliteStore {
    pool: SqlitePool,
    /// Keeps an in-memory database alive: SQLite drops it with its last connection, and the
    /// pool may close and reopen its connection. Never used for queries. `None` for a file.
    _memory_anchor: Option<Mutex<SqliteConnection>>,
    /// This server process's instance ID.
    instance: String,
}

fn migrator() -> Migrator {
    Migrator::with_migrations(vec![
        Migration::new(
            1,
            "initial".into(),
            MigrationType::Simple,
            include_str!("../../migrations/sqlite/0001_initial.sql").into_sql_str(),
            false,
        ),
        Migration::new(
            2,
            "server keys".into(),
            MigrationType::Simple,
            include_str!("../../migrations/sqlite/0002_server_keys.sql").into_sql_str(),
            false,
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
impl Store for SqliteStore {
    async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn insert(&self, rec: &Record) -> Result<()> {
        sqlx::query(
            "INSERT INTO records (kind, id, owner, parent, state, body, version, created_at, due_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, 1, ?7, ?8)",
        )
        .bind(rec.kind.as_str())
        .bind(&rec.id)
        .bind(&rec.owner)
        .bind(&rec.parent)
        .bind(&rec.state)
        .bind(json_text(&rec.body))
        .bind(micros(rec.created_at))
        .bind(rec.due_at.map(micros))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn get(&self, kind: Kind, scope: Scope<'_>, id: &str) -> Result<Option<Record>> {
        let owner = match scope {
            Scope::Owner(owner) => Some(owner),
            Scope::System => None,
        };
        let row = sqlx::query(
            "SELECT kind, id, owner, parent, state, body, version, created_at, due_at FROM records \
             WHERE kind = ?1 AND id = ?2 AND (?3 IS NULL OR owner = ?3)",
        )
        .bind(kind.as_str())
        .bind(id)
        .bind(owner)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|r| RawRecord::from_row(&r)?.into_record())
            .transpose()
    }

    async fn update(&self, rec: &Record) -> Result<Record> {
        let row = sqlx::query(
            "UPDATE records SET parent = ?3, state = ?4, body = ?5, due_at = ?6, version = version + 1 \
             WHERE kind = ?1 AND id = ?2 AND version = ?7 \
             RETURNING kind, id, owner, parent, state, body, version, created_at, due_at",
        )
        .bind(rec.kind.as_str())
        .bind(&rec.id)
        .bind(&rec.parent)
        .bind(&rec.state)
        .bind(json_text(&rec.body))
        .bind(rec.due_at.map(micros))
        .bind(rec.version)
        .fetch_optional(&self.pool)
        .await?;
        if let Some(row) = row {
            return RawRecord::from_row(&row)?.into_record();
        }
        let exists = sqlx::query("SELECT 1 FROM records WHERE kind = ?1 AND id = ?2")
            .bind(rec.kind.as_str())
            .bind(&rec.id)
            .fetch_optional(&self.pool)
            .await?;
        Err(if exists.is_some() {
            StoreError::Conflict
        } else {
            StoreError::NotFound
        })
    }

    async fn delete(&self, kind: Kind, id: &str) -> Result<bool> {
        let done = sqlx::query("DELETE FROM records WHERE kind = ?1 AND id = ?2")
            .bind(kind.as_str())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn list(&self, q: &ListQuery<'_>) -> Result<Vec<Record>> {
        let rows = list_query::<sqlx::Sqlite>(q)
            .build()
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| RawRecord::from_row(r)?.into_record())
            .collect()
    }

    async fn due(&self, kind: Kind, now: OffsetDateTime, limit: u32) -> Result<Vec<Record>> {
        let rows = sqlx::query(
            "SELECT kind, id, owner, parent, state, body, version, created_at, due_at FROM records \
             WHERE kind = ?1 AND due_at IS NOT NULL AND due_at <= ?2 ORDER BY due_at, id LIMIT ?3",
        )
        .bind(kind.as_str())
        .bind(micros(now))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| RawRecord::from_row(r)?.into_record())
            .collect()
    }

    async fn append_event(&self, stream: &str, kind: &str, data: &Value) -> Result<Event> {
        let at = crate::clock::now();
        let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
        let seq: i64 = sqlx::query(
            "INSERT INTO streams (stream, last_seq, purged_through) VALUES (?1, 1, 0) \
             ON CONFLICT (stream) DO UPDATE SET last_seq = last_seq + 1 RETURNING last_seq",
        )
        .bind(stream)
        .fetch_one(&mut *tx)
        .await?
        .try_get(0)?;
        sqlx::query("INSERT INTO events (stream, seq, kind, data, at) VALUES (?1, ?2, ?3, ?4, ?5)")
            .bind(stream)
            .bind(seq)
            .bind(kind)
            .bind(json_text(data))
            .bind(micros(at))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Event {
            stream: stream.to_owned(),
            seq,
            kind: kind.to_owned(),
            data: data.clone(),
            at,
        })
    }

    async fn events_after(&self, stream: &str, after: i64, limit: u32) -> Result<Vec<Event>> {
        let rows = sqlx::query(
            "SELECT stream, seq, kind, data, at FROM events WHERE stream = ?1 AND seq > ?2 \
             ORDER BY seq LIMIT ?3",
        )
        .bind(stream)
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| RawEvent::from_row(r)?.into_event())
            .collect()
    }

    async fn stream_bounds(&self, stream: &str) -> Result<StreamBounds> {
        let row =
            sqlx::query("SELECT stream, last_seq, purged_through FROM streams WHERE stream = ?1")
                .bind(stream)
                .fetch_optional(&self.pool)
                .await?;
        Ok(match row {
            Some(row) => {
                let s = RawStream::from_row(&row)?;
                StreamBounds {
                    last_seq: s.last_seq,
                    purged_through: s.purged_through,
                }
            }
            None => StreamBounds::default(),
        })
    }

    async fn purge_events(&self, stream: &str, through: i64) -> Result<()> {
        let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
        let purged: Option<i64> = sqlx::query(
            "UPDATE streams SET purged_through = MAX(purged_through, MIN(?2, last_seq)) \
             WHERE stream = ?1 RETURNING purged_through",
        )
        .bind(stream)
        .bind(through)
        .fetch_optional(&mut *tx)
        .await?
        .map(|row| row.try_get(0))
        .transpose()?;
        if let Some(purged) = purged {
            sqlx::query("DELETE FROM events WHERE stream = ?1 AND seq <= ?2")
                .bind(stream)
                .bind(purged)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn drop_stream(&self, stream: &str) -> Result<()> {
        let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
        sqlx::query("DELETE FROM streams WHERE stream = ?1")
            .bind(stream)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM events WHERE stream = ?1")
            .bind(stream)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn idem_claim(
        &self,
        principal: &str,
        key: &str,
        request_hash: &str,
        expire_before: OffsetDateTime,
    ) -> Result<IdemClaim> {
        let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
        sqlx::query("DELETE FROM idempotency WHERE created_at < ?1")
            .bind(micros(expire_before))
            .execute(&mut *tx)
            .await?;
        let inserted = sqlx::query(
            "INSERT INTO idempotency (principal, key, request_hash, status, resource_id, created_at) \
             VALUES (?1, ?2, ?3, NULL, NULL, ?4) ON CONFLICT (principal, key) DO NOTHING",
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
                 WHERE principal = ?1 AND key = ?2",
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

    async fn idem_complete(
        &self,
        principal: &str,
        key: &str,
        status: u16,
        resource_id: &str,
    ) -> Result<()> {
        sqlx::query("UPDATE idempotency SET status = ?3, resource_id = ?4 WHERE principal = ?1 AND key = ?2")
            .bind(principal)
            .bind(key)
            .bind(i32::from(status))
            .bind(resource_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn idem_release(&self, principal: &str, key: &str) -> Result<()> {
        sqlx::query("DELETE FROM idempotency WHERE principal = ?1 AND key = ?2 AND status IS NULL")
            .bind(principal)
            .bind(key)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn digest(&self) -> Result<String> {
        // One read transaction: a consistent snapshot of all four tables.
        let mut tx = self.pool.begin().await?;
        let mut snap = Snapshot::default();
        for row in sqlx::query(
            "SELECT kind, id, owner, parent, state, body, version, created_at, due_at FROM records",
        )
        .fetch_all(&mut *tx)
        .await?
        {
            snap.records.push(RawRecord::from_row(&row)?);
        }
        for row in sqlx::query("SELECT stream, seq, kind, data, at FROM events")
            .fetch_all(&mut *tx)
            .await?
        {
            snap.events.push(RawEvent::from_row(&row)?);
        }
        for row in sqlx::query("SELECT stream, last_seq, purged_through FROM streams")
            .fetch_all(&mut *tx)
            .await?
        {
            snap.streams.push(RawStream::from_row(&row)?);
        }
        for row in sqlx::query(
            "SELECT principal, key, request_hash, status, resource_id, created_at FROM idempotency",
        )
        .fetch_all(&mut *tx)
        .await?
        {
            snap.idempotency.push(RawIdem::from_row(&row)?);
        }
        tx.commit().await?;
        snap.digest()
    }

    fn instance(&self) -> &str {
        &self.instance
    }

    async fn instance_alive(&self, instance: &str) -> Result<bool> {
        Ok(instance == self.instance)
    }

    async fn lock(&self, _key: &str) -> Result<StoreLock> {
        Ok(StoreLock::none())
    }

    async fn shared_key(&self, name: &str, fresh: [u8; 32]) -> Result<[u8; 32]> {
        sqlx::query("INSERT INTO server_keys (name, value) VALUES (?1, ?2) ON CONFLICT DO NOTHING")
            .bind(name)
            .bind(hex::encode(fresh))
            .execute(&self.pool)
            .await?;
        let value: String = sqlx::query("SELECT value FROM server_keys WHERE name = ?1")
            .bind(name)
            .fetch_one(&self.pool)
            .await?
            .try_get(0)?;
        decode_key(&value)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

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
