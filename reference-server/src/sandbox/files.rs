//! Files inside a sandbox, confined to its root with capability-based I/O (cap-std): `..`
//! that leaves the root, absolute paths and symlinks pointing out are refused by the OS-level
//! resolution, not by string checks alone.

use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use cap_std::ambient_authority;
use cap_std::fs::Dir;
use sha2::{Digest as _, Sha256};

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FileEntry {
    pub name: String,
    /// `file`, `dir` or `symlink`.
    pub kind: &'static str,
    pub size: u64,
}

/// One entry's metadata, for stat-like answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryStat {
    /// `file`, `dir` or `symlink`.
    pub kind: &'static str,
    pub size: u64,
    /// The st_mode bits (type and permissions).
    pub mode: u32,
    pub modified: Option<std::time::SystemTime>,
    /// Where a symlink points, as stored in it.
    pub symlink_target: Option<String>,
}

/// The result of a write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteOutcome {
    /// The path as the client gave it, normalized (`a/./b` is `a/b`).
    pub path: String,
    pub size: u64,
    pub sha256: String,
    /// True when the file did not exist before (201), false when replaced (200).
    pub created: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The path leaves the root, is absolute outside it, or crosses a symlink pointing out.
    #[error("invalid path")]
    InvalidPath,
    #[error("path not found")]
    NotFound,
    /// A directory where a file was expected or the reverse.
    #[error("wrong kind of entry")]
    WrongKind,
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// The files of one sandbox.
pub struct SandboxFiles {
    access: Access,
    /// The root on disk, and whether reads resolve through it with plain path joins (the
    /// `read-follows-symlinks` defect: one operation that follows symlinks out).
    root: PathBuf,
    read_joined: bool,
    /// The sandbox's own host uid (its root's owner) when it has one: what the files API
    /// creates is given to it, so that the sandbox's processes can change it.
    owner: Option<u32>,
}

/// How paths are resolved below the root.
enum Access {
    /// The honest way: every lookup goes through a directory capability, so the kernel
    /// (openat2 `RESOLVE_BENEATH`, or cap-std's own walk) refuses anything that leaves it.
    Confined(Dir),
    /// Defect `symlink-escape`: plain path joins with a string check for `..` only, so a
    /// symlink inside the root that points out of it is followed.
    Joined(PathBuf),
}

impl SandboxFiles {
    /// Opens the files of the sandbox whose root is `root`. With `follow_symlinks_out`
    /// (defect `symlink-escape`) symlinks are followed wherever they point.
    pub(super) fn open(root: &Path, follow_symlinks_out: bool) -> io::Result<Self> {
        use std::os::unix::fs::MetadataExt as _;
        let owner = std::fs::metadata(root)
            .ok()
            .map(|m| m.uid())
            .filter(|uid| super::isolation::is_sandbox_uid(*uid));
        let access = if follow_symlinks_out {
            if !root.is_dir() {
                return Err(io::Error::from(io::ErrorKind::NotFound));
            }
            Access::Joined(root.to_owned())
        } else {
            Access::Confined(Dir::open_ambient_dir(root, ambient_authority())?)
        };
        Ok(Self {
            access,
            root: root.to_owned(),
            read_joined: false,
            owner,
        })
    }

    /// Defect `read-follows-symlinks`: reads (and only reads) join the path to the root and
    /// let the OS follow whatever symlink they meet.
    pub(super) fn reading_through_symlinks(mut self) -> Self {
        self.read_joined = true;
        self
    }

    pub fn write(&self, path: &str, bytes: &[u8]) -> Result<WriteOutcome, FileError> {
        let rel = normalize(path)?;
        if rel.is_empty() {
            return Err(FileError::InvalidPath);
        }
        let created = match self.metadata(&rel) {
            Ok(meta) if meta.is_dir => return Err(FileError::WrongKind),
            Ok(_) => false,
            Err(FileError::NotFound) => true,
            Err(e) => return Err(e),
        };
        let parent = Path::new(&rel)
            .parent()
            .filter(|p| !p.as_os_str().is_empty());
        match &self.access {
            Access::Confined(dir) => {
                if let Some(parent) = parent {
                    self.create_dirs(dir, parent)?;
                }
                let mut file = dir.create(&rel).map_err(map_io)?;
                if let Some(uid) = self.owner {
                    give(&file, uid)?;
                }
                file.write_all(bytes)?;
            }
            Access::Joined(root) => {
                if let Some(parent) = parent {
                    std::fs::create_dir_all(root.join(parent)).map_err(map_io)?;
                }
                std::fs::write(root.join(&rel), bytes).map_err(map_io)?;
                if let Some(uid) = self.owner {
                    std::os::unix::fs::lchown(root.join(&rel), Some(uid), Some(uid))?;
                }
            }
        }
        Ok(WriteOutcome {
            path: rel,
            size: bytes.len() as u64,
            sha256: hex::encode(Sha256::digest(bytes)),
            created,
        })
    }

