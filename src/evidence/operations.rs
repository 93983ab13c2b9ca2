//! The receipt's operation coverage: for every operation the run's profile lists, the
//! scenarios whose requests called it and what the target answered them, and the operations
//! no scenario called. Computed from the transcripts' requests alone (method and path), so it
//! says what was sent, not what a scenario meant to test.

use std::collections::{BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use crate::engine::Entry;
use crate::profile::{Operation, operation_of};
use crate::report::ScenarioReport;

/// How a run's requests covered its profile's operations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperationCoverage {
    /// Operations the profile's document lists.
    pub declared: usize,
    /// Operations at least one request of a scenario called.
    pub called: usize,
    /// Operations the target carried out at least once (answered 2xx).
    pub succeeded: usize,
    /// Operations the target refused at least once for a missing or unknown credential (401).
    pub unauthenticated: usize,
    /// Operations the target refused at least once for a credential without the right (403).
    pub forbidden: usize,
    /// Every listed operation, in the document's order.
    pub operations: Vec<OperationRow>,
    /// `METHOD path` of each listed operation no scenario called, in the document's order.
    pub uncalled: Vec<String>,
    /// Requests that called no listed operation (an unknown path or method, on purpose or not).
    pub unlisted_requests: usize,
}

/// One listed operation and how the run's requests called it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperationRow {
    pub method: String,
    pub path: String,
    pub group: String,
    /// Scenarios with a request that called it, in the order of the receipt's scenarios.
    pub scenarios: Vec<String>,
    /// The statuses it was answered with, ascending (a request with no answer adds none).
    pub statuses: Vec<u16>,
}

impl OperationRow {
    /// `METHOD path`.
    pub fn name(&self) -> String {
        format!("{} {}", self.method, self.path)
    }

    /// The statuses as a list (`200, 401, 403`), or `not called`.
    pub fn statuses_text(&self) -> String {
        if self.scenarios.is_empty() {
            return "not called".to_owned();
        }
        let list: Vec<String> = self.statuses.iter().map(u16::to_string).collect();
        list.join(", ")
    }

    fn has(&self, wanted: impl Fn(u16) -> bool) -> bool {
        self.statuses.iter().any(|s| wanted(*s))
    }
}

impl OperationCoverage {
    /// Coverage of `operations` by the requests of `scenarios`' transcripts; `None` when the
    /// profile lists no operations.
    pub fn of(operations: &[Operation], scenarios: &[ScenarioReport]) -> Option<Self> {
        if operations.is_empty() {
            return None;
        }
        let mut rows: Vec<OperationRow> = operations
            .iter()
            .map(|op| OperationRow {
                method: op.method.clone(),
                path: op.path.clone(),
                group: op.group.clone(),
                scenarios: Vec::new(),
                statuses: Vec::new(),
            })
            .collect();
        let mut statuses: HashMap<usize, BTreeSet<u16>> = HashMap::new();
        let mut unlisted = 0;
        for s in scenarios {
            for entry in &s.transcript {
                let (method, target, status) = match entry {
                    Entry::Http(h) => (h.method.as_str(), h.target.as_str(), h.status),
                    Entry::Sse(e) => ("GET", e.target.as_str(), e.status),
                    Entry::Note(_) => continue,
                };
                let Some(i) = operation_of(operations, method, target) else {
                    unlisted += 1;
                    continue;
                };
                if !rows[i].scenarios.contains(&s.id) {
                    rows[i].scenarios.push(s.id.clone());
                }
                if let Some(status) = status {
                    statuses.entry(i).or_default().insert(status);
                }
            }
        }
        for (i, set) in statuses {
            rows[i].statuses = set.into_iter().collect();
        }
        Some(Self::from_rows(rows, unlisted))
    }

