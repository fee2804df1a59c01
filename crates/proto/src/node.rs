//! One peer of the dissemination tree (docs/wire-protocol.md §8): a hub (sender only),
//! a relay (receiver and sender: it forwards every verified segment downstream as it
//! arrives, and holds no weights) or an actor (receiver and actor).
//!
//! A relay may also keep a snapshot for its region's joins ([`RelayOptions::keep_snapshots`]):
//! it starts by taking its upstream's newest snapshot, forwarding it cut-through like a
//! delta but with each segment kept in the driver's [`SnapshotSpace`], and serves it to
//! every peer that joins with no weights while it holds the deltas after it. The
//! region's joins then cost the link one copy, and the session's streams carry it
//! before the first delta does.
//!
//! An actor may also start with no weights ([`Node::joining_actor`]): it takes a
//! snapshot over the wire, decodes it segment by segment against the empty checkpoint,
//! activates it at once, then goes on as any other.
//!
//! The node wires its parts together. Drivers feed it connection events and the outcomes
//! of its effects through its `handle_*` methods and the actor's (`decoded`, `verified`,
//! `activated`), tell it the time through [`Node::handle_timeout`], and drain one stream
//! of [`Output`]s from [`Node::poll`], as quinn-proto's `Connection` states its contract.
//! Reading a part ([`Node::sender`], [`Node::receiver`]) is for status; a hub's driver
//! publishes through its sender ([`Node::sender_mut`]).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aurora_delta::{DeltaHeader, Hash, SpilledChunks, SpilledPatch};
use bytes::Bytes;

use crate::EffectError;
use crate::actor::{ActorAction, ActorCore, ActorStatus};
use crate::frame::{ArtifactKind, Role, VersionRef, Welcome};
use crate::keep::SnapshotSpace;
use crate::receiver::{Artifact, Receiver, ReceiverEvent, SessionEnd};
use crate::sender::{ArtifactKey, Sender, SenderEvent};
use crate::weights::Staged;
use crate::{ConnId, Transmit};

