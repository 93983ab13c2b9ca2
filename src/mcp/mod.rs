//! Driving an MCP server under test as an agent does: the client session over a child
//! process's stdio, and the record of what was exchanged.

mod session;
pub mod toolmap;

pub use session::{Exchange, McpError, McpSession, RunSession, ServerCommand, Shutdown, ToolReply};
pub use toolmap::{Action, ToolMap};

/// The MCP server a run drives (`--mcp-server`) and the map of its tools (`--tool-map`).
#[derive(Debug, Clone)]
pub struct McpServer {
    /// How to start it; the map's environment is added per session.
    pub command: ServerCommand,
    pub map: ToolMap,
}
