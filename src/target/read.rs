//! Bounded reads of everything a target sends: response bodies (event streams and Connect
//! streams included), SSE lines and events, Connect messages, an MCP server's messages on its
//! stdout, and the lines a launched service or the reference server prints. Every read path
//! goes through the one [`Meter`] here, which counts bytes as they arrive and refuses the
//! read that takes a unit over its cap, so a target that never stops sending costs the runner
//! at most the cap, and the step that read it fails with the size in its reason.
//!
//! Two caps, both settable: `--max-body-bytes` for a whole response body, and
//! `--max-event-bytes` for one SSE line or event, one Connect message and one MCP message. A
//! line of a child's output is kept up to [`MAX_OUTPUT_LINE_BYTES`] and the rest of it read
//! and dropped: it only ever serves an error message.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncBufRead, AsyncBufReadExt as _, AsyncRead, ReadBuf};

/// The default of `--max-body-bytes`: 64 MiB. The largest answers of the catalogs are a
/// process's whole output (`limits.max_process_output_bytes`, 4 MiB on the reference server;
/// 4,194,379 bytes for PRC-TRUNC-001), sixteen times less.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 64 * 1024 * 1024;

/// The default of `--max-event-bytes`: 16 MiB. The largest legitimate units are an output
/// chunk's event (64 KiB of output, JSON-escaped), a Connect message (envd's own limit is
/// 4 MiB) and an MCP tool result holding a process's output (4 MiB); the MCP SDK's own line
/// limit is the same 16 MiB.
pub const DEFAULT_MAX_EVENT_BYTES: u64 = 16 * 1024 * 1024;

/// What is kept of one line of a child's output (a launched service, the reference server).
pub const MAX_OUTPUT_LINE_BYTES: u64 = 4096;

/// The caps of a run (`--max-body-bytes`, `--max-event-bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLimits {
    /// A whole response body, a stream's included.
    pub body: u64,
    /// One SSE line or event, one Connect message, one MCP message.
    pub event: u64,
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits {
            body: DEFAULT_MAX_BODY_BYTES,
            event: DEFAULT_MAX_EVENT_BYTES,
        }
    }
}

/// What a cap counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Body,
    SseLine,
    SseEvent,
    ConnectMessage,
    McpMessage,
    OutputLine,
}

impl Unit {
    fn noun(self) -> &'static str {
        match self {
            Unit::Body => "the response body",
            Unit::SseLine => "an SSE line",
            Unit::SseEvent => "an SSE event",
            Unit::ConnectMessage => "a Connect message",
            Unit::McpMessage => "an MCP message",
            Unit::OutputLine => "a line of output",
        }
    }

    fn flag(self) -> &'static str {
        match self {
            Unit::Body => "--max-body-bytes",
            Unit::SseLine | Unit::SseEvent | Unit::ConnectMessage | Unit::McpMessage => {
                "--max-event-bytes"
            }
            Unit::OutputLine => "the output line cap",
        }
    }
}

/// A unit that crossed its cap: where, the cap, and how much had arrived (or was declared).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooLarge {
    pub unit: Unit,
    pub limit: u64,
    /// Bytes of the unit read when the read was refused.
    pub seen: u64,
    /// The size the sender declared in advance (a Content-Length, a Connect envelope's
    /// length), when it declared one over the cap: nothing of it was read.
    pub declared: Option<u64>,
}

impl std::fmt::Display for TooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (noun, flag, limit) = (self.unit.noun(), self.unit.flag(), self.limit);
        match self.declared {
            Some(n) => write!(
                f,
                "{noun} declares {n} bytes, over {flag} ({limit} bytes): not read, connection closed"
            ),
            None => write!(
                f,
                "{noun} exceeds {flag} ({limit} bytes): stopped at {} bytes, connection closed",
                self.seen
            ),
        }
    }
}

impl std::error::Error for TooLarge {}

