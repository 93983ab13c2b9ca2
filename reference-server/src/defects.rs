//! Negative controls: deliberate, realistic bugs that `--defect <name>` switches on one at a time.
//!
//! The names and descriptions live in the `sandspec-defects` crate, which the runner's scenario
//! parser checks scenarios against; this module decides which of them a server has on.
//! Without the `defects` cargo feature the set can only be empty, so a release build cannot
//! be started with a bug switched on.

use std::collections::BTreeSet;

pub use sandspec_defects::{Defect, UnknownDefect};

/// Why a defect name was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DefectError {
    #[error("unknown defect `{0}` (see `sandspec serve --list-defects`)")]
    Unknown(String),
    #[error("this build has no defects; rebuild with the `defects` feature to use `--defect {0}`")]
    NotBuilt(String),
}

impl From<UnknownDefect> for DefectError {
    fn from(e: UnknownDefect) -> Self {
        DefectError::Unknown(e.0)
    }
}

/// The defects switched on for one server. Empty in every normal run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Defects(BTreeSet<Defect>);

impl Defects {
    /// No defect: the honest server.
    pub fn none() -> Self {
        Self::default()
    }

    /// Parses defect names; refuses any name when the `defects` feature is off.
    pub fn parse<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Self, DefectError> {
        let mut set = BTreeSet::new();
        for name in names {
            let defect: Defect = name.parse()?;
            if !cfg!(feature = "defects") {
                return Err(DefectError::NotBuilt(name.to_owned()));
            }
            set.insert(defect);
        }
        Ok(Self(set))
    }

    /// Whether `defect` is switched on. Always false without the `defects` feature.
    #[inline]
    pub fn has(&self, defect: Defect) -> bool {
        cfg!(feature = "defects") && self.0.contains(&defect)
    }

    pub fn iter(&self) -> impl Iterator<Item = Defect> + '_ {
        self.0.iter().copied()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_name_is_refused() {
        assert_eq!(
            Defects::parse(["no-such-bug"]).unwrap_err(),
            DefectError::Unknown("no-such-bug".into())
        );
    }

    #[test]
    fn feature_gates_switching_on() {
        let parsed = Defects::parse(["pause-noop"]);
        if cfg!(feature = "defects") {
            assert!(parsed.unwrap().has(Defect::PauseNoop));
        } else {
            assert_eq!(
                parsed.unwrap_err(),
                DefectError::NotBuilt("pause-noop".into())
            );
        }
    }
}
