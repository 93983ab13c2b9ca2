//! An incremental server-sent events parser over raw bytes, following the WHATWG
//! "event stream interpretation" rules exactly, plus the stricter framing rules of API v1 §7.
//!
//! The parser is a pure state machine: feed it chunks as they arrive (split anywhere, even
//! between a CR and its LF, or inside a UTF-8 sequence) and it returns what became complete.
//! It never looks at the clock; the client stamps items with times.

use std::fmt;

/// One thing the stream delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// A dispatched event.
    Event(Event),
    /// A comment line (`: ping`), without the colon and one leading space.
    Comment(String),
    /// A valid `retry:` field, in milliseconds.
    Retry(u64),
    /// Something the byte stream got wrong.
    Fault(Fault),
}

/// A dispatched event, as a browser's `EventSource` would see it, plus what the framing
/// rules need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// `event:` field, or `message` when the block had none.
    pub event: String,
    /// Data lines joined with `\n`.
    pub data: String,
    /// How many `data:` lines the block had.
    pub data_lines: usize,
    /// The `id:` field of this block, when it had one (ids containing NUL are ignored).
    pub id: Option<String>,
    /// The stream's last event ID after this event (it persists across blocks).
    pub last_event_id: String,
}

/// A framing fault: a byte-level problem or a broken API v1 framing rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// A line was not valid UTF-8 (it was decoded lossily).
    InvalidUtf8 { line: usize },
    /// The stream ended inside an event block (the block is discarded, as the spec says).
    EndedMidEvent,
    /// A field the spec does not know (ignored by clients).
    UnknownField { line: usize, field: String },
    /// A `retry:` value that is not all digits (ignored by clients).
    BadRetry { line: usize },
    /// An `id:` containing NUL (ignored by clients).
    IdWithNul { line: usize },
    /// An event without an `id:` where every event must have one.
    MissingId { event: String },
    /// An id that is not a decimal sequence number.
    NonNumericId { id: String },
    /// An id that does not follow the previous one by exactly 1 (gap or duplicate); in a
    /// filtered view, an id not greater than the previous one.
    NonMonotonicId { previous: u64, id: u64 },
    /// Data split over several `data:` lines where one line of JSON is required.
    MultiLineData { event: String, lines: usize },
    /// Data that is not JSON where JSON is required.
    DataNotJson { event: String },
    /// JSON data whose `seq` is missing or differs from the event id.
    SeqMismatch { id: String, seq: Option<u64> },
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::InvalidUtf8 { line } => write!(f, "line {line} is not valid UTF-8"),
            Fault::EndedMidEvent => f.write_str("stream ended inside an event block"),
            Fault::UnknownField { line, field } => {
                write!(f, "line {line}: unknown field `{field}`")
            }
            Fault::BadRetry { line } => write!(f, "line {line}: `retry` value is not all digits"),
            Fault::IdWithNul { line } => write!(f, "line {line}: `id` contains NUL"),
            Fault::MissingId { event } => write!(f, "event `{event}` has no id"),
            Fault::NonNumericId { id } => write!(f, "id `{id}` is not a sequence number"),
            Fault::NonMonotonicId { previous, id } => {
                write!(f, "id {id} does not follow {previous}")
            }
            Fault::MultiLineData { event, lines } => {
                write!(f, "event `{event}` has {lines} data lines, not one")
            }
            Fault::DataNotJson { event } => write!(f, "event `{event}` data is not JSON"),
            Fault::SeqMismatch { id, seq } => match seq {
                Some(seq) => write!(f, "event id {id} carries seq {seq}"),
                None => write!(f, "event id {id} carries no seq"),
            },
        }
    }
}

/// The byte-level parser state.
#[derive(Debug, Default)]
pub struct Parser {
    /// Bytes of the current, unfinished line.
    line: Vec<u8>,
    /// The previous chunk ended in CR: an LF at the start of the next one belongs to it.
    after_cr: bool,
    /// Whether the first bytes have been seen (a BOM is stripped only there).
    started: bool,
    /// Bytes held back at the start while deciding whether they are a BOM.
    bom_probe: Vec<u8>,
    /// Lines seen so far, for fault positions.
    line_no: usize,
    event_type: String,
    data: String,
    data_lines: usize,
    /// The id field of the current block, if any.
    block_id: Option<String>,
    /// Persists across blocks, as the spec's "last event ID buffer".
    last_event_id: String,
    /// Something was seen in the current block (for `EndedMidEvent`).
    in_block: bool,
}