/// How a byte stream divides into the units one cap holds for, besides the whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Only the whole counts.
    Whole,
    /// Server-sent events: lines (ended by CR, LF or CRLF) and events (the field lines of
    /// one block, up to the blank line that dispatches it; comments do not count).
    Sse,
    /// Connect envelopes: a flags byte, a 4-byte big-endian length, the message.
    Connect,
    /// Newline-ended JSON-RPC messages (MCP over stdio).
    McpLines,
    /// Newline-ended lines of a child's output.
    OutputLines,
}

impl Framing {
    /// The framing of a response body by its content type: an event stream's lines and
    /// events, a Connect stream's envelopes, or the whole.
    pub fn of_content_type(content_type: &str) -> Framing {
        let ct = content_type.trim_start().to_ascii_lowercase();
        if ct.starts_with("text/event-stream") {
            Framing::Sse
        } else if ct.starts_with("application/connect+") {
            Framing::Connect
        } else {
            Framing::Whole
        }
    }
}

#[derive(Debug, Clone)]
enum FrameState {
    Whole,
    Sse {
        line: u64,
        event: u64,
        after_cr: bool,
        comment: bool,
    },
    Connect {
        header: [u8; 5],
        have: usize,
        remaining: u64,
    },
    Lines {
        unit: Unit,
        line: u64,
    },
}

/// Counts the bytes of a stream as they arrive, by its framing, and refuses the bytes that
/// take the whole or one unit over its cap. Every bounded read of the runner goes through
/// one. Once it has refused, it refuses everything after.
#[derive(Debug, Clone)]
pub struct Meter {
    limits: ReadLimits,
    /// Cap on the whole; `None` for a child's stdio, which lives as long as the session.
    whole: Option<u64>,
    total: u64,
    frame: FrameState,
    tripped: Option<TooLarge>,
}

impl Meter {
    /// A meter for a response body of this framing: the body cap on the whole, the event cap
    /// on each unit.
    pub fn body(limits: ReadLimits, framing: Framing) -> Meter {
        Meter {
            whole: Some(limits.body),
            ..Meter::stream(limits, framing)
        }
    }

    /// A meter for a child's stdio: no cap on the whole, the event cap on each message (or
    /// [`MAX_OUTPUT_LINE_BYTES`] on each line of output).
    pub fn stream(limits: ReadLimits, framing: Framing) -> Meter {
        let frame = match framing {
            Framing::Whole => FrameState::Whole,
            Framing::Sse => FrameState::Sse {
                line: 0,
                event: 0,
                after_cr: false,
                comment: false,
            },
            Framing::Connect => FrameState::Connect {
                header: [0; 5],
                have: 0,
                remaining: 0,
            },
            Framing::McpLines => FrameState::Lines {
                unit: Unit::McpMessage,
                line: 0,
            },
            Framing::OutputLines => FrameState::Lines {
                unit: Unit::OutputLine,
                line: 0,
            },
        };
        Meter {
            limits,
            whole: None,
            total: 0,
            frame,
            tripped: None,
        }
    }

    /// Bytes taken so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// What the meter refused, if it refused anything.
    pub fn tripped(&self) -> Option<&TooLarge> {
        self.tripped.as_ref()
    }

    /// Takes the next bytes of the stream, or refuses them when they take the whole or a unit
    /// over its cap.
    pub fn take(&mut self, chunk: &[u8]) -> Result<(), TooLarge> {
        if let Some(t) = &self.tripped {
            return Err(t.clone());
        }
        let result = self.count(chunk);
        if let Err(t) = &result {
            self.tripped = Some(t.clone());
        }
        result
    }

