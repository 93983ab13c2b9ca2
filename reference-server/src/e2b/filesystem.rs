//! envd's `filesystem.Filesystem` service over the sandbox's root (its `/home/user`): Stat,
//! ListDir, MakeDir, Move, Remove, the WatchDir stream and the polling watchers
//! (CreateWatcher, GetWatcherEvents, RemoveWatcher) that the Python SDK's `watch_dir` uses.
//!
//! Watching compares snapshots of the directory (each entry's kind, size and modification
//! time): an entry that appears is `CREATE`, one that goes is `REMOVE`, a file whose size or
//! time changed is `WRITE`. Changes between two looks are coalesced (a file created and then
//! written is one `CREATE`), where upstream's inotify reports each.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::AppState;
use crate::defects::{Defect, Defects};
use crate::sandbox::{FileError, SandboxFiles};

use super::connect::{self, Code, ConnectError};
use super::envd::{EnvdSandbox, blocking, to_e2b, to_rel};

/// How often a WatchDir stream looks at its directory.
const WATCH_POLL: Duration = Duration::from_millis(200);
/// Most entries one snapshot walks, so a watch on a huge tree stays bounded.
const MAX_WATCHED: usize = 10_000;
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

/// The extended-attribute namespace of an entry's user metadata (envd 0.6.2 and later).
pub const METADATA_PREFIX: &str = "user.e2b.";

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

/// What a watch remembers of each entry below its directory.
type Snapshot = BTreeMap<String, (&'static str, u64, Option<SystemTime>)>;

/// Walks `dir` (root-relative), one level or the whole tree, keyed by the path relative to
/// `dir`.
fn snapshot(files: &SandboxFiles, dir: &str, recursive: bool) -> Result<Snapshot, FileError> {
    let mut out = Snapshot::new();
    let mut pending = vec![String::new()];
    while let Some(sub) = pending.pop() {
        let full = match (dir.is_empty(), sub.is_empty()) {
            (_, true) => dir.to_owned(),
            (true, false) => sub.clone(),
            (false, false) => format!("{dir}/{sub}"),
        };
        let entries = match files.list(&full) {
            Ok(entries) => entries,
            // A subdirectory removed while walking: its REMOVE shows on the next look.
            Err(FileError::NotFound) if !sub.is_empty() => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let name = if sub.is_empty() {
                entry.name.clone()
            } else {
                format!("{sub}/{}", entry.name)
            };
            let path = if dir.is_empty() {
                name.clone()
            } else {
                format!("{dir}/{name}")
            };
            let modified = files.stat(&path).ok().and_then(|s| s.modified);
            if recursive && entry.kind == "dir" {
                pending.push(name.clone());
            }
            out.insert(name, (entry.kind, entry.size, modified));
            if out.len() >= MAX_WATCHED {
                return Ok(out);
            }
        }
    }
    Ok(out)
}

/// The events that turn `old` into `new`: (name relative to the watched directory, type).
/// `skip_writes` is the deliberate defect `e2b-watch-misses-writes`.
fn diff(old: &Snapshot, new: &Snapshot, skip_writes: bool) -> Vec<(String, &'static str)> {
    let mut out = Vec::new();
    for (name, now) in new {
        match old.get(name) {
            None => out.push((name.clone(), "EVENT_TYPE_CREATE")),
            Some(before) if before.0 != now.0 => {
                out.push((name.clone(), "EVENT_TYPE_REMOVE"));
                out.push((name.clone(), "EVENT_TYPE_CREATE"));
            }
            Some(before) if now.0 == "file" && before != now && !skip_writes => {
                out.push((name.clone(), "EVENT_TYPE_WRITE"))
            }
            Some(_) => {}
        }
    }
    for name in old.keys() {
        if !new.contains_key(name) {
            out.push((name.clone(), "EVENT_TYPE_REMOVE"));
        }
    }
    out
}

fn event_json(
    files: &SandboxFiles,
    defects: &Defects,
    dir: &str,
    name: &str,
    kind: &str,
    include_entry: bool,
) -> Value {
    let mut event = json!({"name": name, "type": kind});
    if include_entry && kind != "EVENT_TYPE_REMOVE" {
        let rel = if dir.is_empty() {
            name.to_owned()
        } else {
            format!("{dir}/{name}")
        };
        if let Ok(entry) = entry_info(files, &rel, defects) {
            event["entry"] = entry;
        }
    }
    event
}

/// The directory a watch request names, checked to exist and be a directory.
fn watched_dir(files: &SandboxFiles, path: &str) -> Result<String, ConnectError> {
    let rel = normalized(&to_rel(path)?);
    match files.stat(&rel).map_err(|e| not_found_as(e, "directory"))? {
        s if s.kind == "dir" => Ok(rel),
        _ => Err(ConnectError::invalid("path is not a directory")),
    }
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
        let _ = req.allow_network_mounts;
        let files = sbx.files()?;
        let path = req.path.clone();
        let recursive = req.recursive;
        let (files, dir, snap) = blocking(move || {
            let dir = watched_dir(&files, &path)?;
            let snap = snapshot(&files, &dir, recursive)?;
            Ok::<_, ConnectError>((files, dir, snap))
        })
        .await?;
        Ok::<_, ConnectError>((req, files, dir, snap))
    };
    let (req, files, dir, mut snap) = match setup.await {
        Ok(ready) => ready,
        Err(e) => return connect::stream_error(e),
    };
    let (response, sender) = connect::stream_response();
    let keepalive = connect::keepalive_interval(&headers);
    let files = std::sync::Arc::new(files);
    tokio::spawn(async move {
        if !sender.send(&json!({"start": {}})).await {
            return;
        }
        let mut last_ping = tokio::time::Instant::now();
        loop {
            tokio::select! {
                () = tokio::time::sleep(WATCH_POLL) => {}
                () = sender.closed() => return,
                () = state.shutdown.cancelled() => {
                    sender.finish(Some(ConnectError::new(Code::Unavailable, "the server is shutting down"))).await;
                    return;
                }
            }
            let looked = {
                let (files, dir, old) = (std::sync::Arc::clone(&files), dir.clone(), snap.clone());
                let (recursive, include) = (req.recursive, req.include_entry);
                let skip_writes = state.config.defects.has(Defect::E2bWatchMissesWrites);
                let defects = state.config.defects.clone();
                blocking(move || {
                    let new = snapshot(&files, &dir, recursive)?;
                    let events: Vec<Value> = diff(&old, &new, skip_writes)
                        .into_iter()
                        .map(|(name, kind)| {
                            event_json(&files, &defects, &dir, &name, kind, include)
                        })
                        .collect();
                    Ok::<_, ConnectError>((new, events))
                })
                .await
            };
            match looked {
                Ok((new, events)) => {
                    snap = new;
                    for event in events {
                        if !sender.send(&json!({ "filesystem": event })).await {
                            return;
                        }
                    }
                }
                Err(e) => {
                    sender.finish(Some(e)).await;
                    return;
                }
            }
            if let Some(every) = keepalive
                && last_ping.elapsed() >= every
            {
                last_ping = tokio::time::Instant::now();
                if !sender.send(&json!({"keepalive": {}})).await {
                    return;
                }
            }
        }
    });
    response
}

