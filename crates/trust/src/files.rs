//! Writing key and certificate files: crash-safe (a temporary file, fsync, rename, then
//! the directory's fsync) and, for secrets, readable by the owner alone from the moment
//! the file exists (mode 0600 at creation, never a chmod after writing).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::TrustError;

/// Who may read a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// A private key: the owner only (0600).
    Secret,
    /// A certificate or a public key (0644).
    Public,
}

pub(crate) fn write(path: &Path, contents: &[u8], access: Access) -> Result<(), TrustError> {
    let io = |source| TrustError::Io {
        path: path.to_path_buf(),
        source,
    };
    let temporary = temporary_path(path);
    let mode = match access {
        Access::Secret => 0o600,
        Access::Public => 0o644,
    };
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&temporary)
        .map_err(io)?;
    file.write_all(contents).map_err(io)?;
    file.sync_all().map_err(io)?;
    fs::rename(&temporary, path).map_err(io)?;
    if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        File::open(dir).and_then(|dir| dir.sync_all()).map_err(io)?;
    }
    Ok(())
}

pub(crate) fn read_text(path: &Path) -> Result<String, TrustError> {
    fs::read_to_string(path).map_err(|source| TrustError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn temporary_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}
