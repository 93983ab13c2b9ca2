//! The published receipt schema (`evidence/schema/receipt.schema.json`), compiled once, and
//! validation that reports where a receipt breaks it without echoing any value from it.

use std::sync::LazyLock;

use serde_json::Value;

/// The JSON Schema (2020-12) every receipt must satisfy, as published.
pub const RECEIPT_SCHEMA: &str = include_str!("../../evidence/schema/receipt.schema.json");

static VALIDATOR: LazyLock<jsonschema::Validator> = LazyLock::new(|| {
    let schema: Value = serde_json::from_str(RECEIPT_SCHEMA).expect("the receipt schema is JSON");
    jsonschema::draft202012::new(&schema).expect("the receipt schema is a valid 2020-12 schema")
});

/// Validates a receipt. Each violation reads `<instance path>: <keyword> (schema <path>)`;
/// values are left out, because a tampered receipt may hold a secret.
pub fn validate_receipt(receipt: &Value) -> Result<(), Vec<String>> {
    let errors: Vec<String> = VALIDATOR
        .iter_errors(receipt)
        .map(|e| {
            let at = e.instance_path().as_str();
            format!(
                "{}: {} (schema {})",
                if at.is_empty() { "/" } else { at },
                e.kind().keyword(),
                e.schema_path().as_str()
            )
        })
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schema_compiles_and_rejects_an_empty_object() {
        let errors = validate_receipt(&serde_json::json!({})).unwrap_err();
        assert!(errors.iter().any(|e| e.contains("required")), "{errors:?}");
    }

    #[test]
    fn violations_do_not_echo_values() {
        let secret = "sandspec-canary-0123456789abcdef";
        let errors = validate_receipt(&serde_json::json!({"_type": secret})).unwrap_err();
        assert!(errors.iter().all(|e| !e.contains(secret)), "{errors:?}");
        assert!(
            errors.iter().any(|e| e.starts_with("/_type: const")),
            "{errors:?}"
        );
    }
}
