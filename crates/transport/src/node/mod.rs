//! The event loop of one node: owns the sans-IO [`aurora_proto::Node`], its sockets, its
//! timers and, for actors, its weights and engine.
//!
//! Every socket has a reader and a writer task; they and the listener report to the loop
//! through one bounded channel, so the loop is the only place where protocol state
//! changes. Heavy work (staging, activation, store reads and writes, building snapshot
//! artifacts) runs on blocking threads and reports back the same way. Everything a node
//! spawns lives in one `JoinSet`, so killing the loop's task closes every socket at once,
//! as a crash would.
//!
//! This module holds the vocabulary (settings, status, errors); `spawn` starts each kind
//! of node, `handle` is the caller's side, `driver` the loop that handles events, and
//! `effects` carries out what the protocol node asks of it.

mod accept;
mod driver;
mod effects;
mod handle;
mod spawn;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use aurora_delta::{
    ArtifactKind, ArtifactSignature, DeltaError, Hash, Heap, ImageSpace, RunId, SigningKey,
    Statement, VerifyingKey,
};
use aurora_proto::{
    Auth, Identity, JoinFloor, Receiver, ReceiverConfig, ReceiverStats, SenderConfig, SenderError,
    SenderStats, VersionRef,
};
use aurora_store::StoreError;
use aurora_trust::TrustError;

use crate::conn::SocketOptions;
use crate::decode::DecodePool;
use crate::security::{Limits, Refusals, Security};

pub(crate) use self::driver::Event;
pub use self::handle::NodeHandle;
pub use self::spawn::{spawn_actor, spawn_collector, spawn_hub, spawn_joining_actor, spawn_relay};

