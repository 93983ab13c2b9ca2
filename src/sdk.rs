//! The SDK version matrix (`--sdk`): a protocol's real client SDKs, at pinned versions, as the
//! judge of a target. Each SDK is installed into a cache of its own (a virtualenv, an npm
//! prefix) and runs the profile's *journeys*, short programs of this project that do what a
//! user's code does (create, run and stream, files, list pages, pause and connect, timeouts,
//! kill, secure access); each cell of the journey × SDK table is PASS, FAIL (with the SDK's
//! own exception text), SKIP (the SDK version has no such API) or ERROR (the SDK could not be
//! installed or the journey program broke). The newest release of each language is judged:
//! its journeys are scenarios of the run, with their clauses, so a failure fails those clauses
//! in the verdict; older versions are reported in the matrix, not judged.
//!
//! A journey program prints one JSON line per journey, `{"journey": "...", "outcome": "pass"
//! | "fail" | "skip", "detail": "...", "ms": 12}`, to standard output; nothing it prints is
//! trusted further than that, and every read is bounded.

use std::cmp::Ordering;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _};

/// A client SDK's language.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Language {
    Python,
    Node,
}

/// One SDK at one version: `python:e2b==2.63.0`, `node:e2b@2.51.0`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SdkSpec {
    pub language: Language,
    pub package: String,
    pub version: String,
}

impl fmt::Display for SdkSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.language {
            Language::Python => write!(f, "python:{}=={}", self.package, self.version),
            Language::Node => write!(f, "node:{}@{}", self.package, self.version),
        }
    }
}

impl std::str::FromStr for SdkSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "`{s}` is not an SDK: write `python:<package>==<version>` or `node:<package>@<version>`"
            )
        };
        let (language, rest) = s.split_once(':').ok_or_else(bad)?;
        let (language, (package, version)) = match language {
            "python" => (Language::Python, rest.split_once("==").ok_or_else(bad)?),
            "node" => (Language::Node, rest.rsplit_once('@').ok_or_else(bad)?),
            _ => return Err(bad()),
        };
        let exact = !version.is_empty()
            && version
                .split('.')
                .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric()));
        let name = !package.is_empty()
            && package
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.@/".contains(&b));
        if !exact || !name {
            return Err(format!(
                "`{s}`: an SDK is pinned to one exact version of one package"
            ));
        }
        Ok(SdkSpec {
            language,
            package: package.to_owned(),
            version: version.to_owned(),
        })
    }
}

impl SdkSpec {
    /// The version's numeric parts, for ordering releases.
    fn numbers(&self) -> Vec<u64> {
        self.version
            .split('.')
            .map(|p| {
                p.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
                    .parse()
                    .unwrap_or(0)
            })
            .collect()
    }

    /// The directory of the cache it is installed in.
    fn cache_name(&self) -> String {
        let lang = match self.language {
            Language::Python => "python",
            Language::Node => "node",
        };
        format!(
            "{lang}-{}-{}",
            self.package.replace(['/', '@'], "_"),
            self.version
        )
    }
}

/// One journey: what users' code does, with the clauses it exercises.
#[derive(Debug, Clone, Copy)]
pub struct Journey {
    pub name: &'static str,
    pub title: &'static str,
    pub clauses: &'static [&'static str],
}

/// Where a journey program points its SDK.
#[derive(Debug, Clone, Copy)]
pub struct SdkTarget<'a> {
    pub base_url: &'a str,
    pub envd_domain: Option<&'a str>,
    pub api_key: &'a str,
    pub run_id: &'a str,
}

/// A profile's SDK journeys: the programs and how they are pointed at a target.
pub struct Journeys {
    /// The SDKs `--sdk default` stands for: the newest Python and JavaScript releases and one
    /// older major.
    pub default: &'static [&'static str],
    pub journeys: &'static [Journey],
    /// The journey program for the Python SDKs, and for the JavaScript ones (an ES module).
    pub python: &'static str,
    pub node: &'static str,
    /// The prefix of the scenario IDs of judged journeys: `<prefix>-PYTHON-<JOURNEY>`.
    pub id_prefix: &'static str,
}

