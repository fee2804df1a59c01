//! The upstream side of the protocol (docs/wire-protocol.md §5): a hub or a relay serving
//! artifacts to subscribed sessions, each of several streams.
//!
//! Sans-IO: the driver reports connections, frames, completed writes and time; the
//! sender answers with frames to write ([`Sender::poll_transmit`]), requests and
//! notices ([`Sender::poll_event`]) and its next deadline ([`Sender::poll_timeout`]).
//!
//! Each connection has a window of [`SenderConfig::window_frames`] frames: a frame is
//! handed to the driver only while the window has room, and room comes back when the
//! driver reports the write done ([`Sender::on_sent`]). So the driver's queue per
//! connection is bounded, a slow subscriber only ever holds its own window, and one that
//! makes no progress for [`SenderConfig::stall_timeout`] is dropped (it resumes later
//! from what it holds).
//!
//! A session's streams take its frames fewest segments in flight first, the lowest on a
//! tie: a version's first segment rides the stream the versions before it kept open, a
//! transfer of many segments spreads over every stream, and a slower stream carries
//! less. Sessions take turns.
//!
//! A store-backed sender also serves peers that join with no weights: a Want with the
//! snapshot flag gets its next version as a snapshot artifact (loaded on demand, held
//! while a session needs it: it is a whole checkpoint), then the deltas after it.
//!
//! It also serves catch-up in one artifact: a session at least two versions behind the
//! store's latest version v whose Want accepts composed catch-up gets, if the driver's
//! plan finds it cheaper by bytes ([`ArtifactKey::Composed`]), the composed delta
//! from `next_version - 1` to v (Offer kind 3) in place of the deltas in between, and
//! nothing after it until its next Want moves past v. Otherwise it replays the deltas.
//!
//! The modules: [`artifacts`] holds, loads and evicts every kind of artifact by one
//! mechanism, `subscribe` takes the subscribers' frames, `session` keeps what each has
//! been sent, and this one chooses the frames to write and keeps time.

mod artifacts;
mod auth;
mod session;
mod subscribe;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use aurora_delta::{
    ArtifactSignature, DeltaError, Hash, RunId, SignatureError, Statement, VerifyingKey,
};

use self::artifacts::Artifact;
pub use self::artifacts::{ArtifactKey, KeptSnapshot, StoredArtifact, offer_signature};
pub use self::auth::{Auth, AuthRefusal};
use self::session::{
    Conn, Hedge, SegState, Session, hedgeable, next_artifact_frame, next_hedge_frame,
    session_artifact,
};
use crate::frame::{Commit, Frame, Hello, MAX_TRANSFER_SEGMENTS, Role, VersionRef};
use crate::snapshot::NotASnapshot;
use crate::{ConnId, Identity, Transmit};

#[derive(Debug, Clone)]
pub struct SenderConfig {
    pub identity: Identity,
    pub auth: Auth,
    /// Frames handed to the driver per connection before a write completes.
    pub window_frames: usize,
    /// Versions a subscriber may have in flight beyond the one it is completing.
    pub versions_ahead: u64,
    /// Deltas kept in memory beyond those a subscriber still needs: at most this many,
    /// and at most [`SenderConfig::retain_bytes`] of them, whichever binds first; the
    /// newest is always kept.
    pub retain_versions: usize,
    /// Bytes of the deltas kept as [`SenderConfig::retain_versions`] says. A delta's size
    /// grows with the model's (about 46 MB at 4B, 1% changed), so a count alone would
    /// make a relay's memory grow with it too.
    pub retain_bytes: u64,
    /// Whether older versions, snapshots and composed catch-up deltas can be loaded on
    /// request ([`SenderEvent::Load`]); a relay answers Unavailable instead, and replays.
    pub store_backed: bool,
    pub max_sessions: usize,
    /// Control frames queued per session; a session that lets more pile up is dropped.
    pub max_control_queue: usize,
    /// Nacks accepted per session before it is dropped as broken or hostile.
    pub max_nacks: u32,
    pub handshake_timeout: Duration,
    pub keepalive_interval: Duration,
    pub stall_timeout: Duration,
    /// A version no larger than this whose Want has not come back in twice the
    /// session's delivery time (`hedge_first` before there is one) goes out once more,
    /// each frame on a stream other than its own (§5.13); 0 never.
    pub hedge_max_bytes: u64,
    pub hedge_first: Duration,
    /// The least wait before a version is sent again, however fast the session: below
    /// it a late Want is a busy receiver's event loop more likely than a stalled stream.
    pub hedge_min: Duration,
    /// The trainer's public key, where the deployment signs: every artifact and Commit
    /// this sender is given must carry the trainer's signature, or it is refused and
    /// never served (docs/security.md).
    pub trainer_key: Option<VerifyingKey>,
    /// The run this sender serves, named in its Welcomes and in every statement it
    /// checks: a hub's own (its store's); `None` for a relay, which learns it from its
    /// upstream ([`Sender::serve_run`]).
    pub run: Option<RunId>,
}

