//! The downstream side of the protocol (docs/wire-protocol.md §6): one session of up to
//! S streams to an upstream, assembling artifacts from verified segments.
//!
//! Sans-IO: the driver dials when asked ([`ReceiverEvent::Dial`]), reports connections,
//! frames, closes and time; the receiver answers with frames to write
//! ([`Receiver::poll_transmit`]) and events ([`Receiver::poll_event`]).
//!
//! Every segment is checked against the hash in its frame and, once the table is known,
//! against the table; a bad one is nacked and sent again. A version is delivered
//! ([`ReceiverEvent::Complete`]) only when its table's hash is the artifact id and every
//! segment matches it, and versions are delivered in order. What the receiver holds
//! survives a lost stream or a lost upstream: the next session's Want reports it, so only
//! missing segments travel again.
//!
//! A receiver that holds no weights ([`Receiver::joining`]) starts from the newest
//! snapshot an upstream offers in its Welcome, wants it with the snapshot flag, and
//! continues with the deltas after it like any other receiver.
//!
//! With a pinned trainer key ([`ReceiverConfig::trainer_key`]) an Offer is taken only
//! when it carries the trainer's signature over its kind, version and descriptor,
//! checked before the descriptor is parsed, so nothing is sized from a descriptor the
//! trainer did not make; a version is reported sealed, and so delivered, only when its
//! Seal carries the trainer's signature over the artifact (kind, id, versions, weights
//! hashes, encoding), and a Commit is reported only with the trainer's signature over
//! it: an upstream that alters an artifact and re-hashes everything it can is caught at
//! the Seal, and one that strips or forges a signature is given up like any other
//! protocol violation.
//!
//! An actor's receiver accepts composed catch-up ([`Receiver::accept_composed`]): its
//! Wants say so, and an upstream may answer one that is behind with a single composed
//! delta from the weights of `next_version - 1` to a later version v (Offer kind 3,
//! docs/wire-protocol.md §6.7) instead of the deltas in between; once it is delivered
//! the receiver goes on from v + 1. Its version may lie beyond the window: the one
//! version beyond it that an upstream sends is taken as that composed delta.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aurora_delta::{ArtifactSignature, DeltaHeader, Hash, RunId, SegmentEntry, VerifyingKey};
use bytes::Bytes;

use crate::frame::{
    ArtifactKind, Commit, Frame, Hello, MAX_WANT_VERSIONS, PROTOCOL_VERSION, Progress, Role,
    VersionRef, Welcome,
};
use crate::tuner::StreamTuner;

mod assembly;
mod error;
mod inbound;

pub use self::assembly::Artifact;
use self::assembly::Assembly;
pub use self::error::{DescriptorFault, SessionEnd, Violation};
use crate::{ConnId, Identity, Transmit};

#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    pub identity: Identity,
    pub token: Vec<u8>,
    /// Streams per session.
    pub streams: u8,
    /// Versions held beyond the one being completed; must not exceed the upstream's
    /// window (a version further ahead is a protocol violation).
    pub versions_ahead: u64,
    /// Bytes of incomplete artifacts held at most.
    pub max_held_bytes: u64,
    /// Bad copies of one segment tolerated before the upstream is given up.
    pub max_segment_failures: u32,
    /// An upstream that sends nothing (not even a keepalive) for this long is lost.
    pub idle_timeout: Duration,
    /// A relay that brings too little for this long (less than `behind_progress_bytes`
    /// of new segments, and no descriptor, table, delivery or newer Commit) while a
    /// committed version this receiver lacks, or lacks the Commit of, is known
    /// ([`Receiver::expect_committed`]) is lost: it is stuck behind, withholding it, or
    /// trickling it a segment at a time, and its keepalives keep it from being silent.
    /// A hub is never lost so: it may take minutes to build what it serves from its
    /// store.
    pub behind_timeout: Duration,
    /// See `behind_timeout`; default [`BEHIND_PROGRESS_BYTES`].
    pub behind_progress_bytes: u64,
    /// When set, the stream count is tuned ([`StreamTuner`]) at this interval: each
    /// session starts with one stream and opens more, up to `streams`, while they pay.
    pub tune_interval: Option<Duration>,
    /// The trainer's public key, where the deployment signs: an Offer, a Seal or a
    /// Commit without its valid signature (over the run's statement) is a protocol
    /// violation, and nothing of it is delivered.
    pub trainer_key: Option<VerifyingKey>,
    /// The run this node serves, where it was told (by the control plane, or a
    /// setting): an upstream of another run is given up. `None`: the run is learned
    /// from the first Welcome of the trainer's own hub (with a trainer key pinned; from
    /// any upstream without one) and held for the receiver's life.
    pub run: Option<RunId>,
    /// What a receiver with no weights was told by the control plane before it joins:
    /// it takes no snapshot older than `snapshot` and no upstream that has committed
    /// less than `commit` (docs/wire-protocol.md §6.6). Zeros: no floor.
    pub join_floor: JoinFloor,
}

