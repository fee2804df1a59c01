//! The handle a caller holds: commands into a node's event loop, and its status out.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use aurora_delta::{Hash, Manifest, Segment, SegmentSource};
use aurora_proto::{KeptSegments, KeptSnapshot, VersionRef};
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};

use super::{NodeStatus, TransportError};

pub(super) enum Command {
    Begin {
        descriptor: Bytes,
        reply: oneshot::Sender<Result<u64, TransportError>>,
    },
    Segment {
        version: u64,
        segment: Segment,
        reply: oneshot::Sender<Result<(), TransportError>>,
    },
    Seal {
        version: u64,
        manifest: Manifest,
        reply: oneshot::Sender<Result<(), TransportError>>,
    },
    Publish {
        artifact: Bytes,
        reply: oneshot::Sender<Result<u64, TransportError>>,
    },
    Commit(VersionRef),
    ExpectCommitted(u64),
    StoreChanged {
        reply: oneshot::Sender<Result<(), TransportError>>,
    },
    StopServing(String),
    /// A relay's fetcher hands over the snapshot it took ([`aurora_proto::Node::take_kept`]).
    TakeKept {
        reply: oneshot::Sender<Option<(KeptSnapshot, Box<dyn KeptSegments>)>>,
    },
}

/// A running node. Dropping the handle leaves the node running; [`NodeHandle::kill`]
/// stops it at once, closing every socket.
pub struct NodeHandle {
    pub(super) commands: mpsc::Sender<Command>,
    pub(super) status: watch::Receiver<NodeStatus>,
    pub(super) local_addr: Option<SocketAddr>,
    pub(super) task: tokio::task::JoinHandle<()>,
    pub(super) upstream_bytes: Arc<AtomicU64>,
}

