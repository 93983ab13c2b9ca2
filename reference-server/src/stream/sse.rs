//! SSE responses over durable logs (§7): resumable, heartbeated, bounded in time, and capped
//! per principal.
//!
//! The body is pull-based: it reads the next batch from the store only when the connection
//! has written the previous one, so a slow client holds at most one batch in memory and the
//! durable log is its buffer. Only when retention purges events the client has not read yet
//! does the stream end with `stream.end {reason: "lagging"}`, so nothing is ever skipped
//! silently. Framing is written by hand so the exact bytes are under our control.
//!
//! A stream may be a filtered view of its log (the events of one submission in its session's
//! log): events the filter leaves out are read and passed over, so the cursor still follows
//! the log's own gap-free `seq` and ids on the wire increase with gaps (SSE-7.6).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::store::{Event, SlotClaim, Store, StoreError};

use super::{EventLog, Framed};

/// Events read from the store per batch (and so at most buffered per stream).
const BATCH: u32 = 256;
/// How often an idle stream re-reads the store even without a wake-up, so that appends by
/// another server process sharing the database are seen.
const POLL: Duration = Duration::from_secs(1);

/// Why a stream could not start.
#[derive(Debug, thiserror::Error)]
pub enum SseError {
    #[error("the request does not accept text/event-stream")]
    NotAcceptable,
    #[error("the cursor is not a sequence number")]
    BadCursor,
    #[error("the cursor is older than the stream's retention")]
    CursorExpired,
    #[error("too many concurrent streams")]
    TooManyStreams { retry_after_s: u64 },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Per-principal counts of open streams. A slot is held by a [`StreamSlot`] that lives in the
/// response body, so it is released the moment the connection drops the body.
#[derive(Debug, Default)]
pub struct StreamSlots {
    open: Mutex<HashMap<String, u32>>,
    /// The `stream-quota-unenforced` defect: slots are counted but never refused.
    unenforced: bool,
}

impl StreamSlots {
    /// Slots that refuse a principal's stream beyond its limit, unless `unenforced` (the
    /// `stream-quota-unenforced` defect).
    pub fn new(unenforced: bool) -> Self {
        Self {
            open: Mutex::default(),
            unenforced,
        }
    }

    /// A slot for `principal`, or `None` when it already holds `limit` streams.
    pub fn try_acquire(self: &Arc<Self>, principal: &str, limit: u32) -> Option<StreamSlot> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(principal.to_owned()).or_insert(0);
        if *count >= limit && !self.unenforced {
            return None;
        }
        *count += 1;
        Some(StreamSlot {
            slots: Arc::clone(self),
            principal: principal.to_owned(),
            shared: None,
        })
    }

    /// A slot for `principal`: in this process ([`StreamSlots::try_acquire`]), and, when the
    /// store is shared by several server processes, in the store too, so that the limit holds
    /// over all of them. `TooManyStreams` when either is full.
    pub async fn acquire(
        self: &Arc<Self>,
        store: &Arc<dyn Store>,
        principal: &str,
        limit: u32,
    ) -> Result<StreamSlot, SseError> {
        let full = || SseError::TooManyStreams { retry_after_s: 1 };
        let mut slot = self.try_acquire(principal, limit).ok_or_else(full)?;
        if self.unenforced {
            return Ok(slot);
        }
        match store.claim_stream_slot(principal, limit).await? {
            SlotClaim::Local => {}
            SlotClaim::Held(id) => slot.shared = Some((Arc::clone(store), id)),
            SlotClaim::Full => return Err(full()),
        }
        Ok(slot)
    }

    /// How many streams `principal` holds now.
    pub fn open(&self, principal: &str) -> u32 {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.get(principal).copied().unwrap_or(0)
    }
}

/// One held stream slot; dropping it frees the slot (the store's at once, in the background).
pub struct StreamSlot {
    slots: Arc<StreamSlots>,
    principal: String,
    shared: Option<(Arc<dyn Store>, String)>,
}

impl std::fmt::Debug for StreamSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSlot")
            .field("principal", &self.principal)
            .field("shared", &self.shared.as_ref().map(|(_, id)| id))
            .finish()
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        if let Some((store, id)) = self.shared.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move {
                if let Err(e) = store.release_stream_slot(&id).await {
                    tracing::warn!(error = %e, "could not release a stream slot");
                }
            });
        }
        let mut open = self.slots.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.principal) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.remove(&self.principal);
            }
        }
    }
}

