//! What a relay that keeps a snapshot for its region's joins does besides forwarding
//! (docs/wire-protocol.md §8): where the snapshot's segments and the deltas' after it
//! go, which artifact a forwarded segment belongs to, and when to take a newer snapshot.

use std::collections::BTreeMap;
use std::sync::Arc;

use aurora_delta::DeltaHeader;
use bytes::Bytes;

use crate::frame::ArtifactKind;
use crate::keep::{KEPT_TAIL_SNAPSHOTS, KeptSegments, SnapshotSpace, snapshot_capacity};
use crate::receiver::Receiver;
use crate::sender::{ArtifactKey, KeptSnapshot, Sender};

/// Versions a relay lets pass before it asks again for a newer snapshot its upstream did
/// not have: a failed try costs a handshake, and a hub makes a snapshot every few
/// versions. Each failure in a row doubles it, up to [`FETCH_RETRY_DOUBLINGS`] times: a
/// try that fails after the snapshot came cost a snapshot across the WAN.
pub const FETCH_RETRY_VERSIONS: u64 = 8;
pub const FETCH_RETRY_DOUBLINGS: u32 = 6;

pub(super) struct Keeping {
    space: Arc<dyn SnapshotSpace>,
    /// The snapshot being taken or kept, and where its segments go, and the deltas'
    /// after it.
    file: Option<(u64, Box<dyn KeptSegments>)>,
    /// Each relayed version's kind, from its Offer: which artifact a segment is part of.
    kinds: BTreeMap<u64, ArtifactKind>,
    /// A snapshot the relay stopped keeping before it was whole: it is never offered
    /// again, since what the receiver already holds of it is not in the file.
    given_up: Option<u64>,
    /// Whether a joiner has wanted a kept snapshot since a newer one was last asked for.
    demand: bool,
    /// Whether a fetch asked for is still out: its outcome changes the kept snapshot, or
    /// says it failed.
    fetching: bool,
    /// The relay's version from which a failed fetch may be tried again, the failures
    /// in a row, and the snapshot kept when the last one failed: a fetch for another
    /// (the kept one withdrawn, or replaced) starts without the wait.
    retry_from: Option<u64>,
    failures: u32,
    failed_for: Option<u64>,
    /// The newest snapshot kept so far: one fetched after it was withdrawn must be newer.
    last_kept: Option<u64>,
}

impl Keeping {
    pub(super) fn new(space: Arc<dyn SnapshotSpace>) -> Keeping {
        Keeping {
            space,
            file: None,
            kinds: BTreeMap::new(),
            given_up: None,
            demand: false,
            fetching: false,
            retry_from: None,
            failures: 0,
            failed_for: None,
            last_kept: None,
        }
    }

    /// The upstream's Welcome chose the receiver's start: the sender offers the snapshot
    /// the receiver will take, and stops offering one that will not be whole (the
    /// receiver takes another, or none), so that no joiner waits for it for ever.
    pub(super) fn connected(&mut self, sender: &mut Sender, receiver: &Receiver) {
        let taking = receiver
            .taking_snapshot()
            .filter(|&version| self.given_up != Some(version));
        if let Some(kept) = sender.kept_snapshot()
            && taking != Some(kept)
            && !sender.kept_snapshot_complete()
        {
            self.give_up(sender, kept, "the relay's upstream no longer brings it");
        }
        match taking {
            // Its deltas are not held here (the relay holds versions from after it).
            Some(version) if !sender.holds_deltas_after(version) => {
                self.given_up = Some(version);
            }
            Some(version) => sender.expect_snapshot(version),
            None => {}
        }
    }

    /// The Offer of `version` as `kind`: whether the relay publishes it. A snapshot's
    /// segments are kept in the space and served from there: the receiver holds only
    /// their hashes, not the whole model until the last one came.
    pub(super) fn offered(
        &mut self,
        sender: &mut Sender,
        receiver: &mut Receiver,
        version: u64,
        kind: ArtifactKind,
        header: &DeltaHeader,
    ) -> bool {
        self.kinds.insert(version, kind);
        match kind {
            ArtifactKind::Delta => return true,
            ArtifactKind::Composed => return false,
            ArtifactKind::Snapshot => receiver.take_segments(version),
        }
        if self.given_up == Some(version) {
            return false;
        }
        if self.file.as_ref().is_some_and(|(kept, _)| *kept == version) {
            // Resumed in a new session.
            return true;
        }
        match self.space.create(snapshot_capacity(header)) {
            Ok(file) => {
                self.file = Some((version, file));
                true
            }
            Err(why) => {
                self.give_up(sender, version, &format!("no room to keep it: {why}"));
                false
            }
        }
    }

    /// The key a segment of `version` is published under.
    pub(super) fn key(&self, version: u64) -> ArtifactKey {
        match self.kinds.get(&version) {
            Some(ArtifactKind::Snapshot) => ArtifactKey::Snapshot(version),
            _ => ArtifactKey::Delta(version),
        }
    }

