//! The fleet's certificate authority and the node certificates it issues
//! (docs/security.md §2).
//!
//! A fleet has one CA: `ca.pem` (its certificate, given to every node) and `ca.key` (kept
//! by whoever issues certificates, mode 0600). A node certificate carries the node's
//! identity (role, id and region; [`crate::identity`]) and may serve and connect: a
//! relay does both. Keys are ECDSA P-256.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::{Duration, OffsetDateTime};

use crate::TrustError;
use crate::files::{self, Access};
use crate::identity::Identity;

/// The CA certificate's file in a fleet directory.
pub const CA_CERT: &str = "ca.pem";
/// The CA key's file in a fleet directory.
pub const CA_KEY: &str = "ca.key";
/// How long a CA is valid.
const CA_VALIDITY: Duration = Duration::days(10 * 365);
/// Certificates start being valid a little before they are issued, so a peer whose clock
/// is slightly behind accepts a fresh one.
const CLOCK_SKEW: Duration = Duration::minutes(5);

/// A fleet's certificate authority, able to issue certificates.
pub struct FleetCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

/// A node's certificate and key, in PEM.
pub struct NodeCertificate {
    pub identity: Identity,
    pub cert_pem: String,
    pub key_pem: String,
}

/// The files of one node's certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl NodeFiles {
    /// `<id>.pem` and `<id>.key` in `dir`.
    pub fn in_dir(dir: &Path, id: &str) -> NodeFiles {
        NodeFiles {
            cert: dir.join(format!("{id}.pem")),
            key: dir.join(format!("{id}.key")),
        }
    }
}

impl FleetCa {
    /// A new CA named `name`.
    pub fn create(name: &str) -> Result<FleetCa, TrustError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} fleet CA"));
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - CLOCK_SKEW;
        params.not_after = now + CA_VALIDITY;
        let cert = params.self_signed(&key)?;
        Ok(FleetCa {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// Writes `ca.pem` and `ca.key` into `dir` (created if needed), refusing to
    /// overwrite a CA already there: every certificate it issued would stop verifying.
    pub fn save(&self, dir: &Path) -> Result<(), TrustError> {
        std::fs::create_dir_all(dir).map_err(|source| TrustError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let cert = dir.join(CA_CERT);
        if cert.exists() {
            return Err(TrustError::Exists(cert));
        }
        files::write(
            &dir.join(CA_KEY),
            self.issuer.key().serialize_pem().as_bytes(),
            Access::Secret,
        )?;
        Ok(files::write(
            &cert,
            self.cert_pem.as_bytes(),
            Access::Public,
        )?)
    }

    /// The CA in `dir`, as [`FleetCa::save`] wrote it.
    pub fn load(dir: &Path) -> Result<FleetCa, TrustError> {
        let cert_path = dir.join(CA_CERT);
        let key_path = dir.join(CA_KEY);
        let cert_pem = read_text(&cert_path)?;
        let key = KeyPair::from_pem(&read_text(&key_path)?).map_err(|source| {
            TrustError::Certificate {
                path: key_path.clone(),
                source,
            }
        })?;
        let issuer =
            Issuer::from_ca_cert_pem(&cert_pem, key).map_err(|source| TrustError::Certificate {
                path: cert_path,
                source,
            })?;
        Ok(FleetCa { issuer, cert_pem })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate for `identity`, valid from now (less a few minutes of clock skew)
    /// for `validity`.
    pub fn issue(
        &self,
        identity: &Identity,
        validity: Duration,
    ) -> Result<NodeCertificate, TrustError> {
        let now = OffsetDateTime::now_utc();
        self.issue_between(identity, now - CLOCK_SKEW, now + validity)
    }

    /// A certificate valid from `not_before` to `not_after`: tests issue expired ones.
    pub fn issue_between(
        &self,
        identity: &Identity,
        not_before: OffsetDateTime,
        not_after: OffsetDateTime,
    ) -> Result<NodeCertificate, TrustError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, identity.id.clone());
        params.subject_alt_names = vec![SanType::URI(identity.uri().try_into()?)];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        // Every node may serve (a relay serves its actors) and connect.
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.not_before = not_before;
        params.not_after = not_after;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(NodeCertificate {
            identity: identity.clone(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// A PEM file's text.
fn read_text(path: &Path) -> Result<String, TrustError> {
    String::from_utf8(files::read(path)?).map_err(|_| TrustError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, "not a PEM file (not text)"),
    })
}

impl NodeCertificate {
    /// Writes the certificate and its key (mode 0600).
    pub fn save(&self, files: &NodeFiles) -> Result<(), TrustError> {
        files::write(&files.key, self.key_pem.as_bytes(), Access::Secret)?;
        Ok(files::write(
            &files.cert,
            self.cert_pem.as_bytes(),
            Access::Public,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::identity::Role;

    #[test]
    fn a_saved_ca_issues_certificates_that_carry_the_identity_and_keys_are_private() {
        let dir = tempfile::tempdir().unwrap();
        FleetCa::create("test").unwrap().save(dir.path()).unwrap();
        let mode = |name: &str| {
            std::fs::metadata(dir.path().join(name))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode(CA_KEY), 0o600);
        assert!(matches!(
            FleetCa::create("again").unwrap().save(dir.path()),
            Err(TrustError::Exists(_))
        ));

        let ca = FleetCa::load(dir.path()).unwrap();
        let identity = Identity::new(Role::Actor, "actor-7", "us").unwrap();
        let node = ca.issue(&identity, Duration::days(1)).unwrap();
        let files = NodeFiles::in_dir(dir.path(), "actor-7");
        node.save(&files).unwrap();
        assert_eq!(mode("actor-7.key"), 0o600);

        let der = crate::tls::read_certificates(&files.cert).unwrap();
        assert_eq!(Identity::from_certificate(&der[0]).unwrap(), identity);
    }
}
