//! Every connection and request the hub turns away, counted by reason for `/metrics`
//! (docs/control-api.md, "Metrics") and logged once, where it is decided, with a line
//! naming the peer and what was wrong; a flood of one reason logs a window's budget of
//! lines ([`RefusalLog`]) and is otherwise only counted. Refusals are rare for honest
//! peers, so one lock over the counters costs nothing; a flood of them contends only
//! with itself.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use aurora_trust::{Admission, RefusalLog};

/// Declares a label enum with every value (`ALL`, for zeros in the metrics) and its
/// label text.
macro_rules! labels {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum $name { $($(#[$vmeta])* $variant,)+ }

        impl $name {
            pub const ALL: &[$name] = &[$($name::$variant,)+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text,)+ }
            }
        }
    };
}

labels! {
    /// Why a TLS handshake failed.
    HandshakeFailure {
        /// The client did not speak TLS (a plaintext HTTP client, say).
        NotTls => "not_tls",
        /// The client's certificate is not from the fleet CA.
        UnknownCa => "unknown_ca",
        /// The client's certificate has expired or is not valid yet.
        Expired => "expired",
        /// The client presented no certificate.
        NoCertificate => "no_certificate",
        /// The client's certificate is unusable otherwise (revoked, wrong usage).
        BadCertificate => "bad_certificate",
        /// The certificate verified but carries no aurora identity.
        NoIdentity => "no_identity",
        /// The client refused the hub's certificate (an alert from its side).
        PeerRefused => "peer_refused",
        /// Anything else in the protocol: no common version, cipher or ALPN.
        Protocol => "protocol",
        /// The connection broke off before the handshake completed.
        Closed => "closed",
    }
}

labels! {
    /// Which connection cap turned a connection away.
    ConnectionLimit {
        Total => "total",
        PerAddress => "per_address",
        PerIdentity => "per_identity",
    }
}

labels! {
    /// Which wait ran out.
    Timeout {
        /// The TLS handshake.
        Handshake => "handshake",
        /// The request head (also ends idle keep-alive connections; counted only when
        /// a head had started).
        Header => "header",
        /// Handling a request: body upload, queueing and the call.
        Request => "request",
        /// A response the peer did not read.
        Write => "write",
    }
}

labels! {
    /// Which rule refused a request (401, 403 or 429).
    RequestRule {
        MissingToken => "missing_token",
        WrongFleetToken => "wrong_fleet_token",
        MalformedToken => "malformed_token",
        TokenNotIssued => "token_not_issued",
        OutdatedToken => "outdated_token",
        NoCertificate => "no_certificate",
        Role => "role",
        OtherActor => "other_actor",
        NotAnActorId => "not_an_actor_id",
        OtherRegion => "other_region",
        PeerConcurrency => "peer_concurrency",
    }
}

/// One refusal, by kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Refusal {
    Handshake(HandshakeFailure),
    Connection(ConnectionLimit),
    Timeout(Timeout),
    Request(RequestRule),
}

impl Refusal {
    /// The metric counting it, and its label.
    pub fn metric(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Refusal::Handshake(reason) => (HANDSHAKES, "reason", reason.as_str()),
            Refusal::Connection(limit) => (CONNECTIONS, "limit", limit.as_str()),
            Refusal::Timeout(wait) => (TIMEOUTS, "wait", wait.as_str()),
            Refusal::Request(rule) => (REQUESTS, "rule", rule.as_str()),
        }
    }

    fn all() -> impl Iterator<Item = Refusal> {
        let handshakes = HandshakeFailure::ALL.iter().map(|&r| Refusal::Handshake(r));
        let connections = ConnectionLimit::ALL.iter().map(|&l| Refusal::Connection(l));
        let timeouts = Timeout::ALL.iter().map(|&t| Refusal::Timeout(t));
        let requests = RequestRule::ALL.iter().map(|&r| Refusal::Request(r));
        handshakes
            .chain(connections)
            .chain(timeouts)
            .chain(requests)
    }
}

const HANDSHAKES: &str = "aurora_tls_handshakes_failed_total";
const CONNECTIONS: &str = "aurora_connections_refused_total";
const TIMEOUTS: &str = "aurora_timeouts_total";
const REQUESTS: &str = "aurora_requests_refused_total";

/// The metrics' names and help, in the order they are rendered.
pub(crate) const METRICS: [(&str, &str); 4] = [
    (HANDSHAKES, "TLS handshakes that failed, by reason."),
    (
        CONNECTIONS,
        "Connections closed at once for being over a cap, by cap.",
    ),
    (
        TIMEOUTS,
        "Connections or requests ended by a timeout, by wait.",
    ),
    (
        REQUESTS,
        "Requests refused by an authentication, authorization or concurrency rule.",
    ),
];

/// The counts of a hub process (they restart at zero with it, as Prometheus counters
/// may).
#[derive(Debug)]
pub struct Refusals {
    counts: Mutex<BTreeMap<Refusal, u64>>,
    log: RefusalLog<Refusal>,
}

impl Default for Refusals {
    fn default() -> Refusals {
        Refusals {
            counts: Mutex::new(Refusal::all().map(|refusal| (refusal, 0)).collect()),
            log: RefusalLog::default(),
        }
    }
}

impl Refusals {
    /// Counts `refusal` and logs it once (within the log's budget per reason, see
    /// [`RefusalLog`]): `peer` is who was refused, `detail` why.
    pub fn record(&self, refusal: Refusal, peer: &dyn fmt::Display, detail: &dyn fmt::Display) {
        *self
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(refusal)
            .or_default() += 1;
        let (metric, _, label) = refusal.metric();
        match self.log.admit(refusal, Instant::now()) {
            Admission::Log { skipped_before: 0 } => {
                tracing::warn!(%peer, metric, label, "refused {peer}: {detail}")
            }
            Admission::Log { skipped_before } => tracing::warn!(
                %peer,
                metric,
                label,
                skipped_before,
                "refused {peer}: {detail} ({skipped_before} more of these were refused in the \
                 last window without a log line)"
            ),
            Admission::Skip => {}
        }
    }

    /// How many of `refusal` were counted.
    pub fn count(&self, refusal: Refusal) -> u64 {
        self.counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&refusal)
            .copied()
            .unwrap_or(0)
    }

    /// Every count, zeros included, in [`METRICS`] order.
    pub(crate) fn snapshot(&self) -> Vec<(Refusal, u64)> {
        self.counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(refusal, count)| (*refusal, *count))
            .collect()
    }
}
