//! What a receiver holds of each version until it is complete, and the verified
//! artifacts it delivers, in version order, from those holdings.

use std::collections::BTreeMap;
use std::sync::Arc;

use aurora_delta::{ArtifactSignature, DeltaHeader, Hash, Manifest, SegmentEntry};
use bytes::{Bytes, BytesMut};

use super::{Receiver, ReceiverEvent, Start};
use crate::frame::{ArtifactKind, Progress, VersionRef};
use crate::ranges;

/// Memory a held segment costs beyond its bytes, charged against `max_held_bytes`.
pub(super) const SEGMENT_OVERHEAD_BYTES: u64 = 64;
/// Memory of one slot of an assembly's segment list: a segment at index i costs i slots.
pub(super) const SLOT_BYTES: u64 = 48;

#[derive(Default)]
pub(super) struct Assembly {
    /// The Offer's descriptor and its header: pending until the table is verified, then
    /// completed with the Seal's target hash.
    pub(super) descriptor: Option<(Bytes, Arc<DeltaHeader>)>,
    /// The kind its Offer named (set with the descriptor).
    pub(super) kind: Option<ArtifactKind>,
    pub(super) segments: Vec<Option<(Hash, Bytes)>>,
    pub(super) table: Option<Table>,
    /// The signature the Seal carried with the table.
    pub(super) signature: Option<ArtifactSignature>,
    pub(super) verified_table: bool,
    pub(super) failures: BTreeMap<u32, u32>,
    pub(super) held_bytes: u64,
    /// The consumer takes its segments as they are announced
    /// ([`super::Receiver::take_segments`]): only their hashes are kept.
    pub(super) taken: bool,
}

/// What a Seal carries.
pub(super) struct Table {
    pub(super) id: Hash,
    pub(super) target_hash: Hash,
    pub(super) entries: Vec<SegmentEntry>,
}

impl Assembly {
    pub(super) fn is_complete(&self) -> bool {
        match (&self.descriptor, &self.table) {
            (Some(_), Some(table)) => {
                self.verified_table
                    && self.segments.len() == table.entries.len()
                    && self.segments.iter().all(Option::is_some)
            }
            _ => false,
        }
    }

    pub(super) fn progress(&self, version: u64) -> Progress {
        Progress {
            version,
            has_offer: self.descriptor.is_some(),
            has_seal: self.table.is_some() && self.verified_table,
            composed: self.kind == Some(ArtifactKind::Composed),
            have: ranges::have_ranges(self.segments.iter().map(Option::is_some)),
        }
    }
}

impl Receiver {
    /// Hands out complete versions in order and tells the upstream the window moved.
    /// A complete composed delta from `next_version - 1` is delivered as its version,
    /// and what is held of the versions it skips is dropped.
    pub(super) fn deliver(&mut self) {
        let mut moved = false;
        while let Some(version) = self.deliverable() {
            let assembly = self.assemblies.remove(&version).expect("deliverable");
            self.held_bytes -= assembly.held_bytes;
            let kind = match assembly.kind {
                Some(ArtifactKind::Composed) => ArtifactKind::Composed,
                _ => self.kind_of(version),
            };
            // A joiner told of a commit past its snapshot expects it from now on: an
            // upstream that brings it too little of the way is given up (§6.4).
            let told = self.config.join_floor.commit;
            if matches!(self.start, Start::Snapshot(_)) && told > version {
                self.expected = self.expected.max(Some(told));
            }
            // Delivered: from now on every version follows this one as a delta, and a
            // relay that chooses its start again (cut off past its upstream's window)
            // follows from the newest version: taking a snapshot again would hold back
            // the deltas its actors wait for until the snapshot came.
            self.start = Start::Weights;
            if self.relaying {
                self.relay_start = Start::Newest;
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
    pub(super) fn deliverable(&self) -> Option<u64> {
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
}

/// A complete, verified artifact, held as its parts: the preamble and complete header,
/// the segments in order (the buffers they arrived in), then table and trailer.
///
/// Delivery copies nothing: joining a full checkpoint's gigabyte on the event loop
/// held up everything else for the better part of a second (BENCHMARKS.md). A
/// consumer that needs the bytes contiguous calls [`Artifact::to_bytes`] where it may
/// take its time (a relay forwards segments as they arrive and never needs it). A
/// version's segments are empty where its consumer took them as they were announced
/// ([`super::Receiver::take_segments`]).
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
    pub(super) fn from_assembly(assembly: Assembly, kind: ArtifactKind) -> Artifact {
        // Complete: the header holds the Seal's target hash.
        let (_, header) = assembly.descriptor.expect("complete");
        let entries = assembly.table.expect("complete").entries;
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
            descriptor: Bytes::from(header.encode()),
            header,
            segments,
            entries,
            tail: Bytes::from(tail),
        }
    }

    /// A delta, a composed delta, or the snapshot a joining receiver started from.
    pub fn kind(&self) -> ArtifactKind {
        self.kind
    }

    /// Its header, complete with the target hash its Seal brought.
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

    pub(super) fn parts(&self) -> impl Iterator<Item = &Bytes> {
        std::iter::once(&self.descriptor)
            .chain(&self.segments)
            .chain(std::iter::once(&self.tail))
    }
}
