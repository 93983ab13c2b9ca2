//! The `sandspec serve` command line: flags and an optional TOML file build a [`Config`];
//! then bind, print `listening on URL`, and serve until SIGTERM or SIGINT.
//!
//! Usage errors (a bad flag value, an unknown defect, a missing file) exit with status 2 and
//! one line on stderr; failures while running exit with status 1.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use serde::Deserialize;

use crate::config::{Config, Database, Limits, Principal, ProviderConfig, Retention, Scope, Tls};
use crate::defects::{Defect, Defects};

/// Arguments of `sandspec serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on [default: 127.0.0.1:0].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// A principal as NAME:TOKEN or NAME:TOKEN:SCOPES (SCOPES is read, write or read+write).
    /// Kept as given and parsed in [`ServeArgs::to_config`], so that a mistake is reported
    /// without echoing the token.
    #[arg(long = "principal", value_name = "NAME:TOKEN[:SCOPES]")]
    pub principals: Vec<String>,
    /// The token that guards the test controls.
    #[arg(long)]
    pub admin_token: Option<String>,
    /// A TOML file with any of: principals, admin_token, providers, limits, retention,
    /// test_controls, data_dir, database_url, defects, tls. Flags override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Where sandboxes, snapshots and the default SQLite database live [default: ./sandspec-data].
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// `sqlite::memory:`, `sqlite://PATH` or `postgres://...` [default: SQLite in the data dir].
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
    /// Serve the test controls (needs an admin token).
    #[arg(long)]
    pub enable_test_controls: bool,
    /// Switch on a deliberate defect (builds with the `defects` feature only).
    #[arg(long = "defect", value_name = "NAME", value_parser = parse_defect)]
    pub defects: Vec<Defect>,
    /// Print every defect with its description and exit.
    #[arg(long)]
    pub list_defects: bool,
    /// PEM certificate chain: serve HTTPS.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Override a limit, e.g. `--limit max_streams_per_principal=2`.
    #[arg(long = "limit", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub limits: Vec<(String, u64)>,
    /// Override a retention period, e.g. `--retention process_output_s=5`.
    #[arg(long = "retention", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub retention: Vec<(String, u64)>,
}

/// Parses `NAME:TOKEN[:SCOPES]`; errors name the principal, never the token.
fn parse_principal(s: &str) -> Result<Principal, String> {
    let mut parts = s.splitn(3, ':');
    let name = parts.next().unwrap_or_default();
    let token = parts
        .next()
        .ok_or_else(|| format!("--principal `{name}`: expected NAME:TOKEN[:SCOPES]"))?;
    if name.is_empty() || token.is_empty() {
        return Err(
            "--principal: expected NAME:TOKEN[:SCOPES] with a non-empty name and token".into(),
        );
    }
    let scopes = match parts.next() {
        None | Some("read+write") | Some("write+read") => Principal::all_scopes(),
        Some("read") => vec![Scope::Read],
        Some("write") => vec![Scope::Write],
        Some(other) => {
            return Err(format!(
                "--principal `{name}`: unknown scopes `{other}` (use read, write or read+write)"
            ));
        }
    };
    Ok(Principal {
        name: name.to_owned(),
        token: token.to_owned(),
        scopes,
    })
}

fn parse_defect(s: &str) -> Result<Defect, String> {
    s.parse::<Defect>().map_err(|e| e.to_string())
}

fn parse_key_value(s: &str) -> Result<(String, u64), String> {
    let (k, v) = s.split_once('=').ok_or("expected KEY=VALUE")?;
    let v = v
        .parse::<u64>()
        .map_err(|_| format!("`{v}` is not a non-negative integer"))?;
    Ok((k.to_owned(), v))
}

/// The TOML configuration file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    #[serde(default)]
    principals: Vec<Principal>,
    admin_token: Option<String>,
    providers: Option<Vec<ProviderConfig>>,
    limits: Option<Limits>,
    retention: Option<Retention>,
    test_controls: Option<bool>,
    data_dir: Option<PathBuf>,
    database_url: Option<String>,
    #[serde(default)]
    defects: Vec<String>,
    tls: Option<FileTls>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTls {
    cert: PathBuf,
    key: PathBuf,
}

/// A mistake in how the server was started: exit status 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(String);

fn usage(msg: impl Into<String>) -> UsageError {
    UsageError(msg.into())
}

/// Sets one numeric field of a `Limits` or `Retention` by name.
fn override_field<T: serde::Serialize + serde::de::DeserializeOwned>(
    value: &mut T,
    what: &str,
    key: &str,
    n: u64,
) -> Result<(), UsageError> {
    let mut json = serde_json::to_value(&*value).map_err(|e| usage(e.to_string()))?;
    let obj = json
        .as_object_mut()
        .ok_or_else(|| usage(format!("{what} is not a table")))?;
    if !obj.contains_key(key) {
        let known: Vec<&str> = obj.keys().map(String::as_str).collect();
        return Err(usage(format!(
            "unknown {what} `{key}` (known: {})",
            known.join(", ")
        )));
    }
    obj.insert(key.to_owned(), n.into());
    *value =
        serde_json::from_value(json).map_err(|_| usage(format!("{what} `{key}` cannot be {n}")))?;
    Ok(())
}

