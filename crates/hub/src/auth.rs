//! Who may call what: the refusals of authentication (401) and authorization (403), and
//! the per-registration actor tokens.
//!
//! Over mutual TLS a peer is who its certificate says (`aurora_trust::Identity`), and its
//! role decides the routes it may call (docs/control-api.md has the matrix). Over
//! insecure plaintext, the fleet token (the hub's configuration) stands for every role
//! but the actor's: it lets a machine register and read the status and metrics.
//!
//! Either way, registering returns a fresh **actor token**, `<actor>.<64 hex digits>`:
//! 256 bits from the operating system's random source behind the actor's id. Every later
//! call of that actor (heartbeat, versions, claim, submit, leave, preempt) must present
//! it, so a re-registration (a new process of the same actor) rotates it and locks the
//! old process out: a call replayed from an earlier registration is refused, even though
//! the old process holds the same certificate.
//!
//! The hub keeps only the BLAKE3 hash of each actor token (a plain hash suffices for
//! a 256-bit random secret; there is nothing to guess), and compares hashes with
//! [`blake3::Hash`]'s constant-time equality, so neither the content nor the length
//! of a presented token changes how long a refusal takes. The id before the dot only
//! says which hash to compare with.

use std::fmt;

use aurora_control::ActorId;
use aurora_trust::{Identity, Role};
use thiserror::Error;

use crate::refusals::RequestRule;

/// Random bytes in an actor token.
const SECRET_BYTES: usize = 32;

/// Why a request was not authenticated. Every variant is a 401.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum AuthError {
    /// No `Authorization: Bearer ...` header.
    #[error("missing bearer token (send `Authorization: Bearer <token>`)")]
    Missing,
    /// The fleet token is wrong.
    #[error("wrong fleet token")]
    WrongFleetToken,
    /// An actor route got something that is not an actor token.
    #[error(
        "not an actor token: actor routes take the `<actor>.<secret>` token that /v1/register returned"
    )]
    MalformedActorToken,
    /// No token is on file for the actor: it never registered, or its registration
    /// ended (left, preempted, timed out).
    #[error("no token is issued to {0}: register first")]
    NotIssued(ActorId),
    /// The token is not the actor's current one (a wrong secret, or one rotated by a
    /// later registration).
    #[error("wrong or outdated token for {0}: register again to get a new one")]
    WrongActorToken(ActorId),
    /// A hub that takes mutual TLS got a request without a verified certificate.
    #[error("no client certificate: this hub takes mutual TLS with the fleet's certificates")]
    NoCertificate,
}

impl AuthError {
    pub(crate) fn rule(self) -> RequestRule {
        match self {
            AuthError::Missing => RequestRule::MissingToken,
            AuthError::WrongFleetToken => RequestRule::WrongFleetToken,
            AuthError::MalformedActorToken => RequestRule::MalformedToken,
            AuthError::NotIssued(_) => RequestRule::TokenNotIssued,
            AuthError::WrongActorToken(_) => RequestRule::OutdatedToken,
            AuthError::NoCertificate => RequestRule::NoCertificate,
        }
    }
}

/// Why an authenticated peer may not make a request. Every variant is a 403.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum Forbidden {
    /// The peer's role may not call the route.
    #[error("{identity} may not {action}: only {} may", roles(allowed))]
    Role {
        identity: Identity,
        /// What the route does, e.g. `register`.
        action: &'static str,
        allowed: &'static [Role],
    },
    /// The request names another actor than the one its proof is for.
    #[error("the {proof} is {holder}'s; it cannot act for {requested}")]
    OtherActor {
        /// `certificate` or `token`.
        proof: &'static str,
        holder: ActorId,
        requested: ActorId,
    },
    /// An actor certificate whose id is not an actor id of the control plane.
    #[error(
        "the certificate's actor id {0:?} is not an actor id of the control plane (its \
         number in decimal, no leading zeros, as `aurora certs issue --role actor --id` takes it)"
    )]
    NotAnActorId(String),
    /// A registration naming another region than the actor's certificate.
    #[error(
        "the certificate puts {actor} in region {certified:?}; it cannot register in {requested:?}"
    )]
    OtherRegion {
        actor: ActorId,
        certified: String,
        requested: String,
    },
}

impl Forbidden {
    pub(crate) fn rule(&self) -> RequestRule {
        match self {
            Forbidden::Role { .. } => RequestRule::Role,
            Forbidden::OtherActor { .. } => RequestRule::OtherActor,
            Forbidden::NotAnActorId(_) => RequestRule::NotAnActorId,
            Forbidden::OtherRegion { .. } => RequestRule::OtherRegion,
        }
    }
}