/// What a relay does beyond forwarding (docs/wire-protocol.md §8), chosen when it is
/// made ([`Node::relay`]).
#[derive(Clone, Default)]
pub struct RelayOptions {
    /// Keep a snapshot for the region's joins in this space: start from the upstream's
    /// newest snapshot ([`Receiver::keep_snapshots`]) and offer it to joiners while
    /// every delta after it is held. Hellos wait for the upstream's Welcome, which names
    /// the snapshot, so the joiners that come first are not sent to the hub.
    pub keep_snapshots: Option<Arc<dyn SnapshotSpace>>,
    /// With no working upstream session for this long, send the subscribers away and
    /// refuse new ones ([`Sender::suspend`]) until there is one again: the relay has
    /// nothing new to give them, and they can fetch it from the hub or another relay.
    /// A session works once it delivers a version or lasts this long: a Welcome alone
    /// proves little (a session may end at the Commit that came with it). `None`: the
    /// actors of a relay cut off from the hub wait for it, however long that takes.
    pub suspend_after: Option<Duration>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Write a frame. Frames for inbound connections count against their window:
    /// report [`Node::sent`] once written.
    Transmit(Transmit),
    Close {
        conn: ConnId,
    },
    /// Open stream `stream` of upstream session `session`.
    Dial {
        session: u64,
        stream: u8,
    },
    /// The upstream session is over: start a new one
    /// ([`Receiver::start_session`]), on the next upstream if this one failed.
    UpstreamLost {
        reason: SessionEnd,
    },
    /// Load an artifact from the store (or build it: a snapshot, a composed delta if
    /// the catch-up plan finds it cheapest by bytes) and pass it, or why there is none,
    /// to [`crate::Sender::loaded`].
    Load(ArtifactKey),
    /// Decode segment `index` of `version` (verified, with `hash`) against the active
    /// weights ([`crate::Weights::decode_segment`]; a joining node's are
    /// [`crate::Weights::empty`]), then call [`Node::decoded`]. Each
    /// segment of the next version is decoded as it arrives, while later ones are still
    /// on the wire; the decodes of one version may run in parallel.
    Decode {
        version: u64,
        index: u32,
        hash: Hash,
        kind: ArtifactKind,
        header: Arc<DeltaHeader>,
        bytes: Bytes,
    },
    /// Wait for the engine's safe point, then call [`Node::safe_point`].
    AwaitSafePoint,
    /// A relay that keeps a snapshot a joiner has wanted, whose deltas after it have
    /// grown to half of what it keeps ([`crate::KEPT_TAIL_SNAPSHOTS`]), or one that keeps
    /// none now and was asked for one: take the upstream's newest snapshot if it is newer
    /// than `newer_than`, on a session of its own ([`Node::snapshot_fetcher`]), and hand
    /// it over ([`Node::adopt_snapshot`]), or say it could not
    /// ([`Node::snapshot_not_fetched`]: asked again some versions on). Where the relay
    /// keeps no snapshot by the time the fetcher holds its own, it lacks deltas after it
    /// too: the fetcher first follows them up to this relay's newest version, and hands
    /// them over with it. Without a newer one the relay stops serving its snapshot once
    /// the deltas after it outgrow what it keeps.
    FetchSnapshot {
        newer_than: u64,
    },
    /// Apply what is staged for `version` ([`Node::take_staged`]), then call
    /// [`Node::activated`]. No decode is outstanding: the weights are free to change. A
    /// joining node's snapshot comes without a safe point: its engine runs nothing yet.
    Activate {
        version: u64,
    },
    /// Check the patch staged for `version` ([`Node::staged_patch`]) against the active
    /// weights ([`crate::Weights::verify`]) and pass the outcome to [`Node::verified`]:
    /// a node that [`Node::verify_at_staging`] reports a delta staged only then. The
    /// weights are only read; they count as a decode outstanding until it is done.
    Verify {
        version: u64,
    },
    /// Something worth logging or observing; nothing to do.
    Notice(Notice),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    Connected(Welcome),
    Complete {
        version: u64,
    },
    /// A joining actor received its snapshot of `version`; what follows are deltas. If
    /// it came from a fallback (the hub: its region's relay keeps no snapshot, or no
    /// longer offers its own), a driver may move back to its first upstream for them.
    Joined {
        version: u64,
    },
    Committed(VersionRef),
    Subscribed {
        peer_id: String,
        role: Role,
        region: String,
    },
    Dropped {
        peer_id: String,
        reason: String,
    },
    Status {
        peer_id: String,
        active: VersionRef,
        staged: Option<u64>,
        note: String,
    },
    /// A relay could not republish what it received (a bug or a hostile upstream).
    RelayError(String),
}

pub struct Node {
    sender: Option<Sender>,
    receiver: Option<Receiver>,
    actor: Option<ActorCore>,
    /// Complete artifacts waiting to be staged and activated.
    artifacts: BTreeMap<u64, Artifact>,
    /// The version being decoded against the active weights, at most one: only the
    /// next version's base is the active weights.
    staging: Option<Staging>,
    /// What is staged, until it is activated.
    patch: Option<(u64, Staged)>,
    /// Staged deltas are checked against the active weights before they count as staged
    /// ([`Output::Verify`]), so activating one only writes its changes.
    verify_at_staging: bool,
    /// Decodes handed to the driver and not yet reported, of any version: while one is
    /// out the weights are being read, so an activation waits for them.
    decodes_out: usize,
    activation_waiting: Option<u64>,
    /// A relay suspends its sender once it has had no working upstream session this
    /// long ([`RelayOptions::suspend_after`]).
    suspend_after: Option<Duration>,
    /// Since when a relay has had no working upstream session: from a lost session
    /// until one delivers a version or lasts `suspend_after`.
    upstream_lost_at: Option<Instant>,
    /// When the relay's current upstream session was welcomed.
    upstream_welcomed_at: Option<Instant>,
    /// A relay that keeps a snapshot for its region's joins ([`RelayOptions::keep_snapshots`]).
    keeping: Option<Keeping>,
    /// The node serves nobody any more ([`Node::stop_serving`]).
    stopped_serving: bool,
    outputs: VecDeque<Output>,
}

