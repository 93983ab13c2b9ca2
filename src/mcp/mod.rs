//! Driving an MCP server under test as an agent does: the client session over a child
//! process's stdio or over streamable HTTP, and the record of what was exchanged.

mod http;
mod session;
pub mod toolmap;

pub use http::{MAX_ERROR_BODY, MAX_REQUESTS, MAX_RESUME_DELAY, MAX_RESUMES};
pub use session::{
    Exchange, HttpServer, McpError, McpSession, RunSession, ServerCommand, Shutdown, ToolReply,
};
pub use toolmap::{Action, ToolMap};

/// The MCP server a run drives and the map of its tools (`--tool-map`).
#[derive(Debug, Clone)]
pub struct McpServer {
    pub transport: McpTransport,
    pub map: ToolMap,
}

/// How the run reaches the MCP server under test.
#[derive(Debug, Clone)]
pub enum McpTransport {
    /// A process per session, started with this command (`--mcp-server`), speaking on its
    /// stdio; the map's environment, naming the run's control plane, is added per session.
    Stdio(ServerCommand),
    /// A server already running, at this URL (`--mcp-url`), configured with its control plane
    /// by whoever started it; each session is an HTTP session of its own.
    Http(HttpServer),
}

impl McpServer {
    /// Whether the server is told its control plane by the run, per session (stdio), and so
    /// follows the run onto a deployment the runner starts for one scenario. A server over
    /// HTTP keeps the control plane it was started with.
    pub fn follows_deployment(&self) -> bool {
        matches!(self.transport, McpTransport::Stdio(_))
    }
}

/// How the command line names the MCP server under test, before anything is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum McpServerSpec {
    /// `--mcp-server "<command line>"`.
    Command(String),
    /// `--mcp-url URL [--mcp-token-env NAME]`.
    Url {
        url: String,
        token_env: Option<String>,
    },
}

impl McpServerSpec {
    /// The flag that named it, for messages.
    pub fn flag(&self) -> &'static str {
        match self {
            McpServerSpec::Command(_) => "--mcp-server",
            McpServerSpec::Url { .. } => "--mcp-url",
        }
    }
}
