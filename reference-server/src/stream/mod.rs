//! Durable per-stream event logs with live wake-ups, and the SSE responses built on them.
//!
//! The store's event table is the truth; the wake-ups only tell waiting streams that there is
//! something new to read. Appends in this process wake them directly; appends by another
//! server process sharing the database arrive through the store's LISTEN/NOTIFY feed. A stream
//! that misses a wake-up still reads every event on its next poll, so nothing is ever skipped.

pub mod sse;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tokio::sync::watch;

use crate::store::{Event, Result, Store};

/// How many of a followed stream's latest events this process keeps in memory.
const RECENT: usize = 512;

/// Appends to durable logs and wakes the streams that follow them.
///
/// For a stream someone follows, the events this process appended last are also kept in
/// memory (with their SSE frame rendered once), so that a wake-up of many followers costs one
/// store write, not one store read per follower. A reader takes from memory only a run that
/// starts right after its cursor; anything else (an event another process appended, one
/// appended before anyone followed) comes from the store, which stays the truth.
#[derive(Clone)]
pub struct EventLog {
    store: Arc<dyn Store>,
    /// One entry per stream that someone follows: the watch channel carrying the last appended
    /// seq, and the recent events. Entries are created on demand and dropped when nobody
    /// follows the stream any more.
    wakers: Arc<Wakers>,
    /// The `foreign-appends-ignored` defect: other processes' appends wake nobody, and
    /// streams read the store only when woken.
    foreign_ignored: bool,
}

/// An event with its SSE frame.
#[derive(Debug)]
pub struct Framed {
    pub event: Event,
    pub frame: bytes::Bytes,
}

impl Framed {
    pub fn new(event: Event) -> Self {
        let frame = bytes::Bytes::from(frame(&event));
        Self { event, frame }
    }
}

/// One event's frame: `id`, `event` and a one-line JSON `data` carrying `seq`.
pub fn frame(event: &Event) -> String {
    let data = match &event.data {
        Value::Object(map) => {
            let mut map = map.clone();
            map.insert("seq".into(), Value::from(event.seq));
            Value::Object(map)
        }
        other => serde_json::json!({"seq": event.seq, "data": other}),
    };
    // serde_json never writes a raw newline, so `data` is one line. U+2028 and U+2029 are
    // line ends to some readers: they are written escaped (they can only occur in strings).
    let data = data
        .to_string()
        .replace('\u{2028}', "\\u2028")
        .replace('\u{2029}', "\\u2029");
    format!(
        "id: {}\nevent: {}\ndata: {}\n\n",
        event.seq, event.kind, data
    )
}

struct Followed {
    tx: watch::Sender<i64>,
    recent: BTreeMap<i64, Arc<Framed>>,
}

impl EventLog {
    /// Must be called inside a Tokio runtime when the store reports other processes' appends:
    /// a task forwards them as wake-ups for as long as the store lives.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self::build(store, false)
    }

    /// The `foreign-appends-ignored` defect: the store's feed of other processes' appends is
    /// dropped, and streams do not poll the store between wake-ups.
    pub fn ignoring_foreign_appends(store: Arc<dyn Store>) -> Self {
        Self::build(store, true)
    }

    /// Whether this log was built with [`EventLog::ignoring_foreign_appends`].
    pub fn ignores_foreign_appends(&self) -> bool {
        self.foreign_ignored
    }

    fn build(store: Arc<dyn Store>, foreign_ignored: bool) -> Self {
        let log = Self {
            store,
            wakers: Arc::default(),
            foreign_ignored,
        };
        if foreign_ignored {
            return log;
        }
        if let Some(mut foreign) = log.store.foreign_appends() {
            let wakers = Arc::clone(&log.wakers);
            tokio::spawn(async move {
                use tokio::sync::broadcast::error::RecvError;
                loop {
                    match foreign.recv().await {
                        Ok((stream, seq)) => wake(&wakers, &stream, seq),
                        // Missed wake-ups are made good by the streams' own polling.
                        Err(RecvError::Lagged(_)) => {}
                        Err(RecvError::Closed) => return,
                    }
                }
            });
        }
        log
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Appends one event durably, then wakes the stream's followers.
    pub async fn append(&self, stream: &str, kind: &str, data: &Value) -> Result<Event> {
        let event = self.store.append_event(stream, kind, data).await?;
        {
            let mut wakers = self.wakers.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(followed) = wakers.get_mut(stream) {
                followed
                    .recent
                    .insert(event.seq, Arc::new(Framed::new(event.clone())));
                while followed.recent.len() > RECENT {
                    followed.recent.pop_first();
                }
            }
        }
        self.wake(stream, event.seq);
        Ok(event)
    }

    /// Up to `limit` events of `stream` after `after`, ascending: from memory when it holds the
    /// very next ones, else from the store.
    pub async fn read_after(
        &self,
        stream: &str,
        after: i64,
        limit: u32,
    ) -> Result<Vec<Arc<Framed>>> {
        {
            let wakers = self.wakers.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(followed) = wakers.get(stream) {
                let run: Vec<Arc<Framed>> = followed
                    .recent
                    .range(after + 1..)
                    .take(limit as usize)
                    .zip(after + 1..)
                    .take_while(|((seq, _), want)| *seq == want)
                    .map(|((_, f), _)| Arc::clone(f))
                    .collect();
                if !run.is_empty() {
                    return Ok(run);
                }
            }
        }
        let events = self.store.events_after(stream, after, limit).await?;
        Ok(events
            .into_iter()
            .map(|e| Arc::new(Framed::new(e)))
            .collect())
    }

    /// Tells followers of `stream` that events up to `seq` exist (also used when another
    /// server process reports an append).
    pub fn wake(&self, stream: &str, seq: i64) {
        wake(&self.wakers, stream, seq);
    }

    /// A receiver that changes whenever something is appended to `stream`.
    pub fn follow(&self, stream: &str) -> watch::Receiver<i64> {
        let mut wakers = self.wakers.lock().unwrap_or_else(|e| e.into_inner());
        // Streams nobody follows any more (their last follower went without a wake-up since).
        wakers.retain(|_, followed| followed.tx.receiver_count() > 0);
        wakers
            .entry(stream.to_owned())
            .or_insert_with(|| Followed {
                tx: watch::channel(0).0,
                recent: BTreeMap::new(),
            })
            .tx
            .subscribe()
    }
}

