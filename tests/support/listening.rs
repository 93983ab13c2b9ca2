//! A server a test runs in a task of its own: its base URL, and the task, which ends when the
//! handle is dropped.

/// A running server; it stops when dropped.
pub struct Listening {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Listening {
    /// The handle of the server at `url` that `task` runs.
    pub fn new(url: String, task: tokio::task::JoinHandle<()>) -> Listening {
        Listening { url, task }
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.task.abort();
    }
}
