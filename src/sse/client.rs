//! Reads an SSE response body through the strict [`Parser`], stamping every item with the
//! time since the request was sent, until a stop condition, a cut, EOF or the deadline.

use std::time::{Duration, Instant};

use super::parser::{Item, Parser};
use crate::target::{BoundedBody, ReadError, ReadLimits, TooLarge};

/// An item and when it arrived, measured from the request's start.
#[derive(Debug, Clone)]
pub struct Timed {
    pub at: Duration,
    pub item: Item,
}

/// When to stop reading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// Only at EOF (or the deadline).
    Eof,
    /// After this many events.
    Events(usize),
    /// After an event of this type.
    Event(String),
}

/// Why reading ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndReason {
    /// The server closed the stream.
    Eof,
    /// The stop condition was met; the connection was dropped.
    Stopped,
    /// `cut_after` events arrived; the connection was dropped on purpose.
    Cut,
    /// The deadline passed first.
    Deadline,
    /// The body failed mid-stream (connection reset, decoding error).
    BodyError(String),
    /// The stream, one of its lines or one of its events crossed its cap
    /// (`--max-body-bytes`, `--max-event-bytes`); the connection was closed.
    TooLarge(TooLarge),
}

/// Everything observed on one stream.
#[derive(Debug, Clone)]
pub struct StreamRecord {
    pub items: Vec<Timed>,
    pub first_byte: Option<Duration>,
    /// Time to the first complete frame (event or comment).
    pub first_frame: Option<Duration>,
    /// Time to EOF, when the server ended the stream.
    pub eof: Option<Duration>,
    pub end: EndReason,
    /// The longest time between frames (or from the start to the first frame, or from the
    /// last frame to the end), for heartbeat checks.
    pub longest_silence: Duration,
    pub last_event_id: String,
    /// Bytes of the stream read.
    pub bytes: u64,
}

impl StreamRecord {
    pub fn events(&self) -> impl Iterator<Item = &super::parser::Event> {
        self.items.iter().filter_map(|t| match &t.item {
            Item::Event(e) => Some(e),
            _ => None,
        })
    }
}

/// Reads `response`'s body until `stop`, `cut_after` events, EOF or `deadline`, under the
/// caps of `limits`. `started` is when the request was sent.
pub async fn read_stream(
    response: reqwest::Response,
    limits: ReadLimits,
    started: Instant,
    stop: Stop,
    cut_after: Option<usize>,
    deadline: Duration,
) -> StreamRecord {
    read_stream_signalling(response, limits, started, stop, cut_after, deadline, None).await
}