/// A polling watcher: its sandbox, directory and the snapshot of its last look.
struct Watcher {
    sandbox: String,
    dir: String,
    recursive: bool,
    include_entry: bool,
    snapshot: Snapshot,
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
        let (dir, snap) = blocking(move || {
            let dir = watched_dir(&files, &req.path)?;
            let snap = snapshot(&files, &dir, req.recursive)?;
            Ok::<_, ConnectError>((dir, snap))
        })
        .await?;
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
                dir,
                recursive: req.recursive,
                include_entry: req.include_entry,
                snapshot: snap,
            },
        );
        Ok(json!({ "watcherId": id }))
    };
    unary(result.await)
}

pub async fn get_watcher_events(sbx: EnvdSandbox, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        let req: WatcherRequest = connect::unary_request(&headers, &body)?;
        let (dir, recursive, include, old) = {
            let all = watchers();
            let w = all
                .as_ref()
                .and_then(|all| all.get(&req.watcher_id))
                .filter(|w| w.sandbox == sbx.rec.id)
                .ok_or_else(|| ConnectError::not_found("watcher not found"))?;
            (
                w.dir.clone(),
                w.recursive,
                w.include_entry,
                w.snapshot.clone(),
            )
        };
        let files = sbx.files()?;
        let skip_writes = sbx.defects.has(Defect::E2bWatchMissesWrites);
        let defects = sbx.defects.clone();
        let (new, events) = blocking(move || {
            let new = snapshot(&files, &dir, recursive)?;
            let events: Vec<Value> = diff(&old, &new, skip_writes)
                .into_iter()
                .map(|(name, kind)| event_json(&files, &defects, &dir, &name, kind, include))
                .collect();
            Ok::<_, ConnectError>((new, events))
        })
        .await?;
        if let Some(w) = watchers()
            .as_mut()
            .and_then(|all| all.get_mut(&req.watcher_id))
        {
            w.snapshot = new;
        }
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
    fn snapshots_diff_into_create_write_and_remove() {
        let t = Some(SystemTime::UNIX_EPOCH);
        let later = Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1));
        let old: Snapshot = [
            ("kept".to_owned(), ("file", 1, t)),
            ("written".to_owned(), ("file", 1, t)),
            ("gone".to_owned(), ("file", 1, t)),
        ]
        .into();
        let new: Snapshot = [
            ("kept".to_owned(), ("file", 1, t)),
            ("written".to_owned(), ("file", 1, later)),
            ("new".to_owned(), ("dir", 0, t)),
        ]
        .into();
        assert_eq!(
            diff(&old, &new, false),
            vec![
                ("new".to_owned(), "EVENT_TYPE_CREATE"),
                ("written".to_owned(), "EVENT_TYPE_WRITE"),
                ("gone".to_owned(), "EVENT_TYPE_REMOVE"),
            ]
        );
    }

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions("file", 0o100644), "-rw-r--r--");
        assert_eq!(permissions("dir", 0o040755), "drwxr-xr-x");
        assert_eq!(permissions("symlink", 0o120777), "Lrwxrwxrwx");
    }
}
