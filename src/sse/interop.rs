//! Interoperability probe: consumes a stream with the `eventsource-client` crate, an
//! ordinary SSE client, so that a stream the strict parser accepts is also one a popular
//! client can read. Reconnection is off: the probe reads one connection, as the strict
//! client did, and under the same caps: its transport counts the stream's lines and events
//! with the runner's [`Meter`] and ends the stream at the first byte over a cap.

use std::time::Duration;

use bytes::Bytes;
use eventsource_client::{self as es, Client as _};
use futures_util::StreamExt as _;
use launchdarkly_sdk_transport::{
    ByteStream, HttpTransport, Request, Response, ResponseFuture, TransportError,
};

use super::Stop;
use crate::target::{Framing, Meter, ReadLimits};

/// A transport whose response bodies are read through a [`Meter`] of the run's caps.
#[derive(Clone)]
struct Capped<T> {
    inner: T,
    limits: ReadLimits,
}

impl<T: HttpTransport> HttpTransport for Capped<T> {
    fn request(&self, request: Request<Option<Bytes>>) -> ResponseFuture {
        let response = self.inner.request(request);
        let limits = self.limits;
        Box::pin(async move {
            let (parts, body) = response.await?.into_parts();
            let mut meter = Meter::body(limits, Framing::Sse);
            let body: ByteStream = Box::pin(body.map(move |chunk| {
                let chunk = chunk?;
                meter.take(&chunk).map_err(TransportError::new)?;
                Ok(chunk)
            }));
            Ok(Response::from_parts(parts, body))
        })
    }
}

/// What the probe saw: `(event type, id)` per event, in order.
pub type Seen = Vec<(String, Option<String>)>;

/// Reads `url` like the strict client does: until `stop`, `cut_after` events, EOF or
/// `deadline`, under the caps of `limits`.
pub async fn consume(
    url: String,
    limits: ReadLimits,
    bearer: Option<String>,
    last_event_id: Option<String>,
    stop: Stop,
    cut_after: Option<usize>,
    deadline: Duration,
) -> Result<Seen, String> {
    let transport = Capped {
        inner: launchdarkly_sdk_transport::HyperTransport::builder()
            .connect_timeout(Duration::from_secs(10))
            .build_http()
            .map_err(|e| format!("transport: {e}"))?,
        limits,
    };
    let mut builder = es::ClientBuilder::for_url(&url).map_err(|e| format!("url: {e:?}"))?;
    if let Some(token) = bearer {
        builder = builder
            .header("Authorization", &format!("Bearer {token}"))
            .map_err(|e| format!("header: {e:?}"))?;
    }
    if let Some(id) = last_event_id {
        builder = builder.last_event_id(id);
    }
    let client = builder
        .reconnect(es::ReconnectOptions::reconnect(false).build())
        .build_with_transport(transport);
    let mut stream = client.stream();
    let mut seen = Seen::new();
    let read = async {
        loop {
            match stream.next().await {
                None | Some(Err(es::Error::Eof)) => break,
                Some(Ok(es::SSE::Event(ev))) => {
                    let done = match &stop {
                        Stop::Eof => false,
                        Stop::Events(n) => seen.len() + 1 >= *n,
                        Stop::Event(t) => &ev.event_type == t,
                    };
                    seen.push((ev.event_type, ev.id));
                    if done || cut_after.is_some_and(|n| seen.len() >= n) {
                        break;
                    }
                }
                Some(Ok(es::SSE::Connected(_) | es::SSE::Comment(_))) => {}
                Some(Err(e)) => return Err(format!("eventsource-client: {e:?}")),
            }
        }
        Ok(())
    };
    match tokio::time::timeout(deadline, read).await {
        Ok(Ok(())) => Ok(seen),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(format!(
            "eventsource-client: no end within {}s after {} events",
            deadline.as_secs(),
            seen.len()
        )),
    }
}
