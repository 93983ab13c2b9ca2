//! The clock the server keeps time by: real time plus an offset that only moves forward.
//!
//! Every timestamp the server writes ([`now`]) and every deadline it keeps as
//! an instant ([`instant`]: worker leases) is read from this clock, so retention of events,
//! results and process output, sandbox time-outs and lease expiry all fall due by it. The
//! offset is zero unless the test control `POST /v1/test/clock` (TC-9.12) moves it, so that
//! a scenario can see a minute of retention pass without waiting a minute. Moving it wakes
//! the background passes that act on expiry ([`subscribe`]), so that their effect follows at
//! once.
//!
//! The clock is one per server process: a deployment of several processes on one database
//! moves each process's clock on its own (the test control acts on the process it reaches).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use time::OffsetDateTime;
use tokio::sync::watch;

/// Milliseconds added to real time.
static OFFSET_MS: AtomicU64 = AtomicU64::new(0);

/// Bumped on every advance, so that waiting passes wake.
fn moved() -> &'static watch::Sender<u64> {
    static MOVED: OnceLock<watch::Sender<u64>> = OnceLock::new();
    MOVED.get_or_init(|| watch::Sender::new(0))
}

/// The current time on the clock (real time unless the test clock moved it forward, TC-9.12),
/// truncated to whole microseconds so that it survives every store unchanged.
pub fn now() -> OffsetDateTime {
    let t = OffsetDateTime::now_utc() + offset();
    t.replace_nanosecond(t.nanosecond() / 1000 * 1000)
        .unwrap_or(t)
}

/// How far ahead of real time the clock is.
pub fn offset() -> Duration {
    Duration::from_millis(OFFSET_MS.load(Ordering::Acquire))
}

/// The current instant on the clock, for deadlines kept as instants (leases): a deadline set
/// from it falls due when the clock moves past it.
pub fn instant() -> tokio::time::Instant {
    tokio::time::Instant::now() + offset()
}

/// Moves the clock forward by `by` (saturating at `u64::MAX` ms) and wakes every waiting
/// pass; answers the new offset.
pub fn advance(by: Duration) -> Duration {
    let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
    let _ = OFFSET_MS.fetch_update(Ordering::AcqRel, Ordering::Acquire, |o| {
        Some(o.saturating_add(ms))
    });
    moved().send_modify(|n| *n = n.wrapping_add(1));
    offset()
}

/// A receiver that sees every later advance (`changed()` resolves after one).
pub fn subscribe() -> watch::Receiver<u64> {
    moved().subscribe()
}
