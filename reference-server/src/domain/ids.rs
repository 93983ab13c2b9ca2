//! Provider-qualified IDs: `<provider>:<local-id>`. Local IDs are unique only within a provider;
//! a bare ID (no prefix) is resolved in the default provider and nowhere else.

use std::fmt;

/// The kind of object an ID names; each has its own local-ID prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdKind {
    Sandbox,
    Process,
    Snapshot,
    Connection,
    Preview,
}

impl IdKind {
    pub fn prefix(self) -> &'static str {
        match self {
            IdKind::Sandbox => "sbx_",
            IdKind::Process => "prc_",
            IdKind::Snapshot => "snp_",
            IdKind::Connection => "conn_",
            IdKind::Preview => "prv_",
        }
    }
}

/// A local ID, unique within one provider only.
pub type LocalId = String;

/// A fresh local ID: the kind's prefix and a lowercase ULID.
pub fn new_local_id(kind: IdKind) -> LocalId {
    format!(
        "{}{}",
        kind.prefix(),
        ulid::Ulid::new().to_string().to_lowercase()
    )
}

/// An unguessable token (preview tokens, page-token keys): 32 random bytes, URL-safe base64.
pub fn new_token() -> String {
    use base64::Engine as _;
    let bytes: [u8; 32] = rand::random();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// Why a client-supplied ID was not understood. Callers answer 404: an ID that cannot
/// exist is indistinguishable from one that does not.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdError {
    #[error("empty id")]
    Empty,
    #[error("malformed id")]
    Malformed,
}

/// A provider-qualified ID.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QualifiedId {
    pub provider: String,
    pub local: LocalId,
}

impl QualifiedId {
    pub fn new(provider: impl Into<String>, local: impl Into<String>) -> Self {
        Self {
            provider: provider.into(),
            local: local.into(),
        }
    }

    /// Parses `provider:local`, or a bare `local` which resolves in `default_provider` only.
    /// Returns the ID and whether it was bare.
    pub fn parse(s: &str, default_provider: &str) -> Result<(Self, bool), IdError> {
        if s.is_empty() {
            return Err(IdError::Empty);
        }
        let valid = |part: &str| {
            !part.is_empty()
                && part.len() <= 128
                && part
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
        };
        match s.split_once(':') {
            Some((provider, local)) if valid(provider) && valid(local) => {
                Ok((Self::new(provider, local), false))
            }
            Some(_) => Err(IdError::Malformed),
            None if valid(s) => Ok((Self::new(default_provider, s), true)),
            None => Err(IdError::Malformed),
        }
    }
}

impl fmt::Display for QualifiedId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.provider, self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The expected (provider, local, bare) of a parse.
    type Parsed<'a> = Result<(&'a str, &'a str, bool), IdError>;

    #[test]
    fn parse_cases() {
        let cases: &[(&str, Parsed<'_>)] = &[
            ("local:sbx_1", Ok(("local", "sbx_1", false))),
            ("local-b:sbx_1", Ok(("local-b", "sbx_1", false))),
            ("sbx_1", Ok(("local", "sbx_1", true))),
            ("", Err(IdError::Empty)),
            (":sbx_1", Err(IdError::Malformed)),
            ("local:", Err(IdError::Malformed)),
            ("a:b:c", Err(IdError::Malformed)),
            ("../etc", Err(IdError::Malformed)),
        ];
        for (input, expected) in cases {
            let got =
                QualifiedId::parse(input, "local").map(|(id, bare)| (id.provider, id.local, bare));
            let expected = expected
                .as_ref()
                .map(|(p, l, b)| (p.to_string(), l.to_string(), *b))
                .map_err(|e| e.clone_for_test());
            assert_eq!(got, expected, "input {input:?}");
        }
    }

    impl IdError {
        fn clone_for_test(&self) -> IdError {
            match self {
                IdError::Empty => IdError::Empty,
                IdError::Malformed => IdError::Malformed,
            }
        }
    }

    #[test]
    fn fresh_ids_carry_prefix_and_differ() {
        let a = new_local_id(IdKind::Sandbox);
        let b = new_local_id(IdKind::Sandbox);
        assert!(a.starts_with("sbx_"));
        assert_ne!(a, b);
        assert_eq!(
            QualifiedId::new("local", a.clone()).to_string(),
            format!("local:{a}")
        );
    }
}
