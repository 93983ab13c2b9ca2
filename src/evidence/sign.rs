//! Signed receipts: `receipt.json` wrapped in a DSSE envelope (in-toto's signing format)
//! with an Ed25519 signature, written as `receipt.dsse.json`.
//!
//! The private key is a PKCS#8 PEM file as `openssl genpkey -algorithm ed25519` writes it;
//! the public key a SubjectPublicKeyInfo PEM (`openssl pkey -pubout`). The signature is over
//! DSSE's pre-authentication encoding of the payload type and the exact bytes of
//! `receipt.json`; the receipt names every other file of the folder with its digest, so the
//! one signature covers the whole folder. A key's ID is the SHA-256 of its
//! SubjectPublicKeyInfo DER, in hex.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair as _, UnparsedPublicKey};
use serde::{Deserialize, Serialize};

pub use super::folder::ENVELOPE;
use super::folder::sha256_hex;

/// DSSE payload type of an in-toto Statement.
pub const PAYLOAD_TYPE: &str = "application/vnd.in-toto+json";

/// The DER prefix of an Ed25519 SubjectPublicKeyInfo (RFC 8410); the 32-byte key follows.
const ED25519_SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// A DSSE envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    /// Base64 of the payload's bytes.
    pub payload: String,
    #[serde(rename = "payloadType")]
    pub payload_type: String,
    pub signatures: Vec<EnvelopeSignature>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvelopeSignature {
    /// The signing key's ID (a hint; only the signature itself is trusted).
    pub keyid: String,
    /// Base64 of the 64-byte Ed25519 signature.
    pub sig: String,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("read key file `{path}`")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("`{path}` is not a PEM `{expected}` block{hint}")]
    NotPem {
        path: PathBuf,
        expected: &'static str,
        hint: &'static str,
    },
    #[error("`{path}` is not an Ed25519 key")]
    NotEd25519 { path: PathBuf },
}

/// DSSE's pre-authentication encoding: `DSSEv1 <len> <type> <len> <payload>`.
pub fn pae(payload_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "DSSEv1 {} {payload_type} {} ",
        payload_type.len(),
        payload.len()
    )
    .into_bytes();
    out.extend_from_slice(payload);
    out
}

fn spki_der(raw: &[u8]) -> Vec<u8> {
    let mut der = ED25519_SPKI_PREFIX.to_vec();
    der.extend_from_slice(raw);
    der
}

/// The body of the one PEM block labelled `label` in `text`.
fn pem_block(text: &str, label: &str) -> Option<Vec<u8>> {
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let start = text.find(&begin)? + begin.len();
    let stop = start + text[start..].find(&end)?;
    let b64: String = text[start..stop]
        .chars()
        .filter(|c| !c.is_ascii_whitespace())
        .collect();
    B64.decode(b64).ok()
}

fn read(path: &Path) -> Result<String, KeyError> {
    std::fs::read_to_string(path).map_err(|source| KeyError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// An Ed25519 private key for signing receipts.
#[derive(Clone)]
pub struct SigningKey {
    pair: Arc<Ed25519KeyPair>,
    keyid: String,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey")
            .field("keyid", &self.keyid)
            .finish_non_exhaustive()
    }
}

impl SigningKey {
    /// Reads a PKCS#8 PEM file (`openssl genpkey -algorithm ed25519`).
    pub fn from_file(path: &Path) -> Result<SigningKey, KeyError> {
        SigningKey::from_pem(&read(path)?, path)
    }

    /// `path` only names the source in errors.
    /// A fresh key made in memory and never written anywhere: for tests, which must not
    /// commit keys.
    pub fn generate() -> SigningKey {
        let der = Ed25519KeyPair::generate_pkcs8(&ring::rand::SystemRandom::new())
            .expect("the system random source works");
        let pair = Ed25519KeyPair::from_pkcs8(der.as_ref()).expect("a fresh PKCS#8 key parses");
        let keyid = sha256_hex(&spki_der(pair.public_key().as_ref()));
        SigningKey {
            pair: Arc::new(pair),
            keyid,
        }
    }

    pub fn from_pem(text: &str, path: &Path) -> Result<SigningKey, KeyError> {
        let Some(der) = pem_block(text, "PRIVATE KEY") else {
            let hint = if text.contains("ENCRYPTED PRIVATE KEY") {
                " (it is encrypted: give the runner an unencrypted key, kept in the CI system's secret store)"
            } else if text.contains("PUBLIC KEY") {
                " (this is a public key: signing needs the private key)"
            } else {
                ""
            };
            return Err(KeyError::NotPem {
                path: path.to_path_buf(),
                expected: "PRIVATE KEY",
                hint,
            });
        };
        // PKCS#8 v2 carries the public key and is checked against it; openssl writes v1.
        let pair = Ed25519KeyPair::from_pkcs8(&der)
            .or_else(|_| Ed25519KeyPair::from_pkcs8_maybe_unchecked(&der))
            .map_err(|_| KeyError::NotEd25519 {
                path: path.to_path_buf(),
            })?;
        let keyid = sha256_hex(&spki_der(pair.public_key().as_ref()));
        Ok(SigningKey {
            pair: Arc::new(pair),
            keyid,
        })
    }

    pub fn keyid(&self) -> &str {
        &self.keyid
    }

    /// The public key as a SubjectPublicKeyInfo PEM, for `evidence verify --key`.
    pub fn public_key_pem(&self) -> String {
        let b64 = B64.encode(spki_der(self.pair.public_key().as_ref()));
        format!("-----BEGIN PUBLIC KEY-----\n{b64}\n-----END PUBLIC KEY-----\n")
    }

    /// The envelope of `payload` (the bytes of `receipt.json`).
    pub fn sign(&self, payload: &[u8]) -> Envelope {
        let sig = self.pair.sign(&pae(PAYLOAD_TYPE, payload));
        Envelope {
            payload: B64.encode(payload),
            payload_type: PAYLOAD_TYPE.to_owned(),
            signatures: vec![EnvelopeSignature {
                keyid: self.keyid.clone(),
                sig: B64.encode(sig.as_ref()),
            }],
        }
    }
}

/// An Ed25519 public key that receipts are checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyingKey {
    raw: [u8; 32],
    keyid: String,
}