/// The oldest state a joining receiver accepts ([`ReceiverConfig::join_floor`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JoinFloor {
    /// The newest snapshot the trainer's store holds at or below `commit`: the one its
    /// own hub offers.
    pub snapshot: u64,
    /// The version the control plane has committed.
    pub commit: u64,
}

/// The default of [`ReceiverConfig::behind_timeout`].
pub const BEHIND_TIMEOUT: Duration = Duration::from_secs(60);

/// The default of [`ReceiverConfig::behind_progress_bytes`]: the new segment bytes a
/// relay must bring within each `behind_timeout` while a committed
/// version is lacking (unless it brings a descriptor, a table, a delivery or a newer
/// Commit): about 1.1 Mbps at the default timeout. A count of segments would let a relay
/// that sends one (or an empty one) a minute hold its actors for as long as a version
/// has segments; bytes scale with the version, and an honest relay on any link worth
/// relaying through brings them many times over.
pub const BEHIND_PROGRESS_BYTES: u64 = 8 << 20;

/// What grows when a session brings something new besides segment bytes
/// ([`Receiver::progress_mark`]).
type ProgressMark = (u64, usize, usize, Option<u64>);

impl ReceiverConfig {
    pub fn new(identity: Identity, token: Vec<u8>) -> Self {
        ReceiverConfig {
            identity,
            token,
            streams: 4,
            versions_ahead: 4,
            max_held_bytes: 8 << 30,
            max_segment_failures: 8,
            idle_timeout: Duration::from_secs(10),
            behind_timeout: BEHIND_TIMEOUT,
            behind_progress_bytes: BEHIND_PROGRESS_BYTES,
            tune_interval: None,
            trainer_key: None,
            run: None,
            join_floor: JoinFloor::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReceiverEvent {
    /// Open stream `stream` of the current session and report [`Receiver::connected`]
    /// (or [`Receiver::dial_failed`]).
    Dial { session: u64, stream: u8 },
    /// Close `conn` (a stream of a session given up).
    Close { conn: ConnId },
    /// The upstream accepted the session.
    Connected { upstream: Welcome },
    /// The session is over; start another one, on another upstream if this one failed.
    UpstreamLost { reason: SessionEnd },
    /// The descriptor of `version` arrived, and (with a pinned trainer key) its signature
    /// verifies (relays publish a delta's downstream with the signature as it came;
    /// actors may start decoding its segments against their weights). Its header's
    /// target hash is pending: the Seal brings it, and the complete artifact's header
    /// holds it.
    Offered {
        version: u64,
        kind: ArtifactKind,
        descriptor: Bytes,
        header: Arc<DeltaHeader>,
        signature: Option<ArtifactSignature>,
    },
    /// A verified segment (relays forward it at once); never before its version's
    /// `Offered`.
    Segment {
        version: u64,
        index: u32,
        hash: Hash,
        bytes: Bytes,
    },
    /// A segment forwarded earlier did not match the table that arrived later.
    Revoked { version: u64, index: u32 },
    /// The table of `version` arrived, its hash is the artifact id, and (with a pinned
    /// trainer key) the signature verifies; a relay forwards it as it came.
    Sealed {
        version: u64,
        id: Hash,
        target_hash: Hash,
        segments: Vec<SegmentEntry>,
        signature: Option<ArtifactSignature>,
    },
    /// `version` is complete and verified: the whole artifact, in version order.
    Complete { version: u64, artifact: Artifact },
    /// A Commit, its signature verified where a trainer key is pinned.
    Commit(Commit),
}

/// Counters for benchmarks and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    pub segments: u64,
    pub segment_bytes: u64,
    /// Segments that arrived again after being verified once.
    pub duplicates: u64,
    /// Segments whose bytes did not match their hash.
    pub corrupt: u64,
    pub nacks_sent: u64,
    pub sessions: u64,
    /// Sessions ended by a protocol violation of the upstream (a missing or bad
    /// signature among them).
    pub violations: u64,
    /// Segment bytes received per stream index.
    pub stream_bytes: Vec<u64>,
}

/// What the receiver starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// The weights of `next_version - 1`: every version arrives as a delta.
    Weights,
    /// Nothing, and nothing needed: a relay's receiver, which forwards deltas and holds
    /// no weights, starts from the newest version its upstream serves (a Welcome's
    /// `latest`, at least 1), chosen again at each session's first Welcome until a
    /// version is delivered. A relay told its next version is unavailable chooses
    /// again: it was cut off for longer than its upstream keeps deltas, and would ask
    /// for that version forever.
    Newest,
    /// No weights: the first version arrives as a snapshot, of the version an upstream
    /// offered (None until a Welcome did), then the deltas after it.
    Snapshot(Option<u64>),
}

#[derive(Clone, Default)]
struct Stream {
    conn: Option<ConnId>,
    welcomed: bool,
    /// Connections made on this stream in this session.
    epoch: u32,
    /// Who the connection's certificate says the upstream is, where it has one.
    certified: Option<Identity>,
}

struct Session {
    id: u64,
    wants: u64,
    streams: Vec<Stream>,
    upstream: Option<Welcome>,
    last_heard: Instant,
}

pub struct Receiver {
    config: ReceiverConfig,
    start: Start,
    next_version: u64,
    /// The weights of `next_version - 1` where known: the base a composed delta must
    /// start from.
    tip: Option<VersionRef>,
    /// Whether Wants accept a composed delta for catch-up (an actor's receiver; a relay
    /// republishes deltas and takes none).
    accepts_composed: bool,
    /// A relay's receiver: one that may choose its start again.
    relaying: bool,
    /// What a relay's receiver starts from when it chooses again: the newest version,
    /// or for one that keeps a snapshot for its region's joins
    /// ([`Receiver::keep_snapshots`]) and has delivered nothing yet, the newest snapshot.
    relay_start: Start,
    /// The oldest snapshot this receiver takes: a joiner's from its
    /// [`ReceiverConfig::join_floor`], a relay's fetcher's from
    /// [`Receiver::take_snapshots_from`].
    snapshot_floor: u64,
    /// The run the upstreams must serve: pinned, or learned from the trainer's hub.
    run: Option<RunId>,
    active: VersionRef,
    staged: Option<u64>,
    session: Option<Session>,
    assemblies: BTreeMap<u64, Assembly>,
    held_bytes: u64,
    /// Nacks not yet answered, with the stream (index, epoch) that carried each: one
    /// carried by a stream that dies is sent again.
    nacks: BTreeMap<(u64, u32), (usize, u32)>,
    /// Frames to write, and whether to close the connection after each.
    out: VecDeque<Transmit>,
    events: VecDeque<ReceiverEvent>,
    stats: ReceiverStats,
    /// The newest version known to be committed, from outside the session
    /// ([`Receiver::expect_committed`]), while this receiver lacks it or its Commit.
    expected: Option<u64>,
    /// The newest Commit this receiver has had.
    committed: Option<u64>,
    /// When the session last brought something new (or began, or the receiver learnt
    /// it was behind), and the segment bytes received by then.
    progress_at: Option<Instant>,
    progress_bytes: u64,
    /// Present when tuning is on.
    tuner: Option<StreamTuner>,
    /// Next tuning instant and the byte count at the last one.
    tune_at: Option<Instant>,
    tune_bytes: u64,
}

impl Receiver {
    /// A receiver that wants every version from `next_version` on; `active` is what the
    /// local weights are (reported in each Hello).
    pub fn new(config: ReceiverConfig, next_version: u64, active: VersionRef) -> Receiver {
        assert!(config.streams > 0, "a session needs at least one stream");
        let streams = config.streams as usize;
        let (snapshot_floor, run) = (config.join_floor.snapshot, config.run);
        Receiver {
            config,
            start: Start::Weights,
            next_version,
            tip: (active.version + 1 == next_version).then_some(active),
            accepts_composed: false,
            relaying: false,
            relay_start: Start::Newest,
            snapshot_floor,
            run,
            active,
            staged: None,
            session: None,
            assemblies: BTreeMap::new(),
            held_bytes: 0,
            nacks: BTreeMap::new(),
            out: VecDeque::new(),
            events: VecDeque::new(),
            stats: ReceiverStats {
                stream_bytes: vec![0; streams],
                ..ReceiverStats::default()
            },
            expected: None,
            committed: None,
            progress_at: None,
            progress_bytes: 0,
            tuner: None,
            tune_at: None,
            tune_bytes: 0,
        }
    }

