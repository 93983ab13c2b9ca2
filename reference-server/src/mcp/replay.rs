//! The events of `sandspec mcp --listen`'s event streams, kept so that a client whose stream
//! was cut can resume it with `Last-Event-ID` and get what it missed, the answer to its request
//! included, whenever that answer came. (rmcp's own cache of a request's stream is dropped the
//! moment the answer is sent, so a client that reconnects later would get nothing.)
//!
//! An event's ID is `<stream>#<n>`; a request's stream has an ID of its own, and each session's
//! standalone stream is `<session>:common`. A stream belongs to the session that it was first
//! sent to ([`Replay::bind`]); a session may resume only its own. The log is bounded: at most
//! [`MAX_EVENTS`] events a stream and [`MAX_STREAMS`] streams (the oldest go first), and a
//! session's streams go with it.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use rmcp::transport::streamable_http_server::session::{
    EventStore, EventStoreError, EventStream, ServerSseMessage, SessionId,
};

/// Events kept of one stream; older ones cannot be resumed from.
pub const MAX_EVENTS: usize = 256;
/// Streams kept; the oldest is forgotten first.
pub const MAX_STREAMS: usize = 4096;

/// One stream's events.
#[derive(Default)]
struct Log {
    /// The session it belongs to, once known.
    session: Option<SessionId>,
    /// `(n, event)`, oldest first.
    events: VecDeque<(u64, ServerSseMessage)>,
    next: u64,
}

#[derive(Default)]
struct Logs {
    streams: HashMap<String, Log>,
    /// Stream IDs, oldest first.
    order: VecDeque<String>,
}

/// The event log shared by every session of one server.
#[derive(Default)]
pub struct Replay {
    logs: Mutex<Logs>,
}

/// A stream's ID and an event's number, from an event ID.
fn parse(event_id: &str) -> Option<(&str, u64)> {
    let (stream, n) = event_id.rsplit_once('#')?;
    Some((stream, n.parse().ok()?))
}

/// What a `Last-Event-ID` names, for the session that sends it.
#[derive(Debug, PartialEq, Eq)]
pub enum Resumable {
    /// A stream of this session that is still kept.
    Own,
    /// A stream of another session: never replayed to this one.
    Foreign,
    /// No stream this server keeps (an ID it never gave, or one long forgotten).
    Unknown,
}

impl Replay {
    fn logs(&self) -> std::sync::MutexGuard<'_, Logs> {
        self.logs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes that the stream of `event_id` is `session`'s, when it is not bound yet.
    pub fn bind(&self, event_id: &str, session: &SessionId) {
        let Some((stream, _)) = parse(event_id) else {
            return;
        };
        if let Some(log) = self.logs().streams.get_mut(stream) {
            log.session.get_or_insert_with(|| session.clone());
        }
    }

    /// Whether `session` may resume from `event_id`.
    pub fn resumable(&self, event_id: &str, session: &SessionId) -> Resumable {
        let Some((stream, _)) = parse(event_id) else {
            return Resumable::Unknown;
        };
        let logs = self.logs();
        let Some(log) = logs.streams.get(stream) else {
            return Resumable::Unknown;
        };
        let common = stream.strip_suffix(":common") == Some(session.as_ref());
        match &log.session {
            _ if common => Resumable::Own,
            Some(owner) if owner == session => Resumable::Own,
            _ => Resumable::Foreign,
        }
    }

    /// Forgets every stream of `session`.
    pub fn forget(&self, session: &SessionId) {
        let common = format!("{session}:common");
        let mut logs = self.logs();
        logs.streams
            .retain(|id, log| *id != common && log.session.as_ref() != Some(session));
        let Logs { streams, order } = &mut *logs;
        order.retain(|id| streams.contains_key(id));
    }
}

#[async_trait::async_trait]
impl EventStore for Replay {
    async fn store_event(
        &self,
        stream_id: &str,
        event: &ServerSseMessage,
    ) -> Result<String, EventStoreError> {
        let mut logs = self.logs();
        if !logs.streams.contains_key(stream_id) {
            if logs.order.len() >= MAX_STREAMS
                && let Some(oldest) = logs.order.pop_front()
            {
                logs.streams.remove(&oldest);
            }
            logs.order.push_back(stream_id.to_owned());
        }
        let log = logs.streams.entry(stream_id.to_owned()).or_default();
        let n = log.next;
        log.next += 1;
        let id = format!("{stream_id}#{n}");
        let mut kept = event.clone();
        kept.event_id = Some(id.clone());
        if log.events.len() >= MAX_EVENTS {
            log.events.pop_front();
        }
        log.events.push_back((n, kept));
        Ok(id)
    }

