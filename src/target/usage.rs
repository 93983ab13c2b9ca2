//! What a run consumed of the target's account, as the runner saw it: requests sent, bytes
//! sent and received, throttling answers waited out, sandboxes and sessions created, and the
//! sandbox-seconds held. One [`Usage`] is shared by a target and every deployment started for
//! one of its scenarios; the receipt reports its [`Consumption`].
//!
//! Sandbox-seconds are what the runner observed: a sandbox is held from the answer that
//! created it to the first answer that showed it gone (its delete answered 2xx or 404, or any
//! request for it answered 404), or else to the end of the run. A sandbox that ends by itself
//! (a timeout) is counted until the runner next looks: an upper bound of what a platform bills.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The run's account of what it consumed.
#[derive(Debug, Default)]
pub struct Usage {
    requests: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    sessions_created: AtomicU64,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    /// Sandboxes held now, by path, with when each was created.
    live: BTreeMap<String, Instant>,
    created: u64,
    /// Sandbox-time of those that ended.
    ended: Duration,
    /// The most held at once.
    peak: u64,
    throttles: Vec<ThrottleWait>,
}

/// One throttling answer the run waited out.
#[derive(Debug, Clone, Copy)]
struct ThrottleWait {
    status: u16,
    waited: Duration,
}

/// What a run consumed, as the receipt records it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Consumption {
    /// Sandboxes the target answered as created (the profile recognised them in its answers;
    /// an MCP server's creates by the handles its tools returned).
    pub sandboxes_created: u64,
    /// Sessions the target answered as created.
    pub sessions_created: u64,
    /// The most sandboxes the run held at once, as it observed them.
    pub peak_sandboxes: u64,
    /// Sandbox-seconds held: from each create's answer to the first answer that showed the
    /// sandbox gone, or the end of the run (an upper bound of what is billed).
    pub sandbox_seconds: f64,
    /// HTTP requests and streams sent to the target, retries and the runner's own sweeps
    /// included.
    pub requests: u64,
    /// Request bodies sent.
    pub bytes_sent: u64,
    /// Response bodies received (what was read of them).
    pub bytes_received: u64,
    /// Throttling answers (429, or 503 with `Retry-After`) waited out before sending again.
    pub throttles: Throttles,
    /// The run's account limits, as given.
    pub limits: AccountLimits,
    /// The run stopped starting scenarios because `--max-sandbox-seconds` was reached.
    pub budget_ended: bool,
}

/// Throttling answers waited out, with the time spent waiting.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Throttles {
    pub waits: u64,
    pub waited_ms: u64,
    /// Waits per status (`"429"`, `"503"`).
    pub by_status: BTreeMap<String, u64>,
}

/// The account limits a run was given (`--max-sandboxes`, `--max-sandbox-seconds`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccountLimits {
    pub max_sandboxes: Option<u64>,
    pub max_sandbox_seconds: Option<u64>,
}

impl Consumption {
    /// What the shards of one run consumed together: their sums, the most any one of them
    /// held at once, the first's limits, and whether a budget ended any of them.
    pub fn of_shards<'a>(parts: impl IntoIterator<Item = &'a Consumption>) -> Consumption {
        let mut all = Consumption::default();
        for (i, c) in parts.into_iter().enumerate() {
            if i == 0 {
                all.limits = c.limits.clone();
            }
            all.sandboxes_created += c.sandboxes_created;
            all.sessions_created += c.sessions_created;
            all.peak_sandboxes = all.peak_sandboxes.max(c.peak_sandboxes);
            all.sandbox_seconds += c.sandbox_seconds;
            all.requests += c.requests;
            all.bytes_sent += c.bytes_sent;
            all.bytes_received += c.bytes_received;
            all.throttles.waits += c.throttles.waits;
            all.throttles.waited_ms += c.throttles.waited_ms;
            for (status, n) in &c.throttles.by_status {
                *all.throttles.by_status.entry(status.clone()).or_default() += n;
            }
            all.budget_ended |= c.budget_ended;
        }
        all
    }
}