impl NodeHandle {
    /// The address subscribers connect to (hubs and relays).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local_addr
    }

    pub fn status(&self) -> NodeStatus {
        self.status.borrow().clone()
    }

    /// Bytes read from upstream connections so far, frames of every kind, counted as
    /// they arrive rather than per complete frame: the live progress of a transfer whose
    /// segments take seconds each.
    pub fn upstream_bytes(&self) -> u64 {
        self.upstream_bytes.load(Ordering::Relaxed)
    }

    /// A receiver of every status update.
    pub fn watch(&self) -> watch::Receiver<NodeStatus> {
        self.status.clone()
    }

    /// Waits until the status satisfies `condition`.
    pub async fn wait_for(
        &self,
        mut condition: impl FnMut(&NodeStatus) -> bool,
    ) -> Result<NodeStatus, TransportError> {
        let mut watch = self.status.clone();
        let status = watch
            .wait_for(|s| condition(s))
            .await
            .map_err(|_| TransportError::Stopped)?;
        Ok(status.clone())
    }

    /// Waits until the node has every stream its session uses welcomed by its upstream
    /// (a tuned session's first one; more open while it runs), so what follows times (or
    /// faults) transfers, not connection set-up.
    pub async fn all_streams_up(&self) -> Result<NodeStatus, TransportError> {
        self.wait_for(|s| s.connected && s.streams > 0 && s.streams == s.target_streams)
            .await
    }

    /// Stops the node abruptly, as a crash would: no goodbye, every socket closed.
    pub fn kill(&self) {
        self.task.abort();
    }

    pub(super) async fn call<T>(
        &self,
        command: impl FnOnce(oneshot::Sender<Result<T, TransportError>>) -> Command,
    ) -> Result<T, TransportError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(command(reply))
            .await
            .map_err(|_| TransportError::Stopped)?;
        answer.await.map_err(|_| TransportError::Stopped)?
    }

    /// Starts publishing a delta whose segments follow (hubs): `descriptor` is its
    /// preamble and header with the target hash pending
    /// ([`aurora_delta::DeltaHeader::encode_pending`]); the Seal brings the hash.
    pub async fn begin(&self, descriptor: Bytes) -> Result<u64, TransportError> {
        self.call(|reply| Command::Begin { descriptor, reply })
            .await
    }

    /// Publishes one segment of a version begun with [`NodeHandle::begin`]; it goes out
    /// to subscribers at once.
    pub async fn segment(&self, version: u64, segment: Segment) -> Result<(), TransportError> {
        self.call(|reply| Command::Segment {
            version,
            segment,
            reply,
        })
        .await
    }

    /// Closes a version with its manifest, whose header holds the target hash; a hub with
    /// a store stores the artifact.
    pub async fn seal(&self, version: u64, manifest: Manifest) -> Result<(), TransportError> {
        self.call(|reply| Command::Seal {
            version,
            manifest,
            reply,
        })
        .await
    }

    /// Publishes a complete delta artifact (and stores it, on a hub with a store).
    pub async fn publish(&self, artifact: Bytes) -> Result<u64, TransportError> {
        self.call(|reply| Command::Publish { artifact, reply })
            .await
    }

    /// The store was written behind the hub's back (a snapshot put by the trainer): the
    /// hub serves what the store holds now, and offers its newest snapshot to peers that
    /// join with no weights. Returns once the hub has read the catalog.
    /// A fetcher's snapshot, once it has delivered it.
    pub(super) async fn take_kept(
        &self,
    ) -> Result<(KeptSnapshot, Box<dyn KeptSegments>), TransportError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::TakeKept { reply })
            .await
            .map_err(|_| TransportError::Stopped)?;
        answer
            .await
            .map_err(|_| TransportError::Stopped)?
            .ok_or(TransportError::Stopped)
    }

    pub async fn store_changed(&self) -> Result<(), TransportError> {
        self.call(|reply| Command::StoreChanged { reply }).await
    }

    /// Version `version` is committed, as the control plane says: while this node lacks
    /// it or its Commit, a relay upstream that brings too little for
    /// [`NodeConfig::behind_timeout`](super::NodeConfig) (nothing new but less than
    /// [`aurora_proto::BEHIND_PROGRESS_BYTES`] of segments) is given up for the next
    /// upstream (docs/wire-protocol.md §6.4). Without it, a relay that keeps its session
    /// alive but is stuck behind, or withholds, would hold its actors back for good.
    pub async fn expect_committed(&self, version: u64) -> Result<(), TransportError> {
        self.commands
            .send(Command::ExpectCommitted(version))
            .await
            .map_err(|_| TransportError::Stopped)
    }

    /// Sends every subscriber away and refuses new ones, for `reason`, until the node
    /// stops: a relay's graceful stop, so its subscribers move to their next upstream at
    /// once ([`aurora_proto::Node::stop_serving`]).
    pub async fn stop_serving(&self, reason: String) -> Result<(), TransportError> {
        self.commands
            .send(Command::StopServing(reason))
            .await
            .map_err(|_| TransportError::Stopped)
    }

    /// Announces a commit to every subscriber.
    pub async fn commit(&self, commit: VersionRef) -> Result<(), TransportError> {
        self.commands
            .send(Command::Commit(commit))
            .await
            .map_err(|_| TransportError::Stopped)
    }

    /// Runs `delta` (an extraction, or the parts of sharded ranks put together) and
    /// publishes it cut-through: the descriptor first (its target hash pending), each
    /// segment as the encoder finishes it, and the Seal with the manifest last. `target_hash` runs beside the encoder (the hash of a large model
    /// takes as long as its extraction) and returns the target's weights hash, which the
    /// Seal carries (docs/wire-protocol.md §4.4): whatever must precede the Seal (a
    /// control-plane announcement) belongs in it too. On an error of either, nothing is
    /// sealed: the Offer and the segments sent stay with the subscribers until a later
    /// publication of the version, whose Seal tells its segments from these
    /// (docs/wire-protocol.md §4.4). Blocks the calling thread, which must not be an
    /// async task's (use `spawn_blocking`); both run on its rayon pool.
    pub fn publish_delta<E: From<TransportError> + Send>(
        &self,
        delta: &impl SegmentSource,
        target_hash: impl FnOnce() -> Result<Hash, E> + Send,
    ) -> Result<Manifest, E> {
        self.publish_delta_observed(delta, target_hash, |_| {})
    }

    /// [`NodeHandle::publish_delta`], calling `observe` with each segment as it
    /// leaves the encoder, before it is published (benchmarks time the first one).
    pub fn publish_delta_observed<E: From<TransportError> + Send>(
        &self,
        delta: &impl SegmentSource,
        target_hash: impl FnOnce() -> Result<Hash, E> + Send,
        mut observe: impl FnMut(&Segment) + Send,
    ) -> Result<Manifest, E> {
        let descriptor = Bytes::from(delta.header().encode_pending());
        let version = block_on_reply(&self.commands, |reply| Command::Begin { descriptor, reply })?;
        // The encoder first: on a pool of one thread the hash follows it.
        let (extracted, hashed) = rayon::join(
            || {
                delta.run(|segment: Segment| {
                    observe(&segment);
                    block_on_reply(&self.commands, |reply| Command::Segment {
                        version,
                        segment,
                        reply,
                    })
                })
            },
            target_hash,
        );
        let mut manifest = extracted?;
        let hash = hashed?;
        let header = delta.header();
        if !header.target_pending() && header.target_hash != hash {
            return Err(TransportError::TargetHashDisagrees {
                version,
                header: header.target_hash,
                given: hash,
            }
            .into());
        }
        manifest.header.target_hash = hash;
        block_on_reply(&self.commands, |reply| Command::Seal {
            version,
            manifest: manifest.clone(),
            reply,
        })?;
        Ok(manifest)
    }
}

pub(super) fn block_on_reply<T>(
    commands: &mpsc::Sender<Command>,
    command: impl FnOnce(oneshot::Sender<Result<T, TransportError>>) -> Command,
) -> Result<T, TransportError> {
    let (reply, answer) = oneshot::channel();
    commands
        .blocking_send(command(reply))
        .map_err(|_| TransportError::Stopped)?;
    answer
        .blocking_recv()
        .map_err(|_| TransportError::Stopped)?
}
