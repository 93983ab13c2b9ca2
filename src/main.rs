//! The `sandspec` command: the runner (`run`, `list`, `sweep`, `evidence verify`), the
//! sessions worker (`worker`, internal), `sandspec serve` (the reference server) and
//! `sandspec mcp` (the reference sandbox MCP server). `main` only parses arguments and calls
//! library functions.
//!
//! The runner library does not depend on the reference server; this binary does, through the
//! default `reference` feature. Built without it (`--no-default-features`), `sandspec` is the
//! runner alone: `run` then needs `--target` or `--launch`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "sandspec",
    version,
    about = "Conformance suite and acceptance-testing harness for code-execution sandboxes and agent sessions"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run scenarios against a target and judge conformance.
    Run(Box<sandspec::cli::RunArgs>),
    /// List the scenario catalog: ID, level, clauses, title.
    List(sandspec::cli::ListArgs),
    /// Remove test resources (tagged `sandspec_run`) left by earlier, interrupted runs.
    Sweep(sandspec::cli::SweepArgs),
    /// Run the reference server.
    #[cfg(feature = "reference")]
    Serve(reference_server::cli::ServeArgs),
    /// Run the reference sandbox MCP server on stdio, over the E2B control plane named by
    /// E2B_API_URL and E2B_API_KEY.
    #[cfg(feature = "reference")]
    Mcp(reference_server::mcp::McpArgs),
    /// Work with evidence folders.
    #[command(subcommand)]
    Evidence(EvidenceCommand),
    /// The agent worker the reference server starts inside a session's sandbox (internal:
    /// configured through its environment and stdin by the server).
    #[cfg(feature = "reference")]
    #[command(hide = true)]
    Worker,
}

#[derive(Debug, Subcommand)]
enum EvidenceCommand {
    /// Compare two run folders for a release review: regressions, fixes, scenarios added or
    /// removed, verdicts and the gate that changed, MUST clauses newly covered or lost, and
    /// scenarios whose time changed beyond the runs' own spread. Both must verify. Prints
    /// Markdown; exit code 0 when nothing got worse, 1 when something did, 2 when a folder is
    /// refused.
    Diff {
        /// The earlier run's folder.
        old: PathBuf,
        /// The later run's folder.
        new: PathBuf,
        /// Also write the comparison as JSON to this file.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Write the Markdown to this file instead of standard output.
        #[arg(long, value_name = "FILE")]
        markdown: Option<PathBuf>,
    },
    /// Merge the folders of one run's shards (`--shard 1/n` ... `n/n`) into one verified
    /// folder with one verdict. Exit code as the whole run's: 0 conformant (or its gate
    /// passed), 1 not (or its gate failed); 2 when the shards are refused (missing, given
    /// twice, of another run, or not verified), 3 when writing failed.
    Merge {
        /// The shard folders, in any order.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        /// Where to write the merged folder (it must not exist, or be empty).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Sign the merged receipt with this Ed25519 private key (PKCS#8 PEM).
        #[arg(long, value_name = "FILE")]
        sign_key: Option<PathBuf>,
    },
    /// Check a run folder: manifest digests, the receipt against its schema and the folder,
    /// a scan of every file for secrets, and with --key the receipt's signature. Exit code 0
    /// only when all hold, 1 otherwise, 2 when DIR is not a folder or the key is unusable.
    Verify {
        /// The run folder (e.g. evidence/runs/<run-id>).
        dir: PathBuf,
        /// Ed25519 public key (SubjectPublicKeyInfo PEM) that must have signed the receipt
        /// (`receipt.dsse.json`).
        #[arg(long, value_name = "PUBFILE")]
        key: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    match Cli::parse().command {
        #[cfg(not(feature = "reference"))]
        Command::Run(args) if args.target.is_none() && args.launch.is_none() => {
            eprintln!(
                "error: this sandspec was built without the embedded reference server (the \
                 `reference` feature); name a target with --target URL or --launch COMMAND"
            );
            ExitCode::from(sandspec::cli::EXIT_USAGE)
        }
        Command::Run(args) => sandspec::commands::run_blocking(*args),
        Command::List(args) => sandspec::commands::list(&args),
        Command::Sweep(args) => sandspec::commands::sweep_blocking(args),
        #[cfg(feature = "reference")]
        Command::Serve(args) => reference_server::cli::main(args),
        #[cfg(feature = "reference")]
        Command::Mcp(args) => reference_server::mcp::run_blocking(args),
        #[cfg(feature = "reference")]
        Command::Worker => reference_server::cli::worker_main(),
        Command::Evidence(EvidenceCommand::Verify { dir, key }) => ExitCode::from(
            u8::try_from(sandspec::evidence::verify_cli(&dir, key.as_deref())).unwrap_or(1),
        ),
        Command::Evidence(EvidenceCommand::Diff {
            old,
            new,
            json,
            markdown,
        }) => sandspec::commands::diff(&old, &new, json.as_deref(), markdown.as_deref()),
        Command::Evidence(EvidenceCommand::Merge {
            dirs,
            out,
            sign_key,
        }) => sandspec::commands::merge(&dirs, &out, sign_key.as_deref()),
    }
}
