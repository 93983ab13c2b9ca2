//! A sanitized deep copy of a run report: every string a file could be rendered from passes
//! through the sanitizer, so the renderers cannot forget one.

use base64::Engine as _;

use super::receipt::strip_userinfo;
use super::sanitize::{REDACTED, Sanitizer};
use crate::engine::{Body, Entry, Frame, HttpExchange, Note, Outcome, SseExchange};
use crate::gate::{Baseline, Expected, Gate};
use crate::report::{FamilyVerdict, RunReport, ScenarioReport, TargetInfo};
use crate::sdk::{Cell, SdkMatrix};

/// A copy of `report` with every string sanitized, for anything else that writes a report
/// (a `report.json`, logs). Binary bodies holding a secret are dropped, as in a run folder.
pub fn sanitized_report(report: &RunReport, sanitizer: &Sanitizer) -> RunReport {
    Cleaner::new(sanitizer, sanitizer).report(report)
}

/// Applies the sanitizer; remembers what it could not remove from binary bodies.
pub(crate) struct Cleaner<'a> {
    sanitizer: &'a Sanitizer,
    /// The sanitizer plus the canary: used only to look for survivors, never to redact.
    scanner: &'a Sanitizer,
    /// `(where, what)` for secrets found in base64 bodies, which a scan of the rendered
    /// files cannot see.
    pub hidden: Vec<(String, String)>,
}

impl<'a> Cleaner<'a> {
    pub fn new(sanitizer: &'a Sanitizer, scanner: &'a Sanitizer) -> Self {
        Cleaner {
            sanitizer,
            scanner,
            hidden: Vec::new(),
        }
    }

    fn s(&self, text: &str) -> String {
        self.sanitizer.text(text).into_owned()
    }

    fn leftover(&self, l: &crate::live::Leftover) -> crate::live::Leftover {
        crate::live::Leftover {
            path: self.s(&l.path),
            removed: l.removed,
        }
    }

    fn all(&self, list: &[String]) -> Vec<String> {
        list.iter().map(|t| self.s(t)).collect()
    }

    pub fn report(&mut self, r: &RunReport) -> RunReport {
        RunReport {
            run_id: self.s(&r.run_id),
            suite_version: self.s(&r.suite_version),
            started_at: r.started_at.clone(),
            finished_at: r.finished_at.clone(),
            duration_ms: r.duration_ms,
            target: TargetInfo {
                kind: r.target.kind.clone(),
                url: self.s(&strip_userinfo(&r.target.url)),
                server_name: r.target.server_name.as_deref().map(|t| self.s(t)),
                server_version: r.target.server_version.as_deref().map(|t| self.s(t)),
                defects: self.all(&r.target.defects),
                capabilities: self.sanitizer.json(&r.target.capabilities),
            },
            profile: self.s(&r.profile),
            filters: self.all(&r.filters),
            shard: r.shard.as_deref().map(|t| self.s(t)),
            label: r.label.as_deref().map(|t| self.s(t)),
            retries: r.retries,
            certify: r.certify,
            scenarios: r.scenarios.iter().map(|s| self.scenario(s)).collect(),
            profiles: r
                .profiles
                .iter()
                .map(|p| FamilyVerdict {
                    reason: p.reason.as_deref().map(|t| self.s(t)),
                    ..p.clone()
                })
                .collect(),
            run_sweep: crate::live::RunSweep {
                found: r.run_sweep.found.iter().map(|l| self.leftover(l)).collect(),
                ignored: r.run_sweep.ignored.clone(),
                error: r.run_sweep.error.as_deref().map(|t| self.s(t)),
            },
            not_applicable: r
                .not_applicable
                .iter()
                .map(|n| crate::report::NotApplicable {
                    id: self.s(&n.id),
                    reason: self.s(&n.reason),
                })
                .collect(),
            sdk_matrix: r.sdk_matrix.as_ref().map(|m| SdkMatrix {
                sdks: m.sdks.clone(),
                journeys: m.journeys.clone(),
                cells: m
                    .cells
                    .iter()
                    .map(|c| Cell {
                        detail: c.detail.as_deref().map(|t| self.s(t)),
                        ..c.clone()
                    })
                    .collect(),
            }),
            consumption: r.consumption.clone(),
        }
    }

    /// A gate with every string the baseline or the run put in it sanitized.
    pub fn gate(&self, g: &Gate) -> Gate {
        let list = |l: &[String]| self.all(l);
        Gate {
            baseline: Baseline {
                file: self.s(&g.baseline.file),
                sha256: g.baseline.sha256.clone(),
                entries: g
                    .baseline
                    .entries
                    .iter()
                    .map(|e| Expected {
                        id: self.s(&e.id),
                        step: e.step.as_deref().map(|t| self.s(t)),
                        reason: self.s(&e.reason),
                        link: e.link.as_deref().map(|t| self.s(t)),
                        expires: e.expires.clone(),
                    })
                    .collect(),
            },
            result: g.result.clone(),
            expected: list(&g.expected),
            unexpected: list(&g.unexpected),
            stale: list(&g.stale),
            expired: list(&g.expired),
            wrong_step: list(&g.wrong_step),
            reasons: list(&g.reasons),
        }
    }

