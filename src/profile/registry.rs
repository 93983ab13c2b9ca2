//! Which profile each `--api` value is, and the questions asked of all profiles at once: the
//! catalog folders that are not `/v1`'s, and which document a cited clause belongs to.

use std::path::{Path, PathBuf};

use super::agent_sandbox::AgentSandbox;
use super::api::Api;
use super::binding::{Clauses, Defects, Profile};
use super::clauses::Level;
use super::e2b::E2b;
use super::mcp::Mcp;
use super::v1::V1;

impl Api {
    /// The profile this value selects.
    pub fn profile(self) -> &'static dyn Profile {
        match self {
            Api::V1 => &V1,
            Api::E2b => &E2b,
            Api::Mcp => &Mcp,
            Api::AgentSandbox => &AgentSandbox,
        }
    }

    /// The profile's catalog inside the catalog root: the folder named after the profile,
    /// or the root itself for `/v1`.
    pub fn catalog(self, root: &Path) -> PathBuf {
        match self.profile().catalog_folder() {
            Some(folder) => root.join(folder),
            None => root.to_owned(),
        }
    }

    /// The request header a principal's credential goes in, and its value for `token`.
    pub fn credential(self, token: &str) -> (&'static str, String) {
        self.profile().credential(token)
    }
}

/// The folders of a catalog root that are other profiles' catalogs, not `/v1`'s.
pub fn profile_folders() -> impl Iterator<Item = &'static str> {
    Api::ALL
        .into_iter()
        .filter_map(|api| api.profile().catalog_folder())
}

/// The profile whose document a clause ID belongs to: the one whose clause table has its
/// prefix, else `/v1`'s `docs/protocol.md`.
fn profile_of_clause(id: &str) -> &'static dyn Profile {
    Api::ALL
        .into_iter()
        .map(Api::profile)
        .find(|p| matches!(p.clauses(), Clauses::Table(t) if id.starts_with(t.prefix)))
        .unwrap_or(&V1)
}

/// The level of a clause a scenario cites, or why it cannot be cited.
pub fn clause_level(id: &str) -> Result<Level, String> {
    match profile_of_clause(id).clauses() {
        Clauses::Table(table) => table
            .level(id)
            .ok_or_else(|| format!("clause `{id}` is not defined in {}", table.path)),
        Clauses::Protocol => match super::v1::clause(id) {
            None => Err(format!(
                "clause `{id}` is not a clause of docs/protocol.md (IDs look like `SBX-3.4`)"
            )),
            Some(known) if known.withdrawn => {
                Err(format!("clause `{id}` is withdrawn in docs/protocol.md"))
            }
            Some(known) => Ok(known.level),
        },
    }
}

/// The defects the negative controls of a scenario citing `clauses` may name: a stand-in's
/// when any clause is of a profile judged through one, the reference server's otherwise.
pub fn defects_for<'a>(clauses: impl IntoIterator<Item = &'a str>) -> Defects {
    clauses
        .into_iter()
        .map(|id| profile_of_clause(id).defects())
        .find(|d| matches!(d, Defects::StandIn(_)))
        .unwrap_or(Defects::Reference)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_names_its_own_profile() {
        for api in Api::ALL {
            assert_eq!(api.profile().api(), api, "{}", api.name());
        }
        let folders: Vec<&str> = profile_folders().collect();
        assert_eq!(folders, ["e2b", "mcp", "agent-sandbox"]);
    }

    #[test]
    fn a_clause_is_judged_by_its_own_document() {
        assert_eq!(clause_level("SBX-3.4"), Ok(Level::Must));
        assert_eq!(clause_level("E2B-AUTH-1"), Ok(Level::Must));
        assert_eq!(clause_level("ASB-AUTH-1"), Ok(Level::Must));
        assert!(clause_level("MCP-1").is_ok());
        assert_eq!(
            clause_level("E2B-AUTH-999"),
            Err("clause `E2B-AUTH-999` is not defined in docs/profiles/e2b.md".into())
        );
        // The catalog's table further down names scenarios, not clauses.
        assert!(clause_level("E2B-LIFE-001").is_err());
        assert!(clause_level("ASB-AUTH-001").is_err());
        assert!(clause_level("SBX-3.99").is_err());
    }

    #[test]
    fn credentials_go_where_the_profile_puts_them() {
        assert_eq!(
            Api::V1.credential("t"),
            ("Authorization", "Bearer t".into())
        );
        assert_eq!(Api::E2b.credential("t"), ("X-API-Key", "t".into()));
        assert_eq!(Api::Mcp.credential("t"), ("X-API-Key", "t".into()));
        assert_eq!(
            Api::AgentSandbox.credential("t"),
            ("Authorization", "Bearer t".into())
        );
    }

    #[test]
    fn only_an_agent_sandbox_clause_takes_the_stand_in_defects() {
        assert!(matches!(defects_for(["SBX-3.4"]), Defects::Reference));
        assert!(matches!(defects_for(["E2B-AUTH-1"]), Defects::Reference));
        assert!(matches!(
            defects_for(["ASB-AUTH-1", "SBX-3.4"]),
            Defects::StandIn(_)
        ));
    }
}
