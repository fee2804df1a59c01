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
//! Segments are striped: a stream with room takes the next segment its session still
//! needs, so equal streams alternate round-robin and a slower stream carries less.
//!
//! A store-backed sender also serves peers that join with no weights: a Want with the
//! snapshot flag gets its next version as a snapshot artifact (loaded on demand, held
//! while a session needs it: it is a whole checkpoint), then the deltas after it.
//!
//! It also serves catch-up in one artifact: a session at least two versions behind the
//! store's latest version v whose Want accepts composed catch-up gets, if the driver's
//! plan finds it cheaper by bytes ([`SenderEvent::LoadComposed`]), the composed delta
//! from `next_version - 1` to v (Offer kind 3) in place of the deltas in between, and
//! nothing after it until its next Want moves past v. Otherwise it replays the deltas.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use aurora_delta::{DeltaFile, DeltaHeader, Hash, SegmentEntry};
use bytes::Bytes;

use crate::frame::{
    ArtifactKind, Frame, Hello, MAX_STREAMS, MAX_TRANSFER_SEGMENTS, PROTOCOL_VERSION, Progress,
    RejectCode, Role, VersionRef, Welcome,
};
use crate::{ConnId, Identity, ranges};

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

#[derive(Debug, Clone)]
pub struct SenderConfig {
    pub identity: Identity,
    pub auth: Auth,
    /// Frames handed to the driver per connection before a write completes.
    pub window_frames: usize,
    /// Versions a subscriber may have in flight beyond the one it is completing.
    pub versions_ahead: u64,
    /// Artifacts kept in memory beyond those a subscriber still needs.
    pub retain_versions: usize,
    /// Whether older versions, snapshots and composed catch-up deltas can be loaded on
    /// request ([`SenderEvent::Load`], [`SenderEvent::LoadSnapshot`],
    /// [`SenderEvent::LoadComposed`]); a relay answers Unavailable instead, and replays.
    pub store_backed: bool,
    pub max_sessions: usize,
    /// Control frames queued per session; a session that lets more pile up is dropped.
    pub max_control_queue: usize,
    /// Nacks accepted per session before it is dropped as broken or hostile.
    pub max_nacks: u32,
    pub handshake_timeout: Duration,
    pub keepalive_interval: Duration,
    pub stall_timeout: Duration,
}

impl SenderConfig {
    pub fn new(identity: Identity, auth: Auth) -> Self {
        SenderConfig {
            identity,
            auth,
            window_frames: 4,
            versions_ahead: 4,
            retain_versions: 4,
            store_backed: false,
            max_sessions: 1024,
            max_control_queue: 64,
            max_nacks: 1024,
            handshake_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(2),
            stall_timeout: Duration::from_secs(30),
        }
    }
}