/// One version decoded segment by segment (docs/wire-protocol.md §7). Results are kept
/// with the hash of the bytes they came from: once the artifact is complete, each of
/// its segments must have been decoded from exactly the bytes its table names, so a
/// segment revoked or resent on the way is decoded again, never used stale.
struct Staging {
    version: u64,
    kind: ArtifactKind,
    header: Arc<DeltaHeader>,
    decoded: BTreeMap<u32, (Hash, Result<SpilledChunks, EffectError>)>,
    /// Decodes out, by index, with the hash of the bytes sent.
    decoding: BTreeMap<u32, Hash>,
    /// The complete artifact, once the actor core asked to stage it.
    artifact: Option<Artifact>,
}

impl Node {
    pub fn hub(sender: Sender) -> Node {
        Node::new(Some(sender), None, None)
    }

    /// A relay: receives from upstream (`receiver` is [`Receiver::relaying`]) and
    /// republishes to its subscribers, as `options` say. It holds no weights: nobody
    /// waits for a relay to stage or activate a version, and on a machine it shares, its
    /// decodes would only slow its actors' down.
    pub fn relay(receiver: Receiver, mut sender: Sender, options: RelayOptions) -> Node {
        // A relay pinned to its run (or one that learned it already) serves it from the
        // start; otherwise from its upstream's first Welcome.
        if let Some(run) = receiver.run() {
            sender.serve_run(run);
        }
        let mut node = Node::new(Some(sender), Some(receiver), None);
        node.suspend_after = options.suspend_after;
        if let Some(space) = options.keep_snapshots {
            node.keep_snapshots(space);
        }
        node
    }

    /// An actor: it accepts composed catch-up (it stages what it receives and
    /// republishes nothing).
    pub fn actor(mut receiver: Receiver, active: VersionRef) -> Node {
        receiver.accept_composed();
        Node::new(None, Some(receiver), Some(ActorCore::new(active)))
    }

    /// An actor with no weights: `receiver` is [`Receiver::joining`].
    pub fn joining_actor(mut receiver: Receiver) -> Node {
        receiver.accept_composed();
        Node::new(None, Some(receiver), Some(ActorCore::joining()))
    }

    /// A receiver that only collects artifacts (benchmarks): no staging.
    pub fn collector(receiver: Receiver) -> Node {
        Node::new(None, Some(receiver), None)
    }

    fn new(sender: Option<Sender>, receiver: Option<Receiver>, actor: Option<ActorCore>) -> Node {
        Node {
            sender,
            receiver,
            actor,
            artifacts: BTreeMap::new(),
            staging: None,
            patch: None,
            verify_at_staging: false,
            decodes_out: 0,
            activation_waiting: None,
            suspend_after: None,
            upstream_lost_at: None,
            upstream_welcomed_at: None,
            keeping: None,
            stopped_serving: false,
            outputs: VecDeque::new(),
        }
    }

    /// An actor checks each staged delta's target hash over its active weights behind
    /// generation ([`Output::Verify`]) and reports it staged only then: the check an
    /// activation would make at the safe point, where the engine waits for it, is made
    /// while the engine still generates.
    pub fn verify_at_staging(&mut self) {
        self.verify_at_staging = true;
    }

    pub fn sender(&self) -> Option<&Sender> {
        self.sender.as_ref()
    }

    pub fn sender_mut(&mut self) -> Option<&mut Sender> {
        self.sender.as_mut()
    }

