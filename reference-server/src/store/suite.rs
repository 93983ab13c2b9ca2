//! The shared store test suite, run against every implementation.
//!
//! Each case is a public async function that takes a fresh, empty store and panics when the
//! store breaks the [`Store`] contract. [`store_suite!`](crate::store_suite) turns the cases
//! into one `#[tokio::test]` each; [`CASES`] lists them for harnesses that build their test
//! list at run time.

use std::any::Any;
use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde_json::{Value, json};
use time::macros::datetime;
use time::{Duration, OffsetDateTime};

use super::{IdemClaim, Kind, ListQuery, Record, Scope, Store, StoreError, StreamBounds};

/// A fresh store for one case, with whatever must outlive it (a temporary directory).
pub struct Fixture {
    pub store: Arc<dyn Store>,
    /// Dropped after the store (fields drop in order).
    _guard: Option<Box<dyn Any + Send + Sync>>,
}

impl Fixture {
    pub fn new(store: impl Store) -> Self {
        Self {
            store: Arc::new(store),
            _guard: None,
        }
    }

    /// Keeps `guard` alive as long as the fixture.
    pub fn holding(mut self, guard: impl Any + Send + Sync) -> Self {
        self._guard = Some(Box::new(guard));
        self
    }
}

/// A running case.
pub type CaseFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// One case of the suite, by name.
pub struct Case {
    pub name: &'static str,
    pub run: fn(Arc<dyn Store>) -> CaseFuture,
}

/// Expands to one `#[tokio::test]` per case of the store suite. The argument is an expression,
/// evaluated inside each async test, that yields `Option<Fixture>`: a fresh store for that
/// test, or `None` to skip it (a database that is not installed).
///
/// ```no_run
/// mod sqlite_memory {
///     use reference_server::store::{SqliteStore, suite::Fixture};
///     reference_server::store_suite!(Some(Fixture::new(SqliteStore::open(None).await.unwrap())));
/// }
/// ```
#[macro_export]
macro_rules! store_suite {
    ($fixture:expr) => {
        $crate::store_suite!(@names [tests $fixture]);
    };
    // The one list of case names.
    (@names [$($args:tt)*]) => {
        $crate::store_suite!(@expand [$($args)*]
            ping_answers,
            insert_then_get_round_trips,
            every_kind_round_trips,
            timestamps_round_trip_exactly,
            insert_of_existing_id_conflicts,
            get_is_scoped_to_owner,
            update_compares_and_swaps_version,
            update_keeps_owner_and_created_at,
            update_of_missing_record_is_not_found,
            concurrent_updates_have_one_winner,
            delete_removes_once,
            list_orders_by_created_at_then_id,
            list_pages_with_keyset_cursor,
            list_filters_by_scope_parent_and_state,
            list_respects_limit,
            due_returns_records_due_oldest_first,
            append_numbers_events_from_one,
            events_after_respects_cursor_and_limit,
            purge_moves_bounds_and_drops_events,
            drop_stream_forgets_everything,
            concurrent_appends_are_gap_free,
            idempotency_claim_in_flight_then_done,
            idempotency_release_frees_key,
            idempotency_keys_expire,
            concurrent_claims_have_one_winner,
            digest_is_stable_without_writes,
            digest_changes_on_every_write,
            digest_ignores_failed_writes,
            digest_is_equal_for_equal_state,
        );
    };
    (@expand [tests $fixture:expr] $($name:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let fixture: ::std::option::Option<$crate::store::suite::Fixture> = $fixture;
                let ::std::option::Option::Some(fixture) = fixture else { return };
                $crate::store::suite::$name(::std::sync::Arc::clone(&fixture.store)).await;
            }
        )*
    };
    (@expand [cases] $($name:ident),* $(,)?) => {
        /// Every case of the suite, for harnesses that list tests at run time.
        pub const CASES: &[$crate::store::suite::Case] = &[
            $(
                $crate::store::suite::Case {
                    name: stringify!($name),
                    run: |store| ::std::boxed::Box::pin($crate::store::suite::$name(store)),
                },
            )*
        ];
    };
}

crate::store_suite!(@names [cases]);

/// A fixed point in time with microseconds, so that equality after a round trip is exact.
fn t(seconds: i64) -> OffsetDateTime {
    datetime!(2030-01-02 03:04:05.123456 UTC) + Duration::seconds(seconds)
}

fn rec(kind: Kind, id: &str, owner: &str, created_at: OffsetDateTime) -> Record {
    Record {
        kind,
        id: id.to_owned(),
        owner: owner.to_owned(),
        parent: None,
        state: "running".to_owned(),
        body: json!({"id": id, "n": 1}),
        version: 1,
        created_at,
        due_at: None,
    }
}

fn ids(records: &[Record]) -> Vec<&str> {
    records.iter().map(|r| r.id.as_str()).collect()
}

fn expire_never() -> OffsetDateTime {
    crate::clock::now() - Duration::hours(1)
}

async fn insert_all(store: &dyn Store, records: &[Record]) {
    for r in records {
        store
            .insert(r)
            .await
            .unwrap_or_else(|e| panic!("insert {}: {e}", r.id));
    }
}

pub async fn ping_answers(store: Arc<dyn Store>) {
    store.ping().await.expect("ping");
}