impl Journeys {
    /// `--sdk` values: each a spec, or `default`.
    pub fn specs(&self, given: &[String]) -> Result<Vec<SdkSpec>, String> {
        let mut out: Vec<SdkSpec> = Vec::new();
        for value in given {
            let expanded: Vec<&str> = if value == "default" {
                self.default.to_vec()
            } else {
                vec![value.as_str()]
            };
            for spec in expanded {
                let spec: SdkSpec = spec.parse()?;
                if !out.contains(&spec) {
                    out.push(spec);
                }
            }
        }
        Ok(out)
    }

    /// The scenario ID a judged journey of `language` has.
    pub fn id(&self, language: Language, journey: &Journey) -> String {
        let lang = match language {
            Language::Python => "PYTHON",
            Language::Node => "NODE",
        };
        format!(
            "{}-{lang}-{}",
            self.id_prefix,
            journey.name.to_uppercase().replace('_', "-")
        )
    }
}

/// The newest release of each language among `specs`: the ones judged.
pub fn judged(specs: &[SdkSpec]) -> Vec<bool> {
    specs
        .iter()
        .map(|s| {
            !specs.iter().any(|o| {
                o.language == s.language
                    && o.package == s.package
                    && o.numbers().cmp(&s.numbers()) == Ordering::Greater
            })
        })
        .collect()
}

/// One cell's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CellOutcome {
    Pass,
    Fail,
    Skip,
    Error,
}

/// One cell of the matrix: a journey run by one SDK.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cell {
    pub journey: String,
    /// The SDK, as `--sdk` names it.
    pub sdk: String,
    pub outcome: CellOutcome,
    /// The SDK's own exception text for a failure, why for a skip or an error.
    pub detail: Option<String>,
    pub ms: u64,
}

/// One SDK of the matrix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Column {
    pub sdk: String,
    /// The newest release of its language in the run: its journeys judge the target.
    pub judged: bool,
}

/// One journey of the matrix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Row {
    pub journey: String,
    pub title: String,
    pub clauses: Vec<String>,
}

/// The journey × SDK table, as the receipt records it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SdkMatrix {
    pub sdks: Vec<Column>,
    pub journeys: Vec<Row>,
    pub cells: Vec<Cell>,
}

impl SdkMatrix {
    pub fn cell(&self, journey: &str, sdk: &str) -> Option<&Cell> {
        self.cells
            .iter()
            .find(|c| c.journey == journey && c.sdk == sdk)
    }
}

/// Longest line a journey program may print, and most it may print in all.
const MAX_LINE: usize = 64 * 1024;
const MAX_OUTPUT: usize = 4 * 1024 * 1024;
/// Most of a program's standard error kept, from its end, for an error's detail.
const MAX_STDERR: usize = 16 * 1024;
/// How long one journey may take, and an install.
pub const JOURNEY_WAIT: Duration = Duration::from_secs(120);
const INSTALL_WAIT: Duration = Duration::from_secs(600);