    pub fn read(&self, path: &str) -> Result<Vec<u8>, FileError> {
        let rel = normalize(path)?;
        if self.read_joined {
            let full = self.root.join(&rel);
            if std::fs::metadata(&full).map_err(map_io)?.is_dir() {
                return Err(FileError::WrongKind);
            }
            return std::fs::read(full).map_err(map_io);
        }
        if self.metadata(&rel)?.is_dir {
            return Err(FileError::WrongKind);
        }
        match &self.access {
            Access::Confined(dir) => dir.read(&rel).map_err(map_io),
            Access::Joined(root) => std::fs::read(root.join(&rel)).map_err(map_io),
        }
    }

    pub fn list(&self, path: &str) -> Result<Vec<FileEntry>, FileError> {
        let rel = normalize(path)?;
        if !self.metadata(&rel)?.is_dir {
            return Err(FileError::WrongKind);
        }
        let mut entries = match &self.access {
            Access::Confined(dir) => {
                let sub = if rel.is_empty() {
                    dir.try_clone()?
                } else {
                    dir.open_dir(&rel).map_err(map_io)?
                };
                let mut out = Vec::new();
                for entry in sub.entries()? {
                    let entry = entry?;
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let meta = sub.symlink_metadata(entry.file_name()).map_err(map_io)?;
                    out.push(entry_of(name, &Meta::of_cap(&meta)));
                }
                out
            }
            Access::Joined(root) => {
                let mut out = Vec::new();
                for entry in std::fs::read_dir(root.join(&rel)).map_err(map_io)? {
                    let entry = entry?;
                    let meta = std::fs::symlink_metadata(entry.path())?;
                    out.push(entry_of(
                        entry.file_name().to_string_lossy().into_owned(),
                        &Meta::of_std(&meta),
                    ));
                }
                out
            }
        };
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(entries)
    }

    /// Removes a file, a symlink (not its target) or a directory with everything below it.
    pub fn delete(&self, path: &str) -> Result<(), FileError> {
        let rel = normalize(path)?;
        if rel.is_empty() {
            // The root itself is not an entry of the sandbox; it cannot be deleted.
            return Err(FileError::InvalidPath);
        }
        let meta = self.symlink_metadata(&rel)?;
        match (&self.access, meta.is_dir) {
            (Access::Confined(dir), true) => dir.remove_dir_all(&rel).map_err(map_io),
            (Access::Confined(dir), false) => dir.remove_file(&rel).map_err(map_io),
            (Access::Joined(root), true) => {
                std::fs::remove_dir_all(root.join(&rel)).map_err(map_io)
            }
            (Access::Joined(root), false) => std::fs::remove_file(root.join(&rel)).map_err(map_io),
        }
    }

    /// What one entry is (the entry itself: a symlink is not followed in the last component).
    pub fn stat(&self, path: &str) -> Result<EntryStat, FileError> {
        let rel = normalize(path)?;
        let stat_of = |m: &std::fs::Metadata| -> EntryStat {
            use std::os::unix::fs::MetadataExt as _;
            EntryStat {
                kind: if m.file_type().is_symlink() {
                    "symlink"
                } else if m.is_dir() {
                    "dir"
                } else {
                    "file"
                },
                size: m.len(),
                mode: m.mode(),
                modified: m.modified().ok(),
                symlink_target: None,
            }
        };
        match &self.access {
            Access::Confined(dir) => {
                let target = if rel.is_empty() { "." } else { rel.as_str() };
                let file = dir.symlink_metadata(target).map_err(map_io)?;
                let mut stat = EntryStat {
                    kind: if file.file_type().is_symlink() {
                        "symlink"
                    } else if file.is_dir() {
                        "dir"
                    } else {
                        "file"
                    },
                    size: file.len(),
                    mode: cap_std::fs::PermissionsExt::mode(&file.permissions()),
                    modified: file.modified().ok().map(|t| t.into_std()),
                    symlink_target: None,
                };
                if stat.kind == "symlink" {
                    stat.symlink_target = dir
                        .read_link_contents(target)
                        .ok()
                        .map(|p| p.to_string_lossy().into_owned());
                }
                Ok(stat)
            }
            Access::Joined(root) => {
                let full = root.join(&rel);
                let mut stat = stat_of(&std::fs::symlink_metadata(&full).map_err(map_io)?);
                if stat.kind == "symlink" {
                    stat.symlink_target = std::fs::read_link(&full)
                        .ok()
                        .map(|p| p.to_string_lossy().into_owned());
                }
                Ok(stat)
            }
        }
    }