    /// A receiver that holds no weights: it takes the newest snapshot an upstream
    /// offers, then every delta after it. Its Hellos report version 0 with the all-zero
    /// hash (docs/wire-protocol.md §4.1).
    pub fn joining(config: ReceiverConfig) -> Receiver {
        let mut receiver = Receiver::new(config, 0, VersionRef::default());
        receiver.start = Start::Snapshot(None);
        receiver
    }

    /// A relay's receiver: it holds no weights, so it wants every version from the newest
    /// its upstream serves on (docs/wire-protocol.md §8). Its Hellos report version 0
    /// with the all-zero hash until [`Receiver::set_local`] says what it holds.
    pub fn relaying(config: ReceiverConfig) -> Receiver {
        let mut receiver = Receiver::new(config, 1, VersionRef::default());
        receiver.start = Start::Newest;
        receiver.relaying = true;
        receiver
    }

    /// A relay that keeps a snapshot to serve its region's joins (docs/wire-protocol.md
    /// §8): it starts from the newest snapshot its upstream offers, then the deltas
    /// after it, until it has delivered a version; from an upstream that offers none,
    /// and whenever it chooses its start again after that, it follows from the newest
    /// version, as any relay (its node takes newer snapshots on the side).
    pub fn keep_snapshots(&mut self) {
        debug_assert!(self.relaying, "only a relay's receiver keeps snapshots");
        self.relay_start = Start::Snapshot(None);
        if self.start == Start::Newest {
            self.start = self.relay_start;
            self.next_version = 0;
        }
    }