impl SenderConfig {
    pub fn new(identity: Identity, auth: Auth) -> Self {
        SenderConfig {
            identity,
            auth,
            window_frames: 4,
            versions_ahead: 4,
            retain_versions: 4,
            retain_bytes: 256 << 20,
            store_backed: false,
            max_sessions: 1024,
            max_control_queue: 64,
            max_nacks: 1024,
            handshake_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(2),
            stall_timeout: Duration::from_secs(30),
            hedge_max_bytes: 4 << 20,
            hedge_first: Duration::from_millis(200),
            hedge_min: Duration::from_millis(50),
            trainer_key: None,
            run: None,
        }
    }
}

/// Which connection [`Sender::poll_transmit`] tries first, least first: its session's
/// turn (none, for a handshake, before any), whether it is late, its segments in
/// flight, its stream, its id.
type TransmitRank = (Option<u64>, bool, usize, u8, ConnId);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SenderEvent {
    /// Load `key` from the store and pass it, or why there is none, to
    /// [`Sender::loaded`]. A composed delta (for a session at `base + 1` that accepts
    /// one) is worth loading only if the catch-up plan says it costs fewer bytes than
    /// replaying the deltas; otherwise the driver declines it and the session replays.
    Load(ArtifactKey),
    /// Close `conn` now, without writing anything more.
    Close { conn: ConnId, reason: String },
    /// A session finished its handshake.
    Subscribed {
        peer_id: String,
        role: Role,
        region: String,
        session: u64,
    },
    /// A session was dropped (its connections are being closed).
    Dropped { peer_id: String, reason: String },
    /// A downstream reported its versions.
    Status {
        peer_id: String,
        active: VersionRef,
        staged: Option<u64>,
        note: String,
    },
}