/// Runs every journey with every SDK of `specs`, each program with the environment `env`
/// gives it (which points it at the target), installing each SDK into `cache` first. The
/// cells come in journey order, SDK by SDK.
pub async fn run(
    journeys: &Journeys,
    specs: &[SdkSpec],
    cache: &Path,
    env: &(dyn Fn(&SdkSpec) -> Vec<(String, String)> + Sync),
) -> SdkMatrix {
    let judged = judged(specs);
    let mut matrix = SdkMatrix {
        sdks: specs
            .iter()
            .zip(&judged)
            .map(|(s, j)| Column {
                sdk: s.to_string(),
                judged: *j,
            })
            .collect(),
        journeys: journeys
            .journeys
            .iter()
            .map(|j| Row {
                journey: j.name.to_owned(),
                title: j.title.to_owned(),
                clauses: j.clauses.iter().map(|c| (*c).to_owned()).collect(),
            })
            .collect(),
        cells: Vec::new(),
    };
    for spec in specs {
        let cells = match install(spec, journeys, cache).await {
            Err(why) => journeys
                .journeys
                .iter()
                .map(|j| Cell {
                    journey: j.name.to_owned(),
                    sdk: spec.to_string(),
                    outcome: CellOutcome::Error,
                    detail: Some(format!("the SDK could not be installed: {why}")),
                    ms: 0,
                })
                .collect(),
            Ok(program) => {
                let wait = JOURNEY_WAIT * u32::try_from(journeys.journeys.len()).unwrap_or(1);
                drive(journeys, spec, &program, &env(spec), wait).await
            }
        };
        for c in &cells {
            eprintln!(
                "sdk: {:<5} {} with {spec}{}",
                format!("{:?}", c.outcome).to_uppercase(),
                c.journey,
                c.detail
                    .as_deref()
                    .map(|d| format!(": {d}"))
                    .unwrap_or_default()
            );
        }
        matrix.cells.extend(cells);
    }
    matrix
}

/// The command that runs the journey program of an installed SDK.
struct Program {
    argv: Vec<PathBuf>,
    env: Vec<(String, String)>,
}

/// Installs `spec` into its directory of `cache` (once: a marker says an install finished) and
/// writes the journey program beside it. Runs that share a cache take turns: a lock file beside
/// the directory is held from the marker check until the program is written.
async fn install(spec: &SdkSpec, journeys: &Journeys, cache: &Path) -> Result<Program, String> {
    std::fs::create_dir_all(cache).map_err(|e| format!("cannot make {}: {e}", cache.display()))?;
    let lock_path = cache.join(format!("{}.lock", spec.cache_name()));
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| format!("cannot open {}: {e}", lock_path.display()))?;
    let waited_since = tokio::time::Instant::now();
    loop {
        match lock.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) => {
                if waited_since.elapsed() > INSTALL_WAIT {
                    return Err(format!(
                        "another run held {} for longer than {}s",
                        lock_path.display(),
                        INSTALL_WAIT.as_secs()
                    ));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(format!("cannot lock {}: {e}", lock_path.display()));
            }
        }
    }
    // The lock is released when `lock` is dropped, on every return below.
    let dir = cache.join(spec.cache_name());
    let marker = dir.join("sandspec-installed");
    let done = std::fs::read_to_string(&marker).is_ok_and(|m| m == spec.to_string());
    if !done {
        eprintln!("sdk: {spec}: installing into {}", dir.display());
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        let steps: Vec<Vec<String>> = match spec.language {
            Language::Python => vec![
                vec![
                    "python3".into(),
                    "-m".into(),
                    "venv".into(),
                    dir.join("venv").display().to_string(),
                ],
                vec![
                    dir.join("venv/bin/pip").display().to_string(),
                    "install".into(),
                    "--quiet".into(),
                    "--disable-pip-version-check".into(),
                    format!("{}=={}", spec.package, spec.version),
                ],
            ],
            Language::Node => vec![vec![
                "npm".into(),
                "install".into(),
                "--no-audit".into(),
                "--no-fund".into(),
                "--no-save".into(),
                "--prefix".into(),
                dir.display().to_string(),
                format!("{}@{}", spec.package, spec.version),
            ]],
        };
        for argv in steps {
            let mut cmd = tokio::process::Command::new(&argv[0]);
            cmd.args(&argv[1..])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .kill_on_drop(true);
            let child = cmd
                .spawn()
                .map_err(|e| format!("cannot run {}: {e}", argv[0]))?;
            let out = tokio::time::timeout(INSTALL_WAIT, child.wait_with_output())
                .await
                .map_err(|_| {
                    format!(
                        "`{}` took longer than {}s",
                        argv.join(" "),
                        INSTALL_WAIT.as_secs()
                    )
                })?
                .map_err(|e| format!("`{}`: {e}", argv.join(" ")))?;
            if !out.status.success() {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(format!(
                    "`{}` failed ({}): {}",
                    argv.join(" "),
                    out.status,
                    tail(&out.stderr, 2000)
                ));
            }
        }
        std::fs::write(&marker, spec.to_string())
            .map_err(|e| format!("cannot write {}: {e}", marker.display()))?;
    }
    let (script, text) = match spec.language {
        Language::Python => (dir.join("journeys.py"), journeys.python),
        Language::Node => (dir.join("journeys.mjs"), journeys.node),
    };
    std::fs::write(&script, text).map_err(|e| format!("cannot write {}: {e}", script.display()))?;
    Ok(match spec.language {
        Language::Python => Program {
            argv: vec![dir.join("venv/bin/python"), script],
            env: Vec::new(),
        },
        Language::Node => Program {
            argv: vec![PathBuf::from("node"), script],
            env: vec![("SANDSPEC_NPM_PREFIX".into(), dir.display().to_string())],
        },
    })
}

