//! Where a relay keeps the snapshot it serves its region's joins from
//! (docs/wire-protocol.md §8). A snapshot is the whole model (16.4 GB at 8B): a relay
//! that held its segments on the heap would grow with the model, so the driver gives
//! the node a [`SnapshotSpace`] that keeps them in a file and serves them from its map,
//! page cache the kernel writes back and drops under pressure. This crate does no I/O:
//! it defines the interface and the heap's ([`HeapSnapshots`], for tests and the
//! simulation); the file's is the transport's.

use std::fmt;
use std::io;

use aurora_delta::{DeltaHeader, TensorChange};
use bytes::Bytes;

/// How many snapshots' worth of deltas a relay keeps after its snapshot
/// (docs/wire-protocol.md §8). A joiner takes the snapshot and them over its region's
/// network, which costs the WAN nothing, so they stay until they come to this many
/// snapshots; the relay takes a newer snapshot, a snapshot across the WAN, when they
/// come to half as much. The more it keeps, the rarer that is (a snapshot each time
/// this many halves of one have crossed as deltas), and the more the relay's disk holds.
pub const KEPT_TAIL_SNAPSHOTS: u64 = 2;

/// Where kept snapshots live.
pub trait SnapshotSpace: Send + Sync + fmt::Debug {
    /// Room for the segments of one snapshot, at most `capacity` bytes of them.
    fn create(&self, capacity: u64) -> io::Result<Box<dyn KeptSegments>>;
}

/// The segments of one kept snapshot.
pub trait KeptSegments: Send + fmt::Debug {
    /// Keeps `bytes` and returns them as kept, to be served from there; an error of kind
    /// `StorageFull` where the capacity is spent (or the disk is full).
    fn keep(&mut self, bytes: &[u8]) -> io::Result<Bytes>;
}

/// The room a snapshot with `header` and the deltas kept after it need: its tensors'
/// bytes with the chunk records' framing around them (a few dozen bytes per chunk of at
/// most 8 MiB, delta-format §5), [`KEPT_TAIL_SNAPSHOTS`] times as much for the deltas,
/// and an eighth more for segments sent twice (one revoked by its table). The room is
/// reserved, not taken: the disk holds only what was kept.
pub fn snapshot_capacity(header: &DeltaHeader) -> u64 {
    let tensors: u64 = header
        .tensors
        .iter()
        .map(|entry| match &entry.change {
            TensorChange::Added(spec) => spec.byte_len(),
            _ => 0,
        })
        .fold(0, u64::saturating_add);
    tensors
        .saturating_mul(1 + KEPT_TAIL_SNAPSHOTS)
        .saturating_add(tensors / 8)
        .saturating_add(1 << 20)
}

/// Snapshots kept on the heap: tests and the simulation.
#[derive(Debug, Clone, Copy, Default)]
pub struct HeapSnapshots;

impl SnapshotSpace for HeapSnapshots {
    fn create(&self, capacity: u64) -> io::Result<Box<dyn KeptSegments>> {
        Ok(Box::new(HeapSegments { left: capacity }))
    }
}

#[derive(Debug)]
struct HeapSegments {
    left: u64,
}

impl KeptSegments for HeapSegments {
    fn keep(&mut self, bytes: &[u8]) -> io::Result<Bytes> {
        self.left = self.left.checked_sub(bytes.len() as u64).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::StorageFull,
                format!("{} bytes more than the snapshot's room", bytes.len()),
            )
        })?;
        Ok(Bytes::copy_from_slice(bytes))
    }
}