    pub fn receiver(&self) -> Option<&Receiver> {
        self.receiver.as_ref()
    }

    pub fn receiver_mut(&mut self) -> Option<&mut Receiver> {
        self.receiver.as_mut()
    }

    pub fn actor_status(&self) -> Option<ActorStatus> {
        self.actor.as_ref().map(ActorCore::status)
    }

    /// Whether the actor gave up on its upstreams' chain (see [`ActorCore::diverged`]).
    pub fn actor_diverged(&self) -> bool {
        self.actor.as_ref().is_some_and(ActorCore::diverged)
    }

    /// A frame written on an inbound connection: its window has room again.
    pub fn sent(&mut self, now: Instant, conn: ConnId) {
        if let Some(sender) = &mut self.sender {
            sender.on_sent(now, conn);
        }
    }

    /// The driver decoded segment `index` of `version` from the bytes with `hash`.
    pub fn decoded(
        &mut self,
        version: u64,
        index: u32,
        hash: Hash,
        outcome: Result<SpilledChunks, EffectError>,
    ) {
        self.decodes_out = self.decodes_out.saturating_sub(1);
        if let Some(staging) = &mut self.staging
            && staging.version == version
            && staging.decoding.get(&index) == Some(&hash)
        {
            staging.decoding.remove(&index);
            staging.decoded.insert(index, (hash, outcome));
            self.finish_staging();
        }
        if self.decodes_out == 0
            && let Some(version) = self.activation_waiting.take()
        {
            self.outputs.push_back(Output::Activate { version });
        }
    }

    /// The patch staged for `version`, for [`Output::Verify`].
    pub fn staged_patch(&self, version: u64) -> Option<&SpilledPatch> {
        match &self.patch {
            Some((staged, Staged::Patch(patch))) if *staged == version => Some(patch),
            _ => None,
        }
    }

    /// The outcome of [`Output::Verify`] for `version`: a patch that checks out is
    /// reported staged (and activates without a second check); one that does not is
    /// dropped and reported failed, as a segment that failed to decode is.
    pub fn verified(&mut self, version: u64, outcome: Result<(), EffectError>) {
        self.decodes_out = self.decodes_out.saturating_sub(1);
        let staged = match self.patch.take() {
            Some((staged, Staged::Patch(patch))) if staged == version => {
                outcome.map(|()| self.patch = Some((version, Staged::Verified(patch))))
            }
            other => {
                // Discarded meanwhile (a newer version superseded it).
                self.patch = other;
                return;
            }
        };
        if let Some(actor) = &mut self.actor {
            actor.staged(version, staged);
        }
        if self.decodes_out == 0
            && let Some(version) = self.activation_waiting.take()
        {
            self.outputs.push_back(Output::Activate { version });
        }
    }

    /// What is staged for `version`, for [`Output::Activate`].
    pub fn take_staged(&mut self, version: u64) -> Option<Staged> {
        match self.patch.take() {
            Some((staged, patch)) if staged == version => Some(patch),
            other => {
                self.patch = other;
                None
            }
        }
    }

    pub fn safe_point(&mut self) {
        if let Some(actor) = &mut self.actor {
            actor.safe_point();
        }
    }

    pub fn activated(&mut self, version: u64, outcome: Result<Hash, EffectError>) {
        if let Some(actor) = &mut self.actor {
            actor.activated(version, outcome);
        }
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        let sender = self.sender.as_ref().and_then(Sender::poll_timeout);
        let receiver = self.receiver.as_ref().and_then(Receiver::poll_timeout);
        sender
            .into_iter()
            .chain(receiver)
            .chain(self.suspend_at())
            .chain(self.proven_at())
            .min()
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        if self.proven_at().is_some_and(|at| now >= at) {
            self.upstream_works();
        }
        if let (Some(at), Some(after)) = (self.suspend_at(), self.suspend_after)
            && now >= at
            && let Some(sender) = &mut self.sender
        {
            let reason = format!("this relay has had no working upstream for {after:?}");
            tracing::warn!(reason, "sending the subscribers away");
            sender.suspend(reason);
        }
        if let Some(sender) = &mut self.sender {
            sender.handle_timeout(now);
        }
        if let Some(receiver) = &mut self.receiver {
            receiver.handle_timeout(now);
        }
    }

