//! Composed deltas C(base -> target): built on first request from a snapshot and its
//! chain of deltas, then stored and served like any artifact.

use aurora_checkpoint::{FileImages, MappedFile};
use aurora_delta::{Checkpoint, DeltaError, DeltaFile, ExtractOptions, Hash, compose, replay};
use redb::ReadableTable;

use crate::catalog::{
    COMPOSED_TABLE, ComposedRecord, SnapshotRecord, composed_record, composed_value,
};
use crate::error::catalog;
use crate::files::{commit_with_file, open_delta_artifact};
use crate::{Result, Store, StoreError};

impl Store {
    /// C(base -> target): one exact delta from version `base` to `target`, read fully
    /// verified from the cache or built and stored first (see the crate docs).
    pub fn composed_artifact(&self, base: u64, target: u64) -> Result<Vec<u8>> {
        let (record, built) = self.ensure_composed(base, target)?;
        if let Some(bytes) = built {
            return Ok(bytes);
        }
        let file = open_delta_artifact(
            "composed delta",
            &self.composed_path(&record),
            record.size_bytes,
            record.id,
            (base, target),
        )?;
        Ok(file.bytes().to_vec())
    }

    /// The record of C(base -> target), building and storing the artifact if the
    /// catalog has none; then also the bytes just built (and verified by the build), so
    /// a caller that wants them need not read them back.
    pub(crate) fn ensure_composed(
        &self,
        base: u64,
        target: u64,
    ) -> Result<(ComposedRecord, Option<Vec<u8>>)> {
        if let Some(record) = self.composed_record(base, target)? {
            return Ok((record, None));
        }
        let (record, bytes) = self.composed_unstored(base, target)?;
        self.keep_composed(record, bytes)
    }

    /// C(base -> target) built, with the record it would have, not stored: a plan that
    /// then prefers replaying leaves nothing behind.
    pub(crate) fn composed_unstored(
        &self,
        base: u64,
        target: u64,
    ) -> Result<(ComposedRecord, Vec<u8>)> {
        let bytes = self.build_composed(base, target)?;
        let file = DeltaFile::parse(&bytes).map_err(|source| StoreError::ComposedArtifact {
            base,
            target,
            source,
        })?;
        let header = file.header();
        let record = ComposedRecord {
            base_version: base,
            target_version: target,
            id: file.id,
            base_hash: header.base_hash,
            target_hash: header.target_hash,
            size_bytes: bytes.len() as u64,
        };
        Ok((record, bytes))
    }

    /// Stores a composed delta [`Store::composed_unstored`] built, unless its target is
    /// no longer the latest version (one to an older target is never served again);
    /// its record and bytes either way.
    pub(crate) fn keep_composed(
        &self,
        record: ComposedRecord,
        bytes: Vec<u8>,
    ) -> Result<(ComposedRecord, Option<Vec<u8>>)> {
        let (base, target) = (record.base_version, record.target_version);
        if self.latest_version()? != Some(target) {
            return Ok((record, Some(bytes)));
        }
        let txn = self.db.begin_write().map_err(catalog)?;
        {
            let table = txn.open_table(COMPOSED_TABLE).map_err(catalog)?;
            if let Some(existing) = table.get((base, target)).map_err(catalog)? {
                // Built by another call meanwhile: composing is deterministic, so it is
                // the same artifact.
                return Ok((
                    composed_record((base, target), existing.value()),
                    Some(bytes),
                ));
            }
        }
        commit_with_file(txn, &self.composed_path(&record), &bytes, |txn| {
            txn.open_table(COMPOSED_TABLE)
                .map_err(catalog)?
                .insert((base, target), composed_value(&record))
                .map_err(catalog)?;
            Ok(())
        })?;
        tracing::info!(base, target, id = %record.id, bytes = record.size_bytes, "stored a composed delta");
        Ok((record, Some(bytes)))
    }

    /// Composes D(base+1..=target) against the weights of `base`, rebuilt from the
    /// newest snapshot at or below `base` whose chain of deltas reaches `target`.
    fn build_composed(&self, base: u64, target: u64) -> Result<Vec<u8>> {
        let (deltas, snapshots) = self.records()?;
        let latest = deltas.keys().chain(snapshots.keys()).max().copied();
        if base >= target || latest.is_none_or(|latest| target > latest) {
            return Err(StoreError::NoComposed {
                base,
                target,
                latest,
            });
        }
        let chain = self.chain_to(base, target)?;
        let failed = |source| StoreError::ComposedArtifact {
            base,
            target,
            source,
        };
        let parsed = chain.parse().map_err(failed)?;
        let (to_base, to_target) = parsed.split_at((base - chain.start) as usize);
        let scratch = self.scratch();
        chain.with_weights(to_base, &scratch, failed, |base_weights, base_hash| {
            let options = ExtractOptions {
                base_hash: Some(base_hash),
                ..ExtractOptions::default()
            };
            Ok(compose(base_weights, to_target, options, &scratch)?.1)
        })
    }

