//! Scenario outcomes and how they combine.
//!
//! Severity order (combination takes the worst): PASS < FLAKY < SKIP < FAIL < ERROR.
//! FLAKY is worse than PASS because it only passed on retry; SKIP is worse than FLAKY because
//! nothing was observed at all; FAIL is the target's fault; ERROR means the harness could not
//! judge, which is the least trustworthy of all.

use std::fmt;

use serde::Serialize;

/// What running one scenario concluded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Pass,
    /// Failed at first, passed on a retry.
    Flaky {
        attempts: u32,
        first_failure: String,
    },
    /// Not run: a capability is missing or a precondition does not hold.
    Skip {
        reason: String,
    },
    /// The target did something the scenario forbids.
    Fail {
        step: String,
        reason: String,
    },
    /// The harness could not judge (target unreachable, harness bug).
    Error {
        reason: String,
    },
}

impl Outcome {
    /// Position in the severity order.
    pub fn severity(&self) -> u8 {
        match self {
            Outcome::Pass => 0,
            Outcome::Flaky { .. } => 1,
            Outcome::Skip { .. } => 2,
            Outcome::Fail { .. } => 3,
            Outcome::Error { .. } => 4,
        }
    }

    /// The worse of the two (the first one on a tie, so the earliest reason is kept).
    pub fn combine(self, other: Outcome) -> Outcome {
        if other.severity() > self.severity() {
            other
        } else {
            self
        }
    }

    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Pass => "PASS",
            Outcome::Flaky { .. } => "FLAKY",
            Outcome::Skip { .. } => "SKIP",
            Outcome::Fail { .. } => "FAIL",
            Outcome::Error { .. } => "ERROR",
        }
    }

    /// Ran and passed (plainly or after a retry).
    pub fn passed(&self) -> bool {
        matches!(self, Outcome::Pass | Outcome::Flaky { .. })
    }

    pub fn reason(&self) -> Option<String> {
        match self {
            Outcome::Pass => None,
            Outcome::Flaky {
                attempts,
                first_failure,
            } => Some(format!(
                "passed on attempt {attempts}; first failure: {first_failure}"
            )),
            Outcome::Skip { reason } | Outcome::Error { reason } => Some(reason.clone()),
            Outcome::Fail { step, reason } => Some(format!("{step}: {reason}")),
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.reason() {
            Some(reason) => write!(f, "{} ({reason})", self.label()),
            None => f.write_str(self.label()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Outcome> {
        vec![
            Outcome::Pass,
            Outcome::Flaky {
                attempts: 2,
                first_failure: "x".into(),
            },
            Outcome::Skip {
                reason: "no pause".into(),
            },
            Outcome::Fail {
                step: "steps[0]".into(),
                reason: "status".into(),
            },
            Outcome::Error {
                reason: "unreachable".into(),
            },
        ]
    }

    #[test]
    fn combination_only_gets_worse() {
        let outcomes = all();
        for (i, a) in outcomes.iter().enumerate() {
            for (j, b) in outcomes.iter().enumerate() {
                let c = a.clone().combine(b.clone());
                assert_eq!(c, outcomes[i.max(j)].clone(), "{a} + {b}");
                assert!(c.severity() >= a.severity() && c.severity() >= b.severity());
            }
        }
    }

    #[test]
    fn ties_keep_the_first_reason() {
        let a = Outcome::Fail {
            step: "a".into(),
            reason: "first".into(),
        };
        let b = Outcome::Fail {
            step: "b".into(),
            reason: "second".into(),
        };
        assert_eq!(a.clone().combine(b), a);
    }

    #[test]
    fn only_pass_and_flaky_count_as_passed() {
        let passed: Vec<bool> = all().iter().map(Outcome::passed).collect();
        assert_eq!(passed, vec![true, true, false, false, false]);
    }
}
