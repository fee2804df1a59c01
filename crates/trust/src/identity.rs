//! Who a node is: its role, id and region, carried by its certificate (docs/security.md
//! §2) as one URI subject alternative name, `aurora://<role>/<region>/<id>`.
//!
//! A peer's identity is read from the certificate the TLS handshake verified, never from
//! what the peer says in a frame or a request.

use std::fmt;
use std::str::FromStr;

use thiserror::Error;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

/// The URI scheme of an identity.
pub const SCHEME: &str = "aurora://";
/// Longest id or region: the segment protocol's names are at most 64 bytes.
pub const MAX_NAME_BYTES: usize = 64;
/// Ids no node may have: the names of a fleet directory's own files (`ca.pem`,
/// `signing.key`, ...) and of directories.
pub const RESERVED_IDS: [&str; 4] = ["ca", "signing", ".", ".."];

/// What a node may do (docs/security.md §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// The trainer's node: the control plane and the hub the versions start from.
    Trainer,
    /// Forwards versions to the actors of its region.
    Relay,
    /// Generates rollouts.
    Actor,
    /// Reads status and metrics, nothing else.
    Observer,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Trainer, Role::Relay, Role::Actor, Role::Observer];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Trainer => "trainer",
            Role::Relay => "relay",
            Role::Actor => "actor",
            Role::Observer => "observer",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = IdentityError;

    fn from_str(text: &str) -> Result<Role, IdentityError> {
        Role::ALL
            .into_iter()
            .find(|role| role.as_str() == text)
            .ok_or_else(|| IdentityError::UnknownRole(text.to_string()))
    }
}

/// A node's identity as its certificate states it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    pub role: Role,
    pub id: String,
    pub region: String,
}

/// Why a certificate or a name does not give an identity.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum IdentityError {
    #[error("unknown role {0:?}: one of trainer, relay, actor, observer")]
    UnknownRole(String),
    #[error(
        "{what} {value:?} is not a name: 1 to {MAX_NAME_BYTES} bytes of letters, digits, '.', '-' and '_'"
    )]
    BadName { what: &'static str, value: String },
    #[error("not an aurora identity URI (aurora://<role>/<region>/<id>): {0:?}")]
    BadUri(String),
    #[error("the certificate cannot be parsed: {0}")]
    BadCertificate(String),
    #[error(
        "the certificate carries no aurora identity (a URI name aurora://<role>/<region>/<id>)"
    )]
    Missing,
    #[error("{0:?} is reserved (a fleet file's or a directory's name) and is no node's id")]
    Reserved(String),
    #[error(
        "actor id {0:?} is not canonical: an actor's id is its number in decimal, without \
         leading zeros or signs, so that one actor has one spelling"
    )]
    NotCanonical(String),
    #[error("the certificate carries {0} aurora identities; a node has exactly one")]
    Ambiguous(usize),
    #[error("the peer presented no certificate")]
    NoCertificate,
}

impl Identity {
    /// An identity with checked names: every id has one spelling (an actor's is its
    /// number, [`canonical_actor_id`]), and none is [`RESERVED_IDS`].
    pub fn new(role: Role, id: &str, region: &str) -> Result<Identity, IdentityError> {
        check_name("id", id)?;
        check_name("region", region)?;
        if RESERVED_IDS.contains(&id) {
            return Err(IdentityError::Reserved(id.to_string()));
        }
        if role == Role::Actor {
            canonical_actor_id(id)?;
        }
        Ok(Identity {
            role,
            id: id.to_string(),
            region: region.to_string(),
        })
    }

    /// The URI a certificate carries.
    pub fn uri(&self) -> String {
        format!("{SCHEME}{}/{}/{}", self.role, self.region, self.id)
    }

