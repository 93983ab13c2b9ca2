//! The Connect protocol's server-stream framing, JSON codec: an incremental, strict parser of
//! envelopes (a flags byte, a 4-byte big-endian length, that many bytes of JSON) ending in the
//! end-of-stream message (flag `0x02`).
//!
//! Like the SSE parser it is a pure state machine: feed it chunks as they arrive, split
//! anywhere, and it returns what became complete. Every fault names where in the stream it
//! happened (the envelope's index and its byte offset), so a failure reads as precisely as an
//! SSE framing fault.

use std::fmt;

use serde_json::Value;

/// Flag of a compressed message (this codec asks for none).
const FLAG_COMPRESSED: u8 = 0x01;
/// Flag of the end-of-stream message.
const FLAG_END: u8 = 0x02;
/// The largest envelope accepted: larger is a fault rather than an allocation.
pub const MAX_ENVELOPE: u32 = 16 * 1024 * 1024;

/// One thing the stream delivered.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// A message (flags `0x00`), its JSON.
    Message(Value),
    /// The end-of-stream message: `{}` or `{"error": {"code", "message"}}` (and `metadata`).
    End(Value),
    /// Something the framing got wrong.
    Fault(Fault),
}

/// A framing fault, with the envelope's index (from 0) and the byte offset of its prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Flag bits other than end-of-stream.
    UnknownFlags {
        index: usize,
        offset: u64,
        flags: u8,
    },
    /// A compressed message, which the JSON codec without compression never asked for.
    Compressed { index: usize, offset: u64 },
    /// A length beyond [`MAX_ENVELOPE`].
    TooLong {
        index: usize,
        offset: u64,
        length: u32,
    },
    /// An envelope whose bytes are not JSON (or an end-of-stream message that is not an
    /// object).
    NotJson {
        index: usize,
        offset: u64,
        error: String,
    },
    /// Bytes after the end-of-stream message.
    AfterEnd { offset: u64 },
    /// The body ended inside an envelope's 5-byte prefix.
    TruncatedPrefix {
        index: usize,
        offset: u64,
        have: usize,
    },
    /// The body ended inside an envelope's payload.
    TruncatedPayload {
        index: usize,
        offset: u64,
        length: u32,
        have: usize,
    },
    /// The body ended without an end-of-stream message.
    NoEnd { messages: usize },
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::UnknownFlags {
                index,
                offset,
                flags,
            } => write!(
                f,
                "envelope #{index} at byte {offset}: unknown flags 0x{flags:02x}"
            ),
            Fault::Compressed { index, offset } => write!(
                f,
                "envelope #{index} at byte {offset}: compressed, though no compression was negotiated"
            ),
            Fault::TooLong {
                index,
                offset,
                length,
            } => write!(
                f,
                "envelope #{index} at byte {offset}: length {length} beyond {MAX_ENVELOPE}"
            ),
            Fault::NotJson {
                index,
                offset,
                error,
            } => {
                write!(f, "envelope #{index} at byte {offset}: not JSON ({error})")
            }
            Fault::AfterEnd { offset } => {
                write!(f, "bytes at {offset} after the end-of-stream message")
            }
            Fault::TruncatedPrefix {
                index,
                offset,
                have,
            } => write!(
                f,
                "envelope #{index} at byte {offset}: the body ended after {have} of the prefix's 5 bytes"
            ),
            Fault::TruncatedPayload {
                index,
                offset,
                length,
                have,
            } => write!(
                f,
                "envelope #{index} at byte {offset}: the body ended after {have} of its {length} bytes"
            ),
            Fault::NoEnd { messages } => write!(
                f,
                "the stream ended after {messages} messages without an end-of-stream message"
            ),
        }
    }
}

/// The parser's state between chunks.
#[derive(Debug, Default)]
pub struct Parser {
    /// Bytes of the current envelope not yet complete.
    pending: Vec<u8>,
    /// Stream offset of `pending[0]`.
    offset: u64,
    /// Envelopes completed so far.
    index: usize,
    /// Messages (not the end) completed so far.
    messages: usize,
    /// Whether the end-of-stream message came.
    ended: bool,
    /// Whether a fault that makes the rest unreadable happened (then the rest is ignored).
    broken: bool,
}

