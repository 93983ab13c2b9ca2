//! A `sandspec serve` child's base URL: the address from the `listening on <url>` line it prints
//! once it accepts connections. The rest of its stdout is drained, so that the server never
//! blocks on a full pipe. Shared by the test binaries that start real server processes.

#![allow(dead_code)]

use std::io::BufRead as _;
use std::time::Duration;

use tokio::io::AsyncBufReadExt as _;

/// How long a server may take to start listening on a loaded machine.
pub const START_WITHIN: Duration = Duration::from_secs(60);

fn base_of(line: &str) -> Option<String> {
    line.strip_prefix("listening on ").map(str::to_owned)
}

/// Waits for a tokio child (spawned with `stdout(Stdio::piped())`) to print its address.
/// Panics when it exits or says nothing within [`START_WITHIN`].
pub async fn base_url(child: &mut tokio::process::Child) -> String {
    let stdout = child.stdout.take().expect("the server's stdout is piped");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let found = tokio::time::timeout(START_WITHIN, async {
        while let Some(line) = lines
            .next_line()
            .await
            .expect("reading the server's stdout")
        {
            if let Some(base) = base_of(&line) {
                return Some(base);
            }
        }
        None
    })
    .await;
    match found {
        Ok(Some(base)) => {
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            base
        }
        Ok(None) => panic!("the server exited before listening"),
        Err(_) => panic!("no `listening on` line within {START_WITHIN:?}"),
    }
}

/// [`base_url`] for a `std::process` child; the child is killed when it fails to start.
pub fn base_url_blocking(child: &mut std::process::Child) -> String {
    let stdout = child.stdout.take().expect("the server's stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = std::io::BufReader::new(stdout).lines();
        for line in lines.by_ref().map_while(Result::ok) {
            if let Some(base) = base_of(&line) {
                let _ = tx.send(base);
                break;
            }
        }
        for _ in lines {}
    });
    rx.recv_timeout(START_WITHIN).unwrap_or_else(|e| {
        let _ = child.kill();
        panic!("sandspec serve printed no `listening on` line: {e}")
    })
}
