//! The artifacts a sender holds, one mechanism for every kind (docs/wire-protocol.md §4):
//! deltas published cut-through or loaded from a store, snapshots for peers that join
//! with no weights, and composed catch-up deltas. Each is named by an [`ArtifactKey`],
//! loaded on demand ([`SenderEvent::Load`]), answered by [`Sender::loaded`], and evicted
//! by one rule: deltas beyond the retained window, the others once no session is served
//! them (a snapshot is a whole checkpoint; a composed delta serves only its base).
//!
//! Each artifact is held with the trainer's two signatures, served as they came (a
//! sender cannot make one): the descriptor's in its Offer, the artifact's in its Seal
//! (docs/wire-protocol.md §4.4). A sender with a pinned trainer key
//! ([`super::SenderConfig::trainer_key`]) refuses an artifact either of whose
//! signatures is missing or does not verify, so a signed deployment never serves an
//! unsigned one.

use std::fmt;

use aurora_delta::{
    ArtifactSignature, DeltaError, DeltaFile, DeltaHeader, Hash, RunId, SegmentEntry, SigningKey,
    Statement,
};
use bytes::Bytes;

use super::session::SegState;
use super::{Sender, SenderError, SenderEvent};
use crate::frame::{ArtifactKind, Frame, MAX_TRANSFER_SEGMENTS};

/// Which artifact: the delta D(v) from v - 1 to v, the snapshot of v, or the composed
/// delta C(base -> target). Ordered deltas first, by version, which eviction relies on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ArtifactKey {
    Delta(u64),
    Snapshot(u64),
    Composed { base: u64, target: u64 },
}

impl ArtifactKey {
    pub fn kind(self) -> ArtifactKind {
        match self {
            ArtifactKey::Delta(_) => ArtifactKind::Delta,
            ArtifactKey::Snapshot(_) => ArtifactKind::Snapshot,
            ArtifactKey::Composed { .. } => ArtifactKind::Composed,
        }
    }

    /// The version a subscriber holds once it has the artifact (its Offer's version).
    pub fn version(self) -> u64 {
        match self {
            ArtifactKey::Delta(version) | ArtifactKey::Snapshot(version) => version,
            ArtifactKey::Composed { target, .. } => target,
        }
    }

    /// Whether `header` is this artifact's: versions as the key names them, and a
    /// snapshot's base the empty checkpoint.
    fn check(self, header: &DeltaHeader) -> Result<(), SenderError> {
        let fits = match self {
            ArtifactKey::Delta(version) => {
                header.target_version == version && header.base_version < version
            }
            ArtifactKey::Snapshot(version) => {
                return crate::snapshot::check_header(header, version)
                    .map_err(SenderError::NotASnapshot);
            }
            ArtifactKey::Composed { base, target } => {
                header.base_version == base && header.target_version == target && base < target
            }
        };
        if fits {
            return Ok(());
        }
        Err(SenderError::NotTheArtifact {
            wanted: self,
            base: header.base_version,
            target: header.target_version,
        })
    }
}

impl fmt::Display for ArtifactKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArtifactKey::Delta(version) => write!(f, "the delta to version {version}"),
            ArtifactKey::Snapshot(version) => write!(f, "the snapshot of version {version}"),
            ArtifactKey::Composed { base, target } => {
                write!(f, "the composed delta from version {base} to {target}")
            }
        }
    }
}

/// A complete artifact's bytes as a store holds them, with the trainer's signatures.
#[derive(Debug, Clone)]
pub struct StoredArtifact {
    pub bytes: Bytes,
    /// Over the artifact ([`Statement::artifact`]), served in its Seal.
    pub signature: Option<ArtifactSignature>,
    /// Over its descriptor ([`Statement::offer`]), served in its Offer.
    pub offer_signature: Option<ArtifactSignature>,
}