    /// Creates a directory and its missing parents. False when it already existed.
    pub fn make_dir(&self, path: &str) -> Result<bool, FileError> {
        let rel = normalize(path)?;
        if rel.is_empty() {
            return Ok(false);
        }
        match self.metadata(&rel) {
            Ok(meta) if meta.is_dir => return Ok(false),
            Ok(_) => return Err(FileError::WrongKind),
            Err(FileError::NotFound) => {}
            Err(e) => return Err(e),
        }
        match &self.access {
            Access::Confined(dir) => self.create_dirs(dir, Path::new(&rel))?,
            Access::Joined(root) => std::fs::create_dir_all(root.join(&rel)).map_err(map_io)?,
        }
        Ok(true)
    }

    /// Creates `path`'s missing directories below `dir`. Those it makes are given to the
    /// sandbox's uid, as if its user had made them (so that its processes can write in them);
    /// those that were there keep their owner and see no change.
    fn create_dirs(&self, dir: &Dir, path: &Path) -> Result<(), FileError> {
        let mut made = Vec::new();
        let mut prefix = PathBuf::new();
        for part in path.components() {
            prefix.push(part);
            if !made.is_empty() || !dir.exists(&prefix) {
                made.push(prefix.clone());
            }
        }
        dir.create_dir_all(path).map_err(map_io)?;
        if let Some(uid) = self.owner {
            for made in made {
                let sub = dir.open_dir(&made).map_err(map_io)?;
                give(&sub, uid)?;
            }
        }
        Ok(())
    }

    /// Moves an entry, creating the destination's missing parents; an existing destination
    /// file is replaced, as rename(2) does.
    pub fn rename(&self, from: &str, to: &str) -> Result<(), FileError> {
        let (from, to) = (normalize(from)?, normalize(to)?);
        if from.is_empty() || to.is_empty() {
            return Err(FileError::InvalidPath);
        }
        self.symlink_metadata(&from)?;
        let parent = Path::new(&to)
            .parent()
            .filter(|p| !p.as_os_str().is_empty());
        match &self.access {
            Access::Confined(dir) => {
                if let Some(parent) = parent {
                    self.create_dirs(dir, parent)?;
                }
                dir.rename(&from, dir, &to).map_err(map_io)
            }
            Access::Joined(root) => {
                if let Some(parent) = parent {
                    std::fs::create_dir_all(root.join(parent)).map_err(map_io)?;
                }
                std::fs::rename(root.join(&from), root.join(&to)).map_err(map_io)
            }
        }
    }

    /// Where `path` leads once every symlink on the way is followed (none may lead out of
    /// the root), as a root-relative path, and what is there. `NotFound` for a dangling link.
    pub fn resolve(&self, path: &str) -> Result<(String, EntryStat), FileError> {
        let rel = normalize(path)?;
        let target = if rel.is_empty() { "." } else { rel.as_str() };
        let resolved = match &self.access {
            Access::Confined(dir) => dir.canonicalize(target).map_err(map_io)?,
            Access::Joined(root) => {
                let full = std::fs::canonicalize(root.join(target)).map_err(map_io)?;
                let base = std::fs::canonicalize(root).map_err(map_io)?;
                full.strip_prefix(&base)
                    .map_err(|_| FileError::InvalidPath)?
                    .to_owned()
            }
        };
        let resolved = normalize(&resolved.to_string_lossy())?;
        let stat = self.stat(&resolved)?;
        Ok((resolved, stat))
    }

    /// The extended attributes of the entry at `path` (symlinks followed) whose names start
    /// with `prefix`, by the rest of their name. Attributes whose name or value is not UTF-8
    /// are left out; a file system without extended attributes has none.
    pub fn attributes(
        &self,
        path: &str,
        prefix: &str,
    ) -> Result<std::collections::BTreeMap<String, String>, FileError> {
        let fd = self.open_for_attributes(path)?;
        let mut out = std::collections::BTreeMap::new();
        for name in xattr::list(&fd)? {
            let Some(key) = name.strip_prefix(prefix) else {
                continue;
            };
            if let Some(value) = xattr::get(&fd, &name)?
                && let Ok(value) = String::from_utf8(value)
            {
                out.insert(key.to_owned(), value);
            }
        }
        Ok(out)
    }

