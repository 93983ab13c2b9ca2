//! Clause documents: what a scenario may cite, and what clause coverage is measured against.
//!
//! Two shapes. `docs/protocol.md`, sandspec's own contract, writes each clause as a line
//! `- **<ID>** (MUST|SHOULD) ...` (its "How to read" section defines the shape); a clause whose
//! text is marked `*withdrawn*` keeps its ID but can no longer be cited and is not counted.
//! A protocol profile's document (`docs/profiles/<profile>.md`) writes its clauses as the rows
//! of the first table after its `## Clauses` heading, `| \`<PREFIX>...\` | ... |`.

/// Requirement level of a clause, and of the scenarios that check it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Deserialize, serde::Serialize,
)]
pub enum Level {
    #[serde(rename = "MUST")]
    Must,
    #[serde(rename = "SHOULD")]
    Should,
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Level::Must => "MUST",
            Level::Should => "SHOULD",
        })
    }
}

/// How a profile document's rows say their level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowLevels {
    /// Every clause is a MUST: the document states guarantees.
    AllMust,
    /// A row is a MUST when its requirement says ` MUST `, a SHOULD otherwise.
    Stated,
}

/// A profile's clause document: the table after its `## Clauses` heading.
#[derive(Debug, Clone, Copy)]
pub struct ClauseTable {
    /// What every clause ID of the document begins with, e.g. `E2B-`.
    pub prefix: &'static str,
    /// The document, as the repository names it (for messages).
    pub path: &'static str,
    /// Its text, embedded at build time so that a scenario cannot cite a clause it lacks.
    pub text: &'static str,
    pub levels: RowLevels,
}

impl ClauseTable {
    /// Every clause ID the document defines, in order.
    pub fn ids(&self) -> impl Iterator<Item = &'static str> + use<> {
        let prefix = self.prefix;
        self.rows()
            .filter_map(move |(id, _)| id.starts_with(prefix).then_some(id))
    }

    /// The level of clause `id`, if the document defines it.
    pub fn level(&self, id: &str) -> Option<Level> {
        if !id.starts_with(self.prefix) {
            return None;
        }
        let (_, row) = self.rows().find(|(row_id, _)| *row_id == id)?;
        Some(match self.levels {
            RowLevels::AllMust => Level::Must,
            RowLevels::Stated if row.contains(" MUST ") => Level::Must,
            RowLevels::Stated => Level::Should,
        })
    }

    /// The first table after the `## Clauses` heading, and nothing else of the page: each
    /// row's ID and the whole row.
    fn rows(&self) -> impl Iterator<Item = (&'static str, &'static str)> + use<> {
        self.text
            .lines()
            .skip_while(|line| *line != "## Clauses")
            .skip_while(|line| !line.starts_with('|'))
            .take_while(|line| line.starts_with('|'))
            .filter_map(|line| {
                let rest = line.strip_prefix("| `")?;
                let (id, _) = rest.split_once('`')?;
                Some((id, line))
            })
    }
}

/// One numbered clause of `docs/protocol.md`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clause {
    /// `SBX-3.4`.
    pub id: String,
    pub level: Level,
    /// Marked `*withdrawn*`: kept for its ID, no longer a rule.
    pub withdrawn: bool,
}

/// The clause lines of a protocol document in `docs/protocol.md`'s shape. Lines inside fenced code blocks (the format's
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

    #[test]
    fn a_table_defines_its_prefix_and_levels() {
        const TEXT: &str = "# Doc\n\n| `X-0` | before the heading |\n\n## Clauses\n\n\
            | Clause | Requirement |\n| --- | --- |\n\
            | `X-1` | it MUST hold |\n| `X-2` | it should hold |\n| `Y-1` | another prefix |\n\n\
            | `X-3` | a later table |\n";
        let stated = ClauseTable {
            prefix: "X-",
            path: "doc.md",
            text: TEXT,
            levels: RowLevels::Stated,
        };
        assert_eq!(stated.ids().collect::<Vec<_>>(), ["X-1", "X-2"]);
        assert_eq!(stated.level("X-1"), Some(Level::Must));
        assert_eq!(stated.level("X-2"), Some(Level::Should));
        for absent in ["X-0", "X-3", "Y-1"] {
            assert_eq!(stated.level(absent), None, "{absent}");
        }
        let all = ClauseTable {
            levels: RowLevels::AllMust,
            ..stated
        };
        assert_eq!(all.level("X-2"), Some(Level::Must));
    }
}
