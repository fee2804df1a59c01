//! TLS 1.3 with mutual authentication against the fleet CA (docs/security.md §2).
//!
//! Both sides of every connection present a certificate the fleet CA issued. A server
//! (a hub, a relay, the control plane) requires one from every client; a client verifies
//! the server's chain and then its *role*, before it sends a byte: a downstream talks
//! only to a trainer or a relay, whatever address it dialled. Certificates are bound to
//! identities, not to host names (nodes dial addresses the control plane hands out), so
//! the client's check replaces the host-name check with the role check.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, OtherError, RootCertStore, ServerConfig,
    SignatureScheme,
};

use crate::TrustError;
use crate::identity::{Identity, IdentityError, Role};

/// ALPN of the segment protocol, version 2: a client of another protocol (an HTTP client
/// dialling the segment port) fails the handshake instead of sending a confusing frame.
pub const SEGMENT_ALPN: &[u8] = b"aurora-segments/2";
/// ALPN of the control API.
pub const CONTROL_ALPN: &[u8] = b"http/1.1";
/// The name a client puts in its hello. Servers are recognised by their certificate's
/// identity, not by a host name.
pub const SERVER_NAME: &str = "aurora.invalid";

/// Where a node's trust material is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The fleet CA's certificate.
    pub ca: PathBuf,
    /// The node's certificate (chain), PEM.
    pub cert: PathBuf,
    /// The node's private key, PEM.
    pub key: PathBuf,
}

/// A node's TLS material: its identity, certificate and key, and the fleet CA.
pub struct NodeTls {
    identity: Identity,
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    provider: Arc<CryptoProvider>,
}

impl std::fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTls")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl NodeTls {
    pub fn load(files: &TlsFiles) -> Result<NodeTls, TrustError> {
        let ca = read_certificates(&files.ca)?;
        let chain = read_certificates(&files.cert)?;
        let key = PrivateKeyDer::from_pem_slice(&crate::files::read_secret(&files.key)?).map_err(
            |source| TrustError::Pem {
                path: files.key.clone(),
                source,
            },
        )?;
        NodeTls::new(ca, chain, key).map_err(|error| match error {
            TrustError::Identity(source) => TrustError::NodeCertificate {
                path: files.cert.clone(),
                source,
            },
            other => other,
        })
    }

    /// From PEM text: the fleet CA's certificate, the node's certificate and its key.
    pub fn from_pem(ca: &str, cert: &str, key: &str) -> Result<NodeTls, TrustError> {
        let parse = |pem: &str| {
            CertificateDer::pem_slice_iter(pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|source| TrustError::Pem {
                    path: PathBuf::from("<memory>"),
                    source,
                })
        };
        let key =
            PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|source| TrustError::Pem {
                path: PathBuf::from("<memory>"),
                source,
            })?;
        NodeTls::new(parse(ca)?, parse(cert)?, key)
    }

    fn new(
        ca: Vec<CertificateDer<'static>>,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Result<NodeTls, TrustError> {
        let mut roots = RootCertStore::empty();
        for cert in ca {
            roots.add(cert)?;
        }
        let leaf = chain.first().ok_or(IdentityError::NoCertificate)?;
        let identity = Identity::from_certificate(leaf)?;
        Ok(NodeTls {
            identity,
            roots: Arc::new(roots),
            chain,
            key,
            provider: Arc::new(rustls::crypto::ring::default_provider()),
        })
    }

    /// Who this node is, as its certificate says.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// A server that requires a certificate from the fleet CA of every client.
    pub fn server_config(&self, alpn: &[u8]) -> Result<Arc<ServerConfig>, TrustError> {
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), self.provider.clone())
                .build()?;
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())?;
        config.alpn_protocols = vec![alpn.to_vec()];
        Ok(Arc::new(config))
    }

    /// A client that presents this node's certificate and accepts only a server whose
    /// certificate the fleet CA issued to one of `servers`.
    pub fn client_config(
        &self,
        alpn: &[u8],
        servers: &[Role],
    ) -> Result<Arc<ClientConfig>, TrustError> {
        let verifier = FleetServerVerifier {
            roots: self.roots.clone(),
            algorithms: self.provider.signature_verification_algorithms,
            servers: servers.to_vec(),
        };
        let mut config = ClientConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())?;
        config.alpn_protocols = vec![alpn.to_vec()];
        Ok(Arc::new(config))
    }
}

/// The name a client sends: see [`SERVER_NAME`].
pub fn server_name() -> ServerName<'static> {
    ServerName::try_from(SERVER_NAME).expect("a valid DNS name")
}

/// The identity of a peer whose chain the handshake verified: the end entity of
/// `certificates` (what `rustls` reports as the peer's certificates).
pub fn peer_identity(
    certificates: Option<&[CertificateDer<'_>]>,
) -> Result<Identity, IdentityError> {
    let leaf = certificates
        .and_then(|chain| chain.first())
        .ok_or(IdentityError::NoCertificate)?;
    Identity::from_certificate(leaf)
}

/// Every certificate in a PEM file.
pub fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TrustError> {
    let certificates = CertificateDer::pem_file_iter(path)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TrustError::Pem {
            path: path.to_path_buf(),
            source,
        })?;
    if certificates.is_empty() {
        return Err(TrustError::NoCertificate(path.to_path_buf()));
    }
    Ok(certificates)
}

/// Verifies a server's chain against the fleet CA (validity dates included), then that
/// its certificate names an allowed role.
#[derive(Debug)]
struct FleetServerVerifier {
    roots: Arc<RootCertStore>,
    algorithms: WebPkiSupportedAlgorithms,
    servers: Vec<Role>,
}