/// Why an artifact was refused (it is never served in part).
#[derive(Debug, thiserror::Error)]
pub enum SenderError {
    #[error("artifact refused: {0}")]
    Malformed(#[from] DeltaError),
    #[error("artifact refused: {count} bytes after the delta header")]
    TrailingBytes { count: usize },
    #[error(
        "the descriptor of version {version} names a target hash: an Offer leaves it pending \
         (all zero) for the Seal (wire-protocol §4.4)"
    )]
    TargetHashOffered { version: u64 },
    #[error("{wanted} was wanted, but the artifact goes from version {base} to {target}")]
    NotTheArtifact {
        wanted: ArtifactKey,
        base: u64,
        target: u64,
    },
    #[error("artifact refused: {0}")]
    NotASnapshot(#[from] NotASnapshot),
    #[error("{count} segments exceed the protocol's limit of {MAX_TRANSFER_SEGMENTS}")]
    TooManySegments { count: usize },
    #[error("segment {index} of version {version} does not match the table")]
    SegmentMismatch { version: u64, index: u32 },
    #[error("the table of version {version} hashes to id {computed}, not {claimed}")]
    WrongId {
        version: u64,
        computed: Hash,
        claimed: Hash,
    },
    #[error("{key} could not be loaded: {reason}")]
    NotLoaded { key: ArtifactKey, reason: String },
    #[error("version {version} is already published with different contents")]
    Conflict { version: u64 },
    #[error("{key} is not being published")]
    UnknownArtifact { key: ArtifactKey },
    #[error("refused: {0}")]
    Signature(#[from] SignatureError),
}

/// Counters for benchmarks and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SenderStats {
    pub segments_sent: u64,
    pub segment_bytes_sent: u64,
    /// Segments sent again after a nack or a lost stream.
    pub segments_resent: u64,
    pub nacks: u64,
    pub sessions_dropped: u64,
    /// Times it stopped serving ([`Sender::suspend`]).
    pub suspensions: u64,
    /// Offers of composed deltas (a catch-up served in one artifact).
    pub composed_offers: u64,
    /// Hellos refused because the peer is not who it says: a wrong token, or a Hello
    /// that does not name the identity of the connection's certificate.
    pub refused_auth: u64,
    /// Hellos refused as replays: of a session that ended, or of a superseded epoch.
    pub refused_stale: u64,
    /// Connections closed without a Hello within the handshake timeout.
    pub handshake_timeouts: u64,
    /// Loads the driver deferred (over its build budget): the sessions wanting them
    /// were told to come back later.
    pub loads_deferred: u64,
    /// Frames of overdue versions sent once more on another stream (§5.13).
    pub frames_hedged: u64,
    /// Composed deltas not built because the peer had another built or held, or the
    /// target had [`MAX_COMPOSED_PER_TARGET`] bases already: the session replayed.
    pub composed_refused: u64,
}

/// Ended sessions remembered so that a replayed Hello cannot revive one.
pub const MAX_RETIRED_SESSIONS: usize = 4096;
/// Composed deltas to one target built or held at once, from different bases, for every
/// peer together: actors far behind at a handful of versions each get theirs, and a
/// peer cycling through bases gets no more than its one ([`Sender::composed_for_peer`]).
pub const MAX_COMPOSED_PER_TARGET: usize = 4;

pub struct Sender {
    config: SenderConfig,
    artifacts: BTreeMap<ArtifactKey, Artifact>,
    /// Highest version a load can provide (the store's latest).
    loadable_max: Option<u64>,
    /// The versions the store holds snapshots of.
    snapshots_stored: BTreeSet<u64>,
    /// The snapshot a relay takes from upstream to serve its region's joins, held (its
    /// segments in the driver's file, not on the heap) until a newer one replaces it
    /// ([`Sender::begin_artifact`]); set before its Offer arrives by
    /// [`Sender::expect_snapshot`].
    kept_snapshot: Option<u64>,
    /// Whether a joiner has wanted the kept snapshot since it was kept, or one while
    /// none was: a relay takes a newer one only for a region where peers join
    /// ([`Sender::kept_snapshot_wanted`]).
    kept_wanted: bool,
    /// Whether a joiner was told of a newer joinable snapshot than the kept one (its
    /// Hello's floor is above it): the kept one is not offered to it, and a newer one
    /// is due at once ([`Sender::kept_snapshot_outdated`]).
    kept_outdated: bool,
    /// The run served: the configuration's, or learned ([`Sender::serve_run`]).
    run: Option<RunId>,
    /// Hellos answered once [`Sender::release_hellos`] is called, while a relay does not
    /// yet know which snapshot it will offer ([`Sender::hold_hellos`]).
    held_hellos: Option<Vec<(ConnId, Hello)>>,
    /// Versions below this one are not held and never will be (evicted, or older than
    /// what a relay started from); a session asking for one is told so.
    floor: u64,
    loading: BTreeSet<ArtifactKey>,
    /// The composed delta each peer's sessions are served, while it is built or held:
    /// one per peer.
    composed_for_peer: HashMap<String, ArtifactKey>,
    /// Artifacts that cannot be served, with why: sessions wanting one are told it is
    /// unavailable, except those of a composed delta, which replay the deltas instead.
    unavailable: BTreeMap<ArtifactKey, String>,
    /// Artifacts the driver cannot load now (over its build budget), with why: sessions
    /// wanting one are told it is unavailable, and the next Want asks again.
    deferred: BTreeMap<ArtifactKey, String>,
    /// Sessions that ended here (a set, and its order to forget the oldest).
    retired: BTreeSet<u64>,
    retired_order: VecDeque<u64>,
    commit: Option<Commit>,
    /// Why nobody is served now ([`Sender::suspend`]).
    suspended: Option<String>,
    sessions: HashMap<u64, Session>,
    conns: BTreeMap<ConnId, Conn>,
    /// The session [`Sender::poll_transmit`] serves first: sessions take turns.
    next_session: u64,
    events: VecDeque<SenderEvent>,
    stats: SenderStats,
}