/// Runs the journey program once for all journeys, reading its result lines as they come, for
/// at most `deadline` and [`MAX_OUTPUT`] bytes; a journey it does not report on is an error.
async fn drive(
    journeys: &Journeys,
    spec: &SdkSpec,
    program: &Program,
    env: &[(String, String)],
    deadline: Duration,
) -> Vec<Cell> {
    let sdk = spec.to_string();
    let broke = |why: &str| -> Vec<Cell> {
        journeys
            .journeys
            .iter()
            .map(|j| Cell {
                journey: j.name.to_owned(),
                sdk: sdk.clone(),
                outcome: CellOutcome::Error,
                detail: Some(why.to_owned()),
                ms: 0,
            })
            .collect()
    };
    let mut cmd = tokio::process::Command::new(&program.argv[0]);
    cmd.args(&program.argv[1..])
        .args(journeys.journeys.iter().map(|j| j.name))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", std::env::var_os("HOME").unwrap_or_default())
        .envs(program.env.iter().map(|(k, v)| (k, v)))
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return broke(&format!("the journey program could not start: {e}")),
    };
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let errors = tokio::spawn(async move {
        let mut kept = Vec::new();
        let mut buf = [0u8; 8192];
        while let Ok(n) = stderr.read(&mut buf).await {
            if n == 0 {
                break;
            }
            kept.extend_from_slice(&buf[..n]);
            if kept.len() > 2 * MAX_STDERR {
                kept.drain(..kept.len() - MAX_STDERR);
            }
        }
        kept
    });
    let started = Instant::now();
    let mut cells: Vec<Cell> = Vec::new();
    let mut reader = tokio::io::BufReader::new(stdout).take(MAX_OUTPUT as u64 + 1);
    let mut line = Vec::new();
    let mut broken = None;
    let mut printed = 0usize;
    loop {
        line.clear();
        let left = deadline.saturating_sub(started.elapsed());
        let read = tokio::time::timeout(left, bounded_line(&mut reader, &mut line)).await;
        match read {
            Err(_) => {
                broken = Some(format!(
                    "the journeys did not end within {}s",
                    deadline.as_secs()
                ));
                break;
            }
            Ok(Err(e)) => {
                broken = Some(e);
                break;
            }
            Ok(Ok(0)) => break,
            Ok(Ok(n)) => printed += n,
        }
        if printed > MAX_OUTPUT {
            broken = Some(format!(
                "the journey program printed more than {MAX_OUTPUT} bytes"
            ));
            break;
        }
        match serde_json::from_slice::<Reported>(&line) {
            Ok(r) if journeys.journeys.iter().any(|j| j.name == r.journey) => cells.push(Cell {
                journey: r.journey,
                sdk: sdk.clone(),
                outcome: match r.outcome {
                    ReportedOutcome::Pass => CellOutcome::Pass,
                    ReportedOutcome::Fail => CellOutcome::Fail,
                    ReportedOutcome::Skip => CellOutcome::Skip,
                },
                detail: r.detail.filter(|d| !d.is_empty()),
                ms: r.ms,
            }),
            // Anything else the program printed (an SDK's own logging) is not a result.
            _ => {}
        }
    }
    // The program and whatever it started (an SDK's helper processes) end with the journeys.
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        // SAFETY: killpg(2) on the process group our own unreaped child leads.
        unsafe { libc::killpg(pid, libc::SIGKILL) };
    }
    let _ = child.start_kill();
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    let stderr = errors.await.unwrap_or_default();
    // Every journey the program did not report on: it ended early or broke.
    let why = broken.unwrap_or_else(|| {
        format!(
            "the journey program ended ({}) without reporting it: {}",
            match status {
                Ok(Ok(s)) => s.to_string(),
                _ => "not at all".to_owned(),
            },
            tail(&stderr, 1500)
        )
    });
    for j in journeys.journeys {
        if !cells.iter().any(|c| c.journey == j.name) {
            cells.push(Cell {
                journey: j.name.to_owned(),
                sdk: sdk.clone(),
                outcome: CellOutcome::Error,
                detail: Some(why.clone()),
                ms: 0,
            });
        }
    }
    cells.sort_by_key(|c| journeys.journeys.iter().position(|j| j.name == c.journey));
    cells
}

