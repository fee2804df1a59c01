//! Who may subscribe: the token check of a Hello, apart from the protocol so that the
//! rule (and its constant-time comparison) is read in one place.

use std::collections::BTreeMap;

/// Who may connect. Tokens are compared in constant time.
#[derive(Clone)]
pub enum Auth {
    /// One secret for every peer.
    Shared(Vec<u8>),
    /// A secret per peer id.
    PerPeer(BTreeMap<String, Vec<u8>>),
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Auth::Shared(_) => f.write_str("Auth::Shared(..)"),
            Auth::PerPeer(peers) => write!(f, "Auth::PerPeer({:?})", peers.keys()),
        }
    }
}

impl Auth {
    pub fn admits(&self, peer_id: &str, token: &[u8]) -> bool {
        let expected = match self {
            Auth::Shared(secret) => secret,
            Auth::PerPeer(peers) => match peers.get(peer_id) {
                Some(secret) => secret,
                None => return false,
            },
        };
        constant_time_eq(expected, token)
    }
}

/// Compares the tokens' hashes: `blake3::Hash` compares in constant time, and hashing
/// first hides the length too (the hub checks its tokens the same way).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    blake3::hash(a) == blake3::hash(b)
}