pub async fn insert_then_get_round_trips(store: Arc<dyn Store>) {
    let mut r = rec(Kind::Process, "local:prc_1", "alice", t(0));
    r.parent = Some("local:sbx_1".into());
    r.state = "exited".into();
    r.body = json!({
        "cmd": ["sh", "-c", "echo \"hi\""],
        "exit_code": 0,
        "ratio": 0.25,
        "big": 9_007_199_254_740_993_u64,
        "text": "ünïcödé ✓ \u{0}",
        "nested": {"z": null, "a": [true, false]}
    });
    r.due_at = Some(t(60));
    r.version = 7;
    store.insert(&r).await.expect("insert");
    let got = store
        .get(Kind::Process, Scope::System, "local:prc_1")
        .await
        .expect("get")
        .expect("present");
    assert_eq!(
        got,
        Record { version: 1, ..r },
        "insert stores version 1 and every field as given"
    );
}

pub async fn every_kind_round_trips(store: Arc<dyn Store>) {
    for (i, kind) in Kind::ALL.iter().enumerate() {
        let r = rec(*kind, "same-id", "alice", t(i64::try_from(i).unwrap()));
        store
            .insert(&r)
            .await
            .unwrap_or_else(|e| panic!("insert {kind:?}: {e}"));
    }
    for (i, kind) in Kind::ALL.iter().enumerate() {
        let got = store
            .get(*kind, Scope::Owner("alice"), "same-id")
            .await
            .unwrap();
        assert_eq!(
            got,
            Some(rec(*kind, "same-id", "alice", t(i64::try_from(i).unwrap()))),
            "{kind:?}"
        );
        let listed = store
            .list(&ListQuery::new(*kind, Scope::System))
            .await
            .unwrap();
        assert_eq!(
            listed.len(),
            1,
            "{kind:?}: each kind lists only its own records"
        );
    }
}

pub async fn timestamps_round_trip_exactly(store: Arc<dyn Store>) {
    let times = [
        datetime!(1970-01-01 0:00 UTC),
        datetime!(1969-12-31 23:59:59.999999 UTC),
        datetime!(2000-02-29 12:00:00.000001 UTC),
        datetime!(2030-01-02 03:04:05.123456 +02:00),
        datetime!(9999-12-31 23:59:59.999999 UTC),
        crate::clock::now(),
    ];
    for (i, at) in times.iter().enumerate() {
        let mut r = rec(Kind::Sandbox, &format!("sbx_{i}"), "alice", *at);
        r.due_at = Some(*at);
        store.insert(&r).await.unwrap();
        let got = store
            .get(Kind::Sandbox, Scope::System, &r.id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got.created_at, *at, "created_at {at}");
        assert_eq!(got.due_at, Some(*at), "due_at {at}");
    }
}

pub async fn insert_of_existing_id_conflicts(store: Arc<dyn Store>) {
    let r = rec(Kind::Sandbox, "local:sbx_1", "alice", t(0));
    store.insert(&r).await.unwrap();
    let mut other = rec(Kind::Sandbox, "local:sbx_1", "bob", t(5));
    other.body = json!({"other": true});
    let err = store
        .insert(&other)
        .await
        .expect_err("second insert of one id");
    assert!(matches!(err, StoreError::Conflict), "got {err:?}");
    assert_eq!(
        store
            .get(Kind::Sandbox, Scope::System, "local:sbx_1")
            .await
            .unwrap(),
        Some(r)
    );
    store
        .insert(&rec(Kind::Snapshot, "local:sbx_1", "bob", t(0)))
        .await
        .expect("same id, other kind");
}

pub async fn get_is_scoped_to_owner(store: Arc<dyn Store>) {
    let r = rec(Kind::Sandbox, "local:sbx_a", "alice", t(0));
    store.insert(&r).await.unwrap();
    let get = |scope| {
        let store = Arc::clone(&store);
        async move {
            store
                .get(Kind::Sandbox, scope, "local:sbx_a")
                .await
                .unwrap()
        }
    };
    assert_eq!(get(Scope::Owner("alice")).await, Some(r.clone()));
    assert_eq!(
        get(Scope::Owner("bob")).await,
        None,
        "another principal's record is invisible"
    );
    assert_eq!(get(Scope::Owner("")).await, None);
    assert_eq!(get(Scope::System).await, Some(r));
    assert_eq!(
        store
            .get(Kind::Sandbox, Scope::System, "local:sbx_missing")
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        store
            .get(Kind::Process, Scope::Owner("alice"), "local:sbx_a")
            .await
            .unwrap(),
        None
    );
}

pub async fn update_compares_and_swaps_version(store: Arc<dyn Store>) {
    let r = rec(Kind::Sandbox, "sbx_1", "alice", t(0));
    store.insert(&r).await.unwrap();

    let mut next = r.clone();
    next.state = "paused".into();
    next.body = json!({"paused": true});
    next.parent = Some("parent".into());
    next.due_at = Some(t(30));
    let v2 = store
        .update(&next)
        .await
        .expect("update at the current version");
    assert_eq!(
        v2,
        Record {
            version: 2,
            ..next.clone()
        }
    );
    assert_eq!(
        store
            .get(Kind::Sandbox, Scope::System, "sbx_1")
            .await
            .unwrap(),
        Some(v2.clone())
    );

    let mut stale = r.clone();
    stale.state = "killed".into();
    let err = store
        .update(&stale)
        .await
        .expect_err("update at a stale version");
    assert!(matches!(err, StoreError::Conflict), "got {err:?}");
    assert_eq!(
        store
            .get(Kind::Sandbox, Scope::System, "sbx_1")
            .await
            .unwrap(),
        Some(v2.clone())
    );

    let mut ahead = v2.clone();
    ahead.version = 5;
    assert!(
        matches!(store.update(&ahead).await, Err(StoreError::Conflict)),
        "a version from the future"
    );

    let mut again = v2;
    again.state = "running".into();
    again.parent = None;
    again.due_at = None;
    let v3 = store.update(&again).await.expect("update at version 2");
    assert_eq!(v3.version, 3);
    assert_eq!(v3.parent, None);
    assert_eq!(v3.due_at, None);
    assert_eq!(
        store
            .get(Kind::Sandbox, Scope::System, "sbx_1")
            .await
            .unwrap(),
        Some(v3)
    );
}

