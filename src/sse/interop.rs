//! Interoperability probe: consumes a stream with the `eventsource-client` crate, an
//! ordinary SSE client, so that a stream the strict parser accepts is also one a popular
//! client can read. Reconnection is off: the probe reads one connection, as the strict
//! client did.

use std::time::Duration;

use eventsource_client::{self as es, Client as _};
use futures_util::StreamExt as _;

use super::Stop;

/// What the probe saw: `(event type, id)` per event, in order.
pub type Seen = Vec<(String, Option<String>)>;

/// Reads `url` like the strict client does: until `stop`, `cut_after` events, EOF or
/// `deadline`.
pub async fn consume(
    url: String,
    bearer: Option<String>,
    last_event_id: Option<String>,
    stop: Stop,
    cut_after: Option<usize>,
    deadline: Duration,
) -> Result<Seen, String> {
    let transport = launchdarkly_sdk_transport::HyperTransport::builder()
        .connect_timeout(Duration::from_secs(10))
        .build_http()
        .map_err(|e| format!("transport: {e}"))?;
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
