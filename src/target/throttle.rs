//! Throttling answers: a `429`, or a `503` with `Retry-After`, is a target saying "not now":
//! the request was refused before anything was done with it (RFC 6585 §4: too many requests;
//! RFC 9110 §15.6.4: unable to handle the request; protocol ERR-1.6 and SUB-8.6: a `429`
//! creates nothing). Such an answer is waited out and the request sent again, whatever its
//! method; nothing else is (a `503` without `Retry-After`, any other status, a connection that
//! broke after the request went out, a timeout: the target may have acted). The engine decides
//! for a scenario's steps, which may expect such an answer ([`crate::engine`]); here is what
//! such an answer asks, and how the runner's own requests (sweeps, the capabilities) wait.

use std::time::{Duration, Instant};

use super::usage::Usage;

/// The shortest wait between two attempts, whatever `Retry-After` says: a target answering
/// `Retry-After: 0` for ever is not hammered.
pub const MIN_WAIT: Duration = Duration::from_millis(250);

/// The wait after a `429` without `Retry-After`, doubled with each attempt up to
/// [`MAX_DEFAULT_WAIT`].
pub const DEFAULT_WAIT: Duration = Duration::from_secs(1);
pub const MAX_DEFAULT_WAIT: Duration = Duration::from_secs(8);

/// How many times one request is sent at most.
pub const MAX_ATTEMPTS: u32 = 30;

/// How long the runner's own requests (a sweep's, the capabilities) wait out throttling in
/// all, per request.
pub const OWN_REQUEST_PATIENCE: Duration = Duration::from_secs(60);

/// A throttling answer and what it asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Throttle {
    pub status: u16,
    /// How long to wait before sending again.
    pub wait: Duration,
    /// The `Retry-After` value as sent, if one was.
    pub retry_after: Option<String>,
}

impl Throttle {
    /// `429 with Retry-After: 2`, `429 without Retry-After`.
    pub fn describe(&self) -> String {
        match &self.retry_after {
            Some(v) => format!("{} with Retry-After: {v}", self.status),
            None => format!("{} without Retry-After", self.status),
        }
    }
}

/// The throttling answer `status` and `headers` are, for the `attempt`-th sending (from 1) of
/// a request: a `429` (waiting what its `Retry-After` says, or [`DEFAULT_WAIT`] doubled per
/// attempt), or a `503` with a `Retry-After`. `None` for any other answer.
pub fn throttle_of(
    status: u16,
    headers: &reqwest::header::HeaderMap,
    attempt: u32,
) -> Option<Throttle> {
    let retry_after = headers
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_owned());
    let asked = retry_after.as_deref().and_then(retry_after_wait);
    let wait = match (status, asked) {
        (429 | 503, Some(wait)) => wait,
        (429, None) => {
            let doublings = attempt.saturating_sub(1).min(8);
            (DEFAULT_WAIT * 2u32.pow(doublings)).min(MAX_DEFAULT_WAIT)
        }
        _ => return None,
    };
    Some(Throttle {
        status,
        wait: wait.max(MIN_WAIT),
        retry_after,
    })
}

/// A `Retry-After` value: delta-seconds, or an HTTP-date (from now; a date past is no wait).
fn retry_after_wait(value: &str) -> Option<Duration> {
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let format = time::macros::format_description!(
        "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
    );
    let at = time::PrimitiveDateTime::parse(value, format)
        .ok()?
        .assume_utc();
    let from_now = at - time::OffsetDateTime::now_utc();
    Some(Duration::try_from(from_now).unwrap_or(Duration::ZERO))
}

/// Sends one of the runner's own requests (a sweep's, the capabilities), waiting out
/// throttling answers for at most [`OWN_REQUEST_PATIENCE`] in all; each sending is counted in
/// `usage`, and each wait. The last answer is returned as it is.
pub async fn send_patiently(
    builder: reqwest::RequestBuilder,
    usage: &Usage,
) -> reqwest::Result<reqwest::Response> {
    let (client, request) = builder.build_split();
    let request = request?;
    let body = request
        .body()
        .and_then(|b| b.as_bytes())
        .map_or(0, |b| b.len() as u64);
    let give_up = Instant::now() + OWN_REQUEST_PATIENCE;
    let mut attempt = 1;
    loop {
        let Some(again) = request.try_clone() else {
            // A streamed body cannot be sent twice: this answer is the one.
            usage.sent(body);
            return client.execute(request).await;
        };
        usage.sent(body);
        let response = client.execute(again).await?;
        let throttle = throttle_of(response.status().as_u16(), response.headers(), attempt);
        match throttle {
            Some(t) if attempt < MAX_ATTEMPTS && Instant::now() + t.wait <= give_up => {
                drop(response);
                usage.throttled(t.status, t.wait);
                tokio::time::sleep(t.wait).await;
                attempt += 1;
            }
            _ => return Ok(response),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(retry_after: Option<&str>) -> reqwest::header::HeaderMap {
        let mut h = reqwest::header::HeaderMap::new();
        if let Some(v) = retry_after {
            h.insert(reqwest::header::RETRY_AFTER, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn only_a_429_and_a_503_with_retry_after_are_throttling() {
        let t = throttle_of(429, &headers(Some("3")), 1).unwrap();
        assert_eq!(
            (t.wait, t.describe()),
            (Duration::from_secs(3), "429 with Retry-After: 3".to_owned())
        );
        let t = throttle_of(503, &headers(Some("1")), 1).unwrap();
        assert_eq!(t.wait, Duration::from_secs(1));
        assert_eq!(throttle_of(503, &headers(None), 1), None);
        for status in [200, 201, 400, 404, 409, 500, 502, 504] {
            assert_eq!(
                throttle_of(status, &headers(Some("1")), 1),
                None,
                "{status}"
            );
        }
        // No Retry-After: a second, doubled per attempt, at most eight.
        let waits: Vec<u64> = (1..=6)
            .map(|n| throttle_of(429, &headers(None), n).unwrap().wait.as_secs())
            .collect();
        assert_eq!(waits, [1, 2, 4, 8, 8, 8]);
        // Never less than the floor; a garbled value is as if none was sent.
        assert_eq!(
            throttle_of(429, &headers(Some("0")), 1).unwrap().wait,
            MIN_WAIT
        );
        assert_eq!(
            throttle_of(429, &headers(Some("soon")), 1).unwrap().wait,
            DEFAULT_WAIT
        );
        assert_eq!(throttle_of(503, &headers(Some("soon")), 1), None);
    }

    #[test]
    fn a_retry_after_date_is_a_wait_from_now() {
        let later = time::OffsetDateTime::now_utc() + time::Duration::seconds(30);
        let format = time::macros::format_description!(
            "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
        );
        let date = later.format(format).unwrap();
        let wait = retry_after_wait(&date).unwrap();
        assert!(
            wait > Duration::from_secs(25) && wait <= Duration::from_secs(30),
            "{wait:?}"
        );
        assert_eq!(
            retry_after_wait("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(Duration::ZERO)
        );
    }
}
