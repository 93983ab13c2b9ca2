//! The URL target over HTTPS: `sandspec serve --tls-cert/--tls-key` with a CA generated here.
//! Trusting that CA (as `--ca-file` does) works and a scenario passes; an unknown CA is refused.

use std::path::PathBuf;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use sandspec::engine::{Outcome, run_scenario};
use sandspec::scenario::parse_str;
use sandspec::target::{ReferenceOptions, ReferenceServer, Target, TargetError};

/// A CA and a leaf certificate for 127.0.0.1 signed by it, as PEM.
fn ca_and_leaf() -> (String, String, String) {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&leaf_key, &ca)
        .unwrap();
    (ca.pem(), leaf.pem(), leaf_key.serialize_pem())
}

#[tokio::test]
async fn https_target_with_private_ca() {
    let dir = tempfile::tempdir().unwrap();
    let (ca_pem, cert_pem, key_pem) = ca_and_leaf();
    std::fs::write(dir.path().join("cert.pem"), cert_pem).unwrap();
    std::fs::write(dir.path().join("key.pem"), key_pem).unwrap();
    let options = ReferenceOptions {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_sandspec")),
        extra_args: vec![
            "--tls-cert".into(),
            dir.path().join("cert.pem").display().to_string(),
            "--tls-key".into(),
            dir.path().join("key.pem").display().to_string(),
        ],
        ..ReferenceOptions::default()
    };
    let server = ReferenceServer::start(&options).await.unwrap();
    assert!(
        server.url.starts_with("https://127.0.0.1:"),
        "{}",
        server.url
    );

    // An unknown CA (the platform roots, or another private CA) is refused.
    let refused = Target::connect_with_tokens(&server.url, server.tokens.clone(), None)
        .await
        .unwrap_err();
    assert!(
        matches!(refused, TargetError::Unreachable { .. }),
        "{refused}"
    );
    let (other_ca, _, _) = ca_and_leaf();
    let other = reqwest::Certificate::from_pem(other_ca.as_bytes()).unwrap();
    let refused = Target::connect_with_tokens(&server.url, server.tokens.clone(), Some(other))
        .await
        .unwrap_err();
    assert!(
        matches!(refused, TargetError::Unreachable { .. }),
        "{refused}"
    );

    // The right CA works, and a scenario (including its fresh-client absence check) passes.
    let ca = reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap();
    let target = Target::connect_with_tokens(&server.url, server.tokens.clone(), Some(ca))
        .await
        .unwrap();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios/lifecycle/create-get-list-kill.yaml");
    let scenario = parse_str(&path, &std::fs::read_to_string(&path).unwrap()).unwrap();
    let run = run_scenario(&target, &scenario, "tlstest").await;
    assert_eq!(run.outcome, Outcome::Pass);
}
