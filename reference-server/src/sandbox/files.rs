//! Files inside a sandbox, confined to its root with capability-based I/O (cap-std): `..`
//! that leaves the root, absolute paths and symlinks pointing out are refused by the OS-level
//! resolution, not by string checks alone.

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FileEntry {
    pub name: String,
    /// `file`, `dir` or `symlink`.
    pub kind: &'static str,
    pub size: u64,
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
    // Private: a cap-std directory handle on the sandbox root.
}

impl SandboxFiles {
    pub fn write(&self, _path: &str, _bytes: &[u8]) -> Result<WriteOutcome, FileError> {
        todo!()
    }

    pub fn read(&self, _path: &str) -> Result<Vec<u8>, FileError> {
        todo!()
    }

    pub fn list(&self, _path: &str) -> Result<Vec<FileEntry>, FileError> {
        todo!()
    }

    pub fn delete(&self, _path: &str) -> Result<(), FileError> {
        todo!()
    }
}