    /// The next thing for the driver to do, after routing what the parts said to each
    /// other.
    pub fn poll(&mut self, now: Instant) -> Option<Output> {
        loop {
            if let Some(output) = self.outputs.pop_front() {
                return Some(output);
            }
            if let Some(event) = self.receiver.as_mut().and_then(Receiver::poll_event) {
                self.on_receiver_event(now, event);
                continue;
            }
            if let Some(action) = self.actor.as_mut().and_then(ActorCore::poll_action) {
                self.on_actor_action(action);
                continue;
            }
            if let Some(transmit) = self.receiver.as_mut().and_then(Receiver::poll_transmit) {
                return Some(Output::Transmit(transmit));
            }
            if let Some(event) = self.sender.as_mut().and_then(Sender::poll_event) {
                self.on_sender_event(event);
                continue;
            }
            let transmit = self.sender.as_mut().and_then(|s| s.poll_transmit(now))?;
            return Some(Output::Transmit(transmit));
        }
    }

    fn on_receiver_event(&mut self, now: Instant, event: ReceiverEvent) {
        let relay_error = |e: crate::SenderError| Output::Notice(Notice::RelayError(e.to_string()));
        match event {
            ReceiverEvent::Dial { session, stream } => {
                self.outputs.push_back(Output::Dial { session, stream })
            }
            ReceiverEvent::Close { conn } => self.outputs.push_back(Output::Close { conn }),
            ReceiverEvent::Connected { upstream } => {
                self.upstream_welcomed_at = Some(now);
                // Until a relay has a version complete, each Welcome may move its start
                // (wire-protocol §6.6): what comes before it is never held here, and
                // what was begun of it goes. A start that follows on from what the
                // relay holds keeps it.
                if let (Some(sender), Some(receiver)) = (&mut self.sender, &self.receiver) {
                    // A relay serves the run its receiver took from upstream.
                    if let Some(run) = receiver.run() {
                        sender.serve_run(run);
                    }
                    if receiver.choosing_start()
                        && sender
                            .latest()
                            .is_none_or(|held| held.saturating_add(1) < receiver.next_version())
                    {
                        sender.set_floor(receiver.next_version());
                    }
                    if let Some(keeping) = &mut self.keeping {
                        keeping.connected(sender, receiver);
                    }
                    sender.release_hellos(now);
                }
                self.outputs
                    .push_back(Output::Notice(Notice::Connected(upstream)));
            }
            ReceiverEvent::UpstreamLost { reason } => {
                if let Some(sender) = &mut self.sender {
                    self.upstream_lost_at.get_or_insert(now);
                    self.upstream_welcomed_at = None;
                    // Without an upstream the relay cannot say which snapshot it will
                    // offer: the joiners waiting go to their next upstream.
                    sender.release_hellos(now);
                }
                self.outputs.push_back(Output::UpstreamLost { reason })
            }
            ReceiverEvent::Offered {
                version,
                kind,
                descriptor,
                header,
                signature,
            } => {
                // Only a relay republishes: deltas, and the snapshot it keeps. The
                // signature goes downstream as it came: a relay cannot make one.
                if let Some(sender) = &mut self.sender {
                    let relayed = match (&mut self.keeping, &mut self.receiver) {
                        (Some(keeping), Some(receiver)) => {
                            keeping.offered(sender, receiver, version, kind, &header)
                        }
                        _ => kind == ArtifactKind::Delta,
                    };
                    if relayed && let Err(e) = sender.begin_artifact(kind, descriptor, signature) {
                        self.outputs.push_back(relay_error(e));
                    }
                }
                self.begin_staging(version, kind, header);
            }
            ReceiverEvent::Segment {
                version,
                index,
                hash,
                bytes,
            } => {
                self.decode(version, index, hash, &bytes);
                let key = self.relayed(version);
                if let Some(sender) = &mut self.sender {
                    let bytes = match &mut self.keeping {
                        Some(keeping) => keeping.segment(sender, key, index, bytes),
                        None => Some(bytes),
                    };
                    if let Some(bytes) = bytes
                        && let Err(e) = sender.add_segment(key, index, hash, bytes)
                    {
                        self.outputs.push_back(relay_error(e));
                    }
                }
            }
            ReceiverEvent::Revoked { version, index } => {
                if let Some(staging) = &mut self.staging
                    && staging.version == version
                {
                    staging.decoded.remove(&index);
                    staging.decoding.remove(&index);
                }
                let key = self.relayed(version);
                if let Some(sender) = &mut self.sender {
                    sender.revoke_segment(key, index);
                }
            }
            ReceiverEvent::Sealed {
                version,
                id,
                target_hash,
                segments,
                signature,
            } => {
                // The receiver verified the signature where a trainer key is pinned; it
                // goes downstream as it came: a relay cannot make one.
                let key = self.relayed(version);
                if let Some(sender) = &mut self.sender
                    && let Err(e) = sender.seal_artifact(key, target_hash, id, segments, signature)
                {
                    self.outputs.push_back(relay_error(e));
                }
            }
            ReceiverEvent::Complete { version, artifact } => {
                if self.sender.is_some() {
                    self.upstream_works();
                }
                self.outputs
                    .push_back(Output::Notice(Notice::Complete { version }));
                if artifact.kind() == ArtifactKind::Snapshot && self.actor.is_some() {
                    self.outputs
                        .push_back(Output::Notice(Notice::Joined { version }));
                }
                if let Some(actor) = &mut self.actor {
                    match artifact.kind() {
                        ArtifactKind::Snapshot => actor.snapshot(artifact.header()),
                        kind => actor.delta(kind, artifact.header()),
                    }
                    self.artifacts.insert(version, artifact);
                } else if let (Some(_), Some(receiver)) = (&self.sender, &mut self.receiver) {
                    // A relay holds what it forwards: that is what its Hellos and
                    // reports say, as an actor's say what it runs.
                    let held = VersionRef {
                        version,
                        hash: artifact.header().target_hash,
                    };
                    receiver.set_local(held, None);
                    receiver.report(format!("holds v{version}"));
                    if let (Some(keeping), Some(sender)) = (&mut self.keeping, &self.sender)
                        && let Some(newer_than) = keeping.delivered(sender, version)
                    {
                        self.outputs.push_back(Output::FetchSnapshot { newer_than });
                    }
                }
            }
            ReceiverEvent::Commit(commit) => {
                self.outputs
                    .push_back(Output::Notice(Notice::Committed(commit.target)));
                if let Some(actor) = &mut self.actor {
                    actor.commit(commit.target);
                }
                if let Some(sender) = &mut self.sender
                    && let Err(e) = sender.commit(commit)
                {
                    self.outputs.push_back(relay_error(e));
                }
            }
        }
    }