const BOM: &[u8] = b"\xEF\xBB\xBF";

impl Parser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds a chunk; returns every item it completed.
    pub fn feed(&mut self, mut chunk: &[u8]) -> Vec<Item> {
        let mut out = Vec::new();
        if !self.started {
            // Hold back up to three bytes to recognise a BOM split across chunks.
            let need = BOM.len() - self.bom_probe.len();
            let take = need.min(chunk.len());
            self.bom_probe.extend_from_slice(&chunk[..take]);
            chunk = &chunk[take..];
            if self.bom_probe.len() < BOM.len() && BOM.starts_with(&self.bom_probe) {
                return out;
            }
            self.started = true;
            let probe = std::mem::take(&mut self.bom_probe);
            let rest: &[u8] = if probe == BOM { &[] } else { &probe };
            self.bytes(rest, &mut out);
        }
        self.bytes(chunk, &mut out);
        out
    }

    /// Signals the end of the stream.
    pub fn finish(&mut self) -> Vec<Item> {
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            let probe = std::mem::take(&mut self.bom_probe);
            if probe != BOM {
                self.bytes(&probe, &mut out);
            }
        }
        // A final line without a terminator is not a line (the spec discards it), but it
        // means the block was unfinished.
        if self.in_block || !self.line.is_empty() {
            out.push(Item::Fault(Fault::EndedMidEvent));
        }
        self.line.clear();
        self.reset_block();
        out
    }

    /// The stream's last event ID (for a resume).
    pub fn last_event_id(&self) -> &str {
        &self.last_event_id
    }

    fn bytes(&mut self, chunk: &[u8], out: &mut Vec<Item>) {
        for &b in chunk {
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            match b {
                b'\r' => {
                    self.after_cr = true;
                    self.end_line(out);
                }
                b'\n' => self.end_line(out),
                _ => self.line.push(b),
            }
        }
    }

    fn end_line(&mut self, out: &mut Vec<Item>) {
        self.line_no += 1;
        let bytes = std::mem::take(&mut self.line);
        let line = match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => {
                out.push(Item::Fault(Fault::InvalidUtf8 { line: self.line_no }));
                String::from_utf8_lossy(e.as_bytes()).into_owned()
            }
        };
        if line.is_empty() {
            self.dispatch(out);
            return;
        }
        if let Some(comment) = line.strip_prefix(':') {
            out.push(Item::Comment(
                comment.strip_prefix(' ').unwrap_or(comment).to_owned(),
            ));
            return;
        }
        self.in_block = true;
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_str(), ""),
        };
        match field {
            "event" => self.event_type = value.to_owned(),
            "data" => {
                self.data.push_str(value);
                self.data.push('\n');
                self.data_lines += 1;
            }
            "id" => {
                if value.contains('\0') {
                    out.push(Item::Fault(Fault::IdWithNul { line: self.line_no }));
                } else {
                    self.block_id = Some(value.to_owned());
                    self.last_event_id = value.to_owned();
                }
            }
            "retry" => {
                if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
                    // Digits only, so the parse fails only on overflow; saturate then.
                    out.push(Item::Retry(value.parse().unwrap_or(u64::MAX)));
                } else {
                    out.push(Item::Fault(Fault::BadRetry { line: self.line_no }));
                }
            }
            other => out.push(Item::Fault(Fault::UnknownField {
                line: self.line_no,
                field: other.to_owned(),
            })),
        }
    }

    fn dispatch(&mut self, out: &mut Vec<Item>) {
        if self.data_lines > 0 {
            let mut data = std::mem::take(&mut self.data);
            data.pop();
            let event = if self.event_type.is_empty() {
                "message".to_owned()
            } else {
                self.event_type.clone()
            };
            out.push(Item::Event(Event {
                event,
                data,
                data_lines: self.data_lines,
                id: self.block_id.clone(),
                last_event_id: self.last_event_id.clone(),
            }));
        }
        self.reset_block();
    }

    fn reset_block(&mut self) {
        self.event_type.clear();
        self.data.clear();
        self.data_lines = 0;
        self.block_id = None;
        self.in_block = false;
    }
}