    /// A relay's receiver that keeps snapshots takes none older than `version`: an
    /// upstream that offers an older one, or none, is given up
    /// ([`SessionEnd::OldSnapshot`], [`SessionEnd::NoSnapshot`]). A relay's fetcher of a
    /// newer snapshot than the one it keeps ([`crate::Node::snapshot_fetcher`]).
    pub fn take_snapshots_from(&mut self, version: u64) {
        self.snapshot_floor = version;
    }

    /// The snapshot this receiver takes before any delta, once a Welcome named it.
    pub fn taking_snapshot(&self) -> Option<u64> {
        match self.start {
            Start::Snapshot(version) => version,
            _ => None,
        }
    }

    /// The consumer takes each segment of `version` as it is announced (an actor that
    /// decodes them as they arrive): from now on the receiver keeps only their hashes,
    /// which stand for them in its Wants and against the table, and the complete
    /// artifact's segments are empty. Holding them would hold the whole delta, or for a
    /// snapshot the whole model, until the last one arrived, for nothing.
    pub fn take_segments(&mut self, version: u64) {
        let Some(assembly) = self.assemblies.get_mut(&version) else {
            return;
        };
        assembly.taken = true;
        for (_, bytes) in assembly.segments.iter_mut().flatten() {
            let released = std::mem::take(bytes).len() as u64;
            assembly.held_bytes -= released;
            self.held_bytes -= released;
        }
    }