    /// Replaces the extended attributes named `prefix` + key of the entry at `path` with
    /// `values`: keys not in `values` are removed.
    pub fn set_attributes(
        &self,
        path: &str,
        prefix: &str,
        values: &std::collections::BTreeMap<String, String>,
    ) -> Result<(), FileError> {
        let fd = self.open_for_attributes(path)?;
        for name in xattr::list(&fd)? {
            if let Some(key) = name.strip_prefix(prefix)
                && !values.contains_key(key)
            {
                xattr::remove(&fd, &name)?;
            }
        }
        for (key, value) in values {
            xattr::set(&fd, &format!("{prefix}{key}"), value.as_bytes())?;
        }
        Ok(())
    }

    /// Watches the directory at `path` (and, with `recursive`, every directory below it, those
    /// made later included) for changes, with inotify: one event per change the kernel
    /// reports, as envd's fsnotify watcher sees them.
    pub fn watch(&self, path: &str, recursive: bool) -> Result<DirWatch, FileError> {
        let rel = normalize(path)?;
        let target = if rel.is_empty() { "." } else { rel.as_str() };
        let base = match &self.access {
            Access::Confined(dir) => dir.open_dir(target).map_err(map_io)?,
            Access::Joined(root) => {
                Dir::open_ambient_dir(root.join(target), ambient_authority()).map_err(map_io)?
            }
        };
        DirWatch::new(base, recursive).map_err(FileError::Io)
    }

    /// A descriptor of the entry at `path` (symlinks followed, confined to the root) that the
    /// extended-attribute calls take.
    fn open_for_attributes(&self, path: &str) -> Result<std::os::fd::OwnedFd, FileError> {
        let rel = normalize(path)?;
        let target = if rel.is_empty() { "." } else { rel.as_str() };
        let is_dir = self.metadata(target)?.is_dir;
        Ok(match (&self.access, is_dir) {
            (Access::Confined(dir), true) => {
                dir.open_dir(target).map_err(map_io)?.into_std_file().into()
            }
            (Access::Confined(dir), false) => dir.open(target).map_err(map_io)?.into_std().into(),
            (Access::Joined(root), _) => std::fs::File::open(root.join(target))
                .map_err(map_io)?
                .into(),
        })
    }

    /// Metadata following symlinks (and refusing those that lead out).
    fn metadata(&self, rel: &str) -> Result<Meta, FileError> {
        let rel = if rel.is_empty() { "." } else { rel };
        match &self.access {
            Access::Confined(dir) => dir.metadata(rel).map(|m| Meta::of_cap(&m)).map_err(map_io),
            Access::Joined(root) => std::fs::metadata(root.join(rel))
                .map(|m| Meta::of_std(&m))
                .map_err(map_io),
        }
    }

    /// Metadata of the entry itself (a symlink is not followed in the last component).
    fn symlink_metadata(&self, rel: &str) -> Result<Meta, FileError> {
        match &self.access {
            Access::Confined(dir) => dir
                .symlink_metadata(rel)
                .map(|m| Meta::of_cap(&m))
                .map_err(map_io),
            Access::Joined(root) => std::fs::symlink_metadata(root.join(rel))
                .map(|m| Meta::of_std(&m))
                .map_err(map_io),
        }
    }
}

/// The parts of file metadata this module needs, from either std or cap-std.
struct Meta {
    is_dir: bool,
    is_symlink: bool,
    len: u64,
}

impl Meta {
    fn of_cap(m: &cap_std::fs::Metadata) -> Self {
        Self {
            is_dir: m.is_dir(),
            is_symlink: m.file_type().is_symlink(),
            len: m.len(),
        }
    }

    fn of_std(m: &std::fs::Metadata) -> Self {
        Self {
            is_dir: m.is_dir(),
            is_symlink: m.file_type().is_symlink(),
            len: m.len(),
        }
    }
}

fn entry_of(name: String, meta: &Meta) -> FileEntry {
    let kind = if meta.is_symlink {
        "symlink"
    } else if meta.is_dir {
        "dir"
    } else {
        "file"
    };
    FileEntry {
        name,
        kind,
        size: if meta.is_dir { 0 } else { meta.len },
    }
}

