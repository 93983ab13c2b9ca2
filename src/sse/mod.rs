//! Server-sent events: the strict parser and the client that reads a stream with timings.

mod client;
#[cfg(feature = "interop")]
pub mod interop;
mod parser;

pub use client::{EndReason, Stop, StreamRecord, Timed, read_stream, read_stream_signalling};
pub use parser::{Event, Fault, Framing, Item, Parser};