/// Whether the request accepts an event stream at all (else 406).
pub fn check_accept(headers: &HeaderMap) -> Result<(), SseError> {
    let accepts = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.to_ascii_lowercase().contains("text/event-stream"));
    if accepts {
        Ok(())
    } else {
        Err(SseError::NotAcceptable)
    }
}

/// The resume cursor from `Last-Event-ID` (preferred) or `?after=`; `None` for a fresh stream.
pub fn parse_cursor(headers: &HeaderMap, after: Option<&str>) -> Result<Option<i64>, SseError> {
    let raw = match headers.get("last-event-id") {
        Some(v) => Some(
            v.to_str()
                .map_err(|_| SseError::BadCursor)?
                .trim()
                .to_owned(),
        ),
        None => after.map(str::to_owned),
    };
    match raw {
        None => Ok(None),
        // Digits only, as the schema's pattern says: `parse` alone would take `+5`.
        Some(s) if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) => {
            Err(SseError::BadCursor)
        }
        Some(s) => s.parse::<i64>().map(Some).map_err(|_| SseError::BadCursor),
    }
}

/// A future answering "has the subject (process, submission, ...) finished?".
pub type FinishedCheck = Pin<Box<dyn Future<Output = Result<bool, StoreError>> + Send>>;

/// Makes a fresh [`FinishedCheck`] each time it is called.
pub type Finished = Box<dyn Fn() -> FinishedCheck + Send + Sync>;

/// A test on one event of the log.
pub type EventTest = Box<dyn Fn(&Event) -> bool + Send + Sync>;

/// What a stream is about: the log to read, when it ends, and what to tell the caller.
pub struct Subject {
    /// The durable log's key.
    pub stream: String,
    /// Whether an event is the last one of the subject (the stream ends after it). Asked
    /// only of events the filter lets through.
    pub is_terminal: EventTest,
    /// Whether the subject has finished (its terminal event is in the log, or it is gone):
    /// with nothing for it after the cursor, 204 before the stream starts, and EOF when an
    /// idle stream finds it so (a subject removed before its terminal event was read).
    pub finished: Finished,
    /// The caller has just seen the subject unfinished (the session it looked up exists), so
    /// `finished` is not asked before the stream starts; it is still asked while it idles.
    pub known_live: bool,
    /// The events of the log that belong to this stream; `None` for all of them. The others
    /// are read and passed over: they move the cursor but are not sent.
    pub filter: Option<EventTest>,
    /// Called with each event's seq once it is handed to the connection.
    pub on_delivered: Option<Box<dyn Fn(i64) + Send + Sync>>,
    /// The stream's first read of the log, already made by the caller ([`Head::read`]);
    /// used only for a subject `known_live`, with the same cursor. `None`: `respond` reads.
    pub head: Option<Head>,
}

/// A stream's first read of its log, made before [`respond`] by a caller that looks the
/// subject up at the same time: the read does not depend on the lookup, so the two store
/// reads run at once instead of one after the other. The caller drops it unless the lookup
/// finds the subject.
pub struct Head {
    wake: watch::Receiver<i64>,
    cursor: Option<i64>,
    read: Result<Vec<Arc<Framed>>, StoreError>,
}

impl Head {
    /// Follows `stream` and reads it as [`respond`] would first, for `cursor`.
    pub async fn read(log: &EventLog, stream: &str, cursor: Option<i64>) -> Head {
        // Follow before reading so that an append racing with the read still wakes the stream.
        let wake = log.follow(stream);
        let read = log
            .read_after(stream, first_read_after(cursor), BATCH)
            .await;
        Head { wake, cursor, read }
    }
}

/// Where the first read of a stream starts: one event before the cursor, so that the batch
/// read also proves the cursor (see [`respond`]).
fn first_read_after(cursor: Option<i64>) -> i64 {
    cursor.map_or(0, |c| (c - 1).max(0))
}