    /// Whether the receiver may still move its first version (a relay's, until it has
    /// delivered one, and again once told its next version is gone upstream:
    /// [`Receiver::relaying`]).
    pub fn choosing_start(&self) -> bool {
        self.relaying && matches!(self.start, Start::Newest | Start::Snapshot(_))
    }

    /// Lets Wants accept a composed delta for catch-up (docs/wire-protocol.md §6.7). Only
    /// a peer that stages what it receives takes one: a relay would have to republish a
    /// composed delta as the delta of its version, which it is not.
    pub fn accept_composed(&mut self) {
        self.accepts_composed = true;
    }

    /// Whether the next Want accepts a composed delta: the receiver holds weights and
    /// knows them as the base such a delta starts from.
    fn wants_composed(&self) -> bool {
        self.accepts_composed
            && self.start == Start::Weights
            && self
                .tip
                .is_some_and(|tip| tip.version + 1 == self.next_version)
    }

    /// Whether the receiver still waits for its snapshot.
    #[cfg(test)]
    pub(crate) fn is_joining(&self) -> bool {
        matches!(self.start, Start::Snapshot(_))
    }

    /// The run this receiver's upstreams serve, once pinned or learned.
    pub fn run(&self) -> Option<RunId> {
        self.run
    }

    pub fn stats(&self) -> &ReceiverStats {
        &self.stats
    }

    /// The lowest version not yet delivered (0 for a joining receiver before it knows
    /// its snapshot).
    pub fn next_version(&self) -> u64 {
        self.next_version
    }

    /// Version `version` is committed: the driver heard so from elsewhere (the control
    /// plane). While the receiver lacks it or its Commit, a relay's session that brings
    /// nothing new for `behind_timeout` is given up ([`SessionEnd::Behind`]). A joining
    /// receiver waits for its snapshot as long as it takes.
    pub fn expect_committed(&mut self, now: Instant, version: u64) {
        if matches!(self.start, Start::Snapshot(_))
            || !self.lacks(version)
            || self.expected.is_some_and(|known| known >= version)
        {
            return;
        }
        if self.expected.is_none() {
            self.restart_progress(now);
        }
        self.expected = Some(version);
    }

    /// Whether the receiver still lacks `version` or its Commit.
    fn lacks(&self, version: u64) -> bool {
        version >= self.next_version || self.committed.is_none_or(|c| c < version)
    }

    /// What grows when a session brings something new besides segment bytes: versions
    /// delivered, descriptors and tables taken, the newest Commit.
    pub(super) fn progress_mark(&self) -> ProgressMark {
        let described = self.assemblies.values().filter(|a| a.descriptor.is_some());
        let sealed = self.assemblies.values().filter(|a| a.table.is_some());
        (
            self.next_version,
            described.count(),
            sealed.count(),
            self.committed,
        )
    }

    /// After frames that may have brought something new (`before` is the mark from
    /// before them): the clock of [`ReceiverConfig::behind_timeout`] starts again if
    /// they did, or if `behind_progress_bytes` of new segments came since it last
    /// started, and stops once nothing expected is lacking.
    pub(super) fn note_progress(&mut self, now: Instant, before: ProgressMark) {
        let bytes = self.stats.segment_bytes - self.progress_bytes;
        if self.progress_mark() != before || bytes >= self.config.behind_progress_bytes {
            self.restart_progress(now);
        }
        if self.expected.is_some_and(|version| !self.lacks(version)) {
            self.expected = None;
        }
    }

    fn restart_progress(&mut self, now: Instant) {
        self.progress_at = Some(now);
        self.progress_bytes = self.stats.segment_bytes;
    }

    /// Whether part of a version is held: a session left now would leave it half
    /// received (resumable, but later).
    pub fn receiving(&self) -> bool {
        !self.assemblies.is_empty()
    }

    pub fn is_connected(&self) -> bool {
        self.session.as_ref().is_some_and(|s| s.upstream.is_some())
    }