impl Parser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the end-of-stream message came.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Feeds a chunk; returns the items it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Item> {
        let mut out = Vec::new();
        if self.broken || chunk.is_empty() {
            return out;
        }
        if self.ended {
            out.push(Item::Fault(Fault::AfterEnd {
                offset: self.offset,
            }));
            self.broken = true;
            return out;
        }
        self.pending.extend_from_slice(chunk);
        while self.pending.len() >= 5 {
            let flags = self.pending[0];
            let length = u32::from_be_bytes([
                self.pending[1],
                self.pending[2],
                self.pending[3],
                self.pending[4],
            ]);
            let (index, offset) = (self.index, self.offset);
            let fault = if flags & !(FLAG_COMPRESSED | FLAG_END) != 0 {
                Some(Fault::UnknownFlags {
                    index,
                    offset,
                    flags,
                })
            } else if flags & FLAG_COMPRESSED != 0 {
                Some(Fault::Compressed { index, offset })
            } else if length > MAX_ENVELOPE {
                Some(Fault::TooLong {
                    index,
                    offset,
                    length,
                })
            } else {
                None
            };
            if let Some(fault) = fault {
                out.push(Item::Fault(fault));
                self.broken = true;
                return out;
            }
            let total = 5 + length as usize;
            if self.pending.len() < total {
                break;
            }
            let payload: Vec<u8> = self.pending.drain(..total).skip(5).collect();
            self.offset += total as u64;
            self.index += 1;
            let end = flags & FLAG_END != 0;
            match serde_json::from_slice::<Value>(&payload) {
                Ok(v) if end && !v.is_object() => {
                    out.push(Item::Fault(Fault::NotJson {
                        index,
                        offset,
                        error: "the end-of-stream message must be an object".into(),
                    }));
                }
                Ok(v) if end => out.push(Item::End(v)),
                Ok(v) => {
                    self.messages += 1;
                    out.push(Item::Message(v));
                }
                Err(e) => out.push(Item::Fault(Fault::NotJson {
                    index,
                    offset,
                    error: e.to_string(),
                })),
            }
            if end {
                self.ended = true;
                if !self.pending.is_empty() {
                    out.push(Item::Fault(Fault::AfterEnd {
                        offset: self.offset,
                    }));
                    self.broken = true;
                }
                return out;
            }
        }
        out
    }

    /// The body ended: what was left unfinished.
    pub fn finish(&mut self) -> Option<Fault> {
        if self.broken || self.ended {
            return None;
        }
        let (index, offset) = (self.index, self.offset);
        let have = self.pending.len();
        Some(match have {
            0 => Fault::NoEnd {
                messages: self.messages,
            },
            1..5 => Fault::TruncatedPrefix {
                index,
                offset,
                have,
            },
            _ => Fault::TruncatedPayload {
                index,
                offset,
                length: u32::from_be_bytes([
                    self.pending[1],
                    self.pending[2],
                    self.pending[3],
                    self.pending[4],
                ]),
                have: have - 5,
            },
        })
    }
}

