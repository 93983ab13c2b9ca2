//! A scenario's advertised waits, judged against the run's wait budget (`--max-wait`).
//!
//! A wait is a deadline the scenario derives from a number the target advertises (a poll
//! `within_s: retention.result_s + 5` waits out a retention; an `sse` step `within_s:
//! limits.max_stream_duration_s + 5` waits out a stream's maximum duration) or a pause it
//! takes itself (`sleep`). Deadlines written as plain numbers bound something that should
//! happen at once, and are not waits: they do not grow with the target's settings. A
//! scenario whose waits add up to more than the budget is skipped with the numbers, so that
//! a run against a deployment with hour-long retentions ends in minutes, saying what it left
//! out.

use std::time::Duration;

use super::vars::Vars;
use crate::scenario::Scenario;
use crate::target::Capabilities;

/// How the skip reason of a scenario over the budget begins.
pub const OVER_BUDGET: &str = "over the wait budget";

/// The default of `--max-wait`.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(120);

/// One wait of a scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct Wait {
    /// Where: `steps[3] poll`, `cleanup[0] sleep`.
    pub step: String,
    /// What it waits for, with the numbers: `retention.result_s + 5 = 3605 s`.
    pub what: String,
    pub seconds: u64,
}

/// Every advertised wait of `scenario` against a target with these capabilities, in order.
/// A deadline over a number the target does not advertise is left out (the step fails when
/// it runs). An `advance_clock` is a wait unless `clock_movable` (the runner moves the
/// target's clock instead, TC-9.12).
pub fn waits(scenario: &Scenario, caps: &Capabilities, clock_movable: bool) -> Vec<Wait> {
    let vars = Vars::new("", caps, "");
    let mut out = Vec::new();
    let steps = scenario
        .steps
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("steps[{i}]"), s))
        .chain(
            scenario
                .cleanup
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("cleanup[{i}]"), s)),
        );
    for (at, step) in steps {
        if let Some((what, seconds)) = step.advertised_wait(&vars, clock_movable) {
            out.push(Wait {
                step: format!("{at} {}", step.kind()),
                what,
                seconds,
            });
        }
    }
    out
}

/// How long `waits` take together, in seconds: what the wait budget is judged against, and
/// the order in which the runner starts scenarios (longest first).
pub fn total_s(waits: &[Wait]) -> u64 {
    waits.iter().map(|w| w.seconds).sum()
}

/// Why the scenario is over `budget`, if it is: the total and each wait that made it.
pub fn over_budget(
    scenario: &Scenario,
    caps: &Capabilities,
    clock_movable: bool,
    budget: Duration,
) -> Option<String> {
    let waits = waits(scenario, caps, clock_movable);
    let total = total_s(&waits);
    if total <= budget.as_secs() {
        return None;
    }
    let each: Vec<String> = waits
        .iter()
        .filter(|w| w.seconds > 0)
        .map(|w| format!("{}: {}", w.step, w.what))
        .collect();
    Some(format!(
        "{OVER_BUDGET}: advertised waits of {total} s exceed --max-wait {} ({})",
        format_budget(Some(budget)),
        each.join("; ")
    ))
}

