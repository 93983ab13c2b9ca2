//! The one SQL flow of both stores: [`Store`] implemented once, over sqlx's `Database`, for
//! every [`SqlStore`] (SQLite and PostgreSQL).
//!
//! Where the two databases take the same statement, it is written here once, with `$N`
//! placeholders (PostgreSQL's, which SQLite also reads as the Nth parameter). What differs is
//! stated by each store in its `SqlStore` implementation: the statements whose SQL is not the
//! same (`GET`, `PURGE`), how its transactions begin, and the operations that are its own
//! (appending an event, claiming an idempotency key, instances, locks and stream slots).

use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{
    ColumnIndex, Database, Encode, Executor, IntoArguments, Pool, Row as _, SqlSafeStr as _, Type,
};
use time::OffsetDateTime;
use tokio::sync::broadcast;

use super::rows::{
    Columns, RawEvent, RawIdem, RawRecord, RawStream, Snapshot, decode_key, json_text, list_query,
    micros,
};
use super::{
    Event, ForeignAppend, IdemClaim, Kind, ListQuery, Record, Result, Scope, SlotClaim, Store,
    StoreError, StoreLock, StreamBounds,
};

/// The migrations of `migrations/<database>/`: `(version, description, SQL)`, in order.
pub(super) fn migrator(migrations: &[(i64, &'static str, &'static str)]) -> Migrator {
    Migrator::with_migrations(
        migrations
            .iter()
            .map(|&(version, description, sql)| {
                Migration::new(
                    version,
                    description.into(),
                    MigrationType::Simple,
                    sql.into_sql_str(),
                    false,
                )
            })
            .collect(),
    )
}

/// A value the shared statements bind, in either database.
pub(super) trait Param<DB: Database>: for<'t> Encode<'t, DB> + Type<DB> + Send {}
impl<DB: Database, T: for<'t> Encode<'t, DB> + Type<DB> + Send> Param<DB> for T {}

/// A store on a SQL database: its pool, where its SQL differs from the other store's, and the
/// operations it does its own way. Each method here stands for the [`Store`] method of the
/// same purpose, documented there.
#[async_trait]
pub(super) trait SqlStore: Send + Sync + 'static {
    type DB: Database;

    /// One record of kind `$1` and ID `$2`, owned by `$3`, or by anyone when `$3` is NULL
    /// (PostgreSQL must be told that `$3` is text).
    const GET: &'static str;
    /// Raises `purged_through` of stream `$1` to `$2`, never past `last_seq` and never down,
    /// and returns it (the larger of two values is `GREATEST` in PostgreSQL, `MAX` in SQLite).
    const PURGE: &'static str;
    /// How a transaction that writes begins.
    const BEGIN_WRITE: &'static str;
    /// How the digest's read begins: one snapshot of all four tables.
    const BEGIN_SNAPSHOT: &'static str;
    /// [`Store::takeover_grace`].
    const TAKEOVER_GRACE: Duration = Duration::ZERO;

    fn pool(&self) -> &Pool<Self::DB>;
    fn rows_affected(done: &<Self::DB as Database>::QueryResult) -> u64;

    /// Appends an event at `at` with the stream's next sequence number; answers that number.
    async fn append(
        &self,
        stream: &str,
        kind: &str,
        data: &Value,
        at: OffsetDateTime,
    ) -> Result<i64>;
    /// [`Store::idem_claim`].
    async fn claim_key(
        &self,
        principal: &str,
        key: &str,
        request_hash: &str,
        expire_before: OffsetDateTime,
    ) -> Result<IdemClaim>;
    /// [`Store::instance`].
    fn instance_id(&self) -> &str;
    /// [`Store::instance_alive`].
    async fn is_alive(&self, instance: &str) -> Result<bool>;
    /// [`Store::lock`].
    async fn take_lock(&self, key: &str) -> Result<StoreLock>;
    /// [`Store::foreign_appends`].
    fn others_appends(&self) -> Option<broadcast::Receiver<ForeignAppend>> {
        None
    }
    /// [`Store::claim_stream_slot`].
    async fn claim_slot(&self, _principal: &str, _limit: u32) -> Result<SlotClaim> {
        Ok(SlotClaim::Local)
    }
    /// [`Store::release_stream_slot`].
    async fn release_slot(&self, _id: &str) -> Result<()> {
        Ok(())
    }
}