    /// Starts decoding `version` as its segments arrive when its base is the active
    /// weights (for a joining node, a snapshot against no weights): then nothing it
    /// could change is in use, and by the time the artifact is complete most of it is
    /// decoded.
    fn begin_staging(&mut self, version: u64, kind: ArtifactKind, header: Arc<DeltaHeader>) {
        let Some(actor) = &self.actor else { return };
        // Nothing fits while the actor activates, whose weights are being written: the
        // receiver holds the version being activated, so what it accepts starts from
        // that one, not from the active version.
        let fits = match (kind, actor.status().active) {
            // The receiver checked the header: a snapshot of `version`.
            (ArtifactKind::Snapshot, None) => true,
            (ArtifactKind::Delta, Some(active)) => {
                header.base_version == active.version
                    && header.base_hash == active.hash
                    && version == active.version + 1
            }
            (ArtifactKind::Composed, Some(active)) => {
                header.base_version == active.version && header.base_hash == active.hash
            }
            _ => false,
        };
        // A joining node builds a snapshot's image from each segment as it comes, and its
        // receiver may keep only their hashes: a newer snapshot (or another artifact of
        // the same version) replaces the one it was building, never waits behind it.
        let supersedes = kind == ArtifactKind::Snapshot
            && self.staging.as_ref().is_some_and(|staging| {
                staging.kind == ArtifactKind::Snapshot
                    && (staging.version, &staging.header) != (version, &header)
            });
        if fits && self.patch.is_none() && (self.staging.is_none() || supersedes) {
            self.staging = Some(Staging {
                version,
                kind,
                header,
                decoded: BTreeMap::new(),
                decoding: BTreeMap::new(),
                artifact: None,
            });
            // Each segment is decoded as it is announced: the receiver keeps only its
            // hash, so a delta (or a snapshot) is never held whole beside what its
            // decodes make, only while its segments wait for a decoder.
            if let Some(receiver) = &mut self.receiver {
                receiver.take_segments(version);
            }
        }
    }

