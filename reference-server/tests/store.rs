//! The shared store suite on every store: SQLite in memory and in a file, and PostgreSQL in a
//! private cluster (each test its own database).

use pg_cluster::PgCluster;
use reference_server::store::suite::{self, Fixture};
use reference_server::store::{PostgresStore, SqliteStore, Store};

async fn sqlite_memory() -> Option<Fixture> {
    Some(Fixture::new(
        SqliteStore::open(None)
            .await
            .expect("open in-memory SQLite"),
    ))
}

async fn sqlite_file() -> Option<Fixture> {
    let dir = tempfile::tempdir().expect("temporary directory");
    let store = SqliteStore::open(Some(&dir.path().join("sandspec.db")))
        .await
        .expect("open SQLite file");
    Some(Fixture::new(store).holding(dir))
}

async fn postgres() -> Option<Fixture> {
    let cluster = PgCluster::shared_or_skip()?;
    let url = cluster.fresh_database().await;
    Some(Fixture::new(
        PostgresStore::connect(&url)
            .await
            .expect("connect to PostgreSQL"),
    ))
}

mod sqlite_memory {
    reference_server::store_suite!(super::sqlite_memory().await);
}

mod sqlite_file {
    reference_server::store_suite!(super::sqlite_file().await);
}

mod postgres {
    reference_server::store_suite!(super::postgres().await);
}

/// The same logical state has the same digest in every store.
#[tokio::test]
async fn digest_is_the_same_in_every_store() {
    let mut stores: Vec<(&str, Fixture)> = vec![
        ("sqlite memory", sqlite_memory().await.unwrap()),
        ("sqlite file", sqlite_file().await.unwrap()),
    ];
    if let Some(pg) = postgres().await {
        stores.push(("postgres", pg));
    }
    let mut digests = Vec::new();
    for (name, fixture) in &stores {
        let empty = fixture.store.digest().await.unwrap();
        suite::write_deterministic_state(&*fixture.store).await;
        digests.push((*name, empty, fixture.store.digest().await.unwrap()));
    }
    for (name, empty, full) in &digests {
        assert_eq!(empty, &digests[0].1, "{name}: empty digest");
        assert_eq!(full, &digests[0].2, "{name}: digest of the same state");
        assert_ne!(empty, full);
    }
}

/// A PostgreSQL that goes away makes calls fail with `Unavailable` (never a panic or a hang),
/// and the same store works again once it is back.
#[tokio::test]
async fn postgres_outage_is_unavailable_then_recovers() {
    let Some(cluster) = PgCluster::start_or_skip() else {
        return;
    };
    let url = cluster.fresh_database().await;
    let store = PostgresStore::connect(&url).await.unwrap();
    store
        .append_event("s", "k", &serde_json::Value::Null)
        .await
        .unwrap();

    cluster.stop();
    let started = std::time::Instant::now();
    let err = store
        .ping()
        .await
        .expect_err("ping while the database is down");
    assert!(
        matches!(err, reference_server::store::StoreError::Unavailable(_)),
        "got {err:?}"
    );
    let err = store
        .append_event("s", "k", &serde_json::Value::Null)
        .await
        .expect_err("append while down");
    assert!(
        matches!(err, reference_server::store::StoreError::Unavailable(_)),
        "got {err:?}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "failing took {:?}",
        started.elapsed()
    );
    let err = PostgresStore::connect(&url)
        .await
        .err()
        .expect("connect while down");
    assert!(
        matches!(err, reference_server::store::StoreError::Unavailable(_)),
        "got {err:?}"
    );

    cluster.start();
    store.ping().await.expect("ping after the restart");
    assert_eq!(
        store
            .append_event("s", "k", &serde_json::Value::Null)
            .await
            .unwrap()
            .seq,
        2
    );
}

/// Two stores on one PostgreSQL database stand in for two server processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_postgres_stores_share_streams_and_records() {
    let Some(cluster) = PgCluster::shared_or_skip() else {
        return;
    };
    // The blocking form, from inside a runtime, as a synchronous harness would use it.
    let url = cluster.fresh_database_blocking();
    let (a, b) = tokio::join!(PostgresStore::connect(&url), PostgresStore::connect(&url));
    let a: std::sync::Arc<dyn Store> = std::sync::Arc::new(a.expect("first store migrates"));
    let b: std::sync::Arc<dyn Store> =
        std::sync::Arc::new(b.expect("second store migrates concurrently"));

    let mut tasks = Vec::new();
    for i in 0..60 {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move {
            store
                .append_event("s", "k", &serde_json::json!(i))
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
    assert_eq!(seqs, (1..=60).collect::<Vec<i64>>());
    assert_eq!(a.digest().await.unwrap(), b.digest().await.unwrap());
}

async fn two_postgres_stores() -> Option<(PostgresStore, PostgresStore)> {
    let cluster = PgCluster::shared_or_skip()?;
    let url = cluster.fresh_database().await;
    let a = PostgresStore::connect(&url).await.expect("first store");
    let b = PostgresStore::connect(&url).await.expect("second store");
    Some((a, b))
}

/// The session lock excludes a holder in another process until the first guard is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lock_excludes_other_processes() {
    let Some((a, b)) = two_postgres_stores().await else {
        return;
    };
    let held = a.lock("session:x").await.expect("first lock");
    let waiting = tokio::time::timeout(std::time::Duration::from_millis(300), b.lock("session:x"));
    assert!(
        waiting.await.is_err(),
        "the second process took a lock the first holds"
    );
    // Another key is independent.
    let other = tokio::time::timeout(std::time::Duration::from_secs(5), b.lock("session:y"))
        .await
        .expect("an unrelated key is free")
        .unwrap();
    drop(other);
    drop(held);
    tokio::time::timeout(std::time::Duration::from_secs(10), b.lock("session:x"))
        .await
        .expect("the lock is free once the holder drops it")
        .unwrap();
}