    fn scenario(&mut self, s: &ScenarioReport) -> ScenarioReport {
        ScenarioReport {
            id: self.s(&s.id),
            title: self.s(&s.title),
            family: self.s(&s.family),
            file: self.s(&s.file),
            level: s.level,
            clauses: self.all(&s.clauses),
            tags: self.all(&s.tags),
            defects: self.all(&s.defects),
            outcome: self.outcome(&s.outcome),
            started_ms: s.started_ms,
            duration_ms: s.duration_ms,
            attempts: s.attempts,
            measurements: s
                .measurements
                .iter()
                .map(|(k, v)| (self.s(k), *v))
                .collect(),
            swept: s.swept.iter().map(|l| self.leftover(l)).collect(),
            throttled: s.throttled,
            faults: s
                .faults
                .iter()
                .map(|f| crate::engine::FaultRecord {
                    step: self.s(&f.step),
                    kind: f.kind.clone(),
                    on: f.on.clone(),
                    at_ms: f.at_ms,
                    took_ms: f.took_ms,
                    checked_after: self.all(&f.checked_after),
                })
                .collect(),
            transcript: s.transcript.iter().map(|e| self.entry(&s.id, e)).collect(),
        }
    }

    fn outcome(&self, o: &Outcome) -> Outcome {
        match o {
            Outcome::Pass => Outcome::Pass,
            Outcome::Flaky {
                attempts,
                first_failure,
            } => Outcome::Flaky {
                attempts: *attempts,
                first_failure: self.s(first_failure),
            },
            Outcome::Skip { reason } => Outcome::Skip {
                reason: self.s(reason),
            },
            Outcome::Fail { step, reason } => Outcome::Fail {
                step: self.s(step),
                reason: self.s(reason),
            },
            Outcome::Error { reason } => Outcome::Error {
                reason: self.s(reason),
            },
        }
    }

    fn headers(&self, headers: &[(String, String)]) -> Vec<(String, String)> {
        headers
            .iter()
            .map(|(n, v)| (self.s(n), self.sanitizer.header(n, v)))
            .collect()
    }

    /// Text that is JSON is sanitized as JSON (secret-named keys, strings one by one), and
    /// re-serialized only when something changed; other text is sanitized as text.
    fn payload(&self, text: &str) -> String {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(text) {
            let clean = self.sanitizer.json(&v);
            if clean == v {
                return text.to_owned();
            }
            return serde_json::to_string(&clean).unwrap_or_else(|_| REDACTED.to_owned());
        }
        self.s(text)
    }

    fn body(&mut self, at: &str, b: &Body) -> Body {
        if let Some(text) = &b.text {
            return Body {
                len: b.len,
                text: Some(self.payload(text)),
                base64: None,
                truncated: b.truncated,
            };
        }
        let Some(encoded) = &b.base64 else {
            return b.clone();
        };
        // Binary bytes cannot be redacted in place: a body whose decoded form holds a secret is
        // dropped whole. One holding the canary is reported, so the writer refuses.
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .unwrap_or_default();
        let decoded = String::from_utf8_lossy(&bytes);
        let clean = self.sanitizer.text(&decoded);
        for leak in self.scanner.leaks(&clean) {
            self.hidden.push((at.to_owned(), leak.what));
        }
        if clean != decoded {
            return Body {
                len: b.len,
                text: Some(REDACTED.to_owned()),
                base64: None,
                truncated: b.truncated,
            };
        }
        b.clone()
    }

    fn entry(&mut self, scenario: &str, e: &Entry) -> Entry {
        match e {
            Entry::Http(h) => {
                let at = format!("transcript of {scenario}, {} body", h.step);
                Entry::Http(HttpExchange {
                    step: self.s(&h.step),
                    at_ms: h.at_ms,
                    credential: h.credential,
                    method: self.s(&h.method),
                    target: self.s(&h.target),
                    request_headers: self.headers(&h.request_headers),
                    request_body: h.request_body.as_ref().map(|b| self.body(&at, b)),
                    status: h.status,
                    response_headers: self.headers(&h.response_headers),
                    response_body: h.response_body.as_ref().map(|b| self.body(&at, b)),
                    duration_ms: h.duration_ms,
                    error: h.error.as_deref().map(|t| self.s(t)),
                })
            }
            Entry::Sse(x) => Entry::Sse(SseExchange {
                step: self.s(&x.step),
                at_ms: x.at_ms,
                credential: x.credential,
                target: self.s(&x.target),
                last_event_id: x.last_event_id.as_deref().map(|t| self.s(t)),
                status: x.status,
                response_headers: self.headers(&x.response_headers),
                frames: x
                    .frames
                    .iter()
                    .map(|f| match f {
                        Frame::Event {
                            at_ms,
                            event,
                            id,
                            data,
                        } => Frame::Event {
                            at_ms: *at_ms,
                            event: self.s(event),
                            id: id.as_deref().map(|t| self.s(t)),
                            data: self.payload(data),
                        },
                        Frame::Comment { at_ms, text } => Frame::Comment {
                            at_ms: *at_ms,
                            text: self.s(text),
                        },
                        Frame::Retry { at_ms, ms } => Frame::Retry {
                            at_ms: *at_ms,
                            ms: *ms,
                        },
                        Frame::Fault { at_ms, fault } => Frame::Fault {
                            at_ms: *at_ms,
                            fault: self.s(fault),
                        },
                    })
                    .collect(),
                first_frame_ms: x.first_frame_ms,
                eof_ms: x.eof_ms,
                end: self.s(&x.end),
            }),
            Entry::Note(n) => Entry::Note(Note {
                at_ms: n.at_ms,
                text: self.s(&n.text),
            }),
        }
    }
}
