//! How a node's segment connections are secured (docs/wire-protocol.md §2.1,
//! docs/security.md §4): mutual TLS 1.3 against the fleet CA, or plaintext behind
//! an explicit insecure setting; the limits on what a stranger can make a node do; and
//! the counts of what was refused.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aurora_proto::{ArtifactKey, Identity, Role};
use aurora_trust::peer_identity;
use aurora_trust::tls::{SEGMENT_ALPN, UnexpectedRole, explain};
use aurora_trust::{Admission, BeyondLoopback, NodeTls, PlaintextReach, RefusalLog, TrustError};
use rustls::{AlertDescription, CertificateError, OtherError};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::conn::Stream;

/// How a node authenticates the peers of its segment connections and proves itself.
#[derive(Clone, Debug)]
pub enum Security {
    /// TLS 1.3, both sides presenting a certificate of the fleet CA. A downstream
    /// verifies that its upstream is a trainer or a relay before it sends a byte; an
    /// upstream binds each Hello to the certificate of its connection. Hellos carry no
    /// token.
    Tls(Arc<NodeTls>),
    /// Plain TCP, peers authenticated by a shared token in their Hello: anyone on the
    /// path reads the weights and the token, and can replay or forge frames. For
    /// loopback tests and closed networks only; a node running so logs a warning, and
    /// listens on and dials only the addresses `reach` allows.
    InsecurePlaintext {
        token: Vec<u8>,
        reach: PlaintextReach,
    },
}

impl Security {
    /// The TLS endpoints of this setting, built once per node.
    pub(crate) fn endpoints(&self) -> Result<Option<TlsEndpoints>, TrustError> {
        let Security::Tls(tls) = self else {
            tracing::warn!(
                "segment connections are INSECURE PLAINTEXT: peers are authenticated by a \
                 shared token anyone on the path can read, and the weights travel in clear"
            );
            return Ok(None);
        };
        Ok(Some(TlsEndpoints {
            acceptor: TlsAcceptor::from(tls.server_config(SEGMENT_ALPN)?),
            connector: TlsConnector::from(tls.client_config(
                SEGMENT_ALPN,
                &[aurora_trust::Role::Trainer, aurora_trust::Role::Relay],
            )?),
        }))
    }

    /// Plaintext on loopback only (tests, one machine).
    pub fn loopback_plaintext(token: &[u8]) -> Security {
        Security::InsecurePlaintext {
            token: token.to_vec(),
            reach: PlaintextReach::Loopback,
        }
    }

    /// Whether a socket of this node may use `address` (`what` names it): any, over TLS;
    /// in plaintext, those its reach allows.
    pub fn check_address(
        &self,
        what: &'static str,
        address: SocketAddr,
    ) -> Result<(), BeyondLoopback> {
        match self {
            Security::Tls(_) => Ok(()),
            Security::InsecurePlaintext { reach, .. } => reach.check(what, address),
        }
    }

    /// The identity this node's certificate gives it on the segment protocol (none in
    /// plaintext), or why it has none (an observer's certificate).
    pub fn certified_identity(&self) -> Option<Result<Identity, NoSegmentRole>> {
        match self {
            Security::Tls(tls) => Some(segment_identity(tls.identity())),
            Security::InsecurePlaintext { .. } => None,
        }
    }
}

/// A node's TLS server and client sides.
#[derive(Clone)]
pub(crate) struct TlsEndpoints {
    pub(crate) acceptor: TlsAcceptor,
    pub(crate) connector: TlsConnector,
}

/// A certificate whose role has no part in the segment protocol (an observer's).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{identity} has no part in the segment protocol: only trainers, relays and actors do")]
pub struct NoSegmentRole {
    /// The certificate's identity, as it prints.
    pub identity: String,
}

/// The identity a certificate gives on the segment protocol: a trainer serves as the
/// hub; an observer has no part in it.
pub(crate) fn segment_identity(
    identity: &aurora_trust::Identity,
) -> Result<Identity, NoSegmentRole> {
    let role = match identity.role {
        aurora_trust::Role::Trainer => Role::Hub,
        aurora_trust::Role::Relay => Role::Relay,
        aurora_trust::Role::Actor => Role::Actor,
        aurora_trust::Role::Observer => {
            return Err(NoSegmentRole {
                identity: identity.to_string(),
            });
        }
    };
    Ok(Identity {
        role,
        peer_id: identity.id.clone(),
        region: identity.region.clone(),
    })
}