/// Gives an entry the files API created (or replaced) to the sandbox's uid.
fn give(entry: &impl std::os::fd::AsRawFd, uid: u32) -> io::Result<()> {
    // fchownat(AT_EMPTY_PATH) also takes the O_PATH descriptors cap-std may hold.
    // SAFETY: a NUL-terminated empty path and a descriptor borrowed for the call.
    let done = unsafe {
        libc::fchownat(
            entry.as_raw_fd(),
            c"".as_ptr(),
            uid,
            uid,
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if done == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Normalizes a client path relative to the root: `.` and empty segments go, `..` pops a
/// segment. Absolute paths, `..` above the root and NUL bytes are `InvalidPath`. The empty
/// string is the root itself.
///
/// This is a lexical check only; symlinks are resolved by the OS below a directory capability.
pub(super) fn normalize(path: &str) -> Result<String, FileError> {
    if path.starts_with('/') || path.contains('\0') {
        return Err(FileError::InvalidPath);
    }
    let mut parts: Vec<&str> = Vec::new();
    for segment in path.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                parts.pop().ok_or(FileError::InvalidPath)?;
            }
            s => parts.push(s),
        }
    }
    Ok(parts.join("/"))
}

/// Maps an I/O error to what it means for the client. cap-std reports an attempt to leave
/// the directory as a `PermissionDenied` error without an OS error code.
fn map_io(e: io::Error) -> FileError {
    match e.kind() {
        io::ErrorKind::NotFound => FileError::NotFound,
        io::ErrorKind::PermissionDenied if e.raw_os_error().is_none() => FileError::InvalidPath,
        io::ErrorKind::NotADirectory
        | io::ErrorKind::IsADirectory
        | io::ErrorKind::DirectoryNotEmpty => FileError::WrongKind,
        _ => match e.raw_os_error() {
            // openat2 with RESOLVE_BENEATH answers EXDEV when a path leads out.
            Some(libc::EXDEV) => FileError::InvalidPath,
            // A path component that exists but is a file (`file.txt/x`).
            Some(libc::ENOTDIR) => FileError::WrongKind,
            // A name longer than the file system keeps (255 bytes a component, which a few
            // dozen combining characters reach) or a path beyond PATH_MAX: the client's path
            // is at fault, not the server.
            Some(libc::ENAMETOOLONG) => FileError::InvalidPath,
            _ => FileError::Io(e),
        },
    }
}

/// What happened to one entry below a watched directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// The entry's path relative to the watched directory.
    pub name: String,
    /// `create`, `write`, `remove`, `rename` (moved away) or `chmod` (attributes changed).
    pub kind: &'static str,
}

/// An inotify watch on a directory ([`SandboxFiles::watch`]); its events are read without
/// waiting, so a poller decides how often to look.
pub struct DirWatch {
    fd: std::os::fd::OwnedFd,
    /// The watched directory, through which directories below it are opened (confined).
    base: Dir,
    recursive: bool,
    /// Each watch descriptor's directory, relative to the watched one (`""` for itself).
    dirs: std::collections::HashMap<i32, String>,
}

/// Most directories one watch covers: each is an inotify watch, of which the kernel grants a
/// user a limited number for all its instances.
const MAX_WATCHED_DIRS: usize = 4096;

/// The changes a watch asks the kernel for, as fsnotify's do.
const WATCH_MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_ATTRIB
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    // Not IN_DONT_FOLLOW: the name given is the descriptor's magic link in /proc, which must
    // be followed to the directory it stands for.
    | libc::IN_ONLYDIR;

/// The inotify descriptor, for waiting until it has events (it reads without blocking).
impl std::os::fd::AsRawFd for DirWatch {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.fd)
    }
}