    /// The events of the stream after `last_event_id`; an error when that event is not kept
    /// (a gap would be replayed as if nothing were missing).
    async fn replay_events_after(
        &self,
        last_event_id: &str,
    ) -> Result<EventStream, EventStoreError> {
        let (stream, after) = parse(last_event_id).ok_or("not an event ID of this server")?;
        let logs = self.logs();
        let log = logs.streams.get(stream).ok_or("no such event stream")?;
        if log
            .events
            .front()
            .is_none_or(|(first, _)| *first > after + 1)
        {
            return Err("the event is no longer kept".into());
        }
        let rest: Vec<ServerSseMessage> = log
            .events
            .iter()
            .filter(|(n, _)| *n > after)
            .map(|(_, e)| e.clone())
            .collect();
        Ok(Box::pin(futures_util::stream::iter(rest)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt as _;

    fn event(text: &str) -> ServerSseMessage {
        let mut e = ServerSseMessage::default();
        e.event_id = Some(text.to_owned());
        e
    }

    async fn replayed(replay: &Replay, after: &str) -> Vec<String> {
        replay
            .replay_events_after(after)
            .await
            .unwrap()
            .map(|e| e.event_id.unwrap())
            .collect()
            .await
    }

    #[tokio::test]
    async fn a_stream_resumes_after_the_last_event_seen_and_only_in_its_session() {
        let replay = Replay::default();
        let (alice, bob): (SessionId, SessionId) = ("alice".into(), "bob".into());
        let first = replay.store_event("s1", &event("x")).await.unwrap();
        let second = replay.store_event("s1", &event("y")).await.unwrap();
        let third = replay.store_event("s1", &event("z")).await.unwrap();
        assert_eq!(
            [first.as_str(), second.as_str(), third.as_str()],
            ["s1#0", "s1#1", "s1#2"]
        );
        assert_eq!(
            replayed(&replay, &first).await,
            [second.clone(), third.clone()]
        );
        assert!(replayed(&replay, &third).await.is_empty());
        // Unbound, a request's stream is no one's yet.
        assert_eq!(replay.resumable(&first, &alice), Resumable::Foreign);
        replay.bind(&first, &alice);
        replay.bind(&first, &bob);
        assert_eq!(replay.resumable(&second, &alice), Resumable::Own);
        assert_eq!(replay.resumable(&second, &bob), Resumable::Foreign);
        let common = replay.store_event("bob:common", &event("n")).await.unwrap();
        assert_eq!(replay.resumable(&common, &bob), Resumable::Own);
        assert_eq!(replay.resumable(&common, &alice), Resumable::Foreign);
        for unknown in ["0", "s9#0", "s1", "s1#x"] {
            assert_eq!(
                replay.resumable(unknown, &alice),
                Resumable::Unknown,
                "{unknown}"
            );
        }
        replay.forget(&alice);
        assert_eq!(replay.resumable(&second, &alice), Resumable::Unknown);
        assert_eq!(replay.resumable(&common, &bob), Resumable::Own);
        assert!(replay.replay_events_after("s1#0").await.is_err());
    }

    #[tokio::test]
    async fn the_log_is_bounded() {
        let replay = Replay::default();
        let mut ids = Vec::new();
        for _ in 0..MAX_EVENTS + 2 {
            ids.push(replay.store_event("s", &event("e")).await.unwrap());
        }
        // The two oldest are gone: resuming after the first would skip the second.
        assert!(replay.replay_events_after(&ids[0]).await.is_err());
        assert_eq!(replayed(&replay, &ids[1]).await.len(), MAX_EVENTS);
        assert_eq!(replayed(&replay, &ids[2]).await.len(), MAX_EVENTS - 1);
        for i in 0..MAX_STREAMS {
            replay
                .store_event(&format!("t{i}"), &event("e"))
                .await
                .unwrap();
        }
        assert_eq!(replay.resumable(&ids[5], &"a".into()), Resumable::Unknown);
        assert_eq!(replay.logs().streams.len(), MAX_STREAMS);
    }
}