impl Sender {
    pub fn new(config: SenderConfig) -> Sender {
        assert!(
            config.window_frames > 0,
            "a window of zero frames sends nothing"
        );
        Sender {
            run: config.run,
            config,
            artifacts: BTreeMap::new(),
            loadable_max: None,
            snapshots_stored: BTreeSet::new(),
            kept_snapshot: None,
            kept_wanted: false,
            kept_outdated: false,
            held_hellos: None,
            floor: 0,
            loading: BTreeSet::new(),
            composed_for_peer: HashMap::new(),
            unavailable: BTreeMap::new(),
            deferred: BTreeMap::new(),
            retired: BTreeSet::new(),
            retired_order: VecDeque::new(),
            commit: None,
            suspended: None,
            sessions: HashMap::new(),
            conns: BTreeMap::new(),
            next_session: 0,
            events: VecDeque::new(),
            stats: SenderStats::default(),
        }
    }

    pub fn stats(&self) -> &SenderStats {
        &self.stats
    }

    /// Sessions subscribed now.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Serves nobody, for `reason`, until [`Sender::resume`] (a relay without an
    /// upstream, docs/wire-protocol.md §8): every session is dropped, so its subscriber
    /// moves to its next upstream, and every Hello is refused as Busy with the reason.
    pub fn suspend(&mut self, reason: String) {
        let mut ids: Vec<u64> = self.sessions.keys().copied().collect();
        // In order: the same run, the same events (the simulation replays seeds).
        ids.sort_unstable();
        for id in ids {
            self.drop_session(id, reason.clone());
        }
        self.stats.suspensions += 1;
        self.suspended = Some(reason);
    }

    pub fn resume(&mut self) {
        self.suspended = None;
    }

    pub(crate) fn is_suspended(&self) -> bool {
        self.suspended.is_some()
    }

    /// The newest version this sender can serve.
    pub fn latest(&self) -> Option<u64> {
        self.deltas()
            .next_back()
            .map(|(version, _)| version)
            .max(self.loadable_max)
    }

    /// Versions below `version` will never be held here (a relay that starts from
    /// `version`): what is held of them goes, and sessions wanting one are told so.
    pub(crate) fn set_floor(&mut self, version: u64) {
        self.floor = self.floor.max(version);
        let floor = self.floor;
        self.artifacts
            .retain(|key, _| !matches!(key, ArtifactKey::Delta(v) if *v < floor));
        // A kept snapshot whose next deltas will not be held goes.
        self.evict();
    }

    /// Tells a store-backed sender the newest version its store holds.
    pub fn set_loadable(&mut self, latest: Option<u64>) {
        self.loadable_max = latest;
        // Only composed deltas to the latest version are ever asked for again.
        self.unavailable.retain(|key, _| match key {
            ArtifactKey::Composed { target, .. } => latest.is_none_or(|latest| *target >= latest),
            _ => true,
        });
    }

