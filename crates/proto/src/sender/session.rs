//! What a sender keeps per subscriber: its connections, and per version in flight the
//! state of every segment, from which the next frame a stream carries is chosen.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use super::SenderStats;
use super::artifacts::{Artifact, ArtifactKey};
use crate::frame::{ArtifactKind, Frame};
use crate::{ConnId, Identity, ranges};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SegState {
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
pub(super) struct SendVersion {
    pub(super) offer_sent: bool,
    pub(super) seal_sent: bool,
    /// States of the segments the artifact has (never longer: a hostile index cannot
    /// make it grow).
    pub(super) segs: Vec<SegState>,
    /// The have-ranges of the last Want, for segments beyond `segs`.
    pub(super) reported: Vec<std::ops::Range<u32>>,
    /// No index below this one is `Unsent` and present.
    pub(super) cursor: usize,
    /// Segments sent at least once: a later send is a resend.
    pub(super) ever_sent: BTreeSet<u32>,
    /// When the latest frame of this version was handed out, on any stream.
    pub(super) written_at: Option<Instant>,
    /// The streams the Offer and the Seal went out on.
    pub(super) offer_on: Option<u8>,
    pub(super) seal_on: Option<u8>,
    /// The version is overdue: its frames go out once more, each on a stream other than
    /// its own (§5.13).
    pub(super) hedge: Option<Hedge>,
}

/// What an overdue version has copied so far: each frame at most once.
#[derive(Default)]
pub(super) struct Hedge {
    offer: bool,
    seal: bool,
    segments: BTreeSet<u32>,
}

impl SendVersion {
    pub(super) fn state(&self, index: usize) -> SegState {
        match self.segs.get(index) {
            Some(state) => *state,
            None if ranges::contains(&self.reported, index as u32) => SegState::Have,
            None => SegState::Unsent,
        }
    }

    /// Callers pass only indices of segments the artifact has.
    pub(super) fn set(&mut self, index: usize, state: SegState) {
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

pub(super) struct Session {
    pub(super) peer_id: String,
    pub(super) streams: Vec<Option<ConnId>>,
    /// The epoch of the latest connection welcomed on each stream: a Hello of an epoch
    /// not above it is a replay.
    pub(super) epochs: Vec<u32>,
    /// None until the first Want: nothing is sent before the subscriber says what it has.
    pub(super) next_version: Option<u64>,
    /// The version the latest Want asked for as a snapshot (its next version).
    pub(super) snapshot: Option<u64>,
    /// The composed delta (base, target) this session is served in place of the deltas
    /// from `base + 1` to `target`.
    pub(super) composed: Option<(u64, u64)>,
    pub(super) last_want: Option<u64>,
    pub(super) versions: BTreeMap<u64, SendVersion>,
    pub(super) control: VecDeque<Frame>,
    /// A version reported unavailable; nothing more is sent until the next Want.
    pub(super) blocked: bool,
    pub(super) nacks: u32,
    /// The least time seen from a version's last frame handed out to the Want that
    /// moved past it: a round trip plus the transfer of a version.
    pub(super) delivery: Option<Duration>,
}

impl Session {
    /// The artifact this session is served to reach `version`: the composed delta it was
    /// chosen for, the snapshot it joins from, or else the delta.
    pub(super) fn artifact_for(&self, version: u64) -> ArtifactKey {
        session_artifact(self.snapshot, self.composed, version)
    }
}

/// [`Session::artifact_for`] from the session's `snapshot` and `composed` fields, for
/// callers that hold its versions mutably.
pub(super) fn session_artifact(
    snapshot: Option<u64>,
    composed: Option<(u64, u64)>,
    version: u64,
) -> ArtifactKey {
    match composed {
        Some((base, target)) if target == version => ArtifactKey::Composed { base, target },
        _ if snapshot == Some(version) => ArtifactKey::Snapshot(version),
        _ => ArtifactKey::Delta(version),
    }
}

pub(super) struct Conn {
    /// Who the TLS handshake proved the peer to be (none over plaintext).
    pub(super) peer: Option<Identity>,
    pub(super) session: Option<u64>,
    pub(super) stream: u8,
    pub(super) epoch: u32,
    /// The frames handed to the driver and not yet reported written, oldest first, each
    /// as whether it is a segment: the window is full at `window_frames` of them.
    pub(super) in_flight: VecDeque<bool>,
    /// Frames for this connection only (handshake answers).
    pub(super) direct: VecDeque<(Frame, bool)>,
    pub(super) opened_at: Instant,
    pub(super) last_send: Instant,
    pub(super) stalled_since: Option<Instant>,
    pub(super) closing: bool,
    /// It carried a frame of a version when that version became overdue, and no version
    /// it carried has been delivered without being sent again since: it takes frames
    /// only after the session's other streams (§5 rule 3).
    pub(super) late: bool,
}

/// The next frame of `artifact` (`key`) that a session whose state is `state` needs,
/// written on stream (index, epoch) `on` at `now`: its Offer, its Seal once known, then
/// each segment it does not hold, lowest index first.
pub(super) fn next_artifact_frame(
    state: &mut SendVersion,
    artifact: &Artifact,
    key: ArtifactKey,
    on: (u8, u32),
    now: Instant,
    stats: &mut SenderStats,
) -> Option<Frame> {
    let frame = first_send(state, artifact, key, on, stats)?;
    state.written_at = Some(now);
    Some(frame)
}

fn first_send(
    state: &mut SendVersion,
    artifact: &Artifact,
    key: ArtifactKey,
    (stream, epoch): (u8, u32),
    stats: &mut SenderStats,
) -> Option<Frame> {
    let version = key.version();
    if !state.offer_sent {
        state.offer_sent = true;
        state.offer_on = Some(stream);
        if key.kind() == ArtifactKind::Composed {
            stats.composed_offers += 1;
        }
        return Some(artifact.offer_frame(key));
    }
    if !state.seal_sent
        && let Some(seal) = artifact.seal_frame(version)
    {
        state.seal_sent = true;
        state.seal_on = Some(stream);
        return Some(seal);
    }
    while state.cursor < artifact.segments.len() && state.state(state.cursor) != SegState::Unsent {
        state.cursor += 1;
    }
    let index = (state.cursor..artifact.segments.len())
        .find(|&i| state.state(i) == SegState::Unsent && artifact.present(i))?;
    let frame = artifact.segment_frame(version, index);
    state.set(index, SegState::Sent { stream, epoch });
    stats.segments_sent += 1;
    if let Frame::Segment { bytes, .. } = &frame {
        stats.segment_bytes_sent += bytes.len() as u64;
    }
    if !state.ever_sent.insert(index as u32) {
        stats.segments_resent += 1;
    }
    Some(frame)
}

/// Whether `state`, once overdue, may be sent again: every frame of the sealed
/// `artifact` is out, and it is no larger than `max_bytes`.
pub(super) fn hedgeable(state: &SendVersion, artifact: &Artifact, max_bytes: u64) -> bool {
    state.offer_sent
        && state.seal_sent
        && artifact
            .sealed_payload_bytes()
            .is_some_and(|bytes| bytes <= max_bytes)
        && (0..artifact.segments.len())
            .all(|i| !artifact.present(i) || state.state(i) != SegState::Unsent)
}

/// A copy of a frame of an overdue version that went out on another stream than
/// `stream` and was not copied yet: the Offer, the Seal, then the segments not known to
/// be held. Receivers ignore whichever copy comes second (§6.2).
pub(super) fn next_hedge_frame(
    state: &mut SendVersion,
    artifact: &Artifact,
    key: ArtifactKey,
    stream: u8,
    stats: &mut SenderStats,
) -> Option<Frame> {
    let elsewhere = |on: Option<u8>| on.is_some_and(|on| on != stream);
    let version = key.version();
    let hedge = state.hedge.as_ref()?;
    let frame = if !hedge.offer && elsewhere(state.offer_on) {
        state.hedge.as_mut()?.offer = true;
        artifact.offer_frame(key)
    } else if !hedge.seal && elsewhere(state.seal_on) {
        let seal = artifact.seal_frame(version)?;
        state.hedge.as_mut()?.seal = true;
        seal
    } else {
        let index = (0..artifact.segments.len()).find(|&i| {
            matches!(state.state(i), SegState::Sent { stream: on, .. } if on != stream)
                && artifact.present(i)
                && !hedge.segments.contains(&(i as u32))
        })?;
        state.hedge.as_mut()?.segments.insert(index as u32);
        artifact.segment_frame(version, index)
    };
    stats.frames_hedged += 1;
    Some(frame)
}
