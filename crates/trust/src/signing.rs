//! The trainer's ed25519 signing key on disk (docs/security.md): generated once, kept as
//! PKCS#8 PEM readable by its owner alone, its public half given to every relay and
//! actor, which pin it and check every artifact and Commit against it
//! (`aurora_delta::verify`).
//!
//! Writes are crash-safe (temporary file, fsync, rename, directory fsync): a crash
//! leaves the old file or the new one, never half a key. Every error names the file.

use std::path::{Path, PathBuf};

use aurora_delta::{SigningKey, VerifyingKey};
use ed25519_dalek::pkcs8::spki::der::pem::LineEnding;
use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey};

pub use aurora_delta::key_fingerprint as fingerprint;

pub use crate::files::PRIVATE_KEY_MODE;
use crate::files::{self, Access, FileError, Replace, SecretError};

/// What went wrong with a key file, and which.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    /// The cause is part of the message (not a `source`), so an error chain names it once.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path} is not {what} in PEM: {reason}")]
    Parse {
        path: PathBuf,
        what: &'static str,
        reason: String,
    },
    #[error(
        "{path} has mode {mode:o}: a signing key must be readable and writable by its owner alone (chmod 600)"
    )]
    Exposed { path: PathBuf, mode: u32 },
    #[error("{path} exists already: a signing key is never overwritten unless asked")]
    Exists { path: PathBuf },
    #[error("cannot encode the key as PEM: {0}")]
    Encode(String),
    #[error("no randomness for a new key: {0}")]
    Random(String),
}

impl From<FileError> for KeyFileError {
    fn from(FileError { path, error }: FileError) -> KeyFileError {
        if error.kind() == std::io::ErrorKind::AlreadyExists {
            return KeyFileError::Exists { path };
        }
        KeyFileError::Io { path, error }
    }
}

impl From<SecretError> for KeyFileError {
    fn from(error: SecretError) -> KeyFileError {
        match error {
            SecretError::Io(error) => error.into(),
            SecretError::Exposed { path, mode } => KeyFileError::Exposed { path, mode },
        }
    }
}

/// A new signing key from the operating system's randomness.
pub fn generate() -> Result<SigningKey, KeyFileError> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| KeyFileError::Random(e.to_string()))?;
    Ok(SigningKey::from_bytes(&seed))
}

/// Generates a signing key and writes it to `private` (mode 0600) and its public half to
/// `public`, neither of which may exist, the public half first: a crash between the two
/// leaves no private key whose public half is missing. Returns the public key.
pub fn create_key_pair(private: &Path, public: &Path) -> Result<VerifyingKey, KeyFileError> {
    if private.exists() {
        // Checked before the public half is written, so nothing is left half made.
        return Err(KeyFileError::Exists {
            path: private.to_path_buf(),
        });
    }
    let key = generate()?;
    write_public_key(public, &key.verifying_key(), Replace::Never)?;
    write_signing_key(private, &key, Replace::Never)?;
    Ok(key.verifying_key())
}

/// Writes `key` to `path` as PKCS#8 PEM with mode 0600.
pub fn write_signing_key(
    path: &Path,
    key: &SigningKey,
    replace: Replace,
) -> Result<(), KeyFileError> {
    let pem = key
        .to_pkcs8_pem(LineEnding::LF)
        .map_err(|e| KeyFileError::Encode(e.to_string()))?;
    Ok(files::write(path, pem.as_bytes(), Access::Secret, replace)?)
}

/// Writes `key` to `path` as a SubjectPublicKeyInfo PEM (`-----BEGIN PUBLIC KEY-----`).
pub fn write_public_key(
    path: &Path,
    key: &VerifyingKey,
    replace: Replace,
) -> Result<(), KeyFileError> {
    let pem = key
        .to_public_key_pem(LineEnding::LF)
        .map_err(|e| KeyFileError::Encode(e.to_string()))?;
    Ok(files::write(path, pem.as_bytes(), Access::Public, replace)?)
}

/// Reads a signing key written by [`write_signing_key`] (or any PKCS#8 ed25519 PEM),
/// refusing one that others may read.
pub fn load_signing_key(path: &Path) -> Result<SigningKey, KeyFileError> {
    let what = "an ed25519 private key (PKCS#8)";
    let pem = String::from_utf8(files::read_secret(path)?)
        .map_err(|_| parse_error(path, what, "the file is not text"))?;
    SigningKey::from_pkcs8_pem(&pem).map_err(|e| parse_error(path, what, e))
}

/// Reads a public key written by [`write_public_key`]: the trainer key a relay or an
/// actor pins.
pub fn load_public_key(path: &Path) -> Result<VerifyingKey, KeyFileError> {
    let what = "an ed25519 public key";
    let pem = read_pem(path, what)?;
    VerifyingKey::from_public_key_pem(&pem).map_err(|e| parse_error(path, what, e))
}

/// The text of a PEM file; a file that is not text is not `what`.
fn read_pem(path: &Path, what: &'static str) -> Result<String, KeyFileError> {
    let bytes = files::read(path)?;
    String::from_utf8(bytes).map_err(|_| parse_error(path, what, "the file is not text"))
}

fn parse_error(path: &Path, what: &'static str, reason: impl ToString) -> KeyFileError {
    KeyFileError::Parse {
        path: path.to_path_buf(),
        what,
        reason: reason.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn keys_round_trip_through_their_files() {
        let dir = tempfile::tempdir().unwrap();
        let (private, public) = (
            dir.path().join("trainer.key"),
            dir.path().join("trainer.pub"),
        );
        let key = generate().unwrap();
        write_signing_key(&private, &key, Replace::Never).unwrap();
        write_public_key(&public, &key.verifying_key(), Replace::Never).unwrap();
        let error = create_key_pair(&private, &public).unwrap_err();
        assert!(matches!(error, KeyFileError::Exists { .. }), "{error}");
        let mode = fs::metadata(&private).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, PRIVATE_KEY_MODE);
        assert_eq!(
            load_signing_key(&private).unwrap().to_bytes(),
            key.to_bytes()
        );
        assert_eq!(load_public_key(&public).unwrap(), key.verifying_key());
        assert_eq!(fingerprint(&key.verifying_key()).len(), 16);
        assert_ne!(generate().unwrap().to_bytes(), key.to_bytes());
        assert!(
            fs::read_dir(dir.path()).unwrap().count() == 2,
            "no temporary file left"
        );
    }

    #[test]
    fn bad_key_files_are_refused_with_their_name() {
        let dir = tempfile::tempdir().unwrap();
        let private = dir.path().join("trainer.key");
        write_signing_key(&private, &generate().unwrap(), Replace::Never).unwrap();
        fs::set_permissions(&private, fs::Permissions::from_mode(0o644)).unwrap();
        let err = load_signing_key(&private).unwrap_err();
        assert!(matches!(err, KeyFileError::Exposed { .. }), "{err}");
        assert!(err.to_string().contains("trainer.key"), "{err}");
        // A private key is not a public key, and neither is garbage.
        let err = load_public_key(&private).unwrap_err();
        assert!(err.to_string().contains("trainer.key"), "{err}");
        let missing = dir.path().join("missing.pub");
        let err = load_public_key(&missing).unwrap_err();
        assert!(err.to_string().contains("missing.pub"), "{err}");
    }
}