    /// Tells a store-backed sender the versions its store holds snapshots of: every
    /// Welcome offers one to peers that join with no weights.
    pub fn set_snapshots(&mut self, versions: impl IntoIterator<Item = u64>) {
        self.snapshots_stored = versions.into_iter().collect();
    }

    /// The snapshot a Welcome offers: the newest at or below the committed version (a
    /// joiner activates it at once, and no peer runs weights that were not committed:
    /// it would be ahead of the step its actors are to generate on); none where there
    /// is no store to build one from, and a relay's kept one only while it holds (or
    /// is yet to receive) every delta after it, which the joiner goes on with.
    fn snapshot_offer(&self) -> Option<u64> {
        let committed = self.commit.map_or(u64::MAX, |commit| commit.target.version);
        if self.config.store_backed {
            return self
                .snapshots_stored
                .range(..=committed)
                .next_back()
                .copied();
        }
        self.kept_snapshot
            .filter(|&kept| kept <= committed && self.holds_deltas_after(kept))
    }

    /// A relay is about to take the snapshot of `version` from upstream: Welcomes offer
    /// it from now on, and sessions that want it wait for it to arrive, served
    /// cut-through as its segments come ([`Sender::begin_artifact`]).
    pub(crate) fn expect_snapshot(&mut self, version: u64) {
        if self.kept_snapshot.replace(version) != Some(version) {
            self.kept_wanted = false;
            self.kept_outdated = false;
        }
        self.unavailable.remove(&ArtifactKey::Snapshot(version));
        // Another one goes once no session is served it.
        self.evict();
    }

    /// Whether every delta after `version` is held here or still to come: a snapshot of
    /// `version` can be served.
    pub(crate) fn holds_deltas_after(&self, version: u64) -> bool {
        self.floor <= version.saturating_add(1)
    }

    /// The snapshot a relay keeps for its region's joins, if any.
    pub fn kept_snapshot(&self) -> Option<u64> {
        self.kept_snapshot
    }

    /// Whether a joiner has wanted the kept snapshot since it was kept, or, while none
    /// is, was welcomed without one.
    pub(crate) fn kept_snapshot_wanted(&self) -> bool {
        self.kept_wanted
    }

    /// Whether a joiner was told of a newer joinable snapshot than the kept one: a
    /// newer one is due now, not once the deltas after the kept one have grown.
    pub(crate) fn kept_snapshot_outdated(&self) -> bool {
        self.kept_outdated
    }

    /// The run this sender serves, once known.
    pub fn run(&self) -> Option<RunId> {
        self.run
    }

    /// A relay learned its run from its upstream (`aurora_proto::Receiver::run`): its
    /// Welcomes name it from now on, and every statement it checks is of it. A sender
    /// keeps the first run it is given.
    pub(crate) fn serve_run(&mut self, run: RunId) {
        if self.run.is_none() {
            self.run = Some(run);
        }
    }

    /// Checks `signature` over `statement` where a trainer key is pinned (of the run
    /// served; before it is known nothing verifies).
    pub(crate) fn check_signature(
        &self,
        statement: &Statement,
        signature: Option<&ArtifactSignature>,
    ) -> Result<(), SignatureError> {
        match &self.config.trainer_key {
            None => Ok(()),
            Some(key) => {
                aurora_delta::verify(key, &self.run.unwrap_or_default(), statement, signature)
            }
        }
    }

    /// Stops serving the kept snapshot, for `reason` (it will not be whole, or the deltas
    /// after it are no longer all held, or outgrew what a relay keeps): sessions that
    /// want it are told it is unavailable, and fetch one elsewhere.
    pub(crate) fn withdraw_snapshot(&mut self, reason: String) {
        if let Some(version) = self.kept_snapshot.take() {
            self.kept_wanted = false;
            self.kept_outdated = false;
            let key = ArtifactKey::Snapshot(version);
            self.artifacts.remove(&key);
            self.unavailable.insert(key, reason);
        }
    }