/// Dials TLS over a connected socket, verifying the upstream's certificate and role
/// before anything is sent; the stream and the upstream's identity, as its certificate
/// says (the receiver holds its Welcome to it).
pub(crate) async fn connect(
    connector: &TlsConnector,
    tcp: TcpStream,
) -> Result<(Stream, Identity), (String, Refusal)> {
    let stream = connector
        .connect(aurora_trust::tls::server_name(), tcp)
        .await
        .map_err(|error| describe(&error))?;
    let certified = peer_identity(stream.get_ref().1.peer_certificates())
        .map_err(|error| (error.to_string(), Refusal::Handshake))
        .and_then(|identity| {
            segment_identity(&identity).map_err(|why| (why.to_string(), Refusal::WrongRole))
        })?;
    Ok((Stream::Tls(Box::new(stream.into())), certified))
}

/// The limits on what peers, authenticated or not, can make a node do. Every one is a
/// bound on memory, descriptors or threads a stranger could otherwise take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// From accepting a connection to its Hello, the TLS handshake included; a
    /// connection that has not said Hello by then is closed.
    pub handshake_timeout: Duration,
    /// Inbound connections at once, authenticated or not.
    pub max_connections: usize,
    /// Inbound connections from one source address still in their TLS handshake.
    pub max_unauthenticated_per_address: usize,
    /// Inbound connections of one authenticated peer (its session's streams, and the
    /// reconnections that replace them).
    pub max_connections_per_peer: usize,
    /// Snapshot and composed-delta builds a hub runs at once; a session wanting one
    /// more is told to come back later (Unavailable), never queued.
    pub max_builds: usize,
    /// Scratch space the builds a hub runs at once may take (mapped files in the store's
    /// directory: disk and page cache, not the hub's own memory), each charged the size
    /// of a whole checkpoint (twice for a composed delta, which rebuilds two sets of
    /// weights). One build always runs, however large.
    pub max_build_bytes: u64,
    /// Bytes of incomplete artifacts a relay or an actor holds from its upstream
    /// ([`aurora_proto::ReceiverConfig::max_held_bytes`]); beyond it the session ends,
    /// and the node asks again.
    pub max_held_bytes: u64,
    /// Bytes of received segments an actor lets wait for its decode pool;
    /// beyond it, it reads nothing more from its upstreams until decodes catch up.
    pub max_decode_backlog_bytes: u64,
    /// How long a frame from a subscriber may take to arrive whole once its first byte
    /// has, beyond what [`Limits::min_frame_read_rate`] allows for its length: a peer
    /// that starts a frame and trickles or withholds the rest holds a buffer no longer.
    /// The wait between frames is not bounded by it (a subscriber between versions
    /// sends nothing).
    pub frame_read_timeout: Duration,
    /// The slowest a subscriber's frame may arrive, in bytes per second, once
    /// [`Limits::frame_read_timeout`] is spent.
    pub min_frame_read_rate: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            handshake_timeout: Duration::from_secs(10),
            max_connections: 4096,
            max_unauthenticated_per_address: 64,
            // A session has at most 64 streams; a reconnection overlaps the connection
            // it replaces.
            max_connections_per_peer: 2 * aurora_proto::frame::MAX_STREAMS as usize,
            max_builds: 2,
            max_build_bytes: 32 << 30,
            max_held_bytes: 8 << 30,
            max_decode_backlog_bytes: 128 << 20,
            frame_read_timeout: Duration::from_secs(10),
            min_frame_read_rate: 64 << 10,
        }
    }
}

impl Limits {
    /// How long a subscriber's frame of `len` bytes may take from its first byte.
    pub(crate) fn frame_deadline(&self, len: usize) -> Duration {
        let rate = self.min_frame_read_rate.max(1);
        self.frame_read_timeout + Duration::from_secs_f64(len as f64 / rate as f64)
    }
}

/// The snapshot and composed-delta builds a hub runs, against [`Limits::max_builds`]
/// and [`Limits::max_build_bytes`]. One build always runs, however large: the budget
/// bounds how many run together, never whether a large model can be served at all.
#[derive(Debug, Default)]
pub(crate) struct BuildBudget {
    /// Each running build with the bytes it is charged.
    running: BTreeMap<ArtifactKey, u64>,
}

