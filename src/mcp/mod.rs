//! Driving an MCP server under test as an agent does: the client session over a child
//! process's stdio, and the record of what was exchanged.

mod session;

pub use session::{Exchange, McpError, McpSession, ServerCommand, Shutdown, ToolReply};
