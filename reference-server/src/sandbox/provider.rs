//! What every provider answers in: the errors of its operations and the signals it delivers
//! to a process.

/// Why a provider refused or failed an operation.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The request exceeds what the provider can grant; nothing was created.
    #[error("resources unsatisfiable: {0}")]
    Unsatisfiable(String),
    /// The sandbox, snapshot or process is not known to this provider.
    #[error("not found")]
    NotFound,
    /// The process has already ended.
    #[error("process has exited")]
    ProcessExited,
    /// The process was started without `stdin: true`.
    #[error("process has no stdin")]
    NoStdin,
    /// The working directory of a process is not inside the sandbox.
    #[error("invalid path")]
    InvalidPath,
    /// A request field names something the sandbox does not have (a program that cannot be
    /// run, a working directory that does not exist); nothing was started.
    #[error("{detail}")]
    InvalidArgument { param: &'static str, detail: String },
    /// The operating system refused (spawn failed, disk full, ...).
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

/// Signals a client may send to a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Term,
    Kill,
    Int,
}

impl Signal {
    pub fn parse(s: &str) -> Option<Signal> {
        match s {
            "TERM" => Some(Signal::Term),
            "KILL" => Some(Signal::Kill),
            "INT" => Some(Signal::Int),
            _ => None,
        }
    }
}