    /// The safetensors image of `version`'s weights, rebuilt from the newest snapshot at
    /// or below it and the deltas after that snapshot, each verified by its target hash
    /// as it is applied: what a restarted trainer of the built-in engine (whose models
    /// are small) reads for a version it no longer holds.
    pub fn weights_image(&self, version: u64) -> Result<Vec<u8>> {
        let chain = self.chain_to(version, version)?;
        let failed = |source| StoreError::Rebuild { version, source };
        let parsed = chain.parse().map_err(failed)?;
        chain.with_weights(&parsed, &self.scratch(), failed, |weights, _| {
            weights.to_safetensors()
        })
    }

    /// Stores a snapshot of `version`, rebuilt as [`Store::weights_image`] rebuilds it:
    /// for a trainer that published `version` from its ranks' shards and never held it
    /// whole. The rebuilt weights lie in mapped scratch files, not in memory.
    pub fn put_snapshot_rebuilt(&self, version: u64) -> Result<SnapshotRecord> {
        let chain = self.chain_to(version, version)?;
        let failed = |source| StoreError::Rebuild { version, source };
        let parsed = chain.parse().map_err(failed)?;
        let mut stored = None;
        chain.with_weights(&parsed, &self.scratch(), failed, |weights, _| {
            stored = Some(self.put_snapshot_checkpoint(version, weights));
            Ok(())
        })?;
        stored.expect("set by the rebuild")
    }

    /// Where weights are rebuilt: unnamed files in the store's directory, mapped, so a
    /// rebuild holds no model in memory and leaves nothing behind.
    fn scratch(&self) -> FileImages {
        FileImages::new(&self.root)
    }

    /// The newest snapshot at or below `base` whose chain of deltas reaches `reach`, and
    /// the deltas after it up to `reach`, mapped and verified.
    fn chain_to(&self, base: u64, reach: u64) -> Result<Chain> {
        let (deltas, snapshots) = self.records()?;
        let start = snapshots
            .range(..=base)
            .rev()
            .map(|(&s, _)| s)
            .find(|&s| (s + 1..=reach).all(|v| deltas.contains_key(&v)))
            .ok_or(StoreError::NoRoute {
                actor: base,
                latest: reach,
            })?;
        let (snapshot, record) = self.verified_snapshot(start)?;
        let deltas = (start + 1..=reach)
            .map(|version| self.delta(version))
            .collect::<Result<Vec<MappedFile>>>()?;
        Ok(Chain {
            start,
            snapshot,
            weights_hash: record.weights_hash,
            deltas,
        })
    }
}

/// A snapshot and the deltas after it, as mapped from the store.
struct Chain {
    start: u64,
    snapshot: MappedFile,
    weights_hash: Hash,
    deltas: Vec<MappedFile>,
}

impl Chain {
    fn parse(&self) -> std::result::Result<Vec<DeltaFile<'_>>, DeltaError> {
        self.deltas
            .iter()
            .map(|file| DeltaFile::parse(file.bytes()))
            .collect()
    }

    /// Calls `then` with the weights after applying `deltas` (the first ones of this
    /// chain) to the snapshot in `scratch`, each verified by its target hash as it is
    /// applied, and their hash; a failure of either is mapped by `failed`.
    fn with_weights<T>(
        &self,
        deltas: &[DeltaFile<'_>],
        scratch: &FileImages,
        failed: impl Fn(DeltaError) -> StoreError,
        then: impl FnOnce(&Checkpoint<'_>, Hash) -> std::result::Result<T, DeltaError>,
    ) -> Result<T> {
        let start = Checkpoint::from_safetensors(self.snapshot.bytes()).map_err(|source| {
            StoreError::InvalidSnapshot {
                version: self.start,
                source,
            }
        })?;
        let hash = deltas
            .last()
            .map_or(self.weights_hash, |delta| delta.header().target_hash);
        let rebuilt = replay(&start, deltas, Some(self.weights_hash), scratch).map_err(&failed)?;
        let weights = match &rebuilt {
            Some((image, layout)) => Checkpoint::from_layout(image, layout).map_err(&failed)?,
            None => start,
        };
        then(&weights, hash).map_err(failed)
    }
}
