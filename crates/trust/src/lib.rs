//! Trust in an aurora fleet (docs/security.md): who a peer is, and who made a version.
//!
//! - [`identity`]: a node's role, id and region, as its certificate carries them.
//! - [`certs`]: the fleet's certificate authority and the node certificates it issues.
//! - [`tls`]: TLS 1.3 configurations with mutual authentication against the fleet CA.
//! - [`signing`]: the trainer's ed25519 key, which signs every version.
//! - [`plaintext`]: how far a node in plaintext may reach (loopback, unless told otherwise).
//! - [`refusal_log`]: how many log lines the refusals of strangers may cause.

pub mod certs;
mod files;
pub mod identity;
pub mod plaintext;
pub mod refusal_log;
pub mod signing;
pub mod tls;

use std::path::PathBuf;

pub use certs::{FleetCa, NodeCertificate, NodeFiles};
pub use files::Replace;
pub use identity::{Identity, IdentityError, Role, canonical_actor_id};
pub use plaintext::{BeyondLoopback, PlaintextReach};
pub use refusal_log::{Admission, RefusalLog};
pub use tls::{NodeTls, TlsFiles, peer_identity};

impl From<files::FileError> for TrustError {
    fn from(files::FileError { path, error }: files::FileError) -> TrustError {
        if error.kind() == std::io::ErrorKind::AlreadyExists {
            return TrustError::Exists(path);
        }
        TrustError::Io {
            path,
            source: error,
        }
    }
}

impl From<files::SecretError> for TrustError {
    fn from(error: files::SecretError) -> TrustError {
        match error {
            files::SecretError::Io(error) => error.into(),
            files::SecretError::Exposed { path, mode } => TrustError::Exposed { path, mode },
        }
    }
}

/// Why trust material could not be created, read or used. Each names the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("{}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{} exists already: trust files are never overwritten unless asked (a new CA or key \
         invalidates every certificate or signature the old one made)",
        .0.display()
    )]
    Exists(PathBuf),
    #[error(
        "{} has mode {mode:o}: a private key must be readable and writable by its owner \
         alone (chmod 600)",
        path.display()
    )]
    Exposed { path: PathBuf, mode: u32 },
    #[error("{}: not a usable certificate or key", path.display())]
    Certificate {
        path: PathBuf,
        #[source]
        source: rcgen::Error,
    },
    #[error("{}: invalid PEM", path.display())]
    Pem {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("{}: no certificate in the file", .0.display())]
    NoCertificate(PathBuf),
    #[error("{}: the certificate is not an aurora node's", path.display())]
    NodeCertificate {
        path: PathBuf,
        #[source]
        source: IdentityError,
    },
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error("generating a certificate")]
    Generate(#[from] rcgen::Error),
    #[error("building the TLS configuration")]
    Tls(#[from] rustls::Error),
    #[error("building the client certificate verifier")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}
