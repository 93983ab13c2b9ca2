//! envd's `filesystem.Filesystem` service over the sandbox's root (its `/home/user`): Stat,
//! ListDir, MakeDir, Move, Remove, the WatchDir stream and the polling watchers
//! (CreateWatcher, GetWatcherEvents, RemoveWatcher) that the Python SDK's `watch_dir` uses.
//!
//! Watching is inotify's, as upstream's (envd watches with fsnotify): one event per change
//! the kernel reports, so a file created and then written is a `CREATE` and a `WRITE`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::AppState;
use crate::defects::{Defect, Defects};
use crate::sandbox::{DirWatch, FileError, SandboxFiles};

use super::connect::{self, Code, ConnectError};
use super::envd::{EnvdSandbox, METADATA_PREFIX, blocking, to_e2b, to_rel};

/// How often a WatchDir stream looks at its queue without a wake-up.
const WATCH_POLL: Duration = Duration::from_millis(200);
/// How long `GetWatcherEvents` lets the kernel's events of changes made just before it come in.
const WATCH_SETTLE: Duration = Duration::from_millis(50);
/// Most polling watchers alive at once on this server.
const MAX_WATCHERS: usize = 1024;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PathRequest {
    #[serde(default)]
    path: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListDirRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MoveRequest {
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WatchRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default, alias = "include_entry")]
    include_entry: bool,
    #[serde(default, alias = "allow_network_mounts")]
    allow_network_mounts: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WatcherRequest {
    #[serde(default, alias = "watcher_id")]
    watcher_id: String,
}

fn file_type(kind: &str) -> &'static str {
    match kind {
        "dir" => "FILE_TYPE_DIRECTORY",
        "symlink" => "FILE_TYPE_SYMLINK",
        _ => "FILE_TYPE_FILE",
    }
}