/// Stream-wide settings.
pub struct Options {
    pub heartbeat: Duration,
    pub max_duration: Duration,
    /// Ends every open stream (server shutdown).
    pub shutdown: CancellationToken,
    /// When set, a resumed stream starts one event late (the `sse-resume-drops-event` defect).
    pub skip_first_on_resume: bool,
    /// When set, a cursor older than the retained log starts at the oldest retained event
    /// instead of being refused (the `expired-cursor-skips` defect).
    pub expired_cursor_skips: bool,
    /// When set, a stream the client closes before its end keeps its slot (the
    /// `stream-slot-leaked-on-close` defect).
    pub leak_slot_on_close: bool,
    /// When set, the heartbeat timer is never armed again after the opening heartbeat (the
    /// `heartbeats-stop` defect): an idle stream goes silent.
    pub heartbeats_stop: bool,
    /// When set, a stream whose store read fails goes silent until its deadline (the
    /// `outage-stalls-stream` defect).
    pub outage_stalls: bool,
}

/// Builds the response: 204 when the subject finished and nothing follows the cursor,
/// otherwise a streaming 200. `cursor` comes from [`parse_cursor`]; the slot is held for the
/// life of the body.
pub async fn respond(
    log: &EventLog,
    subject: Subject,
    cursor: Option<i64>,
    slot: StreamSlot,
    options: Options,
) -> Result<Response, SseError> {
    let mut subject = subject;
    let store = Arc::clone(log.store());
    let head = subject
        .head
        .take()
        .filter(|h| subject.known_live && h.cursor == cursor);
    let (wake, head_read) = match head {
        Some(head) => (head.wake, Some(head.read)),
        // Follow before reading so that an append racing with the first read still wakes us.
        None => (log.follow(&subject.stream), None),
    };
    let finished = !subject.known_live && (subject.finished)().await?;
    // The first read of the log also places the cursor. The log is gap-free and retention
    // drops a prefix of it, so its first retained event is the one after `purged_through`:
    // a batch read from just before the cursor whose first event is at most the one after
    // it proves the cursor is not expired. The log's bounds are read only when no batch
    // proves it (an empty or purged log), or for a subject that has finished.
    let first = match head_read {
        _ if finished => Vec::new(),
        Some(read) => read?,
        None => {
            log.read_after(&subject.stream, first_read_after(cursor), BATCH)
                .await?
        }
    };
    let placed = match (cursor, first.first()) {
        (Some(c), Some(f)) if f.event.seq <= c + 1 => Some(c),
        (None, Some(f)) => Some(f.event.seq - 1),
        _ => None,
    };
    let (mut start, mut pending) = match placed {
        Some(start) => {
            // The events after the cursor, possibly none: the stream starts with them
            // instead of reading again.
            let after = first.into_iter().filter(|f| f.event.seq > start).collect();
            (start, Some(after))
        }
        None => {
            let bounds = store.stream_bounds(&subject.stream).await?;
            let start = match cursor {
                Some(c) if c < bounds.purged_through => {
                    if !options.expired_cursor_skips {
                        return Err(SseError::CursorExpired);
                    }
                    // The defect: the events between the cursor and the retained log are
                    // skipped.
                    bounds.purged_through
                }
                Some(c) => c,
                None => bounds.purged_through,
            };
            if finished && !any_after(store.as_ref(), &subject, start, bounds.last_seq).await? {
                return Ok(StatusCode::NO_CONTENT.into_response());
            }
            (start, None)
        }
    };
    if cursor.is_some() && options.skip_first_on_resume {
        start += 1;
        pending = None;
    }
    let now = Instant::now();
    let state = Running {
        log: log.clone(),
        wake,
        stream: subject.stream,
        is_terminal: subject.is_terminal,
        finished: subject.finished,
        filter: subject.filter,
        on_delivered: subject.on_delivered,
        cursor: start,
        heartbeat_every: options.heartbeat,
        // The first heartbeat goes out at once when there is nothing to replay, so a client
        // (and a proxy) sees the stream is open without waiting a whole interval.
        next_heartbeat: now,
        deadline: now + options.max_duration,
        shutdown: options.shutdown,
        done: false,
        ended: false,
        leak_slot_on_close: options.leak_slot_on_close,
        heartbeats_stop: options.heartbeats_stop,
        outage_stalls: options.outage_stalls,
        slot: Some(slot),
        read_due: true,
        pending,
    };
    let body = futures_util::stream::unfold(state, |mut s| async move {
        let Some(chunk) = s.next_chunk().await else {
            s.mark_ended();
            return None;
        };
        Some((Ok::<_, std::convert::Infallible>(chunk), s))
    });
    let mut response = Response::new(Body::from_stream(body));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-store, no-transform"),
    );
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
}