pub async fn update_keeps_owner_and_created_at(store: Arc<dyn Store>) {
    let r = rec(Kind::Sandbox, "sbx_1", "alice", t(0));
    store.insert(&r).await.unwrap();
    let mut changed = r.clone();
    changed.owner = "bob".into();
    changed.created_at = t(99);
    changed.state = "paused".into();
    let stored = store.update(&changed).await.unwrap();
    assert_eq!(stored.owner, "alice");
    assert_eq!(stored.created_at, t(0));
    assert_eq!(stored.state, "paused");
    assert_eq!(
        store
            .get(Kind::Sandbox, Scope::Owner("bob"), "sbx_1")
            .await
            .unwrap(),
        None
    );
}

pub async fn update_of_missing_record_is_not_found(store: Arc<dyn Store>) {
    let err = store
        .update(&rec(Kind::Sandbox, "sbx_none", "alice", t(0)))
        .await
        .expect_err("missing");
    assert!(matches!(err, StoreError::NotFound), "got {err:?}");
    store
        .insert(&rec(Kind::Process, "sbx_none", "alice", t(0)))
        .await
        .unwrap();
    let err = store
        .update(&rec(Kind::Sandbox, "sbx_none", "alice", t(0)))
        .await
        .expect_err("other kind");
    assert!(matches!(err, StoreError::NotFound), "got {err:?}");
}

pub async fn concurrent_updates_have_one_winner(store: Arc<dyn Store>) {
    let r = rec(Kind::Session, "ses_1", "alice", t(0));
    store.insert(&r).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let store = Arc::clone(&store);
        let mut next = r.clone();
        next.body = json!({"writer": i});
        tasks.push(tokio::spawn(async move { store.update(&next).await }));
    }
    let mut winners = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            Ok(stored) => winners.push(stored),
            Err(StoreError::Conflict) => {}
            Err(e) => panic!("unexpected error: {e:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one writer at version 1 succeeds");
    assert_eq!(winners[0].version, 2);
    assert_eq!(
        store
            .get(Kind::Session, Scope::System, "ses_1")
            .await
            .unwrap()
            .as_ref(),
        Some(&winners[0])
    );
}

pub async fn delete_removes_once(store: Arc<dyn Store>) {
    store
        .insert(&rec(Kind::Sandbox, "sbx_1", "alice", t(0)))
        .await
        .unwrap();
    store
        .insert(&rec(Kind::Snapshot, "sbx_1", "alice", t(0)))
        .await
        .unwrap();
    assert!(store.delete(Kind::Sandbox, "sbx_1").await.unwrap());
    assert_eq!(
        store
            .get(Kind::Sandbox, Scope::System, "sbx_1")
            .await
            .unwrap(),
        None
    );
    assert!(
        !store.delete(Kind::Sandbox, "sbx_1").await.unwrap(),
        "second delete finds nothing"
    );
    assert!(!store.delete(Kind::Sandbox, "never").await.unwrap());
    assert!(
        store
            .get(Kind::Snapshot, Scope::System, "sbx_1")
            .await
            .unwrap()
            .is_some(),
        "other kind kept"
    );
    let err = store
        .update(&rec(Kind::Sandbox, "sbx_1", "alice", t(0)))
        .await
        .expect_err("update deleted");
    assert!(matches!(err, StoreError::NotFound), "got {err:?}");
    store
        .insert(&rec(Kind::Sandbox, "sbx_1", "bob", t(1)))
        .await
        .expect("an ID can be reused after delete");
}

pub async fn list_orders_by_created_at_then_id(store: Arc<dyn Store>) {
    // Inserted out of order, with ties on created_at broken by id (byte order: 'B' < 'a').
    let records = [
        rec(Kind::Sandbox, "c", "alice", t(1)),
        rec(Kind::Sandbox, "a", "alice", t(2)),
        rec(Kind::Sandbox, "b", "alice", t(1)),
        rec(Kind::Sandbox, "B", "alice", t(1)),
        rec(Kind::Sandbox, "z", "alice", t(0)),
        rec(
            Kind::Sandbox,
            "a2",
            "alice",
            t(1) + Duration::microseconds(1),
        ),
    ];
    insert_all(&*store, &records).await;
    let listed = store
        .list(&ListQuery::new(Kind::Sandbox, Scope::System))
        .await
        .unwrap();
    assert_eq!(ids(&listed), ["z", "B", "b", "c", "a2", "a"]);
    assert_eq!(listed[0], records[4], "list returns whole records");
}

