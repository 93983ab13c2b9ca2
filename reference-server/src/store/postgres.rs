//! The PostgreSQL store: several server processes share one database.
//!
//! Every write is one statement or one short transaction whose row locks make it safe against
//! other server processes: appends serialize on their stream's row, updates compare and swap on
//! `version`, idempotency claims insert-or-read on the key.

use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnection, PgListener, PgPool, PgPoolOptions, PgQueryResult, Postgres};
use sqlx::{Connection as _, Row as _};
use time::OffsetDateTime;
use tokio::sync::broadcast;

use super::rows::{RawIdem, json_text, micros};
use super::sql::{self, SqlStore};
use super::{ForeignAppend, IdemClaim, Result, SlotClaim, StoreError, StoreLock};

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
    sql::migrator(&[
        (
            1,
            "initial",
            include_str!("../../migrations/postgres/0001_initial.sql"),
        ),
        (
            2,
            "server keys",
            include_str!("../../migrations/postgres/0002_server_keys.sql"),
        ),
        (
            3,
            "stream slots",
            include_str!("../../migrations/postgres/0003_stream_slots.sql"),
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
impl SqlStore for PostgresStore {
    type DB = Postgres;

    const GET: &'static str = "SELECT kind, id, owner, parent, state, body, version, created_at, due_at \
         FROM records WHERE kind = $1 AND id = $2 AND ($3::text IS NULL OR owner = $3)";
    const PURGE: &'static str = "UPDATE streams SET purged_through = GREATEST(purged_through, LEAST($2, last_seq)) \
         WHERE stream = $1 RETURNING purged_through";
    /// Row locks make each write safe against other server processes.
    const BEGIN_WRITE: &'static str = "BEGIN";
    const BEGIN_SNAPSHOT: &'static str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";
    const TAKEOVER_GRACE: Duration = TAKEOVER_GRACE;

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn rows_affected(done: &PgQueryResult) -> u64 {
        done.rows_affected()
    }

    async fn append(
        &self,
        stream: &str,
        kind: &str,
        data: &Value,
        at: OffsetDateTime,
    ) -> Result<i64> {
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
        Ok(seq)
    }

    async fn claim_key(
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

    fn instance_id(&self) -> &str {
        &self.instance
    }

    async fn is_alive(&self, instance: &str) -> Result<bool> {
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

    async fn take_lock(&self, key: &str) -> Result<StoreLock> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
            .bind(key)
            .execute(&mut *tx)
            .await?;
        Ok(StoreLock::held(tx))
    }

    fn others_appends(&self) -> Option<broadcast::Receiver<ForeignAppend>> {
        Some(self.appends.subscribe())
    }

    async fn claim_slot(&self, principal: &str, limit: u32) -> Result<SlotClaim> {
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

    async fn release_slot(&self, id: &str) -> Result<()> {
        sqlx::query("DELETE FROM stream_slots WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}