impl VerifyingKey {
    /// Reads a SubjectPublicKeyInfo PEM file (`openssl pkey -pubout`).
    pub fn from_file(path: &Path) -> Result<VerifyingKey, KeyError> {
        VerifyingKey::from_pem(&read(path)?, path)
    }

    pub fn from_pem(text: &str, path: &Path) -> Result<VerifyingKey, KeyError> {
        let Some(der) = pem_block(text, "PUBLIC KEY") else {
            let hint = if text.contains("PRIVATE KEY") {
                " (this is a private key: a reviewer needs only the public key, `openssl pkey -in KEY -pubout`)"
            } else {
                ""
            };
            return Err(KeyError::NotPem {
                path: path.to_path_buf(),
                expected: "PUBLIC KEY",
                hint,
            });
        };
        let raw = der
            .strip_prefix(&ED25519_SPKI_PREFIX[..])
            .and_then(|k| <[u8; 32]>::try_from(k).ok())
            .ok_or_else(|| KeyError::NotEd25519 {
                path: path.to_path_buf(),
            })?;
        Ok(VerifyingKey {
            keyid: sha256_hex(&der),
            raw,
        })
    }

    pub fn keyid(&self) -> &str {
        &self.keyid
    }

    /// Whether one of the envelope's signatures is this key's over its payload.
    pub fn verifies(&self, envelope: &Envelope) -> bool {
        let Ok(payload) = B64.decode(&envelope.payload) else {
            return false;
        };
        let message = pae(&envelope.payload_type, &payload);
        let key = UnparsedPublicKey::new(&ED25519, &self.raw);
        envelope.signatures.iter().any(|s| {
            B64.decode(&s.sig)
                .is_ok_and(|sig| key.verify(&message, &sig).is_ok())
        })
    }
}

/// What is wrong with an envelope's form, whichever key checks it: the payload must be
/// exactly `receipt`, of the in-toto type, and every signature a key ID and 64 bytes.
pub(crate) fn envelope_problems(envelope: &Envelope, receipt: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    if envelope.payload_type != PAYLOAD_TYPE {
        out.push(format!(
            "payloadType is `{}`, not `{PAYLOAD_TYPE}`",
            envelope.payload_type
        ));
    }
    match B64.decode(&envelope.payload) {
        Ok(p) if p == receipt => {}
        Ok(_) => out.push("its payload is not receipt.json".to_owned()),
        Err(_) => out.push("its payload is not base64".to_owned()),
    }
    if envelope.signatures.is_empty() {
        out.push("it holds no signature".to_owned());
    }
    for s in &envelope.signatures {
        let id_ok = s.keyid.len() == 64 && s.keyid.bytes().all(|b| b.is_ascii_hexdigit());
        let sig_ok = B64.decode(&s.sig).is_ok_and(|b| b.len() == 64);
        if !id_ok || !sig_ok {
            out.push("a signature is not a key ID and a 64-byte Ed25519 signature".to_owned());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> SigningKey {
        SigningKey::generate()
    }

    #[test]
    fn pae_is_dsse_v1() {
        assert_eq!(
            pae("http://example.com/HelloWorld", b"hello world"),
            b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
        );
    }

    #[test]
    fn a_signature_verifies_with_its_key_only() {
        let key = fresh();
        let public = VerifyingKey::from_pem(&key.public_key_pem(), Path::new("p.pem")).unwrap();
        assert_eq!(public.keyid(), key.keyid());
        let envelope = key.sign(b"{\"a\":1}\n");
        assert!(public.verifies(&envelope));
        assert!(envelope_problems(&envelope, b"{\"a\":1}\n").is_empty());

        let other = VerifyingKey::from_pem(&fresh().public_key_pem(), Path::new("o.pem")).unwrap();
        assert!(!other.verifies(&envelope));

        let mut changed = envelope.clone();
        changed.payload = B64.encode(b"{\"a\":2}\n");
        assert!(!public.verifies(&changed));
        let mut retyped = envelope;
        retyped.payload_type = "application/json".into();
        assert!(!public.verifies(&retyped));
    }

    #[test]
    fn keys_of_the_wrong_kind_are_named() {
        let key = fresh();
        let err = SigningKey::from_pem(&key.public_key_pem(), Path::new("p.pem")).unwrap_err();
        assert!(err.to_string().contains("this is a public key"), "{err}");
        let err = VerifyingKey::from_pem("junk", Path::new("j.pem")).unwrap_err();
        assert_eq!(err.to_string(), "`j.pem` is not a PEM `PUBLIC KEY` block");
        // A P-256 SubjectPublicKeyInfo is PEM but not Ed25519.
        let p256 = "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEEVs/o5+uQbTjL3chynL4wXgUg2R9\nq9UU8I5mEovUf86QZ7kOBIjJwqnzD1omageEHWwHdBO6B+dFabmdT9POxg==\n-----END PUBLIC KEY-----\n";
        let err = VerifyingKey::from_pem(p256, Path::new("p256.pem")).unwrap_err();
        assert!(matches!(err, KeyError::NotEd25519 { .. }), "{err}");
    }
}
