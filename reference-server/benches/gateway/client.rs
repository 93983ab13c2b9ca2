//! The client side, the same code for both servers: control requests to the reference
//! server's API, and SSE streams read off plain TCP with the request written by hand.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::servers::ServerProcess;
use crate::{MODEL, TOKEN};

/// Control requests (create, submit, read) to the reference server.
#[derive(Clone)]
pub struct Api {
    client: reqwest::Client,
    base: String,
}

impl Api {
    pub fn new(server: &ServerProcess) -> anyhow::Result<Self> {
        Ok(Self {
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()?,
            base: server.base.clone(),
        })
    }

    async fn send(&self, request: reqwest::RequestBuilder, expect: u16) -> anyhow::Result<Value> {
        let response = request.bearer_auth(TOKEN).send().await?;
        let status = response.status().as_u16();
        let body = response.bytes().await?;
        ensure!(
            status == expect,
            "expected {expect}, got {status}: {}",
            String::from_utf8_lossy(&body)
        );
        Ok(serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    /// A session with its own sandbox, running the fixture model; waits until it is active.
    pub async fn create_session(&self) -> anyhow::Result<String> {
        let body = json!({"agent": {"model": MODEL}, "sandbox": {"create": {}}});
        let session = self
            .send(
                self.client
                    .post(format!("{}/v1/sessions", self.base))
                    .json(&body),
                201,
            )
            .await?;
        let sid = session["id"]
            .as_str()
            .context("session without id")?
            .to_owned();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = self.session(&sid).await?;
            if s["state"] == "active" {
                return Ok(sid);
            }
            ensure!(
                Instant::now() < deadline,
                "session {sid} not active: {}",
                s["state"]
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn session(&self, sid: &str) -> anyhow::Result<Value> {
        self.send(
            self.client.get(format!("{}/v1/sessions/{sid}", self.base)),
            200,
        )
        .await
    }

    pub async fn last_seq(&self, sid: &str) -> anyhow::Result<i64> {
        self.session(sid).await?["last_seq"]
            .as_i64()
            .context("session without last_seq")
    }

    pub async fn submit(&self, sid: &str, key: &str) -> anyhow::Result<()> {
        self.send(
            self.client
                .post(format!("{}/v1/sessions/{sid}/submissions", self.base))
                .header("Idempotency-Key", key)
                .json(&json!({"input": "hello"})),
            202,
        )
        .await
        .map(drop)
    }

    /// Submits `n` turns to `sid` and waits until all of them have completed.
    pub async fn run_turns(
        &self,
        server: &ServerProcess,
        sid: &str,
        n: usize,
    ) -> anyhow::Result<()> {
        let after = self.last_seq(sid).await?;
        let watcher = tokio::spawn(completions(server.addr, sid.to_owned(), after, n));
        for i in 0..n {
            self.submit(sid, &ulid::Ulid::new().to_string())
                .await
                .with_context(|| format!("submission {i}"))?;
        }
        watcher.await??;
        Ok(())
    }
}

// ----- the SSE client -----

/// The request that opens an event stream; the same bytes for both servers but the path.
fn sse_request(addr: SocketAddr, path: &str, last_event_id: Option<i64>) -> Vec<u8> {
    let mut req = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN}\r\n\
         Accept: text/event-stream\r\n"
    );
    if let Some(id) = last_event_id {
        req.push_str(&format!("Last-Event-ID: {id}\r\n"));
    }
    req.push_str("\r\n");
    req.into_bytes()
}

/// An SSE response read off a TCP connection: the head checked, the chunked body decoded,
/// frames split on blank lines.
pub struct SseReader {
    stream: TcpStream,
    /// Bytes read and not yet decoded.
    raw: Vec<u8>,
    /// Decoded body bytes not yet split into frames.
    body: Vec<u8>,
    head_seen: bool,
}

impl SseReader {
    pub async fn open(
        addr: SocketAddr,
        path: &str,
        last_event_id: Option<i64>,
    ) -> anyhow::Result<Self> {
        let mut stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        stream
            .write_all(&sse_request(addr, path, last_event_id))
            .await?;
        Ok(Self::new(stream))
    }

    fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            raw: Vec::with_capacity(4096),
            body: Vec::new(),
            head_seen: false,
        }
    }

    /// Reads once more; an error at the end of the stream.
    pub async fn fill(&mut self) -> anyhow::Result<()> {
        let mut buf = [0u8; 8192];
        let n = self.stream.read(&mut buf).await?;
        ensure!(n > 0, "the stream ended");
        self.raw.extend_from_slice(&buf[..n]);
        Ok(())
    }