impl StoredArtifact {
    /// An artifact of an unsigned deployment (or one a sender with a pinned key refuses).
    pub fn unsigned(bytes: Bytes) -> StoredArtifact {
        StoredArtifact {
            bytes,
            signature: None,
            offer_signature: None,
        }
    }

    /// The artifact `bytes` as `kind` of `run`, signed by `key` (a hub signs so what it
    /// extracts or builds).
    pub fn signed(
        bytes: Bytes,
        kind: ArtifactKind,
        key: &SigningKey,
        run: &RunId,
    ) -> Result<StoredArtifact, DeltaError> {
        let file = DeltaFile::parse(&bytes)?;
        let statement = Statement::artifact(kind, file.id, file.header());
        let signature = Some(aurora_delta::sign(key, run, &statement));
        let offer_signature = Some(offer_signature(key, run, kind, &bytes)?);
        Ok(StoredArtifact {
            bytes,
            signature,
            offer_signature,
        })
    }
}

/// `key`'s signature of the Offer of the artifact of `run` that begins `bytes` (its
/// preamble and header then anything), as `kind`: over the descriptor an Offer carries,
/// the header with its target hash pending (docs/wire-protocol.md §4.4).
pub fn offer_signature(
    key: &SigningKey,
    run: &RunId,
    kind: ArtifactKind,
    bytes: &[u8],
) -> Result<ArtifactSignature, DeltaError> {
    let (header, _) = DeltaHeader::decode(bytes)?;
    let statement = Statement::offer(kind, header.target_version, &header.encode_pending());
    Ok(aurora_delta::sign(key, run, &statement))
}

/// A complete, sealed snapshot a relay took ([`Sender::take_kept_snapshot`]), its
/// segments where the relay keeps them, with the complete deltas after it it holds, to
/// be served by another sender ([`Sender::adopt_snapshot`]).
pub struct KeptSnapshot {
    version: u64,
    artifact: Artifact,
    deltas: Vec<(u64, Artifact)>,
}

impl KeptSnapshot {
    pub fn version(&self) -> u64 {
        self.version
    }
}

impl fmt::Debug for KeptSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeptSnapshot")
            .field("version", &self.version)
            .field("segments", &self.artifact.segments.len())
            .field("deltas", &self.deltas.len())
            .finish()
    }
}

pub(super) struct Artifact {
    /// The header with its target hash pending, as every Offer carries it.
    pub(super) descriptor: Bytes,
    /// The trainer's signature over the descriptor, served in the Offer.
    pub(super) offer_signature: Option<ArtifactSignature>,
    pub(super) segments: Vec<Option<(Hash, Bytes)>>,
    pub(super) seal: Option<Seal>,
}

/// What an artifact's Seal carries: its id, the target hash its descriptor left
/// pending, its table and the signature over them.
pub(super) struct Seal {
    pub(super) id: Hash,
    pub(super) target_hash: Hash,
    pub(super) segments: Vec<SegmentEntry>,
    pub(super) signature: Option<ArtifactSignature>,
}

impl Artifact {
    pub(super) fn present(&self, index: usize) -> bool {
        self.segments.get(index).is_some_and(Option::is_some)
    }

    /// The artifact's Offer, as `key`.
    pub(super) fn offer_frame(&self, key: ArtifactKey) -> Frame {
        Frame::Offer {
            version: key.version(),
            kind: key.kind(),
            descriptor: self.descriptor.clone(),
            signature: self.offer_signature,
        }
    }

    /// Its Seal, once it is sealed.
    pub(super) fn seal_frame(&self, version: u64) -> Option<Frame> {
        let seal = self.seal.as_ref()?;
        Some(Frame::Seal {
            version,
            id: seal.id,
            target_hash: seal.target_hash,
            segments: seal.segments.clone(),
            signature: seal.signature,
        })
    }

    /// Segment `index`, which must be present.
    pub(super) fn segment_frame(&self, version: u64, index: usize) -> Frame {
        let (hash, bytes) = self.segments[index].clone().expect("present");
        Frame::Segment {
            version,
            index: index as u32,
            hash,
            bytes,
        }
    }

