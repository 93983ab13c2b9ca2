//! `report.html` in a real browser, and signed receipts through the real command line: a real
//! `sandspec run` against the reference server with a deliberate defect (a failure) and a
//! dropped capability (a skip), signed with a key made here by `openssl genpkey`. The folder
//! verifies with the public key and with no other; headless Chromium renders the report with
//! no Content-Security-Policy violation; its DOM shows every scenario with its outcome, the
//! verdict and the failure's reason; screenshots (wide and narrow) are kept under
//! `target/tmp/report-browser/` for a person to look at.
//!
//! Chromium is Debian's `chromium` (`.ci/run` installs it). Without it the test fails under
//! `CI=true` and is skipped, saying so, elsewhere.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sandspec::evidence::Statement;

const DEFECT: &str = "kill-reports-success-without-removing";
/// Caught by the defect (FAIL), skipped for the dropped capability (SKIP), and one more.
const SCENARIOS: &[&str] = &["SBX-LIFE-001", "SBX-SNAP-002", "AUTH-MATRIX-001"];

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The first of `names` on `PATH`.
fn on_path(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    names.iter().find_map(|name| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn sandspec() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sandspec"))
}

/// `openssl genpkey -algorithm ed25519` and its public key, in `dir`.
fn openssl_key(openssl: &Path, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let key = dir.join(format!("{name}.pem"));
    let public = dir.join(format!("{name}.pub.pem"));
    let made = run(Command::new(openssl)
        .args(["genpkey", "-algorithm", "ed25519", "-out"])
        .arg(&key));
    assert!(made.status.success(), "{made:?}");
    let made = run(Command::new(openssl)
        .args(["pkey", "-pubout", "-in"])
        .arg(&key)
        .arg("-out")
        .arg(&public));
    assert!(made.status.success(), "{made:?}");
    (key, public)
}

/// Headless Chromium on `page` with `args`; returns its stdout and stderr.
fn chromium(browser: &Path, profile: &Path, page: &Path, args: &[&str]) -> (String, String) {
    let out = run(Command::new(browser)
        .args([
            "--headless",
            // The test runs as root in CI, where Chromium's sandbox cannot start; the page
            // has no scripts and loads nothing.
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display())));
    assert!(out.status.success(), "chromium failed: {out:?}");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Text as Chromium serializes a text node.
fn dom_text(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('\u{a0}', "&nbsp;")
}

/// The element that starts at `id="<id>"`, up to its closing `</tag>`.
fn element<'a>(dom: &'a str, id: &str, tag: &str) -> &'a str {
    let start = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no element #{id} in the DOM"));
    let end = dom[start..]
        .find(&format!("</{tag}>"))
        .unwrap_or_else(|| panic!("#{id} is not closed"));
    &dom[start..start + end]
}

/// Width and height from a PNG's IHDR.
fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let be = |i: usize| u32::from_be_bytes(bytes[i..i + 4].try_into().unwrap());
    (be(16), be(20))
}