impl ServerCertVerifier for FleetServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.algorithms.all,
        )?;
        let identity = Identity::from_certificate(end_entity).map_err(refusal)?;
        if !self.servers.contains(&identity.role) {
            return Err(refusal(UnexpectedRole {
                identity,
                expected: self.servers.clone(),
            }));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// A server whose certificate is valid but whose role may not serve this client.
#[derive(Debug, thiserror::Error)]
#[error(
    "the server is {identity}, and only {} may serve here",
    roles(expected)
)]
pub struct UnexpectedRole {
    pub identity: Identity,
    pub expected: Vec<Role>,
}

fn roles(roles: &[Role]) -> String {
    roles
        .iter()
        .map(|r| r.as_str())
        .collect::<Vec<_>>()
        .join(" or ")
}

/// A handshake's error for a log line: rustls prints the errors a verifier adds with
/// their `Debug` form, this with their message.
pub fn explain(error: &rustls::Error) -> String {
    match error {
        rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(inner))) => {
            format!("invalid peer certificate: {inner}")
        }
        other => other.to_string(),
    }
}

fn refusal(error: impl std::error::Error + Send + Sync + 'static) -> rustls::Error {
    rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(error))))
}

#[cfg(test)]
mod tests {
    use rustls::{ClientConnection, ServerConnection};
    use time::{Duration, OffsetDateTime};

    use super::*;
    use crate::FleetCa;

    fn node(ca: &FleetCa, role: Role, id: &str) -> NodeTls {
        let identity = Identity::new(role, id, "us").unwrap();
        let cert = ca.issue(&identity, Duration::days(1)).unwrap();
        NodeTls::from_pem(ca.cert_pem(), &cert.cert_pem, &cert.key_pem).unwrap()
    }

    /// Runs a handshake in memory; the first side's error ends it.
    fn handshake(
        client: &NodeTls,
        server: &NodeTls,
        servers: &[Role],
    ) -> Result<(Identity, Identity), rustls::Error> {
        let mut client = ClientConnection::new(
            client.client_config(SEGMENT_ALPN, servers).unwrap(),
            server_name(),
        )?;
        let mut server = ServerConnection::new(server.server_config(SEGMENT_ALPN).unwrap())?;
        while client.is_handshaking() || server.is_handshaking() {
            let mut wire = Vec::new();
            client.write_tls(&mut wire).unwrap();
            server.read_tls(&mut wire.as_slice()).unwrap();
            server.process_new_packets()?;
            wire.clear();
            server.write_tls(&mut wire).unwrap();
            client.read_tls(&mut wire.as_slice()).unwrap();
            client.process_new_packets()?;
        }
        Ok((
            peer_identity(server.peer_certificates()).unwrap(),
            peer_identity(client.peer_certificates()).unwrap(),
        ))
    }

    #[test]
    fn both_sides_learn_the_other_s_identity_from_its_certificate() {
        let ca = FleetCa::create("test").unwrap();
        let actor = node(&ca, Role::Actor, "1");
        let relay = node(&ca, Role::Relay, "r1");
        let (client_seen, server_seen) =
            handshake(&actor, &relay, &[Role::Trainer, Role::Relay]).unwrap();
        assert_eq!(&client_seen, actor.identity());
        assert_eq!(&server_seen, relay.identity());
    }

    #[test]
    fn a_client_refuses_a_server_of_a_role_it_does_not_talk_to() {
        let ca = FleetCa::create("test").unwrap();
        let actor = node(&ca, Role::Actor, "1");
        let impostor = node(&ca, Role::Actor, "2");
        let error = handshake(&actor, &impostor, &[Role::Trainer, Role::Relay]).unwrap_err();
        assert_eq!(
            explain(&error),
            "invalid peer certificate: the server is actor 2 (us), and only trainer or relay \
             may serve here"
        );
    }

    #[test]
    fn certificates_of_another_ca_are_refused_both_ways() {
        let ours = FleetCa::create("ours").unwrap();
        let theirs = FleetCa::create("theirs").unwrap();
        let actor = node(&ours, Role::Actor, "1");
        let relay = node(&ours, Role::Relay, "r1");
        let foreign_actor = node(&theirs, Role::Actor, "1");
        let foreign_relay = node(&theirs, Role::Relay, "r1");
        let error = handshake(&foreign_actor, &relay, &[Role::Relay]).unwrap_err();
        assert!(
            matches!(error, rustls::Error::InvalidCertificate(_)),
            "{error}"
        );
        let error = handshake(&actor, &foreign_relay, &[Role::Relay]).unwrap_err();
        assert!(
            matches!(error, rustls::Error::InvalidCertificate(_)),
            "{error}"
        );
    }

    #[test]
    fn an_expired_certificate_is_refused() {
        let ca = FleetCa::create("test").unwrap();
        let relay = node(&ca, Role::Relay, "r1");
        let now = OffsetDateTime::now_utc();
        let identity = Identity::new(Role::Actor, "1", "us").unwrap();
        let expired = ca
            .issue_between(&identity, now - Duration::days(2), now - Duration::days(1))
            .unwrap();
        let actor = NodeTls::from_pem(ca.cert_pem(), &expired.cert_pem, &expired.key_pem).unwrap();
        let error = handshake(&actor, &relay, &[Role::Relay]).unwrap_err();
        assert!(
            matches!(
                error,
                rustls::Error::InvalidCertificate(CertificateError::ExpiredContext { .. })
            ),
            "{error}"
        );
    }
}
