//! E2B sandbox IDs and the provider-qualified IDs they stand for.
//!
//! E2B IDs are opaque, lowercase and DNS-label safe (they appear in host names such as
//! `49983-<id>.<domain>`), so a qualified ID cannot be used as it is. A sandbox whose local ID
//! is `sbx_<26 lowercase ULID characters>` has the E2B ID `<ulid>` in the default provider and
//! `<ulid><index>` in the provider at position `index` (1, 2, ...) of the server's provider
//! list. The ULID has a fixed length, so the mapping is one-to-one in both directions. A
//! sandbox whose local ID has another shape (only test controls make those) has no E2B ID and
//! is not on the E2B surface.

use crate::domain::QualifiedId;

const ULID_LEN: usize = 26;

/// The E2B ID of the stored sandbox `qualified`, if it has one.
pub fn to_e2b(providers: &[String], qualified: &str) -> Option<String> {
    encode(providers, qualified, "sbx_", "")
}

/// The qualified ID an E2B ID names, if it is well formed and its provider exists.
pub fn from_e2b(providers: &[String], e2b: &str) -> Option<String> {
    decode(providers, e2b, "sbx_", "")
}

/// The E2B snapshot ID of the stored snapshot `qualified` (`<provider>:snp_<ulid>`):
/// `snp_<ulid>` and the provider's index as for sandboxes. Snapshots are templates upstream,
/// so the prefix keeps them apart from template names such as `base`.
pub fn snapshot_to_e2b(providers: &[String], qualified: &str) -> Option<String> {
    encode(providers, qualified, "snp_", "snp_")
}

/// The qualified snapshot ID an E2B snapshot ID names.
pub fn snapshot_from_e2b(providers: &[String], e2b: &str) -> Option<String> {
    decode(providers, e2b, "snp_", "snp_")
}

fn encode(
    providers: &[String],
    qualified: &str,
    local_prefix: &str,
    prefix: &str,
) -> Option<String> {
    let (provider, local) = qualified.split_once(':')?;
    let ulid = local.strip_prefix(local_prefix)?;
    if ulid.len() != ULID_LEN
        || !ulid
            .bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase())
    {
        return None;
    }
    match providers.iter().position(|p| p == provider)? {
        0 => Some(format!("{prefix}{ulid}")),
        index => Some(format!("{prefix}{ulid}{index}")),
    }
}

fn decode(providers: &[String], e2b: &str, local_prefix: &str, prefix: &str) -> Option<String> {
    let e2b = e2b.strip_prefix(prefix)?;
    if e2b.len() < ULID_LEN || !e2b.is_ascii() {
        return None;
    }
    let (ulid, index) = e2b.split_at(ULID_LEN);
    if !ulid
        .bytes()
        .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase())
    {
        return None;
    }
    let index = match index {
        "" => 0,
        digits if !digits.starts_with('0') && digits.bytes().all(|b| b.is_ascii_digit()) => {
            digits.parse::<usize>().ok()?
        }
        _ => return None,
    };
    let provider = providers.get(index)?;
    Some(QualifiedId::new(provider, format!("{local_prefix}{ulid}")).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_map_both_ways_and_refuse_what_names_nothing() {
        let providers = vec!["local".to_owned(), "local-b".to_owned()];
        let ulid = "01jf0000000000000000000000";
        let cases: &[(&str, Option<&str>)] = &[
            ("local:sbx_01jf0000000000000000000000", Some(ulid)),
            (
                "local-b:sbx_01jf0000000000000000000000",
                Some("01jf00000000000000000000001"),
            ),
            ("local:sbx_short", None),
            ("local:prc_01jf0000000000000000000000", None),
            ("other:sbx_01jf0000000000000000000000", None),
            ("local:sbx_01JF0000000000000000000000", None),
        ];
        for (qualified, e2b) in cases {
            let got = to_e2b(&providers, qualified);
            assert_eq!(got.as_deref(), *e2b, "{qualified}");
            if let Some(e2b) = e2b {
                assert_eq!(from_e2b(&providers, e2b).as_deref(), Some(*qualified));
            }
        }
        for bad in [
            "",
            "short",
            "01jf00000000000000000000002",
            "01jf000000000000000000000001",
            "01jf00000000000000000000-1",
            "01JF0000000000000000000000",
            "01jf0000000000000000000000x",
        ] {
            assert_eq!(from_e2b(&providers, bad), None, "{bad}");
        }
        let snapshot = "local-b:snp_01jf0000000000000000000000";
        let e2b = snapshot_to_e2b(&providers, snapshot).unwrap();
        assert_eq!(e2b, "snp_01jf00000000000000000000001");
        assert_eq!(
            snapshot_from_e2b(&providers, &e2b).as_deref(),
            Some(snapshot)
        );
        assert_eq!(from_e2b(&providers, &e2b), None);
        assert_eq!(snapshot_from_e2b(&providers, ulid), None);
    }
}