    /// Hands a segment of the version being staged to the driver, unless the same bytes
    /// are already decoded or out.
    fn decode(&mut self, version: u64, index: u32, hash: Hash, bytes: &Bytes) {
        let Some(staging) = &mut self.staging else {
            return;
        };
        if staging.version != version
            || staging.decoding.get(&index) == Some(&hash)
            || staging.decoded.get(&index).is_some_and(|d| d.0 == hash)
        {
            return;
        }
        staging.decoded.remove(&index);
        staging.decoding.insert(index, hash);
        self.decodes_out += 1;
        self.outputs.push_back(Output::Decode {
            version,
            index,
            hash,
            kind: staging.kind,
            header: staging.header.clone(),
            bytes: bytes.clone(),
        });
    }

    /// The actor core asks for `version`, now complete: decode what is not decoded yet
    /// from exactly the artifact's segments. What was begun at its Offer decoded them
    /// against the same header, its target hash still pending.
    fn stage(&mut self, version: u64) {
        let artifact = self.artifacts[&version].clone();
        let reuse = self.staging.as_ref().is_some_and(|s| {
            s.version == version
                && s.kind == artifact.kind()
                && (s.header == *artifact.header() || artifact.header().completes(&s.header))
        });
        if !reuse {
            self.staging = Some(Staging {
                version,
                kind: artifact.kind(),
                header: artifact.header().clone(),
                decoded: BTreeMap::new(),
                decoding: BTreeMap::new(),
                artifact: None,
            });
        }
        for (index, hash, bytes) in artifact.segments() {
            self.decode(version, index, hash, bytes);
        }
        self.staging.as_mut().expect("set above").artifact = Some(artifact);
        self.finish_staging();
    }