    /// Holds every Hello unanswered until [`Sender::release_hellos`]: a relay that will
    /// offer the snapshot it takes, and learns which one only from its upstream's
    /// Welcome, would otherwise send the joiners that arrive first to the hub. A peer
    /// kept waiting past the handshake timeout is closed, and tries its next upstream.
    pub(crate) fn hold_hellos(&mut self) {
        self.held_hellos.get_or_insert_with(Vec::new);
    }

    /// Answers the Hellos held since [`Sender::hold_hellos`], and every one after.
    pub(crate) fn release_hellos(&mut self, now: Instant) {
        for (conn, hello) in self.held_hellos.take().unwrap_or_default() {
            if self.conns.get(&conn).is_some_and(|c| !c.closing) {
                self.on_hello(now, conn, hello);
            }
        }
    }

    /// Announces a commit to every session, now and at every later handshake, with its
    /// signature as it came (a relay cannot sign). With a pinned trainer key, a commit
    /// whose signature is missing or does not verify is refused.
    pub fn commit(&mut self, commit: Commit) -> Result<(), SenderError> {
        self.check_signature(&commit.statement(), commit.signature.as_ref())?;
        if self
            .commit
            .is_some_and(|c| c.target.version >= commit.target.version)
        {
            return Ok(());
        }
        self.commit = Some(commit);
        let mut ids: Vec<u64> = self.sessions.keys().copied().collect();
        // In order: the same run, the same events (the simulation replays seeds).
        ids.sort_unstable();
        for id in ids {
            self.queue_control(id, Frame::Commit(commit));
        }
        Ok(())
    }

    pub fn poll_event(&mut self) -> Option<SenderEvent> {
        self.events.pop_front()
    }