/// Each store holds its instance lock while it lives; another sees it go with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_instance_liveness_follows_the_store() {
    let Some((a, b)) = two_postgres_stores().await else {
        return;
    };
    let id = a.instance().to_owned();
    assert_ne!(id, b.instance());
    assert!(b.instance_alive(&id).await.unwrap());
    assert!(b.instance_alive(b.instance()).await.unwrap());
    assert!(
        !b.instance_alive("7fffffff").await.unwrap(),
        "no such instance"
    );
    assert!(!b.instance_alive("not-hex").await.unwrap());
    drop(a);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if !b.instance_alive(&id).await.unwrap() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a dropped store still looks alive"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Appends by one process reach the other's feed; a process does not hear its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_appends_notify_the_other_process() {
    let Some((a, b)) = two_postgres_stores().await else {
        return;
    };
    let mut feed = b.foreign_appends().expect("PostgreSQL has a feed");
    // LISTEN starts in the background; append until the first notification arrives.
    let mut first = None;
    for _ in 0..100 {
        b.append_event("own", "k", &serde_json::Value::Null)
            .await
            .unwrap();
        let e = a
            .append_event("s", "k", &serde_json::Value::Null)
            .await
            .unwrap();
        if let Ok(Ok(got)) =
            tokio::time::timeout(std::time::Duration::from_millis(100), feed.recv()).await
        {
            first = Some((got, e.seq));
            break;
        }
    }
    let ((stream, seq), appended) = first.expect("no notification within 10 s");
    assert_eq!(stream, "s", "only the other process's appends are heard");
    assert!(seq <= appended && seq >= 1);
    let e = a
        .append_event("s", "k", &serde_json::Value::Null)
        .await
        .unwrap();
    let mut last = 0;
    while last < e.seq {
        let (stream, seq) = tokio::time::timeout(std::time::Duration::from_secs(5), feed.recv())
            .await
            .expect("a notification per append")
            .unwrap();
        assert_eq!(stream, "s");
        last = seq;
    }
}

/// The first process to ask creates a shared key; every other gets the same one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_keys_are_shared() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.db");
    let a = SqliteStore::open(Some(&path)).await.unwrap();
    let b = SqliteStore::open(Some(&path)).await.unwrap();
    let mut pairs: Vec<(Box<dyn Store>, Box<dyn Store>)> = vec![(Box::new(a), Box::new(b))];
    if let Some((a, b)) = two_postgres_stores().await {
        pairs.push((Box::new(a), Box::new(b)));
    }
    for (a, b) in pairs {
        let digest = a.digest().await.unwrap();
        assert_eq!(a.shared_key("k", [1; 32]).await.unwrap(), [1; 32]);
        assert_eq!(b.shared_key("k", [2; 32]).await.unwrap(), [1; 32]);
        assert_eq!(b.shared_key("other", [3; 32]).await.unwrap(), [3; 32]);
        assert_eq!(a.digest().await.unwrap(), digest, "keys are not state");
    }
}

/// The stream quota holds over every process on the database; a dead process's slots are
/// freed, and a released slot can be claimed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stream_slots_are_shared_by_processes() {
    use reference_server::store::SlotClaim;
    let Some((a, b)) = two_postgres_stores().await else {
        return;
    };
    let held = |c: SlotClaim| match c {
        SlotClaim::Held(id) => id,
        other => panic!("expected a slot, got {other:?}"),
    };
    let first = held(a.claim_stream_slot("alice", 2).await.unwrap());
    let _second = held(b.claim_stream_slot("alice", 2).await.unwrap());
    assert_eq!(
        a.claim_stream_slot("alice", 2).await.unwrap(),
        SlotClaim::Full
    );
    assert_eq!(
        b.claim_stream_slot("alice", 2).await.unwrap(),
        SlotClaim::Full,
        "the limit counts both processes"
    );
    held(b.claim_stream_slot("bob", 2).await.unwrap());
    a.release_stream_slot(&first).await.unwrap();
    let _third = held(b.claim_stream_slot("alice", 2).await.unwrap());
    // A holds one of alice's slots ... and dies: its slot is freed by the next claim.
    let a_slot = held(a.claim_stream_slot("carol", 1).await.unwrap());
    assert!(!a_slot.is_empty());
    drop(a);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match b.claim_stream_slot("carol", 1).await.unwrap() {
            SlotClaim::Held(_) => break,
            SlotClaim::Full => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "a dead process's slot was never freed"
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            SlotClaim::Local => panic!("PostgreSQL keeps slots in the store"),
        }
    }
    // SQLite serves one process: its count is in memory.
    let sqlite = SqliteStore::open(None).await.unwrap();
    assert_eq!(
        sqlite.claim_stream_slot("alice", 1).await.unwrap(),
        SlotClaim::Local
    );
}
