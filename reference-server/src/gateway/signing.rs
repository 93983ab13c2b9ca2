//! The private bridge's request signature (§8.8): HMAC-SHA256 over method, request target,
//! body digest and timestamp. Used by the gateway to check and by the worker to sign.

use hmac::{Hmac, Mac};
use sha2::{Digest as _, Sha256};

pub const TIMESTAMP_HEADER: &str = "x-sandspec-timestamp";
pub const SIGNATURE_HEADER: &str = "x-sandspec-signature";
pub const REVISION_HEADER: &str = "x-sandspec-control-revision";
/// How far a request's timestamp may be from the server's clock.
pub const MAX_SKEW_S: i64 = 300;

fn mac(secret: &str, method: &str, target: &str, body: &[u8], timestamp: &str) -> Hmac<Sha256> {
    let mut mac =
        Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key length");
    let canonical = format!(
        "{}\n{}\n{}\n{}",
        method.to_ascii_uppercase(),
        target,
        hex::encode(Sha256::digest(body)),
        timestamp
    );
    mac.update(canonical.as_bytes());
    mac
}

/// The `X-Sandspec-Signature` value for a request.
pub fn sign(secret: &str, method: &str, target: &str, body: &[u8], timestamp: &str) -> String {
    format!(
        "v1={}",
        hex::encode(
            mac(secret, method, target, body, timestamp)
                .finalize()
                .into_bytes()
        )
    )
}

/// Whether `signature` is a valid `v1=` signature of the request made within the allowed skew
/// of `now_s`. The comparison is constant-time.
pub fn verify(
    secret: &str,
    method: &str,
    target: &str,
    body: &[u8],
    timestamp: &str,
    signature: &str,
    now_s: i64,
) -> bool {
    let Ok(ts) = timestamp.parse::<i64>() else {
        return false;
    };
    if !timestamp.bytes().all(|b| b.is_ascii_digit()) || (ts - now_s).abs() > MAX_SKEW_S {
        return false;
    }
    let Some(hexed) = signature.strip_prefix("v1=") else {
        return false;
    };
    let Ok(tag) = hex::decode(hexed) else {
        return false;
    };
    mac(secret, method, target, body, timestamp)
        .verify_slice(&tag)
        .is_ok()
}

/// A fresh bridge secret: 256 random bits, hex.
pub fn new_secret() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_verify_and_any_change_breaks_them() {
        let sig = sign(
            "k",
            "post",
            "/bridge/v1/sessions/s/heartbeat",
            b"{}",
            "1000",
        );
        assert!(sig.starts_with("v1="));
        assert!(verify(
            "k",
            "POST",
            "/bridge/v1/sessions/s/heartbeat",
            b"{}",
            "1000",
            &sig,
            1100
        ));
        assert!(!verify(
            "k2",
            "POST",
            "/bridge/v1/sessions/s/heartbeat",
            b"{}",
            "1000",
            &sig,
            1100
        ));
        assert!(!verify(
            "k",
            "POST",
            "/bridge/v1/sessions/s/next",
            b"{}",
            "1000",
            &sig,
            1100
        ));
        assert!(!verify(
            "k",
            "POST",
            "/bridge/v1/sessions/s/heartbeat",
            b"{ }",
            "1000",
            &sig,
            1100
        ));
        assert!(!verify(
            "k",
            "POST",
            "/bridge/v1/sessions/s/heartbeat",
            b"{}",
            "1000",
            &sig,
            1400
        ));
        assert!(!verify(
            "k",
            "POST",
            "/bridge/v1/sessions/s/heartbeat",
            b"{}",
            "1000",
            "v2=00",
            1000
        ));
    }

    #[test]
    fn the_canonical_string_is_the_documented_one() {
        // The example of docs/protocol.md §8.8, computed independently.
        let body = br#"{"lease_generation":3}"#;
        let canonical = format!(
            "POST\n/bridge/v1/sessions/ses_x/heartbeat\n{}\n1764422400",
            hex::encode(Sha256::digest(body))
        );
        let mut m = Hmac::<Sha256>::new_from_slice(b"secret").unwrap();
        m.update(canonical.as_bytes());
        let expected = format!("v1={}", hex::encode(m.finalize().into_bytes()));
        assert_eq!(
            sign(
                "secret",
                "POST",
                "/bridge/v1/sessions/ses_x/heartbeat",
                body,
                "1764422400"
            ),
            expected
        );
    }
}