    /// Whether it is here whole: sealed, every segment held.
    fn is_complete(&self) -> bool {
        self.seal.as_ref().is_some_and(|seal| {
            self.segments.len() == seal.segments.len() && self.segments.iter().all(Option::is_some)
        })
    }

    /// The bytes it holds: descriptor and segments.
    fn held_bytes(&self) -> u64 {
        let segments: usize = self.segments.iter().flatten().map(|(_, b)| b.len()).sum();
        (self.descriptor.len() + segments) as u64
    }

    /// The bytes of its segments, once it is sealed.
    pub(super) fn sealed_payload_bytes(&self) -> Option<u64> {
        let seal = self.seal.as_ref()?;
        Some(seal.segments.iter().map(|entry| u64::from(entry.len)).sum())
    }
}

impl Sender {
    /// Starts publishing an artifact of `kind` whose segments will follow
    /// ([`Sender::add_segment`]) and whose table and target hash come last
    /// ([`Sender::seal_artifact`]), cut-through: a delta from an extraction or a relay's
    /// upstream, or the snapshot a relay takes to serve its region's joins
    /// (docs/wire-protocol.md §8), which it keeps as long as it serves it: it offers it in
    /// every Welcome while it holds every delta after it, and a newer one replaces it.
    /// `descriptor` is the artifact's preamble and header with the target hash pending
    /// ([`DeltaHeader::encode_pending`]), and `offer_signature` the trainer's signature
    /// over it, as it came.
    pub fn begin_artifact(
        &mut self,
        kind: ArtifactKind,
        descriptor: Bytes,
        offer_signature: Option<ArtifactSignature>,
    ) -> Result<u64, SenderError> {
        let version = self.begin(kind, descriptor, offer_signature)?;
        self.evict();
        Ok(version)
    }

    fn begin(
        &mut self,
        kind: ArtifactKind,
        descriptor: Bytes,
        offer_signature: Option<ArtifactSignature>,
    ) -> Result<u64, SenderError> {
        let header = parse_descriptor(&descriptor)?;
        let version = header.target_version;
        if !header.target_pending() {
            return Err(SenderError::TargetHashOffered { version });
        }
        let key = match kind {
            ArtifactKind::Snapshot => ArtifactKey::Snapshot(version),
            _ => ArtifactKey::Delta(version),
        };
        match key {
            ArtifactKey::Snapshot(_) => crate::snapshot::check_header(&header, version)?,
            _ if kind == ArtifactKind::Delta && header.base_version < version => {}
            _ => {
                return Err(SenderError::NotTheArtifact {
                    wanted: key,
                    base: header.base_version,
                    target: version,
                });
            }
        }
        self.check_offer_signature(key, &descriptor, offer_signature)?;
        if let ArtifactKey::Snapshot(version) = key
            && self.kept_snapshot != Some(version)
        {
            // One snapshot is kept: another (a relay that started over) replaces it. The
            // old one goes once no session is served it (`evict`).
            self.kept_snapshot = Some(version);
            self.kept_wanted = false;
        }
        if let Some(existing) = self.artifacts.get_mut(&key) {
            if existing.descriptor != descriptor {
                return Err(SenderError::Conflict { version });
            }
            // The descriptor leaves the target hash to the Seal, so it does not tell two
            // publications of a version apart (a publication that failed before its Seal,
            // then another): one begun again starts over, for its subscribers too. Only
            // the Seal's id names it.
            if existing.seal.is_none() {
                existing.segments.clear();
                for session in self.sessions.values_mut() {
                    if session.artifact_for(version) == key {
                        session.versions.remove(&version);
                    }
                }
            }
            return Ok(version);
        }
        self.unavailable.remove(&key);
        self.artifacts.insert(
            key,
            Artifact {
                descriptor,
                offer_signature,
                segments: Vec::new(),
                seal: None,
            },
        );
        Ok(version)
    }