/// The permissions string of an entry as envd writes it (Go's `FileMode.String` of the entry
/// itself): the type letter (`d` directory, `L` symlink, `-` file), then `rwx` three times.
fn permissions(kind: &str, mode: u32) -> String {
    let mut out = String::with_capacity(10);
    out.push(match kind {
        "dir" => 'd',
        "symlink" => 'L',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 0o7;
        out.push(if bits & 4 != 0 { 'r' } else { '-' });
        out.push(if bits & 2 != 0 { 'w' } else { '-' });
        out.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    out
}

/// `EntryInfo` of the entry at root-relative `rel`, as envd describes it: the entry's own
/// name, size and permissions string, but for a symlink the type and `mode` (permission bits
/// only, no file-type bits) of what it leads to and its resolved target as an absolute path;
/// the user metadata from its `user.e2b.*` extended attributes.
pub fn entry_info(files: &SandboxFiles, rel: &str, defects: &Defects) -> Result<Value, FileError> {
    let stat = files.stat(rel)?;
    let name = rel.rsplit('/').next().unwrap_or_default();
    let name = if rel.is_empty() { "user" } else { name };
    let (kind, mode, target) = if stat.kind == "symlink" {
        match files.resolve(rel) {
            Ok((resolved, to)) => (to.kind, to.mode & 0o777, Some(to_e2b(&resolved))),
            // A dangling link: its type is unknown upstream; here it stays a symlink.
            Err(_) => ("symlink", 0, Some(to_e2b(rel))),
        }
    } else {
        (stat.kind, stat.mode & 0o777, None)
    };
    // The defect: the file-type bits of st_mode stay in `mode`.
    let mode = if defects.has(Defect::E2bModeWithTypeBits) {
        mode | (stat.mode & 0o170000)
    } else {
        mode
    };
    let mut out = json!({
        "name": name,
        "type": file_type(kind),
        "path": to_e2b(rel),
        // int64 is a string in protobuf's JSON mapping.
        "size": stat.size.to_string(),
        "mode": mode,
        "permissions": permissions(stat.kind, stat.mode),
        "owner": "user",
        "group": "user",
    });
    if let Some(t) = stat.modified {
        let t = time::OffsetDateTime::from(t);
        if let Ok(text) = t.format(&time::format_description::well_known::Rfc3339) {
            out["modifiedTime"] = json!(text);
        }
    }
    if let Some(target) = target {
        out["symlinkTarget"] = json!(target);
    }
    let metadata = if kind == "symlink" {
        Default::default()
    } else {
        files.attributes(rel, METADATA_PREFIX).unwrap_or_default()
    };
    if !metadata.is_empty() {
        out["metadata"] = json!(metadata);
    }
    Ok(out)
}

fn unary(result: Result<Value, ConnectError>) -> Response {
    match result {
        Ok(message) => connect::unary_response(&message),
        Err(e) => e.into_response(),
    }
}

/// One unary call: resolve the sandbox, decode the request, run `f` on its files off the
/// async workers.
async fn call<R, F>(sbx: EnvdSandbox, headers: &HeaderMap, body: &Bytes, f: F) -> Response
where
    R: serde::de::DeserializeOwned + Send + 'static,
    F: FnOnce(&SandboxFiles, &Defects, R) -> Result<Value, ConnectError> + Send + 'static,
{
    let result = async {
        let req: R = connect::unary_request(headers, body)?;
        let files = sbx.files()?;
        let defects = sbx.defects.clone();
        blocking(move || f(&files, &defects, req)).await
    };
    unary(result.await)
}

fn not_found_as(e: FileError, what: &str) -> ConnectError {
    match e {
        FileError::NotFound => ConnectError::not_found(format!("{what} not found")),
        other => other.into(),
    }
}

pub async fn stat(sbx: EnvdSandbox, headers: HeaderMap, body: Bytes) -> Response {
    call(sbx, &headers, &body, |files, defects, req: PathRequest| {
        let rel = to_rel(&req.path)?;
        let rel = normalized(&rel);
        let entry = entry_info(files, &rel, defects).map_err(|e| not_found_as(e, "path"))?;
        Ok(json!({ "entry": entry }))
    })
    .await
}

/// `rel` without `.` and empty segments (the files module refuses what leaves the root).
fn normalized(rel: &str) -> String {
    rel.split('/')
        .filter(|s| !s.is_empty() && *s != ".")
        .collect::<Vec<_>>()
        .join("/")
}

/// `a/b` from `a` and `b`, either of which may be empty.
fn join(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_owned(),
        (_, true) => a.to_owned(),
        _ => format!("{a}/{b}"),
    }
}

/// The entries below `dir/sub`, depth first in name order as envd's `filepath.WalkDir`, down
/// to `depth` levels below `dir`; each named by its path below `requested` (the path the
/// client gave, which may be a symlink to `dir`).
fn walk(
    files: &SandboxFiles,
    defects: &Defects,
    dir: &str,
    requested: &str,
    sub: &str,
    depth: usize,
    out: &mut Vec<Value>,
) -> Result<(), ConnectError> {
    let level = if sub.is_empty() {
        1
    } else {
        sub.split('/').count() + 1
    };
    let entries = match files.list(&join(dir, sub)) {
        Ok(entries) => entries,
        // Gone while listing.
        Err(FileError::NotFound) if !sub.is_empty() => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    for entry in entries {
        let child = join(sub, &entry.name);
        let Ok(mut info) = entry_info(files, &join(dir, &child), defects) else {
            continue;
        };
        info["path"] = json!(to_e2b(&join(requested, &child)));
        out.push(info);
        if entry.kind == "dir" && level < depth {
            walk(files, defects, dir, requested, &child, depth, out)?;
        }
    }
    Ok(())
}

pub async fn list_dir(sbx: EnvdSandbox, headers: HeaderMap, body: Bytes) -> Response {
    call(
        sbx,
        &headers,
        &body,
        |files, defects, req: ListDirRequest| {
            let rel = normalized(&to_rel(&req.path)?);
            let depth = req.depth.max(1) as usize;
            let dir = match files
                .resolve(&rel)
                .map_err(|e| not_found_as(e, "directory"))?
            {
                (dir, s) if s.kind == "dir" => dir,
                _ => return Err(ConnectError::invalid("path is not a directory")),
            };
            let mut entries = Vec::new();
            walk(files, defects, &dir, &rel, "", depth, &mut entries)?;
            Ok(json!({ "entries": entries }))
        },
    )
    .await
}

pub async fn make_dir(sbx: EnvdSandbox, headers: HeaderMap, body: Bytes) -> Response {
    call(sbx, &headers, &body, |files, defects, req: PathRequest| {
        let rel = normalized(&to_rel(&req.path)?);
        let created = match files.make_dir(&rel) {
            Ok(created) => !rel.is_empty() && created,
            Err(FileError::WrongKind) => {
                return Err(ConnectError::invalid(
                    "the path already exists but is not a directory",
                ));
            }
            Err(e) => return Err(e.into()),
        };
        if !created {
            return Err(ConnectError::new(
                Code::AlreadyExists,
                "the directory already exists",
            ));
        }
        Ok(json!({ "entry": entry_info(files, &rel, defects)? }))
    })
    .await
}

pub async fn move_entry(sbx: EnvdSandbox, headers: HeaderMap, body: Bytes) -> Response {
    call(sbx, &headers, &body, |files, defects, req: MoveRequest| {
        let from = normalized(&to_rel(&req.source)?);
        let to = normalized(&to_rel(&req.destination)?);
        files
            .rename(&from, &to)
            .map_err(|e| not_found_as(e, "source"))?;
        Ok(json!({ "entry": entry_info(files, &to, defects)? }))
    })
    .await
}

pub async fn remove(sbx: EnvdSandbox, headers: HeaderMap, body: Bytes) -> Response {
    call(sbx, &headers, &body, |files, defects, req: PathRequest| {
        let rel = to_rel(&req.path)?;
        // envd removes with os.RemoveAll: a path that is not there is already removed.
        match files.delete(&rel) {
            Err(FileError::NotFound) if defects.has(Defect::E2bRemoveMissingNotFound) => {
                Err(ConnectError::not_found("path not found"))
            }
            Ok(()) | Err(FileError::NotFound) => Ok(json!({})),
            Err(e) => Err(e.into()),
        }
    })
    .await
}

/// envd's `EventType` of a watch event's kind.
fn event_type(kind: &str) -> &'static str {
    match kind {
        "create" => "EVENT_TYPE_CREATE",
        "write" => "EVENT_TYPE_WRITE",
        "remove" => "EVENT_TYPE_REMOVE",
        "rename" => "EVENT_TYPE_RENAME",
        _ => "EVENT_TYPE_CHMOD",
    }
}

/// The `FilesystemEvent`s of what a watch saw since its last look: named relative to the
/// watched directory `dir`, with the entry (when asked for) of those that leave one behind
/// (create, write, chmod). The defect `e2b-watch-misses-writes` drops the writes.
fn look(
    watch: &mut DirWatch,
    files: &SandboxFiles,
    defects: &Defects,
    dir: &str,
    include_entry: bool,
) -> Result<Vec<Value>, ConnectError> {
    let skip_writes = defects.has(Defect::E2bWatchMissesWrites);
    Ok(watch
        .events()
        .map_err(|e| ConnectError::from(FileError::Io(e)))?
        .into_iter()
        .filter(|e| !(skip_writes && e.kind == "write"))
        .map(|e| {
            let mut event = json!({"name": e.name, "type": event_type(e.kind)});
            if include_entry
                && matches!(e.kind, "create" | "write" | "chmod")
                && let Ok(entry) = entry_info(files, &join(dir, &e.name), defects)
            {
                event["entry"] = entry;
            }
            event
        })
        .collect())
}

/// Most events a watch holds for its reader; past them the oldest are dropped, as a kernel
/// queue overflows.
const MAX_QUEUED: usize = 10_000;

/// Runs a watch: its events are read as soon as the kernel has them (so that a directory
/// made below a recursive watch is watched before anything is made in it), turned into
/// `FilesystemEvent`s and queued for the reader until it goes away.
fn run_watch(
    watch: DirWatch,
    files: SandboxFiles,
    defects: Defects,
    dir: String,
    include_entry: bool,
) -> Result<(Queue, tokio::task::AbortHandle), ConnectError> {
    // SAFETY: the watch owns its inotify descriptor, never replaces it, and closes it only when
    // dropped, which the `AsyncFd` that owns the watch does last.
    let mut readable = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(watch, tokio::io::Interest::READABLE)
    }
    .map_err(|e| ConnectError::from(FileError::Io(e.into_parts().1)))?;
    let queue: Queue = std::sync::Arc::new((Mutex::new(Vec::new()), tokio::sync::Notify::new()));
    let filled = queue.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok(mut guard) = readable.readable_mut().await else {
                return;
            };
            let looked = look(guard.get_inner_mut(), &files, &defects, &dir, include_entry);
            guard.clear_ready();
            let events = match looked {
                Ok(events) => events,
                Err(e) => {
                    tracing::warn!(error = %e.message, "a directory watch failed");
                    return;
                }
            };
            if events.is_empty() {
                continue;
            }
            {
                let mut queued = filled.0.lock().unwrap_or_else(|e| e.into_inner());
                queued.extend(events);
                let over = queued.len().saturating_sub(MAX_QUEUED);
                queued.drain(..over);
            }
            filled.1.notify_one();
        }
    });
    Ok((queue, task.abort_handle()))
}