pub async fn list_pages_with_keyset_cursor(store: Arc<dyn Store>) {
    let records: Vec<Record> = (0..7)
        .map(|i| rec(Kind::Process, &format!("prc_{i}"), "alice", t(i / 2)))
        .collect();
    insert_all(&*store, &records).await;
    let mut pages = Vec::new();
    let mut after = None;
    loop {
        let mut q = ListQuery::new(Kind::Process, Scope::Owner("alice"));
        q.limit = Some(3);
        q.after = after.clone();
        let page = store.list(&q).await.unwrap();
        if page.is_empty() {
            break;
        }
        after = page.last().map(|r| (r.created_at, r.id.clone()));
        pages.push(
            ids(&page)
                .into_iter()
                .map(str::to_owned)
                .collect::<Vec<_>>(),
        );
        assert!(pages.len() <= 3, "paging does not end: {pages:?}");
    }
    assert_eq!(
        pages,
        [
            vec!["prc_0", "prc_1", "prc_2"],
            vec!["prc_3", "prc_4", "prc_5"],
            vec!["prc_6"]
        ],
        "keyset pages cover every record once, in order"
    );

    // A cursor between two records sharing a created_at.
    let mut q = ListQuery::new(Kind::Process, Scope::System);
    q.after = Some((t(1), "prc_2".into()));
    assert_eq!(
        ids(&store.list(&q).await.unwrap()),
        ["prc_3", "prc_4", "prc_5", "prc_6"]
    );
    // A cursor that is not a stored record still orders correctly.
    q.after = Some((t(1) + Duration::microseconds(1), String::new()));
    assert_eq!(
        ids(&store.list(&q).await.unwrap()),
        ["prc_4", "prc_5", "prc_6"]
    );
}

pub async fn list_filters_by_scope_parent_and_state(store: Arc<dyn Store>) {
    let mk = |id: &str, owner: &str, parent: Option<&str>, state: &str, at: i64| Record {
        parent: parent.map(str::to_owned),
        state: state.to_owned(),
        ..rec(Kind::Process, id, owner, t(at))
    };
    let records = [
        mk("p1", "alice", Some("sbx_a"), "running", 0),
        mk("p2", "alice", Some("sbx_a"), "exited", 1),
        mk("p3", "alice", Some("sbx_b"), "running", 2),
        mk("p4", "bob", Some("sbx_a"), "running", 3),
        mk("p5", "bob", None, "exited", 4),
    ];
    insert_all(&*store, &records).await;
    store
        .insert(&rec(Kind::Sandbox, "sbx_a", "alice", t(0)))
        .await
        .unwrap();

    let list = |scope, parent, state| {
        let store = Arc::clone(&store);
        async move {
            let mut q = ListQuery::new(Kind::Process, scope);
            q.parent = parent;
            q.state = state;
            let listed = store.list(&q).await.unwrap();
            listed.into_iter().map(|r| r.id).collect::<Vec<_>>()
        }
    };
    assert_eq!(
        list(Scope::System, None, None).await,
        ["p1", "p2", "p3", "p4", "p5"]
    );
    assert_eq!(
        list(Scope::Owner("alice"), None, None).await,
        ["p1", "p2", "p3"]
    );
    assert_eq!(list(Scope::Owner("bob"), None, None).await, ["p4", "p5"]);
    assert_eq!(
        list(Scope::Owner("carol"), None, None).await,
        Vec::<String>::new()
    );
    assert_eq!(
        list(Scope::System, Some("sbx_a"), None).await,
        ["p1", "p2", "p4"]
    );
    assert_eq!(
        list(Scope::Owner("alice"), Some("sbx_a"), None).await,
        ["p1", "p2"]
    );
    assert_eq!(
        list(Scope::System, None, Some("exited")).await,
        ["p2", "p5"]
    );
    assert_eq!(
        list(Scope::Owner("alice"), Some("sbx_a"), Some("running")).await,
        ["p1"]
    );
    assert_eq!(
        list(Scope::Owner("bob"), Some("sbx_b"), None).await,
        Vec::<String>::new()
    );
    // Any of several states, in order, and with a limit.
    let mut q = ListQuery::new(Kind::Process, Scope::System);
    q.states = &["exited", "running"];
    assert_eq!(
        ids(&store.list(&q).await.unwrap()),
        ["p1", "p2", "p3", "p4", "p5"]
    );
    q.parent = Some("sbx_a");
    q.states = &["exited", "paused"];
    assert_eq!(ids(&store.list(&q).await.unwrap()), ["p2"]);
    q.parent = None;
    q.states = &["running"];
    q.limit = Some(2);
    assert_eq!(ids(&store.list(&q).await.unwrap()), ["p1", "p3"]);
}

pub async fn list_respects_limit(store: Arc<dyn Store>) {
    let records: Vec<Record> = (0..5)
        .map(|i| rec(Kind::Preview, &format!("prv_{i}"), "alice", t(i)))
        .collect();
    insert_all(&*store, &records).await;
    let mut q = ListQuery::new(Kind::Preview, Scope::Owner("alice"));
    for (limit, want) in [
        (Some(0), 0),
        (Some(1), 1),
        (Some(4), 4),
        (Some(5), 5),
        (Some(100), 5),
        (None, 5),
    ] {
        q.limit = limit;
        let listed = store.list(&q).await.unwrap();
        assert_eq!(listed.len(), want, "limit {limit:?}");
        assert_eq!(
            ids(&listed),
            ids(&records[..want]),
            "limit {limit:?} keeps the first records"
        );
    }
}