    /// A segment published as `key`, kept in the file if it is the kept snapshot's or a
    /// later delta's (the sender keeps those with the snapshot for its joiners); `None`
    /// where it cannot be served.
    pub(super) fn segment(
        &mut self,
        sender: &mut Sender,
        key: ArtifactKey,
        index: u32,
        bytes: Bytes,
    ) -> Option<Bytes> {
        if self.file.as_ref().map(|(kept, _)| *kept) != sender.kept_snapshot() {
            // Withdrawn, or replaced before its Offer came: nothing more goes in it.
            self.file = None;
        }
        let Some((kept, file)) = &mut self.file else {
            return matches!(key, ArtifactKey::Delta(_)).then_some(bytes);
        };
        let kept = *kept;
        let in_file = match key {
            ArtifactKey::Snapshot(version) => version == kept,
            ArtifactKey::Delta(version) => version > kept,
            ArtifactKey::Composed { .. } => false,
        };
        if !in_file {
            return matches!(key, ArtifactKey::Delta(_)).then_some(bytes);
        }
        match file.keep(&bytes) {
            Ok(kept) => Some(kept),
            Err(why) => {
                self.give_up(sender, kept, &format!("segment {index} of {key}: {why}"));
                // A delta goes on from memory, as on a relay that keeps no snapshot.
                matches!(key, ArtifactKey::Delta(_)).then_some(bytes)
            }
        }
    }

    /// `version` is complete here: what is no longer relayed is forgotten, and a newer
    /// snapshot is asked for (the version it must beat) when it is time
    /// ([`Keeping::due`]).
    pub(super) fn delivered(&mut self, sender: &Sender, version: u64) -> Option<u64> {
        self.kinds = self.kinds.split_off(&(version + 1));
        self.demand |= sender.kept_snapshot_wanted();
        self.last_kept = self.last_kept.max(sender.kept_snapshot());
        if self.retry_from.is_some() && self.failed_for != sender.kept_snapshot() {
            self.retry_from = None;
            self.failures = 0;
        }
        let due = self.due(sender, version)?;
        self.fetching = true;
        self.demand = false;
        Some(due)
    }

    /// The snapshot a newer one should now beat, if one is to be asked for: a joiner
    /// has wanted the kept one since the last ask, no fetch is out or waiting to be
    /// retried, and the deltas after the kept one have come to half of what is kept
    /// ([`KEPT_TAIL_SNAPSHOTS`]). A newer snapshot costs the upstream link a snapshot; a
    /// region where nobody joins is not worth it. Where none is kept (withdrawn, given
    /// up, or none offered at the start), a joiner welcomed without one since is reason
    /// enough, and only that: the demand for a snapshot since withdrawn was met. The
    /// fetcher brings the deltas after its snapshot that the relay no longer holds
    /// ([`Sender::adopt_snapshot`]).
    fn due(&self, sender: &Sender, version: u64) -> Option<u64> {
        if !self.demand || self.fetching || self.retry_from.is_some_and(|from| version < from) {
            return None;
        }
        let Some(kept) = sender.kept_snapshot() else {
            return sender
                .kept_snapshot_wanted()
                .then(|| self.last_kept.max(self.given_up).unwrap_or(0));
        };
        if sender.kept_snapshot_outdated() {
            // A joiner was told of a newer joinable snapshot: the kept one serves none.
            return Some(kept);
        }
        let (tail, snapshot) = sender.kept_tail()?;
        let half = snapshot.saturating_mul(KEPT_TAIL_SNAPSHOTS) / 2;
        (snapshot != u64::MAX && tail >= half).then_some(kept)
    }

    /// The fetch asked for by [`Keeping::delivered`] failed: it is tried again some
    /// versions on, for the same demand.
    pub(super) fn not_fetched(&mut self, sender: &Sender) {
        self.fetching = false;
        self.demand = true;
        let latest = sender.latest().unwrap_or(0);
        let wait = FETCH_RETRY_VERSIONS << self.failures.min(FETCH_RETRY_DOUBLINGS);
        self.failures = self.failures.saturating_add(1);
        self.retry_from = Some(latest.saturating_add(wait));
        self.failed_for = sender.kept_snapshot();
    }

    /// The sender serves the fetched snapshot in place of the kept one, and the deltas
    /// after it go to its file.
    pub(super) fn adopt(
        &mut self,
        sender: &mut Sender,
        snapshot: KeptSnapshot,
        file: Box<dyn KeptSegments>,
    ) -> Result<(), String> {
        self.fetching = false;
        self.retry_from = None;
        let version = snapshot.version();
        if let Err(reason) = sender.adopt_snapshot(snapshot) {
            // Asked again later, not at once: the next might fail the same way.
            self.not_fetched(sender);
            return Err(reason);
        }
        self.failures = 0;
        // Joiners of the snapshot it replaces wanted that one.
        self.demand = false;
        self.last_kept = self.last_kept.max(Some(version));
        self.file = Some((version, file));
        Ok(())
    }

    /// A fetcher hands over its snapshot with its file.
    pub(super) fn take(
        &mut self,
        sender: &mut Sender,
    ) -> Option<(KeptSnapshot, Box<dyn KeptSegments>)> {
        let snapshot = sender.take_kept_snapshot()?;
        let (_, file) = self.file.take()?;
        Some((snapshot, file))
    }

    fn give_up(&mut self, sender: &mut Sender, version: u64, why: &str) {
        let reason = format!("the snapshot of version {version}: {why}");
        tracing::warn!(reason, "the relay stops serving its snapshot");
        sender.withdraw_snapshot(reason);
        self.file = None;
        self.given_up = Some(version);
    }
}