fn parse_database(url: &str) -> Result<Database, UsageError> {
    if url == "sqlite::memory:" {
        return Ok(Database::Sqlite(None));
    }
    if let Some(path) = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
    {
        if path.is_empty() {
            return Err(usage("--database-url sqlite: needs a path"));
        }
        return Ok(Database::Sqlite(Some(PathBuf::from(path))));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok(Database::Postgres(url.to_owned()));
    }
    Err(usage(
        "--database-url must be sqlite::memory:, sqlite://PATH or postgres://...",
    ))
}

impl ServeArgs {
    /// Builds the configuration: the file first, then the flags over it.
    pub fn to_config(&self) -> Result<Config, UsageError> {
        let (file, base) = match &self.config {
            None => (FileConfig::default(), PathBuf::new()),
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    usage(format!("cannot read config file {}: {e}", path.display()))
                })?;
                let file: FileConfig = toml::from_str(&text).map_err(|e| {
                    let line = e
                        .span()
                        .map_or(1, |s| text[..s.start].matches('\n').count() + 1);
                    usage(format!(
                        "invalid config file {}:{line}: {}",
                        path.display(),
                        e.message()
                    ))
                })?;
                let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
                (file, base)
            }
        };
        // Paths in the file are relative to the file.
        let rel = |p: PathBuf| if p.is_absolute() { p } else { base.join(p) };

        let data_dir = match (&self.data_dir, file.data_dir) {
            (Some(dir), _) => dir.clone(),
            (None, Some(dir)) => rel(dir),
            (None, None) => PathBuf::from("./sandspec-data"),
        };
        let database = match self
            .database_url
            .as_deref()
            .or(file.database_url.as_deref())
        {
            Some(url) => parse_database(url)?,
            None => Database::Sqlite(Some(data_dir.join("sandspec.db"))),
        };

        let mut principals = file.principals;
        for given in &self.principals {
            principals.push(parse_principal(given).map_err(usage)?);
        }
        for (i, p) in principals.iter().enumerate() {
            if principals[..i].iter().any(|q| q.name == p.name) {
                return Err(usage(format!("principal `{}` is given twice", p.name)));
            }
            if principals[..i].iter().any(|q| q.token == p.token) {
                return Err(usage(format!(
                    "principal `{}` reuses another principal's token",
                    p.name
                )));
            }
        }
        let admin_token = self.admin_token.clone().or(file.admin_token);
        if admin_token
            .as_ref()
            .is_some_and(|t| principals.iter().any(|p| &p.token == t))
        {
            return Err(usage(
                "the admin token must differ from every principal's token",
            ));
        }
        let test_controls = self.enable_test_controls || file.test_controls.unwrap_or(false);
        if test_controls && admin_token.is_none() {
            return Err(usage("--enable-test-controls needs --admin-token"));
        }

        let providers = file.providers.unwrap_or_else(Config::standard_providers);
        if providers.is_empty() {
            return Err(usage("at least one provider is needed"));
        }
        let mut limits = file.limits.unwrap_or_default();
        for (k, v) in &self.limits {
            override_field(&mut limits, "limit", k, *v)?;
        }
        let mut retention = file.retention.unwrap_or_default();
        for (k, v) in &self.retention {
            override_field(&mut retention, "retention", k, *v)?;
        }

        let mut names: Vec<String> = file.defects;
        names.extend(self.defects.iter().map(|d| d.name().to_owned()));
        let defects =
            Defects::parse(names.iter().map(String::as_str)).map_err(|e| usage(e.to_string()))?;

        let tls = match (&self.tls_cert, &self.tls_key, file.tls) {
            (Some(cert), Some(key), _) => Some(Tls {
                cert: cert.clone(),
                key: key.clone(),
            }),
            (_, _, Some(t)) => Some(Tls {
                cert: rel(t.cert),
                key: rel(t.key),
            }),
            _ => None,
        };
        if let Some(tls) = &tls {
            for f in [&tls.cert, &tls.key] {
                if !f.is_file() {
                    return Err(usage(format!("TLS file {} does not exist", f.display())));
                }
            }
        }
        Ok(Config {
            listen: self
                .listen
                .or(file.listen)
                .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0))),
            principals,
            admin_token,
            providers,
            limits,
            retention,
            data_dir,
            database,
            test_controls,
            defects,
            tls,
            gateway: crate::config::GatewayConfig::from_env(),
        })
    }
}

