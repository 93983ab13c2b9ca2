//! `{{var}}` templates and the small arithmetic expressions they and deadlines may hold.
//!
//! The grammar is deliberately tiny: an expression is one atom (a variable name or an
//! integer), optionally followed by one operator (`+`, `-`, `*`) and an integer. That covers
//! "one past the limit" and "twice the heartbeat interval" without a language to learn.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer};
use serde_saphyr::Spanned;

use super::pos::Pos;

/// An operand: a variable or an integer literal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Atom {
    Var(String),
    Int(i64),
}

/// The operators an expression may apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Add,
    Sub,
    Mul,
}

/// `atom [op int]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expr {
    pub atom: Atom,
    pub op: Option<(Op, i64)>,
}

impl Expr {
    pub fn int(n: i64) -> Self {
        Expr {
            atom: Atom::Int(n),
            op: None,
        }
    }

    /// Parses `name`, `123`, `name * 2`, `name + 1`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let split = text.find(['+', '-', '*']).filter(|&i| i > 0);
        let (head, op) = match split {
            Some(i) => {
                let op = match &text[i..=i] {
                    "+" => Op::Add,
                    "-" => Op::Sub,
                    _ => Op::Mul,
                };
                let rhs = text[i + 1..].trim();
                let n: i64 = rhs.parse().map_err(|_| {
                    format!("expected an integer after `{}` in `{text}`", &text[i..=i])
                })?;
                (text[..i].trim(), Some((op, n)))
            }
            None => (text, None),
        };
        let atom = if let Ok(n) = head.parse::<i64>() {
            Atom::Int(n)
        } else if is_var_name(head) {
            Atom::Var(head.to_owned())
        } else {
            return Err(format!(
                "`{text}` is not a variable name or an integer expression"
            ));
        };
        Ok(Expr { atom, op })
    }

    pub fn var(&self) -> Option<&str> {
        match &self.atom {
            Atom::Var(v) => Some(v),
            Atom::Int(_) => None,
        }
    }

    /// Applies the operator to an already-resolved atom value.
    pub fn apply(&self, value: i64) -> Option<i64> {
        match self.op {
            None => Some(value),
            Some((Op::Add, n)) => value.checked_add(n),
            Some((Op::Sub, n)) => value.checked_sub(n),
            Some((Op::Mul, n)) => value.checked_mul(n),
        }
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.atom {
            Atom::Var(v) => f.write_str(v)?,
            Atom::Int(n) => write!(f, "{n}")?,
        }
        match self.op {
            None => Ok(()),
            Some((Op::Add, n)) => write!(f, " + {n}"),
            Some((Op::Sub, n)) => write!(f, " - {n}"),
            Some((Op::Mul, n)) => write!(f, " * {n}"),
        }
    }
}

/// Variable names: letters, digits, `_` and `.` (for `limits.x`), starting with a letter.
pub fn is_var_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
}

/// A piece of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Lit(String),
    Expr(Expr),
}

/// A string with `{{expr}}` holes, and where it was written.
#[derive(Debug, Clone)]
pub struct Template {
    pub raw: String,
    pub parts: Vec<Part>,
    pub pos: Pos,
}

impl Template {
    /// Splits `text` into literal parts and expressions.
    pub fn parse(text: &str, pos: Pos) -> Result<Self, String> {
        Ok(Template {
            raw: text.to_owned(),
            parts: parse_parts(text)?,
            pos,
        })
    }

    /// Every variable the template refers to.
    pub fn vars(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Expr(e) => e.var(),
            Part::Lit(_) => None,
        })
    }

    /// The single expression when the whole template is one `{{expr}}` (so a JSON body
    /// value can take the variable's type, e.g. a number).
    pub fn sole_expr(&self) -> Option<&Expr> {
        match self.parts.as_slice() {
            [Part::Expr(e)] => Some(e),
            _ => None,
        }
    }
}

/// Splits a string into literal text and `{{...}}` expressions.
pub fn parse_parts(text: &str) -> Result<Vec<Part>, String> {
    let mut parts = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        if start > 0 {
            parts.push(Part::Lit(rest[..start].to_owned()));
        }
        let after = &rest[start + 2..];
        let end = after
            .find("}}")
            .ok_or_else(|| format!("unclosed `{{{{` in `{text}`"))?;
        parts.push(Part::Expr(Expr::parse(&after[..end])?));
        rest = &after[end + 2..];
    }
    if !rest.is_empty() {
        parts.push(Part::Lit(rest.to_owned()));
    }
    Ok(parts)
}

impl<'de> Deserialize<'de> for Template {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = Spanned::<String>::deserialize(deserializer)?;
        let pos = Pos::of(&raw);
        Template::parse(&raw.value, pos).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, expect: &[Part]) {
        assert_eq!(parse_parts(text).unwrap(), expect, "{text}");
    }

    #[test]
    fn splits_literals_and_expressions() {
        check("/v1/sandboxes", &[Part::Lit("/v1/sandboxes".into())]);
        check(
            "/v1/sandboxes/{{sbx}}/files",
            &[
                Part::Lit("/v1/sandboxes/".into()),
                Part::Expr(Expr {
                    atom: Atom::Var("sbx".into()),
                    op: None,
                }),
                Part::Lit("/files".into()),
            ],
        );
        check(
            "{{ limits.max_timeout_s + 1 }}",
            &[Part::Expr(Expr {
                atom: Atom::Var("limits.max_timeout_s".into()),
                op: Some((Op::Add, 1)),
            })],
        );
        check(
            "{{3*2}}",
            &[Part::Expr(Expr {
                atom: Atom::Int(3),
                op: Some((Op::Mul, 2)),
            })],
        );
    }

    #[test]
    fn rejects_bad_templates() {
        assert!(parse_parts("/a/{{sbx").unwrap_err().contains("unclosed"));
        assert!(parse_parts("{{ a b }}").is_err());
        assert!(parse_parts("{{x + y}}").is_err());
        assert!(parse_parts("{{}}").is_err());
    }

    #[test]
    fn applies_operators() {
        assert_eq!(Expr::parse("a * 2").unwrap().apply(15), Some(30));
        assert_eq!(Expr::parse("a - 2").unwrap().apply(5), Some(3));
        assert_eq!(Expr::parse("a").unwrap().apply(5), Some(5));
    }
}
