//! Where something was written in a scenario file, so that every error can point at it.

use serde_saphyr::Spanned;

/// A position in a scenario file (1-based line and column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Pos {
    pub line: u64,
    pub col: u64,
}

impl Pos {
    pub fn of<T>(spanned: &Spanned<T>) -> Self {
        Pos {
            line: spanned.referenced.line(),
            col: spanned.referenced.column(),
        }
    }
}

/// A string value together with where it was written.
pub type Located<T> = Spanned<T>;