    /// Adds segment `index` of an artifact being published, in any order.
    pub fn add_segment(
        &mut self,
        key: ArtifactKey,
        index: u32,
        hash: Hash,
        bytes: Bytes,
    ) -> Result<(), SenderError> {
        let version = key.version();
        let artifact = self
            .artifacts
            .get_mut(&key)
            .ok_or(SenderError::UnknownArtifact { key })?;
        if index >= MAX_TRANSFER_SEGMENTS {
            return Err(SenderError::TooManySegments {
                count: index as usize + 1,
            });
        }
        if let Some(seal) = &artifact.seal
            && seal
                .segments
                .get(index as usize)
                .is_none_or(|e| e.hash != hash || e.len as usize != bytes.len())
        {
            return Err(SenderError::SegmentMismatch { version, index });
        }
        let index = index as usize;
        if artifact.segments.len() <= index {
            artifact.segments.resize(index + 1, None);
        }
        artifact.segments[index] = Some((hash, bytes));
        Ok(())
    }

    /// Withdraws a segment that turned out not to match its table (a relay forwarded it
    /// before the table arrived, or forwarded another publication's). Subscribers that
    /// got it will nack it at their own check, perhaps before this sender holds the
    /// right bytes, when a nack is ignored: so every subscriber is sent them once they
    /// are here, nack or not.
    pub(crate) fn revoke_segment(&mut self, key: ArtifactKey, index: u32) {
        let version = key.version();
        let Some(slot) = self
            .artifacts
            .get_mut(&key)
            .and_then(|a| a.segments.get_mut(index as usize))
        else {
            return;
        };
        *slot = None;
        for session in self.sessions.values_mut() {
            if session.artifact_for(version) == key
                && let Some(state) = session.versions.get_mut(&version)
            {
                state.set(index as usize, SegState::Unsent);
            }
        }
    }

    /// Closes a version being published with the target hash its descriptor left
    /// pending, its segment table, artifact id and the trainer's signature.
    pub fn seal_artifact(
        &mut self,
        key: ArtifactKey,
        target_hash: Hash,
        id: Hash,
        segments: Vec<SegmentEntry>,
        signature: Option<ArtifactSignature>,
    ) -> Result<(), SenderError> {
        let version = key.version();
        let descriptor = &self
            .artifacts
            .get(&key)
            .ok_or(SenderError::UnknownArtifact { key })?
            .descriptor;
        if segments.len() > MAX_TRANSFER_SEGMENTS as usize {
            return Err(SenderError::TooManySegments {
                count: segments.len(),
            });
        }
        let header = parse_descriptor(descriptor)?.with_target_hash(target_hash);
        let statement = Statement::artifact(key.kind(), id, &header);
        let computed = aurora_delta::Manifest {
            header,
            segments: segments.clone(),
        }
        .id();
        if computed != id {
            return Err(SenderError::WrongId {
                version,
                computed,
                claimed: id,
            });
        }
        self.check_signature(&statement, signature.as_ref())?;
        let artifact = self
            .artifacts
            .get_mut(&key)
            .ok_or(SenderError::UnknownArtifact { key })?;

        // Slots beyond the table may only be empty: a relay withdrew what it forwarded
        // of another publication of the version with the same descriptor.
        if let Some(index) = (segments.len()..artifact.segments.len())
            .find(|&index| artifact.segments[index].is_some())
        {
            return Err(SenderError::SegmentMismatch {
                version,
                index: index as u32,
            });
        }
        artifact.segments.truncate(segments.len());
        for session in self.sessions.values_mut() {
            if session.artifact_for(version) == key
                && let Some(state) = session.versions.get_mut(&version)
            {
                state.segs.truncate(segments.len());
            }
        }
        for (index, held) in artifact.segments.iter_mut().enumerate() {
            if let Some((hash, bytes)) = held
                && (*hash != segments[index].hash || bytes.len() != segments[index].len as usize)
            {
                return Err(SenderError::SegmentMismatch {
                    version,
                    index: index as u32,
                });
            }
        }
        artifact.seal = Some(Seal {
            id,
            target_hash,
            segments,
            signature,
        });
        Ok(())
    }