impl BuildBudget {
    /// Takes a place for `key` if it is a build (a stored delta is only read) of a
    /// model whose whole checkpoint takes `checkpoint_bytes`, or says why there is none.
    pub(crate) fn admit(
        &mut self,
        key: ArtifactKey,
        checkpoint_bytes: u64,
        limits: &Limits,
    ) -> Result<(), String> {
        let charge = match key {
            ArtifactKey::Delta(_) => return Ok(()),
            ArtifactKey::Snapshot(_) => checkpoint_bytes,
            // It rebuilds two sets of weights.
            ArtifactKey::Composed { .. } => checkpoint_bytes.saturating_mul(2),
        };
        let running = self.running.len();
        let charged: u64 = self.running.values().sum();
        if running > 0 && running >= limits.max_builds {
            return Err(format!(
                "{running} builds are running, the budget is {} (`max_builds`); come back later",
                limits.max_builds
            ));
        }
        if running > 0 && charged.saturating_add(charge) > limits.max_build_bytes {
            return Err(format!(
                "builds of {charged} bytes are running and this one needs {charge}, the \
                 budget is {} bytes (`max_build_bytes`); come back later",
                limits.max_build_bytes
            ));
        }
        self.running.insert(key, charge);
        Ok(())
    }

    /// `key`'s build (if it was one) has ended.
    pub(crate) fn finished(&mut self, key: ArtifactKey) {
        self.running.remove(&key);
    }
}

/// Why a connection or a request was refused before the protocol served it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The peer did not speak TLS (a plaintext client on a TLS port).
    NotTls,
    /// Its certificate is not of the fleet CA (or a peer refused ours as such).
    UnknownCa,
    /// Its certificate has expired or is not valid yet.
    Expired,
    /// Its certificate's role may not take this part (an upstream that is not a trainer
    /// or a relay; an observer subscribing).
    WrongRole,
    /// Any other failed handshake: no certificate, another protocol (ALPN), a broken
    /// message, the connection closed in the middle.
    Handshake,
    /// The TLS handshake was not done within the handshake timeout.
    HandshakeTimeout,
    /// Over the cap of connections in their handshake from one address.
    AddressCap,
    /// Over the cap of connections of one authenticated peer.
    PeerCap,
    /// Over the cap of connections in total.
    TotalCap,
    /// A snapshot or composed-delta build over the hub's budget.
    BuildBudget,
    /// A frame of a kind its sender's end never sends (a Segment from a subscriber), or
    /// out of its place (a second Hello).
    FrameKind,
    /// A frame over its size: larger than a Hello before authentication, or than the
    /// largest its kind may be.
    FrameSize,
    /// A subscriber's frame that did not arrive whole within its deadline.
    FrameTimeout,
}

/// Refusals counted by reason (see [`Refusal`]). Hellos refused by the protocol (a
/// Hello that does not name its certificate's identity, a replay, no Hello in time)
/// are counted in [`aurora_proto::SenderStats`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Refusals {
    pub not_tls: u64,
    pub unknown_ca: u64,
    pub expired: u64,
    pub wrong_role: u64,
    pub handshake: u64,
    pub handshake_timeout: u64,
    pub address_cap: u64,
    pub peer_cap: u64,
    pub total_cap: u64,
    pub build_budget: u64,
    pub frame_kind: u64,
    pub frame_size: u64,
    pub frame_timeout: u64,
}

impl Refusals {
    pub fn total(&self) -> u64 {
        self.not_tls
            + self.unknown_ca
            + self.expired
            + self.wrong_role
            + self.handshake
            + self.handshake_timeout
            + self.address_cap
            + self.peer_cap
            + self.total_cap
            + self.build_budget
            + self.frame_kind
            + self.frame_size
            + self.frame_timeout
    }
}

/// [`Refusals`] counted from any task, each logged within the log's budget per reason
/// ([`RefusalLog`]), so that a flood of strangers is counted in full without a log line
/// each.
#[derive(Debug, Default)]
pub(crate) struct RefusalCounters {
    counts: [AtomicU64; 13],
    log: RefusalLog<Refusal>,
}

impl RefusalCounters {
    /// Counts `refusal` of `peer` (an address, a peer's id, an artifact) and logs `why`.
    pub(crate) fn record(&self, refusal: Refusal, peer: &dyn fmt::Display, why: &dyn fmt::Display) {
        self.counts[refusal as usize].fetch_add(1, Ordering::Relaxed);
        match self.log.admit(refusal, Instant::now()) {
            Admission::Log { skipped_before: 0 } => {
                tracing::warn!(%peer, ?refusal, "refused {peer}: {why}")
            }
            Admission::Log { skipped_before } => tracing::warn!(
                %peer,
                ?refusal,
                skipped_before,
                "refused {peer}: {why} ({skipped_before} more of these were refused in the \
                 last window without a log line)"
            ),
            Admission::Skip => {}
        }
    }

