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
use crate::files::{self, Access, Replace};
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

/// The subdirectory of a fleet directory that holds the node certificates, apart from
/// the CA's and the signing key's files, so no node's name can ever be one of theirs.
pub const NODES_DIR: &str = "nodes";

/// The files of one node's certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl NodeFiles {
    /// `nodes/<role>-<id>.pem` and `nodes/<role>-<id>.key` in the fleet directory `dir`:
    /// one pair per identity, whatever other roles share its id.
    pub fn of(dir: &Path, identity: &Identity) -> NodeFiles {
        let stem = format!("{}-{}", identity.role, identity.id);
        let nodes = dir.join(NODES_DIR);
        NodeFiles {
            cert: nodes.join(format!("{stem}.pem")),
            key: nodes.join(format!("{stem}.key")),
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
    /// overwrite either: every certificate a CA there issued would stop verifying.
    pub fn save(&self, dir: &Path) -> Result<(), TrustError> {
        create_dir(dir)?;
        for name in [CA_CERT, CA_KEY] {
            if dir.join(name).exists() {
                return Err(TrustError::Exists(dir.join(name)));
            }
        }
        files::write(
            &dir.join(CA_KEY),
            self.issuer.key().serialize_pem().as_bytes(),
            Access::Secret,
            Replace::Never,
        )?;
        Ok(files::write(
            &dir.join(CA_CERT),
            self.cert_pem.as_bytes(),
            Access::Public,
            Replace::Never,
        )?)
    }

    /// The CA in `dir`, as [`FleetCa::save`] wrote it.
    pub fn load(dir: &Path) -> Result<FleetCa, TrustError> {
        let cert_path = dir.join(CA_CERT);
        let key_path = dir.join(CA_KEY);
        let cert_pem = read_text(&cert_path)?;
        let key_pem =
            String::from_utf8(files::read_secret(&key_path)?).map_err(|_| not_text(&key_path))?;
        let key = KeyPair::from_pem(&key_pem).map_err(|source| TrustError::Certificate {
            path: key_path.clone(),
            source,
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
    String::from_utf8(files::read(path)?).map_err(|_| not_text(path))
}

fn not_text(path: &Path) -> TrustError {
    TrustError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, "not a PEM file (not text)"),
    }
}

fn create_dir(dir: &Path) -> Result<(), TrustError> {
    std::fs::create_dir_all(dir).map_err(|source| TrustError::Io {
        path: dir.to_path_buf(),
        source,
    })
}

impl NodeCertificate {
    /// Writes the certificate and its key (mode 0600), creating their directory. With
    /// [`Replace::Never`] neither file may exist yet: a node's key is not replaced by
    /// accident (a second issue for the same identity, say).
    pub fn save(&self, files: &NodeFiles, replace: Replace) -> Result<(), TrustError> {
        for path in [&files.cert, &files.key] {
            if let Some(dir) = path.parent() {
                create_dir(dir)?;
            }
            if replace == Replace::Never && path.exists() {
                return Err(TrustError::Exists(path.clone()));
            }
        }
        files::write(&files.key, self.key_pem.as_bytes(), Access::Secret, replace)?;
        Ok(files::write(
            &files.cert,
            self.cert_pem.as_bytes(),
            Access::Public,
            replace,
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
        let identity = Identity::new(Role::Actor, "7", "us").unwrap();
        let node = ca.issue(&identity, Duration::days(1)).unwrap();
        let files = NodeFiles::of(dir.path(), &identity);
        node.save(&files, Replace::Never).unwrap();
        assert_eq!(mode("nodes/actor-7.key"), 0o600);

        let der = crate::tls::read_certificates(&files.cert).unwrap();
        assert_eq!(Identity::from_certificate(&der[0]).unwrap(), identity);
    }

    #[test]
    fn nothing_is_overwritten_unless_asked_and_exposed_keys_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        FleetCa::create("test").unwrap().save(dir.path()).unwrap();
        let ca_pem = std::fs::read(dir.path().join(CA_CERT)).unwrap();
        // A CA whose certificate was moved away still keeps its key.
        std::fs::rename(dir.path().join(CA_CERT), dir.path().join("moved.pem")).unwrap();
        let error = FleetCa::create("again")
            .unwrap()
            .save(dir.path())
            .unwrap_err();
        assert!(
            matches!(&error, TrustError::Exists(path) if path.ends_with(CA_KEY)),
            "{error}"
        );
        std::fs::rename(dir.path().join("moved.pem"), dir.path().join(CA_CERT)).unwrap();
        assert_eq!(std::fs::read(dir.path().join(CA_CERT)).unwrap(), ca_pem);

        let ca = FleetCa::load(dir.path()).unwrap();
        let identity = Identity::new(Role::Relay, "eu", "eu").unwrap();
        let files = NodeFiles::of(dir.path(), &identity);
        let first = ca.issue(&identity, Duration::days(1)).unwrap();
        first.save(&files, Replace::Never).unwrap();
        let second = ca.issue(&identity, Duration::days(1)).unwrap();
        let error = second.save(&files, Replace::Never).unwrap_err();
        assert!(matches!(error, TrustError::Exists(_)), "{error}");
        assert_eq!(std::fs::read_to_string(&files.key).unwrap(), first.key_pem);
        second.save(&files, Replace::Allowed).unwrap();
        assert_eq!(std::fs::read_to_string(&files.key).unwrap(), second.key_pem);

        // A key others may read is refused, the CA's and a node's alike.
        for key in [dir.path().join(CA_KEY), files.key.clone()] {
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        let error = FleetCa::load(dir.path()).err().expect("an exposed CA key");
        assert!(
            matches!(error, TrustError::Exposed { mode: 0o644, .. }),
            "{error}"
        );
        let tls = crate::TlsFiles {
            ca: dir.path().join(CA_CERT),
            cert: files.cert.clone(),
            key: files.key.clone(),
        };
        let error = crate::NodeTls::load(&tls).unwrap_err();
        assert!(error.to_string().contains("chmod 600"), "{error}");
    }
}
