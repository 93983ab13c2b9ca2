//! A hostile target for tests: a loopback HTTP/1.1 server, on threads of its own, that
//! answers each request as the test says, among them answers that never end (a body, an SSE
//! line, a Connect message that goes on for ever); and `sandspec run` as a child process
//! whose peak memory (its `VmHWM`, read from `/proc` until it exits) and wall time are
//! measured. Not `ru_maxrss`: a child spawned from the test process starts with that
//! process's high-water mark, whatever it uses itself.

#![allow(dead_code)]

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the server answers one request.
pub enum Answer {
    /// A whole response: status, content type, body.
    Whole(u16, &'static str, String),
    /// These bytes, as they are: a status line, headers and a body of the test's making.
    Raw(Vec<u8>),
    /// A `200` with this content type whose body is `first`, then `again` for ever (until the
    /// client closes the connection): the body has no length and never ends.
    Endless {
        content_type: &'static str,
        first: Vec<u8>,
        again: Vec<u8>,
    },
    /// A `200` with this content type whose body is `first`, then `again` every `every`, for
    /// ever (until the client closes the connection): an answer that goes on at its own pace,
    /// as a long execution's output does.
    Trickle {
        content_type: &'static str,
        first: Vec<u8>,
        again: Vec<u8>,
        every: Duration,
    },
}

/// Picks the answer to a request by its method and path (query included).
pub type Route = dyn Fn(&str, &str) -> Answer + Send + Sync;

/// Picks the answer to a request by its method, its path and its whole head (request line
/// and headers, as received).
pub type HeadRoute = dyn Fn(&str, &str, &str) -> Answer + Send + Sync;

/// Starts the server on a free loopback port; returns its base URL. It runs until the test
/// process ends.
pub fn serve(route: Box<Route>) -> String {
    serve_with_head(Box::new(move |method, path, _| route(method, path)))
}

/// [`serve`], with routes that read the request's headers too.
pub fn serve_with_head(route: Box<HeadRoute>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let route: Arc<HeadRoute> = Arc::from(route);
    std::thread::spawn(move || {
        for socket in listener.incoming() {
            let Ok(socket) = socket else { continue };
            let route = route.clone();
            std::thread::spawn(move || answer(socket, &*route));
        }
    });
    url
}

fn answer(mut socket: TcpStream, route: &HeadRoute) {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match socket.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&head);
    let mut first = text.lines().next().unwrap_or_default().split(' ');
    let (method, path) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
    match route(method, path, &text) {
        Answer::Whole(status, content_type, body) => {
            let response = format!(
                "HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = socket.write_all(response.as_bytes());
        }
        Answer::Raw(bytes) => {
            let _ = socket.write_all(&bytes);
        }
        Answer::Endless {
            content_type,
            first,
            again,
        } => {
            if !begin_endless(&mut socket, content_type, &first) {
                return;
            }
            // Until the client closes: a write then fails.
            while socket.write_all(&again).is_ok() {}
        }
        Answer::Trickle {
            content_type,
            first,
            again,
            every,
        } => {
            if !begin_endless(&mut socket, content_type, &first) {
                return;
            }
            loop {
                std::thread::sleep(every);
                if socket.write_all(&again).is_err() {
                    return;
                }
            }
        }
    }
}

/// Writes the head of a `200` whose body has no length and `first` of its body; `false` when
/// the client has gone.
fn begin_endless(socket: &mut TcpStream, content_type: &str, first: &[u8]) -> bool {
    let head =
        format!("HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nConnection: close\r\n\r\n");
    socket.write_all(head.as_bytes()).is_ok() && socket.write_all(first).is_ok()
}

/// JSON answers, for the routes that behave.
pub fn json(status: u16, body: serde_json::Value) -> Answer {
    Answer::Whole(status, "application/json", body.to_string())
}

/// What a child run of `sandspec` did.
#[derive(Debug)]
pub struct Measured {
    /// Its exit code (`None` when a signal ended it).
    pub code: Option<i32>,
    /// Its peak resident set, in KiB (the last `VmHWM` read before it exited).
    pub peak_kib: u64,
    pub took: Duration,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the `sandspec` binary with `args` and the variables `env`, waits for it (killing it
/// after `within`), and measures its peak memory and wall time.
pub fn run_measured(args: &[String], env: &[(&str, &str)], within: Duration) -> Measured {
    let dir = tempfile::tempdir().unwrap();
    let out = std::fs::File::create(dir.path().join("stdout")).unwrap();
    let err = std::fs::File::create(dir.path().join("stderr")).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_sandspec"));
    command
        .args(args)
        .env_remove("CI")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    for (k, v) in env {
        command.env(k, v);
    }
    let started = Instant::now();
    #[expect(
        clippy::zombie_processes,
        reason = "reaped by waitpid below, while it is measured"
    )]
    let child = command.spawn().expect("sandspec starts");
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    let (status, peak_kib) = wait_measured(pid, started + within);
    let read = |name: &str| std::fs::read_to_string(dir.path().join(name)).unwrap_or_default();
    Measured {
        code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
        peak_kib,
        took: started.elapsed(),
        stdout: read("stdout"),
        stderr: read("stderr"),
    }
}

/// Waits for child `pid`, reading its `VmHWM` every few milliseconds until it exits (a
/// high-water mark: any reading after the peak shows it, and a run goes on for a while after
/// a step failed); SIGKILL at `deadline`. Its wait status and the highest `VmHWM` read, KiB.
fn wait_measured(pid: libc::pid_t, deadline: Instant) -> (libc::c_int, u64) {
    let status_file = format!("/proc/{pid}/status");
    let mut peak = 0u64;
    let mut killed = false;
    loop {
        if let Ok(text) = std::fs::read_to_string(&status_file)
            && let Some(kib) = text
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        {
            peak = peak.max(kib);
        }
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid on our own child, with a pointer to a local that outlives the call.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            assert!(!killed, "sandspec did not end in time and was killed");
            return (status, peak);
        }
        assert!(r == 0, "waitpid: {}", std::io::Error::last_os_error());
        if Instant::now() > deadline && !killed {
            // SAFETY: kill(2) on our own child, not reaped yet.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Writes a one-file catalog: `file` (relative, e.g. `bounds/body.yaml`) under `dir`.
pub fn catalog(dir: &Path, file: &str, yaml: &str) -> std::path::PathBuf {
    let path = dir.join("catalog").join(file);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, yaml).unwrap();
    dir.join("catalog")
}