/// The actor an actor certificate is for: its id is the actor's id in the control plane,
/// in its one spelling (a certificate naming `042` acts for no actor, not for 42).
pub(crate) fn certified_actor(identity: &Identity) -> Result<ActorId, Forbidden> {
    aurora_trust::canonical_actor_id(&identity.id)
        .map(ActorId)
        .map_err(|_| Forbidden::NotAnActorId(identity.id.clone()))
}

fn roles(roles: &[Role]) -> String {
    let names: Vec<String> = roles.iter().map(|role| format!("{role}s")).collect();
    match names.as_slice() {
        [] => "nobody".into(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

/// A freshly issued actor token. Only its hash is stored; this is the one copy, to be
/// returned to the actor. `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub struct ActorToken(String);

impl ActorToken {
    /// A new random token for `actor`.
    pub(crate) fn generate(actor: ActorId) -> Result<ActorToken, getrandom::Error> {
        let mut secret = [0u8; SECRET_BYTES];
        getrandom::fill(&mut secret)?;
        let mut text = format!("{}.", actor.0);
        for byte in secret {
            text.push_str(&format!("{byte:02x}"));
        }
        Ok(ActorToken(text))
    }

    /// The token, as the actor must present it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// What the hub stores.
    pub(crate) fn hash(&self) -> blake3::Hash {
        hash_token(self.0.as_bytes())
    }
}

impl fmt::Debug for ActorToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ActorToken(..)")
    }
}

/// The stored form of a token.
pub(crate) fn hash_token(token: &[u8]) -> blake3::Hash {
    blake3::hash(token)
}

/// Checks the fleet token (`presented` is the bearer token, if any) against its hash.
pub(crate) fn authenticate_fleet(
    fleet: &blake3::Hash,
    presented: Option<&[u8]>,
) -> Result<(), AuthError> {
    let presented = presented.ok_or(AuthError::Missing)?;
    // `blake3::Hash` compares in constant time, and hashing first hides the length.
    if hash_token(presented) == *fleet {
        Ok(())
    } else {
        Err(AuthError::WrongFleetToken)
    }
}

/// The actor an actor token claims to be for (the text before the dot); the claim is
/// checked against the stored hash by the caller.
pub(crate) fn claimed_actor(token: &[u8]) -> Result<ActorId, AuthError> {
    let (id, secret) = token
        .iter()
        .position(|&byte| byte == b'.')
        .map(|dot| (&token[..dot], &token[dot + 1..]))
        .ok_or(AuthError::MalformedActorToken)?;
    // One actor, one spelling: `u64::from_str` would also take `+12` and `012`.
    if secret.is_empty() {
        return Err(AuthError::MalformedActorToken);
    }
    std::str::from_utf8(id)
        .ok()
        .and_then(|id| aurora_trust::canonical_actor_id(id).ok())
        .map(ActorId)
        .ok_or(AuthError::MalformedActorToken)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_name_their_actor_and_differ_every_time() {
        let first = ActorToken::generate(ActorId(42)).unwrap();
        let second = ActorToken::generate(ActorId(42)).unwrap();
        assert_ne!(first, second);
        assert_eq!(first.as_str().len(), "42.".len() + 2 * SECRET_BYTES);
        assert_eq!(claimed_actor(first.as_str().as_bytes()), Ok(ActorId(42)));
        assert_ne!(first.hash(), second.hash());
        assert_eq!(format!("{first:?}"), "ActorToken(..)");
    }

    #[test]
    fn malformed_actor_tokens_are_refused() {
        for token in [
            "",
            "s3cret-fleet-token",
            ".abc",
            "12.",
            "+12.abc",
            "012.abc",
            "x.abc",
            "99999999999999999999999.abc",
        ] {
            assert_eq!(
                claimed_actor(token.as_bytes()),
                Err(AuthError::MalformedActorToken),
                "{token:?}"
            );
        }
        assert_eq!(claimed_actor(b"7.anything"), Ok(ActorId(7)));
    }

    #[test]
    fn an_actor_certificate_names_its_actor_in_decimal_digits() {
        // As a certificate of another CA, or an older aurora, might spell it.
        let identity = |id: &str| Identity {
            role: Role::Actor,
            id: id.into(),
            region: "us".into(),
        };
        assert_eq!(certified_actor(&identity("42")), Ok(ActorId(42)));
        for id in ["actor-42", "0x2a", "042", "99999999999999999999999"] {
            assert_eq!(
                certified_actor(&identity(id)),
                Err(Forbidden::NotAnActorId(id.into())),
                "{id}"
            );
        }
        let refused = Forbidden::Role {
            identity: Identity::new(Role::Observer, "dash", "us").unwrap(),
            action: "register",
            allowed: &[Role::Actor],
        };
        assert_eq!(
            refused.to_string(),
            "observer dash (us) may not register: only actors may"
        );
    }
}