/// [`read_stream`], and once `signal`'s count of events has arrived, sends on its channel
/// (and goes on reading): the caller injects a fault into the open stream's server.
pub async fn read_stream_signalling(
    response: reqwest::Response,
    limits: ReadLimits,
    started: Instant,
    stop: Stop,
    cut_after: Option<usize>,
    deadline: Duration,
    mut signal: Option<(usize, tokio::sync::oneshot::Sender<()>)>,
) -> StreamRecord {
    let mut parser = Parser::new();
    let mut record = StreamRecord {
        items: Vec::new(),
        first_byte: None,
        first_frame: None,
        eof: None,
        end: EndReason::Deadline,
        longest_silence: Duration::ZERO,
        last_event_id: String::new(),
        bytes: 0,
    };
    let mut events = 0usize;
    let mut last_frame = Duration::ZERO;
    let end_at = tokio::time::Instant::from_std(started + deadline);
    // The stream's lines and events are counted as they arrive, before the parser keeps them.
    let mut body = match BoundedBody::new(response, limits) {
        Ok(body) => body,
        Err(t) => {
            record.end = EndReason::TooLarge(t);
            return record;
        }
    };
    'read: loop {
        let next = tokio::time::timeout_at(end_at, body.next()).await;
        let chunk = match next {
            Err(_) => {
                record.end = EndReason::Deadline;
                break;
            }
            Ok(None) => {
                let at = started.elapsed();
                record.eof = Some(at);
                for item in parser.finish() {
                    record.items.push(Timed { at, item });
                }
                record.end = EndReason::Eof;
                break;
            }
            Ok(Some(Err(ReadError::TooLarge(t)))) => {
                record.end = EndReason::TooLarge(t);
                break;
            }
            Ok(Some(Err(e))) => {
                record.end = EndReason::BodyError(e.to_string());
                break;
            }
            Ok(Some(Ok(chunk))) => chunk,
        };
        let at = started.elapsed();
        record.first_byte.get_or_insert(at);
        for item in parser.feed(&chunk) {
            let frame = matches!(item, Item::Event(_) | Item::Comment(_));
            let is_event = matches!(&item, Item::Event(_));
            let stop_here = match (&item, &stop) {
                (Item::Event(_), Stop::Events(n)) => events + 1 >= *n,
                (Item::Event(e), Stop::Event(t)) => &e.event == t,
                _ => false,
            };
            if frame {
                record.first_frame.get_or_insert(at);
                record.longest_silence = record.longest_silence.max(at.saturating_sub(last_frame));
                last_frame = at;
            }
            record.items.push(Timed { at, item });
            if is_event {
                events += 1;
                if signal.as_ref().is_some_and(|(n, _)| events >= *n)
                    && let Some((_, tx)) = signal.take()
                {
                    let _ = tx.send(());
                }
                if cut_after.is_some_and(|n| events >= n) {
                    record.end = EndReason::Cut;
                    break 'read;
                }
                if stop_here {
                    record.end = EndReason::Stopped;
                    break 'read;
                }
            }
        }
    }
    record.bytes = body.read();
    let end = record.eof.unwrap_or_else(|| started.elapsed());
    record.longest_silence = record.longest_silence.max(end.saturating_sub(last_frame));
    // The parser may have read past a cut; the last id is that of the last item kept.
    record.last_event_id = record
        .items
        .iter()
        .rev()
        .find_map(|t| match &t.item {
            Item::Event(e) => Some(e.last_event_id.clone()),
            _ => None,
        })
        .unwrap_or_else(|| parser.last_event_id().to_owned());
    record
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// Serves one canned SSE response per connection, written in `chunks` with a pause
    /// between them; returns the base URL.
    pub(crate) async fn canned_server(chunks: Vec<&'static [u8]>, pause: Duration) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let chunks = chunks.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let _ = socket.read(&mut buf).await;
                    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n";
                    if socket.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    for chunk in chunks {
                        if socket.write_all(chunk).await.is_err() {
                            return;
                        }
                        let _ = socket.flush().await;
                        tokio::time::sleep(pause).await;
                    }
                    let _ = socket.shutdown().await;
                });
            }
        });
        format!("http://{addr}")
    }

    const CHUNKS: &[&[u8]] = &[
        b": ping\n\n",
        b"id: 1\nevent: stdout\ndata: {\"seq\":1,\"data\":\"a\"}\n\n",
        b"id: 2\nevent: std",
        b"out\r\ndata: {\"seq\":2,\"data\":\"b\"}\r",
        b"\n\r\nid: 3\nevent: exit\ndata: {\"seq\":3,\"state\":\"exited\"}\n\n",
    ];

    #[tokio::test]
    async fn reads_a_stream_with_timings() {
        let url = canned_server(CHUNKS.to_vec(), Duration::from_millis(20)).await;
        let client = crate::target::build_client(None).unwrap();
        let started = Instant::now();
        let response = client.get(&url).send().await.unwrap();
        let record = read_stream(
            response,
            ReadLimits::default(),
            started,
            Stop::Eof,
            None,
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(record.end, EndReason::Eof);
        let events: Vec<(&str, Option<&str>)> = record
            .events()
            .map(|e| (e.event.as_str(), e.id.as_deref()))
            .collect();
        assert_eq!(
            events,
            vec![
                ("stdout", Some("1")),
                ("stdout", Some("2")),
                ("exit", Some("3"))
            ]
        );
        assert!(matches!(&record.items[0].item, Item::Comment(c) if c == "ping"));
        let first = record.first_frame.unwrap();
        let eof = record.eof.unwrap();
        assert!(
            first <= eof && eof >= Duration::from_millis(80),
            "first {first:?} eof {eof:?}"
        );
        assert_eq!(record.last_event_id, "3");
    }

    #[tokio::test]
    async fn stops_at_an_event_type_and_cuts() {
        let url = canned_server(CHUNKS.to_vec(), Duration::from_millis(5)).await;
        let client = crate::target::build_client(None).unwrap();
        let r = client.get(&url).send().await.unwrap();
        let record = read_stream(
            r,
            ReadLimits::default(),
            Instant::now(),
            Stop::Event("exit".into()),
            None,
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(record.end, EndReason::Stopped);
        let r = client.get(&url).send().await.unwrap();
        let record = read_stream(
            r,
            ReadLimits::default(),
            Instant::now(),
            Stop::Eof,
            Some(2),
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(record.end, EndReason::Cut);
        assert_eq!(record.events().count(), 2);
        assert_eq!(record.last_event_id, "2");
    }

    #[tokio::test]
    async fn deadline_ends_a_silent_stream() {
        let url = canned_server(vec![b": ping\n\n"], Duration::from_secs(5)).await;
        let r = crate::target::build_client(None)
            .unwrap()
            .get(&url)
            .send()
            .await
            .unwrap();
        let record = read_stream(
            r,
            ReadLimits::default(),
            Instant::now(),
            Stop::Eof,
            None,
            Duration::from_millis(300),
        )
        .await;
        assert_eq!(record.end, EndReason::Deadline);
        assert!(
            record.longest_silence >= Duration::from_millis(250),
            "{:?}",
            record.longest_silence
        );
    }

    #[cfg(feature = "interop")]
    #[tokio::test]
    async fn eventsource_client_sees_the_same_events() {
        let url = canned_server(CHUNKS.to_vec(), Duration::from_millis(5)).await;
        let seen = crate::sse::interop::consume(
            url,
            ReadLimits::default(),
            None,
            None,
            Stop::Eof,
            None,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        let seen: Vec<(&str, Option<&str>)> = seen
            .iter()
            .map(|(t, id)| (t.as_str(), id.as_deref()))
            .collect();
        assert_eq!(
            seen,
            vec![
                ("stdout", Some("1")),
                ("stdout", Some("2")),
                ("exit", Some("3"))
            ]
        );
    }
}
