//! `sandspec-worker`: the agent runtime the gateway starts inside each session's sandbox.
//! Everything it needs comes from its environment and, for the bridge secret, its stdin
//! (see `gateway::worker::WorkerEnv`).

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    reference_server::gateway::worker::run_from_env().await
}