    /// Publishes a complete delta artifact (from a store): its structure, manifest
    /// hash and signature are checked here, its segment hashes by the store that read it.
    /// For a delta sealed here already (published cut-through) it replaces the parts the
    /// delta was published in: `bytes` must be that artifact, which its id vouches for.
    pub fn insert_artifact(&mut self, artifact: StoredArtifact) -> Result<u64, SenderError> {
        let file = DeltaFile::parse(&artifact.bytes)?;
        let version = file.header().target_version;
        self.insert(ArtifactKey::Delta(version), &artifact, &file)?;
        Ok(version)
    }

    /// The driver's answer to [`SenderEvent::Load`]: the artifact's bytes and signature,
    /// or why there are none. Its structure, manifest hash and signature are checked
    /// here, its segment hashes by the store that read or built it. Without it, the sessions that want it are told it
    /// is unavailable, except a composed delta's, which replay the deltas (the driver
    /// declines one when replaying costs fewer bytes); the error says why.
    pub fn loaded(
        &mut self,
        key: ArtifactKey,
        artifact: Result<StoredArtifact, String>,
    ) -> Result<(), SenderError> {
        self.loading.remove(&key);
        let inserted = artifact
            .map_err(|reason| SenderError::NotLoaded { key, reason })
            .and_then(|artifact| {
                let file = DeltaFile::parse(&artifact.bytes)?;
                self.insert(key, &artifact, &file)
            });
        if let Err(error) = &inserted {
            let why = match error {
                SenderError::NotLoaded { reason, .. } => reason.clone(),
                refused => refused.to_string(),
            };
            self.unavailable.insert(key, why);
        }
        inserted
    }

    /// The driver's answer to [`SenderEvent::Load`] when it cannot load `key` now (it
    /// is at its budget of concurrent builds): the sessions that want it are told it is
    /// unavailable for `reason`, so their receivers come back after a backoff, and the
    /// next Want of any session lets it be asked for again. A composed delta's sessions
    /// replay the deltas instead. Nothing waits in a queue.
    pub fn load_deferred(&mut self, key: ArtifactKey, reason: String) {
        self.loading.remove(&key);
        self.stats.loads_deferred += 1;
        self.deferred.insert(key, reason);
    }

    fn insert(
        &mut self,
        key: ArtifactKey,
        artifact: &StoredArtifact,
        file: &DeltaFile<'_>,
    ) -> Result<(), SenderError> {
        key.check(file.header())?;
        if let ArtifactKey::Delta(_) = key {
            let sealed = self.artifacts.get_mut(&key).filter(|a| a.seal.is_some());
            if let Some(held) = sealed {
                // Sealed here already (published cut-through, then joined whole to be
                // stored): the same artifact is served from its whole bytes from now on,
                // so the buffers it was published in are freed and it is held once.
                if held.seal.as_ref().is_some_and(|seal| seal.id == file.id) {
                    (held.descriptor, held.segments) = stored_parts(&artifact.bytes, file);
                }
            } else {
                // A delta may be held in part (published cut-through): its descriptor and
                // any segment held must match, and the table (with the signature) seals
                // it.
                let (descriptor, segments) = stored_parts(&artifact.bytes, file);
                self.begin(ArtifactKind::Delta, descriptor, artifact.offer_signature)?;
                self.artifacts.get_mut(&key).expect("just begun").segments = segments;
                let table = file.manifest.segments.clone();
                let target_hash = file.header().target_hash;
                if let Err(error) =
                    self.seal_artifact(key, target_hash, file.id, table, artifact.signature)
                {
                    // Nothing of a refused artifact is served.
                    self.artifacts.remove(&key);
                    return Err(error);
                }
            }
        } else {
            if file.segment_count() > MAX_TRANSFER_SEGMENTS as usize {
                return Err(SenderError::TooManySegments {
                    count: file.segment_count(),
                });
            }
            let statement = Statement::artifact(key.kind(), file.id, file.header());
            self.check_signature(&statement, artifact.signature.as_ref())?;
            let (descriptor, segments) = stored_parts(&artifact.bytes, file);
            self.check_offer_signature(key, &descriptor, artifact.offer_signature)?;
            self.unavailable.remove(&key);
            self.artifacts.insert(
                key,
                Artifact {
                    descriptor,
                    offer_signature: artifact.offer_signature,
                    segments,
                    seal: Some(Seal {
                        id: file.id,
                        target_hash: file.header().target_hash,
                        segments: file.manifest.segments.clone(),
                        signature: artifact.signature,
                    }),
                },
            );
        }
        self.evict();
        Ok(())
    }