/// One line of at most [`MAX_LINE`] bytes into `line` (its end of line dropped); the number
/// of bytes read, 0 at the end of the output.
async fn bounded_line<R: tokio::io::AsyncBufRead + Unpin>(
    reader: &mut R,
    line: &mut Vec<u8>,
) -> Result<usize, String> {
    let mut total = 0;
    loop {
        let buf = reader
            .fill_buf()
            .await
            .map_err(|e| format!("cannot read the journey program: {e}"))?;
        if buf.is_empty() {
            return Ok(total);
        }
        let (take, end) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        total += take;
        if line.len() > MAX_LINE {
            return Err(format!(
                "the journey program printed a line longer than {MAX_LINE} bytes"
            ));
        }
        if end {
            line.pop();
            return Ok(total);
        }
    }
}

/// The end of `bytes` as text, at most `max` bytes, on one line.
fn tail(bytes: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(&bytes[bytes.len().saturating_sub(max)..]);
    text.trim().replace(['\r', '\n'], " | ")
}

#[derive(Deserialize)]
struct Reported {
    journey: String,
    outcome: ReportedOutcome,
    #[serde(default)]
    detail: Option<String>,
    #[serde(default)]
    ms: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum ReportedOutcome {
    Pass,
    Fail,
    Skip,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_only_exact_pins_do() {
        let py: SdkSpec = "python:e2b==2.63.0".parse().unwrap();
        assert_eq!(py.language, Language::Python);
        assert_eq!(
            (py.package.as_str(), py.version.as_str()),
            ("e2b", "2.63.0")
        );
        assert_eq!(py.to_string(), "python:e2b==2.63.0");
        let js: SdkSpec = "node:@e2b/code-interpreter@2.3.0".parse().unwrap();
        assert_eq!(js.package, "@e2b/code-interpreter");
        assert_eq!(js.to_string(), "node:@e2b/code-interpreter@2.3.0");
        for bad in [
            "e2b==2.63.0",
            "ruby:e2b==1",
            "python:e2b>=2",
            "python:e2b==",
            "node:e2b@latest; rm",
            "python:e2b==2.*",
        ] {
            assert!(bad.parse::<SdkSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_newest_of_each_language_is_judged() {
        let specs: Vec<SdkSpec> = [
            "python:e2b==2.63.0",
            "node:e2b@2.51.0",
            "python:e2b==1.11.1",
            "python:e2b==2.9.1",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        assert_eq!(judged(&specs), [true, true, false, false]);
    }

    #[tokio::test]
    async fn a_line_is_read_whole_and_bounded() {
        let input = b"{\"a\":1}\nnext".to_vec();
        let mut reader = tokio::io::BufReader::new(&input[..]);
        let mut line = Vec::new();
        assert_eq!(bounded_line(&mut reader, &mut line).await.unwrap(), 8);
        assert_eq!(line, b"{\"a\":1}");
        line.clear();
        assert_eq!(bounded_line(&mut reader, &mut line).await.unwrap(), 4);
        let endless = vec![b'x'; MAX_LINE + 10];
        let mut reader = tokio::io::BufReader::new(&endless[..]);
        let mut line = Vec::new();
        assert!(bounded_line(&mut reader, &mut line).await.is_err());
    }

    const TWO: &[Journey] = &[
        Journey {
            name: "first",
            title: "first",
            clauses: &[],
        },
        Journey {
            name: "second",
            title: "second",
            clauses: &[],
        },
    ];
    const FAKE: Journeys = Journeys {
        default: &[],
        journeys: TWO,
        python: "",
        node: "",
        id_prefix: "T",
    };

    #[tokio::test]
    async fn runs_sharing_a_cache_take_turns_installing() {
        let cache = tempfile::tempdir().unwrap();
        let spec: SdkSpec = "python:e2b==1.0.0".parse().unwrap();
        // An install another run finished: the marker is there.
        let dir = cache.path().join(spec.cache_name());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("sandspec-installed"), spec.to_string()).unwrap();
        // Another run is still holding the lock.
        let held = std::fs::File::create(cache.path().join(format!("{}.lock", spec.cache_name())))
            .unwrap();
        held.lock().unwrap();
        let path = cache.path().to_path_buf();
        let waiting = tokio::spawn(async move { install(&spec, &FAKE, &path).await });
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(
            !waiting.is_finished(),
            "install went on while the lock was held"
        );
        held.unlock().unwrap();
        let program = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("install ends once the lock is free")
            .unwrap()
            .unwrap();
        assert!(program.argv[0].ends_with("venv/bin/python"));
        assert!(dir.join("journeys.py").exists());
    }

    /// `drive` with a shell script standing in for an SDK's journey program.
    async fn drive_script(script: &str, wait: Duration) -> Vec<Cell> {
        let program = Program {
            argv: vec!["sh".into(), "-c".into(), script.into(), "journeys".into()],
            env: Vec::new(),
        };
        let spec: SdkSpec = "python:e2b==1.0.0".parse().unwrap();
        drive(&FAKE, &spec, &program, &[], wait).await
    }

    #[tokio::test]
    async fn results_are_read_and_an_unreported_journey_is_an_error() {
        let cells = drive_script(
            r#"echo 'SDK log line'; echo '{"journey":"second","outcome":"fail","detail":"boom","ms":5}'; echo 'gone' >&2; exit 3"#,
            Duration::from_secs(30),
        )
        .await;
        assert_eq!(cells.len(), 2);
        assert_eq!(cells[0].journey, "first");
        assert_eq!(cells[0].outcome, CellOutcome::Error);
        let why = cells[0].detail.as_deref().unwrap();
        assert!(
            why.contains("ended") && why.contains('3') && why.contains("gone"),
            "{why}"
        );
        assert_eq!(cells[1].outcome, CellOutcome::Fail);
        assert_eq!((cells[1].detail.as_deref(), cells[1].ms), (Some("boom"), 5));
    }

    #[tokio::test]
    async fn a_program_that_prints_without_end_or_hangs_is_cut_off() {
        let cells = drive_script("yes 0123456789abcdef", Duration::from_secs(60)).await;
        let why = cells[0].detail.as_deref().unwrap();
        assert!(why.contains("more than"), "{why}");
        let started = Instant::now();
        let cells = drive_script(
            r#"echo '{"journey":"first","outcome":"pass"}'; sleep 600 & sleep 600"#,
            Duration::from_millis(500),
        )
        .await;
        assert!(started.elapsed() < Duration::from_secs(15));
        assert_eq!(cells[0].outcome, CellOutcome::Pass);
        assert_eq!(cells[1].outcome, CellOutcome::Error);
        assert!(cells[1].detail.as_deref().unwrap().contains("did not end"));
    }
}