#[test]
fn a_defect_run_signed_and_read_in_a_browser() {
    let browser = on_path(&["chromium", "chromium-browser"]);
    let openssl = on_path(&["openssl"]);
    let (Some(browser), Some(openssl)) = (browser, openssl) else {
        assert!(
            !in_ci(),
            "chromium and openssl are required in CI (.ci/run installs them)"
        );
        eprintln!("SKIPPED: the browser test needs chromium and openssl on PATH");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (key, public) = openssl_key(&openssl, tmp.path(), "signer");
    let (_, other_public) = openssl_key(&openssl, tmp.path(), "other");
    let out = tmp.path().join("evidence");

    // A real run: the reference server started by the runner, with the defect.
    let mut cmd = sandspec();
    cmd.args(["run", "--defect", DEFECT, "--drop-capability", "snapshots"]);
    for id in SCENARIOS {
        cmd.args(["--filter", id]);
    }
    cmd.arg("--out").arg(&out).arg("--sign-key").arg(&key);
    let ran = run(&mut cmd);
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert_eq!(ran.status.code(), Some(1), "not conformant: {stderr}");

    let statement: Statement =
        serde_json::from_slice(&std::fs::read(out.join("receipt.json")).unwrap()).unwrap();
    let r = &statement.predicate;
    assert_eq!(r.target.defects, [DEFECT]);
    let outcome = |id: &str| {
        let s = r.scenarios.iter().find(|s| s.id == id).unwrap();
        serde_json::to_value(s.outcome).unwrap()
    };
    assert_eq!(outcome("SBX-LIFE-001"), "fail");
    assert_eq!(outcome("SBX-SNAP-002"), "skip");

    // Signed: verifies with the signer's public key, and with no other.
    let verified = run(sandspec()
        .args(["evidence", "verify"])
        .arg(&out)
        .arg("--key")
        .arg(&public));
    let said = String::from_utf8_lossy(&verified.stdout);
    assert_eq!(verified.status.code(), Some(0), "{verified:?}");
    assert!(said.contains("signature by key"), "{said}");
    let refused = run(sandspec()
        .args(["evidence", "verify"])
        .arg(&out)
        .arg("--key")
        .arg(&other_public));
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("no signature in receipt.dsse.json"),
        "{refused:?}"
    );
    // A private key where the public one belongs is a usage error, and says why.
    let wrong = run(sandspec()
        .args(["evidence", "verify"])
        .arg(&out)
        .arg("--key")
        .arg(&key));
    assert_eq!(wrong.status.code(), Some(2), "{wrong:?}");

    // The browser: the DOM it builds from the page.
    let page = out.join("report.html");
    let (dom, log) = chromium(
        &browser,
        &tmp.path().join("profile"),
        &page,
        &["--dump-dom"],
    );
    assert!(
        !log.contains("Content Security Policy"),
        "the page breaks its own policy:\n{log}"
    );
    for s in &r.scenarios {
        let row = element(&dom, &format!("scenario-{}", s.id), "tr");
        let outcome = serde_json::to_value(s.outcome).unwrap();
        assert!(
            row.contains(&format!("data-outcome=\"{}\"", outcome.as_str().unwrap())),
            "{row}"
        );
        let bar = format!("<code>{}</code></th>", s.id);
        assert!(
            element(&dom, "timeline", "section").contains(&bar),
            "{} has no bar on the timeline",
            s.id
        );
    }
    let all = r.profiles.iter().find(|p| p.profile == "all").unwrap();
    assert_eq!(all.verdict, "non-conformant");
    assert!(
        dom.contains(r#"<span class="verdict" id="verdict-all">non-conformant</span>"#),
        "no verdict in the DOM"
    );
    let life = r.scenarios.iter().find(|s| s.id == "SBX-LIFE-001").unwrap();
    let card = element(&dom, "failure-SBX-LIFE-001", "article");
    let reason = dom_text(life.reason.as_deref().unwrap());
    assert!(
        card.contains(&format!("<p class=\"reason\">{reason}</p>")),
        "the failure's reason is not on its card:\n{card}"
    );
    assert!(
        card.contains("<details>") && card.contains("(failed step)"),
        "the card holds the collapsed transcript with the failed step marked:\n{card}"
    );
    let skip = element(&dom, "skip-SBX-SNAP-002", "tr");
    let skip_reason = r.scenarios.iter().find(|s| s.id == "SBX-SNAP-002").unwrap();
    assert!(
        skip.contains(&dom_text(skip_reason.reason.as_deref().unwrap())),
        "{skip}"
    );

    // The control: the same check sees a violation once the style sheet no longer matches
    // the page's policy, so the clean log above means something.
    let html = std::fs::read_to_string(&page).unwrap();
    let tampered = tmp.path().join("tampered.html");
    std::fs::write(
        &tampered,
        html.replacen("--pass: #1a7f37", "--pass: #1a7f38", 1),
    )
    .unwrap();
    let (_, log) = chromium(
        &browser,
        &tmp.path().join("profile-control"),
        &tampered,
        &["--dump-dom"],
    );
    assert!(
        log.contains("Content Security Policy"),
        "the control page was not refused:\n{log}"
    );

    // Screenshots to look at: a desktop window and a phone-sized one.
    let artifacts = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report-browser");
    std::fs::create_dir_all(&artifacts).unwrap();
    for (name, width, height) in [("report.png", 1280, 2400), ("report-narrow.png", 390, 2400)] {
        let shot = artifacts.join(name);
        let _ = std::fs::remove_file(&shot);
        chromium(
            &browser,
            &tmp.path().join(format!("profile-{width}")),
            &page,
            &[
                &format!("--window-size={width},{height}"),
                &format!("--screenshot={}", shot.display()),
            ],
        );
        let bytes = std::fs::read(&shot).unwrap();
        assert_eq!(png_size(&bytes), (width, height), "{name}");
        eprintln!("screenshot: {}", shot.display());
    }
    std::fs::copy(&page, artifacts.join("report.html")).unwrap();
}