    /// With a pinned trainer key, `signature` must be the trainer's over the Offer of
    /// `key` with `descriptor`: a receiver refuses an Offer without it before it
    /// allocates anything the descriptor claims.
    fn check_offer_signature(
        &self,
        key: ArtifactKey,
        descriptor: &[u8],
        signature: Option<ArtifactSignature>,
    ) -> Result<(), SenderError> {
        let statement = Statement::offer(key.kind(), key.version(), descriptor);
        Ok(self.check_signature(&statement, signature.as_ref())?)
    }

    /// The held deltas, oldest first.
    pub(super) fn deltas(&self) -> impl DoubleEndedIterator<Item = (u64, &Artifact)> {
        self.artifacts
            .range(ArtifactKey::Delta(0)..=ArtifactKey::Delta(u64::MAX))
            .map(|(key, artifact)| (key.version(), artifact))
    }

    /// Drops what no session needs: deltas beyond the retained count or bytes, older
    /// first (never the newest), and any other artifact as soon as no session is served
    /// it, but the snapshot a relay keeps. A relay keeps the deltas after that snapshot
    /// with it (they are in its file, not in memory: [`crate::RelayOptions::keep_snapshots`])
    /// while they add up to no more than [`crate::KEPT_TAIL_SNAPSHOTS`] snapshots, since a
    /// joiner goes on with them; past that, a newer snapshot from the hub costs a joiner
    /// less, and the relay's is withdrawn.
    pub(super) fn evict(&mut self) {
        let versions_ahead = self.config.versions_ahead;
        if let Some(kept) = self.kept_snapshot {
            if !self.keeps_tail() {
                self.withdraw_snapshot(format!(
                    "the deltas after the snapshot of version {kept} outgrew what a relay \
                     keeps: the hub's newer snapshot costs a joiner less"
                ));
            } else if !self.holds_deltas_after(kept) {
                self.withdraw_snapshot(format!(
                    "the deltas after the snapshot of version {kept} are not all held here \
                     (this relay follows from version {})",
                    self.floor
                ));
            }
        }
        // The deltas a kept snapshot's joiners go on with stay; the others are retained
        // as on any relay.
        let tail_from = self
            .kept_snapshot
            .filter(|_| self.keeps_tail())
            .map_or(u64::MAX, |kept| kept.saturating_add(1));
        loop {
            let (count, bytes) = self
                .deltas()
                .fold((0, 0), |(n, b), (_, a)| (n + 1, b + a.held_bytes()));
            let over = count > self.config.retain_versions || bytes > self.config.retain_bytes;
            if count <= 1 || !over {
                break;
            }
            let (oldest, _) = self.deltas().next().expect("not empty");
            if oldest >= tail_from {
                break;
            }
            let needed = self.sessions.values().any(|s| {
                s.next_version
                    .is_some_and(|n| n <= oldest && oldest < n + versions_ahead)
            });
            if needed {
                break;
            }
            self.artifacts.remove(&ArtifactKey::Delta(oldest));
            self.floor = self.floor.max(oldest + 1);
        }
        let sessions = &self.sessions;
        let kept = self.kept_snapshot.map(ArtifactKey::Snapshot);
        self.artifacts.retain(|key, _| {
            matches!(key, ArtifactKey::Delta(_))
                || Some(*key) == kept
                || sessions
                    .values()
                    .any(|s| s.artifact_for(key.version()) == *key)
        });
    }

