//! The handle a caller holds: commands into a node's event loop, and its status out.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use aurora_delta::{Extraction, Manifest, Segment};
use aurora_proto::VersionRef;
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
    StoreChanged {
        reply: oneshot::Sender<Result<(), TransportError>>,
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
    /// preamble and header ([`aurora_delta::DeltaHeader::encode`]).
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

    /// Closes a version with its manifest; a hub with a store stores the artifact.
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
    pub async fn store_changed(&self) -> Result<(), TransportError> {
        self.call(|reply| Command::StoreChanged { reply }).await
    }

    /// Announces a commit to every subscriber.
    pub async fn commit(&self, commit: VersionRef) -> Result<(), TransportError> {
        self.commands
            .send(Command::Commit(commit))
            .await
            .map_err(|_| TransportError::Stopped)
    }

    /// Runs `extraction` and publishes it cut-through: the header first, each segment as
    /// the encoder finishes it, the manifest last. Blocks the calling thread, which must
    /// not be an async task's (use `spawn_blocking`).
    pub fn publish_extraction(&self, extraction: &Extraction) -> Result<Manifest, TransportError> {
        self.publish_extraction_observed(extraction, |_| {})
    }

    /// [`NodeHandle::publish_extraction`], calling `observe` with each segment as it
    /// leaves the encoder, before it is published (benchmarks time the first one).
    pub fn publish_extraction_observed(
        &self,
        extraction: &Extraction,
        mut observe: impl FnMut(&Segment) + Send,
    ) -> Result<Manifest, TransportError> {
        let descriptor = Bytes::from(extraction.header().encode());
        let version = block_on_reply(&self.commands, |reply| Command::Begin { descriptor, reply })?;
        let manifest = extraction.run(|segment: Segment| {
            observe(&segment);
            block_on_reply(&self.commands, |reply| Command::Segment {
                version,
                segment,
                reply,
            })
        })?;
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
