//! The protocol's clauses, read from `docs/protocol.md` as it was when the runner was built:
//! what a scenario may cite, and what clause coverage is measured against.
//!
//! A clause is a line `- **<ID>** (MUST|SHOULD) ...` of that document (its "How to read"
//! section defines the shape). A clause whose text is marked `*withdrawn*` keeps its ID but
//! can no longer be cited and is not counted.

use std::sync::LazyLock;

use super::model::Level;

/// The normative document, embedded so the runner and its checks agree with the text.
pub const PROTOCOL_MD: &str = include_str!("../../docs/protocol.md");

/// One numbered clause of the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clause {
    /// `SBX-3.4`.
    pub id: String,
    pub level: Level,
    /// Marked `*withdrawn*`: kept for its ID, no longer a rule.
    pub withdrawn: bool,
}

static CLAUSES: LazyLock<Vec<Clause>> = LazyLock::new(|| parse_clauses(PROTOCOL_MD));

/// Every clause of `docs/protocol.md`, in document order.
pub fn protocol_clauses() -> &'static [Clause] {
    &CLAUSES
}

/// The clause with this ID, if the protocol has one.
pub fn clause(id: &str) -> Option<&'static Clause> {
    CLAUSES.iter().find(|c| c.id == id)
}

/// IDs of the MUST clauses in force (not withdrawn), in document order.
pub fn must_clauses() -> impl Iterator<Item = &'static str> {
    CLAUSES
        .iter()
        .filter(|c| c.level == Level::Must && !c.withdrawn)
        .map(|c| c.id.as_str())
}

/// The clause lines of a protocol document. Lines inside fenced code blocks (the format's
/// own example) are not clauses.
pub fn parse_clauses(text: &str) -> Vec<Clause> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let Some(rest) = line.strip_prefix("- **") else {
            continue;
        };
        let Some((id, rest)) = rest.split_once("** (") else {
            continue;
        };
        if !is_clause_id(id) {
            continue;
        }
        let level = if rest.starts_with("MUST)") {
            Level::Must
        } else if rest.starts_with("SHOULD)") {
            Level::Should
        } else {
            continue;
        };
        out.push(Clause {
            id: id.to_owned(),
            level,
            withdrawn: rest.contains("*withdrawn*"),
        });
    }
    out
}

/// `<AREA>-<section>.<n>`: upper-case letters, a dash, two dot-separated numbers.
fn is_clause_id(id: &str) -> bool {
    let Some((area, number)) = id.split_once('-') else {
        return false;
    };
    let Some((section, n)) = number.split_once('.') else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    !area.is_empty() && area.bytes().all(|b| b.is_ascii_uppercase()) && digits(section) && digits(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clause_lines_are_recognised_and_examples_are_not() {
        let text = "intro\n\n```\n- **SBX-3.4** (MUST) an example\n```\n\
            - **CONV-1.1** (MUST) a rule\n  continued\n\
            - **CONV-1.2** (SHOULD) advice\n\
            - **CONV-1.3** (MUST) *withdrawn* replaced by CONV-1.4\n\
            - **bad-1.1** (MUST) not an ID\n\
            - **CONV-1.5** (MAY) not a level\n\
            | CONV-1.1 | MUST | an index row |\n";
        let got = parse_clauses(text);
        let want = [
            ("CONV-1.1", Level::Must, false),
            ("CONV-1.2", Level::Should, false),
            ("CONV-1.3", Level::Must, true),
        ];
        let got: Vec<_> = got
            .iter()
            .map(|c| (c.id.as_str(), c.level, c.withdrawn))
            .collect();
        assert_eq!(got, want);
    }

    /// The clause lines and the document's own clause index agree: same IDs, same levels,
    /// same order, and the totals its heading states.
    #[test]
    fn the_protocol_clauses_match_its_clause_index() {
        let (_, index) = PROTOCOL_MD
            .split_once("\n## Clause index\n")
            .expect("docs/protocol.md has a clause index");
        let rows: Vec<(String, Level)> = index
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                let level = match cells.get(2) {
                    Some(&"MUST") => Level::Must,
                    Some(&"SHOULD") => Level::Should,
                    _ => return None,
                };
                Some((cells[1].to_owned(), level))
            })
            .collect();
        let clauses: Vec<(String, Level)> = protocol_clauses()
            .iter()
            .map(|c| (c.id.clone(), c.level))
            .collect();
        assert_eq!(clauses, rows);
        let must = clauses.iter().filter(|c| c.1 == Level::Must).count();
        let stated = format!(
            "{} clauses: {must} MUST, {} SHOULD.",
            clauses.len(),
            clauses.len() - must
        );
        assert!(index.contains(&stated), "the index heading says {stated}");
        assert_eq!(must_clauses().count(), must);
        assert!(clause("SBX-3.4").is_some_and(|c| c.level == Level::Must));
        assert!(clause("SBX-3.99").is_none());
    }
}
