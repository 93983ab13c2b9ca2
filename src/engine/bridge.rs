//! Signing requests to the private bridge (protocol §8.8) the way a worker does, written from
//! the protocol text rather than shared with the reference server, so that a scenario checks
//! a target's signature rules instead of agreeing with them by construction.

use hmac::{Hmac, Mac};
use sha2::{Digest as _, Sha256};

pub const TIMESTAMP_HEADER: &str = "X-Sandspec-Timestamp";
pub const SIGNATURE_HEADER: &str = "X-Sandspec-Signature";

/// The `X-Sandspec-Signature` value: `v1=` and the hex HMAC-SHA256, keyed with the secret, of
/// `METHOD \n TARGET \n hex(SHA-256(body)) \n TIMESTAMP`, where `target` is the request
/// target exactly as sent (path, and `?query` when there is one).
pub fn signature(secret: &str, method: &str, target: &str, body: &[u8], timestamp: &str) -> String {
    let canonical = format!(
        "{}\n{target}\n{}\n{timestamp}",
        method.to_ascii_uppercase(),
        hex::encode(Sha256::digest(body)),
    );
    let mut mac =
        Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key length");
    mac.update(canonical.as_bytes());
    format!("v1={}", hex::encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known answers computed with another HMAC implementation (Python's `hmac`), the first
    /// for the example of protocol §8.8.
    #[test]
    fn signatures_match_known_answers() {
        assert_eq!(
            signature(
                "secret",
                "POST",
                "/bridge/v1/sessions/ses_x/heartbeat",
                br#"{"lease_generation":3}"#,
                "1764422400"
            ),
            "v1=877fe39be9f9b41033177b7a5c89e7839e3f26518269a13c021511dffa49d28f"
        );
        assert_eq!(
            signature("k", "get", "/bridge/v1/x?a=1", b"", "5"),
            "v1=b0192cf90364db77bea10a177fb904c8308bb5ce1aa9ce43587630219ff50883"
        );
    }

    #[test]
    fn the_reference_server_accepts_what_the_runner_signs() {
        let body = br#"{"worker_id":"w"}"#;
        let target = "/bridge/v1/sessions/ses_x/lease";
        let sig = signature("k3y-of-the-session", "POST", target, body, "1000");
        assert!(reference_server::gateway::signing::verify(
            "k3y-of-the-session",
            "POST",
            target,
            body,
            "1000",
            &sig,
            1000
        ));
    }
}