    /// What the local weights are, for later Hellos.
    pub fn set_local(&mut self, active: VersionRef, staged: Option<u64>) {
        self.active = active;
        self.staged = staged;
        if self.tip.is_none() && active.version + 1 == self.next_version {
            self.tip = Some(active);
        }
    }

    /// Starts a session (after [`ReceiverEvent::UpstreamLost`], or the first time):
    /// closes the old one's streams and asks the driver to dial every stream.
    pub fn start_session(&mut self, now: Instant, session: u64) {
        self.end_session("starting a new session");
        self.stats.sessions += 1;
        // A new upstream gets the whole time to show it is not behind too.
        self.restart_progress(now);
        self.session = Some(Session {
            id: session,
            wants: 0,
            streams: vec![Stream::default(); self.config.streams as usize],
            upstream: None,
            last_heard: now,
        });
        // A new session may run to another upstream over another path: tune afresh.
        self.tuner = self
            .config
            .tune_interval
            .map(|_| StreamTuner::new(self.config.streams));
        self.tune_at = self.config.tune_interval.map(|interval| now + interval);
        self.tune_bytes = self.stats.segment_bytes;
        for stream in 0..self.stream_count() {
            self.events
                .push_back(ReceiverEvent::Dial { session, stream });
        }
    }

    /// Ends the session: frames already queued (a refusal's report) still go out, then
    /// a Goodbye, then each connection is closed.
    fn end_session(&mut self, reason: &str) {
        // The next session's Want reports what is held; nothing is in flight there.
        self.nacks.clear();
        if let Some(old) = self.session.take() {
            for stream in old.streams {
                if let Some(conn) = stream.conn {
                    let goodbye = Frame::Goodbye {
                        reason: truncated(reason),
                    };
                    self.out.push_back(Transmit {
                        conn,
                        frame: goodbye,
                        close_after: true,
                    });
                }
            }
        }
    }

    /// Gives the current upstream up (it served something unusable, or the node goes
    /// back to its first upstream); the driver starts a new session elsewhere. False
    /// where there was no session to give up: it had ended already.
    pub fn abandon(&mut self, reason: &str) -> bool {
        if self.session.is_none() {
            return false;
        }
        self.lose_upstream(SessionEnd::Abandoned(reason.to_string()));
        true
    }

    fn lose_upstream(&mut self, reason: SessionEnd) {
        if matches!(reason, SessionEnd::Violation(_)) {
            self.stats.violations += 1;
            tracing::warn!(%reason, "upstream broke the protocol");
        } else {
            tracing::info!(%reason, "upstream lost");
        }
        self.end_session(&reason.to_string());
        self.events
            .push_back(ReceiverEvent::UpstreamLost { reason });
    }

    /// Stream `stream` of session `session` is connected as `conn`, to an upstream whose
    /// certificate says it is `certified` (None in plaintext): its Welcome must say the
    /// same.
    pub fn connected(
        &mut self,
        now: Instant,
        session: u64,
        stream: u8,
        conn: ConnId,
        certified: Option<Identity>,
    ) {
        let snapshot_floor = match self.start {
            Start::Snapshot(_) => self.snapshot_floor,
            _ => 0,
        };
        match &mut self.session {
            Some(s) if s.id == session && (stream as usize) < s.streams.len() => {
                let slot = &mut s.streams[stream as usize];
                slot.conn = Some(conn);
                slot.welcomed = false;
                slot.epoch += 1;
                slot.certified = certified;
                let hello = Hello {
                    protocol_version: PROTOCOL_VERSION,
                    flags: 0,
                    role: self.config.identity.role,
                    peer_id: self.config.identity.peer_id.clone(),
                    region: self.config.identity.region.clone(),
                    token: self.config.token.clone(),
                    session,
                    stream,
                    streams: self.config.streams,
                    epoch: slot.epoch,
                    active: self.active,
                    staged: self.staged,
                    snapshot_floor,
                };
                s.last_heard = now;
                self.out.push_back(Transmit {
                    conn,
                    frame: Frame::Hello(hello),
                    close_after: false,
                });
            }
            // A late connection of a session given up.
            _ => self.events.push_back(ReceiverEvent::Close { conn }),
        }
    }