/// A frame for the driver to write on `conn`; after writing it, the driver closes the
/// connection if `close_after` is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    pub conn: ConnId,
    pub frame: Frame,
    pub close_after: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SenderEvent {
    /// Load the stored artifact of `version` and pass it to [`Sender::insert_artifact`],
    /// or report [`Sender::load_failed`].
    Load { version: u64 },
    /// Load the stored snapshot of `version` as an artifact (docs/wire-protocol.md
    /// §4.4) and pass it to [`Sender::insert_snapshot`], or report
    /// [`Sender::snapshot_load_failed`].
    LoadSnapshot { version: u64 },
    /// A session at `base + 1` accepts a composed delta to `target`: if the catch-up
    /// plan says it costs fewer bytes than replaying the deltas, pass C(base -> target)
    /// to [`Sender::insert_composed`]; otherwise (or when it cannot be built) report
    /// [`Sender::composed_declined`], and the session replays the deltas.
    LoadComposed { base: u64, target: u64 },
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

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SenderError {
    #[error("artifact refused: {0}")]
    InvalidArtifact(String),
    #[error("version {version} is already published with different contents")]
    Conflict { version: u64 },
    #[error("version {version} is not being published")]
    UnknownVersion { version: u64 },
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
    /// Offers of composed deltas (a catch-up served in one artifact).
    pub composed_offers: u64,
}

struct Artifact {
    descriptor: Bytes,
    segments: Vec<Option<(Hash, Bytes)>>,
    seal: Option<(Hash, Vec<SegmentEntry>)>,
}

impl Artifact {
    fn present(&self, index: usize) -> bool {
        self.segments.get(index).is_some_and(Option::is_some)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SegState {
    Unsent,
    /// Written on stream `stream` in its connection of `epoch`.
    Sent {
        stream: u8,
        epoch: u32,
    },
    /// The subscriber said it holds it.
    Have,
}

#[derive(Default)]
struct SendVersion {
    offer_sent: bool,
    seal_sent: bool,
    /// States of the segments the artifact has (never longer: a hostile index cannot
    /// make it grow).
    segs: Vec<SegState>,
    /// The have-ranges of the last Want, for segments beyond `segs`.
    reported: Vec<std::ops::Range<u32>>,
    /// No index below this one is `Unsent` and present.
    cursor: usize,
    /// Segments sent at least once: a later send is a resend.
    ever_sent: BTreeSet<u32>,
}

impl SendVersion {
    fn state(&self, index: usize) -> SegState {
        match self.segs.get(index) {
            Some(state) => *state,
            None if ranges::contains(&self.reported, index as u32) => SegState::Have,
            None => SegState::Unsent,
        }
    }

    /// Callers pass only indices of segments the artifact has.
    fn set(&mut self, index: usize, state: SegState) {
        while self.segs.len() <= index {
            let next = self.state(self.segs.len());
            self.segs.push(next);
        }
        self.segs[index] = state;
        if state == SegState::Unsent {
            self.cursor = self.cursor.min(index);
        }
    }
}

struct Session {
    peer_id: String,
    streams: Vec<Option<ConnId>>,
    /// None until the first Want: nothing is sent before the subscriber says what it has.
    next_version: Option<u64>,
    /// The version the latest Want asked for as a snapshot (its next version).
    snapshot: Option<u64>,
    /// The composed delta (base, target) this session is served in place of the deltas
    /// from `base + 1` to `target`.
    composed: Option<(u64, u64)>,
    last_want: Option<u64>,
    versions: BTreeMap<u64, SendVersion>,
    control: VecDeque<Frame>,
    /// A version reported unavailable; nothing more is sent until the next Want.
    blocked: bool,
    nacks: u32,
}

struct Conn {
    session: Option<u64>,
    stream: u8,
    epoch: u32,
    credit: usize,
    /// Frames for this connection only (handshake answers).
    direct: VecDeque<(Frame, bool)>,
    opened_at: Instant,
    last_send: Instant,
    stalled_since: Option<Instant>,
    closing: bool,
}

pub struct Sender {
    config: SenderConfig,
    artifacts: BTreeMap<u64, Artifact>,
    /// Highest version a load can provide (the store's latest).
    loadable_max: Option<u64>,
    /// Versions below this one are not held and never will be (evicted, or older than
    /// what a relay started from); a session asking for one is told so.
    floor: u64,
    loading: BTreeSet<u64>,
    unavailable: BTreeMap<u64, String>,
    /// Snapshot artifacts, kept apart from the deltas (a snapshot of v is not D(v)) and
    /// only while a session wants one: each is a whole checkpoint.
    snapshots: BTreeMap<u64, Artifact>,
    /// The newest snapshot a load can provide (the store's newest).
    snapshot_loadable: Option<u64>,
    snapshots_loading: BTreeSet<u64>,
    snapshots_unavailable: BTreeMap<u64, String>,
    /// Composed deltas by (base, target), held only while a session is served one.
    composed: BTreeMap<(u64, u64), Artifact>,
    composed_loading: BTreeSet<(u64, u64)>,
    /// Composed deltas the driver declined (replaying is cheaper, or it could not build
    /// one), with why: their sessions replay the deltas.
    composed_declined: BTreeMap<(u64, u64), String>,
    commit: Option<VersionRef>,
    sessions: HashMap<u64, Session>,
    conns: BTreeMap<ConnId, Conn>,
    /// Round-robin start for [`Sender::poll_transmit`].
    next_conn: ConnId,
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
            config,
            artifacts: BTreeMap::new(),
            loadable_max: None,
            floor: 0,
            loading: BTreeSet::new(),
            unavailable: BTreeMap::new(),
            snapshots: BTreeMap::new(),
            snapshot_loadable: None,
            snapshots_loading: BTreeSet::new(),
            snapshots_unavailable: BTreeMap::new(),
            composed: BTreeMap::new(),
            composed_loading: BTreeSet::new(),
            composed_declined: BTreeMap::new(),
            commit: None,
            sessions: HashMap::new(),
            conns: BTreeMap::new(),
            next_conn: 0,
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

    /// The newest version this sender can serve.
    pub fn latest(&self) -> Option<u64> {
        self.artifacts
            .keys()
            .next_back()
            .copied()
            .max(self.loadable_max)
    }

    /// Versions below `version` will never be held here (a relay that started from
    /// weights of `version - 1`).
    pub fn set_floor(&mut self, version: u64) {
        self.floor = self.floor.max(version);
    }

    /// Tells a store-backed sender the newest version its store holds.
    pub fn set_loadable(&mut self, latest: Option<u64>) {
        self.loadable_max = latest;
        // Only composed deltas to the latest version are ever asked for again.
        self.composed_declined
            .retain(|(_, target), _| latest.is_none_or(|latest| *target >= latest));
    }

    /// Tells a store-backed sender the newest snapshot its store holds: every Welcome
    /// offers it to peers that join with no weights.
    pub fn set_snapshot_loadable(&mut self, newest: Option<u64>) {
        self.snapshot_loadable = newest;
    }

    /// The snapshot a Welcome offers: none where there is no store to build one from.
    fn snapshot_offer(&self) -> Option<u64> {
        self.snapshot_loadable.filter(|_| self.config.store_backed)
    }

    /// Snapshot artifacts held now (they are evicted once no session wants them).
    #[cfg(test)]
    pub(crate) fn snapshots_held(&self) -> usize {
        self.snapshots.len()
    }

    // ---------------------------------------------------------------------------------
    // Artifacts
    // ---------------------------------------------------------------------------------

    /// Starts publishing a delta whose segments will follow ([`Sender::add_segment`]) and
    /// whose table comes last ([`Sender::seal_artifact`]): cut-through from an extraction
    /// or a relay's upstream. `descriptor` is the delta's preamble and header.
    pub fn begin_artifact(&mut self, descriptor: Bytes) -> Result<u64, SenderError> {
        let version = self.begin(descriptor)?;
        self.evict();
        Ok(version)
    }

    fn begin(&mut self, descriptor: Bytes) -> Result<u64, SenderError> {
        let header = parse_descriptor(&descriptor)?;
        let version = header.target_version;
        if header.base_version >= version {
            return Err(SenderError::InvalidArtifact(format!(
                "version {version} starts from version {}: not a delta (a snapshot goes to insert_snapshot)",
                header.base_version
            )));
        }
        if let Some(existing) = self.artifacts.get(&version) {
            if existing.descriptor == descriptor {
                return Ok(version);
            }
            return Err(SenderError::Conflict { version });
        }
        self.unavailable.remove(&version);
        self.artifacts.insert(
            version,
            Artifact {
                descriptor,
                segments: Vec::new(),
                seal: None,
            },
        );
        Ok(version)
    }

    /// Adds segment `index` of a version being published, in any order.
    pub fn add_segment(
        &mut self,
        version: u64,
        index: u32,
        hash: Hash,
        bytes: Bytes,
    ) -> Result<(), SenderError> {
        let artifact = self
            .artifacts
            .get_mut(&version)
            .ok_or(SenderError::UnknownVersion { version })?;
        if index >= MAX_TRANSFER_SEGMENTS {
            return Err(SenderError::InvalidArtifact(format!(
                "segment index {index} is beyond the protocol's {MAX_TRANSFER_SEGMENTS} segments"
            )));
        }
        if let Some((_, entries)) = &artifact.seal
            && entries
                .get(index as usize)
                .is_none_or(|e| e.hash != hash || e.len as usize != bytes.len())
        {
            return Err(SenderError::InvalidArtifact(format!(
                "segment {index} of version {version} does not match the sealed table"
            )));
        }
        let index = index as usize;
        if artifact.segments.len() <= index {
            artifact.segments.resize(index + 1, None);
        }
        artifact.segments[index] = Some((hash, bytes));
        Ok(())
    }

    /// Withdraws a segment that turned out not to match its table (a relay forwarded it
    /// before the table arrived); subscribers that got it nack it at their own check.
    pub fn revoke_segment(&mut self, version: u64, index: u32) {
        if let Some(slot) = self
            .artifacts
            .get_mut(&version)
            .and_then(|a| a.segments.get_mut(index as usize))
        {
            *slot = None;
        }
    }

    /// Closes a version being published with its segment table and artifact id.
    pub fn seal_artifact(
        &mut self,
        version: u64,
        id: Hash,
        segments: Vec<SegmentEntry>,
    ) -> Result<(), SenderError> {
        let artifact = self
            .artifacts
            .get_mut(&version)
            .ok_or(SenderError::UnknownVersion { version })?;
        if segments.len() > MAX_TRANSFER_SEGMENTS as usize {
            return Err(SenderError::InvalidArtifact(format!(
                "{} segments exceed the protocol's limit of {MAX_TRANSFER_SEGMENTS}",
                segments.len()
            )));
        }
        let header = parse_descriptor(&artifact.descriptor)?;
        let computed = aurora_delta::Manifest {
            header,
            segments: segments.clone(),
        }
        .id();
        if computed != id {
            return Err(SenderError::InvalidArtifact(format!(
                "the table of version {version} hashes to id {computed}, not {id}"
            )));
        }
        if artifact.segments.len() > segments.len() {
            return Err(SenderError::InvalidArtifact(format!(
                "version {version} has segment {} beyond its table of {}",
                artifact.segments.len() - 1,
                segments.len()
            )));
        }
        for (index, held) in artifact.segments.iter_mut().enumerate() {
            if let Some((hash, bytes)) = held
                && (*hash != segments[index].hash || bytes.len() != segments[index].len as usize)
            {
                return Err(SenderError::InvalidArtifact(format!(
                    "segment {index} of version {version} does not match the table"
                )));
            }
        }
        artifact.seal = Some((id, segments));
        Ok(())
    }

    /// Publishes a complete delta artifact (from a store): its structure and manifest
    /// hash are checked here, its segment hashes by the store that read it.
    pub fn insert_artifact(&mut self, bytes: Bytes) -> Result<u64, SenderError> {
        let file =
            DeltaFile::parse(&bytes).map_err(|e| SenderError::InvalidArtifact(e.to_string()))?;
        let version = file.header().target_version;
        self.loading.remove(&version);
        if self
            .artifacts
            .get(&version)
            .is_some_and(|a| a.seal.is_some())
        {
            return Ok(version);
        }
        let (descriptor, segments) = stored_parts(&bytes, &file);
        let id = file.id;
        let entries = file.manifest.segments.clone();
        self.begin(descriptor)?;
        let artifact = self.artifacts.get_mut(&version).expect("just begun");
        artifact.segments = segments;
        self.seal_artifact(version, id, entries)?;
        self.evict();
        Ok(version)
    }

    /// Holds a snapshot artifact (from a store, [`SenderEvent::LoadSnapshot`]) for the
    /// sessions that want it; its structure and manifest hash are checked here, its
    /// segment hashes by the store that built it.
    pub fn insert_snapshot(&mut self, bytes: Bytes) -> Result<u64, SenderError> {
        let file =
            DeltaFile::parse(&bytes).map_err(|e| SenderError::InvalidArtifact(e.to_string()))?;
        let version = file.header().target_version;
        self.snapshots_loading.remove(&version);
        crate::snapshot::check_header(file.header(), version)
            .map_err(SenderError::InvalidArtifact)?;
        let artifact = sealed_artifact(&bytes, &file)?;
        self.snapshots_unavailable.remove(&version);
        self.snapshots.insert(version, artifact);
        self.evict_snapshots();
        Ok(version)
    }

    /// Holds a composed delta (from a store, [`SenderEvent::LoadComposed`]) for the
    /// sessions it was built for; its structure and manifest hash are checked here, its
    /// segment hashes by the store that built it.
    pub fn insert_composed(&mut self, bytes: Bytes) -> Result<(u64, u64), SenderError> {
        let file =
            DeltaFile::parse(&bytes).map_err(|e| SenderError::InvalidArtifact(e.to_string()))?;
        let header = file.header();
        let key = (header.base_version, header.target_version);
        self.composed_loading.remove(&key);
        if key.0 >= key.1 {
            return Err(SenderError::InvalidArtifact(format!(
                "a composed delta goes forward, not from version {} to {}",
                key.0, key.1
            )));
        }
        let artifact = sealed_artifact(&bytes, &file)?;
        self.composed_declined.remove(&key);
        self.composed.insert(key, artifact);
        self.evict_composed();
        Ok(key)
    }

    /// The driver will not serve C(base -> target) (replaying the deltas costs fewer
    /// bytes, or it could not be built): its sessions replay the deltas.
    pub fn composed_declined(&mut self, base: u64, target: u64, reason: String) {
        self.composed_loading.remove(&(base, target));
        self.composed_declined.insert((base, target), reason);
    }

    /// The driver could not load the snapshot of `version`: the sessions that want it
    /// are told it is unavailable.
    pub fn snapshot_load_failed(&mut self, version: u64, reason: String) {
        self.snapshots_loading.remove(&version);
        self.snapshots_unavailable.insert(version, reason);
    }

    /// The driver could not load `version`: its subscribers are told it is unavailable.
    pub fn load_failed(&mut self, version: u64, reason: String) {
        self.loading.remove(&version);
        self.unavailable.insert(version, reason);
    }

    /// Announces a commit to every session, now and at every later handshake.
    pub fn commit(&mut self, commit: VersionRef) {
        if self.commit.is_some_and(|c| c.version >= commit.version) {
            return;
        }
        self.commit = Some(commit);
        let ids: Vec<u64> = self.sessions.keys().copied().collect();
        for id in ids {
            self.queue_control(id, Frame::Commit(commit));
        }
    }

    fn evict(&mut self) {
        while self.artifacts.len() > self.config.retain_versions {
            let oldest = *self.artifacts.keys().next().expect("not empty");
            let needed = self.sessions.values().any(|s| {
                s.next_version
                    .is_some_and(|n| n <= oldest && oldest < n + self.config.versions_ahead)
            });
            if needed {
                break;
            }
            self.artifacts.remove(&oldest);
            self.floor = self.floor.max(oldest + 1);
        }
    }

    /// A snapshot is a whole checkpoint: it goes as soon as no session wants it. So does
    /// a composed delta: it serves only the sessions at its base.
    fn evict_snapshots(&mut self) {
        let sessions = &self.sessions;
        self.snapshots
            .retain(|version, _| sessions.values().any(|s| s.snapshot == Some(*version)));
        self.evict_composed();
    }

    fn evict_composed(&mut self) {
        let sessions = &self.sessions;
        self.composed
            .retain(|key, _| sessions.values().any(|s| s.composed == Some(*key)));
    }

    /// Composed delta artifacts held now.
    #[cfg(test)]
    pub(crate) fn composed_held(&self) -> usize {
        self.composed.len()
    }

    // ---------------------------------------------------------------------------------
    // Connections
    // ---------------------------------------------------------------------------------

    /// A downstream connected; its first frame must be a Hello.
    pub fn accepted(&mut self, now: Instant, conn: ConnId) {
        self.conns.insert(
            conn,
            Conn {
                session: None,
                stream: 0,
                epoch: 0,
                credit: self.config.window_frames,
                direct: VecDeque::new(),
                opened_at: now,
                last_send: now,
                stalled_since: None,
                closing: false,
            },
        );
    }

    /// The driver finished writing one frame on `conn`.
    pub fn on_sent(&mut self, now: Instant, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.credit = (c.credit + 1).min(self.config.window_frames);
            c.stalled_since = None;
            c.last_send = now;
        }
    }

    /// `conn` is gone. Its session keeps the segments it carried as sent until the
    /// subscriber's next Want says what actually arrived.
    pub fn closed(&mut self, conn: ConnId) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        let Some(id) = c.session else { return };
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        if session.streams.get(c.stream as usize) == Some(&Some(conn)) {
            session.streams[c.stream as usize] = None;
        }
        if session.streams.iter().all(Option::is_none) {
            self.sessions.remove(&id);
            self.evict();
            self.evict_snapshots();
        }
    }

    pub fn handle_frame(&mut self, now: Instant, conn: ConnId, frame: Frame) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        if c.closing {
            return;
        }
        let Some(session_id) = c.session else {
            match frame {
                Frame::Hello(hello) => self.on_hello(now, conn, hello),
                other => self.refuse(
                    conn,
                    RejectCode::Refused,
                    format!(
                        "the first frame must be Hello, not {}",
                        other.frame_type().name()
                    ),
                ),
            }
            return;
        };
        match frame {
            Frame::Want {
                seq,
                next_version,
                snapshot,
                composed,
                live_streams,
                epochs,
                progress,
            } => {
                let session = self.sessions.get_mut(&session_id).expect("conn has it");
                if session.last_want.is_some_and(|last| seq <= last) {
                    // Overtaken by a later Want on another stream, which says more.
                    return;
                }
                session.last_want = Some(seq);
                let snapshot = snapshot.then_some(next_version);
                let composed = self.composed_choice(next_version, composed, &progress);
                self.on_want(
                    session_id,
                    next_version,
                    (snapshot, composed),
                    live_streams,
                    &epochs,
                    progress,
                );
            }
            Frame::Nack { version, index } => self.on_nack(session_id, version, index),
            Frame::Status {
                active,
                staged,
                note,
            } => {
                let peer_id = self.sessions[&session_id].peer_id.clone();
                self.events.push_back(SenderEvent::Status {
                    peer_id,
                    active,
                    staged,
                    note,
                });
            }
            Frame::Keepalive => {}
            Frame::Goodbye { reason } => {
                tracing::debug!(conn, reason, "downstream said goodbye");
                self.events.push_back(SenderEvent::Close { conn, reason });
            }
            other => self.drop_session(
                session_id,
                format!(
                    "protocol violation: a downstream sent {}",
                    other.frame_type().name()
                ),
            ),
        }
    }

    fn refuse(&mut self, conn: ConnId, code: RejectCode, reason: String) {
        tracing::info!(conn, ?code, reason, "refusing a connection");
        if let Some(c) = self.conns.get_mut(&conn) {
            c.direct.push_back((Frame::Reject { code, reason }, true));
            c.closing = true;
        }
    }

    fn on_hello(&mut self, now: Instant, conn: ConnId, hello: Hello) {
        if hello.protocol_version != PROTOCOL_VERSION {
            return self.refuse(
                conn,
                RejectCode::Version,
                format!(
                    "protocol version {} is not supported (this peer speaks {PROTOCOL_VERSION})",
                    hello.protocol_version
                ),
            );
        }
        if hello.flags != 0 {
            return self.refuse(
                conn,
                RejectCode::Refused,
                format!("unknown Hello flags {:#x}", hello.flags),
            );
        }
        if !self.config.auth.admits(&hello.peer_id, &hello.token) {
            return self.refuse(
                conn,
                RejectCode::Auth,
                format!("peer '{}' is unknown or its token is wrong", hello.peer_id),
            );
        }
        if hello.role == Role::Hub {
            return self.refuse(
                conn,
                RejectCode::Refused,
                "a hub does not subscribe to anyone".into(),
            );
        }
        match self.sessions.get(&hello.session) {
            Some(existing) if existing.peer_id != hello.peer_id => {
                return self.refuse(
                    conn,
                    RejectCode::Refused,
                    format!("session {} belongs to another peer", hello.session),
                );
            }
            Some(existing) if existing.streams.len() != hello.streams as usize => {
                return self.refuse(
                    conn,
                    RejectCode::Refused,
                    format!(
                        "session {} was opened with {} streams, not {}",
                        hello.session,
                        existing.streams.len(),
                        hello.streams
                    ),
                );
            }
            None if self.sessions.len() >= self.config.max_sessions => {
                return self.refuse(
                    conn,
                    RejectCode::Busy,
                    format!("at the limit of {} sessions", self.config.max_sessions),
                );
            }
            _ => {}
        }
        debug_assert!(hello.streams <= MAX_STREAMS, "checked by the decoder");
        let session = self.sessions.entry(hello.session).or_insert_with(|| {
            self.events.push_back(SenderEvent::Subscribed {
                peer_id: hello.peer_id.clone(),
                role: hello.role,
                region: hello.region.clone(),
                session: hello.session,
            });
            Session {
                peer_id: hello.peer_id.clone(),
                streams: vec![None; hello.streams as usize],
                next_version: None,
                snapshot: None,
                composed: None,
                last_want: None,
                versions: BTreeMap::new(),
                control: VecDeque::new(),
                blocked: false,
                nacks: 0,
            }
        });
        // A reconnecting stream replaces the connection it had.
        if let Some(old) = session.streams[hello.stream as usize].replace(conn) {
            self.events.push_back(SenderEvent::Close {
                conn: old,
                reason: "replaced by a new connection of the same stream".into(),
            });
            self.conns.remove(&old);
        }
        let welcome = Frame::Welcome(Welcome {
            protocol_version: PROTOCOL_VERSION,
            role: self.config.identity.role,
            peer_id: self.config.identity.peer_id.clone(),
            region: self.config.identity.region.clone(),
            latest: self.latest(),
            commit: self.commit,
            snapshot: self.snapshot_offer(),
        });
        let c = self.conns.get_mut(&conn).expect("handle_frame checked");
        c.session = Some(hello.session);
        c.stream = hello.stream;
        c.epoch = hello.epoch;
        c.last_send = now;
        c.direct.push_back((welcome, false));
    }

    /// The composed delta a Want at `next_version` is served, if any: a store-backed
    /// sender, a Want that accepts one, and at least two versions to go (one behind,
    /// it would be the stored delta itself). Its target is the one the subscriber holds
    /// parts of (a transfer resumes), else the store's latest; a target the driver
    /// declined from this base or an earlier one is replayed instead.
    fn composed_choice(
        &self,
        next_version: u64,
        accepted: bool,
        progress: &[Progress],
    ) -> Option<(u64, u64)> {
        let latest = self
            .loadable_max
            .filter(|_| accepted && self.config.store_backed)?;
        let held = progress
            .iter()
            .find(|p| p.composed)
            .map(|p| p.version)
            .filter(|&t| t <= latest);
        let target = held.unwrap_or(latest);
        if progress.iter().any(|p| p.version == target && !p.composed) {
            // It holds parts of D(target): it is replaying already, and parts of two
            // artifacts for one version would only be dropped.
            return None;
        }
        let key = (next_version.checked_sub(1)?, target);
        // Declined from an earlier base: replaying to the same target from a later one
        // is cheaper still, so the plan is not asked again at every delivered version.
        let declined = self
            .composed_declined
            .keys()
            .any(|&(base, t)| t == target && base <= key.0);
        (target > next_version && !declined).then_some(key)
    }

    fn on_want(
        &mut self,
        id: u64,
        next_version: u64,
        (snapshot, composed): (Option<u64>, Option<(u64, u64)>),
        live_streams: u64,
        epochs: &[u32],
        progress: Vec<Progress>,
    ) {
        let session = self.sessions.get_mut(&id).expect("caller checked");
        // A session this sender is already sending deltas past its next version keeps
        // replaying: switching mid-stream would waste what is in flight (a Want may lag
        // behind the deltas sent since it was written).
        let serving = session.composed.map(|(_, target)| target);
        let replaying = session.versions.iter().any(|(v, state)| {
            *v >= next_version && Some(*v) != serving && !state.ever_sent.is_empty()
        });
        let composed = composed.filter(|_| !replaying);
        if session.snapshot != snapshot {
            // What was sent of these versions belongs to the other kind of artifact: the
            // Want's progress alone says what the subscriber holds now.
            for version in [session.snapshot, snapshot].into_iter().flatten() {
                session.versions.remove(&version);
            }
            session.snapshot = snapshot;
        }
        if session.composed != composed {
            // The same: D(target) and a composed delta to target are different artifacts.
            for (_, target) in [session.composed, composed].into_iter().flatten() {
                session.versions.remove(&target);
            }
            session.composed = composed;
        }
        let composed_target = composed.map(|(_, target)| target);
        // A segment written on a connection is lost if the Want knows that connection
        // and says it is gone (replaced by a later epoch, or not live). A Want written
        // before the connection existed says nothing about it (it crossed the Hello).
        let still_live = |state: SegState| match state {
            SegState::Sent { stream, epoch } => {
                let known = epochs.get(stream as usize).copied().unwrap_or(0);
                epoch > known || (epoch == known && live_streams & (1 << stream) != 0)
            }
            _ => false,
        };
        session.next_version = Some(next_version);
        session.blocked = false;
        // A Commit written on a stream that died since is lost with it; a Want follows
        // every change of streams, so the latest commit goes out again (receivers ignore
        // one they have).
        if let Some(commit) = self.commit {
            session.control.retain(|f| !matches!(f, Frame::Commit(_)));
            session.control.push_back(Frame::Commit(commit));
        }
        session.versions.retain(|v, _| *v >= next_version);
        let mut reported: BTreeMap<u64, Progress> =
            progress.into_iter().map(|p| (p.version, p)).collect();
        let versions: BTreeSet<u64> = session
            .versions
            .keys()
            .chain(reported.keys())
            .copied()
            .collect();
        for version in versions {
            let state = session.versions.entry(version).or_default();
            let mut report = reported.remove(&version).unwrap_or_default();
            if report.composed != (composed_target == Some(version)) {
                // Progress of the kind of artifact not served: none of it is held.
                report = Progress::default();
            }
            state.offer_sent = report.has_offer;
            state.seal_sent = report.has_seal;
            for index in 0..state.segs.len() {
                let new = if ranges::contains(&report.have, index as u32) {
                    SegState::Have
                } else if still_live(state.segs[index]) {
                    state.segs[index]
                } else {
                    SegState::Unsent
                };
                state.segs[index] = new;
            }
            state.reported = report.have;
            state.cursor = 0;
        }
        self.evict();
        self.evict_snapshots();
    }

    fn on_nack(&mut self, id: u64, version: u64, index: u32) {
        self.stats.nacks += 1;
        let session = self.sessions.get_mut(&id).expect("caller checked");
        session.nacks += 1;
        if session.nacks > self.config.max_nacks {
            let limit = self.config.max_nacks;
            return self.drop_session(id, format!("more than {limit} nacks"));
        }
        let held = match session.composed {
            Some(key) if key.1 == version => self.composed.get(&key),
            _ if session.snapshot == Some(version) => self.snapshots.get(&version),
            _ => self.artifacts.get(&version),
        }
        .is_some_and(|a| a.present(index as usize));
        // A nack for a segment this sender never had is ignored, whatever its index.
        if held && let Some(state) = session.versions.get_mut(&version) {
            state.set(index as usize, SegState::Unsent);
        }
    }

    fn queue_control(&mut self, id: u64, frame: Frame) {
        let limit = self.config.max_control_queue;
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        session.control.push_back(frame);
        if session.control.len() > limit {
            self.drop_session(id, format!("more than {limit} control frames queued"));
        }
    }

    fn drop_session(&mut self, id: u64, reason: String) {
        let Some(session) = self.sessions.remove(&id) else {
            return;
        };
        tracing::info!(peer = session.peer_id, reason, "dropping a session");
        self.stats.sessions_dropped += 1;
        for conn in session.streams.into_iter().flatten() {
            self.conns.remove(&conn);
            self.events.push_back(SenderEvent::Close {
                conn,
                reason: reason.clone(),
            });
        }
        self.events.push_back(SenderEvent::Dropped {
            peer_id: session.peer_id,
            reason,
        });
        self.evict_snapshots();
    }

    // ---------------------------------------------------------------------------------
    // Output
    // ---------------------------------------------------------------------------------

    pub fn poll_event(&mut self) -> Option<SenderEvent> {
        self.events.pop_front()
    }

    /// The next frame to write, on a connection whose window has room.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        let ids: Vec<ConnId> = self
            .conns
            .range(self.next_conn..)
            .chain(self.conns.range(..self.next_conn))
            .filter(|(_, c)| c.credit > 0)
            .map(|(id, _)| *id)
            .collect();
        for conn in ids {
            if let Some((frame, close_after)) = self.next_frame(conn) {
                let c = self.conns.get_mut(&conn).expect("listed above");
                c.credit -= 1;
                c.last_send = now;
                if c.credit == 0 {
                    c.stalled_since.get_or_insert(now);
                }
                self.next_conn = conn + 1;
                return Some(Transmit {
                    conn,
                    frame,
                    close_after,
                });
            }
        }
        None
    }

    /// Why `version` (as a snapshot, or as a delta) cannot be sent from here, or `None`
    /// while it may yet come: loading from the store (asked for here) or not published.
    fn why_unavailable(&mut self, version: u64, as_snapshot: bool) -> Option<String> {
        if as_snapshot {
            if !self.config.store_backed {
                return Some(format!(
                    "version {version} is wanted as a snapshot and this {} has no store to build one from",
                    self.config.identity.role
                ));
            }
            if let Some(reason) = self.snapshots_unavailable.get(&version) {
                return Some(reason.clone());
            }
            if self
                .snapshot_loadable
                .is_some_and(|newest| version <= newest)
            {
                if self.snapshots_loading.insert(version) {
                    self.events.push_back(SenderEvent::LoadSnapshot { version });
                }
                return None;
            }
            return Some(format!(
                "no snapshot of version {version} here (the newest is {:?})",
                self.snapshot_loadable
            ));
        }
        if let Some(reason) = self.unavailable.get(&version) {
            return Some(reason.clone());
        }
        if self.config.store_backed && self.loadable_max.is_some_and(|latest| version <= latest) {
            if self.loading.insert(version) {
                self.events.push_back(SenderEvent::Load { version });
            }
            return None;
        }
        if version < self.floor {
            return Some(format!(
                "version {version} is not held here (versions from {} are)",
                self.floor
            ));
        }
        // Not published yet, or not begun yet by a relay that began a later one first
        // (offers of consecutive versions travel on different streams).
        None
    }

    fn next_frame(&mut self, conn: ConnId) -> Option<(Frame, bool)> {
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
        if let Some(key) = session.composed {
            if let Some(artifact) = self.composed.get(&key) {
                // Nothing after it until the next Want moves past it: the subscriber
                // holds only one version beyond its window, this one.
                let state = session.versions.entry(key.1).or_default();
                let frame = next_artifact_frame(
                    state,
                    artifact,
                    key.1,
                    ArtifactKind::Composed,
                    (c_stream, c_epoch),
                    &mut self.stats,
                );
                return frame.map(|frame| (frame, false));
            }
            if let Some(reason) = self.composed_declined.get(&key) {
                tracing::info!(
                    peer = session.peer_id,
                    base = key.0,
                    target = key.1,
                    reason,
                    "catch-up replays the deltas"
                );
                session.composed = None;
                session.versions.remove(&key.1);
            } else {
                if self.composed_loading.insert(key) {
                    self.events.push_back(SenderEvent::LoadComposed {
                        base: key.0,
                        target: key.1,
                    });
                }
                return None;
            }
        }
        for version in next_version..next_version + self.config.versions_ahead {
            let as_snapshot = session.snapshot == Some(version);
            let held = if as_snapshot {
                self.snapshots.get(&version)
            } else {
                self.artifacts.get(&version)
            };
            let Some(artifact) = held else {
                let reason = self.why_unavailable(version, as_snapshot)?;
                let session = self.sessions.get_mut(&id).expect("looked up above");
                session.blocked = true;
                return Some((Frame::Unavailable { version, reason }, false));
            };
            let state = session.versions.entry(version).or_default();
            let kind = if as_snapshot {
                ArtifactKind::Snapshot
            } else {
                ArtifactKind::Delta
            };
            let frame = next_artifact_frame(
                state,
                artifact,
                version,
                kind,
                (c_stream, c_epoch),
                &mut self.stats,
            );
            if let Some(frame) = frame {
                return Some((frame, false));
            }
        }
        None
    }

    /// The earliest instant at which [`Sender::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
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
            .min()
    }

    /// Closes handshakes that took too long, drops stalled sessions and queues
    /// keepalives on idle connections.
    pub fn handle_timeout(&mut self, now: Instant) {
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

/// The next frame of `artifact` (sent as `version` of `kind`) that a session whose
/// state is `state` needs, written on stream (index, epoch) `on`: its Offer, its Seal
/// once known, then each segment it does not hold, lowest index first.
fn next_artifact_frame(
    state: &mut SendVersion,
    artifact: &Artifact,
    version: u64,
    kind: ArtifactKind,
    (stream, epoch): (u8, u32),
    stats: &mut SenderStats,
) -> Option<Frame> {
    if !state.offer_sent {
        state.offer_sent = true;
        if kind == ArtifactKind::Composed {
            stats.composed_offers += 1;
        }
        return Some(Frame::Offer {
            version,
            kind,
            descriptor: artifact.descriptor.clone(),
        });
    }
    if let Some((id, entries)) = &artifact.seal
        && !state.seal_sent
    {
        state.seal_sent = true;
        return Some(Frame::Seal {
            version,
            id: *id,
            segments: entries.clone(),
        });
    }
    while state.cursor < artifact.segments.len() && state.state(state.cursor) != SegState::Unsent {
        state.cursor += 1;
    }
    let index = (state.cursor..artifact.segments.len())
        .find(|&i| state.state(i) == SegState::Unsent && artifact.present(i))?;
    let (hash, bytes) = artifact.segments[index].clone().expect("present");
    state.set(index, SegState::Sent { stream, epoch });
    stats.segments_sent += 1;
    stats.segment_bytes_sent += bytes.len() as u64;
    if !state.ever_sent.insert(index as u32) {
        stats.segments_resent += 1;
    }
    Some(Frame::Segment {
        version,
        index: index as u32,
        hash,
        bytes,
    })
}

/// A complete stored artifact held apart from the deltas (a snapshot or a composed
/// delta), after checking that it can travel over the protocol.
fn sealed_artifact(bytes: &Bytes, file: &DeltaFile<'_>) -> Result<Artifact, SenderError> {
    if file.segment_count() > MAX_TRANSFER_SEGMENTS as usize {
        return Err(SenderError::InvalidArtifact(format!(
            "{} segments exceed the protocol's limit of {MAX_TRANSFER_SEGMENTS}",
            file.segment_count()
        )));
    }
    let (descriptor, segments) = stored_parts(bytes, file);
    Ok(Artifact {
        descriptor,
        segments,
        seal: Some((file.id, file.manifest.segments.clone())),
    })
}

/// A stored artifact's descriptor and segments, as slices of its bytes.
fn stored_parts(bytes: &Bytes, file: &DeltaFile<'_>) -> (Bytes, Vec<Option<(Hash, Bytes)>>) {
    let head_len = file.header().encode().len();
    let mut offset = head_len;
    let mut segments = Vec::with_capacity(file.segment_count());
    for entry in &file.manifest.segments {
        let end = offset + entry.len as usize;
        segments.push(Some((entry.hash, bytes.slice(offset..end))));
        offset = end;
    }
    (bytes.slice(..head_len), segments)
}

fn parse_descriptor(descriptor: &[u8]) -> Result<DeltaHeader, SenderError> {
    let (header, used) =
        DeltaHeader::decode(descriptor).map_err(|e| SenderError::InvalidArtifact(e.to_string()))?;
    if used != descriptor.len() {
        return Err(SenderError::InvalidArtifact(format!(
            "{} bytes after the delta header",
            descriptor.len() - used
        )));
    }
    Ok(header)
}

#[cfg(test)]
mod tests;