/// Settings shared by every kind of node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub identity: Identity,
    /// Accept subscribers here (hubs and relays).
    pub listen: Option<SocketAddr>,
    /// How connections are secured and peers authenticated, both ways: TLS with the
    /// fleet's certificates, or insecure plaintext with a shared token.
    pub security: Security,
    /// What peers may make this node do (connections, handshakes, builds).
    pub limits: Limits,
    /// Upstreams in order of preference (relays and actors): the region's relay first,
    /// then the hub or a peer relay to fall back to.
    pub upstreams: Vec<SocketAddr>,
    /// A session on any upstream but the first goes back to the first after about this
    /// long (a quarter more or less, drawn for each node, so that actors that left a
    /// relay together do not come back together), between two versions
    /// (docs/wire-protocol.md §6.4): an actor that fell back to the hub while its
    /// region's relay was down takes the relay's copy again once it is back. `None`: it
    /// stays where it is.
    pub return_after: Option<Duration>,
    /// A relay that has had no working upstream session this long sends its subscribers
    /// away and refuses new ones until it has one again
    /// (`aurora_proto::RelayOptions::suspend_after`), so that the actors of a relay cut off from
    /// the hub fetch the versions elsewhere instead of waiting for it. Longer than a hub
    /// takes to restart: while the hub is down there is nothing to fetch elsewhere, and
    /// sending every region's actors to it as it comes back is what relays are for
    /// avoiding. `None`: they wait.
    pub relay_suspend_after: Option<Duration>,
    /// Parallel streams per upstream session (the upper bound when tuned).
    pub streams: u8,
    /// Tune the stream count from measured goodput at this interval.
    pub tune_interval: Option<Duration>,
    pub socket: SocketOptions,
    pub connect_timeout: Duration,
    pub idle_timeout: Duration,
    /// A relay upstream that brings too little for this long (nothing new but less than
    /// [`aurora_proto::BEHIND_PROGRESS_BYTES`] of segments), while this node lacks a
    /// version the control plane says is committed, or its Commit
    /// ([`NodeHandle::expect_committed`]), is given up.
    pub behind_timeout: Duration,
    pub keepalive_interval: Duration,
    pub stall_timeout: Duration,
    /// An engine that took a version's changes first ([`crate::Engine::takes_changes_first`])
    /// lets go of the weights it ran before within this long
    /// ([`crate::Engine::released`]), so that the node's copy can take the version;
    /// otherwise the activation is reported failed and the engine is handed the copy's
    /// weights back whole, as when the copy's write fails. Longer than an engine takes to
    /// load a version.
    pub release_timeout: Duration,
    /// A version of at most this many bytes whose receiver's Want is overdue is sent
    /// once more, each frame on another stream (docs/wire-protocol.md §5.13); 0 never.
    pub hedge_max_bytes: u64,
    /// Versions a relay keeps in memory for its subscribers, and their bytes at most
    /// ([`aurora_proto::SenderConfig::retain_bytes`]).
    pub retain_versions: usize,
    pub retain_bytes: u64,
    /// Frames in flight per connection (the sender's window).
    pub window_frames: usize,
    /// A relay keeps the snapshot it starts from in an unnamed file in this directory
    /// ([`crate::FileSnapshots`]; the model's size on disk, none of it in the process's
    /// memory) and serves it to the peers of its region that join with no weights, so
    /// the region's joins cross its upstream link once (docs/wire-protocol.md §8).
    /// `None`: it keeps none, and joiners fetch their snapshots from the hub.
    pub snapshot_dir: Option<PathBuf>,
    /// Segment size of the snapshot artifacts a hub builds from its store for peers that
    /// join with no weights. Hubs that serve one store must agree on it: the same
    /// snapshot then gives the same artifact, and a join resumes across them.
    pub snapshot_segment_bytes: usize,
    /// Where an actor decodes deltas as their segments arrive, at a lower
    /// priority than the process ([`DecodePool`]). `None`: a pool of its own, one
    /// thread per core. Nodes of one process may share a pool: they then take turns,
    /// one segment each. Hubs, relays and collectors decode nothing.
    pub decode_pool: Option<Arc<DecodePool>>,
    /// Where an actor that joins with no weights builds the image of the
    /// snapshot it takes (and the images after it): the heap, or unnamed files mapped
    /// from a directory (`aurora_checkpoint::FileImages`), which keep the node's memory
    /// flat whatever the model's size. A node started with weights keeps theirs.
    pub images: Arc<dyn ImageSpace>,
    /// The trainer's signing key, on a hub that signs what it serves (docs/security.md):
    /// each delta when its extraction ends, each snapshot or composed delta as it is
    /// built from the store, each Commit. Such a hub also pins its public half, so it
    /// refuses to serve a stored delta that is not signed by it.
    pub signing_key: Option<Arc<SigningKey>>,
    /// The trainer's public key that relays and actors pin: they verify every Offer,
    /// Seal and Commit against it and take nothing unsigned. With certificates a
    /// receiving node must have it, unless [`NodeConfig::insecure_unsigned`].
    pub trainer_key: Option<VerifyingKey>,
    /// INSECURE: versions travel unsigned although the node has certificates: a hub
    /// without a signing key serves them, a relay or an actor without the trainer's key
    /// takes them, and a compromised relay can then hand its actors any weights.
    /// Without certificates (plaintext) nothing is authenticated anyway, and unsigned
    /// versions need no flag.
    pub insecure_unsigned: bool,
    /// The run this node serves: a hub's is its store's (or, without a store, this
    /// setting, else a new one); a relay or actor told it (by the control plane, a
    /// setting) refuses upstreams of another. `None` on a relay or actor: learned from
    /// the trainer's own hub (docs/security.md §5).
    pub run: Option<RunId>,
    /// What an actor that joins was told by the control plane: it takes no snapshot or
    /// upstream older (docs/wire-protocol.md §6.6).
    pub join_floor: JoinFloor,
}

impl NodeConfig {
    pub fn new(identity: Identity, security: Security) -> NodeConfig {
        NodeConfig {
            identity,
            listen: None,
            security,
            limits: Limits::default(),
            upstreams: Vec::new(),
            return_after: Some(RETURN_AFTER),
            relay_suspend_after: Some(Duration::from_secs(30)),
            streams: 4,
            tune_interval: None,
            socket: SocketOptions::default(),
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(10),
            behind_timeout: BEHIND_TIMEOUT,
            keepalive_interval: Duration::from_secs(2),
            stall_timeout: Duration::from_secs(30),
            release_timeout: Duration::from_secs(120),
            hedge_max_bytes: 4 << 20,
            retain_versions: 4,
            retain_bytes: 256 << 20,
            window_frames: 4,
            snapshot_segment_bytes: 256 << 10,
            snapshot_dir: None,
            decode_pool: None,
            images: Arc::new(Heap),
            signing_key: None,
            trainer_key: None,
            insecure_unsigned: false,
            run: None,
            join_floor: JoinFloor::default(),
        }
    }