    /// Dialing stream `stream` failed; the session goes on while another stream lives.
    pub fn dial_failed(&mut self, session: u64, stream: u8, reason: &str) {
        let Some(s) = self.session.as_mut().filter(|s| s.id == session) else {
            return;
        };
        tracing::debug!(stream, reason, "dial failed");
        if s.streams.iter().all(|st| st.conn.is_none()) {
            self.lose_upstream(SessionEnd::CannotConnect(reason.to_string()));
        }
    }

    /// `conn` is gone. The session goes on with its other streams (the driver is asked
    /// to dial this one again) and tells the upstream which streams remain, so segments
    /// lost with this one are sent again and no others.
    pub fn closed(&mut self, conn: ConnId) {
        let Some(s) = self.session.as_mut() else {
            return;
        };
        let Some(index) = s.streams.iter().position(|st| st.conn == Some(conn)) else {
            return;
        };
        let lost_epoch = s.streams[index].epoch;
        s.streams[index].conn = None;
        s.streams[index].welcomed = false;
        let id = s.id;
        if s.streams.iter().all(|st| st.conn.is_none()) {
            return self.lose_upstream(SessionEnd::StreamsClosed);
        }
        self.queue_want();
        let lost: Vec<(u64, u32)> = self
            .nacks
            .iter()
            .filter(|(_, carrier)| **carrier == (index, lost_epoch))
            .map(|(key, _)| *key)
            .collect();
        for (version, index) in lost {
            self.nack(version, index);
        }
        if index < self.stream_count() as usize {
            self.events.push_back(ReceiverEvent::Dial {
                session: id,
                stream: index as u8,
            });
        }
    }

    /// The number of streams the session uses now.
    pub fn stream_count(&self) -> u8 {
        self.tuner
            .as_ref()
            .map_or(self.config.streams, StreamTuner::current)
    }

    /// Streams of the current session the upstream has welcomed: a benchmark starts
    /// its clock once they are all up, so connection set-up is not timed.
    pub fn welcomed_streams(&self) -> u8 {
        self.session.as_ref().map_or(0, |s| {
            s.streams
                .iter()
                .filter(|st| st.conn.is_some() && st.welcomed)
                .count() as u8
        })
    }

    /// Dials the streams the tuner added. It never lowers the count, so no stream is
    /// closed with segments in flight; the streams below `from` are open or being
    /// dialled already (a lost one is dialled again by [`Receiver::closed`]).
    fn open_streams(&mut self, from: u8, to: u8) {
        let Some(s) = self.session.as_ref() else {
            return;
        };
        for stream in from..to {
            self.events.push_back(ReceiverEvent::Dial {
                session: s.id,
                stream,
            });
        }
    }

    /// Starts over from `version`: what is held of it and later versions is dropped.
    /// An actor calls this after refusing a delta, to fetch the chain again.
    pub fn rewind(&mut self, version: u64) {
        self.next_version = version;
        self.tip = (self.active.version + 1 == version).then_some(self.active);
        self.forget_held();
        self.queue_want();
    }

    /// Starts over as a receiver with no weights: the next Welcome's snapshot is taken
    /// afresh. An actor calls this after refusing its snapshot.
    pub fn rejoin(&mut self) {
        self.start = Start::Snapshot(None);
        self.next_version = 0;
        self.tip = None;
        self.forget_held();
    }

    fn forget_held(&mut self) {
        self.assemblies.clear();
        self.nacks.clear();
        self.held_bytes = 0;
    }

    /// Sends a Status report to the upstream.
    pub fn report(&mut self, note: String) {
        let frame = Frame::Status {
            active: self.active,
            staged: self.staged,
            note,
        };
        // Without a session the report is dropped: the next Hello carries the same.
        let _ = self.send_control(frame);
    }

