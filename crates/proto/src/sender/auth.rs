//! Who may subscribe: the authentication of a Hello, apart from the protocol so that the
//! rule (and its constant-time comparison) is read in one place.

use std::collections::BTreeMap;

use crate::Identity;
use crate::frame::{Hello, Role};

/// Who may connect.
#[derive(Clone)]
pub enum Auth {
    /// Peers are authenticated by the certificate their TLS handshake verified
    /// (docs/wire-protocol.md §2.1): the driver hands the sender that identity with the
    /// connection, a Hello must name it (id and role), and only relays and actors may
    /// subscribe. The Hello's token is ignored.
    Certificate,
    /// Plaintext only: one secret for every peer, compared in constant time.
    Shared(Vec<u8>),
    /// Plaintext only: a secret per peer id, compared in constant time.
    PerPeer(BTreeMap<String, Vec<u8>>),
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Auth::Certificate => f.write_str("Auth::Certificate"),
            Auth::Shared(_) => f.write_str("Auth::Shared(..)"),
            Auth::PerPeer(peers) => write!(f, "Auth::PerPeer({:?})", peers.keys()),
        }
    }
}

/// Why a Hello may not subscribe. Its text is what the Reject frame carries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthRefusal {
    /// A per-peer secret was expected, and the peer has none.
    #[error("peer '{peer}' is unknown")]
    UnknownPeer { peer: String },
    /// The Hello's token is not the peer's secret.
    #[error("the token is wrong for peer '{peer}'")]
    WrongToken { peer: String },
    /// The upstream authenticates by TLS and the connection verified no certificate.
    #[error("peer '{peer}' has no certificate: this upstream authenticates peers by TLS")]
    NoCertificate { peer: String },
    /// The Hello names someone other than the connection's certificate.
    #[error(
        "the Hello names {named_role} '{named}' but the connection's certificate is {certified_role} '{certified}'"
    )]
    NotTheCertificate {
        named_role: Role,
        named: String,
        certified_role: Role,
        certified: String,
    },
    /// The certificate's role does not subscribe (a hub, a trainer).
    #[error("{role} '{peer}' may not subscribe: only relays and actors do")]
    RoleMayNotSubscribe { role: Role, peer: String },
}

impl Auth {
    /// Whether `hello`, received on a connection whose peer the transport verified as
    /// `certified` (none over plaintext), may subscribe.
    pub fn check(&self, certified: Option<&Identity>, hello: &Hello) -> Result<(), AuthRefusal> {
        let expected = match self {
            Auth::Certificate => return check_certified(certified, hello),
            Auth::Shared(secret) => secret,
            Auth::PerPeer(peers) => match peers.get(&hello.peer_id) {
                Some(secret) => secret,
                None => {
                    return Err(AuthRefusal::UnknownPeer {
                        peer: hello.peer_id.clone(),
                    });
                }
            },
        };
        if constant_time_eq(expected, &hello.token) {
            Ok(())
        } else {
            Err(AuthRefusal::WrongToken {
                peer: hello.peer_id.clone(),
            })
        }
    }
}

fn check_certified(certified: Option<&Identity>, hello: &Hello) -> Result<(), AuthRefusal> {
    let Some(certified) = certified else {
        return Err(AuthRefusal::NoCertificate {
            peer: hello.peer_id.clone(),
        });
    };
    if certified.peer_id != hello.peer_id || certified.role != hello.role {
        return Err(AuthRefusal::NotTheCertificate {
            named_role: hello.role,
            named: hello.peer_id.clone(),
            certified_role: certified.role,
            certified: certified.peer_id.clone(),
        });
    }
    if !matches!(certified.role, Role::Relay | Role::Actor) {
        return Err(AuthRefusal::RoleMayNotSubscribe {
            role: certified.role,
            peer: certified.peer_id.clone(),
        });
    }
    Ok(())
}

/// Compares the tokens' hashes: `blake3::Hash` compares in constant time, and hashing
/// first hides the length too (the hub checks its tokens the same way).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    blake3::hash(a) == blake3::hash(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{TOKEN, hello, identity};

    #[test]
    fn each_refusal_names_what_was_wrong() {
        let a1 = hello(1, 0, 1);
        let shared = Auth::Shared(TOKEN.to_vec());
        assert_eq!(shared.check(None, &a1), Ok(()));
        let wrong = Hello {
            token: b"guess".to_vec(),
            ..a1.clone()
        };
        assert_eq!(
            shared.check(None, &wrong),
            Err(AuthRefusal::WrongToken { peer: "a1".into() })
        );
        let per_peer = Auth::PerPeer(BTreeMap::from([("a2".to_owned(), TOKEN.to_vec())]));
        assert_eq!(
            per_peer.check(None, &a1),
            Err(AuthRefusal::UnknownPeer { peer: "a1".into() })
        );
        let tls = Auth::Certificate;
        assert_eq!(
            tls.check(None, &a1),
            Err(AuthRefusal::NoCertificate { peer: "a1".into() })
        );
        assert_eq!(tls.check(Some(&identity(Role::Actor, "a1")), &a1), Ok(()));
        assert_eq!(
            tls.check(Some(&identity(Role::Actor, "a2")), &a1),
            Err(AuthRefusal::NotTheCertificate {
                named_role: Role::Actor,
                named: "a1".into(),
                certified_role: Role::Actor,
                certified: "a2".into(),
            })
        );
        let hub = Hello {
            role: Role::Hub,
            peer_id: "hub".into(),
            ..a1
        };
        assert_eq!(
            tls.check(Some(&identity(Role::Hub, "hub")), &hub),
            Err(AuthRefusal::RoleMayNotSubscribe {
                role: Role::Hub,
                peer: "hub".into(),
            })
        );
    }
}
