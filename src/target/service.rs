//! A service the runner launched itself (`--launch`), as the target drives it: killed and
//! started again by fault steps, restarted by `restart` steps, stopped when dropped.

use futures_util::future::BoxFuture;

/// A launched service under test.
pub trait Service: Send {
    /// SIGKILL to the service, as a crash: nothing of its shutdown runs.
    fn kill(&mut self) -> BoxFuture<'_, Result<(), String>>;

    /// Starts it again after a kill, on the same address, principals and directories, once
    /// healthy; `Ok(false)` when it is running (nothing to start).
    fn start_again(&mut self) -> BoxFuture<'_, Result<bool, String>>;

    /// Stops it and starts it again on the same address, principals and directories; answers
    /// once it is healthy.
    fn restart(&mut self) -> BoxFuture<'_, Result<(), String>>;
}
