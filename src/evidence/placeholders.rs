//! Stable placeholders for object IDs, so receipts (and snapshots of them) name resources
//! without their run-specific IDs: `local-b:sbx_01j…` becomes `local-b:<sbx-1>`.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use regex::Regex;

/// An ID's kind prefix (`sbx`, `prc`, `snp`, `conn`, `prv`, `sub`, ...) and its ULID. The
/// provider prefix (`local:`) is kept: which provider held an object is part of what a
/// scenario observed.
static OBJECT_ID: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b([a-z]{2,5})_([0-9A-Za-z]{26})\b").expect("object ID regex"));

/// Numbers IDs in order of first appearance, per kind.
#[derive(Debug, Default, Clone)]
pub struct Placeholders {
    seen: BTreeMap<String, String>,
    per_kind: BTreeMap<String, usize>,
}

impl Placeholders {
    pub fn new() -> Self {
        Self::default()
    }

    /// `text` with every object ID replaced; the same ID always gets the same placeholder.
    pub fn apply(&mut self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut last = 0;
        for c in OBJECT_ID.captures_iter(text) {
            let whole = c.get(0).expect("group 0");
            out.push_str(&text[last..whole.start()]);
            let id = whole.as_str().to_ascii_lowercase();
            let placeholder = match self.seen.get(&id) {
                Some(p) => p.clone(),
                None => {
                    let n = self.per_kind.entry(c[1].to_owned()).or_default();
                    *n += 1;
                    let p = format!("<{}-{n}>", &c[1]);
                    self.seen.insert(id, p.clone());
                    p
                }
            };
            out.push_str(&placeholder);
            last = whole.end();
        }
        out.push_str(&text[last..]);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_become_numbered_placeholders() {
        let a = "local:sbx_01jabcdefghjkmnpqrstvwxyz0";
        let b = "local-b:sbx_01jabcdefghjkmnpqrstvwxyz1";
        let p = "local:prc_01jabcdefghjkmnpqrstvwxyz2";
        let mut ph = Placeholders::new();
        assert_eq!(
            ph.apply(&format!("/v1/sandboxes/{a}")),
            "/v1/sandboxes/local:<sbx-1>"
        );
        assert_eq!(
            ph.apply(&format!("/v1/sandboxes/{b}/x/{a}")),
            "/v1/sandboxes/local-b:<sbx-2>/x/local:<sbx-1>"
        );
        assert_eq!(
            ph.apply(&format!("/v1/processes/{p}")),
            "/v1/processes/local:<prc-1>"
        );
        assert_eq!(
            ph.apply("sub_01jabcdefghjkmnpqrstvwxyz5/cancel"),
            "<sub-1>/cancel"
        );
        assert_eq!(
            ph.apply("/v1/sandboxes/sbx_short"),
            "/v1/sandboxes/sbx_short"
        );
    }
}
