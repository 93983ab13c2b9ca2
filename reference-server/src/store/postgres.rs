//! The PostgreSQL store: several server processes share one database.
//!
//! Every write is one statement or one short transaction whose row locks make it safe against
//! other server processes: appends serialize on their stream's row, updates compare and swap on
//! `version`, idempotency claims insert-or-read on the key.

use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::postgres::{PgConnection, PgListener, PgPool, PgPoolOptions};
use sqlx::{Connection as _, Row as _, SqlSafeStr as _};
use time::OffsetDateTime;
use tokio::sync::broadcast;

use super::rows::{
    RawEvent, RawIdem, RawRecord, RawStream, Snapshot, decode_key, json_text, list_query, micros,
};
use super::{
    Event, ForeignAppend, IdemClaim, Kind, ListQuery, Record, Result, Scope, SlotClaim, Store,
    StoreError, StoreLock, StreamBounds,
};

/// How long a request waits for a connection. While the database is down, every request
/// fails after this long with `Unavailable` (a 503), so it is short.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// Connections per server process (the instance lock and the listener hold one more each).
const MAX_CONNECTIONS: u32 = 16;

/// The first key of every instance lock (`pg_advisory_lock(INSTANCE_LOCKS, instance)`); other
/// advisory locks use the one-key form, a separate key space.
const INSTANCE_LOCKS: i32 = 0x5344_5350;
/// How often the instance lock's connection is checked (and the lock retaken after a restart).
const INSTANCE_CHECK: Duration = Duration::from_secs(2);
/// How long another instance must look dead before its sessions are taken over: longer than
/// it takes a live process to retake its lock after the database comes back.
const TAKEOVER_GRACE: Duration = Duration::from_secs(5);
/// The NOTIFY channel of appends: payload `<instance> <seq> <stream>`.
const APPENDS: &str = "sandspec_events";

pub struct PostgresStore {
    /// Reconnects by itself: connections broken by a database restart are tested and
    /// replaced when next acquired, so the server recovers without restarting.
    pool: PgPool,
    /// This process's instance ID: its instance lock's second key, in hex.
    instance: String,
    /// Appends by other processes, from the LISTEN connection.
    appends: broadcast::Sender<ForeignAppend>,
    /// The instance-lock keeper and the listener; stopped with the store.
    tasks: Vec<tokio::task::AbortHandle>,
}

