//! `sandspec-worker`: the agent runtime the gateway starts inside each session's sandbox.
//! Everything it needs comes from its environment and, for the bridge secret, its stdin
//! (see `gateway::worker::WorkerEnv`).

fn main() -> std::process::ExitCode {
    reference_server::cli::worker_main()
}
