//! Key and certificate files.
//!
//! Writes are crash-safe (a temporary file, fsync, then into place, then the directory's
//! fsync: a crash leaves the old file or the new one, never half a key) and, for secrets,
//! readable by the owner alone from the moment the file exists (the temporary file is
//! created with mode 0600, never chmod-ed after writing). Unless the caller asks to
//! replace, a file is put into place with a hard link, which fails if the name exists:
//! a fleet's CA or signing key, once made, is never overwritten by a later command that
//! happens to write the same name (every certificate it issued, or every version it
//! signed, would stop verifying).
//!
//! Reads of private keys check the file's mode on the open file first: a key that others
//! may read or write is refused, never used with a warning.

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
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

/// Whether a write may replace a file of the same name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replace {
    /// The name must be free: a file there is an error ([`std::io::ErrorKind::AlreadyExists`]).
    Never,
    /// A file there is replaced (atomically).
    Allowed,
}

/// A file operation that failed, and on which file.
#[derive(Debug)]
pub(crate) struct FileError {
    pub path: PathBuf,
    pub error: std::io::Error,
}

/// Why a private key file was not read.
#[derive(Debug)]
pub(crate) enum SecretError {
    Io(FileError),
    /// Permission bits beyond [`PRIVATE_KEY_MODE`].
    Exposed {
        path: PathBuf,
        mode: u32,
    },
}

impl From<FileError> for SecretError {
    fn from(error: FileError) -> SecretError {
        SecretError::Io(error)
    }
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> FileError {
    let path = path.to_path_buf();
    move |error| FileError { path, error }
}

pub(crate) fn write(
    path: &Path,
    bytes: &[u8],
    access: Access,
    replace: Replace,
) -> Result<(), FileError> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let name = path.file_name().ok_or_else(|| FileError {
        path: path.to_path_buf(),
        error: std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"),
    })?;
    if replace == Replace::Never && fs::symlink_metadata(path).is_ok() {
        // Said before any temporary file is made; the link below decides races.
        return Err(FileError {
            path: path.to_path_buf(),
            error: std::io::ErrorKind::AlreadyExists.into(),
        });
    }
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
        .map_err(io_at(&temporary))?;
    file.write_all(bytes).map_err(io_at(&temporary))?;
    file.sync_all().map_err(io_at(&temporary))?;
    drop(file);
    match replace {
        Replace::Allowed => fs::rename(&temporary, path).map_err(io_at(path))?,
        Replace::Never => {
            // A hard link never replaces: a name taken meanwhile fails here.
            let linked = fs::hard_link(&temporary, path).map_err(io_at(path));
            let _ = fs::remove_file(&temporary);
            linked?;
        }
    }
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_at(dir))
}

pub(crate) fn read(path: &Path) -> Result<Vec<u8>, FileError> {
    fs::read(path).map_err(io_at(path))
}

/// A private key file's bytes, refused if its mode lets anyone but its owner read or
/// write it (or execute it: nothing but 0600 or less is a key's mode). The mode is read
/// from the open file, so the file checked is the file read.
pub(crate) fn read_secret(path: &Path) -> Result<Vec<u8>, SecretError> {
    let mut file = fs::File::open(path).map_err(io_at(path))?;
    let mode = file.metadata().map_err(io_at(path))?.permissions().mode() & 0o777;
    if mode & !PRIVATE_KEY_MODE != 0 {
        return Err(SecretError::Exposed {
            path: path.to_path_buf(),
            mode,
        });
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(io_at(path))?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_never_replaced_unless_asked_and_no_temporary_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.key");
        write(&path, b"first", Access::Secret, Replace::Never).unwrap();
        let error = write(&path, b"second", Access::Secret, Replace::Never).unwrap_err();
        assert_eq!(error.error.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(fs::read(&path).unwrap(), b"first");
        write(&path, b"third", Access::Secret, Replace::Allowed).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"third");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_secret_readable_or_writable_by_others_is_refused_with_its_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.key");
        write(&path, b"key", Access::Secret, Replace::Never).unwrap();
        assert_eq!(read_secret(&path).unwrap(), b"key");
        for mode in [0o644, 0o640, 0o604, 0o700, 0o620] {
            fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
            match read_secret(&path) {
                Err(SecretError::Exposed { mode: found, .. }) => assert_eq!(found, mode),
                other => panic!("mode {mode:o}: {other:?}"),
            }
        }
        fs::set_permissions(&path, fs::Permissions::from_mode(0o400)).unwrap();
        assert_eq!(read_secret(&path).unwrap(), b"key");
    }
}
