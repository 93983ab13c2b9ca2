//! What a run's `receipt.json` says: its predicate (the report), the `all` profile's verdict
//! and a scenario's record.

#![allow(dead_code)]

use std::path::Path;

use serde_json::Value;

/// The predicate of the receipt in the evidence folder `out`.
pub fn predicate(out: &Path) -> Value {
    let path = out.join("receipt.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut receipt: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
    receipt["predicate"].take()
}

/// The record of profile `name` in a predicate.
pub fn profile<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["profiles"]
        .as_array()
        .expect("the report's profiles")
        .iter()
        .find(|p| p["profile"] == name)
        .unwrap_or_else(|| panic!("profile {name} in the receipt"))
}

/// The `all` profile's verdict.
pub fn verdict(report: &Value) -> String {
    profile(report, "all")["verdict"]
        .as_str()
        .expect("the verdict is a string")
        .to_owned()
}

/// The scenarios' records in a predicate.
pub fn scenarios(report: &Value) -> &[Value] {
    report["scenarios"]
        .as_array()
        .expect("the report's scenarios")
}

/// The record of scenario `id`.
pub fn scenario<'a>(report: &'a Value, id: &str) -> &'a Value {
    scenarios(report)
        .iter()
        .find(|s| s["id"] == id)
        .unwrap_or_else(|| panic!("{id} in the receipt"))
}
