//! What a sender keeps per subscriber: its connections, and per version in flight the
//! state of every segment, from which the next frame a stream carries is chosen.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;

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
}

impl Session {
    /// The artifact this session is served to reach `version`: the composed delta it was
    /// chosen for, the snapshot it joins from, or else the delta.
    pub(super) fn artifact_for(&self, version: u64) -> ArtifactKey {
        match self.composed {
            Some((base, target)) if target == version => ArtifactKey::Composed { base, target },
            _ if self.snapshot == Some(version) => ArtifactKey::Snapshot(version),
            _ => ArtifactKey::Delta(version),
        }
    }
}

pub(super) struct Conn {
    /// Who the TLS handshake proved the peer to be (none over plaintext).
    pub(super) peer: Option<Identity>,
    pub(super) session: Option<u64>,
    pub(super) stream: u8,
    pub(super) epoch: u32,
    pub(super) credit: usize,
    /// Frames for this connection only (handshake answers).
    pub(super) direct: VecDeque<(Frame, bool)>,
    pub(super) opened_at: Instant,
    pub(super) last_send: Instant,
    pub(super) stalled_since: Option<Instant>,
    pub(super) closing: bool,
}

/// The next frame of `artifact` (`key`) that a session whose state is `state` needs,
/// written on stream (index, epoch) `on`: its Offer, its Seal once known, then each
/// segment it does not hold, lowest index first.
pub(super) fn next_artifact_frame(
    state: &mut SendVersion,
    artifact: &Artifact,
    key: ArtifactKey,
    (stream, epoch): (u8, u32),
    stats: &mut SenderStats,
) -> Option<Frame> {
    let (version, kind) = (key.version(), key.kind());
    if !state.offer_sent {
        state.offer_sent = true;
        if kind == ArtifactKind::Composed {
            stats.composed_offers += 1;
        }
        return Some(Frame::Offer {
            version,
            kind,
            descriptor: artifact.descriptor.clone(),
            signature: artifact.offer_signature,
        });
    }
    if let Some(seal) = &artifact.seal
        && !state.seal_sent
    {
        state.seal_sent = true;
        return Some(Frame::Seal {
            version,
            id: seal.id,
            segments: seal.segments.clone(),
            signature: seal.signature,
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