    /// Whether the deltas after the kept snapshot all stay: they add up to no more than
    /// [`crate::KEPT_TAIL_SNAPSHOTS`] of it (or it is still to come, or to be sealed).
    fn keeps_tail(&self) -> bool {
        self.kept_tail().is_some_and(|(tail, snapshot)| {
            tail <= snapshot.saturating_mul(crate::KEPT_TAIL_SNAPSHOTS)
        })
    }

    /// The bytes of the deltas held after the kept snapshot, and of the snapshot
    /// (`u64::MAX` until it is sealed): a relay takes a newer snapshot before the first
    /// outgrows what it keeps ([`crate::RelayOptions::keep_snapshots`]).
    pub(crate) fn kept_tail(&self) -> Option<(u64, u64)> {
        let kept = self.kept_snapshot?;
        let snapshot = self
            .artifacts
            .get(&ArtifactKey::Snapshot(kept))
            .and_then(Artifact::sealed_payload_bytes)
            .unwrap_or(u64::MAX);
        let tail = self
            .deltas()
            .filter(|(version, _)| *version > kept)
            .map(|(_, artifact)| artifact.held_bytes())
            .sum();
        Some((tail, snapshot))
    }

    /// Whether the kept snapshot is here whole: sealed, every segment held.
    pub(crate) fn kept_snapshot_complete(&self) -> bool {
        self.kept_snapshot
            .and_then(|version| self.artifacts.get(&ArtifactKey::Snapshot(version)))
            .is_some_and(Artifact::is_complete)
    }

    /// Takes the kept snapshot out, once it is complete and sealed, with the complete
    /// deltas after it, in order, up to the first that is not: a relay's fetcher hands
    /// them over to the relay it fetched them for ([`Sender::adopt_snapshot`]).
    pub(crate) fn take_kept_snapshot(&mut self) -> Option<KeptSnapshot> {
        if !self.kept_snapshot_complete() {
            return None;
        }
        let version = self.kept_snapshot.take()?;
        let key = ArtifactKey::Snapshot(version);
        let artifact = self.artifacts.remove(&key)?;
        let mut deltas = Vec::new();
        for next in version.saturating_add(1).. {
            let key = ArtifactKey::Delta(next);
            if !self.artifacts.get(&key).is_some_and(Artifact::is_complete) {
                break;
            }
            deltas.push((next, self.artifacts.remove(&key).expect("looked up above")));
        }
        Some(KeptSnapshot {
            version,
            artifact,
            deltas,
        })
    }

    /// Serves `snapshot` to joiners in place of the kept one, if any: a relay that took a
    /// newer snapshot on the side before the deltas after its own outgrew it, or after it
    /// withdrew its own. It must be newer than the kept one, and every delta after it
    /// must be held here (or be still to come) or come with it, since a joiner goes on
    /// with them; the deltas up to it are then retained as on any relay. An error says
    /// why it was not adopted.
    pub fn adopt_snapshot(&mut self, snapshot: KeptSnapshot) -> Result<(), String> {
        let KeptSnapshot {
            version,
            artifact,
            deltas,
        } = snapshot;
        if let Some(kept) = self.kept_snapshot.filter(|&kept| kept >= version) {
            return Err(format!(
                "the snapshot of version {version} is no newer than the kept one, of {kept}"
            ));
        }
        // The deltas between it and the oldest held here come with it.
        let lacking = version.saturating_add(1)..self.floor;
        let lacking_count = lacking.end.saturating_sub(lacking.start);
        let brought: Vec<(u64, Artifact)> = deltas
            .into_iter()
            .filter(|(delta, _)| lacking.contains(delta))
            .collect();
        if brought.len() as u64 != lacking_count {
            return Err(format!(
                "the deltas after version {version} are held here from version {} on, and \
                 it came with {} of the {lacking_count} before that",
                self.floor,
                brought.len(),
            ));
        }
        for (delta, artifact) in brought {
            self.artifacts.insert(ArtifactKey::Delta(delta), artifact);
        }
        self.floor = self.floor.min(lacking.start);
        // The old one goes once no session is served it (`evict`): a joiner halfway
        // through it finishes it.
        self.kept_snapshot = Some(version);
        self.kept_wanted = false;
        let key = ArtifactKey::Snapshot(version);
        self.unavailable.remove(&key);
        self.artifacts.insert(key, artifact);
        self.evict();
        Ok(())
    }