pub async fn due_returns_records_due_oldest_first(store: Arc<dyn Store>) {
    let now = t(100);
    let mk = |id: &str, owner: &str, due: Option<OffsetDateTime>| Record {
        due_at: due,
        ..rec(Kind::Sandbox, id, owner, t(0))
    };
    let records = [
        mk("late", "alice", Some(t(90))),
        mk("early", "bob", Some(t(10))),
        mk("exact", "alice", Some(now)),
        mk("future", "alice", Some(now + Duration::microseconds(1))),
        mk("never", "alice", None),
        mk("tie-b", "carol", Some(t(50))),
        mk("tie-a", "carol", Some(t(50))),
    ];
    insert_all(&*store, &records).await;
    store
        .insert(&Record {
            due_at: Some(t(0)),
            ..rec(Kind::Preview, "other-kind", "alice", t(0))
        })
        .await
        .unwrap();

    let due = store.due(Kind::Sandbox, now, 100).await.unwrap();
    assert_eq!(
        ids(&due),
        ["early", "tie-a", "tie-b", "late", "exact"],
        "due at or before now, oldest first"
    );
    assert_eq!(due[0], records[1]);
    assert_eq!(
        ids(&store.due(Kind::Sandbox, now, 2).await.unwrap()),
        ["early", "tie-a"]
    );
    assert!(
        store
            .due(Kind::Sandbox, t(5), 100)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        ids(&store.due(Kind::Preview, now, 100).await.unwrap()),
        ["other-kind"]
    );

    // Clearing due_at takes a record off the queue.
    let mut early = records[1].clone();
    early.due_at = None;
    store.update(&early).await.unwrap();
    assert_eq!(
        ids(&store.due(Kind::Sandbox, now, 1).await.unwrap()),
        ["tie-a"]
    );
}

pub async fn append_numbers_events_from_one(store: Arc<dyn Store>) {
    let before = crate::clock::now();
    let mut appended = Vec::new();
    for i in 0..5 {
        let data = json!({"seq_hint": i, "text": format!("line {i}\n")});
        let e = store
            .append_event("prc_1", if i % 2 == 0 { "stdout" } else { "stderr" }, &data)
            .await
            .unwrap();
        assert_eq!(e.seq, i + 1);
        assert_eq!(e.stream, "prc_1");
        assert_eq!(e.data, data);
        assert!(
            e.at >= before && e.at <= crate::clock::now(),
            "event time is the append time"
        );
        appended.push(e);
    }
    let other = store
        .append_event("prc_2", "stdout", &Value::Null)
        .await
        .unwrap();
    assert_eq!(other.seq, 1, "each stream counts on its own");
    assert_eq!(
        store.events_after("prc_1", 0, 100).await.unwrap(),
        appended,
        "stored exactly as returned"
    );
    assert_eq!(
        store.stream_bounds("prc_1").await.unwrap(),
        StreamBounds {
            last_seq: 5,
            purged_through: 0
        }
    );
}

pub async fn events_after_respects_cursor_and_limit(store: Arc<dyn Store>) {
    for i in 1..=5 {
        store.append_event("s", "k", &json!(i)).await.unwrap();
    }
    let seqs = |events: Vec<super::Event>| events.into_iter().map(|e| e.seq).collect::<Vec<_>>();
    assert_eq!(seqs(store.events_after("s", 2, 2).await.unwrap()), [3, 4]);
    assert_eq!(
        seqs(store.events_after("s", 2, 100).await.unwrap()),
        [3, 4, 5]
    );
    assert_eq!(seqs(store.events_after("s", 0, 1).await.unwrap()), [1]);
    assert_eq!(
        seqs(store.events_after("s", 0, 0).await.unwrap()),
        Vec::<i64>::new()
    );
    assert_eq!(
        seqs(store.events_after("s", 5, 100).await.unwrap()),
        Vec::<i64>::new()
    );
    assert_eq!(
        seqs(store.events_after("s", 50, 100).await.unwrap()),
        Vec::<i64>::new()
    );
    assert_eq!(
        seqs(store.events_after("s", -3, 100).await.unwrap()),
        [1, 2, 3, 4, 5]
    );
    assert_eq!(
        seqs(store.events_after("unknown", 0, 100).await.unwrap()),
        Vec::<i64>::new()
    );
}

pub async fn purge_moves_bounds_and_drops_events(store: Arc<dyn Store>) {
    assert_eq!(
        store.stream_bounds("s").await.unwrap(),
        StreamBounds::default()
    );
    for _ in 0..3 {
        store.append_event("s", "k", &Value::Null).await.unwrap();
    }
    assert_eq!(
        store.stream_bounds("s").await.unwrap(),
        StreamBounds {
            last_seq: 3,
            purged_through: 0
        }
    );

    store.purge_events("s", 2).await.unwrap();
    assert_eq!(
        store.stream_bounds("s").await.unwrap(),
        StreamBounds {
            last_seq: 3,
            purged_through: 2
        }
    );
    let left: Vec<i64> = store
        .events_after("s", 0, 100)
        .await
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(left, [3]);

    store.purge_events("s", 1).await.unwrap();
    assert_eq!(
        store.stream_bounds("s").await.unwrap().purged_through,
        2,
        "purged_through never goes down"
    );

    store.purge_events("s", 100).await.unwrap();
    assert_eq!(
        store.stream_bounds("s").await.unwrap(),
        StreamBounds {
            last_seq: 3,
            purged_through: 3
        },
        "purged_through stops at last_seq"
    );
    assert!(store.events_after("s", 0, 100).await.unwrap().is_empty());

    let e = store.append_event("s", "k", &Value::Null).await.unwrap();
    assert_eq!(e.seq, 4, "numbering continues after a purge");
    assert_eq!(store.events_after("s", 0, 100).await.unwrap(), [e]);

    store.purge_events("unknown", 5).await.unwrap();
    assert_eq!(
        store.stream_bounds("unknown").await.unwrap(),
        StreamBounds::default()
    );
}