    /// The counts of `rows`, as [`OperationCoverage::of`] makes them (also for merged shards).
    pub fn from_rows(rows: Vec<OperationRow>, unlisted_requests: usize) -> Self {
        let count = |f: &dyn Fn(&OperationRow) -> bool| rows.iter().filter(|r| f(r)).count();
        OperationCoverage {
            declared: rows.len(),
            called: count(&|r| !r.scenarios.is_empty()),
            succeeded: count(&|r| r.has(|s| (200..300).contains(&s))),
            unauthenticated: count(&|r| r.has(|s| s == 401)),
            forbidden: count(&|r| r.has(|s| s == 403)),
            uncalled: rows
                .iter()
                .filter(|r| r.scenarios.is_empty())
                .map(OperationRow::name)
                .collect(),
            operations: rows,
            unlisted_requests,
        }
    }

    /// One sentence with the counts, as the summary and the page say them.
    pub fn line(&self) -> String {
        format!(
            "{} operations listed; {} called by a scenario, {} carried out (2xx), {} refused without a valid credential (401), {} refused for a missing right (403); {} uncalled; {} requests called no listed operation.",
            self.declared,
            self.called,
            self.succeeded,
            self.unauthenticated,
            self.forbidden,
            self.uncalled.len(),
            self.unlisted_requests
        )
    }

    /// The coverage of shards of one run: each operation's scenarios and statuses joined.
    /// `None` when no shard recorded any.
    pub fn merge<'a>(parts: impl IntoIterator<Item = &'a OperationCoverage>) -> Option<Self> {
        let mut rows: Vec<OperationRow> = Vec::new();
        let mut unlisted = 0;
        let mut any = false;
        for part in parts {
            any = true;
            unlisted += part.unlisted_requests;
            for row in &part.operations {
                match rows
                    .iter_mut()
                    .find(|r| r.method == row.method && r.path == row.path)
                {
                    Some(r) => {
                        for s in &row.scenarios {
                            if !r.scenarios.contains(s) {
                                r.scenarios.push(s.clone());
                            }
                        }
                        let joined: BTreeSet<u16> =
                            r.statuses.iter().chain(&row.statuses).copied().collect();
                        r.statuses = joined.into_iter().collect();
                    }
                    None => rows.push(row.clone()),
                }
            }
        }
        any.then(|| Self::from_rows(rows, unlisted))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(method: &str, path: &str, scenarios: &[&str], statuses: &[u16]) -> OperationRow {
        OperationRow {
            method: method.into(),
            path: path.into(),
            group: "g".into(),
            scenarios: scenarios.iter().map(|s| (*s).to_owned()).collect(),
            statuses: statuses.to_vec(),
        }
    }

    #[test]
    fn counts_are_of_operations_by_what_they_were_answered() {
        let c = OperationCoverage::from_rows(
            vec![
                row("GET", "/a", &["S-1"], &[200, 401]),
                row("POST", "/a", &["S-1", "S-2"], &[403]),
                row("GET", "/b", &[], &[]),
                row("GET", "/c", &["S-2"], &[]),
            ],
            3,
        );
        assert_eq!(
            (
                c.declared,
                c.called,
                c.succeeded,
                c.unauthenticated,
                c.forbidden
            ),
            (4, 3, 1, 1, 1)
        );
        assert_eq!(c.uncalled, ["GET /b"]);
        assert_eq!(c.operations[3].statuses_text(), "");
        assert_eq!(c.operations[2].statuses_text(), "not called");
        assert!(c.line().starts_with("4 operations listed; 3 called"));
    }

    #[test]
    fn shards_join_each_operations_scenarios_and_statuses() {
        let a = OperationCoverage::from_rows(
            vec![
                row("GET", "/a", &["S-1"], &[200]),
                row("GET", "/b", &[], &[]),
            ],
            1,
        );
        let b = OperationCoverage::from_rows(
            vec![
                row("GET", "/a", &["S-2"], &[401]),
                row("GET", "/b", &[], &[]),
            ],
            2,
        );
        let m = OperationCoverage::merge([&a, &b]).unwrap();
        assert_eq!(m.operations[0].scenarios, ["S-1", "S-2"]);
        assert_eq!(m.operations[0].statuses, [200, 401]);
        assert_eq!((m.called, m.unlisted_requests), (1, 3));
        assert_eq!(m.uncalled, ["GET /b"]);
        assert!(OperationCoverage::merge([]).is_none());
    }
}