    pub(crate) fn snapshot(&self) -> Refusals {
        let get = |refusal: Refusal| self.counts[refusal as usize].load(Ordering::Relaxed);
        Refusals {
            not_tls: get(Refusal::NotTls),
            unknown_ca: get(Refusal::UnknownCa),
            expired: get(Refusal::Expired),
            wrong_role: get(Refusal::WrongRole),
            handshake: get(Refusal::Handshake),
            handshake_timeout: get(Refusal::HandshakeTimeout),
            address_cap: get(Refusal::AddressCap),
            peer_cap: get(Refusal::PeerCap),
            total_cap: get(Refusal::TotalCap),
            build_budget: get(Refusal::BuildBudget),
            frame_kind: get(Refusal::FrameKind),
            frame_size: get(Refusal::FrameSize),
            frame_timeout: get(Refusal::FrameTimeout),
        }
    }
}

/// A failed handshake for a log line, and its reason for the counts.
pub(crate) fn describe(error: &std::io::Error) -> (String, Refusal) {
    let Some(tls) = error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    else {
        return (error.to_string(), Refusal::Handshake);
    };
    (explain(tls), classify(tls))
}

fn classify(error: &rustls::Error) -> Refusal {
    use rustls::Error as E;
    match error {
        // The first bytes were not a TLS record: an HTTP request, a version 1 Hello.
        E::InvalidMessage(_) => Refusal::NotTls,
        E::InvalidCertificate(CertificateError::UnknownIssuer | CertificateError::BadSignature)
        | E::AlertReceived(AlertDescription::UnknownCA) => Refusal::UnknownCa,
        E::InvalidCertificate(
            CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. },
        )
        | E::AlertReceived(AlertDescription::CertificateExpired) => Refusal::Expired,
        E::InvalidCertificate(CertificateError::Other(OtherError(inner)))
            if inner.downcast_ref::<UnexpectedRole>().is_some() =>
        {
            Refusal::WrongRole
        }
        _ => Refusal::Handshake,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn limits(max_builds: usize, max_build_bytes: u64) -> Limits {
        Limits {
            max_builds,
            max_build_bytes,
            ..Limits::default()
        }
    }

    #[test]
    fn builds_are_capped_in_count_and_stored_deltas_never() {
        let limits = limits(2, 100 * GIB);
        let mut budget = BuildBudget::default();
        budget
            .admit(ArtifactKey::Snapshot(4), GIB, &limits)
            .unwrap();
        let composed = ArtifactKey::Composed { base: 1, target: 4 };
        budget.admit(composed, GIB, &limits).unwrap();
        let refused = budget
            .admit(ArtifactKey::Snapshot(5), GIB, &limits)
            .unwrap_err();
        assert_eq!(
            refused,
            "2 builds are running, the budget is 2 (`max_builds`); come back later"
        );
        // Reading a stored delta builds nothing.
        budget.admit(ArtifactKey::Delta(5), GIB, &limits).unwrap();
        budget.finished(composed);
        budget
            .admit(ArtifactKey::Snapshot(5), GIB, &limits)
            .unwrap();
    }

    #[test]
    fn builds_are_capped_in_bytes_but_one_always_runs() {
        let limits = limits(8, 3 * GIB);
        let mut budget = BuildBudget::default();
        // Larger than the whole budget, alone: it runs, or a large model is never served.
        let composed = ArtifactKey::Composed { base: 1, target: 4 };
        budget.admit(composed, 2 * GIB, &limits).unwrap();
        let refused = budget
            .admit(ArtifactKey::Snapshot(4), 2 * GIB, &limits)
            .unwrap_err();
        assert_eq!(
            refused,
            format!(
                "builds of {} bytes are running and this one needs {}, the budget is {} \
                 bytes (`max_build_bytes`); come back later",
                4 * GIB,
                2 * GIB,
                3 * GIB
            )
        );
        budget.finished(composed);
        budget
            .admit(ArtifactKey::Snapshot(4), 2 * GIB, &limits)
            .unwrap();
    }
}
