//! Bearer tokens: the fleet token, and the per-actor tokens handed out at registration.
//!
//! The fleet token (the hub's configuration) lets a machine register and read the
//! status and metrics. Registering returns a fresh **actor token**, `<actor>.<64 hex
//! digits>`: 256 bits from the operating system's random source behind the actor's id.
//! Every later call of that actor (heartbeat, versions, claim, submit, leave, preempt)
//! must present it, so one actor cannot act for another, and a re-registration (a new
//! process) rotates it, locking the old process out.
//!
//! The hub keeps only the BLAKE3 hash of each actor token (a plain hash suffices for
//! a 256-bit random secret; there is nothing to guess), and compares hashes with
//! [`blake3::Hash`]'s constant-time equality, so neither the content nor the length
//! of a presented token changes how long a refusal takes. The id before the dot only
//! says which hash to compare with.

use std::fmt;

use aurora_control::ActorId;
use thiserror::Error;

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
    /// The request names an actor other than the token's.
    #[error("the token is {token_actor}'s; it cannot act for {requested}")]
    OtherActor {
        /// Whose token was presented.
        token_actor: ActorId,
        /// The actor named in the request.
        requested: ActorId,
    },
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

/// The actor an actor token claims to be for (the text before the dot); the claim is
/// checked against the stored hash by the caller.
pub(crate) fn claimed_actor(token: &[u8]) -> Result<ActorId, AuthError> {
    let (id, secret) = token
        .iter()
        .position(|&byte| byte == b'.')
        .map(|dot| (&token[..dot], &token[dot + 1..]))
        .ok_or(AuthError::MalformedActorToken)?;
    // Digits only: `u64::from_str` would also take a leading `+`, and one actor must
    // have one spelling.
    if id.is_empty() || !id.iter().all(u8::is_ascii_digit) || secret.is_empty() {
        return Err(AuthError::MalformedActorToken);
    }
    std::str::from_utf8(id)
        .ok()
        .and_then(|id| id.parse().ok())
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
}
