//! Protocol profiles: which API a run speaks. A profile decides the scenario catalog, the
//! header that carries a principal's credential, the clause document its scenarios cite, and
//! how the runner learns what a target supports.
//!
//! `/v1` targets say what they support at `GET /v1/capabilities`. E2B has no such endpoint,
//! so an E2B target supports exactly the features the run is told of (`--assume-capability`);
//! a scenario that requires anything else is skipped with that reason, and a skip is never a
//! pass. The Agent Sandbox profile is judged the same way; its own parts (clauses, the
//! launched service, its stand-in's defects) live in [`crate::agent_sandbox`].

use std::path::{Path, PathBuf};

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

/// The E2B clause document; scenarios of the E2B catalog cite its clause IDs.
const E2B_CLAUSES_DOC: &str = include_str!("../docs/profiles/e2b.md");
/// The MCP clause document; scenarios of the MCP catalog cite its clause IDs.
const MCP_CLAUSES_DOC: &str = include_str!("../docs/profiles/mcp.md");

impl Api {
    pub fn name(self) -> &'static str {
        match self {
            Api::V1 => "v1",
            Api::E2b => "e2b",
            Api::Mcp => "mcp",
            Api::AgentSandbox => "agent-sandbox",
        }
    }

    /// The profile's catalog inside the catalog root: the root itself for `/v1`, the folder
    /// named after the profile otherwise.
    pub fn catalog(self, root: &Path) -> PathBuf {
        match self {
            Api::V1 => root.to_owned(),
            Api::E2b => root.join("e2b"),
            Api::Mcp => root.join("mcp"),
            Api::AgentSandbox => root.join(crate::agent_sandbox::CATALOG_FOLDER),
        }
    }

    /// The folders of a catalog root that belong to other profiles than `/v1`.
    pub fn profile_folders() -> &'static [&'static str] {
        &["e2b", "mcp", crate::agent_sandbox::CATALOG_FOLDER]
    }

    /// Whether the target is an E2B control plane (the E2B profile, and the MCP profile's
    /// servers' control plane).
    pub fn speaks_e2b(self) -> bool {
        matches!(self, Api::E2b | Api::Mcp)
    }

    /// Whether the target advertises what it supports (`GET /v1/capabilities`).
    pub fn has_capabilities_endpoint(self) -> bool {
        self == Api::V1
    }

    /// The request header a principal's credential goes in, and its value for `token`.
    pub fn credential(self, token: &str) -> (&'static str, String) {
        match self {
            Api::V1 | Api::AgentSandbox => ("Authorization", format!("Bearer {token}")),
            Api::E2b | Api::Mcp => ("X-API-Key", token.to_owned()),
        }
    }
}

/// Whether `id` is a clause of the E2B clause document: a table row `| E2B-... |` in its
/// "Clauses" section.
pub fn is_e2b_clause(id: &str) -> bool {
    e2b_clauses().any(|c| c == id)
}

/// Every clause ID the E2B clause document defines.
pub fn e2b_clauses() -> impl Iterator<Item = &'static str> {
    clauses_of(E2B_CLAUSES_DOC, "E2B-")
}

/// Whether `id` is a clause of the MCP clause document.
pub fn is_mcp_clause(id: &str) -> bool {
    clauses_of(MCP_CLAUSES_DOC, "MCP-").any(|c| c == id)
}

/// Whether `id` is an MCP clause whose requirement is a MUST (its row says `MUST`).
pub fn is_mcp_must_clause(id: &str) -> bool {
    let row = format!("| `{id}` |");
    is_mcp_clause(id)
        && MCP_CLAUSES_DOC
            .lines()
            .any(|l| l.starts_with(&row) && l.contains(" MUST "))
}

fn clauses_of(doc: &'static str, prefix: &'static str) -> impl Iterator<Item = &'static str> {
    // The first table after the `## Clauses` heading, and nothing else of the page.
    doc.lines()
        .skip_while(|line| *line != "## Clauses")
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .filter_map(move |line| {
            let rest = line.strip_prefix("| `")?;
            let (id, _) = rest.split_once('`')?;
            id.starts_with(prefix).then_some(id)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_e2b_document_defines_clauses_and_only_those_count() {
        assert!(e2b_clauses().count() >= 10);
        assert!(is_e2b_clause("E2B-AUTH-1"));
        assert!(!is_e2b_clause("E2B-AUTH-999"));
        assert!(!is_e2b_clause("SBX-3.1"));
        // The catalog's table further down names scenarios, not clauses.
        assert!(!is_e2b_clause("E2B-LIFE-001"));
    }

    #[test]
    fn credentials_go_where_the_profile_puts_them() {
        assert_eq!(
            Api::V1.credential("t"),
            ("Authorization", "Bearer t".into())
        );
        assert_eq!(Api::E2b.credential("t"), ("X-API-Key", "t".into()));
        assert_eq!(
            Api::AgentSandbox.credential("t"),
            ("Authorization", "Bearer t".into())
        );
    }
}