    /// The key every artifact and Commit must be signed by: the pinned trainer key, or
    /// a signing hub's own.
    fn pinned_key(&self) -> Option<VerifyingKey> {
        self.trainer_key
            .or_else(|| self.signing_key.as_ref().map(|key| key.verifying_key()))
    }

    /// The key a hub signs with and the run it signs for, on a hub that signs.
    fn signer(&self) -> Option<(&SigningKey, RunId)> {
        let key = self.signing_key.as_deref()?;
        Some((key, self.run.expect("a hub's run is set when it starts")))
    }

    /// The trainer's signature of `statement`, on a hub that signs.
    pub(crate) fn sign(&self, statement: &Statement) -> Option<ArtifactSignature> {
        self.signer()
            .map(|(key, run)| aurora_delta::sign(key, &run, statement))
    }

    /// The trainer's signature of the Offer of the delta whose descriptor is
    /// `descriptor`, on a hub that signs.
    pub(crate) fn sign_offer(
        &self,
        descriptor: &[u8],
    ) -> Result<Option<ArtifactSignature>, DeltaError> {
        self.signer()
            .map(|(key, run)| {
                aurora_proto::offer_signature(key, &run, ArtifactKind::Delta, descriptor)
            })
            .transpose()
    }

    fn sender(&self, store_backed: bool) -> SenderConfig {
        let auth = match &self.security {
            Security::Tls(_) => Auth::Certificate,
            Security::InsecurePlaintext { token, .. } => Auth::Shared(token.clone()),
        };
        let mut config = SenderConfig::new(self.identity.clone(), auth);
        config.store_backed = store_backed;
        config.handshake_timeout = self.limits.handshake_timeout;
        config.keepalive_interval = self.keepalive_interval;
        config.stall_timeout = self.stall_timeout;
        config.hedge_max_bytes = self.hedge_max_bytes;
        config.retain_versions = self.retain_versions;
        config.retain_bytes = self.retain_bytes;
        config.window_frames = self.window_frames;
        config.trainer_key = self.pinned_key();
        config.run = self.run;
        config
    }

    pub(super) fn receiver_config(&self) -> ReceiverConfig {
        // Over TLS the certificate proves who this node is: a Hello carries no token.
        let token = match &self.security {
            Security::Tls(_) => Vec::new(),
            Security::InsecurePlaintext { token, .. } => token.clone(),
        };
        let mut config = ReceiverConfig::new(self.identity.clone(), token);
        config.streams = self.streams;
        config.idle_timeout = self.idle_timeout;
        config.behind_timeout = self.behind_timeout;
        config.tune_interval = self.tune_interval;
        config.trainer_key = self.pinned_key();
        config.max_held_bytes = self.limits.max_held_bytes;
        config.run = self.run;
        config.join_floor = self.join_floor;
        config
    }

    /// A receiver from `active` on, or one that joins from a snapshot (no weights).
    fn receiver(&self, active: Option<VersionRef>) -> Receiver {
        match active {
            Some(active) => Receiver::new(self.receiver_config(), active.version + 1, active),
            None => Receiver::joining(self.receiver_config()),
        }
    }
}

