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

impl Auth {
    /// Whether `hello`, received on a connection whose peer the transport verified as
    /// `certified` (none over plaintext), may subscribe; the error says why not, naming
    /// both identities where they differ.
    pub fn check(&self, certified: Option<&Identity>, hello: &Hello) -> Result<(), String> {
        let expected = match self {
            Auth::Certificate => return check_certified(certified, hello),
            Auth::Shared(secret) => secret,
            Auth::PerPeer(peers) => match peers.get(&hello.peer_id) {
                Some(secret) => secret,
                None => return Err(format!("peer '{}' is unknown", hello.peer_id)),
            },
        };
        if constant_time_eq(expected, &hello.token) {
            Ok(())
        } else {
            Err(format!("the token is wrong for peer '{}'", hello.peer_id))
        }
    }
}

fn check_certified(certified: Option<&Identity>, hello: &Hello) -> Result<(), String> {
    let Some(certified) = certified else {
        return Err(format!(
            "peer '{}' has no certificate: this upstream authenticates peers by TLS",
            hello.peer_id
        ));
    };
    if certified.peer_id != hello.peer_id || certified.role != hello.role {
        return Err(format!(
            "the Hello names {} '{}' but the connection's certificate is {} '{}'",
            hello.role, hello.peer_id, certified.role, certified.peer_id
        ));
    }
    if !matches!(certified.role, Role::Relay | Role::Actor) {
        return Err(format!(
            "{} '{}' may not subscribe: only relays and actors do",
            certified.role, certified.peer_id
        ));
    }
    Ok(())
}

/// Compares the tokens' hashes: `blake3::Hash` compares in constant time, and hashing
/// first hides the length too (the hub checks its tokens the same way).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    blake3::hash(a) == blake3::hash(b)
}