    fn queue_want(&mut self) {
        let Some(s) = &mut self.session else { return };
        // A joining receiver says nothing until a Welcome named its snapshot.
        if s.upstream.is_none() || self.start == Start::Snapshot(None) {
            return;
        }
        s.wants += 1;
        let seq = s.wants;
        // Every connected stream counts as live, welcomed or not: the upstream may
        // already be sending on one whose Welcome is still on its way here.
        let live_streams = s
            .streams
            .iter()
            .enumerate()
            .filter(|(_, st)| st.conn.is_some())
            .fold(0u64, |mask, (k, _)| mask | 1 << k);
        let progress: Vec<Progress> = self
            .assemblies
            .range(self.next_version..)
            .take(MAX_WANT_VERSIONS)
            .map(|(v, a)| a.progress(*v))
            .collect();
        let epochs = s.streams.iter().map(|st| st.epoch).collect();
        let frame = Frame::Want {
            seq,
            next_version: self.next_version,
            snapshot: self.start == Start::Snapshot(Some(self.next_version)),
            composed: self.wants_composed(),
            live_streams,
            epochs,
            progress,
        };
        // A newer Want replaces one still queued: it says everything the old one did.
        self.out
            .retain(|transmit| !matches!(transmit.frame, Frame::Want { .. }));
        let _ = self.send_control(frame);
    }

    fn nack(&mut self, version: u64, index: u32) {
        self.stats.nacks_sent += 1;
        if let Some(carrier) = self.send_control(Frame::Nack { version, index }) {
            self.nacks.insert((version, index), carrier);
        }
    }

    /// Queues `frame` on the first welcomed stream; returns that stream's index and
    /// epoch.
    fn send_control(&mut self, frame: Frame) -> Option<(usize, u32)> {
        let (index, stream) = self
            .session
            .as_ref()?
            .streams
            .iter()
            .enumerate()
            .find(|(_, st)| st.welcomed)?;
        self.out.push_back(Transmit {
            conn: stream.conn?,
            frame,
            close_after: false,
        });
        Some((index, stream.epoch))
    }

    /// The next frame to write.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.out.pop_front()
    }

    pub fn poll_event(&mut self) -> Option<ReceiverEvent> {
        self.events.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        let idle = self
            .session
            .as_ref()
            .map(|s| s.last_heard + self.config.idle_timeout);
        idle.into_iter()
            .chain(self.tune_at)
            .chain(self.behind_at())
            .min()
    }

    /// When a relay's session that brings too little while an expected version is
    /// lacking is given up.
    fn behind_at(&self) -> Option<Instant> {
        if !self.lacks(self.expected?) {
            return None;
        }
        let upstream = self.session.as_ref()?.upstream.as_ref()?;
        if upstream.role != Role::Relay {
            return None;
        }
        self.progress_at?.checked_add(self.config.behind_timeout)
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        if let (Some(at), Some(interval), Some(tuner)) =
            (self.tune_at, self.config.tune_interval, self.tuner.as_mut())
            && now >= at
        {
            let bytes = self.stats.segment_bytes - self.tune_bytes;
            let elapsed = (now - at + interval).as_secs_f64();
            self.tune_bytes = self.stats.segment_bytes;
            self.tune_at = Some(now + interval);
            let before = tuner.current();
            let after = tuner.observe(bytes as f64 / elapsed);
            if after != before {
                tracing::debug!(before, after, "stream count tuned");
                self.open_streams(before, after);
            }
        }
        if self
            .session
            .as_ref()
            .is_some_and(|s| now >= s.last_heard + self.config.idle_timeout)
        {
            let idle = self.config.idle_timeout;
            self.lose_upstream(SessionEnd::Silent(idle));
        } else if let Some(version) = self.expected
            && self.behind_at().is_some_and(|at| now >= at)
        {
            let waited = self.config.behind_timeout;
            self.lose_upstream(SessionEnd::Behind { version, waited });
        }
    }
}

fn truncated(reason: &str) -> String {
    let mut end = reason.len().min(crate::frame::MAX_REASON_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].to_string()
}

#[cfg(test)]
mod behind_tests;
#[cfg(test)]
mod run_tests;
#[cfg(test)]
mod signature_tests;
#[cfg(test)]
mod tests;
