//! Durable per-stream event logs with live wake-ups, and the SSE responses built on them.
//!
//! The store's event table is the truth; the wake-ups only tell waiting streams that there is
//! something new to read. Appends in this process wake them directly; appends by another
//! server process sharing the database arrive through the store's LISTEN/NOTIFY feed. A stream
//! that misses a wake-up still reads every event on its next poll, so nothing is ever skipped.

pub mod sse;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tokio::sync::watch;

use crate::store::{Event, Result, Store};

/// Appends to durable logs and wakes the streams that follow them.
#[derive(Clone)]
pub struct EventLog {
    store: Arc<dyn Store>,
    /// One watch channel per stream that someone follows, carrying the last appended seq.
    /// Entries are created on demand and dropped when nobody follows the stream any more.
    wakers: Arc<Wakers>,
}

impl EventLog {
    /// Must be called inside a Tokio runtime when the store reports other processes' appends:
    /// a task forwards them as wake-ups for as long as the store lives.
    pub fn new(store: Arc<dyn Store>) -> Self {
        let log = Self {
            store,
            wakers: Arc::default(),
        };
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
        self.wake(stream, event.seq);
        Ok(event)
    }

    /// Tells followers of `stream` that events up to `seq` exist (also used when another
    /// server process reports an append).
    pub fn wake(&self, stream: &str, seq: i64) {
        wake(&self.wakers, stream, seq);
    }

    /// A receiver that changes whenever something is appended to `stream`.
    pub fn follow(&self, stream: &str) -> watch::Receiver<i64> {
        let mut wakers = self.wakers.lock().unwrap_or_else(|e| e.into_inner());
        wakers
            .entry(stream.to_owned())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }
}

type Wakers = Mutex<HashMap<String, watch::Sender<i64>>>;

fn wake(wakers: &Wakers, stream: &str, seq: i64) {
    let mut wakers = wakers.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(tx) = wakers.get(stream) {
        if tx.receiver_count() == 0 {
            wakers.remove(stream);
        } else {
            tx.send_if_modified(|last| {
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