type Wakers = Mutex<HashMap<String, Followed>>;

fn wake(wakers: &Wakers, stream: &str, seq: i64) {
    let mut wakers = wakers.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(followed) = wakers.get(stream) {
        if followed.tx.receiver_count() == 0 {
            wakers.remove(stream);
        } else {
            followed.tx.send_if_modified(|last| {
                let newer = seq > *last;
                if newer {
                    *last = seq;
                }
                newer
            });
        }
    }
}

/// The stream key of a process's output log.
pub fn process_stream(process_id: &str) -> String {
    format!("process:{process_id}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SqliteStore;

    async fn log() -> EventLog {
        EventLog::new(Arc::new(SqliteStore::open(None).await.unwrap()))
    }

    fn seqs(read: &[Arc<Framed>]) -> Vec<i64> {
        read.iter().map(|f| f.event.seq).collect()
    }

    #[tokio::test]
    async fn followed_streams_are_read_from_memory_and_others_from_the_store() {
        let log = log().await;
        let data = serde_json::json!({"k": 1});
        log.append("s", "a", &data).await.unwrap();
        let _rx = log.follow("s");
        for _ in 0..3 {
            log.append("s", "a", &data).await.unwrap();
        }
        // Seq 1 was appended before anyone followed: only the store has it.
        assert_eq!(
            seqs(&log.read_after("s", 0, 10).await.unwrap()),
            [1, 2, 3, 4]
        );
        // Make the store forget 2..=4; a run that starts right after the cursor is in memory.
        log.store().purge_events("s", 4).await.unwrap();
        let run = log.read_after("s", 1, 10).await.unwrap();
        assert_eq!(seqs(&run), [2, 3, 4]);
        assert_eq!(run[0].frame, frame(&run[0].event));
        assert_eq!(seqs(&log.read_after("s", 2, 1).await.unwrap()), [3]);
        // Not followed: the store only.
        log.append("t", "a", &data).await.unwrap();
        log.store().purge_events("t", 1).await.unwrap();
        assert!(log.read_after("t", 0, 10).await.unwrap().is_empty());
    }

    #[test]
    fn frames_escape_unicode_line_separators() {
        let event = Event {
            stream: "s".into(),
            seq: 3,
            kind: "k".into(),
            data: serde_json::json!({"t": "a\u{2028}b\u{2029}c\n"}),
            at: time::OffsetDateTime::UNIX_EPOCH,
        };
        let frame = frame(&event);
        assert_eq!(
            frame,
            "id: 3\nevent: k\ndata: {\"seq\":3,\"t\":\"a\\u2028b\\u2029c\\n\"}\n\n"
        );
        let data: Value = serde_json::from_str(
            frame
                .lines()
                .nth(2)
                .unwrap()
                .strip_prefix("data: ")
                .unwrap(),
        )
        .unwrap();
        assert_eq!(data["t"], "a\u{2028}b\u{2029}c\n");
    }

    #[tokio::test]
    async fn a_gap_in_memory_is_read_from_the_store() {
        let log = log().await;
        let data = serde_json::json!({});
        let _rx = log.follow("s");
        // Appended behind the log's back (as by another server process): not in memory.
        log.store().append_event("s", "a", &data).await.unwrap();
        log.append("s", "a", &data).await.unwrap();
        assert_eq!(seqs(&log.read_after("s", 0, 10).await.unwrap()), [1, 2]);
        assert_eq!(seqs(&log.read_after("s", 1, 10).await.unwrap()), [2]);
    }

    #[tokio::test]
    async fn memory_keeps_only_the_latest_events_of_followed_streams() {
        let log = log().await;
        let data = serde_json::json!({});
        let rx = log.follow("s");
        for _ in 0..RECENT + 10 {
            log.append("s", "a", &data).await.unwrap();
        }
        {
            let wakers = log.wakers.lock().unwrap();
            let recent = &wakers["s"].recent;
            assert_eq!(recent.len(), RECENT);
            assert_eq!(recent.first_key_value().unwrap().0, &11);
        }
        drop(rx);
        let _other = log.follow("t");
        assert!(
            !log.wakers.lock().unwrap().contains_key("s"),
            "a stream nobody follows is dropped"
        );
    }
}
