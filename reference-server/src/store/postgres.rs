//! The PostgreSQL store: several server processes share one database.
//!
//! Every write is one statement or one short transaction whose row locks make it safe against
//! other server processes: appends serialize on their stream's row, updates compare and swap on
//! `version`, idempotency claims insert-or-read on the key.

use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Row as _, SqlSafeStr as _};
use time::OffsetDateTime;

use super::rows::{
    RawEvent, RawIdem, RawRecord, RawStream, Snapshot, json_text, list_query, micros,
};
use super::{
    Event, IdemClaim, Kind, ListQuery, Record, Result, Scope, Store, StoreError, StreamBounds,
};

/// How long a request waits for a connection. While the database is down, every request
/// fails after this long with `Unavailable` (a 503), so it is short.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// Connections per server process.
const MAX_CONNECTIONS: u32 = 10;

pub struct PostgresStore {
    /// Reconnects by itself: connections broken by a database restart are tested and
    /// replaced when next acquired, so the server recovers without restarting.
    pool: PgPool,
}

fn migrator() -> Migrator {
    // The migrator holds an advisory lock while it runs, so server processes that start
    // together migrate once.
    Migrator::with_migrations(vec![Migration::new(
        1,
        "initial".into(),
        MigrationType::Simple,
        include_str!("../../migrations/postgres/0001_initial.sql").into_sql_str(),
        false,
    )])
}

impl PostgresStore {
    /// Connects to `url` (`postgres://...`) and migrates the database.
    pub async fn connect(url: &str) -> Result<Self> {
        let pool = PgPoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect(url)
            .await?;
        migrator()
            .run(&pool)
            .await
            .map_err(|e| StoreError::Unavailable(format!("migrating: {e}")))?;
        Ok(Self { pool })
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn insert(&self, rec: &Record) -> Result<()> {
        sqlx::query(
            "INSERT INTO records (kind, id, owner, parent, state, body, version, created_at, due_at) \
             VALUES ($1, $2, $3, $4, $5, $6, 1, $7, $8)",
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
             WHERE kind = $1 AND id = $2 AND ($3::text IS NULL OR owner = $3)",
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
            "UPDATE records SET parent = $3, state = $4, body = $5, due_at = $6, version = version + 1 \
             WHERE kind = $1 AND id = $2 AND version = $7 \
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
        let exists = sqlx::query("SELECT 1 FROM records WHERE kind = $1 AND id = $2")
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
        let done = sqlx::query("DELETE FROM records WHERE kind = $1 AND id = $2")
            .bind(kind.as_str())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn list(&self, q: &ListQuery<'_>) -> Result<Vec<Record>> {
        let rows = list_query::<sqlx::Postgres>(q)
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
             WHERE kind = $1 AND due_at IS NOT NULL AND due_at <= $2 ORDER BY due_at, id LIMIT $3",
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
        let at = crate::domain::now();
        // One statement, so one implicit transaction: the counter's row stays locked until the
        // event is in, and a failed insert rolls the counter back, so no number is skipped.
        let seq: i64 = sqlx::query(
            "WITH next AS ( \
                 INSERT INTO streams (stream, last_seq, purged_through) VALUES ($1, 1, 0) \
                 ON CONFLICT (stream) DO UPDATE SET last_seq = streams.last_seq + 1 \
                 RETURNING last_seq) \
             INSERT INTO events (stream, seq, kind, data, at) \
             SELECT $1, last_seq, $2, $3, $4 FROM next RETURNING seq",
        )
        .bind(stream)
        .bind(kind)
        .bind(json_text(data))
        .bind(micros(at))
        .fetch_one(&self.pool)
        .await?
        .try_get(0)?;
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
            "SELECT stream, seq, kind, data, at FROM events WHERE stream = $1 AND seq > $2 \
             ORDER BY seq LIMIT $3",
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
            sqlx::query("SELECT stream, last_seq, purged_through FROM streams WHERE stream = $1")
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
        // Two statements: the DELETE takes its snapshot after the UPDATE has waited for any
        // append holding the stream's row, so it sees that append's event too.
        let mut tx = self.pool.begin().await?;
        let purged: Option<i64> = sqlx::query(
            "UPDATE streams SET purged_through = GREATEST(purged_through, LEAST($2, last_seq)) \
             WHERE stream = $1 RETURNING purged_through",
        )
        .bind(stream)
        .bind(through)
        .fetch_optional(&mut *tx)
        .await?
        .map(|row| row.try_get(0))
        .transpose()?;
        if let Some(purged) = purged {
            sqlx::query("DELETE FROM events WHERE stream = $1 AND seq <= $2")
                .bind(stream)
                .bind(purged)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn drop_stream(&self, stream: &str) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM streams WHERE stream = $1")
            .bind(stream)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM events WHERE stream = $1")
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
        sqlx::query("DELETE FROM idempotency WHERE created_at < $1")
            .bind(micros(expire_before))
            .execute(&self.pool)
            .await?;
        // The insert waits for a concurrent claim of the same key to commit or roll back; the
        // read that follows may still find the key released in between, hence the retries.
        for _ in 0..5 {
            let inserted = sqlx::query(
                "INSERT INTO idempotency (principal, key, request_hash, status, resource_id, created_at) \
                 VALUES ($1, $2, $3, NULL, NULL, $4) ON CONFLICT (principal, key) DO NOTHING",
            )
            .bind(principal)
            .bind(key)
            .bind(request_hash)
            .bind(micros(crate::domain::now()))
            .execute(&self.pool)
            .await?;
            if inserted.rows_affected() == 1 {
                return Ok(IdemClaim::Claimed);
            }
            let row = sqlx::query(
                "SELECT principal, key, request_hash, status, resource_id, created_at FROM idempotency \
                 WHERE principal = $1 AND key = $2",
            )
            .bind(principal)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
            if let Some(row) = row {
                return RawIdem::from_row(&row)?.into_claim();
            }
        }
        Err(StoreError::Unavailable(
            "idempotency key kept changing under contention".into(),
        ))
    }

    async fn idem_complete(
        &self,
        principal: &str,
        key: &str,
        status: u16,
        resource_id: &str,
    ) -> Result<()> {
        sqlx::query("UPDATE idempotency SET status = $3, resource_id = $4 WHERE principal = $1 AND key = $2")
            .bind(principal)
            .bind(key)
            .bind(i32::from(status))
            .bind(resource_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn idem_release(&self, principal: &str, key: &str) -> Result<()> {
        sqlx::query("DELETE FROM idempotency WHERE principal = $1 AND key = $2 AND status IS NULL")
            .bind(principal)
            .bind(key)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn digest(&self) -> Result<String> {
        // One snapshot of all four tables, even while other processes write.
        let mut tx = self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await?;
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
}