/// Whether the log holds an event of the subject after `start` (up to `last_seq`).
async fn any_after(
    store: &dyn Store,
    subject: &Subject,
    start: i64,
    last_seq: i64,
) -> Result<bool, StoreError> {
    let Some(filter) = &subject.filter else {
        return Ok(last_seq > start);
    };
    let mut after = start;
    while after < last_seq {
        let events = store.events_after(&subject.stream, after, BATCH).await?;
        let Some(last) = events.last() else {
            break;
        };
        if events.iter().any(filter) {
            return Ok(true);
        }
        after = last.seq;
    }
    Ok(false)
}

/// The state of one open stream.
struct Running {
    log: EventLog,
    wake: watch::Receiver<i64>,
    stream: String,
    is_terminal: EventTest,
    finished: Finished,
    filter: Option<EventTest>,
    on_delivered: Option<Box<dyn Fn(i64) + Send + Sync>>,
    /// The last seq read (or the resume point): the next event read is `cursor + 1`. In a
    /// filtered view it also moves past events that were not sent.
    cursor: i64,
    heartbeat_every: Duration,
    next_heartbeat: Instant,
    deadline: Instant,
    shutdown: CancellationToken,
    done: bool,
    /// The body has yielded its last chunk (as opposed to being dropped by a client that
    /// went away).
    ended: bool,
    /// The `stream-slot-leaked-on-close` defect.
    leak_slot_on_close: bool,
    /// The `heartbeats-stop` defect.
    heartbeats_stop: bool,
    /// The `outage-stalls-stream` defect.
    outage_stalls: bool,
    /// Holds the principal's stream slot until the body is dropped, whether the stream
    /// ended or the client closed it.
    slot: Option<StreamSlot>,
    /// Whether the store may hold events not read yet. Always read when the log does not
    /// ignore foreign appends; with that defect, only after a wake-up (or a full batch).
    read_due: bool,
    /// What the stream's start read of the log after the cursor (possibly nothing), used
    /// in place of the first read.
    pending: Option<Vec<Arc<Framed>>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.leak_slot_on_close
            && !self.ended
            && let Some(slot) = self.slot.take()
        {
            // The defect: only the stream's own end gives the slot back.
            std::mem::forget(slot);
        }
    }
}

impl Running {
    /// The body has yielded its last chunk: the stream ended on its own.
    fn mark_ended(&mut self) {
        self.ended = true;
    }

