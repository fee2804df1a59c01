//! A relay's rules (docs/wire-protocol.md §8) beyond forwarding, which the node's routing
//! does: keeping a snapshot for its region's joins and fetching newer ones, suspending
//! its subscribers while it has no working upstream, and its graceful stop.

use std::sync::Arc;
use std::time::Instant;

use super::keeping::Keeping;
use super::{Node, RelayOptions};
use crate::keep::{KeptSegments, SnapshotSpace};
use crate::receiver::Receiver;
use crate::sender::{ArtifactKey, KeptSnapshot, Sender};

impl Node {
    /// See [`super::RelayOptions::keep_snapshots`].
    pub(super) fn keep_snapshots(&mut self, space: Arc<dyn SnapshotSpace>) {
        if let (Some(sender), Some(receiver)) = (&mut self.sender, &mut self.receiver) {
            receiver.keep_snapshots();
            sender.hold_hellos();
            self.keeping = Some(Keeping::new(space));
        }
    }

    /// A relay's fetcher of a newer snapshot than the one of `newer_than` it keeps
    /// ([`crate::Output::FetchSnapshot`]): a relay that keeps snapshots in `space` and takes
    /// none as old as that. Once it has delivered its snapshot, [`Node::take_kept`] hands
    /// it over.
    pub fn snapshot_fetcher(
        mut receiver: Receiver,
        sender: Sender,
        space: Arc<dyn SnapshotSpace>,
        newer_than: u64,
    ) -> Node {
        receiver.take_snapshots_from(newer_than.saturating_add(1));
        let options = RelayOptions {
            keep_snapshots: Some(space),
            suspend_after: None,
        };
        Node::relay(receiver, sender, options)
    }

    /// A fetcher's snapshot, complete and sealed, with the complete deltas after it and
    /// where their segments are kept.
    pub fn take_kept(&mut self) -> Option<(KeptSnapshot, Box<dyn KeptSegments>)> {
        self.keeping.as_mut()?.take(self.sender.as_mut()?)
    }

    /// A relay serves the snapshot its fetcher took in place of the one it kept, and
    /// keeps the deltas after it where that one's segments are ([`Sender::adopt_snapshot`]).
    pub fn adopt_snapshot(&mut self, snapshot: KeptSnapshot, file: Box<dyn KeptSegments>) {
        let (Some(keeping), Some(sender)) = (&mut self.keeping, &mut self.sender) else {
            return;
        };
        let version = snapshot.version();
        match keeping.adopt(sender, snapshot, file) {
            Ok(()) => tracing::info!(version, "serving a newer snapshot to the region's joiners"),
            Err(reason) => tracing::warn!(version, reason, "the fetched snapshot is not served"),
        }
    }

    /// The fetch asked for by [`crate::Output::FetchSnapshot`] brought no newer snapshot, for
    /// `reason`: it is asked for again some versions on
    /// (`FETCH_RETRY_VERSIONS`, twice as many after each failure in a row).
    pub fn snapshot_not_fetched(&mut self, reason: &str) {
        tracing::info!(reason, "no newer snapshot for the region's joiners");
        if let (Some(keeping), Some(sender)) = (&mut self.keeping, &self.sender) {
            keeping.not_fetched(sender);
        }
    }

    /// The key a relay publishes `version`'s artifact under: the kind its Offer named.
    pub(super) fn relayed(&self, version: u64) -> ArtifactKey {
        self.keeping
            .as_ref()
            .map_or(ArtifactKey::Delta(version), |keeping| keeping.key(version))
    }

    /// Sends every subscriber away and refuses new ones for good ([`Sender::suspend`]):
    /// a relay's graceful stop (docs/wire-protocol.md §8), after which its subscribers
    /// are at their next upstream before it closes its sockets.
    pub fn stop_serving(&mut self, reason: String) {
        self.stopped_serving = true;
        if let Some(sender) = &mut self.sender {
            tracing::info!(reason, "sending the subscribers away for good");
            sender.suspend(reason);
        }
    }

    /// When a relay without a working upstream suspends its sender (a time past what an
    /// instant holds: never).
    pub(super) fn suspend_at(&self) -> Option<Instant> {
        let serving = self.sender.as_ref().is_some_and(|s| !s.is_suspended());
        let lost = self.upstream_lost_at.filter(|_| serving)?;
        lost.checked_add(self.suspend_after?)
    }

    /// When the relay's current upstream session, welcomed after a loss, has lasted long
    /// enough to count as working.
    pub(super) fn proven_at(&self) -> Option<Instant> {
        self.upstream_lost_at?;
        self.upstream_welcomed_at?.checked_add(self.suspend_after?)
    }

    /// The relay's upstream works again: it serves, if it had stopped.
    pub(super) fn upstream_works(&mut self) {
        self.upstream_lost_at = None;
        if let Some(sender) = &mut self.sender
            && sender.is_suspended()
            && !self.stopped_serving
        {
            tracing::info!("an upstream again: serving subscribers");
            sender.resume();
        }
    }
}