/// One envelope: `flags`, then the length and `json`.
pub fn envelope(flags: u8, json: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + json.len());
    out.push(flags);
    out.extend_from_slice(&u32::try_from(json.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(json);
    out
}

/// Parses a whole body: its items, then the fault at its end if any.
pub fn parse_all(body: &[u8]) -> Vec<Item> {
    let mut p = Parser::new();
    let mut items = p.push(body);
    items.extend(p.finish().map(Item::Fault));
    items
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stream() -> Vec<u8> {
        let mut body = envelope(0, br#"{"event":{"start":{"pid":1000}}}"#);
        body.extend(envelope(0, br#"{"event":{"data":{"stdout":"aGkK"}}}"#));
        body.extend(envelope(FLAG_END, b"{}"));
        body
    }

    /// Feeds `body` split at `at` and returns everything, end included.
    fn split(body: &[u8], at: usize) -> Vec<Item> {
        let mut p = Parser::new();
        let mut items = p.push(&body[..at]);
        items.extend(p.push(&body[at..]));
        items.extend(p.finish().map(Item::Fault));
        items
    }

    #[test]
    fn every_split_point_gives_the_same_items() {
        let body = stream();
        let whole = parse_all(&body);
        assert_eq!(
            whole,
            [
                Item::Message(json!({"event": {"start": {"pid": 1000}}})),
                Item::Message(json!({"event": {"data": {"stdout": "aGkK"}}})),
                Item::End(json!({})),
            ]
        );
        for at in 0..=body.len() {
            assert_eq!(split(&body, at), whole, "split at {at}");
        }
        // And byte by byte.
        let mut p = Parser::new();
        let mut items = Vec::new();
        for b in &body {
            items.extend(p.push(std::slice::from_ref(b)));
        }
        items.extend(p.finish().map(Item::Fault));
        assert_eq!(items, whole);
    }

    #[test]
    fn a_body_cut_anywhere_says_where() {
        let body = stream();
        let first = 5 + br#"{"event":{"start":{"pid":1000}}}"#.len();
        let second = first + 5 + br#"{"event":{"data":{"stdout":"aGkK"}}}"#.len();
        for cut in 0..body.len() {
            let items = parse_all(&body[..cut]);
            let Some(Item::Fault(fault)) = items.last() else {
                panic!("cut at {cut}: no fault in {items:?}");
            };
            let expected_index = usize::from(cut >= first) + usize::from(cut >= second);
            match fault {
                Fault::NoEnd { messages } => assert_eq!(*messages, expected_index, "cut at {cut}"),
                Fault::TruncatedPrefix { index, have, .. } => {
                    assert_eq!(*index, expected_index, "cut at {cut}");
                    assert!((1..5).contains(have));
                }
                Fault::TruncatedPayload { index, .. } => {
                    assert_eq!(*index, expected_index, "cut at {cut}")
                }
                other => panic!("cut at {cut}: {other}"),
            }
        }
    }

    #[test]
    fn framing_faults_are_named() {
        let check = |body: Vec<u8>, want: &str| {
            let items = parse_all(&body);
            let faults: Vec<String> = items
                .iter()
                .filter_map(|i| match i {
                    Item::Fault(f) => Some(f.to_string()),
                    _ => None,
                })
                .collect();
            assert_eq!(faults, [want], "{items:?}");
        };
        check(
            envelope(0x04, b"{}"),
            "envelope #0 at byte 0: unknown flags 0x04",
        );
        check(
            envelope(FLAG_COMPRESSED, b"{}"),
            "envelope #0 at byte 0: compressed, though no compression was negotiated",
        );
        let mut long = vec![0u8];
        long.extend_from_slice(&(MAX_ENVELOPE + 1).to_be_bytes());
        check(
            long,
            &format!(
                "envelope #0 at byte 0: length {} beyond {MAX_ENVELOPE}",
                MAX_ENVELOPE + 1
            ),
        );
        let mut after = envelope(FLAG_END, b"{}");
        after.extend(envelope(0, b"{}"));
        check(after, "bytes at 7 after the end-of-stream message");
        let mut bad = envelope(0, b"{}");
        bad.extend(envelope(0, b"nope"));
        bad.extend(envelope(FLAG_END, b"{}"));
        let items = parse_all(&bad);
        assert!(
            matches!(
                &items[1],
                Item::Fault(Fault::NotJson {
                    index: 1,
                    offset: 7,
                    ..
                })
            ),
            "{items:?}"
        );
        check(
            envelope(FLAG_END, b"[]"),
            "envelope #0 at byte 0: not JSON (the end-of-stream message must be an object)",
        );
        check(
            Vec::new(),
            "the stream ended after 0 messages without an end-of-stream message",
        );
    }

    #[test]
    fn an_end_of_stream_error_is_an_end_not_a_fault() {
        let body = envelope(
            FLAG_END,
            br#"{"error":{"code":"not_found","message":"no"}}"#,
        );
        assert_eq!(
            parse_all(&body),
            [Item::End(
                json!({"error": {"code": "not_found", "message": "no"}})
            )]
        );
    }
}