    /// The next bytes to write, or `None` at the end of the stream.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if self.done || self.shutdown.is_cancelled() {
                return None;
            }
            if Instant::now() >= self.deadline {
                return Some(self.end("max_duration"));
            }
            let events = if let Some(pending) = self.pending.take() {
                pending
            } else if self.read_due || !self.log.ignores_foreign_appends() {
                match self.log.read_after(&self.stream, self.cursor, BATCH).await {
                    Ok(events) => events,
                    Err(e) if self.outage_stalls => {
                        // The defect: wait silently for the store, past every heartbeat.
                        tracing::warn!(error = %e, stream = %self.stream, "store read failed; waiting");
                        tokio::select! {
                            () = tokio::time::sleep_until(self.deadline) => {}
                            () = self.shutdown.cancelled() => return None,
                        }
                        self.next_heartbeat = self.deadline + self.heartbeat_every;
                        continue;
                    }
                    Err(e) => {
                        // SSE-7.23: the response ends at a frame boundary; the client resumes
                        // from its last id once the store is back.
                        tracing::warn!(error = %e, stream = %self.stream, "ending stream: store read failed");
                        return None;
                    }
                }
            } else {
                Vec::new()
            };
            self.read_due = !events.is_empty();
            if let Some(first) = events.first() {
                if first.event.seq != self.cursor + 1 {
                    // Retention purged events this client had not read yet.
                    return Some(self.end("lagging"));
                }
                // Frames are rendered once per event and shared by every stream that sends it.
                let mut chunk = Vec::new();
                for framed in &events {
                    let event = &framed.event;
                    self.cursor = event.seq;
                    if self.filter.as_ref().is_some_and(|keep| !keep(event)) {
                        continue;
                    }
                    chunk.extend_from_slice(&framed.frame);
                    if let Some(f) = &self.on_delivered {
                        f(event.seq);
                    }
                    if (self.is_terminal)(event) {
                        self.done = true;
                        break;
                    }
                }
                if chunk.is_empty() {
                    // Only events of others: the client has heard nothing, so its heartbeat
                    // is still due on time however busy the log is.
                    if Instant::now() >= self.next_heartbeat {
                        self.rearm_heartbeat();
                        return Some(Bytes::from_static(b": ping\n\n"));
                    }
                    continue;
                }
                self.rearm_heartbeat();
                return Some(Bytes::from(chunk));
            }
            if Instant::now() >= self.next_heartbeat {
                // Due already (the opening heartbeat): written now rather than through a timer,
                // which would round the deadline up to its next tick.
                self.rearm_heartbeat();
                return Some(Bytes::from_static(b": ping\n\n"));
            }
            tokio::select! {
                changed = self.wake.changed() => {
                    self.read_due = true;
                    if changed.is_err() {
                        // The waker went away; fall back to polling.
                        tokio::time::sleep(POLL).await;
                    }
                }
                () = tokio::time::sleep_until(self.next_heartbeat) => {
                    self.rearm_heartbeat();
                    return Some(Bytes::from_static(b": ping\n\n"));
                }
                () = tokio::time::sleep_until(self.deadline) => {}
                () = tokio::time::sleep(POLL) => {
                    if self.idle_and_finished().await {
                        return None;
                    }
                }
                () = self.shutdown.cancelled() => return None,
            }
        }
    }

    /// Schedules the next heartbeat one interval from now (with `heartbeats-stop`, never: past
    /// the stream's deadline).
    fn rearm_heartbeat(&mut self) {
        self.next_heartbeat = if self.heartbeats_stop {
            self.deadline + self.heartbeat_every
        } else {
            Instant::now() + self.heartbeat_every
        };
    }

    /// Whether the subject has finished with nothing left to read: the stream is over.
    async fn idle_and_finished(&self) -> bool {
        match (self.finished)().await {
            Ok(true) => {}
            _ => return false,
        }
        matches!(self.log.store().events_after(&self.stream, self.cursor, 1).await, Ok(events) if events.is_empty())
    }

    fn end(&mut self, reason: &str) -> Bytes {
        self.done = true;
        let data = json!({"reason": reason, "resume_after": self.cursor});
        Bytes::from(format!("event: stream.end\ndata: {data}\n\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::frame;

    #[test]
    fn frame_is_one_line_json_with_seq() {
        let event = Event {
            stream: "s".into(),
            seq: 7,
            kind: "stdout".into(),
            data: json!({"data": "a\nb"}),
            at: time::OffsetDateTime::UNIX_EPOCH,
        };
        assert_eq!(
            frame(&event),
            "id: 7\nevent: stdout\ndata: {\"data\":\"a\\nb\",\"seq\":7}\n\n"
        );
    }

    #[test]
    fn cursor_prefers_last_event_id() {
        let mut headers = HeaderMap::new();
        assert_eq!(parse_cursor(&headers, Some("3")).unwrap(), Some(3));
        headers.insert("last-event-id", HeaderValue::from_static("5"));
        assert_eq!(parse_cursor(&headers, Some("3")).unwrap(), Some(5));
        for bad in ["x", "+5", "-0", "5x", "0x10"] {
            headers.insert("last-event-id", HeaderValue::from_static(bad));
            assert!(
                matches!(parse_cursor(&headers, None), Err(SseError::BadCursor)),
                "{bad:?}"
            );
        }
        assert!(matches!(
            parse_cursor(&HeaderMap::new(), Some("+3")),
            Err(SseError::BadCursor)
        ));
    }

    #[test]
    fn slots_are_capped_and_released_on_drop() {
        let slots = Arc::new(StreamSlots::default());
        let a = slots.try_acquire("alice", 1).unwrap();
        assert!(slots.try_acquire("alice", 1).is_none());
        assert!(slots.try_acquire("bob", 1).is_some());
        drop(a);
        assert_eq!(slots.open("alice"), 0);
        assert!(slots.try_acquire("alice", 1).is_some());
    }

    mod over_a_store {
        use super::*;
        use http_body_util::BodyExt as _;

        use crate::store::SqliteStore;

        async fn log() -> EventLog {
            EventLog::new(Arc::new(SqliteStore::open(None).await.unwrap()))
        }

        fn subject(stream: &str, finished: bool) -> Subject {
            Subject {
                stream: stream.to_owned(),
                is_terminal: Box::new(|e| e.kind == "exit"),
                finished: Box::new(move || Box::pin(async move { Ok(finished) })),
                known_live: false,
                filter: None,
                on_delivered: None,
                head: None,
            }
        }

        fn options() -> Options {
            Options {
                heartbeat: Duration::from_secs(30),
                max_duration: Duration::from_secs(30),
                shutdown: CancellationToken::new(),
                skip_first_on_resume: false,
                expired_cursor_skips: false,
                leak_slot_on_close: false,
                heartbeats_stop: false,
                outage_stalls: false,
            }
        }

        fn slot() -> StreamSlot {
            Arc::new(StreamSlots::default())
                .try_acquire("p", 1)
                .unwrap()
        }

        async fn body(response: Response) -> String {
            let collected =
                tokio::time::timeout(Duration::from_secs(5), response.into_body().collect())
                    .await
                    .expect("the stream ends")
                    .unwrap();
            String::from_utf8(collected.to_bytes().to_vec()).unwrap()
        }

        #[tokio::test]
        async fn streams_every_event_and_ends_after_the_terminal_one() {
            let log = log().await;
            log.append("s", "stdout", &json!({"data": "a"}))
                .await
                .unwrap();
            log.append("s", "exit", &json!({"state": "exited"}))
                .await
                .unwrap();
            log.append("s", "stdout", &json!({"data": "after"}))
                .await
                .unwrap();
            let response = respond(&log, subject("s", false), None, slot(), options())
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            assert_eq!(
                body(response).await,
                "id: 1\nevent: stdout\ndata: {\"data\":\"a\",\"seq\":1}\n\n\
                 id: 2\nevent: exit\ndata: {\"seq\":2,\"state\":\"exited\"}\n\n"
            );
        }

        #[tokio::test]
        async fn a_live_append_wakes_the_stream() {
            let log = log().await;
            let response = respond(&log, subject("s", false), None, slot(), options())
                .await
                .unwrap();
            let writer = log.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                writer.append("s", "exit", &json!({})).await.unwrap();
            });
            // Idle at first: the opening heartbeat, then the event once it is appended.
            assert_eq!(
                body(response).await,
                ": ping\n\nid: 1\nevent: exit\ndata: {\"seq\":1}\n\n"
            );
        }

        #[tokio::test]
        async fn events_purged_under_an_open_stream_end_it_as_lagging() {
            let log = log().await;
            let response = respond(&log, subject("s", false), Some(0), slot(), options())
                .await
                .unwrap();
            // Another process appends (so this one's memory does not hold the events), and
            // retention runs before the stream reads them.
            let other = EventLog::new(Arc::clone(log.store()));
            for _ in 0..3 {
                other
                    .append("s", "stdout", &json!({"data": "x"}))
                    .await
                    .unwrap();
            }
            log.store().purge_events("s", 2).await.unwrap();
            assert_eq!(
                body(response).await,
                "event: stream.end\ndata: {\"reason\":\"lagging\",\"resume_after\":0}\n\n"
            );
        }

        /// Three output events and `exit`, the first two purged by retention.
        async fn purged_through_two() -> EventLog {
            let log = log().await;
            for _ in 0..3 {
                log.append("s", "stdout", &json!({"data": "x"}))
                    .await
                    .unwrap();
            }
            log.append("s", "exit", &json!({})).await.unwrap();
            log.store().purge_events("s", 2).await.unwrap();
            log
        }

        #[tokio::test]
        async fn cursors_below_retention_are_refused_and_fresh_streams_start_after_it() {
            let log = purged_through_two().await;
            let refused = respond(&log, subject("s", true), Some(1), slot(), options()).await;
            assert!(matches!(refused, Err(SseError::CursorExpired)));
            let fresh = respond(&log, subject("s", true), None, slot(), options())
                .await
                .unwrap();
            assert!(body(fresh).await.starts_with("id: 3\n"));
        }

        #[tokio::test]
        async fn a_live_subjects_first_read_places_the_cursor_at_the_retention_edge() {
            // Nobody followed the log while it was written, so every read is the store's.
            let log = purged_through_two().await;
            for expired in [0, 1] {
                let refused =
                    respond(&log, subject("s", false), Some(expired), slot(), options()).await;
                assert!(
                    matches!(refused, Err(SseError::CursorExpired)),
                    "cursor {expired}"
                );
            }
            for (cursor, first) in [
                (Some(2), "id: 3\n"),
                (Some(3), "id: 4\n"),
                (None, "id: 3\n"),
            ] {
                let response = respond(&log, subject("s", false), cursor, slot(), options())
                    .await
                    .unwrap();
                assert!(body(response).await.starts_with(first), "cursor {cursor:?}");
            }
        }

        #[tokio::test]
        async fn finished_with_nothing_after_the_cursor_is_204_and_frees_the_slot() {
            let log = log().await;
            log.append("s", "exit", &json!({})).await.unwrap();
            let slots = Arc::new(StreamSlots::default());
            let held = slots.try_acquire("p", 1).unwrap();
            let response = respond(&log, subject("s", true), Some(1), held, options())
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::NO_CONTENT);
            assert_eq!(slots.open("p"), 0);
        }

        /// A view of the events whose data has `"of": "a"`, ending after a's `exit`.
        fn only_a(finished: bool) -> Subject {
            let of_a = |e: &Event| e.data["of"] == "a";
            Subject {
                is_terminal: Box::new(move |e| e.kind == "exit" && of_a(e)),
                filter: Some(Box::new(of_a)),
                ..subject("s", finished)
            }
        }

        #[tokio::test]
        async fn a_filtered_view_skips_other_events_and_ends_after_its_terminal_one() {
            let log = log().await;
            for (kind, of) in [
                ("stdout", "b"),
                ("stdout", "a"),
                ("stdout", "b"),
                ("exit", "b"),
                ("exit", "a"),
                ("stdout", "a"),
            ] {
                log.append("s", kind, &json!({"of": of})).await.unwrap();
            }
            let response = respond(&log, only_a(false), None, slot(), options())
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            assert_eq!(
                body(response).await,
                "id: 2\nevent: stdout\ndata: {\"of\":\"a\",\"seq\":2}\n\n\
                 id: 5\nevent: exit\ndata: {\"of\":\"a\",\"seq\":5}\n\n"
            );
        }

        #[tokio::test]
        async fn a_finished_view_with_only_other_events_after_the_cursor_is_204() {
            let log = log().await;
            for of in ["a", "b", "b"] {
                log.append("s", "exit", &json!({"of": of})).await.unwrap();
            }
            let after_own = respond(&log, only_a(true), Some(1), slot(), options())
                .await
                .unwrap();
            assert_eq!(after_own.status(), StatusCode::NO_CONTENT);
            // The same cursor on the whole log still has events to send.
            let whole = respond(&log, subject("s", true), Some(1), slot(), options())
                .await
                .unwrap();
            assert_eq!(whole.status(), StatusCode::OK);
            let before_own = respond(&log, only_a(true), Some(0), slot(), options())
                .await
                .unwrap();
            assert_eq!(
                body(before_own).await,
                "id: 1\nevent: exit\ndata: {\"of\":\"a\",\"seq\":1}\n\n"
            );
        }

        #[tokio::test]
        async fn other_events_do_not_hold_back_heartbeats_and_a_resume_continues_after_them() {
            let log = log().await;
            let mut options = options();
            options.heartbeat = Duration::from_millis(100);
            options.max_duration = Duration::from_millis(1000);
            let response = respond(&log, only_a(false), None, slot(), options)
                .await
                .unwrap();
            let writer = log.clone();
            tokio::spawn(async move {
                for _ in 0..12 {
                    writer
                        .append("s", "stdout", &json!({"of": "b"}))
                        .await
                        .unwrap();
                    tokio::time::sleep(Duration::from_millis(40)).await;
                }
            });
            let text = body(response).await;
            assert!(!text.contains("id:"), "{text}");
            assert!(text.matches(": ping").count() >= 4, "{text}");
            // The resume point is past the other events read, not the (empty) view's start.
            assert!(
                text.ends_with(
                    "event: stream.end\ndata: {\"reason\":\"max_duration\",\"resume_after\":12}\n\n"
                ),
                "{text}"
            );
        }

        #[tokio::test]
        async fn max_duration_ends_with_the_resume_point() {
            let log = log().await;
            log.append("s", "stdout", &json!({"data": "x"}))
                .await
                .unwrap();
            let mut options = options();
            options.max_duration = Duration::from_millis(200);
            let response = respond(&log, subject("s", false), None, slot(), options)
                .await
                .unwrap();
            assert_eq!(
                body(response).await,
                "id: 1\nevent: stdout\ndata: {\"data\":\"x\",\"seq\":1}\n\n\
                 event: stream.end\ndata: {\"reason\":\"max_duration\",\"resume_after\":1}\n\n"
            );
        }

        /// The deliberate defects of this module change what the tests above observe.
        mod defects {
            use super::*;

            #[test]
            fn stream_quota_unenforced_never_refuses_a_slot() {
                let slots = Arc::new(StreamSlots::new(true));
                let _a = slots.try_acquire("alice", 1).unwrap();
                let _b = slots
                    .try_acquire("alice", 1)
                    .expect("the defect grants a slot beyond the limit");
                assert_eq!(slots.open("alice"), 2);
            }

            #[tokio::test]
            async fn stream_slot_leaked_on_close_keeps_a_closed_streams_slot() {
                let log = log().await;
                log.append("s", "stdout", &json!({"data": "x"}))
                    .await
                    .unwrap();
                for leak in [false, true] {
                    let slots = Arc::new(StreamSlots::default());
                    let mut options = options();
                    options.leak_slot_on_close = leak;
                    let held = slots.try_acquire("p", 1).unwrap();
                    let response = respond(&log, subject("s", false), None, held, options)
                        .await
                        .unwrap();
                    assert_eq!(slots.open("p"), 1);
                    // The client goes away before the stream ends.
                    drop(response);
                    assert_eq!(slots.open("p"), u32::from(leak), "leak: {leak}");
                }
                // A stream that ends on its own gives its slot back even with the defect.
                log.append("s", "exit", &json!({})).await.unwrap();
                let slots = Arc::new(StreamSlots::default());
                let mut options = options();
                options.leak_slot_on_close = true;
                let held = slots.try_acquire("p", 1).unwrap();
                let response = respond(&log, subject("s", false), None, held, options)
                    .await
                    .unwrap();
                assert!(
                    body(response)
                        .await
                        .ends_with("event: exit\ndata: {\"seq\":2}\n\n")
                );
                assert_eq!(slots.open("p"), 0);
            }

            #[tokio::test]
            async fn expired_cursor_skips_answers_from_the_retained_log() {
                let log = log().await;
                for _ in 0..3 {
                    log.append("s", "stdout", &json!({"data": "x"}))
                        .await
                        .unwrap();
                }
                log.append("s", "exit", &json!({})).await.unwrap();
                log.store().purge_events("s", 2).await.unwrap();
                let mut options = options();
                options.expired_cursor_skips = true;
                let skipped = respond(&log, subject("s", true), Some(1), slot(), options)
                    .await
                    .expect("the defect does not refuse the expired cursor");
                assert!(body(skipped).await.starts_with("id: 3\n"));
            }

            #[tokio::test]
            async fn foreign_appends_ignored_never_sees_another_processs_event() {
                let store: Arc<dyn crate::store::Store> =
                    Arc::new(SqliteStore::open(None).await.unwrap());
                for ignored in [false, true] {
                    let log = if ignored {
                        EventLog::ignoring_foreign_appends(Arc::clone(&store))
                    } else {
                        EventLog::new(Arc::clone(&store))
                    };
                    let stream = format!("s-{ignored}");
                    let response = respond(&log, subject(&stream, false), None, slot(), options())
                        .await
                        .unwrap();
                    // Appended behind the log's back, as by another server process.
                    let writer = Arc::clone(&store);
                    let behind = stream.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        writer
                            .append_event(&behind, "exit", &json!({}))
                            .await
                            .unwrap();
                    });
                    let read = tokio::time::timeout(
                        Duration::from_secs(3),
                        response.into_body().collect(),
                    )
                    .await;
                    assert_eq!(read.is_ok(), !ignored, "ignored: {ignored}");
                }
            }
        }
    }
}