pub async fn drop_stream_forgets_everything(store: Arc<dyn Store>) {
    for _ in 0..3 {
        store.append_event("gone", "k", &Value::Null).await.unwrap();
        store.append_event("kept", "k", &Value::Null).await.unwrap();
    }
    store.purge_events("gone", 1).await.unwrap();
    store.drop_stream("gone").await.unwrap();
    assert_eq!(
        store.stream_bounds("gone").await.unwrap(),
        StreamBounds::default()
    );
    assert!(store.events_after("gone", 0, 100).await.unwrap().is_empty());
    assert_eq!(store.stream_bounds("kept").await.unwrap().last_seq, 3);
    assert_eq!(store.events_after("kept", 0, 100).await.unwrap().len(), 3);
    store.drop_stream("never-existed").await.unwrap();
    assert_eq!(
        store
            .append_event("gone", "k", &Value::Null)
            .await
            .unwrap()
            .seq,
        1
    );
}

pub async fn concurrent_appends_are_gap_free(store: Arc<dyn Store>) {
    const TASKS: i64 = 16;
    const EACH: i64 = 15;
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            for i in 0..EACH {
                let stream = if (task + i) % 3 == 0 { "b" } else { "a" };
                let e = store
                    .append_event(stream, "k", &json!({"task": task, "i": i}))
                    .await
                    .unwrap();
                got.push((e.stream, e.seq));
            }
            got
        }));
    }
    let mut returned: Vec<(String, i64)> = Vec::new();
    for task in tasks {
        returned.extend(task.await.unwrap());
    }
    for stream in ["a", "b"] {
        let mut seqs: Vec<i64> = returned
            .iter()
            .filter(|(s, _)| s == stream)
            .map(|(_, q)| *q)
            .collect();
        let n = i64::try_from(seqs.len()).unwrap();
        seqs.sort_unstable();
        assert_eq!(
            seqs,
            (1..=n).collect::<Vec<_>>(),
            "stream {stream}: returned seqs are 1..={n}"
        );
        let stored: Vec<i64> = store
            .events_after(stream, 0, 1000)
            .await
            .unwrap()
            .iter()
            .map(|e| e.seq)
            .collect();
        assert_eq!(
            stored,
            (1..=n).collect::<Vec<_>>(),
            "stream {stream}: stored seqs are 1..={n}"
        );
        assert_eq!(store.stream_bounds(stream).await.unwrap().last_seq, n);
    }
    assert_eq!(i64::try_from(returned.len()).unwrap(), TASKS * EACH);
    let distinct: BTreeSet<(i64, i64)> = {
        let mut all = Vec::new();
        for stream in ["a", "b"] {
            for e in store.events_after(stream, 0, 1000).await.unwrap() {
                all.push((
                    e.data["task"].as_i64().unwrap(),
                    e.data["i"].as_i64().unwrap(),
                ));
            }
        }
        all.into_iter().collect()
    };
    assert_eq!(
        i64::try_from(distinct.len()).unwrap(),
        TASKS * EACH,
        "every append stored exactly once"
    );
}

pub async fn idempotency_claim_in_flight_then_done(store: Arc<dyn Store>) {
    let key = "POST /v1/sandboxes k1";
    assert_eq!(
        store
            .idem_claim("alice", key, "h1", expire_never())
            .await
            .unwrap(),
        IdemClaim::Claimed
    );
    assert_eq!(
        store
            .idem_claim("alice", key, "h2", expire_never())
            .await
            .unwrap(),
        IdemClaim::InFlight {
            request_hash: "h1".into()
        },
        "a held key reports the hash of the request holding it"
    );
    assert_eq!(
        store
            .idem_claim("bob", key, "h1", expire_never())
            .await
            .unwrap(),
        IdemClaim::Claimed,
        "per principal"
    );
    assert_eq!(
        store
            .idem_claim("alice", "other", "h1", expire_never())
            .await
            .unwrap(),
        IdemClaim::Claimed
    );

    store
        .idem_complete("alice", key, 201, "local:sbx_1")
        .await
        .unwrap();
    let done = IdemClaim::Done {
        request_hash: "h1".into(),
        status: 201,
        resource_id: "local:sbx_1".into(),
    };
    assert_eq!(
        store
            .idem_claim("alice", key, "h1", expire_never())
            .await
            .unwrap(),
        done
    );
    assert_eq!(
        store
            .idem_claim("alice", key, "h9", expire_never())
            .await
            .unwrap(),
        done,
        "whatever the new hash"
    );
    assert_eq!(
        store
            .idem_claim("bob", key, "h1", expire_never())
            .await
            .unwrap(),
        IdemClaim::InFlight {
            request_hash: "h1".into()
        }
    );
    // Completing a key nobody claimed records nothing.
    store.idem_complete("carol", key, 200, "x").await.unwrap();
    assert_eq!(
        store
            .idem_claim("carol", key, "h1", expire_never())
            .await
            .unwrap(),
        IdemClaim::Claimed
    );
}