    /// The next frame to write, on a connection whose window has room.
    ///
    /// Sessions take turns, and within a session the stream with the fewest segments in
    /// flight goes first, the lowest on a tie. A version that begins with no segment in
    /// flight, as one does between steps, thus has its first segment ride the same
    /// stream every time, whose congestion window and pacing rate the versions before it
    /// kept open, instead of one that has sat idle for several versions and starts again
    /// from a few packets a round trip (BENCHMARKS.md, "Delta against full sync in
    /// the sparse regime"); a transfer of many segments spreads over every stream, each
    /// taking more as it drains.
    ///
    /// A late stream goes after every other: one whose version went overdue has most
    /// likely had a retransmission timeout, after which its congestion window starts
    /// again from ten packets, and small versions seconds apart regrow it over tens of
    /// seconds, every one of them waiting for it meanwhile (BENCHMARKS.md, the spells).
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        let window = self.config.window_frames;
        // A heap, not a sort: most calls take the first connection they look at.
        let mut order: BinaryHeap<Reverse<TransmitRank>> = self
            .conns
            .iter()
            .filter(|(_, c)| c.in_flight.len() < window)
            .map(|(id, c)| {
                // Handshake answers, on connections with no session yet (None), go first;
                // then the session at or after `next_session`, wrapping around.
                let turn = c
                    .session
                    .map(|session| session.wrapping_sub(self.next_session));
                let segments = c.in_flight.iter().filter(|segment| **segment).count();
                Reverse((turn, c.late, segments, c.stream, *id))
            })
            .collect();
        while let Some(Reverse((.., conn))) = order.pop() {
            if let Some((frame, close_after)) = self.next_frame(conn, now) {
                let c = self.conns.get_mut(&conn).expect("listed above");
                c.in_flight
                    .push_back(matches!(frame, Frame::Segment { .. }));
                c.last_send = now;
                if c.in_flight.len() == window {
                    c.stalled_since.get_or_insert(now);
                }
                if let Some(session) = c.session {
                    self.next_session = session.wrapping_add(1);
                }
                return Some(Transmit {
                    conn,
                    frame,
                    close_after,
                });
            }
        }
        None
    }

    fn next_frame(&mut self, conn: ConnId, now: Instant) -> Option<(Frame, bool)> {
        let c = self.conns.get_mut(&conn)?;
        if let Some(direct) = c.direct.pop_front() {
            return Some(direct);
        }
        let id = c.session.filter(|_| !c.closing)?;
        let (c_stream, c_epoch) = (c.stream, c.epoch);
        let session = self.sessions.get_mut(&id)?;
        if let Some(frame) = session.control.pop_front() {
            return Some((frame, false));
        }
        let next_version = session.next_version.filter(|_| !session.blocked)?;
        if let Some((base, target)) = session.composed {
            let key = ArtifactKey::Composed { base, target };
            if let Some(artifact) = self.artifacts.get(&key) {
                // Nothing after it until the next Want moves past it: the subscriber
                // holds only one version beyond its window, this one.
                let state = session.versions.entry(target).or_default();
                let on = (c_stream, c_epoch);
                return next_artifact_frame(state, artifact, key, on, now, &mut self.stats)
                    .map(|frame| (frame, false));
            }
            let reason = self.why_unavailable(key)?;
            let session = self.sessions.get_mut(&id).expect("looked up above");
            tracing::info!(
                peer = session.peer_id,
                base,
                target,
                reason,
                "catch-up replays the deltas"
            );
            session.composed = None;
            session.versions.remove(&target);
        }
        let session = self.sessions.get_mut(&id).expect("looked up above");
        for version in next_version..next_version + self.config.versions_ahead {
            let key = session.artifact_for(version);
            let Some(artifact) = self.artifacts.get(&key) else {
                // Not published yet: waited for, and nothing after it goes first.
                let Some(reason) = self.why_unavailable(key) else {
                    break;
                };
                let session = self.sessions.get_mut(&id).expect("looked up above");
                session.blocked = true;
                return Some((Frame::Unavailable { version, reason }, false));
            };
            let state = session.versions.entry(version).or_default();
            let on = (c_stream, c_epoch);
            if let Some(frame) = next_artifact_frame(state, artifact, key, on, now, &mut self.stats)
            {
                return Some((frame, false));
            }
        }
        // Nothing new to send: the stream carries copies of overdue versions' frames.
        let session = self.sessions.get_mut(&id).expect("looked up above");
        for (&version, state) in session.versions.range_mut(next_version..) {
            let key = session_artifact(session.snapshot, session.composed, version);
            if let Some(artifact) = self.artifacts.get(&key)
                && let Some(frame) =
                    next_hedge_frame(state, artifact, key, c_stream, &mut self.stats)
            {
                return Some((frame, false));
            }
        }
        None
    }

    /// When each version waiting for its Want, and not yet sent again, becomes overdue
    /// (§5.13): (session, version, deadline). None where copies are off.
    fn hedge_deadlines(&self) -> impl Iterator<Item = (u64, u64, Instant)> + '_ {
        let max_bytes = self.config.hedge_max_bytes;
        self.sessions
            .iter()
            .filter(move |_| max_bytes > 0)
            .flat_map(move |(&id, session)| {
                // Twice the session's delivery time: a version of the usual size is
                // overdue after that; versions of one session differ in size by far less.
                let wait = session
                    .delivery
                    .map_or(self.config.hedge_first, |delivery| {
                        (delivery * 2).max(self.config.hedge_min)
                    });
                session
                    .versions
                    .iter()
                    .filter_map(move |(&version, state)| {
                        let artifact = self.artifacts.get(&session.artifact_for(version))?;
                        (state.hedge.is_none() && hedgeable(state, artifact, max_bytes))
                            .then_some((id, version, state.written_at? + wait))
                    })
            })
    }

    /// Marks every version overdue at `now` to be sent again.
    fn hedge_overdue(&mut self, now: Instant) {
        let overdue: Vec<(u64, u64)> = self
            .hedge_deadlines()
            .filter(|&(_, _, deadline)| deadline <= now)
            .map(|(id, version, _)| (id, version))
            .collect();
        for (id, version) in overdue {
            let session = self.sessions.get_mut(&id).expect("listed above");
            tracing::debug!(
                peer = session.peer_id,
                version,
                "sending an overdue version again"
            );
            if let Some(state) = session.versions.get_mut(&version) {
                state.hedge = Some(Hedge::default());
            }
            self.mark_carriers(id, version, true);
        }
    }

    /// Marks the live connections that carried frames of `version` of session `id` late
    /// or not: its Offer's and Seal's streams, and those of its segments not reported
    /// held (of the epoch they went out in). No Want reports segments while a version is
    /// in flight, so an overdue version's carriers are all suspect; a small version
    /// mostly rides one stream.
    fn mark_carriers(&mut self, id: u64, version: u64, late: bool) {
        let Some(session) = self.sessions.get(&id) else {
            return;
        };
        let Some(state) = session.versions.get(&version) else {
            return;
        };
        // (stream, epoch), none where any epoch's connection carried it.
        let carriers: BTreeSet<(u8, Option<u32>)> = state
            .segs
            .iter()
            .filter_map(|seg| match *seg {
                SegState::Sent { stream, epoch } => Some((stream, Some(epoch))),
                _ => None,
            })
            .chain(
                [state.offer_on, state.seal_on]
                    .into_iter()
                    .flatten()
                    .map(|s| (s, None)),
            )
            .collect();
        for (stream, epoch) in carriers {
            let conn = session.streams.get(usize::from(stream)).copied().flatten();
            if let Some(c) = conn.and_then(|conn| self.conns.get_mut(&conn))
                && epoch.is_none_or(|epoch| c.epoch == epoch)
                && c.late != late
            {
                tracing::debug!(peer = session.peer_id, stream, late, "stream lateness");
                c.late = late;
            }
        }
    }

    /// The earliest instant at which [`Sender::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let hedge = self
            .hedge_deadlines()
            .map(|(_, _, deadline)| deadline)
            .min();
        self.conns
            .values()
            .map(|c| {
                if c.session.is_none() {
                    c.opened_at + self.config.handshake_timeout
                } else if let Some(since) = c.stalled_since {
                    since + self.config.stall_timeout
                } else {
                    c.last_send + self.config.keepalive_interval
                }
            })
            .chain(hedge)
            .min()
    }

    /// Closes handshakes that took too long, drops stalled sessions and queues
    /// keepalives on idle connections.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.hedge_overdue(now);
        let mut stalled = BTreeSet::new();
        let mut late = Vec::new();
        for (&conn, c) in &mut self.conns {
            match (c.session, c.stalled_since) {
                (None, _) if now >= c.opened_at + self.config.handshake_timeout => {
                    late.push(conn);
                }
                (Some(id), Some(since)) if now >= since + self.config.stall_timeout => {
                    stalled.insert(id);
                }
                (Some(_), None)
                    if now >= c.last_send + self.config.keepalive_interval
                        && c.direct.is_empty() =>
                {
                    c.direct.push_back((Frame::Keepalive, false));
                    c.last_send = now;
                }
                _ => {}
            }
        }
        for conn in late {
            self.conns.remove(&conn);
            self.stats.handshake_timeouts += 1;
            self.events.push_back(SenderEvent::Close {
                conn,
                reason: "no Hello in time".into(),
            });
        }
        for id in stalled {
            let timeout = self.config.stall_timeout;
            self.drop_session(id, format!("no write completed for {timeout:?}: too slow"));
        }
    }
}

#[cfg(test)]
mod catch_up_tests;
#[cfg(test)]
mod stream_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod trust_tests;
