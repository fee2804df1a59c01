//! The frames an upstream sends a receiver: the handshake's answer, then offers,
//! segments and tables, each checked before anything is held, and the reason a
//! session ends when one breaks the rules.

use std::sync::Arc;
use std::time::Instant;

use aurora_delta::{
    ArtifactSignature, DeltaHeader, Hash, Manifest, RunId, SegmentEntry, SignatureError, Statement,
    VerifyingKey,
};
use bytes::Bytes;

use super::assembly::{SEGMENT_OVERHEAD_BYTES, SLOT_BYTES, Table};
use super::{DescriptorFault, Receiver, ReceiverEvent, SessionEnd, Start, Violation};
use crate::frame::{ArtifactKind, Commit, Frame, PROTOCOL_VERSION, Role, Welcome};
use crate::{ConnId, Identity};

impl Receiver {
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
                    self.lose_upstream(SessionEnd::Refused { code, reason })
                }
                other => {
                    self.lose_upstream(Violation::BeforeWelcome(other.frame_type().name()).into())
                }
            };
        }
        let before = self.progress_mark();
        let outcome = match frame {
            Frame::Offer {
                version,
                kind,
                descriptor,
                signature,
            } => self.on_offer(version, kind, descriptor, signature),
            Frame::Segment {
                version,
                index,
                hash,
                bytes,
            } => self.on_segment(stream, version, index, hash, bytes),
            Frame::Seal {
                version,
                id,
                target_hash,
                segments,
                signature,
            } => self.on_seal(version, id, target_hash, segments, signature),
            Frame::Commit(commit) => self.on_commit(commit),
            Frame::Unavailable { version, reason } => {
                if self.relaying && version == self.next_version {
                    // A relay is a cache: it follows its upstream from the newest
                    // version (or snapshot), and its actors that are behind that catch
                    // up from the hub (wire-protocol §6.6).
                    self.start = self.relay_start;
                }
                Err(SessionEnd::Unavailable { version, reason })
            }
            Frame::Keepalive => Ok(()),
            Frame::Goodbye { reason } => Err(SessionEnd::Goodbye(reason)),
            other => Err(Violation::Unexpected(other.frame_type().name()).into()),
        };
        match outcome {
            Ok(()) => self.deliver(),
            Err(reason) => self.lose_upstream(reason),
        }
        self.note_progress(now, before);
    }

    /// Whether the versions up to the window's end from `start`, and the one composed
    /// target beyond it, stay countable: an upstream naming a start near `u64::MAX` is
    /// refused rather than overflowing the window.
    fn countable_from(&self, start: u64) -> bool {
        start
            .checked_add(self.config.versions_ahead.saturating_add(2))
            .is_some()
    }

    pub(super) fn on_welcome(&mut self, stream: usize, welcome: Welcome) {
        if welcome.protocol_version != PROTOCOL_VERSION {
            return self.lose_upstream(SessionEnd::Version(welcome.protocol_version));
        }
        if welcome.role == Role::Actor {
            return self.lose_upstream(SessionEnd::ActorUpstream);
        }
        let certified = self
            .session
            .as_ref()
            .and_then(|s| s.streams[stream].certified.clone());
        if let Err(reason) = self.check_upstream(&welcome, certified.as_ref()) {
            return self.lose_upstream(reason);
        }
        let first = self.session.as_ref().is_some_and(|s| s.upstream.is_none());
        if first
            && self.relaying
            && self.start == Start::Snapshot(None)
            && welcome.snapshot.is_none()
            && self.snapshot_floor == 0
        {
            // A relay needs no snapshot to forward deltas: from an upstream that offers
            // none it follows from the newest version.
            self.start = Start::Newest;
        }
        if first && let Start::Snapshot(held) = self.start {
            let Some(offered) = welcome.snapshot else {
                return self.lose_upstream(SessionEnd::NoSnapshot {
                    role: welcome.role,
                    peer_id: welcome.peer_id,
                });
            };
            if offered < self.snapshot_floor {
                return self.lose_upstream(SessionEnd::OldSnapshot {
                    role: welcome.role,
                    peer_id: welcome.peer_id,
                    offered,
                    wanted: self.snapshot_floor,
                });
            }
            // Versions up to the window's end and the one composed target beyond it
            // must stay countable.
            if !self.countable_from(offered) {
                return self.lose_upstream(SessionEnd::StartTooLate {
                    role: welcome.role,
                    peer_id: welcome.peer_id,
                    offered,
                });
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
        if first && self.start == Start::Newest {
            let newest = welcome.latest.unwrap_or(0).max(1);
            if !self.countable_from(newest) {
                return self.lose_upstream(SessionEnd::StartTooLate {
                    role: welcome.role,
                    peer_id: welcome.peer_id,
                    offered: newest,
                });
            }
            if newest > self.next_version {
                // What is held of older versions is never delivered now.
                self.forget_held();
                self.next_version = newest;
            }
        }
        let s = self.session.as_mut().expect("caller checked");
        s.streams[stream].welcomed = true;
        if s.upstream.is_none() {
            s.upstream = Some(welcome.clone());
            self.events.push_back(ReceiverEvent::Connected {
                upstream: welcome.clone(),
            });
            if let Some(commit) = welcome.commit
                && let Err(reason) = self.on_commit(commit)
            {
                return self.lose_upstream(reason);
            }
        }
        self.queue_want();
    }

    /// Whether the upstream that sent `welcome` may serve this receiver
    /// (docs/wire-protocol.md §6.1, docs/security.md §5):
    /// - it is who its certificate (`certified`, where the link has one) says;
    /// - it serves this node's run: the pinned one, or the one learned from the
    ///   trainer's own hub (a relay's word for the run is not taken by a node that
    ///   pins the trainer's key: it could name another run signed with the same key);
    /// - a joiner's upstream has committed what the control plane told it of: an
    ///   upstream behind that would roll it back to an old authentic snapshot.
    fn check_upstream(
        &mut self,
        welcome: &Welcome,
        certified: Option<&Identity>,
    ) -> Result<(), SessionEnd> {
        if let Some(certified) = certified
            && (certified.role != welcome.role || certified.peer_id != welcome.peer_id)
        {
            return Err(Violation::NotItsCertificate {
                claimed: format!("{} {}", welcome.role, welcome.peer_id),
                certified: format!("{} {}", certified.role, certified.peer_id),
            }
            .into());
        }
        let upstream = || (welcome.role, welcome.peer_id.clone());
        match self.run {
            Some(run) if welcome.run != run => {
                let (role, peer_id) = upstream();
                return Err(SessionEnd::OtherRun {
                    role,
                    peer_id,
                    offered: welcome.run,
                    pinned: run,
                });
            }
            Some(_) => {}
            None if !welcome.run.is_known() => {
                if self.config.trainer_key.is_some() {
                    let (role, peer_id) = upstream();
                    return Err(SessionEnd::RunUnknown { role, peer_id });
                }
            }
            None => {
                // With a pinned key the run is learned only from the trainer itself:
                // over TLS its certificate says so, in plaintext nothing does anyway.
                let from_trainer = certified.map_or(welcome.role, |c| c.role) == Role::Hub;
                if self.config.trainer_key.is_some() && !from_trainer {
                    let (role, peer_id) = upstream();
                    return Err(SessionEnd::RunNotLearned { role, peer_id });
                }
                tracing::info!(run = %welcome.run, upstream = %welcome.peer_id, "serving run");
                self.run = Some(welcome.run);
            }
        }
        let told = self.config.join_floor.commit;
        let joining = matches!(self.start, Start::Snapshot(_));
        if joining && told > 0 && welcome.commit.is_none_or(|c| c.target.version < told) {
            let (role, peer_id) = upstream();
            return Err(SessionEnd::StaleUpstream {
                role,
                peer_id,
                committed: welcome.commit.map(|c| c.target.version),
                told,
            });
        }
        Ok(())
    }

    /// Checks `signature` over `statement` where a trainer key is pinned.
    pub(super) fn check_signature(
        &self,
        statement: &Statement,
        signature: Option<&ArtifactSignature>,
    ) -> Result<(), SignatureError> {
        verify_pinned(
            self.config.trainer_key.as_ref(),
            self.run,
            statement,
            signature,
        )
    }

    /// Reports a Commit, once its signature verifies where a trainer key is pinned: an
    /// unsigned or forged one would make actors activate what the trainer never
    /// committed.
    pub(super) fn on_commit(&mut self, commit: Commit) -> Result<(), SessionEnd> {
        self.check_signature(&commit.statement(), commit.signature.as_ref())
            .map_err(Violation::from)?;
        self.committed = self.committed.max(Some(commit.target.version));
        self.events.push_back(ReceiverEvent::Commit(commit));
        Ok(())
    }

    pub(super) fn window_check(&mut self, version: u64) -> Result<bool, SessionEnd> {
        if version < self.next_version {
            return Ok(false);
        }
        let end = self.next_version + self.config.versions_ahead;
        if version <= end {
            return Ok(true);
        }
        if !self.wants_composed() {
            return Err(Violation::BeyondWindow {
                version,
                next: self.next_version,
                ahead: self.config.versions_ahead,
            }
            .into());
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
    pub(super) fn drop_assemblies(&mut self, versions: &[u64]) {
        for version in versions {
            if let Some(assembly) = self.assemblies.remove(version) {
                self.held_bytes -= assembly.held_bytes;
            }
            self.nacks.retain(|(v, _), _| v != version);
        }
    }

    /// How `version` must arrive: the snapshot a joining receiver took, or a delta.
    pub(super) fn kind_of(&self, version: u64) -> ArtifactKind {
        if self.start == Start::Snapshot(Some(version)) {
            ArtifactKind::Snapshot
        } else {
            ArtifactKind::Delta
        }
    }

    pub(super) fn on_offer(
        &mut self,
        version: u64,
        kind: ArtifactKind,
        descriptor: Bytes,
        signature: Option<ArtifactSignature>,
    ) -> Result<(), SessionEnd> {
        if !self.window_check(version)? {
            return Ok(());
        }
        let wanted = self.kind_of(version);
        let composed_ok = kind == ArtifactKind::Composed && wanted == ArtifactKind::Delta;
        if kind != wanted && !composed_ok {
            return Err(Violation::WrongKind {
                version,
                offered: kind,
                wanted,
            }
            .into());
        }
        if composed_ok && !self.wants_composed() {
            return Err(Violation::ComposedNotAccepted(version).into());
        }
        // Before the descriptor is parsed or anything is sized from it: a joiner
        // allocates a snapshot's whole image from its header (docs/security.md §5).
        let statement = Statement::offer(kind, version, &descriptor);
        if let Err(error) = self.check_signature(&statement, signature.as_ref()) {
            // What arrived of the version came from the same upstream.
            self.drop_assemblies(&[version]);
            return Err(Violation::Signature(error).into());
        }
        let bad_descriptor =
            |source: DescriptorFault| SessionEnd::BadDescriptor { version, source };
        let (header, used) =
            DeltaHeader::decode(&descriptor).map_err(|e| bad_descriptor(e.into()))?;
        if used != descriptor.len() || header.target_version != version {
            return Err(bad_descriptor(DescriptorFault::Mismatch {
                header_version: header.target_version,
                stray: descriptor.len() - used,
            }));
        }
        if !header.target_pending() {
            return Err(bad_descriptor(DescriptorFault::TargetHashOffered));
        }
        if kind == ArtifactKind::Snapshot {
            crate::snapshot::check_header(&header, version)
                .map_err(|e| bad_descriptor(e.into()))?;
        }
        if composed_ok {
            self.check_composed(&header)?;
        }
        let held_kind = self.assemblies.get(&version).and_then(|a| a.kind);
        if held_kind.is_some_and(|held| held != kind) {
            // Parts of D(v) and of a composed delta to v are different artifacts, and
            // segments that overtook this Offer may have joined the wrong one: drop
            // what is held and start a session whose Want says what is held now.
            self.drop_assemblies(&[version]);
            return Err(SessionEnd::KindChanged { version, kind });
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
            Some(_) => return Err(Violation::ConflictingOffers(version).into()),
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
            signature,
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

    pub(super) fn on_segment(
        &mut self,
        stream: usize,
        version: u64,
        index: u32,
        hash: Hash,
        bytes: Bytes,
    ) -> Result<(), SessionEnd> {
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
            Some(table) if assembly.verified_table => {
                let entry = table
                    .entries
                    .get(index as usize)
                    .ok_or(Violation::BeyondTable {
                        version,
                        index,
                        len: table.entries.len(),
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
                return Err(SessionEnd::Corrupted {
                    version,
                    index,
                    failures: *failures,
                });
            }
            tracing::warn!(version, index, "segment corrupted in transit; asking again");
            self.nack(version, index);
            return Ok(());
        }
        // Each held segment costs its bytes and its bookkeeping: empty segments at
        // hostile indices count too.
        let cost = bytes.len() as u64 + SEGMENT_OVERHEAD_BYTES;
        if self.held_bytes + cost + index as u64 * SLOT_BYTES > self.config.max_held_bytes {
            return Err(SessionEnd::OverBudget {
                limit: self.config.max_held_bytes,
            });
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
            if assembly.taken {
                // Announced, and kept no longer: the hash stands for it.
                assembly.segments[index as usize] = Some((hash, Bytes::new()));
                assembly.held_bytes -= bytes.len() as u64;
                self.held_bytes -= bytes.len() as u64;
            }
            self.events.push_back(ReceiverEvent::Segment {
                version,
                index,
                hash,
                bytes,
            });
        }
        Ok(())
    }

    pub(super) fn on_seal(
        &mut self,
        version: u64,
        id: Hash,
        target_hash: Hash,
        segments: Vec<SegmentEntry>,
        signature: Option<ArtifactSignature>,
    ) -> Result<(), SessionEnd> {
        if !self.window_check(version)? {
            return Ok(());
        }
        let assembly = self.assemblies.entry(version).or_default();
        if assembly.table.is_some() {
            return Ok(());
        }
        assembly.table = Some(Table {
            id,
            target_hash,
            entries: segments,
        });
        assembly.signature = signature;
        self.check_table(version)
    }

    /// A composed delta must go from the weights of `next_version - 1` (version and
    /// hash) to a later version than the next one.
    pub(super) fn check_composed(&self, header: &DeltaHeader) -> Result<(), Violation> {
        let version = header.target_version;
        let base = self
            .tip
            .filter(|tip| tip.version + 1 == self.next_version)
            .ok_or(Violation::ComposedBaseUnknown {
                version,
                base: self.next_version.wrapping_sub(1),
            })?;
        if version <= self.next_version {
            return Err(Violation::ComposedTooShort {
                version,
                next: self.next_version,
            });
        }
        if header.base_version != base.version || header.base_hash != base.hash {
            return Err(Violation::ComposedWrongBase {
                version,
                base: header.base_version,
                base_hash: header.base_hash,
                held: base.version,
                held_hash: base.hash,
            });
        }
        Ok(())
    }

    /// Once both descriptor and table are in: the table must hash to the id with the
    /// header completed by the Seal's target hash, the trainer's signature (where a key
    /// is pinned) must vouch for the artifact, and every segment already held must match
    /// the table. The complete header replaces the pending one.
    pub(super) fn check_table(&mut self, version: u64) -> Result<(), SessionEnd> {
        let (trainer_key, run) = (self.config.trainer_key, self.run);
        let assembly = self
            .assemblies
            .get_mut(&version)
            .expect("caller created it");
        let (Some((descriptor, pending)), Some(table)) = (&assembly.descriptor, &assembly.table)
        else {
            return Ok(());
        };
        if assembly.verified_table {
            return Ok(());
        }
        let Table {
            id,
            target_hash,
            ref entries,
        } = *table;
        let manifest = Manifest {
            header: pending.with_target_hash(target_hash),
            segments: entries.clone(),
        };
        if manifest.id() != id {
            // Descriptor and table belong to different artifacts (a table that overtook
            // its Offer may be of the other kind, D(v) or a composed delta to v), or the
            // target hash is not the artifact's: what is held of the version cannot be
            // told apart, so all of it goes, and the next session's Want asks for it
            // afresh.
            self.drop_assemblies(&[version]);
            return Err(SessionEnd::WrongTable { version, id });
        }
        // The kind is signed too: a delta never passes for a composed delta or a
        // snapshot between the same versions, nor the other way round.
        let kind = assembly.kind.expect("set with the descriptor");
        let statement = Statement::artifact(kind, id, &manifest.header);
        let verified = verify_pinned(
            trainer_key.as_ref(),
            run,
            &statement,
            assembly.signature.as_ref(),
        );
        if let Err(error) = verified {
            // Descriptor, table and segments may all be the upstream's invention:
            // nothing of the version is kept, and the next session asks afresh.
            self.drop_assemblies(&[version]);
            return Err(Violation::Signature(error).into());
        }
        assembly.descriptor = Some((descriptor.clone(), Arc::new(manifest.header)));
        assembly.verified_table = true;
        let entries = manifest.segments;
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
        let count = entries.len();
        let sealed = ReceiverEvent::Sealed {
            version,
            id,
            target_hash,
            segments: entries,
            signature: assembly.signature,
        };
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
}

/// Checks `signature` over `statement` of `run` where `trainer_key` is pinned; before a
/// Welcome fixed the run none is known, and nothing verifies.
fn verify_pinned(
    trainer_key: Option<&VerifyingKey>,
    run: Option<RunId>,
    statement: &Statement,
    signature: Option<&ArtifactSignature>,
) -> Result<(), SignatureError> {
    match trainer_key {
        None => Ok(()),
        Some(key) => aurora_delta::verify(key, &run.unwrap_or_default(), statement, signature),
    }
}