    pub fn from_uri(uri: &str) -> Result<Identity, IdentityError> {
        let bad = || IdentityError::BadUri(uri.to_string());
        let rest = uri.strip_prefix(SCHEME).ok_or_else(bad)?;
        let mut parts = rest.split('/');
        let (Some(role), Some(region), Some(id), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        Identity::new(role.parse()?, id, region)
    }

    /// The identity in a DER certificate (the end entity of a verified chain).
    pub fn from_certificate(der: &[u8]) -> Result<Identity, IdentityError> {
        let (_, certificate) = X509Certificate::from_der(der)
            .map_err(|e| IdentityError::BadCertificate(e.to_string()))?;
        let names = certificate
            .subject_alternative_name()
            .map_err(|e| IdentityError::BadCertificate(e.to_string()))?;
        let uris: Vec<&str> = names
            .iter()
            .flat_map(|extension| extension.value.general_names.iter())
            .filter_map(|name| match name {
                GeneralName::URI(uri) if uri.starts_with(SCHEME) => Some(*uri),
                _ => None,
            })
            .collect();
        match uris.as_slice() {
            [] => Err(IdentityError::Missing),
            [uri] => Identity::from_uri(uri),
            more => Err(IdentityError::Ambiguous(more.len())),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} ({})", self.role, self.id, self.region)
    }
}

/// The number an actor's id spells, which must be its only spelling: decimal digits
/// without a leading zero (`0` itself excepted), so `042` and `+42` are no actor's ids.
pub fn canonical_actor_id(id: &str) -> Result<u64, IdentityError> {
    let canonical = !id.is_empty()
        && id.bytes().all(|b| b.is_ascii_digit())
        && (id == "0" || !id.starts_with('0'));
    canonical
        .then(|| id.parse().ok())
        .flatten()
        .ok_or_else(|| IdentityError::NotCanonical(id.to_string()))
}

fn check_name(what: &'static str, value: &str) -> Result<(), IdentityError> {
    let valid = !value.is_empty()
        && value.len() <= MAX_NAME_BYTES
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
    if valid {
        Ok(())
    } else {
        Err(IdentityError::BadName {
            what,
            value: value.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_round_trips_through_its_uri() {
        let identity = Identity::new(Role::Relay, "relay-eu.1", "eu_west").unwrap();
        assert_eq!(identity.uri(), "aurora://relay/eu_west/relay-eu.1");
        let identity = Identity::new(Role::Actor, "42", "us").unwrap();
        assert_eq!(Identity::from_uri(&identity.uri()).unwrap(), identity);
        let identity = Identity::new(Role::Relay, "relay-eu.1", "eu_west").unwrap();
        assert_eq!(identity.uri(), "aurora://relay/eu_west/relay-eu.1");
        assert_eq!(Identity::from_uri(&identity.uri()).unwrap(), identity);
    }

    #[test]
    fn malformed_names_and_uris_are_refused_naming_the_part() {
        assert!(matches!(
            Identity::new(Role::Actor, "a/b", "us"),
            Err(IdentityError::BadName { what: "id", .. })
        ));
        assert!(matches!(
            Identity::new(Role::Actor, "a", ""),
            Err(IdentityError::BadName { what: "region", .. })
        ));
        assert!(matches!(
            Identity::new(Role::Actor, &"x".repeat(65), "us"),
            Err(IdentityError::BadName { .. })
        ));
        for uri in [
            "https://actor/us/a",
            "aurora://actor/us",
            "aurora://actor/us/a/b",
        ] {
            assert!(
                matches!(Identity::from_uri(uri), Err(IdentityError::BadUri(_))),
                "{uri}"
            );
        }
        assert_eq!(
            Identity::from_uri("aurora://admin/us/a"),
            Err(IdentityError::UnknownRole("admin".into()))
        );
    }

    #[test]
    fn an_actor_has_one_spelling_and_reserved_names_are_no_one_s() {
        assert!(Identity::new(Role::Actor, "+42", "us").is_err());
        for id in ["042", "00", "4a", "18446744073709551616"] {
            assert_eq!(
                Identity::new(Role::Actor, id, "us"),
                Err(IdentityError::NotCanonical(id.into())),
                "{id}"
            );
            // A certificate that carries one names no identity.
            let uri = format!("aurora://actor/us/{id}");
            assert!(Identity::from_uri(&uri).is_err(), "{uri}");
        }
        assert_eq!(canonical_actor_id("0"), Ok(0));
        assert_eq!(canonical_actor_id("42"), Ok(42));
        // Other roles' ids are names, compared as they are spelled.
        assert!(Identity::new(Role::Relay, "042", "us").is_ok());
        for id in RESERVED_IDS {
            for role in Role::ALL {
                assert_eq!(
                    Identity::new(role, id, "us"),
                    Err(IdentityError::Reserved(id.into()))
                );
            }
        }
    }
}