    /// The next complete frame already read, if any.
    pub fn frame(&mut self) -> anyhow::Result<Option<String>> {
        if !self.head_seen {
            let Some(end) = find(&self.raw, b"\r\n\r\n") else {
                return Ok(None);
            };
            let head = String::from_utf8_lossy(&self.raw[..end]).into_owned();
            ensure!(
                head.starts_with("HTTP/1.1 200"),
                "the stream did not open: {}",
                head.lines().next().unwrap_or("")
            );
            ensure!(
                head.to_ascii_lowercase()
                    .contains("transfer-encoding: chunked"),
                "the stream is not chunked"
            );
            self.raw.drain(..end + 4);
            self.head_seen = true;
        }
        // Move whole chunks to the body.
        while let Some(line_end) = find(&self.raw, b"\r\n") {
            let size_line = std::str::from_utf8(&self.raw[..line_end])?;
            let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16)
                .with_context(|| format!("bad chunk size line {size_line:?}"))?;
            ensure!(size > 0, "the stream ended");
            let start = line_end + 2;
            if self.raw.len() < start + size + 2 {
                break;
            }
            self.body.extend_from_slice(&self.raw[start..start + size]);
            self.raw.drain(..start + size + 2);
        }
        let Some(end) = find(&self.body, b"\n\n") else {
            return Ok(None);
        };
        let frame = String::from_utf8(self.body[..end].to_vec())?;
        self.body.drain(..end + 2);
        Ok(Some(frame))
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The `data:` object of an event frame; `None` for a comment.
pub fn frame_data(frame: &str) -> anyhow::Result<Option<Value>> {
    match frame.lines().find_map(|l| l.strip_prefix("data: ")) {
        Some(data) => Ok(Some(serde_json::from_str(data)?)),
        None => Ok(None),
    }
}

/// From writing the request on a fresh connection to holding the first whole frame.
pub async fn first_frame(
    addr: SocketAddr,
    path: &str,
    last_event_id: Option<i64>,
) -> anyhow::Result<Duration> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let request = sse_request(addr, path, last_event_id);
    let started = Instant::now();
    stream.write_all(&request).await?;
    let mut reader = SseReader::new(stream);
    loop {
        if reader.frame()?.is_some() {
            return Ok(started.elapsed());
        }
        tokio::time::timeout(Duration::from_secs(10), reader.fill())
            .await
            .context("no first frame within 10 s")??;
    }
}

/// The server's `created_at` of an event's data.
pub fn created_at(data: &Value) -> anyhow::Result<time::OffsetDateTime> {
    let created = data["created_at"]
        .as_str()
        .context("an event without created_at")?;
    Ok(time::OffsetDateTime::parse(
        created,
        &time::format_description::well_known::Rfc3339,
    )?)
}

/// What a session's stream showed of a run of turns: when the last one completed, and the
/// server's `created_at` of each submission's events.
pub struct Completions {
    pub last: Instant,
    /// Per submission, in the order they started: `submission.started` and
    /// `submission.completed`.
    pub turns: Vec<(time::OffsetDateTime, time::OffsetDateTime)>,
}

/// Follows `sid`'s events after `after` until `n` submissions have ended; all must complete.
pub async fn completions(
    addr: SocketAddr,
    sid: String,
    after: i64,
    n: usize,
) -> anyhow::Result<Completions> {
    let mut reader =
        SseReader::open(addr, &format!("/v1/sessions/{sid}/events"), Some(after)).await?;
    let mut started = std::collections::HashMap::new();
    let mut turns = Vec::new();
    loop {
        while let Some(frame) = reader.frame()? {
            let Some(data) = frame_data(&frame)? else {
                continue;
            };
            let kind = data["type"].as_str().unwrap_or("");
            let at = || created_at(&data);
            let id = data["submission_id"].as_str().unwrap_or("").to_owned();
            if kind == "submission.started" {
                started.insert(id, at()?);
            } else if kind == "submission.completed" {
                let start = started
                    .remove(&id)
                    .with_context(|| format!("{id} completed without starting"))?;
                turns.push((start, at()?));
                if turns.len() == n {
                    turns.sort();
                    return Ok(Completions {
                        last: Instant::now(),
                        turns,
                    });
                }
            } else if kind.starts_with("submission.") && kind != "submission.queued" {
                bail!("a submission of {sid} ended otherwise: {data}");
            }
        }
        tokio::time::timeout(Duration::from_secs(120), reader.fill())
            .await
            .with_context(|| {
                format!(
                    "{sid}: {} of {n} submissions completed in 120 s",
                    turns.len()
                )
            })??;
    }
}