/// A watch's events waiting for their reader, and the wake-up of a reader that waits.
type Queue = std::sync::Arc<(Mutex<Vec<Value>>, tokio::sync::Notify)>;

fn drain(queue: &Queue) -> Vec<Value> {
    std::mem::take(&mut *queue.0.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The directory a watch request names, checked to exist and be a directory.
fn watched_dir(files: &SandboxFiles, path: &str) -> Result<String, ConnectError> {
    let rel = normalized(&to_rel(path)?);
    match files.stat(&rel).map_err(|e| not_found_as(e, "directory"))? {
        s if s.kind == "dir" => Ok(rel),
        _ => Err(ConnectError::invalid("path is not a directory")),
    }
}

/// A watch of the directory a request names: (its root-relative path, the watch).
fn start_watch(
    files: &SandboxFiles,
    path: &str,
    recursive: bool,
) -> Result<(String, DirWatch), ConnectError> {
    let dir = watched_dir(files, path)?;
    let watch = files
        .watch(&dir, recursive)
        .map_err(|e| not_found_as(e, "directory"))?;
    Ok((dir, watch))
}

/// `WatchDir`: `start`, then a `filesystem` event per change until the client goes away.
pub async fn watch_dir(
    State(state): State<AppState>,
    sbx: EnvdSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let setup = async {
        let req: WatchRequest = connect::stream_request(&headers, &body)?;
        // There are no network mounts in a sandbox here: the flag changes nothing.
        let _ = req.allow_network_mounts;
        let files = sbx.files()?;
        let (path, recursive) = (req.path.clone(), req.recursive);
        let (files, dir, watch) = blocking(move || {
            let (dir, watch) = start_watch(&files, &path, recursive)?;
            Ok::<_, ConnectError>((files, dir, watch))
        })
        .await?;
        Ok::<_, ConnectError>((req, files, dir, watch))
    };
    let (req, files, dir, watch) = match setup.await {
        Ok(ready) => ready,
        Err(e) => return connect::stream_error(e),
    };
    let (queue, task) = match run_watch(watch, files, sbx.defects.clone(), dir, req.include_entry) {
        Ok(running) => running,
        Err(e) => return connect::stream_error(e),
    };
    let (response, sender) = connect::stream_response();
    let keepalive = connect::keepalive_interval(&headers);
    tokio::spawn(async move {
        // The watch ends with its stream.
        let _watch = AbortOnDrop(task);
        if !sender.send(&json!({"start": {}})).await {
            return;
        }
        let mut ping = keepalive.map(|d| {
            let mut t = tokio::time::interval_at(tokio::time::Instant::now() + d, d);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        loop {
            let tick = async {
                match ping.as_mut() {
                    Some(t) => {
                        t.tick().await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = queue.1.notified() => {}
                // A wake-up given before this reader waited is not lost: look anyway.
                () = tokio::time::sleep(WATCH_POLL) => {}
                () = tick => {
                    if !sender.send(&json!({"keepalive": {}})).await {
                        return;
                    }
                }
                () = sender.closed() => return,
                () = state.shutdown.cancelled() => {
                    sender.finish(Some(ConnectError::new(Code::Unavailable, "the server is shutting down"))).await;
                    return;
                }
            }
            for event in drain(&queue) {
                if !sender.send(&json!({ "filesystem": event })).await {
                    return;
                }
            }
        }
    });
    response
}

/// Ends a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A polling watcher: its sandbox and its running watch's queue (the watch ends with it).
struct Watcher {
    sandbox: String,
    queue: Queue,
    _task: AbortOnDrop,
}

/// The polling watchers of this server, by ID. They live in memory, as upstream's live in
/// envd's: a restart forgets them.
static WATCHERS: Mutex<Option<HashMap<String, Watcher>>> = Mutex::new(None);

fn watchers() -> std::sync::MutexGuard<'static, Option<HashMap<String, Watcher>>> {
    WATCHERS.lock().unwrap_or_else(|e| e.into_inner())
}

pub async fn create_watcher(sbx: EnvdSandbox, headers: HeaderMap, body: Bytes) -> Response {
    let sandbox = sbx.rec.id.clone();
    let result = async {
        let req: WatchRequest = connect::unary_request(&headers, &body)?;
        let files = sbx.files()?;
        let (path, recursive) = (req.path.clone(), req.recursive);
        let (dir, watch, files) = blocking(move || {
            let (dir, watch) = start_watch(&files, &path, recursive)?;
            Ok::<_, ConnectError>((dir, watch, files))
        })
        .await?;
        let (queue, task) = run_watch(watch, files, sbx.defects.clone(), dir, req.include_entry)?;
        let id = format!("w_{}", ulid::Ulid::new().to_string().to_lowercase());
        let mut all = watchers();
        let all = all.get_or_insert_with(HashMap::new);
        if all.len() >= MAX_WATCHERS {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                "too many watchers; remove some first",
            ));
        }
        all.insert(
            id.clone(),
            Watcher {
                sandbox,
                queue,
                _task: AbortOnDrop(task),
            },
        );
        Ok(json!({ "watcherId": id }))
    };
    unary(result.await)
}

pub async fn get_watcher_events(sbx: EnvdSandbox, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        let req: WatcherRequest = connect::unary_request(&headers, &body)?;
        let queue = {
            let all = watchers();
            let w = all
                .as_ref()
                .and_then(|all| all.get(&req.watcher_id))
                .filter(|w| w.sandbox == sbx.rec.id)
                .ok_or_else(|| ConnectError::not_found("watcher not found"))?;
            w.queue.clone()
        };
        // Changes made just before this call may still be on their way from the kernel.
        tokio::time::sleep(WATCH_SETTLE).await;
        let events = drain(&queue);
        Ok(json!({ "events": events }))
    };
    unary(result.await)
}

pub async fn remove_watcher(sbx: EnvdSandbox, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        let req: WatcherRequest = connect::unary_request(&headers, &body)?;
        let mut all = watchers();
        let all = all.get_or_insert_with(HashMap::new);
        match all.get(&req.watcher_id) {
            Some(w) if w.sandbox == sbx.rec.id => {
                all.remove(&req.watcher_id);
                Ok(json!({}))
            }
            _ => Err(ConnectError::not_found("watcher not found")),
        }
    };
    unary(result.await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions("file", 0o100644), "-rw-r--r--");
        assert_eq!(permissions("dir", 0o040755), "drwxr-xr-x");
        assert_eq!(permissions("symlink", 0o120777), "Lrwxrwxrwx");
    }
}
