//! Throttling answers to a scenario's requests, honestly: a `429`, or a `503` with
//! `Retry-After` (what [`crate::target::throttle_of`] calls throttling), at a step that does
//! not name that status in its expectations is waited out and the request sent again; the
//! wait must fit in what the part's deadline and the scenario's wait budget (`--max-wait`)
//! leave. Each wait is a note in the transcript and counts in the scenario's record and the
//! run's consumption. A step that names the status (a quota or stream-limit check) sees the
//! answer as it is, and a throttle that cannot be waited out ends the scenario in ERROR with
//! why: the account's limit, not the target's conformance, decided it. A `429` without
//! `Retry-After` says "too many" but not for how long, which is also how a quota the target
//! miscounts answers: it is waited out twice (1 s, 2 s), and the third is judged as it is, so
//! that such a failure shows as the step's FAIL rather than as a wait.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::context::Ctx;
use crate::target::{MAX_ATTEMPTS, Throttle, throttle_of};

/// The sending of a request whose answer, a `429` without `Retry-After` each time, is judged
/// as it is: after waits of 1 s and 2 s.
const BARE_ATTEMPTS: u32 = 3;

/// What a deadline must still leave after a throttle wait: the request sent again needs a
/// moment too.
const AFTER_WAIT: Duration = Duration::from_secs(2);

/// The throttling a scenario waited out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Throttled {
    /// Requests sent again after a throttling answer.
    pub waits: u32,
    /// Time the scenario spent waiting (waits of a `parallel` group overlap: counted once).
    pub waited_ms: u64,
}

/// What to do with an answer.
pub(super) enum OnThrottle {
    /// Not a throttling answer, or one the step names: judge it as it is.
    Judge,
    /// Wait this long, then send the request again.
    Wait(Throttle),
    /// A throttling answer that cannot be waited out: the scenario ends in ERROR with this.
    GiveUp(String),
}

/// What a request of the running step may wait for: the statuses the step names, and what the
/// part's deadline and the wait budget leave. Taken when the step sends, so that the requests
/// of a `parallel` group, which wait at once, each decide alone.
#[derive(Debug, Clone)]
pub(super) struct Patience {
    names: Vec<u16>,
    /// Waits must end by then.
    until: Option<Instant>,
    /// What the wait budget leaves, and the whole budget (for the message).
    budget: Option<(Duration, Duration)>,
}

impl Patience {
    /// The answer `status` with `headers` to the `attempt`-th sending (from 1) of `what`
    /// (`POST /v1/sandboxes`), after `waited` already for it: to judge, to wait out, or
    /// beyond what may be waited.
    pub(super) fn on(
        &self,
        what: &str,
        status: u16,
        headers: &reqwest::header::HeaderMap,
        attempt: u32,
        waited: Duration,
    ) -> OnThrottle {
        let Some(t) = throttle_of(status, headers, attempt) else {
            return OnThrottle::Judge;
        };
        if self.names.contains(&status) {
            return OnThrottle::Judge;
        }
        // A 429 that does not say for how long may be a limit that will not lift (a quota
        // the target miscounts): waited out briefly, then judged as it is.
        if t.retry_after.is_none() && attempt >= BARE_ATTEMPTS {
            return OnThrottle::Judge;
        }
        if attempt >= MAX_ATTEMPTS {
            return OnThrottle::GiveUp(format!(
                "throttled: {what} was answered {} {attempt} times in a row",
                t.describe()
            ));
        }
        let secs = t.wait.as_secs_f64();
        if let Some(until) = self.until {
            let left = until.saturating_duration_since(Instant::now());
            if t.wait > left {
                return OnThrottle::GiveUp(format!(
                    "throttled: {what} was answered {}: a wait of {secs:.1}s is more than the deadline leaves ({:.1}s)",
                    t.describe(),
                    left.as_secs_f64()
                ));
            }
        }
        if let Some((left, budget)) = self.budget {
            let left = left.saturating_sub(waited);
            if t.wait > left {
                return OnThrottle::GiveUp(format!(
                    "throttled: {what} was answered {}: a wait of {secs:.1}s is more than the wait budget leaves ({:.1}s of --max-wait {}s)",
                    t.describe(),
                    left.as_secs_f64(),
                    budget.as_secs()
                ));
            }
        }
        OnThrottle::Wait(t)
    }
}

impl Ctx<'_> {
    /// What the running step's requests may wait for now.
    pub(super) fn patience(&self) -> Patience {
        Patience {
            names: self.names.clone(),
            until: self
                .deadline
                .map(|d| d.checked_sub(AFTER_WAIT).unwrap_or(d)),
            budget: self
                .target
                .wait_budget
                .map(|b| (b.saturating_sub(self.throttled_for), b)),
        }
    }

    /// Whether the answer to the `attempt`-th sending of `what` is a throttling answer to
    /// wait out (see [`Patience::on`]).
    pub(super) fn throttle(
        &self,
        what: &str,
        status: u16,
        headers: &reqwest::header::HeaderMap,
        attempt: u32,
    ) -> OnThrottle {
        self.patience()
            .on(what, status, headers, attempt, Duration::ZERO)
    }

    /// Counts `waited` against the wait budget: the time the scenario spent waiting (the
    /// waits of a `parallel` group overlap, and count as the longest of them).
    pub(super) fn spent_waiting(&mut self, waited: Duration) {
        self.throttled_for += waited;
    }

    /// Records a wait for one request: a note, the scenario's count, the run's consumption.
    pub(super) fn record_wait(&mut self, label: &str, what: &str, t: &Throttle) {
        self.throttle_waits += 1;
        self.target.usage.throttled(t.status, t.wait);
        self.note(format!(
            "{label}: throttled: {what} was answered {}; waiting {:.1}s, then sending it again (wait {} of the scenario)",
            t.describe(),
            t.wait.as_secs_f64(),
            self.throttle_waits
        ));
    }

    /// The scenario's throttling so far.
    pub(super) fn throttled(&self) -> Throttled {
        Throttled {
            waits: self.throttle_waits,
            waited_ms: u64::try_from(self.throttled_for.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// For a single request: [`Ctx::throttle`], then the wait recorded and waited.
    /// `Ok(true)` to send again, `Ok(false)` to judge the answer, `Err` to give up.
    pub(super) async fn wait_out(
        &mut self,
        label: &str,
        what: &str,
        status: u16,
        headers: &reqwest::header::HeaderMap,
        attempt: u32,
    ) -> Result<bool, String> {
        match self.throttle(what, status, headers, attempt) {
            OnThrottle::Judge => Ok(false),
            OnThrottle::GiveUp(reason) => Err(reason),
            OnThrottle::Wait(t) => {
                self.spent_waiting(t.wait);
                self.record_wait(label, what, &t);
                tokio::time::sleep(t.wait).await;
                Ok(true)
            }
        }
    }
}