    /// Whether the store can provide `key` (asked for with [`SenderEvent::Load`]).
    fn loadable(&self, key: ArtifactKey) -> bool {
        self.config.store_backed
            && match key {
                ArtifactKey::Delta(version) => self.loadable_max.is_some_and(|l| version <= l),
                ArtifactKey::Snapshot(version) => self.snapshots_stored.contains(&version),
                // Chosen only where a store can try to build it (`composed_choice`).
                ArtifactKey::Composed { .. } => true,
            }
    }

    /// Why `key` cannot be sent from here, or `None` while it may yet come: loading from
    /// the store (asked for here) or not published yet.
    pub(super) fn why_unavailable(&mut self, key: ArtifactKey) -> Option<String> {
        if let Some(reason) = self.unavailable.get(&key).or(self.deferred.get(&key)) {
            return Some(reason.clone());
        }
        if self.loadable(key) {
            if self.loading.insert(key) {
                self.events.push_back(SenderEvent::Load(key));
            }
            return None;
        }
        match key {
            // The snapshot a relay is about to take: its Offer is on its way.
            ArtifactKey::Snapshot(version) if self.kept_snapshot == Some(version) => None,
            ArtifactKey::Snapshot(version) if !self.config.store_backed => Some(format!(
                "version {version} is wanted as a snapshot and this {} has no store to build one from",
                self.config.identity.role
            )),
            ArtifactKey::Snapshot(version) => Some(format!(
                "no snapshot of version {version} here (the newest is {:?})",
                self.snapshots_stored.last()
            )),
            ArtifactKey::Delta(version) if version < self.floor => Some(format!(
                "version {version} is not held here (versions from {} are)",
                self.floor
            )),
            // Not published yet, or not begun yet by a relay that began a later one first
            // (offers of consecutive versions travel on different streams).
            _ => None,
        }
    }

    /// Artifacts of `kind` held now.
    #[cfg(test)]
    pub(crate) fn held(&self, kind: ArtifactKind) -> usize {
        self.artifacts.keys().filter(|k| k.kind() == kind).count()
    }
}

/// A stored artifact's descriptor (its header with the target hash pending, as Offers
/// carry it) and its segments, as slices of its bytes.
fn stored_parts(bytes: &Bytes, file: &DeltaFile<'_>) -> (Bytes, Vec<Option<(Hash, Bytes)>>) {
    let descriptor = file.header().encode_pending();
    let mut offset = descriptor.len();
    let mut segments = Vec::with_capacity(file.segment_count());
    for entry in &file.manifest.segments {
        let end = offset + entry.len as usize;
        segments.push(Some((entry.hash, bytes.slice(offset..end))));
        offset = end;
    }
    (Bytes::from(descriptor), segments)
}

fn parse_descriptor(descriptor: &[u8]) -> Result<DeltaHeader, SenderError> {
    let (header, used) = DeltaHeader::decode(descriptor)?;
    if used != descriptor.len() {
        return Err(SenderError::TrailingBytes {
            count: descriptor.len() - used,
        });
    }
    Ok(header)
}
