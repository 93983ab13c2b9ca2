//! The tokio runtime of the test binaries whose trials are plain functions (no
//! `#[tokio::test]`): two workers, shared by every trial.

use std::sync::LazyLock;

pub static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
});
