//! Retention: when to take a snapshot, and pruning what no Actor can still need.

use std::collections::BTreeSet;

use crate::catalog::{
    COMPOSED_TABLE, ComposedRecord, DELTA_TABLE, DeltaRecord, SNAPSHOT_TABLE, SnapshotRecord,
    TrainerData, TrainerDataRecord, sizes,
};
use crate::error::catalog;
use crate::files::remove_unreferenced;
use crate::{Plan, Result, Store, plan};

/// What [`Store::prune`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PruneReport {
    pub deltas: Vec<u64>,
    pub snapshots: Vec<u64>,
    /// (base, target) of each composed delta removed.
    pub composed: Vec<(u64, u64)>,
    pub trainer_states: Vec<u64>,
    pub bytes_freed: u64,
}

/// Whether a snapshot should be taken at `version` under a "one every `every_k` versions"
/// policy. Version 0, the initial checkpoint, is always snapshotted, since every chain
/// starts from it; `every_k == 0` means only version 0.
pub fn should_snapshot(version: u64, every_k: u64) -> bool {
    version == 0 || (every_k > 0 && version.is_multiple_of(every_k))
}

impl Store {
    /// Removes artifacts older than `keep_versions_from` that nobody needs. Kept:
    /// - every delta and snapshot of version `keep_versions_from` or later;
    /// - the newest snapshot and every delta after it, so a new Actor can always join;
    /// - for each live Actor at version a: the deltas after a and the snapshot its
    ///   current catch-up plan starts from, so its plan is unchanged by the prune;
    /// - the composed deltas whose target is the latest version (no other is served
    ///   again: Actors catch up to the latest) and whose base is kept or a live Actor's:
    ///   a composed delta goes with the versions it spans;
    /// - every version's rollouts: the run's training data, which no Actor needs and
    ///   no prune of weights should take away;
    /// - the newest trainer state and every one of version `keep_versions_from` or
    ///   later: a restarted trainer resumes from the newest and retrains forward.
    ///
    /// Records are removed in one committed transaction before any file is deleted (see
    /// the crate docs for why this order is crash-safe).
    pub fn prune(
        &self,
        keep_versions_from: u64,
        live_actor_versions: &[u64],
    ) -> Result<PruneReport> {
        let (deltas, snapshots) = self.records()?;
        let composed = self.composed_records()?;
        let latest = deltas.keys().chain(snapshots.keys()).max().copied();
        let mut keep_deltas: BTreeSet<u64> =
            deltas.range(keep_versions_from..).map(|d| *d.0).collect();
        let mut keep_snapshots: BTreeSet<u64> = snapshots
            .range(keep_versions_from..)
            .map(|s| *s.0)
            .collect();
        if let Some(&newest) = snapshots.keys().next_back() {
            keep_snapshots.insert(newest);
            keep_deltas.extend(deltas.range(newest + 1..).map(|d| *d.0));
        }
        let (delta_sizes, snapshot_sizes) = sizes(&deltas, &snapshots);
        // An Actor ahead of the store has nothing here to lose.
        for (actor, latest) in live_actor_versions.iter().filter_map(|&a| {
            latest
                .filter(|&latest| a <= latest)
                .map(|latest| (a, latest))
        }) {
            keep_deltas.extend(deltas.range(actor + 1..).map(|d| *d.0));
            let composed_size = composed.get(&(actor, latest)).map(|c| c.size_bytes);
            if let Some(Plan::Snapshot { snapshot, .. }) =
                plan::choose(actor, latest, &delta_sizes, &snapshot_sizes, composed_size)
            {
                keep_snapshots.insert(snapshot);
            }
        }
        let doomed_deltas: Vec<&DeltaRecord> = deltas
            .values()
            .filter(|d| !keep_deltas.contains(&d.version))
            .collect();
        let doomed_snapshots: Vec<&SnapshotRecord> = snapshots
            .values()
            .filter(|s| !keep_snapshots.contains(&s.version))
            .collect();
        let doomed_composed: Vec<&ComposedRecord> = composed
            .values()
            .filter(|c| {
                Some(c.target_version) != latest
                    || (c.base_version < keep_versions_from
                        && !live_actor_versions.contains(&c.base_version))
            })
            .collect();
        let states = self.trainer_data_records(TrainerData::State)?;
        let newest_state = states.keys().next_back().copied();
        let doomed_states: Vec<&TrainerDataRecord> = states
            .values()
            .filter(|s| s.version < keep_versions_from && Some(s.version) != newest_state)
            .collect();

        let txn = self.db.begin_write().map_err(catalog)?;
        {
            let mut table = txn.open_table(DELTA_TABLE).map_err(catalog)?;
            for record in &doomed_deltas {
                table.remove(record.version).map_err(catalog)?;
            }
            let mut table = txn.open_table(SNAPSHOT_TABLE).map_err(catalog)?;
            for record in &doomed_snapshots {
                table.remove(record.version).map_err(catalog)?;
            }
            let mut table = txn.open_table(COMPOSED_TABLE).map_err(catalog)?;
            for record in &doomed_composed {
                table
                    .remove((record.base_version, record.target_version))
                    .map_err(catalog)?;
            }
            let mut table = txn
                .open_table(TrainerData::State.table())
                .map_err(catalog)?;
            for record in &doomed_states {
                table.remove(record.version).map_err(catalog)?;
            }
        }
        txn.commit().map_err(catalog)?;

        let paths = doomed_deltas
            .iter()
            .map(|d| self.delta_path(d))
            .chain(doomed_snapshots.iter().map(|s| self.snapshot_path(s)))
            .chain(doomed_composed.iter().map(|c| self.composed_path(c)))
            .chain(doomed_states.iter().map(|s| self.trainer_data_path(s)));
        for path in paths {
            remove_unreferenced(&path)?;
        }
        for record in &doomed_snapshots {
            self.remove_snapshot_artifacts(record)?;
        }
        let report = PruneReport {
            deltas: doomed_deltas.iter().map(|d| d.version).collect(),
            snapshots: doomed_snapshots.iter().map(|s| s.version).collect(),
            composed: doomed_composed
                .iter()
                .map(|c| (c.base_version, c.target_version))
                .collect(),
            trainer_states: doomed_states.iter().map(|s| s.version).collect(),
            bytes_freed: doomed_deltas.iter().map(|d| d.size_bytes).sum::<u64>()
                + doomed_snapshots.iter().map(|s| s.size_bytes).sum::<u64>()
                + doomed_composed.iter().map(|c| c.size_bytes).sum::<u64>()
                + doomed_states.iter().map(|s| s.size_bytes).sum::<u64>(),
        };
        tracing::info!(?report, "pruned the store");
        Ok(report)
    }

    /// Removes the composed deltas to versions older than the latest: no Actor catches
    /// up to one again. Every put of a newer version calls it, so the store holds
    /// composed deltas to one target at most, however many were asked for.
    pub(crate) fn drop_superseded_composed(&self) -> Result<()> {
        let latest = self.latest_version()?;
        let doomed: Vec<ComposedRecord> = self
            .composed_records()?
            .into_values()
            .filter(|c| Some(c.target_version) != latest)
            .collect();
        if doomed.is_empty() {
            return Ok(());
        }
        let txn = self.db.begin_write().map_err(catalog)?;
        {
            let mut table = txn.open_table(COMPOSED_TABLE).map_err(catalog)?;
            for record in &doomed {
                table
                    .remove((record.base_version, record.target_version))
                    .map_err(catalog)?;
            }
        }
        txn.commit().map_err(catalog)?;
        // Records first, then files: a crash in between leaves files the next open
        // removes, never a record without its file.
        for record in &doomed {
            remove_unreferenced(&self.composed_path(record))?;
        }
        tracing::info!(
            count = doomed.len(),
            "dropped composed deltas to older versions"
        );
        Ok(())
    }
}