pub async fn idempotency_release_frees_key(store: Arc<dyn Store>) {
    assert_eq!(
        store
            .idem_claim("alice", "k", "h1", expire_never())
            .await
            .unwrap(),
        IdemClaim::Claimed
    );
    store.idem_release("alice", "k").await.unwrap();
    assert_eq!(
        store
            .idem_claim("alice", "k", "h2", expire_never())
            .await
            .unwrap(),
        IdemClaim::Claimed,
        "a released key can be claimed again, with another request"
    );
    store.idem_complete("alice", "k", 201, "id").await.unwrap();
    store.idem_release("alice", "k").await.unwrap();
    assert_eq!(
        store
            .idem_claim("alice", "k", "h3", expire_never())
            .await
            .unwrap(),
        IdemClaim::Done {
            request_hash: "h2".into(),
            status: 201,
            resource_id: "id".into()
        },
        "release does not forget a finished request"
    );
    store.idem_release("alice", "never-claimed").await.unwrap();
}

pub async fn idempotency_keys_expire(store: Arc<dyn Store>) {
    assert_eq!(
        store
            .idem_claim("alice", "done", "h1", expire_never())
            .await
            .unwrap(),
        IdemClaim::Claimed
    );
    store
        .idem_complete("alice", "done", 201, "id")
        .await
        .unwrap();
    assert_eq!(
        store
            .idem_claim("bob", "held", "h1", expire_never())
            .await
            .unwrap(),
        IdemClaim::Claimed
    );

    let later = crate::clock::now() + Duration::seconds(1);
    assert_eq!(
        store
            .idem_claim("alice", "done", "h2", later)
            .await
            .unwrap(),
        IdemClaim::Claimed,
        "a key used before expire_before is forgotten"
    );
    assert_eq!(
        store
            .idem_claim("bob", "held", "h2", expire_never())
            .await
            .unwrap(),
        IdemClaim::Claimed,
        "expiry forgets every principal's old keys, held ones included"
    );
    assert_eq!(
        store
            .idem_claim("alice", "done", "h3", expire_never())
            .await
            .unwrap(),
        IdemClaim::InFlight {
            request_hash: "h2".into()
        },
        "the new claim is not expired"
    );
}

pub async fn concurrent_claims_have_one_winner(store: Arc<dyn Store>) {
    let mut tasks = Vec::new();
    for i in 0..16 {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            store
                .idem_claim("alice", "k", &format!("h{i}"), expire_never())
                .await
                .unwrap()
        }));
    }
    let mut claimed = 0;
    let mut holders = BTreeSet::new();
    for task in tasks {
        match task.await.unwrap() {
            IdemClaim::Claimed => claimed += 1,
            IdemClaim::InFlight { request_hash } => {
                holders.insert(request_hash);
            }
            done @ IdemClaim::Done { .. } => panic!("nothing completed the key: {done:?}"),
        }
    }
    assert_eq!(claimed, 1, "exactly one concurrent claim wins");
    assert_eq!(
        holders.len(),
        1,
        "the losers all see the winner's hash: {holders:?}"
    );
}

pub async fn digest_is_stable_without_writes(store: Arc<dyn Store>) {
    let empty = store.digest().await.unwrap();
    assert_eq!(empty.len(), 64, "hex SHA-256");
    assert!(empty.bytes().all(|b| b.is_ascii_hexdigit()));
    store
        .insert(&rec(Kind::Sandbox, "sbx_1", "alice", t(0)))
        .await
        .unwrap();
    store
        .append_event("s", "k", &json!({"a": 1}))
        .await
        .unwrap();
    store
        .idem_claim("alice", "k", "h", expire_never())
        .await
        .unwrap();
    let d = store.digest().await.unwrap();
    assert_ne!(d, empty);

    // Reads change nothing.
    store.ping().await.unwrap();
    store
        .get(Kind::Sandbox, Scope::Owner("alice"), "sbx_1")
        .await
        .unwrap();
    store
        .list(&ListQuery::new(Kind::Sandbox, Scope::System))
        .await
        .unwrap();
    store.due(Kind::Sandbox, t(1000), 10).await.unwrap();
    store.events_after("s", 0, 10).await.unwrap();
    store.stream_bounds("s").await.unwrap();
    assert_eq!(store.digest().await.unwrap(), d);
    assert_eq!(store.digest().await.unwrap(), d);
}