    /// Once every segment of the complete artifact is decoded from its table's bytes,
    /// the patch is staged (or the first failure reported).
    fn finish_staging(&mut self) {
        let Some(staging) = &self.staging else { return };
        let Some(artifact) = &staging.artifact else {
            return;
        };
        let complete = artifact.segments().all(|(index, hash, _)| {
            staging
                .decoded
                .get(&index)
                .is_some_and(|(decoded, _)| *decoded == hash)
        });
        if !complete {
            return;
        }
        let mut staging = self.staging.take().expect("checked above");
        let version = staging.version;
        let artifact = staging.artifact.take().expect("checked above");
        let outcome = artifact
            .segments()
            .map(|(index, _, _)| {
                let (_, outcome) = staging.decoded.remove(&index).expect("checked above");
                outcome.map_err(|error| EffectError::Segment {
                    index,
                    error: Box::new(error),
                })
            })
            .collect::<Result<Vec<_>, EffectError>>()
            .and_then(|segments| {
                // What activates checks the weights against the complete header's
                // target hash, the Seal's. A snapshot's segments were decoded into its
                // image as they came.
                let header = artifact.header();
                if staging.kind == ArtifactKind::Snapshot {
                    return Ok(Staged::Snapshot(header.clone()));
                }
                SpilledPatch::new(DeltaHeader::clone(header), segments)
                    .map(Staged::Patch)
                    .map_err(EffectError::from)
            })
            .map(|patch| self.patch = Some((version, patch)));
        if outcome.is_ok() {
            // Staged: what activates is the patch, never these bytes again.
            self.artifacts.remove(&version);
        }
        // A patch that reshapes tensors is built into a new image, and hashed there.
        let in_place = self
            .staged_patch(version)
            .is_some_and(SpilledPatch::preserves_layout);
        if outcome.is_ok() && self.verify_at_staging && in_place {
            // Reported staged once its target hash over the active weights checks out.
            self.decodes_out += 1;
            self.outputs.push_back(Output::Verify { version });
            return;
        }
        if let Some(actor) = &mut self.actor {
            actor.staged(version, outcome);
        }
    }

    fn on_sender_event(&mut self, event: SenderEvent) {
        let output = match event {
            SenderEvent::Load(key) => Output::Load(key),
            SenderEvent::Close { conn, reason } => {
                tracing::debug!(conn, reason, "closing a downstream connection");
                Output::Close { conn }
            }
            SenderEvent::Subscribed {
                peer_id,
                role,
                region,
                session: _,
            } => Output::Notice(Notice::Subscribed {
                peer_id,
                role,
                region,
            }),
            SenderEvent::Dropped { peer_id, reason } => {
                Output::Notice(Notice::Dropped { peer_id, reason })
            }
            SenderEvent::Status {
                peer_id,
                active,
                staged,
                note,
            } => Output::Notice(Notice::Status {
                peer_id,
                active,
                staged,
                note,
            }),
        };
        self.outputs.push_back(output);
    }

    fn on_actor_action(&mut self, action: ActorAction) {
        match action {
            ActorAction::Stage { version } => self.stage(version),
            ActorAction::AwaitSafePoint => self.outputs.push_back(Output::AwaitSafePoint),
            ActorAction::Activate { version } => {
                if self.decodes_out == 0 {
                    self.outputs.push_back(Output::Activate { version });
                } else {
                    self.activation_waiting = Some(version);
                }
            }
            ActorAction::Discard { version } => {
                self.artifacts.remove(&version);
                if self.staging.as_ref().is_some_and(|s| s.version == version) {
                    self.staging = None;
                }
                if self.patch.as_ref().is_some_and(|p| p.0 == version) {
                    self.patch = None;
                }
            }
            ActorAction::Rewind { version } => {
                if let Some(receiver) = &mut self.receiver {
                    receiver.rewind(version);
                    // The upstream served a delta that does not fit this actor: fetch
                    // the chain again elsewhere.
                    receiver.abandon("served a delta that does not fit the active weights");
                }
            }
            ActorAction::Rejoin { reason } => {
                if let Some(receiver) = &mut self.receiver {
                    receiver.rejoin();
                    receiver.abandon(&reason);
                }
            }
            ActorAction::Report { note } => {
                let status = self
                    .actor
                    .as_ref()
                    .expect("actions come from the actor")
                    .status();
                if let Some(receiver) = &mut self.receiver {
                    // No weights yet: version 0 with the all-zero hash, as its Hellos say.
                    receiver.set_local(status.active.unwrap_or_default(), status.staged);
                    receiver.report(note);
                }
            }
        }
    }
}

mod inputs;
mod keeping;
#[cfg(test)]
mod keeping_tests;
mod relay;
#[cfg(test)]
mod tests;

use self::keeping::Keeping;