    fn count(&mut self, chunk: &[u8]) -> Result<(), TooLarge> {
        let n = chunk.len() as u64;
        if let Some(limit) = self.whole
            && self.total + n > limit
        {
            return Err(TooLarge {
                unit: Unit::Body,
                limit,
                seen: self.total + n,
                declared: None,
            });
        }
        self.total += n;
        let event = self.limits.event;
        match &mut self.frame {
            FrameState::Whole => Ok(()),
            FrameState::Sse {
                line,
                event: block,
                after_cr,
                comment,
            } => {
                for &b in chunk {
                    if *after_cr {
                        *after_cr = false;
                        if b == b'\n' {
                            continue;
                        }
                    }
                    if b == b'\r' || b == b'\n' {
                        *after_cr = b == b'\r';
                        if *line == 0 {
                            // A blank line dispatches the block.
                            *block = 0;
                        }
                        *line = 0;
                        continue;
                    }
                    if *line == 0 {
                        *comment = b == b':';
                    }
                    *line += 1;
                    if *line > event {
                        return Err(TooLarge {
                            unit: Unit::SseLine,
                            limit: event,
                            seen: *line,
                            declared: None,
                        });
                    }
                    if !*comment {
                        *block += 1;
                        if *block > event {
                            return Err(TooLarge {
                                unit: Unit::SseEvent,
                                limit: event,
                                seen: *block,
                                declared: None,
                            });
                        }
                    }
                }
                Ok(())
            }
            FrameState::Connect {
                header,
                have,
                remaining,
            } => {
                let mut rest = chunk;
                while !rest.is_empty() {
                    if *remaining > 0 {
                        let skip = (*remaining).min(rest.len() as u64);
                        *remaining -= skip;
                        rest = &rest[usize::try_from(skip).unwrap_or(rest.len())..];
                        continue;
                    }
                    header[*have] = rest[0];
                    *have += 1;
                    rest = &rest[1..];
                    if *have == header.len() {
                        *have = 0;
                        let len = u64::from(u32::from_be_bytes([
                            header[1], header[2], header[3], header[4],
                        ]));
                        if len > event {
                            return Err(TooLarge {
                                unit: Unit::ConnectMessage,
                                limit: event,
                                seen: 0,
                                declared: Some(len),
                            });
                        }
                        *remaining = len;
                    }
                }
                Ok(())
            }
            FrameState::Lines { unit, line } => {
                let limit = match unit {
                    Unit::OutputLine => MAX_OUTPUT_LINE_BYTES,
                    _ => event,
                };
                for &b in chunk {
                    if b == b'\n' {
                        *line = 0;
                        continue;
                    }
                    *line += 1;
                    if *line > limit {
                        return Err(TooLarge {
                            unit: *unit,
                            limit,
                            seen: *line,
                            declared: None,
                        });
                    }
                }
                Ok(())
            }
        }
    }
}

/// A one-line description of a transport error, with its innermost cause.
pub fn describe_reqwest(e: &reqwest::Error) -> String {
    let mut source: &dyn std::error::Error = e;
    while let Some(next) = source.source() {
        source = next;
    }
    let kind = if e.is_connect() {
        "cannot connect"
    } else if e.is_timeout() {
        "timed out"
    } else {
        "request failed"
    };
    format!("{kind}: {source}")
}

/// Why a bounded read of a response body ended without the body.
#[derive(Debug)]
pub enum ReadError {
    /// The body, or a unit of it, crossed its cap.
    TooLarge(TooLarge),
    /// No bytes arrived for `after` (the per-read wait).
    Stalled { read: u64, after: Duration },
    /// The body broke (connection reset, decoding error).
    Transport(reqwest::Error),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::TooLarge(t) => t.fmt(f),
            ReadError::Stalled { read, after } => write!(
                f,
                "the response body stalled: no bytes for {}s after {read} bytes",
                after.as_secs_f64()
            ),
            ReadError::Transport(e) => f.write_str(&describe_reqwest(e)),
        }
    }
}

/// A response's body, read chunk by chunk through a [`Meter`]: every chunk is counted before
/// it is handed on, so nothing past a cap is ever kept. Dropping it closes the connection.
pub struct BoundedBody {
    response: reqwest::Response,
    meter: Meter,
}

impl BoundedBody {
    /// Reads `response`'s body under the body cap and, by the framing its content type
    /// names ([`Framing::of_content_type`]), the event cap. A body whose declared length is
    /// over the cap is refused before anything of it is read.
    pub fn new(response: reqwest::Response, limits: ReadLimits) -> Result<BoundedBody, TooLarge> {
        let framing = Framing::of_content_type(
            response
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or(""),
        );
        if let Some(declared) = response.content_length()
            && declared > limits.body
        {
            return Err(TooLarge {
                unit: Unit::Body,
                limit: limits.body,
                seen: 0,
                declared: Some(declared),
            });
        }
        Ok(BoundedBody {
            response,
            meter: Meter::body(limits, framing),
        })
    }