/// Parses `--max-wait`: `none` (wait everything out), or a number with a unit, `90s`, `2m`,
/// `1h`.
pub fn parse_max_wait(s: &str) -> Result<Option<Duration>, String> {
    if s == "none" {
        return Ok(None);
    }
    let bad = || format!("bad wait budget `{s}` (e.g. 90s, 2m, 1h, or none)");
    let split = s.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let secs = match unit {
        "s" => n,
        "m" => n.checked_mul(60).ok_or_else(bad)?,
        "h" => n.checked_mul(3600).ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    Ok(Some(Duration::from_secs(secs)))
}

/// A budget as the user would write it: `2m`, `90s`, `none`.
pub fn format_budget(budget: Option<Duration>) -> String {
    match budget.map(|b| b.as_secs()) {
        None => "none".to_owned(),
        Some(s) if s % 3600 == 0 && s > 0 => format!("{}h", s / 3600),
        Some(s) if s % 60 == 0 && s > 0 => format!("{}m", s / 60),
        Some(s) => format!("{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn caps(retention_s: i64, stream_s: i64) -> Capabilities {
        Capabilities::from_json(serde_json::json!({
            "providers": [{"name": "local", "default": true}],
            "features": [],
            "limits": {"max_stream_duration_s": stream_s, "heartbeat_interval_s": 1},
            "retention": {"result_s": retention_s}
        }))
        .unwrap()
    }

    fn scenario(steps: &str) -> Scenario {
        let text = format!(
            "id: WAIT-TEST-001\ntitle: t\nclauses: [SSE-7.16]\nlevel: SHOULD\nsteps:\n{steps}"
        );
        crate::scenario::parse_str(Path::new("t.yaml"), &text).unwrap()
    }

    #[test]
    fn advertised_deadlines_and_sleeps_are_waits_literal_deadlines_are_not() {
        let s = scenario(
            "  - poll:
      within_s: 10
      request: {method: GET, path: /v1/sandboxes}
  - poll:
      within_s: retention.result_s + 5
      request: {method: GET, path: /v1/sandboxes}
  - sleep: {ms: 1500}
  - sse:
      path: /v1/sandboxes
      within_s: limits.max_stream_duration_s + 5
      expect_heartbeat_within_s: limits.heartbeat_interval_s * 2
  - sse: {path: /v1/sandboxes, within_s: 30}
",
        );
        let fast = waits(&s, &caps(3, 6), false);
        assert_eq!(
            fast,
            vec![
                Wait {
                    step: "steps[1] poll".into(),
                    what: "within_s retention.result_s + 5 = 8 s".into(),
                    seconds: 8
                },
                Wait {
                    step: "steps[2] sleep".into(),
                    what: "sleep 1500 ms".into(),
                    seconds: 2
                },
                Wait {
                    step: "steps[3] sse".into(),
                    what: "within_s limits.max_stream_duration_s + 5 = 11 s".into(),
                    seconds: 11
                },
            ]
        );
        assert_eq!(over_budget(&s, &caps(3, 6), false, DEFAULT_MAX_WAIT), None);
        let reason = over_budget(&s, &caps(3600, 300), false, DEFAULT_MAX_WAIT).unwrap();
        assert_eq!(
            reason,
            "over the wait budget: advertised waits of 3912 s exceed --max-wait 2m \
             (steps[1] poll: within_s retention.result_s + 5 = 3605 s; steps[2] sleep: sleep \
             1500 ms; steps[3] sse: within_s limits.max_stream_duration_s + 5 = 305 s)"
        );
        // Exactly at the budget still runs.
        assert_eq!(
            over_budget(&s, &caps(3600, 300), false, Duration::from_secs(3912)),
            None
        );
    }

    #[test]
    fn an_unadvertised_number_is_no_wait() {
        let s = scenario(
            "  - poll:
      within_s: retention.events_s + 5
      request: {method: GET, path: /v1/sandboxes}
",
        );
        assert!(waits(&s, &caps(3600, 300), false).is_empty());
    }

    /// Time passing is a wait where the runner waits it out, and none where it moves the
    /// target's clock instead.
    #[test]
    fn advance_clock_is_a_wait_unless_the_clock_moves() {
        let s = scenario("  - advance_clock: {s: retention.result_s + 1}\n");
        assert_eq!(
            waits(&s, &caps(3600, 300), false),
            vec![Wait {
                step: "steps[0] advance_clock".into(),
                what: "advance_clock retention.result_s + 1 = 3601 s".into(),
                seconds: 3601
            }]
        );
        assert!(over_budget(&s, &caps(3600, 300), false, DEFAULT_MAX_WAIT).is_some());
        assert!(waits(&s, &caps(3600, 300), true).is_empty());
        assert_eq!(
            over_budget(&s, &caps(3600, 300), true, DEFAULT_MAX_WAIT),
            None
        );
    }

    #[test]
    fn budgets_parse_and_print() {
        assert_eq!(parse_max_wait("none"), Ok(None));
        assert_eq!(parse_max_wait("90s"), Ok(Some(Duration::from_secs(90))));
        assert_eq!(parse_max_wait("2m"), Ok(Some(DEFAULT_MAX_WAIT)));
        assert_eq!(parse_max_wait("1h"), Ok(Some(Duration::from_secs(3600))));
        for bad in ["", "2", "m", "2 m", "-1m", "2d", "twom"] {
            assert!(parse_max_wait(bad).is_err(), "{bad}");
        }
        assert_eq!(format_budget(Some(DEFAULT_MAX_WAIT)), "2m");
        assert_eq!(format_budget(Some(Duration::from_secs(90))), "90s");
        assert_eq!(format_budget(Some(Duration::from_secs(7200))), "2h");
        assert_eq!(format_budget(None), "none");
    }
}
