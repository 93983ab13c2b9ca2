//! `--api`: the protocol profiles a run can speak, by name. Which profile each one is, is
//! the registry's business ([`super::registry`]).

/// The protocol a run speaks (`--api`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Api {
    /// sandspec's own `/v1` contract (`docs/protocol.md`).
    #[default]
    V1,
    /// E2B's control plane and envd (`docs/profiles/e2b.md`).
    E2b,
    /// A sandbox MCP server driven over its stdio, checked on an E2B control plane
    /// (`docs/profiles/mcp.md`).
    Mcp,
    /// The Agent Sandbox runtime service, `agent-sandbox-server`
    /// (`docs/profiles/agent-sandbox.md`).
    AgentSandbox,
}

impl Api {
    /// Every profile, in the order `--help` lists them.
    pub const ALL: [Api; 4] = [Api::V1, Api::E2b, Api::Mcp, Api::AgentSandbox];

    pub fn name(self) -> &'static str {
        match self {
            Api::V1 => "v1",
            Api::E2b => "e2b",
            Api::Mcp => "mcp",
            Api::AgentSandbox => "agent-sandbox",
        }
    }
}
