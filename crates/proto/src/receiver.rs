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
//! An actor's receiver accepts composed catch-up ([`Receiver::accept_composed`]): its
//! Wants say so, and an upstream may answer one that is behind with a single composed
//! delta from the weights of `next_version - 1` to a later version v (Offer kind 3,
//! docs/wire-protocol.md §6.7) instead of the deltas in between; once it is delivered
//! the receiver goes on from v + 1. Its version may lie beyond the window: the one
//! version beyond it that an upstream sends is taken as that composed delta.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aurora_delta::{DeltaHeader, Hash, Manifest, SegmentEntry};
use bytes::{Bytes, BytesMut};

use crate::frame::{
    ArtifactKind, Frame, Hello, MAX_WANT_VERSIONS, PROTOCOL_VERSION, Progress, Role, VersionRef,
    Welcome,
};
use crate::tuner::StreamTuner;
use crate::{ConnId, Identity, ranges};

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
    /// When set, the stream count is tuned ([`StreamTuner`]) at this interval: each
    /// session starts with one stream and opens more, up to `streams`, while they pay.
    pub tune_interval: Option<Duration>,
}

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
            tune_interval: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReceiverEvent {
    /// Open stream `stream` of the current session and report [`Receiver::connected`]
    /// (or [`Receiver::dial_failed`]).
    Dial {
        session: u64,
        stream: u8,
    },
    /// Close `conn` (a stream of a session given up).
    Close {
        conn: ConnId,
    },
    /// The upstream accepted the session.
    Connected {
        upstream: Welcome,
    },
    /// The session is over; start another one, on another upstream if this one failed.
    UpstreamLost {
        reason: String,
    },
    /// The descriptor of `version` arrived (relays publish a delta's downstream; actors
    /// may start decoding its segments against their weights).
    Offered {
        version: u64,
        kind: ArtifactKind,
        descriptor: Bytes,
        header: Arc<DeltaHeader>,
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
    Revoked {
        version: u64,
        index: u32,
    },
    /// The table of `version` arrived and its hash is the artifact id.
    Sealed {
        version: u64,
        id: Hash,
        segments: Vec<SegmentEntry>,
    },
    /// `version` is complete and verified: the whole artifact, in version order.
    Complete {
        version: u64,
        artifact: Artifact,
    },
    Commit(VersionRef),
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
    /// Segment bytes received per stream index.
    pub stream_bytes: Vec<u64>,
}

/// Memory a held segment costs beyond its bytes, charged against `max_held_bytes`.
const SEGMENT_OVERHEAD_BYTES: u64 = 64;
/// Memory of one slot of an assembly's segment list: a segment at index i costs i slots.
const SLOT_BYTES: u64 = 48;

#[derive(Default)]
struct Assembly {
    descriptor: Option<(Bytes, Arc<DeltaHeader>)>,
    /// The kind its Offer named (set with the descriptor).
    kind: Option<ArtifactKind>,
    segments: Vec<Option<(Hash, Bytes)>>,
    table: Option<(Hash, Vec<SegmentEntry>)>,
    verified_table: bool,
    failures: BTreeMap<u32, u32>,
    held_bytes: u64,
}

impl Assembly {
    fn is_complete(&self) -> bool {
        match (&self.descriptor, &self.table) {
            (Some(_), Some((_, entries))) => {
                self.verified_table
                    && self.segments.len() == entries.len()
                    && self.segments.iter().all(Option::is_some)
            }
            _ => false,
        }
    }

    fn progress(&self, version: u64) -> Progress {
        Progress {
            version,
            has_offer: self.descriptor.is_some(),
            has_seal: self.table.is_some() && self.verified_table,
            composed: self.kind == Some(ArtifactKind::Composed),
            have: ranges::have_ranges(self.segments.iter().map(Option::is_some)),
        }
    }
}

/// What the receiver starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// The weights of `next_version - 1`: every version arrives as a delta.
    Weights,
    /// No weights: the first version arrives as a snapshot, of the version an upstream
    /// offered (None until a Welcome did), then the deltas after it.
    Snapshot(Option<u64>),
}