    /// The next chunk, counted; `None` at the end of the body.
    pub async fn next(&mut self) -> Option<Result<Bytes, ReadError>> {
        match self.response.chunk().await {
            Ok(None) => None,
            Ok(Some(chunk)) => Some(
                self.meter
                    .take(&chunk)
                    .map(|()| chunk)
                    .map_err(ReadError::TooLarge),
            ),
            Err(e) => Some(Err(ReadError::Transport(e))),
        }
    }

    /// [`BoundedBody::next`], waiting at most `stall` for it.
    pub async fn next_within(&mut self, stall: Duration) -> Option<Result<Bytes, ReadError>> {
        match tokio::time::timeout(stall, self.next()).await {
            Ok(next) => next,
            Err(_) => Some(Err(ReadError::Stalled {
                read: self.meter.total(),
                after: stall,
            })),
        }
    }

    /// Bytes read so far.
    pub fn read(&self) -> u64 {
        self.meter.total()
    }
}

/// Reads `response`'s whole body under the body cap, each read waiting at most `stall` (no
/// wait of its own when `None`: the request's timeout bounds it).
pub async fn read_body(
    response: reqwest::Response,
    limits: ReadLimits,
    stall: Option<Duration>,
) -> Result<Bytes, ReadError> {
    let mut body = BoundedBody::new(response, limits).map_err(ReadError::TooLarge)?;
    let mut out = bytes::BytesMut::new();
    loop {
        let next = match stall {
            Some(stall) => body.next_within(stall).await,
            None => body.next().await,
        };
        match next {
            None => return Ok(out.freeze()),
            Some(Ok(chunk)) => out.extend_from_slice(&chunk),
            Some(Err(e)) => return Err(e),
        }
    }
}

/// A child's stdout read through a [`Meter`]: a read that takes a message over its cap fails
/// with an `InvalidData` error (and every read after it), and what was refused is kept in a
/// [`Tripped`] for the error message the reader of the messages cannot give.
pub struct CappedReader<R> {
    inner: R,
    meter: Meter,
    tripped: Tripped,
}

/// What a [`CappedReader`] refused, seen from outside it.
#[derive(Debug, Clone, Default)]
pub struct Tripped(Arc<Mutex<Option<TooLarge>>>);

impl Tripped {
    /// The refusal, if the reader refused anything.
    pub fn get(&self) -> Option<TooLarge> {
        self.0.lock().expect("tripped lock").clone()
    }
}

impl<R> CappedReader<R> {
    pub fn new(inner: R, meter: Meter) -> (CappedReader<R>, Tripped) {
        let tripped = Tripped::default();
        (
            CappedReader {
                inner,
                meter,
                tripped: tripped.clone(),
            },
            tripped,
        )
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for CappedReader<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(t) = this.meter.tripped() {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, t.clone())));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let fresh = &buf.filled()[before..];
                match this.meter.take(fresh) {
                    Ok(()) => Poll::Ready(Ok(())),
                    Err(t) => {
                        // Nothing of the refused bytes is handed on.
                        buf.set_filled(before);
                        *this.tripped.0.lock().expect("tripped lock") = Some(t.clone());
                        Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, t)))
                    }
                }
            }
            other => other,
        }
    }
}

/// One line of a child's output as kept: at most [`MAX_OUTPUT_LINE_BYTES`] of it, lossily
/// decoded, and how long it was when it was longer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputLine {
    pub text: String,
    /// The line's length when it was longer than the kept part: its whole length, or with
    /// [`OutputLine::ended`] false, what had been read of it when reading stopped.
    pub cut_from: Option<u64>,
    /// The line was read to its end.
    pub ended: bool,
}