/// The agent worker that the gateway starts inside a session's sandbox (`sandspec worker`,
/// `sandspec-worker`): configured through its environment and, for the bridge secret, its
/// stdin. Exit status 2: misconfigured, 3: lease lost, 1: other failure.
pub fn worker_main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(crate::gateway::worker::run_from_env()),
        Err(e) => {
            eprintln!("sandspec worker: cannot start the async runtime: {e}");
            ExitCode::from(1)
        }
    }
}

/// Runs `sandspec serve`.
pub fn main(args: ServeArgs) -> ExitCode {
    if args.list_defects {
        let mut out = std::io::stdout().lock();
        for d in Defect::ALL {
            let _ = writeln!(out, "{:<40} {}", d.name(), d.describe());
        }
        return ExitCode::SUCCESS;
    }
    let config = match args.to_config() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("sandspec serve: {e}");
            return ExitCode::from(2);
        }
    };
    init_logging();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandspec serve: failed to start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sandspec serve: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    use anyhow::Context as _;
    if config.principals.is_empty() {
        tracing::warn!("no principals: every request but the health check will be refused");
    }
    if !config.defects.is_empty() {
        let names: Vec<&str> = config.defects.iter().map(Defect::name).collect();
        tracing::warn!(defects = %names.join(","), "deliberate defects are switched on");
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("failed to listen on {}", config.listen))?;
    let server = crate::server::Server::build(listener, config).await?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", server.url())?;
        out.flush()?;
    }
    tracing::info!(url = %server.url(), "serving");
    server.serve(shutdown_signal()).await
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`). Never fails: a subscriber set
/// by the embedding program wins.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn args(list: &[&str]) -> Result<ServeArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("serve").chain(list.iter().copied())).map(|c| c.serve)
    }

    #[test]
    fn principals_and_scopes_parse() {
        let c = args(&["--principal", "alice:t1", "--principal", "r:t2:read"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.principals[0].scopes, Principal::all_scopes());
        assert_eq!(c.principals[1].scopes, vec![Scope::Read]);
        let refused = |given: &str| {
            args(&["--principal", given])
                .unwrap()
                .to_config()
                .unwrap_err()
        };
        assert!(refused("alice").to_string().contains("alice"));
        let err = refused("alice:secret-token:admin").to_string();
        assert!(
            err.contains("admin") && !err.contains("secret-token"),
            "{err}"
        );
    }

    #[test]
    fn usage_errors_are_refused() {
        assert!(args(&["--defect", "no-such-bug"]).is_err());
        assert!(args(&["--tls-cert", "x.pem"]).is_err());
        let a = args(&["--enable-test-controls"]).unwrap();
        assert!(
            a.to_config()
                .unwrap_err()
                .to_string()
                .contains("admin-token")
        );
        let a = args(&["--limit", "no_such=1"]).unwrap();
        assert!(a.to_config().unwrap_err().to_string().contains("no_such"));
        let a = args(&[
            "--tls-cert",
            "/nonexistent/c.pem",
            "--tls-key",
            "/nonexistent/k.pem",
        ])
        .unwrap();
        assert!(
            a.to_config()
                .unwrap_err()
                .to_string()
                .contains("/nonexistent/c.pem")
        );
    }

    #[test]
    fn flags_override_and_defaults() {
        let a = args(&[
            "--limit",
            "max_streams_per_principal=2",
            "--retention",
            "process_output_s=5",
        ])
        .unwrap();
        let c = a.to_config().unwrap();
        assert_eq!(c.limits.max_streams_per_principal, 2);
        assert_eq!(c.retention.process_output_s, 5);
        assert_eq!(c.data_dir, PathBuf::from("./sandspec-data"));
        assert_eq!(
            c.database,
            Database::Sqlite(Some(PathBuf::from("./sandspec-data/sandspec.db")))
        );
        let c = args(&["--database-url", "sqlite::memory:"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.database, Database::Sqlite(None));
    }

    #[test]
    fn config_file_is_strict_and_named_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serve.toml");
        std::fs::write(
            &path,
            "admin_token = \"adm\"\ntest_controls = true\n[[principals]]\nname = \"a\"\ntoken = \"t\"\n[limits]\nmax_page_size = 7\n",
        )
        .unwrap();
        let c = args(&["--config", path.to_str().unwrap()])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.limits.max_page_size, 7);
        assert!(c.test_controls);
        assert_eq!(c.principals.len(), 1);
        std::fs::write(&path, "admin_token = \"a\"\nbogus = 1\n").unwrap();
        let err = args(&["--config", path.to_str().unwrap()])
            .unwrap()
            .to_config()
            .unwrap_err();
        assert!(err.to_string().contains("serve.toml:2:"), "{err}");
    }

    #[test]
    fn defects_need_the_feature() {
        let result = args(&["--defect", "pause-noop"]).unwrap().to_config();
        assert_eq!(result.is_ok(), cfg!(feature = "defects"));
    }
}