#[derive(Clone, Copy, Default)]
struct Stream {
    conn: Option<ConnId>,
    welcomed: bool,
    /// Connections made on this stream in this session.
    epoch: u32,
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
    active: VersionRef,
    staged: Option<u64>,
    session: Option<Session>,
    assemblies: BTreeMap<u64, Assembly>,
    held_bytes: u64,
    /// Nacks not yet answered, with the stream (index, epoch) that carried each: one
    /// carried by a stream that dies is sent again.
    nacks: BTreeMap<(u64, u32), (usize, u32)>,
    /// Frames to write, and whether to close the connection after each.
    out: VecDeque<(ConnId, Frame, bool)>,
    events: VecDeque<ReceiverEvent>,
    stats: ReceiverStats,
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
        Receiver {
            config,
            start: Start::Weights,
            next_version,
            tip: (active.version + 1 == next_version).then_some(active),
            accepts_composed: false,
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

    pub fn stats(&self) -> &ReceiverStats {
        &self.stats
    }

    /// The lowest version not yet delivered (0 for a joining receiver before it knows
    /// its snapshot).
    pub fn next_version(&self) -> u64 {
        self.next_version
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
                    self.out.push_back((conn, goodbye, true));
                }
            }
        }
    }

    /// Gives the current upstream up (it served something unusable); the driver starts
    /// a new session elsewhere.
    pub fn abandon(&mut self, reason: &str) {
        if self.session.is_some() {
            self.lose_upstream(reason.to_string());
        }
    }

    fn lose_upstream(&mut self, reason: String) {
        tracing::info!(reason, "upstream lost");
        self.end_session(&reason);
        self.events
            .push_back(ReceiverEvent::UpstreamLost { reason });
    }

    /// Stream `stream` of session `session` is connected as `conn`.
    pub fn connected(&mut self, now: Instant, session: u64, stream: u8, conn: ConnId) {
        match &mut self.session {
            Some(s) if s.id == session && (stream as usize) < s.streams.len() => {
                let slot = &mut s.streams[stream as usize];
                slot.conn = Some(conn);
                slot.welcomed = false;
                slot.epoch += 1;
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
                };
                s.last_heard = now;
                self.out.push_back((conn, Frame::Hello(hello), false));
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
            self.lose_upstream(format!("cannot connect: {reason}"));
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
            return self.lose_upstream("every stream is closed".into());
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

    pub fn handle_frame(&mut self, now: Instant, conn: ConnId, frame: Frame) {
        let Some(s) = self.session.as_mut() else {
            return;
        };
        let Some(stream) = s.streams.iter().position(|st| st.conn == Some(conn)) else {
            return;
        };
        s.last_heard = now;
        let welcomed = s.streams[stream].welcomed;
        if !welcomed {
            return match frame {
                Frame::Welcome(welcome) => self.on_welcome(stream, welcome),
                Frame::Reject { code, reason } => {
                    self.lose_upstream(format!("refused ({code:?}): {reason}"))
                }
                other => self.lose_upstream(format!(
                    "protocol violation: {} before Welcome",
                    other.frame_type().name()
                )),
            };
        }
        let outcome = match frame {
            Frame::Offer {
                version,
                kind,
                descriptor,
            } => self.on_offer(version, kind, descriptor),
            Frame::Segment {
                version,
                index,
                hash,
                bytes,
            } => self.on_segment(stream, version, index, hash, bytes),
            Frame::Seal {
                version,
                id,
                segments,
            } => self.on_seal(version, id, segments),
            Frame::Commit(commit) => {
                self.events.push_back(ReceiverEvent::Commit(commit));
                Ok(())
            }
            Frame::Unavailable { version, reason } => {
                Err(format!("version {version} is unavailable there: {reason}"))
            }
            Frame::Keepalive => Ok(()),
            Frame::Goodbye { reason } => Err(format!("said goodbye: {reason}")),
            other => Err(format!(
                "protocol violation: an upstream sent {}",
                other.frame_type().name()
            )),
        };
        match outcome {
            Ok(()) => self.deliver(),
            Err(reason) => self.lose_upstream(reason),
        }
    }

    fn on_welcome(&mut self, stream: usize, welcome: Welcome) {
        if welcome.protocol_version != PROTOCOL_VERSION {
            return self.lose_upstream(format!(
                "upstream speaks protocol version {}, this peer {PROTOCOL_VERSION}",
                welcome.protocol_version
            ));
        }
        if welcome.role == Role::Actor {
            return self.lose_upstream("an actor cannot be an upstream".into());
        }
        let first = self.session.as_ref().is_some_and(|s| s.upstream.is_none());
        if first && let Start::Snapshot(held) = self.start {
            let Some(offered) = welcome.snapshot else {
                return self.lose_upstream(format!(
                    "{} {} offers no snapshot to join from",
                    welcome.role, welcome.peer_id
                ));
            };
            // Versions up to the window's end and the one composed target beyond it
            // must stay countable.
            if offered
                .checked_add(self.config.versions_ahead.saturating_add(2))
                .is_none()
            {
                return self.lose_upstream(format!(
                    "{} {} offers snapshot version {offered}, too close to the last \
                     version number",
                    welcome.role, welcome.peer_id
                ));
            }
            if held.is_some_and(|held| held != offered) {
                // Parts of one snapshot never meet parts of another.
                tracing::info!(
                    held,
                    offered,
                    "the upstream offers another snapshot; starting over"
                );
                self.forget_held();
            }
            self.start = Start::Snapshot(Some(offered));
            self.next_version = offered;
        }
        let s = self.session.as_mut().expect("caller checked");
        s.streams[stream].welcomed = true;
        if s.upstream.is_none() {
            s.upstream = Some(welcome.clone());
            if let Some(commit) = welcome.commit {
                self.events.push_back(ReceiverEvent::Commit(commit));
            }
            self.events
                .push_back(ReceiverEvent::Connected { upstream: welcome });
        }
        self.queue_want();
    }

    fn window_check(&mut self, version: u64) -> Result<bool, String> {
        if version < self.next_version {
            return Ok(false);
        }
        let end = self.next_version + self.config.versions_ahead;
        if version <= end {
            return Ok(true);
        }
        if !self.wants_composed() {
            return Err(format!(
                "protocol violation: version {version} is beyond the window (next {}, {} ahead)",
                self.next_version, self.config.versions_ahead
            ));
        }
        // Beyond the window only a composed delta travels, and nothing after it until
        // it is delivered: its segments may overtake its Offer, so the one version out
        // there is held as that composed delta. Another one means the upstream now
        // serves a different composed delta (another hub, a newer target): the old one
        // is dropped, so at most one version is ever held beyond the window.
        let stale: Vec<u64> = self
            .assemblies
            .range(end + 1..)
            .map(|(v, _)| *v)
            .filter(|v| *v != version)
            .collect();
        self.drop_assemblies(&stale);
        Ok(true)
    }

    /// Forgets what is held of `versions` (stale: they will never be delivered).
    fn drop_assemblies(&mut self, versions: &[u64]) {
        for version in versions {
            if let Some(assembly) = self.assemblies.remove(version) {
                self.held_bytes -= assembly.held_bytes;
            }
            self.nacks.retain(|(v, _), _| v != version);
        }
    }

    /// How `version` must arrive: the snapshot a joining receiver took, or a delta.
    fn kind_of(&self, version: u64) -> ArtifactKind {
        if self.start == Start::Snapshot(Some(version)) {
            ArtifactKind::Snapshot
        } else {
            ArtifactKind::Delta
        }
    }

    fn on_offer(
        &mut self,
        version: u64,
        kind: ArtifactKind,
        descriptor: Bytes,
    ) -> Result<(), String> {
        if !self.window_check(version)? {
            return Ok(());
        }
        let wanted = self.kind_of(version);
        let composed_ok = kind == ArtifactKind::Composed && wanted == ArtifactKind::Delta;
        if kind != wanted && !composed_ok {
            return Err(format!(
                "protocol violation: version {version} offered as {kind}, wanted as {wanted}"
            ));
        }
        if composed_ok && !self.wants_composed() {
            return Err(format!(
                "protocol violation: version {version} offered as a composed delta, which this receiver did not accept"
            ));
        }
        let (header, used) = DeltaHeader::decode(&descriptor)
            .map_err(|e| format!("offer of version {version}: {e}"))?;
        if used != descriptor.len() || header.target_version != version {
            return Err(format!(
                "offer of version {version} carries the header of version {} ({} stray bytes)",
                header.target_version,
                descriptor.len() - used
            ));
        }
        if kind == ArtifactKind::Snapshot {
            crate::snapshot::check_header(&header, version)
                .map_err(|reason| format!("offer of version {version}: {reason}"))?;
        }
        if composed_ok {
            self.check_composed(&header)
                .map_err(|reason| format!("protocol violation: {reason}"))?;
        }
        let held_kind = self.assemblies.get(&version).and_then(|a| a.kind);
        if held_kind.is_some_and(|held| held != kind) {
            // Parts of D(v) and of a composed delta to v are different artifacts, and
            // segments that overtook this Offer may have joined the wrong one: drop
            // what is held and start a session whose Want says what is held now.
            self.drop_assemblies(&[version]);
            return Err(format!(
                "version {version} is now offered as {kind}: dropped what was held of it"
            ));
        }
        if composed_ok {
            // One composed delta at a time: one to another version is stale now.
            let others: Vec<u64> = self
                .assemblies
                .iter()
                .filter(|(v, a)| **v != version && a.kind == Some(ArtifactKind::Composed))
                .map(|(v, _)| *v)
                .collect();
            self.drop_assemblies(&others);
        }
        let assembly = self.assemblies.entry(version).or_default();
        match &assembly.descriptor {
            Some((held, _)) if *held == descriptor => return Ok(()),
            Some(_) => return Err(format!("two different offers for version {version}")),
            None => {}
        }
        let header = Arc::new(header);
        assembly.descriptor = Some((descriptor.clone(), header.clone()));
        assembly.kind = Some(kind);
        self.events.push_back(ReceiverEvent::Offered {
            version,
            kind,
            descriptor,
            header,
        });
        // Segments that overtook the offer on another stream are announced now, so a
        // relay republishes them after the descriptor.
        for (index, held) in assembly.segments.iter().enumerate() {
            if let Some((hash, bytes)) = held {
                self.events.push_back(ReceiverEvent::Segment {
                    version,
                    index: index as u32,
                    hash: *hash,
                    bytes: bytes.clone(),
                });
            }
        }
        self.check_table(version)
    }

    fn on_segment(
        &mut self,
        stream: usize,
        version: u64,
        index: u32,
        hash: Hash,
        bytes: Bytes,
    ) -> Result<(), String> {
        if !self.window_check(version)? {
            self.stats.duplicates += 1;
            return Ok(());
        }
        let assembly = self.assemblies.entry(version).or_default();
        if assembly
            .segments
            .get(index as usize)
            .is_some_and(Option::is_some)
        {
            self.stats.duplicates += 1;
            return Ok(());
        }
        let expected = match &assembly.table {
            Some((_, entries)) if assembly.verified_table => {
                let entry = entries.get(index as usize).ok_or_else(|| {
                    format!(
                        "segment {index} of version {version} is beyond its table of {}",
                        entries.len()
                    )
                })?;
                Some(entry.hash)
            }
            _ => None,
        };
        let actual = Hash::of(&bytes);
        if actual != hash || expected.is_some_and(|e| e != actual) {
            self.stats.corrupt += 1;
            let failures = assembly.failures.entry(index).or_default();
            *failures += 1;
            if *failures > self.config.max_segment_failures {
                return Err(format!(
                    "segment {index} of version {version} arrived corrupted {failures} times"
                ));
            }
            tracing::warn!(version, index, "segment corrupted in transit; asking again");
            self.nack(version, index);
            return Ok(());
        }
        // Each held segment costs its bytes and its bookkeeping: empty segments at
        // hostile indices count too.
        let cost = bytes.len() as u64 + SEGMENT_OVERHEAD_BYTES;
        if self.held_bytes + cost + index as u64 * SLOT_BYTES > self.config.max_held_bytes {
            return Err(format!(
                "holding more than {} bytes of incomplete artifacts",
                self.config.max_held_bytes
            ));
        }
        self.held_bytes += cost;
        assembly.held_bytes += cost;
        self.nacks.remove(&(version, index));
        if assembly.segments.len() <= index as usize {
            assembly.segments.resize(index as usize + 1, None);
        }
        assembly.segments[index as usize] = Some((hash, bytes.clone()));
        self.stats.segments += 1;
        self.stats.segment_bytes += bytes.len() as u64;
        if let Some(counter) = self.stats.stream_bytes.get_mut(stream) {
            *counter += bytes.len() as u64;
        }
        if assembly.descriptor.is_some() {
            self.events.push_back(ReceiverEvent::Segment {
                version,
                index,
                hash,
                bytes,
            });
        }
        Ok(())
    }

    fn on_seal(
        &mut self,
        version: u64,
        id: Hash,
        segments: Vec<SegmentEntry>,
    ) -> Result<(), String> {
        if !self.window_check(version)? {
            return Ok(());
        }
        let assembly = self.assemblies.entry(version).or_default();
        if assembly.table.is_some() {
            return Ok(());
        }
        assembly.table = Some((id, segments));
        self.check_table(version)
    }

    /// A composed delta must go from the weights of `next_version - 1` (version and
    /// hash) to a later version than the next one.
    fn check_composed(&self, header: &DeltaHeader) -> Result<(), String> {
        let version = header.target_version;
        let base = self
            .tip
            .filter(|tip| tip.version + 1 == self.next_version)
            .ok_or_else(|| format!("composed delta to {version} offered, but the weights of version {} are not known here", self.next_version.wrapping_sub(1)))?;
        if version <= self.next_version {
            return Err(format!(
                "composed delta to version {version} does not go past the next version {}",
                self.next_version
            ));
        }
        if header.base_version != base.version || header.base_hash != base.hash {
            return Err(format!(
                "composed delta to version {version} starts from version {} with weights {}, but this receiver is at version {} with {}",
                header.base_version, header.base_hash, base.version, base.hash
            ));
        }
        Ok(())
    }

    /// Once both descriptor and table are in: the table must hash to the id with the
    /// header, and every segment already held must match it.
    fn check_table(&mut self, version: u64) -> Result<(), String> {
        let assembly = self
            .assemblies
            .get_mut(&version)
            .expect("caller created it");
        let (Some((_, header)), Some((id, entries))) = (&assembly.descriptor, &assembly.table)
        else {
            return Ok(());
        };
        if assembly.verified_table {
            return Ok(());
        }
        let computed = Manifest {
            header: DeltaHeader::clone(header),
            segments: entries.clone(),
        }
        .id();
        if computed != *id {
            let id = *id;
            // Descriptor and table belong to different artifacts (a table that overtook
            // its Offer may be of the other kind, D(v) or a composed delta to v): what is
            // held of the version cannot be told apart, so all of it goes, and the next
            // session's Want asks for it afresh.
            self.drop_assemblies(&[version]);
            return Err(format!(
                "the table of version {version} does not hash to its artifact id {id}"
            ));
        }
        assembly.verified_table = true;
        let mut revoked = Vec::new();
        let mut freed = 0u64;
        for (index, held) in assembly.segments.iter_mut().enumerate() {
            let matches = entries
                .get(index)
                .is_some_and(|entry| held.as_ref().is_none_or(|(hash, _)| *hash == entry.hash));
            if !matches && let Some((_, bytes)) = held.take() {
                freed += bytes.len() as u64 + SEGMENT_OVERHEAD_BYTES;
                revoked.push(index as u32);
            }
        }
        assembly.segments.resize(entries.len(), None);
        assembly.held_bytes -= freed;
        self.held_bytes -= freed;
        let sealed = ReceiverEvent::Sealed {
            version,
            id: *id,
            segments: entries.clone(),
        };
        let count = entries.len();
        for index in revoked {
            tracing::warn!(
                version,
                index,
                "segment does not match the table; asking again"
            );
            self.events
                .push_back(ReceiverEvent::Revoked { version, index });
            if (index as usize) < count {
                self.nack(version, index);
            }
        }
        self.events.push_back(sealed);
        Ok(())
    }

    /// Hands out complete versions in order and tells the upstream the window moved.
    /// A complete composed delta from `next_version - 1` is delivered as its version,
    /// and what is held of the versions it skips is dropped.
    fn deliver(&mut self) {
        let mut moved = false;
        while let Some(version) = self.deliverable() {
            let assembly = self.assemblies.remove(&version).expect("deliverable");
            self.held_bytes -= assembly.held_bytes;
            let kind = match assembly.kind {
                Some(ArtifactKind::Composed) => ArtifactKind::Composed,
                _ => self.kind_of(version),
            };
            if kind == ArtifactKind::Snapshot {
                self.start = Start::Weights;
            }
            let artifact = Artifact::from_assembly(assembly, kind);
            self.tip = Some(VersionRef {
                version,
                hash: artifact.header().target_hash,
            });
            self.events
                .push_back(ReceiverEvent::Complete { version, artifact });
            self.next_version = version + 1;
            let skipped: Vec<u64> = self.assemblies.range(..=version).map(|(v, _)| *v).collect();
            self.drop_assemblies(&skipped);
            moved = true;
        }
        if moved {
            // A composed delta from a version now passed can never be delivered.
            let base = self.next_version - 1;
            let stale: Vec<u64> = self
                .assemblies
                .iter()
                .filter(|(_, a)| {
                    a.kind == Some(ArtifactKind::Composed)
                        && a.descriptor
                            .as_ref()
                            .is_some_and(|(_, h)| h.base_version != base)
                })
                .map(|(v, _)| *v)
                .collect();
            self.drop_assemblies(&stale);
        }
        let next_version = self.next_version;
        self.nacks
            .retain(|(version, _), _| *version >= next_version);
        if moved {
            self.queue_want();
        }
    }

    /// The version to deliver next: `next_version` when complete, else a complete
    /// composed delta (its base was checked against `next_version - 1` on arrival, and
    /// one whose base passed is dropped).
    fn deliverable(&self) -> Option<u64> {
        if self
            .assemblies
            .get(&self.next_version)
            .is_some_and(Assembly::is_complete)
        {
            return Some(self.next_version);
        }
        self.assemblies
            .iter()
            .find(|(_, a)| a.kind == Some(ArtifactKind::Composed) && a.is_complete())
            .map(|(v, _)| *v)
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
            .retain(|(_, f, _)| !matches!(f, Frame::Want { .. }));
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
        self.out.push_back((stream.conn?, frame, false));
        Some((index, stream.epoch))
    }

    /// The next frame to write: on `conn`, closing it afterwards if the flag is set.
    pub fn poll_transmit(&mut self) -> Option<(ConnId, Frame, bool)> {
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
        idle.into_iter().chain(self.tune_at).min()
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
            self.lose_upstream(format!("nothing heard for {idle:?}"));
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

/// A complete, verified artifact, held as its parts: the descriptor, the segments in
/// order (the buffers they arrived in), then table and trailer.
///
/// Delivery copies nothing: joining a full checkpoint's gigabyte on the event loop
/// held up everything else for the better part of a second (BENCHMARKS.md). A
/// consumer that needs the bytes contiguous calls [`Artifact::to_bytes`] where it may
/// take its time (a relay forwards segments as they arrive and never needs it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifact {
    kind: ArtifactKind,
    header: Arc<DeltaHeader>,
    descriptor: Bytes,
    segments: Vec<Bytes>,
    entries: Vec<SegmentEntry>,
    tail: Bytes,
}

impl Artifact {
    fn from_assembly(assembly: Assembly, kind: ArtifactKind) -> Artifact {
        let (descriptor, header) = assembly.descriptor.expect("complete");
        let (_, entries) = assembly.table.expect("complete");
        let segments = assembly
            .segments
            .into_iter()
            .map(|held| held.expect("complete").1)
            .collect();
        let tail = Manifest {
            header: DeltaHeader::clone(&header),
            segments: entries.clone(),
        }
        .encode_tail();
        Artifact {
            kind,
            header,
            descriptor,
            segments,
            entries,
            tail: Bytes::from(tail),
        }
    }

    /// A delta, a composed delta, or the snapshot a joining receiver started from.
    pub fn kind(&self) -> ArtifactKind {
        self.kind
    }

    /// The header its descriptor carries (decoded and checked on arrival).
    pub fn header(&self) -> &Arc<DeltaHeader> {
        &self.header
    }

    /// The verified segments in order, each with its hash from the table.
    pub fn segments(&self) -> impl Iterator<Item = (u32, Hash, &Bytes)> {
        self.entries
            .iter()
            .zip(&self.segments)
            .enumerate()
            .map(|(index, (entry, bytes))| (index as u32, entry.hash, bytes))
    }

    /// The artifact's bytes, contiguous: descriptor, segments in order, then table and
    /// trailer. Copies every byte.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.parts().map(Bytes::len).sum());
        for part in self.parts() {
            out.extend_from_slice(part);
        }
        out.freeze()
    }

    fn parts(&self) -> impl Iterator<Item = &Bytes> {
        std::iter::once(&self.descriptor)
            .chain(&self.segments)
            .chain(std::iter::once(&self.tail))
    }
}

#[cfg(test)]
mod tests;