impl OutputLine {
    /// The line as a log shows it: a cut line says so.
    pub fn shown(&self) -> String {
        match (self.cut_from, self.ended) {
            (Some(n), true) => format!("{}… (a line of {n} bytes, cut)", self.text),
            (Some(n), false) => format!("{}… (a line of more than {n} bytes, cut)", self.text),
            (None, _) => self.text.clone(),
        }
    }
}

/// Reads the next line of a child's output (without its `\n`), keeping what the output line
/// cap allows and reading the rest of a longer line without keeping it. `None` at EOF.
pub async fn next_output_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
) -> io::Result<Option<OutputLine>> {
    output_line(reader, true).await
}

/// [`next_output_line`], but a line longer than the cap is given back at once, cut, the rest
/// of it left unread: for a line that must be short (a server's `listening on`).
pub async fn next_short_output_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
) -> io::Result<Option<OutputLine>> {
    output_line(reader, false).await
}

async fn output_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    whole: bool,
) -> io::Result<Option<OutputLine>> {
    let mut meter = Meter::stream(ReadLimits::default(), Framing::OutputLines);
    let mut kept = Vec::new();
    let mut length = 0u64;
    let mut cut = false;
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Ok((length > 0).then(|| finish(&kept, length, cut, true)));
        }
        let newline = available.iter().position(|&b| b == b'\n');
        let part = &available[..newline.unwrap_or(available.len())];
        length += part.len() as u64;
        if !cut {
            match meter.take(part) {
                Ok(()) => kept.extend_from_slice(part),
                Err(_) => {
                    let room = usize::try_from(MAX_OUTPUT_LINE_BYTES).unwrap_or(0) - kept.len();
                    kept.extend_from_slice(&part[..room.min(part.len())]);
                    cut = true;
                }
            }
        }
        let consumed = newline.map_or(available.len(), |i| i + 1);
        reader.consume(consumed);
        if newline.is_some() {
            return Ok(Some(finish(&kept, length, cut, true)));
        }
        if cut && !whole {
            return Ok(Some(finish(&kept, length, cut, false)));
        }
    }
}

fn finish(kept: &[u8], length: u64, cut: bool, ended: bool) -> OutputLine {
    let text = String::from_utf8_lossy(kept);
    OutputLine {
        text: text.trim_end_matches('\r').to_owned(),
        cut_from: cut.then_some(length),
        ended,
    }
}