#[async_trait]
impl<S> Store for S
where
    S: SqlStore,
    for<'c> &'c mut <S::DB as Database>::Connection: Executor<'c, Database = S::DB>,
    <S::DB as Database>::Arguments: IntoArguments<S::DB>,
    usize: ColumnIndex<<S::DB as Database>::Row>,
    for<'a> &'a str: Param<S::DB>,
    String: Param<S::DB> + Columns<S::DB>,
    Option<String>: Param<S::DB> + Columns<S::DB>,
    i64: Param<S::DB> + Columns<S::DB>,
    Option<i64>: Param<S::DB> + Columns<S::DB>,
    i32: Param<S::DB>,
    Option<i32>: Columns<S::DB>,
{
    async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(self.pool()).await?;
        Ok(())
    }

    async fn insert(&self, rec: &Record) -> Result<()> {
        sqlx::query(
            "INSERT INTO records (kind, id, owner, parent, state, body, version, created_at, due_at) \
             VALUES ($1, $2, $3, $4, $5, $6, 1, $7, $8)",
        )
        .bind(rec.kind.as_str())
        .bind(rec.id.as_str())
        .bind(rec.owner.as_str())
        .bind(rec.parent.clone())
        .bind(rec.state.as_str())
        .bind(json_text(&rec.body))
        .bind(micros(rec.created_at))
        .bind(rec.due_at.map(micros))
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn get(&self, kind: Kind, scope: Scope<'_>, id: &str) -> Result<Option<Record>> {
        let owner = match scope {
            Scope::Owner(owner) => Some(owner.to_owned()),
            Scope::System => None,
        };
        let row = sqlx::query(S::GET)
            .bind(kind.as_str())
            .bind(id)
            .bind(owner)
            .fetch_optional(self.pool())
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
        .bind(rec.id.as_str())
        .bind(rec.parent.clone())
        .bind(rec.state.as_str())
        .bind(json_text(&rec.body))
        .bind(rec.due_at.map(micros))
        .bind(rec.version)
        .fetch_optional(self.pool())
        .await?;
        if let Some(row) = row {
            return RawRecord::from_row(&row)?.into_record();
        }
        let exists = sqlx::query("SELECT 1 FROM records WHERE kind = $1 AND id = $2")
            .bind(rec.kind.as_str())
            .bind(rec.id.as_str())
            .fetch_optional(self.pool())
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
            .execute(self.pool())
            .await?;
        Ok(S::rows_affected(&done) > 0)
    }

    async fn list(&self, q: &ListQuery<'_>) -> Result<Vec<Record>> {
        let rows = list_query::<S::DB>(q)
            .build()
            .fetch_all(self.pool())
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
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| RawRecord::from_row(r)?.into_record())
            .collect()
    }

    async fn append_event(&self, stream: &str, kind: &str, data: &Value) -> Result<Event> {
        let at = crate::clock::now();
        let seq = self.append(stream, kind, data, at).await?;
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
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| RawEvent::from_row(r)?.into_event())
            .collect()
    }

    async fn stream_bounds(&self, stream: &str) -> Result<StreamBounds> {
        let row =
            sqlx::query("SELECT stream, last_seq, purged_through FROM streams WHERE stream = $1")
                .bind(stream)
                .fetch_optional(self.pool())
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
        // Two statements: on PostgreSQL the DELETE takes its snapshot after the UPDATE has
        // waited for any append holding the stream's row, so it sees that append's event too.
        let mut tx = self.pool().begin_with(S::BEGIN_WRITE).await?;
        let purged: Option<i64> = sqlx::query(S::PURGE)
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
        let mut tx = self.pool().begin_with(S::BEGIN_WRITE).await?;
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
        self.claim_key(principal, key, request_hash, expire_before)
            .await
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
            .execute(self.pool())
            .await?;
        Ok(())
    }

    async fn idem_release(&self, principal: &str, key: &str) -> Result<()> {
        sqlx::query("DELETE FROM idempotency WHERE principal = $1 AND key = $2 AND status IS NULL")
            .bind(principal)
            .bind(key)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    async fn digest(&self) -> Result<String> {
        // One snapshot of all four tables, even while other processes write.
        let mut tx = self.pool().begin_with(S::BEGIN_SNAPSHOT).await?;
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
        self.instance_id()
    }

    async fn instance_alive(&self, instance: &str) -> Result<bool> {
        self.is_alive(instance).await
    }

    fn takeover_grace(&self) -> Duration {
        S::TAKEOVER_GRACE
    }

    async fn lock(&self, key: &str) -> Result<StoreLock> {
        self.take_lock(key).await
    }

    async fn shared_key(&self, name: &str, fresh: [u8; 32]) -> Result<[u8; 32]> {
        sqlx::query("INSERT INTO server_keys (name, value) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(name)
            .bind(hex::encode(fresh))
            .execute(self.pool())
            .await?;
        let value: String = sqlx::query("SELECT value FROM server_keys WHERE name = $1")
            .bind(name)
            .fetch_one(self.pool())
            .await?
            .try_get(0)?;
        decode_key(&value)
    }

    fn foreign_appends(&self) -> Option<broadcast::Receiver<ForeignAppend>> {
        self.others_appends()
    }

    async fn claim_stream_slot(&self, principal: &str, limit: u32) -> Result<SlotClaim> {
        self.claim_slot(principal, limit).await
    }

    async fn release_stream_slot(&self, id: &str) -> Result<()> {
        self.release_slot(id).await
    }
}
