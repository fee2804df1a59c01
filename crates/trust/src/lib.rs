//! Trust in an aurora fleet (docs/security.md): who a peer is, and who made a version.
//!
//! - [`identity`]: a node's role, id and region, as its certificate carries them.
//! - [`certs`]: the fleet's certificate authority and the node certificates it issues.
//! - [`tls`]: TLS 1.3 configurations with mutual authentication against the fleet CA.
//! - [`signing`]: the trainer's ed25519 key, which signs every version.

pub mod signing;