impl DirWatch {
    fn new(base: Dir, recursive: bool) -> io::Result<Self> {
        use std::os::fd::FromRawFd as _;
        // SAFETY: inotify_init1 has no preconditions; the descriptor it returns is owned here.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: just opened and owned by nobody else.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let mut watch = Self {
            fd,
            base,
            recursive,
            dirs: std::collections::HashMap::new(),
        };
        watch.add("")?;
        Ok(watch)
    }

    /// Watches the directory `rel` (below the watched one) and, when recursive, the ones
    /// below it. A directory gone meanwhile is skipped.
    fn add(&mut self, rel: &str) -> io::Result<()> {
        if self.dirs.len() >= MAX_WATCHED_DIRS {
            return Err(io::Error::other(format!(
                "a watch covers at most {MAX_WATCHED_DIRS} directories"
            )));
        }
        let dir = if rel.is_empty() {
            self.base.try_clone()?
        } else {
            match self.base.open_dir(rel) {
                Ok(dir) => dir,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(e),
            }
        };
        // The directory was opened through the capability; the watch is put on that very
        // inode by its descriptor's name, so no path outside the root is ever resolved.
        let path = std::ffi::CString::new(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&dir)
        ))
        .map_err(io::Error::other)?;
        // SAFETY: a NUL-terminated path and a descriptor owned here.
        let wd = unsafe {
            libc::inotify_add_watch(
                std::os::fd::AsRawFd::as_raw_fd(&self.fd),
                path.as_ptr(),
                WATCH_MASK,
            )
        };
        if wd < 0 {
            return Err(io::Error::last_os_error());
        }
        self.dirs.insert(wd, rel.to_owned());
        if self.recursive {
            for entry in dir.entries()? {
                let entry = entry?;
                if entry.file_type()?.is_dir() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let child = if rel.is_empty() {
                        name
                    } else {
                        format!("{rel}/{name}")
                    };
                    self.add(&child)?;
                }
            }
        }
        Ok(())
    }

    /// The events since the last look, in the order the kernel reported them. A directory
    /// created below a recursive watch is watched from then on, and what was made in it
    /// before that is reported as created.
    pub fn events(&mut self) -> io::Result<Vec<WatchEvent>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: the buffer is valid for its length; the descriptor is owned here.
            let n = unsafe {
                libc::read(
                    std::os::fd::AsRawFd::as_raw_fd(&self.fd),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::WouldBlock {
                    return Ok(out);
                }
                return Err(e);
            }
            let n = n as usize;
            let mut at = 0;
            let header = std::mem::size_of::<libc::inotify_event>();
            while at + header <= n {
                // SAFETY: the kernel wrote a whole event header at `at`; read unaligned.
                let event: libc::inotify_event =
                    unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
                let name_bytes = &buf[at + header..at + header + event.len as usize];
                let name = String::from_utf8_lossy(
                    name_bytes.split(|b| *b == 0).next().unwrap_or_default(),
                )
                .into_owned();
                at += header + event.len as usize;
                if event.mask & libc::IN_IGNORED != 0 {
                    self.dirs.remove(&event.wd);
                    continue;
                }
                let Some(dir) = self.dirs.get(&event.wd).cloned() else {
                    continue;
                };
                if name.is_empty() {
                    // An event of the watched directory itself: its entry in its parent
                    // reports it.
                    continue;
                }
                let path = if dir.is_empty() {
                    name
                } else {
                    format!("{dir}/{name}")
                };
                let mask = event.mask;
                let kind = if mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
                    "create"
                } else if mask & libc::IN_MODIFY != 0 {
                    "write"
                } else if mask & libc::IN_DELETE != 0 {
                    "remove"
                } else if mask & libc::IN_MOVED_FROM != 0 {
                    "rename"
                } else if mask & libc::IN_ATTRIB != 0 {
                    "chmod"
                } else {
                    continue;
                };
                out.push(WatchEvent {
                    name: path.clone(),
                    kind,
                });
                if kind == "create" && mask & libc::IN_ISDIR != 0 && self.recursive {
                    // Entries made in the new directory before its watch was in place.
                    let before = self.dirs.len();
                    self.add(&path)?;
                    if self.dirs.len() > before {
                        self.created_below(&path, &mut out)?;
                    }
                }
            }
        }
    }

    /// Reports every entry below the directory `rel` (just watched) as created.
    fn created_below(&self, rel: &str, out: &mut Vec<WatchEvent>) -> io::Result<()> {
        let Ok(dir) = self.base.open_dir(rel) else {
            return Ok(());
        };
        for entry in dir.entries()? {
            let entry = entry?;
            let name = format!("{rel}/{}", entry.file_name().to_string_lossy());
            out.push(WatchEvent {
                name: name.clone(),
                kind: "create",
            });
            if entry.file_type()?.is_dir() {
                self.created_below(&name, out)?;
            }
        }
        Ok(())
    }
}

/// The extended-attribute system calls on a descriptor (`f*xattr`), in the `user.`
/// namespace that unprivileged processes may use.
mod xattr {
    use std::ffi::CString;
    use std::io;
    use std::os::fd::{AsRawFd as _, OwnedFd};

    fn name_of(name: &str) -> io::Result<CString> {
        CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    }

    /// Whether an error says that the file system keeps no extended attributes.
    fn unsupported(e: &io::Error) -> bool {
        e.raw_os_error() == Some(libc::ENOTSUP)
    }

