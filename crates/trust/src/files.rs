//! Writing key and certificate files: crash-safe (a temporary file, fsync, rename, then
//! the directory's fsync: a crash leaves the old file or the new one, never half a key)
//! and, for secrets, readable by the owner alone from the moment the file exists (the
//! temporary file is created with mode 0600, never chmod-ed after writing).

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Permission bits of a private key file: its owner's alone.
pub const PRIVATE_KEY_MODE: u32 = 0o600;
/// Permission bits of a certificate or a public key.
const PUBLIC_MODE: u32 = 0o644;

/// Who may read a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// A private key: the owner only.
    Secret,
    /// A certificate or a public key.
    Public,
}

/// A file operation that failed, and on which file.
#[derive(Debug)]
pub(crate) struct FileError {
    pub path: PathBuf,
    pub error: std::io::Error,
}

pub(crate) fn write(path: &Path, bytes: &[u8], access: Access) -> Result<(), FileError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |error| FileError { path, error }
    };
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let name = path.file_name().ok_or_else(|| FileError {
        path: path.to_path_buf(),
        error: std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"),
    })?;
    let temporary = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    // A temporary file a crash left is ours to replace.
    let _ = fs::remove_file(&temporary);
    let mode = match access {
        Access::Secret => PRIVATE_KEY_MODE,
        Access::Public => PUBLIC_MODE,
    };
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&temporary)
        .map_err(io(&temporary))?;
    file.write_all(bytes).map_err(io(&temporary))?;
    file.sync_all().map_err(io(&temporary))?;
    drop(file);
    fs::rename(&temporary, path).map_err(io(path))?;
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))
}

pub(crate) fn read(path: &Path) -> Result<Vec<u8>, FileError> {
    fs::read(path).map_err(|error| FileError {
        path: path.to_path_buf(),
        error,
    })
}