/// Parses a byte size: a number with an optional `K`, `M` or `G` suffix (powers of 1024,
/// `KiB` and `KB` alike), more than zero.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let suffix = t[digits.len()..].to_ascii_lowercase();
    let unit: u64 = match suffix.as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => {
            return Err(format!(
                "`{s}`: expected a number of bytes, e.g. 65536, 64K, 16M, 1G"
            ));
        }
    };
    let n: u64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("`{s}`: expected a number of bytes, e.g. 65536, 64K, 16M, 1G"))?;
    let bytes = n
        .checked_mul(unit)
        .ok_or_else(|| format!("`{s}` is too large"))?;
    if bytes == 0 {
        return Err("the size must be more than 0 bytes".into());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(body: u64, event: u64) -> ReadLimits {
        ReadLimits { body, event }
    }

    #[test]
    fn a_body_is_refused_at_the_byte_that_crosses_its_cap() {
        let mut m = Meter::body(limits(10, 100), Framing::Whole);
        assert!(m.take(b"0123456789").is_ok());
        let t = m.take(b"x").unwrap_err();
        assert_eq!((t.unit, t.limit, t.seen), (Unit::Body, 10, 11));
        assert!(t.to_string().contains("--max-body-bytes (10 bytes)"), "{t}");
        // Refused for good.
        assert!(m.take(b"").is_err());
    }

    #[test]
    fn sse_lines_and_events_are_counted_across_every_line_ending_and_split() {
        // Lines of 4 bytes, events of two 4-byte lines; comments do not count to events.
        let stream: &[u8] = b"id:1\r\ndata\r\rdat2\rdat3\n\n: ok\n: ok\n: ok\ndata\n\n";
        for split in 0..=stream.len() {
            let mut m = Meter::body(limits(1000, 8), Framing::Sse);
            m.take(&stream[..split]).unwrap();
            m.take(&stream[split..]).unwrap();
        }
        let mut m = Meter::body(limits(1000, 4), Framing::Sse);
        let t = m.take(b"data: 5").unwrap_err();
        assert_eq!((t.unit, t.seen), (Unit::SseLine, 5));
        let mut m = Meter::body(limits(1000, 8), Framing::Sse);
        let t = m.take(b"data:123\ndata:").unwrap_err();
        assert_eq!((t.unit, t.seen), (Unit::SseEvent, 9));
        // A CR then an LF in the next chunk is one line ending, not a blank line.
        let mut m = Meter::body(limits(1000, 8), Framing::Sse);
        m.take(b"data:123\r").unwrap();
        let t = m.take(b"\ndata").unwrap_err();
        assert_eq!(t.unit, Unit::SseEvent);
    }

    #[test]
    fn a_connect_envelope_over_the_cap_is_refused_by_its_declared_length() {
        let mut m = Meter::body(limits(1000, 8), Framing::Connect);
        let mut ok = vec![0, 0, 0, 0, 8];
        ok.extend_from_slice(b"12345678");
        for b in &ok {
            m.take(std::slice::from_ref(b)).unwrap();
        }
        let t = m.take(&[2, 0, 0, 0, 9]).unwrap_err();
        assert_eq!((t.unit, t.declared), (Unit::ConnectMessage, Some(9)));
        assert!(t.to_string().contains("declares 9 bytes"), "{t}");
    }

    #[test]
    fn stdio_lines_have_no_whole_cap() {
        let mut m = Meter::stream(limits(1, 4), Framing::McpLines);
        for _ in 0..100 {
            m.take(b"abcd\n").unwrap();
        }
        assert_eq!(m.take(b"abcde").unwrap_err().unit, Unit::McpMessage);
    }

    #[tokio::test]
    async fn a_capped_reader_fails_the_read_that_crosses_and_says_why() {
        use tokio::io::AsyncReadExt as _;
        let data = [b'x'; 100];
        let (mut r, tripped) =
            CappedReader::new(&data[..], Meter::stream(limits(1, 10), Framing::McpLines));
        let mut out = Vec::new();
        let err = r.read_to_end(&mut out).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(out.len() <= 10, "{}", out.len());
        assert_eq!(tripped.get().unwrap().unit, Unit::McpMessage);
    }

    #[tokio::test]
    async fn output_lines_are_kept_up_to_the_cap_and_the_rest_is_skipped() {
        let mut text = b"short\r\n".to_vec();
        text.extend(std::iter::repeat_n(b'y', 100_000));
        text.extend_from_slice(b"\nlast");
        let mut r = tokio::io::BufReader::with_capacity(1000, &text[..]);
        let first = next_output_line(&mut r).await.unwrap().unwrap();
        assert_eq!((first.text.as_str(), first.cut_from), ("short", None));
        assert!(first.ended);
        let long = next_output_line(&mut r).await.unwrap().unwrap();
        assert_eq!(long.text.len() as u64, MAX_OUTPUT_LINE_BYTES);
        assert_eq!(long.cut_from, Some(100_000));
        assert!(long.shown().ends_with("(a line of 100000 bytes, cut)"));
        let last = next_output_line(&mut r).await.unwrap().unwrap();
        assert_eq!(last.text, "last");
        assert_eq!(next_output_line(&mut r).await.unwrap(), None);
        // A line that must be short is given back as soon as it is too long.
        let mut r = tokio::io::BufReader::with_capacity(1000, &text[7..]);
        let long = next_short_output_line(&mut r).await.unwrap().unwrap();
        assert!(!long.ended && long.cut_from.unwrap() < 100_000, "{long:?}");
        assert!(long.shown().contains("(a line of more than "));
    }

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("16MiB"), Ok(16 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        for bad in ["", "0", "12X", "M", "-1", "99999999999999999999G"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
