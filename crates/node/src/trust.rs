//! How a node proves who it is, one setting for both planes: the fleet's certificates
//! (mutual TLS 1.3 on the segment transport and on the control API, docs/security.md),
//! or plaintext with the fleet token, asked for by name. The CLI's flags and the Python
//! classes' arguments both come down to a [`NodeTrust`], so every face of a node runs
//! the same rules.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use aurora_proto::{Identity, Role};
use aurora_trust::{NodeTls, PlaintextReach, TlsFiles, TrustError};

use crate::{ControlSecurity, NodeError};

#[derive(Clone)]
pub enum NodeTrust {
    /// The node's certificate and key, and the fleet CA its peers' certificates must
    /// chain to. The certificate names the node's role, id and region.
    Certificates(Arc<NodeTls>),
    /// INSECURE: plain TCP and HTTP, peers authenticated by the shared fleet token.
    /// Anyone on the path reads the weights and the tokens, replays requests and can
    /// impersonate a node. For loopback and closed test networks only: the node listens
    /// on and dials only the addresses `reach` allows.
    InsecurePlaintext {
        fleet_token: String,
        reach: PlaintextReach,
    },
}

impl NodeTrust {
    /// The certificates in `files`.
    pub fn load(files: &TlsFiles) -> Result<NodeTrust, TrustError> {
        Ok(NodeTrust::Certificates(Arc::new(NodeTls::load(files)?)))
    }

    /// Plaintext with `fleet_token`, which must not be empty (it would let anyone in),
    /// within `reach`: loopback, unless the network between the nodes is closed.
    pub fn insecure_plaintext(
        fleet_token: impl Into<String>,
        reach: PlaintextReach,
    ) -> Result<NodeTrust, NodeError> {
        let fleet_token = fleet_token.into();
        if fleet_token.is_empty() {
            return Err(NodeError::EmptyFleetToken);
        }
        tracing::warn!(
            ?reach,
            "insecure plaintext: weights, tokens and control calls cross the network in clear"
        );
        Ok(NodeTrust::InsecurePlaintext { fleet_token, reach })
    }

    /// Whether this node may listen on, or dial, `address` (`what` names it): any over
    /// TLS; in plaintext, what its reach allows.
    pub fn check_address(&self, what: &'static str, address: SocketAddr) -> Result<(), NodeError> {
        match self {
            NodeTrust::Certificates(_) => Ok(()),
            NodeTrust::InsecurePlaintext { reach, .. } => Ok(reach.check(what, address)?),
        }
    }

    /// The segment transport's security.
    pub fn transport(&self) -> aurora_transport::Security {
        match self {
            NodeTrust::Certificates(tls) => aurora_transport::Security::Tls(Arc::clone(tls)),
            NodeTrust::InsecurePlaintext { fleet_token, reach } => {
                aurora_transport::Security::InsecurePlaintext {
                    token: fleet_token.as_bytes().to_vec(),
                    reach: *reach,
                }
            }
        }
    }

    /// How a trainer node serves the control plane: its certificate must be a trainer's.
    pub fn control_server(&self) -> Result<aurora_hub::Security, NodeError> {
        let security = match self {
            NodeTrust::Certificates(tls) => aurora_hub::Security::mutual_tls(tls),
            NodeTrust::InsecurePlaintext { fleet_token, .. } => {
                aurora_hub::Security::insecure_plaintext(fleet_token)
            }
        };
        security.map_err(|error| NodeError::Security {
            what: "serving the control plane",
            reason: error.to_string(),
        })
    }

    /// How a node calls the control plane.
    pub fn control_client(&self) -> Result<ControlSecurity, NodeError> {
        match self {
            NodeTrust::Certificates(tls) => {
                ControlSecurity::mutual_tls(tls).map_err(|error| NodeError::Security {
                    what: "calling the control plane",
                    reason: error.to_string(),
                })
            }
            NodeTrust::InsecurePlaintext { fleet_token, .. } => {
                Ok(ControlSecurity::InsecurePlaintext {
                    fleet_token: fleet_token.clone(),
                })
            }
        }
    }

    /// The identity of a node of `role` that may name its `id` and `region`: with
    /// certificates the certificate's, which must be of that role and which the names,
    /// where given, must repeat; in plaintext the names (the id is required, the region
    /// is "default" when unnamed).
    pub fn identity_as(
        &self,
        role: Role,
        id: Option<String>,
        region: Option<String>,
    ) -> Result<Identity, NodeError> {
        match self.transport().certified_identity() {
            Some(certified) => {
                let certified = certified?;
                if certified.role != role
                    || id.as_ref().is_some_and(|id| *id != certified.peer_id)
                    || region.as_ref().is_some_and(|r| *r != certified.region)
                {
                    return Err(NodeError::NotThisNode {
                        certified,
                        role,
                        id,
                        region,
                    });
                }
                Ok(certified)
            }
            None => Ok(Identity {
                role,
                peer_id: id.ok_or(NodeError::NoId { role })?,
                region: region.unwrap_or_else(|| "default".into()),
            }),
        }
    }

    /// The node's identity on the segment protocol: its certificate's, or `plaintext`
    /// where it has none.
    pub fn identity(&self, plaintext: Identity) -> Result<Identity, NodeError> {
        self.transport()
            .certified_identity()
            .unwrap_or(Ok(plaintext))
            .map_err(NodeError::from)
    }
}

impl fmt::Debug for NodeTrust {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the token.
        match self {
            NodeTrust::Certificates(tls) => write!(f, "Certificates({})", tls.identity()),
            NodeTrust::InsecurePlaintext { .. } => f.write_str("InsecurePlaintext"),
        }
    }
}
