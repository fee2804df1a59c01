//! Trust in an aurora fleet (docs/security.md): who a peer is, and who made a version.
//!
//! - [`identity`]: a node's role, id and region, as its certificate carries them.
//! - [`certs`]: the fleet's certificate authority and the node certificates it issues.
//! - [`tls`]: TLS 1.3 configurations with mutual authentication against the fleet CA.
//! - [`signing`]: the trainer's ed25519 key, which signs every version.
//! - [`refusal_log`]: how many log lines the refusals of strangers may cause.

pub mod certs;
mod files;
pub mod identity;
pub mod refusal_log;
pub mod signing;
pub mod tls;

use std::path::PathBuf;

pub use certs::{FleetCa, NodeCertificate, NodeFiles};
pub use identity::{Identity, IdentityError, Role};
pub use refusal_log::{Admission, RefusalLog};
pub use tls::{NodeTls, TlsFiles, peer_identity};

impl From<files::FileError> for TrustError {
    fn from(files::FileError { path, error }: files::FileError) -> TrustError {
        TrustError::Io {
            path,
            source: error,
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
    #[error("{} exists already: a fleet CA is never overwritten (every certificate it issued would stop verifying)", .0.display())]
    Exists(PathBuf),
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