    pub fn list(fd: &OwnedFd) -> io::Result<Vec<String>> {
        let mut buf = vec![0u8; 4096];
        loop {
            // SAFETY: the buffer is valid for its length; the descriptor is borrowed.
            let n = unsafe { libc::flistxattr(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n >= 0 {
                buf.truncate(n as usize);
                break;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ERANGE) if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
                _ if unsupported(&e) => return Ok(Vec::new()),
                _ => return Err(e),
            }
        }
        Ok(buf
            .split(|b| *b == 0)
            .filter(|n| !n.is_empty())
            .filter_map(|n| std::str::from_utf8(n).ok().map(str::to_owned))
            .collect())
    }

    pub fn get(fd: &OwnedFd, name: &str) -> io::Result<Option<Vec<u8>>> {
        let name = name_of(name)?;
        let mut buf = vec![0u8; 4096];
        loop {
            // SAFETY: as in `list`.
            let n = unsafe {
                libc::fgetxattr(
                    fd.as_raw_fd(),
                    name.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return Ok(Some(buf));
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ERANGE) if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
                Some(libc::ENODATA) => return Ok(None),
                _ => return Err(e),
            }
        }
    }

    pub fn set(fd: &OwnedFd, name: &str, value: &[u8]) -> io::Result<()> {
        let name = name_of(name)?;
        // SAFETY: as in `list`.
        let done = unsafe {
            libc::fsetxattr(
                fd.as_raw_fd(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if done == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    pub fn remove(fd: &OwnedFd, name: &str) -> io::Result<()> {
        let name = name_of(name)?;
        // SAFETY: as in `list`.
        let done = unsafe { libc::fremovexattr(fd.as_raw_fd(), name.as_ptr()) };
        if done == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::ENODATA) {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (tempfile::TempDir, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir(&root).unwrap();
        (tmp, root)
    }

    #[test]
    fn normalize_cases() {
        let cases: &[(&str, Option<&str>)] = &[
            ("a/b", Some("a/b")),
            ("a/./b", Some("a/b")),
            ("./a//b/", Some("a/b")),
            ("a/../b", Some("b")),
            ("", Some("")),
            (".", Some("")),
            ("..", None),
            ("../x", None),
            ("a/../../x", None),
            ("/etc/passwd", None),
            ("a\0b", None),
        ];
        for (input, expected) in cases {
            let got = normalize(input).ok();
            assert_eq!(got.as_deref(), *expected, "input {input:?}");
        }
    }

    #[test]
    fn binary_round_trip_is_exact_and_reports_created() {
        let (_tmp, root) = setup();
        let files = SandboxFiles::open(&root, false).unwrap();
        let bytes: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
        let first = files.write("deep/er/./bin.dat", &bytes).unwrap();
        assert_eq!(first.path, "deep/er/bin.dat");
        assert_eq!(first.size, 70_000);
        assert_eq!(first.sha256, hex::encode(Sha256::digest(&bytes)));
        assert!(first.created);
        assert_eq!(files.read("deep/er/bin.dat").unwrap(), bytes);
        assert_eq!(std::fs::read(root.join("deep/er/bin.dat")).unwrap(), bytes);

        let second = files.write("deep/er/bin.dat", b"short").unwrap();
        assert!(!second.created);
        assert_eq!(files.read("deep/er/bin.dat").unwrap(), b"short");
    }

    #[test]
    fn list_is_sorted_with_kinds_and_sizes() {
        let (_tmp, root) = setup();
        let files = SandboxFiles::open(&root, false).unwrap();
        files.write("b.txt", b"12345").unwrap();
        files.write("a/inner.txt", b"x").unwrap();
        std::os::unix::fs::symlink("b.txt", root.join("c-link")).unwrap();
        let entries = files.list("").unwrap();
        let summary: Vec<(&str, &str)> =
            entries.iter().map(|e| (e.name.as_str(), e.kind)).collect();
        assert_eq!(
            summary,
            [("a", "dir"), ("b.txt", "file"), ("c-link", "symlink")]
        );
        assert_eq!(entries[1].size, 5);
        assert_eq!(files.list("a").unwrap()[0].name, "inner.txt");
        assert!(matches!(files.list("b.txt"), Err(FileError::WrongKind)));
        assert!(matches!(files.list("nope"), Err(FileError::NotFound)));
    }

    #[test]
    fn delete_removes_files_and_trees() {
        let (_tmp, root) = setup();
        let files = SandboxFiles::open(&root, false).unwrap();
        files.write("tree/a/b/c.txt", b"x").unwrap();
        files.write("single.txt", b"x").unwrap();
        files.delete("single.txt").unwrap();
        files.delete("tree").unwrap();
        assert!(!root.join("single.txt").exists());
        assert!(!root.join("tree").exists());
        assert!(matches!(files.delete("tree"), Err(FileError::NotFound)));
        assert!(matches!(files.delete(""), Err(FileError::InvalidPath)));
    }

    #[test]
    fn wrong_kinds_and_missing() {
        let (_tmp, root) = setup();
        let files = SandboxFiles::open(&root, false).unwrap();
        files.write("d/f", b"x").unwrap();
        assert!(matches!(files.read("d"), Err(FileError::WrongKind)));
        assert!(matches!(files.read(""), Err(FileError::WrongKind)));
        assert!(matches!(files.write("d", b"x"), Err(FileError::WrongKind)));
        assert!(matches!(
            files.write("d/f/g", b"x"),
            Err(FileError::WrongKind)
        ));
        assert!(matches!(files.read("missing"), Err(FileError::NotFound)));
        assert!(matches!(files.write("", b"x"), Err(FileError::InvalidPath)));
    }

    /// Every way out of the root is refused, and nothing outside it is read or created.
    fn check_escapes(files: &SandboxFiles, outside: &Path) {
        let attempts = [
            "../x",
            "/etc/passwd",
            "out/passwd",
            "out/new-file",
            "up/x",
            "up/root/../escaped",
            "abs-outside/secret.txt",
        ];
        for path in attempts {
            assert!(
                matches!(files.read(path), Err(FileError::InvalidPath)),
                "read {path}"
            );
            assert!(
                matches!(files.write(path, b"pwned"), Err(FileError::InvalidPath)),
                "write {path}"
            );
            assert!(
                matches!(files.list(path), Err(FileError::InvalidPath)),
                "list {path}"
            );
        }
        assert!(matches!(files.list("out"), Err(FileError::InvalidPath)));
        assert!(matches!(files.list("up"), Err(FileError::InvalidPath)));
        assert!(matches!(files.delete("up/x"), Err(FileError::InvalidPath)));
        assert!(!outside.join("x").exists());
        assert!(!outside.join("escaped").exists());
        assert_eq!(
            std::fs::read(outside.join("secret.txt")).unwrap(),
            b"secret"
        );
    }

    #[test]
    fn escapes_are_invalid_paths() {
        let (tmp, root) = setup();
        let outside = tmp.path().to_owned();
        std::fs::write(outside.join("secret.txt"), b"secret").unwrap();
        std::os::unix::fs::symlink("/etc", root.join("out")).unwrap();
        std::os::unix::fs::symlink("..", root.join("up")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("abs-outside")).unwrap();
        let files = SandboxFiles::open(&root, false).unwrap();
        check_escapes(&files, &outside);
        // A symlink that stays inside is fine, and deleting a link leaves its target alone.
        files.write("target.txt", b"inside").unwrap();
        std::os::unix::fs::symlink("target.txt", root.join("inner-link")).unwrap();
        assert_eq!(files.read("inner-link").unwrap(), b"inside");
        files.delete("out").unwrap();
        assert!(Path::new("/etc/passwd").exists());
    }

    #[cfg(feature = "defects")]
    #[test]
    fn defect_read_follows_symlinks_only_on_read() {
        let (_tmp, root) = setup();
        let outside = root.parent().unwrap().join("outside-read.txt");
        std::fs::write(&outside, b"secret").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        let honest = SandboxFiles::open(&root, false).unwrap();
        assert!(matches!(honest.read("link"), Err(FileError::InvalidPath)));
        let files = SandboxFiles::open(&root, false)
            .unwrap()
            .reading_through_symlinks();
        assert_eq!(files.read("link").unwrap(), b"secret");
        // Every other operation is still confined.
        assert!(matches!(
            files.write("link", b"x"),
            Err(FileError::InvalidPath)
        ));
        assert_eq!(std::fs::read(&outside).unwrap(), b"secret");
    }

    #[test]
    fn defect_symlink_escape_follows_links_out() {
        let (tmp, root) = setup();
        let outside = tmp.path().to_owned();
        std::fs::write(outside.join("secret.txt"), b"secret").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("abs-outside")).unwrap();
        let files = SandboxFiles::open(&root, true).unwrap();
        // String checks still refuse `..` and absolute paths ...
        assert!(matches!(
            files.read("../secret.txt"),
            Err(FileError::InvalidPath)
        ));
        assert!(matches!(
            files.read("/etc/passwd"),
            Err(FileError::InvalidPath)
        ));
        // ... but the symlink is followed out of the root.
        assert_eq!(files.read("abs-outside/secret.txt").unwrap(), b"secret");
        files.write("abs-outside/planted.txt", b"x").unwrap();
        assert!(outside.join("planted.txt").exists());
    }
}