impl Usage {
    /// A request sent with a body of `bytes`.
    pub fn sent(&self, bytes: u64) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Response body bytes read.
    pub fn received(&self, bytes: u64) {
        self.bytes_received.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A throttling answer with `status`, waited out for `waited`.
    pub fn throttled(&self, status: u16, waited: Duration) {
        self.held
            .lock()
            .expect("usage lock")
            .throttles
            .push(ThrottleWait { status, waited });
    }

    /// A sandbox at `path` was answered as created.
    pub fn sandbox_created(&self, path: &str) {
        let mut held = self.held.lock().expect("usage lock");
        if held.live.contains_key(path) {
            return;
        }
        held.created += 1;
        held.live.insert(path.to_owned(), Instant::now());
        held.peak = held.peak.max(held.live.len() as u64);
    }

    /// A session was answered as created.
    pub fn session_created(&self) {
        self.sessions_created.fetch_add(1, Ordering::Relaxed);
    }

    /// The object at `path` was seen gone: if it is a sandbox the run holds, it ends now.
    pub fn gone(&self, path: &str) {
        let mut held = self.held.lock().expect("usage lock");
        if let Some(since) = held.live.remove(path) {
            held.ended += since.elapsed();
        }
    }

    /// Sandboxes held now.
    pub fn holding(&self) -> u64 {
        self.held.lock().expect("usage lock").live.len() as u64
    }

    /// Sandbox-seconds held so far, those still held up to now.
    pub fn sandbox_seconds(&self) -> f64 {
        let held = self.held.lock().expect("usage lock");
        let now = Instant::now();
        let live: Duration = held.live.values().map(|since| now - *since).sum();
        (held.ended + live).as_secs_f64()
    }

    /// What was consumed so far; the sandboxes still held count up to now.
    pub fn consumption(&self, limits: AccountLimits, budget_ended: bool) -> Consumption {
        let held = self.held.lock().expect("usage lock");
        let mut throttles = Throttles::default();
        for t in &held.throttles {
            throttles.waits += 1;
            throttles.waited_ms += u64::try_from(t.waited.as_millis()).unwrap_or(u64::MAX);
            *throttles.by_status.entry(t.status.to_string()).or_default() += 1;
        }
        let now = Instant::now();
        let live: Duration = held.live.values().map(|since| now - *since).sum();
        Consumption {
            sandboxes_created: held.created,
            sessions_created: self.sessions_created.load(Ordering::Relaxed),
            peak_sandboxes: held.peak,
            // Milliseconds are as fine as the evidence needs.
            sandbox_seconds: ((held.ended + live).as_millis() as f64) / 1000.0,
            requests: self.requests.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            throttles,
            limits,
            budget_ended,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandboxes_are_held_from_their_create_to_their_end() {
        let usage = Usage::default();
        usage.sandbox_created("/v1/sandboxes/a");
        usage.sandbox_created("/v1/sandboxes/a");
        usage.sandbox_created("/v1/sandboxes/b");
        usage.session_created();
        assert_eq!(usage.holding(), 2);
        std::thread::sleep(Duration::from_millis(30));
        usage.gone("/v1/sandboxes/a");
        usage.gone("/v1/sandboxes/unknown");
        assert_eq!(usage.holding(), 1);
        usage.sent(10);
        usage.received(20);
        usage.throttled(429, Duration::from_millis(1500));
        usage.throttled(503, Duration::from_millis(500));
        usage.throttled(429, Duration::from_millis(1000));
        let c = usage.consumption(AccountLimits::default(), false);
        assert_eq!(
            (c.sandboxes_created, c.sessions_created, c.peak_sandboxes),
            (2, 1, 2)
        );
        assert!(c.sandbox_seconds >= 0.06, "{}", c.sandbox_seconds);
        assert_eq!((c.requests, c.bytes_sent, c.bytes_received), (1, 10, 20));
        assert_eq!((c.throttles.waits, c.throttles.waited_ms), (3, 3000));
        assert_eq!(c.throttles.by_status["429"], 2);
    }
}