/// The API v1 framing rules (§7), applied to events in order: every event but `stream.end`
/// has a numeric `id` one past the previous, one line of JSON data whose `seq` equals the id.
#[derive(Debug, Default)]
pub struct Framing {
    /// The previous id, to check that ids follow each other without gaps or repeats.
    previous: Option<u64>,
    /// The stream is a filtered view of its log (SSE-7.6): ids must only increase.
    gaps: bool,
    /// Another protocol's stream: its data carries no `seq` to match the id.
    ids_only: bool,
}

impl Framing {
    /// Starts checking after a resume cursor (the next id must be `after + 1`).
    pub fn after(after: Option<u64>) -> Self {
        Framing {
            previous: after,
            gaps: false,
            ids_only: false,
        }
    }

    /// Checks the ids only (present, numeric, increasing), not a `seq` in the data: for
    /// profiles whose events do not carry one.
    pub fn ids_only(self) -> Self {
        Framing {
            ids_only: true,
            ..self
        }
    }

    /// Lets ids skip numbers (a filtered view of a log), while still requiring them to
    /// increase.
    pub fn allowing_gaps(self) -> Self {
        Framing { gaps: true, ..self }
    }

    /// Every rule `event` breaks.
    pub fn check(&mut self, event: &Event) -> Vec<Fault> {
        let mut faults = Vec::new();
        if event.data_lines != 1 {
            faults.push(Fault::MultiLineData {
                event: event.event.clone(),
                lines: event.data_lines,
            });
        }
        let json: Option<serde_json::Value> = serde_json::from_str(&event.data).ok();
        if json.is_none() {
            faults.push(Fault::DataNotJson {
                event: event.event.clone(),
            });
        }
        // `stream.end` carries no id (it is not part of the durable log).
        if event.event == "stream.end" {
            return faults;
        }
        let Some(id) = &event.id else {
            faults.push(Fault::MissingId {
                event: event.event.clone(),
            });
            return faults;
        };
        let Ok(n) = id.parse::<u64>() else {
            faults.push(Fault::NonNumericId { id: id.clone() });
            return faults;
        };
        if let Some(previous) = self.previous
            && (if self.gaps {
                n <= previous
            } else {
                n != previous + 1
            })
        {
            faults.push(Fault::NonMonotonicId { previous, id: n });
        }
        self.previous = Some(n);
        if self.ids_only {
            return faults;
        }
        if let Some(json) = json {
            let seq = json.get("seq").and_then(serde_json::Value::as_u64);
            if seq != Some(n) {
                faults.push(Fault::SeqMismatch {
                    id: id.clone(),
                    seq,
                });
            }
        }
        faults
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(event: &str, data: &str, id: Option<&str>, last: &str) -> Item {
        Item::Event(Event {
            event: event.into(),
            data: data.into(),
            data_lines: data.split('\n').count(),
            id: id.map(Into::into),
            last_event_id: last.into(),
        })
    }

    fn parse_all(chunks: &[&[u8]]) -> Vec<Item> {
        let mut p = Parser::new();
        let mut out = Vec::new();
        for c in chunks {
            out.extend(p.feed(c));
        }
        out.extend(p.finish());
        out
    }

    const SAMPLE: &[u8] = b"\xEF\xBB\xBF: ping\r\nid: 1\r\nevent: stdout\r\ndata: {\"seq\":1,\"data\":\"h\xC3\xA9\"}\r\n\r\nid: 2\revent: exit\rdata: {\"seq\":2}\r\rretry: 1500\n: keep\n\ndata: a\ndata:b\ndata\n\n";

    fn sample_expected() -> Vec<Item> {
        vec![
            Item::Comment("ping".into()),
            ev("stdout", "{\"seq\":1,\"data\":\"h\u{e9}\"}", Some("1"), "1"),
            ev("exit", "{\"seq\":2}", Some("2"), "2"),
            Item::Retry(1500),
            Item::Comment("keep".into()),
            ev("message", "a\nb\n", None, "2"),
        ]
    }

    #[test]
    fn parses_mixed_line_endings_bom_comments_and_multiline_data() {
        assert_eq!(parse_all(&[SAMPLE]), sample_expected());
    }

    #[test]
    fn every_split_point_gives_the_same_items() {
        for i in 0..=SAMPLE.len() {
            assert_eq!(
                parse_all(&[&SAMPLE[..i], &SAMPLE[i..]]),
                sample_expected(),
                "split at {i}"
            );
        }
        // And byte by byte.
        let bytes: Vec<&[u8]> = SAMPLE.chunks(1).collect();
        assert_eq!(parse_all(&bytes), sample_expected());
    }

    #[test]
    fn cr_at_chunk_end_then_lf_is_one_line_end() {
        assert_eq!(
            parse_all(&[b"data: x\r", b"\n\r", b"\n"]),
            vec![ev("message", "x", None, "")]
        );
        // CR then CR is two line ends (an empty line: dispatch).
        assert_eq!(
            parse_all(&[b"data: x\r", b"\r"]),
            vec![ev("message", "x", None, "")]
        );
    }

    #[test]
    fn bom_only_at_start_and_only_once() {
        // A second BOM is part of the field name, so the line is an unknown field.
        let items = parse_all(&[b"\xEF\xBB", b"\xBF\xEF\xBB\xBFdata: x\n\n"]);
        assert!(
            matches!(&items[0], Item::Fault(Fault::UnknownField { .. })),
            "{items:?}"
        );
        // A stream that starts like a BOM but is not one keeps its bytes.
        assert_eq!(
            parse_all(&[b"\xEF", b"x\n\n"]),
            vec![
                Item::Fault(Fault::InvalidUtf8 { line: 1 }),
                Item::Fault(Fault::UnknownField {
                    line: 1,
                    field: "\u{FFFD}x".into()
                }),
            ]
        );
    }

    #[test]
    fn id_with_nul_is_ignored_and_empty_id_resets() {
        let items = parse_all(&[b"id: 7\ndata: a\n\nid: 8\0\ndata: b\n\nid\ndata: c\n\n"]);
        assert_eq!(
            items,
            vec![
                ev("message", "a", Some("7"), "7"),
                Item::Fault(Fault::IdWithNul { line: 4 }),
                ev("message", "b", None, "7"),
                ev("message", "c", Some(""), ""),
            ]
        );
    }

    #[test]
    fn field_without_colon_and_leading_space_rules() {
        // `data` alone appends an empty line; only one leading space is stripped.
        let items = parse_all(&[b"data\ndata:  two\n\n"]);
        assert_eq!(items, vec![ev("message", "\n two", None, "")]);
    }

    #[test]
    fn bad_retry_and_unknown_fields_are_faults_not_events() {
        let items = parse_all(&[b"retry: 1s\nfoo: bar\n\n"]);
        assert_eq!(
            items,
            vec![
                Item::Fault(Fault::BadRetry { line: 1 }),
                Item::Fault(Fault::UnknownField {
                    line: 2,
                    field: "foo".into()
                }),
            ]
        );
    }

    #[test]
    fn block_without_data_dispatches_nothing_but_keeps_id() {
        let items = parse_all(&[b"id: 3\nevent: x\n\ndata: y\n\n"]);
        assert_eq!(items, vec![ev("message", "y", None, "3")]);
    }

    #[test]
    fn eof_inside_a_block_discards_it_and_reports() {
        assert_eq!(
            parse_all(&[b"data: x\n"]),
            vec![Item::Fault(Fault::EndedMidEvent)]
        );
        assert_eq!(
            parse_all(&[b"data: x"]),
            vec![Item::Fault(Fault::EndedMidEvent)]
        );
        assert_eq!(parse_all(&[b": c\n"]), vec![Item::Comment("c".into())]);
    }

    #[test]
    fn invalid_utf8_is_reported_and_decoded_lossily() {
        let items = parse_all(&[b"data: \xFF\n\n"]);
        assert_eq!(items[0], Item::Fault(Fault::InvalidUtf8 { line: 1 }));
        assert!(matches!(&items[1], Item::Event(e) if e.data == "\u{FFFD}"));
    }

    fn framing(events: &[(&str, &str, Option<&str>)], after: Option<u64>) -> Vec<Fault> {
        let mut f = Framing::after(after);
        let mut out = Vec::new();
        for (event, data, id) in events {
            let e = Event {
                event: (*event).into(),
                data: (*data).into(),
                data_lines: data.split('\n').count(),
                id: id.map(Into::into),
                last_event_id: String::new(),
            };
            out.extend(f.check(&e));
        }
        out
    }

    #[test]
    fn framing_accepts_a_good_stream() {
        let faults = framing(
            &[
                ("stdout", r#"{"seq":4,"data":"x"}"#, Some("4")),
                ("exit", r#"{"seq":5,"state":"exited"}"#, Some("5")),
                (
                    "stream.end",
                    r#"{"reason":"max_duration","resume_after":5}"#,
                    None,
                ),
            ],
            Some(3),
        );
        assert_eq!(faults, vec![]);
    }

    #[test]
    fn framing_of_a_filtered_view_allows_gaps_but_not_repeats() {
        let viewed = |ids: &[&str], after: Option<u64>| {
            let mut f = Framing::after(after).allowing_gaps();
            ids.iter()
                .flat_map(|id| {
                    let e = Event {
                        event: "x".into(),
                        data: format!(r#"{{"seq":{id}}}"#),
                        data_lines: 1,
                        id: Some((*id).into()),
                        last_event_id: String::new(),
                    };
                    f.check(&e)
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(viewed(&["3", "7", "8"], Some(1)), vec![]);
        assert_eq!(
            viewed(&["3", "3"], None),
            vec![Fault::NonMonotonicId { previous: 3, id: 3 }]
        );
        assert_eq!(
            viewed(&["2"], Some(2)),
            vec![Fault::NonMonotonicId { previous: 2, id: 2 }]
        );
    }

    #[test]
    fn framing_of_ids_only_needs_no_seq_but_still_refuses_repeats() {
        let checked = |ids: &[&str]| {
            let mut f = Framing::after(Some(0)).allowing_gaps().ids_only();
            ids.iter()
                .flat_map(|id| {
                    let e = Event {
                        event: "x".into(),
                        data: r#"{"event_id":"evt_1"}"#.into(),
                        data_lines: 1,
                        id: Some((*id).into()),
                        last_event_id: String::new(),
                    };
                    f.check(&e)
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(checked(&["1", "2", "4"]), vec![]);
        assert_eq!(
            checked(&["1", "4", "4"]),
            vec![Fault::NonMonotonicId { previous: 4, id: 4 }]
        );
    }

    #[test]
    fn framing_reports_each_rule() {
        assert_eq!(
            framing(
                &[
                    ("stdout", r#"{"seq":1}"#, Some("1")),
                    ("stdout", r#"{"seq":3}"#, Some("3"))
                ],
                None
            ),
            vec![Fault::NonMonotonicId { previous: 1, id: 3 }]
        );
        assert_eq!(
            framing(&[("stdout", r#"{"seq":2}"#, Some("2"))], Some(2)),
            vec![Fault::NonMonotonicId { previous: 2, id: 2 }]
        );
        assert_eq!(
            framing(&[("stdout", r#"{"seq":1}"#, None)], None),
            vec![Fault::MissingId {
                event: "stdout".into()
            }]
        );
        assert_eq!(
            framing(&[("stdout", "{\"seq\":\n1}", Some("1"))], None),
            vec![Fault::MultiLineData {
                event: "stdout".into(),
                lines: 2
            }]
        );
        assert_eq!(
            framing(&[("stdout", "<html>", Some("1"))], None),
            vec![Fault::DataNotJson {
                event: "stdout".into()
            }]
        );
        assert_eq!(
            framing(&[("stdout", r#"{"seq":9}"#, Some("1"))], None),
            vec![Fault::SeqMismatch {
                id: "1".into(),
                seq: Some(9)
            }]
        );
        assert_eq!(
            framing(&[("stdout", "{}", Some("x"))], None),
            vec![Fault::NonNumericId { id: "x".into() }]
        );
    }
}