pub async fn digest_changes_on_every_write(store: Arc<dyn Store>) {
    let mut seen = vec![store.digest().await.unwrap()];
    let mut check = |what: &str, d: String| {
        assert!(
            !seen.contains(&d),
            "digest unchanged (or repeated) after {what}"
        );
        seen.push(d);
    };
    let r = rec(Kind::Sandbox, "sbx_1", "alice", t(0));
    store.insert(&r).await.unwrap();
    check("insert", store.digest().await.unwrap());

    let mut next = r.clone();
    next.body = json!({"id": "sbx_1", "n": 2});
    let stored = store.update(&next).await.unwrap();
    check("update of the body", store.digest().await.unwrap());
    let mut next = stored;
    next.due_at = Some(t(5));
    let stored = store.update(&next).await.unwrap();
    check("update of due_at", store.digest().await.unwrap());
    let mut next = stored;
    next.state = "paused".into();
    store.update(&next).await.unwrap();
    check("update of the state", store.digest().await.unwrap());

    store.append_event("s", "k", &Value::Null).await.unwrap();
    check("first append", store.digest().await.unwrap());
    store.append_event("s", "k", &Value::Null).await.unwrap();
    check("second append", store.digest().await.unwrap());
    store.append_event("kept", "k", &Value::Null).await.unwrap();
    check("append to another stream", store.digest().await.unwrap());
    store.purge_events("s", 1).await.unwrap();
    check("purge", store.digest().await.unwrap());
    store.drop_stream("s").await.unwrap();
    check("drop_stream", store.digest().await.unwrap());

    store
        .idem_claim("alice", "k", "h", expire_never())
        .await
        .unwrap();
    check("idem_claim", store.digest().await.unwrap());
    store
        .idem_complete("alice", "k", 201, "sbx_1")
        .await
        .unwrap();
    check("idem_complete", store.digest().await.unwrap());
    store
        .idem_claim("bob", "k", "h", expire_never())
        .await
        .unwrap();
    check(
        "idem_claim by another principal",
        store.digest().await.unwrap(),
    );
    store.idem_release("bob", "k").await.unwrap();
    // Releasing bob's key restores a state seen before.
    assert_eq!(
        store.digest().await.unwrap(),
        seen[seen.len() - 2],
        "release undoes the claim"
    );

    assert!(store.delete(Kind::Sandbox, "sbx_1").await.unwrap());
    let d = store.digest().await.unwrap();
    assert_ne!(d, *seen.last().unwrap(), "digest unchanged after delete");
}

pub async fn digest_ignores_failed_writes(store: Arc<dyn Store>) {
    let r = rec(Kind::Sandbox, "sbx_1", "alice", t(0));
    store.insert(&r).await.unwrap();
    store.append_event("s", "k", &Value::Null).await.unwrap();
    store
        .idem_claim("alice", "k", "h", expire_never())
        .await
        .unwrap();
    store
        .idem_complete("alice", "k", 201, "sbx_1")
        .await
        .unwrap();
    let d = store.digest().await.unwrap();

    assert!(
        store
            .insert(&Record {
                owner: "bob".into(),
                ..r.clone()
            })
            .await
            .is_err()
    );
    store.update(&r).await.unwrap();
    let after_update = store.digest().await.unwrap();
    assert_ne!(after_update, d);
    assert!(matches!(store.update(&r).await, Err(StoreError::Conflict)));
    assert!(matches!(
        store
            .update(&rec(Kind::Sandbox, "none", "alice", t(0)))
            .await,
        Err(StoreError::NotFound)
    ));
    assert!(!store.delete(Kind::Sandbox, "none").await.unwrap());
    store.idem_release("alice", "k").await.unwrap();
    store
        .idem_claim("alice", "k", "h2", expire_never())
        .await
        .unwrap();
    store.purge_events("s", 0).await.unwrap();
    store.purge_events("unknown", 3).await.unwrap();
    store.drop_stream("unknown").await.unwrap();
    assert_eq!(
        store.digest().await.unwrap(),
        after_update,
        "writes that change nothing leave the digest alone"
    );
}

pub async fn digest_is_equal_for_equal_state(store: Arc<dyn Store>) {
    let a = rec(Kind::Sandbox, "sbx_a", "alice", t(0));
    store.insert(&a).await.unwrap();
    let only_a = store.digest().await.unwrap();
    let mut b = rec(Kind::Sandbox, "sbx_b", "bob", t(1));
    b.body = json!({"z": 1, "a": {"y": [1, 2], "b": "x"}});
    store.insert(&b).await.unwrap();
    let both = store.digest().await.unwrap();
    assert_ne!(both, only_a);
    assert!(store.delete(Kind::Sandbox, "sbx_b").await.unwrap());
    assert_eq!(
        store.digest().await.unwrap(),
        only_a,
        "the same rows give the same digest"
    );
    store.insert(&b).await.unwrap();
    assert_eq!(store.digest().await.unwrap(), both);
}

/// Writes the same records into `store`: two stores given this have equal digests, whatever
/// their database. (Events and idempotency keys carry the time they were written.)
pub async fn write_deterministic_state(store: &dyn Store) {
    let mut p = rec(Kind::Process, "local:prc_1", "alice", t(3));
    p.parent = Some("local:sbx_1".into());
    p.due_at = Some(t(60));
    p.body = json!({"cmd": ["echo", "ü"], "nested": {"b": 2, "a": 1.5}, "none": null});
    insert_all(
        store,
        &[
            rec(Kind::Sandbox, "local:sbx_1", "alice", t(0)),
            rec(Kind::Sandbox, "local-b:sbx_2", "bob", t(1)),
            p.clone(),
        ],
    )
    .await;
    p.state = "exited".into();
    store.update(&p).await.unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_names_are_unique() {
        let names: BTreeSet<&str> = CASES.iter().map(|c| c.name).collect();
        assert_eq!(names.len(), CASES.len());
        assert!(CASES.len() >= 29, "{} cases", CASES.len());
    }
}