impl Drop for PostgresStore {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Opens a connection of its own holding the instance lock `key`; `Ok(None)` when another
/// process holds it.
async fn take_instance_lock(pool: &PgPool, key: i32) -> Result<Option<PgConnection>> {
    let mut conn = PgConnection::connect_with(&pool.connect_options()).await?;
    let got: bool = sqlx::query("SELECT pg_try_advisory_lock($1, $2)")
        .bind(INSTANCE_LOCKS)
        .bind(key)
        .fetch_one(&mut conn)
        .await?
        .try_get(0)?;
    Ok(got.then_some(conn))
}

/// Keeps the instance lock for the life of the process, retaking it when its connection is
/// lost (a database restart).
async fn keep_instance_lock(pool: PgPool, key: i32, mut conn: Option<PgConnection>) {
    loop {
        tokio::time::sleep(INSTANCE_CHECK).await;
        let healthy = match conn.as_mut() {
            Some(c) => sqlx::query("SELECT 1").execute(c).await.is_ok(),
            None => false,
        };
        if !healthy {
            conn = match take_instance_lock(&pool, key).await {
                Ok(Some(c)) => Some(c),
                Ok(None) => {
                    tracing::error!(instance = %format!("{key:08x}"), "another process holds this instance's lock");
                    None
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not retake the instance lock yet");
                    None
                }
            };
        }
    }
}

/// Forwards other processes' appends from LISTEN to `tx`, reconnecting when the connection
/// drops (notifications sent meanwhile are lost; readers re-read the log anyway).
async fn listen_appends(pool: PgPool, instance: String, tx: broadcast::Sender<ForeignAppend>) {
    loop {
        let listener = async {
            let mut l = PgListener::connect_with(&pool).await?;
            l.listen(APPENDS).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = match listener.await {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = %e, "LISTEN failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        loop {
            match listener.recv().await {
                Ok(n) => {
                    let mut parts = n.payload().splitn(3, ' ');
                    let (Some(from), Some(seq), Some(stream)) =
                        (parts.next(), parts.next(), parts.next())
                    else {
                        continue;
                    };
                    if from != instance
                        && let Ok(seq) = seq.parse::<i64>()
                    {
                        let _ = tx.send((stream.to_owned(), seq));
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "LISTEN connection lost; reconnecting");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
            }
        }
    }
}

fn migrator() -> Migrator {
    // The migrator holds an advisory lock while it runs, so server processes that start
    // together migrate once.
    Migrator::with_migrations(vec![
        Migration::new(
            1,
            "initial".into(),
            MigrationType::Simple,
            include_str!("../../migrations/postgres/0001_initial.sql").into_sql_str(),
            false,
        ),
        Migration::new(
            2,
            "server keys".into(),
            MigrationType::Simple,
            include_str!("../../migrations/postgres/0002_server_keys.sql").into_sql_str(),
            false,
        ),
        Migration::new(
            3,
            "stream slots".into(),
            MigrationType::Simple,
            include_str!("../../migrations/postgres/0003_stream_slots.sql").into_sql_str(),
            false,
        ),
    ])
}

impl PostgresStore {
    /// Connects to `url` (`postgres://...`), migrates the database, takes this process's
    /// instance lock and starts listening for other processes' appends.
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
        let mut taken = None;
        for _ in 0..16 {
            let key = rand::random_range(1..i32::MAX);
            if let Some(conn) = take_instance_lock(&pool, key).await? {
                taken = Some((key, conn));
                break;
            }
        }
        let (instance_key, conn) = taken.ok_or_else(|| {
            StoreError::Unavailable("no free instance lock after 16 tries".into())
        })?;
        let instance = format!("{instance_key:08x}");
        let (appends, _) = broadcast::channel(4096);
        let keeper = tokio::spawn(keep_instance_lock(pool.clone(), instance_key, Some(conn)));
        let listener = tokio::spawn(listen_appends(
            pool.clone(),
            instance.clone(),
            appends.clone(),
        ));
        Ok(Self {
            pool,
            instance,
            appends,
            tasks: vec![keeper.abort_handle(), listener.abort_handle()],
        })
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
        let at = crate::clock::now();
        // One statement, so one implicit transaction: the counter's row stays locked until the
        // event is in, and a failed insert rolls the counter back, so no number is skipped.
        // The NOTIFY is delivered when it commits, to every server process listening.
        let seq: i64 = sqlx::query(
            "WITH next AS ( \
                 INSERT INTO streams (stream, last_seq, purged_through) VALUES ($1, 1, 0) \
                 ON CONFLICT (stream) DO UPDATE SET last_seq = streams.last_seq + 1 \
                 RETURNING last_seq), \
             ins AS ( \
                 INSERT INTO events (stream, seq, kind, data, at) \
                 SELECT $1, last_seq, $2, $3, $4 FROM next RETURNING seq) \
             SELECT seq, pg_notify($5, $6 || ' ' || seq || ' ' || $1)::text FROM ins",
        )
        .bind(stream)
        .bind(kind)
        .bind(json_text(data))
        .bind(micros(at))
        .bind(APPENDS)
        .bind(&self.instance)
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
            .bind(micros(crate::clock::now()))
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

    fn instance(&self) -> &str {
        &self.instance
    }

    async fn instance_alive(&self, instance: &str) -> Result<bool> {
        if instance == self.instance {
            return Ok(true);
        }
        let Ok(key) = u32::from_str_radix(instance, 16) else {
            // Not an instance of this store (e.g. from a SQLite run): not alive.
            return Ok(false);
        };
        let held: bool = sqlx::query(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND classid::int8 = $1 AND objid::int8 = $2 AND objsubid = 2)",
        )
        .bind(i64::from(INSTANCE_LOCKS))
        .bind(i64::from(key))
        .fetch_one(&self.pool)
        .await?
        .try_get(0)?;
        Ok(held)
    }

    fn takeover_grace(&self) -> Duration {
        TAKEOVER_GRACE
    }

    async fn lock(&self, key: &str) -> Result<StoreLock> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
            .bind(key)
            .execute(&mut *tx)
            .await?;
        Ok(StoreLock::held(tx))
    }

    async fn shared_key(&self, name: &str, fresh: [u8; 32]) -> Result<[u8; 32]> {
        sqlx::query("INSERT INTO server_keys (name, value) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(name)
            .bind(hex::encode(fresh))
            .execute(&self.pool)
            .await?;
        let value: String = sqlx::query("SELECT value FROM server_keys WHERE name = $1")
            .bind(name)
            .fetch_one(&self.pool)
            .await?
            .try_get(0)?;
        decode_key(&value)
    }

    fn foreign_appends(&self) -> Option<broadcast::Receiver<ForeignAppend>> {
        Some(self.appends.subscribe())
    }

    async fn claim_stream_slot(&self, principal: &str, limit: u32) -> Result<SlotClaim> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('stream_slots:' || $1, 0))")
            .bind(principal)
            .execute(&mut *tx)
            .await?;
        // Slots of server processes whose instance lock is gone (they died) are free again.
        sqlx::query(
            "DELETE FROM stream_slots s WHERE s.principal = $1 AND s.instance <> $2 \
             AND NOT EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND l.classid::int8 = $3 AND l.objid::int8 = ('x' || s.instance)::bit(32)::int8 \
               AND l.objsubid = 2)",
        )
        .bind(principal)
        .bind(&self.instance)
        .bind(i64::from(INSTANCE_LOCKS))
        .execute(&mut *tx)
        .await?;
        let held: i64 = sqlx::query("SELECT count(*) FROM stream_slots WHERE principal = $1")
            .bind(principal)
            .fetch_one(&mut *tx)
            .await?
            .try_get(0)?;
        if held >= i64::from(limit) {
            tx.commit().await?;
            return Ok(SlotClaim::Full);
        }
        let id = ulid::Ulid::new().to_string();
        sqlx::query("INSERT INTO stream_slots (id, principal, instance) VALUES ($1, $2, $3)")
            .bind(&id)
            .bind(principal)
            .bind(&self.instance)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(SlotClaim::Held(id))
    }

    async fn release_stream_slot(&self, id: &str) -> Result<()> {
        sqlx::query("DELETE FROM stream_slots WHERE id = $1")
            .bind(id)
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