/// An error and its sources on one line: what a downstream is told in an Unavailable.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("the node has stopped")]
    Stopped,
    #[error("listening on {address}")]
    Listen {
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Publish(#[from] SenderError),
    #[error("storing the artifact")]
    Store(#[from] StoreError),
    #[error("extraction failed")]
    Extraction(#[from] DeltaError),
    #[error(
        "the extraction of version {version} names target hash {header} and its publisher \
         {given}"
    )]
    TargetHashDisagrees {
        version: u64,
        header: Hash,
        given: Hash,
    },
    #[error("this node's TLS configuration")]
    Tls(#[from] TrustError),
    #[error("this node is configured as {configured:?} but its certificate says {certified}")]
    NotTheCertificate {
        configured: Identity,
        certified: String,
    },
    #[error("building the decode thread pool: {0}")]
    Pool(String),
    #[error("invalid benchmark: {0}")]
    InvalidSpec(String),
    #[error("the relay's snapshot directory {dir}")]
    SnapshotDir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("{0} needs at least one upstream")]
    NoUpstream(&'static str),
    /// Certificates authenticate the links, not the weights: a relay in between could
    /// still hand over any weights, unless every version is signed.
    #[error(
        "this node has certificates but pins no trainer key: with certificates every \
         version must carry the trainer's signature (give the trainer's public key: \
         --trainer-key, trainer_key=...), or take unsigned versions by name \
         (--insecure-unsigned, insecure_unsigned=True)"
    )]
    TrainerKeyRequired,
    #[error(
        "this hub has certificates but no signing key: its relays and actors take only \
         signed versions (give the trainer's key: --signing-key, signing_key=...), or \
         serve unsigned ones by name (--insecure-unsigned, insecure_unsigned=True)"
    )]
    SigningKeyRequired,
    #[error(transparent)]
    BeyondLoopback(#[from] aurora_trust::BeyondLoopback),
    #[error("gave up after {0:?}")]
    TimedOut(Duration),
    #[error("this hub is set to serve run {configured}, but its store is of run {stored}")]
    OtherRun { configured: RunId, stored: RunId },
    #[error("no randomness for a new run's id: {0}")]
    Random(String),
    #[error("an actor refused the chain to version {0} from every upstream")]
    Diverged(u64),
}

/// Where a node stands; published after every event it handles.
#[derive(Debug, Clone, Default)]
pub struct NodeStatus {
    /// The active weights (actors; relays hold none).
    pub active: Option<VersionRef>,
    pub staged: Option<u64>,
    pub committed: Option<u64>,
    /// The last [`COMPLETED_SHOWN`] versions completed and verified by the receiver, in
    /// order.
    pub completed: Vec<u64>,
    /// The upstream of the current session.
    pub upstream: Option<SocketAddr>,
    pub connected: bool,
    /// Streams of the upstream session its upstream has welcomed.
    pub streams: u8,
    /// Streams the upstream session uses now (one at first when tuned).
    pub target_streams: u8,
    pub upstream_switches: u64,
    /// Why the last upstream session that failed ended (a node that cannot join says so).
    pub last_upstream_failure: Option<String>,
    pub receiver: Option<ReceiverStats>,
    pub sender: Option<SenderStats>,
    /// Status reports received from subscribers (peer id, active version, note),
    /// the latest [`MAX_REPORTS`] of them.
    pub reports: Vec<(String, VersionRef, String)>,
    /// Sessions currently subscribed (hubs and relays).
    pub subscribers: usize,
    /// The snapshot a relay serves its region's joiners ([`NodeConfig::snapshot_dir`]).
    pub kept_snapshot: Option<u64>,
    /// The actor refused its upstreams' chain [`aurora_proto::MAX_REFUSALS`] times.
    pub diverged: bool,
    /// Activations that failed: a target hash that did not match (the weights were
    /// restored), an engine that held the weights, a panic.
    pub failed_activations: u64,
    /// Why the last activation failed, if it did (cleared by one that succeeds).
    pub last_failed_activation: Option<String>,
    /// Connections and builds refused before the protocol served them, by reason.
    pub refusals: Refusals,
    /// The run this node serves: a hub's own, a relay's or an actor's once pinned or
    /// learned from the trainer's hub.
    pub run: Option<RunId>,
}

/// Reports kept in [`NodeStatus::reports`].
pub const MAX_REPORTS: usize = 256;
/// Versions kept in [`NodeStatus::completed`].
pub const COMPLETED_SHOWN: usize = 64;

/// The default of [`NodeConfig::return_after`].
pub const RETURN_AFTER: Duration = Duration::from_secs(30);

/// The default of [`NodeConfig::behind_timeout`], the receiver's.
pub use aurora_proto::BEHIND_TIMEOUT;
