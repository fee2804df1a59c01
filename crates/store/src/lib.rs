//! The checkpoint store: versioned, immutable artifacts on disk, catalogued in redb.
//!
//! # On-disk layout
//!
//! ```text
//! <root>/
//!   catalog.redb                                  the catalog (redb; also the store's lock)
//!   deltas/<target_version>-<id hex>.adelta       D(v): turns version v-1 into v
//!   snapshots/<version>-<weights hash hex>.safetensors
//!   composed/<base>-<target>-<id hex>.adelta      C(base -> target), built on demand
//!   snapshot-artifacts/<version>-<weights hash hex>-<segment bytes>.adelta
//!                                                 a snapshot as joiners take it, built on
//!                                                 demand, kept while the snapshot is
//!   rollouts/<version>-<hash hex>.json            the rollouts version v was trained on
//!   trainer/<version>-<hash hex>.state            the trainer's state once it made v
//! ```
//!
//! File names carry the artifact's identity (a delta's id is its manifest hash, a
//! snapshot's is its weights hash), so two different artifacts never share a path and a
//! file is never rewritten with other contents.
//!
//! # Catalog tables
//!
//! - `deltas`: version (u64) → (base version, id, base weights hash, target weights hash,
//!   file size in bytes, the trainer's signature if any (64 bytes, docs/security.md)).
//!   The store keeps a signature, it does not check it: it holds no key. Whoever serves
//!   the delta with a pinned trainer key does (`aurora store verify --key` too).
//! - `snapshots`: version (u64) → (weights hash, file size in bytes).
//! - `composed`: (base version, target version) → (id, base weights hash, target weights
//!   hash, file size in bytes).
//! - `rollouts`: version (u64) → (BLAKE3 hash of the file, file size in bytes): the
//!   collected rollouts a trainer turned into that version, as it serialized them.
//! - `trainer_state`: the same, for the trainer's own state once it produced that
//!   version (master weights, optimizer moments, counters): what a restarted trainer
//!   resumes from ([`TrainerData`]).
//!
//! The catalog is the truth: a file is part of the store only while a record names it.
//!
//! # Write order and crash safety
//!
//! - **Put**: the artifact is verified in memory, then written with
//!   [`aurora_checkpoint::write_atomically`] (temporary file, fsync, rename, directory
//!   fsync), and only then is its record committed. A crash before the commit leaves an
//!   unreferenced file or a temporary file, never a record without its file.
//! - **Prune**: the records are removed and committed first, the files deleted after. A
//!   crash in between leaves unreferenced files, never a record without its file.
//! - **Open**: every file in an artifact directory that no record names (orphans of
//!   the two crashes above, and temporary files) is deleted. Only one process can hold
//!   the catalog open (redb locks it), so no other writer's temporary file is touched.
//!
//! So the catalog never points at a missing file through our own doing; a file removed
//! or damaged behind the store's back is reported by the read that finds it.
//!
//! # Reads
//!
//! Every read is verified before it is returned: a delta's (or composed delta's) manifest
//! hash and every segment hash, and its id and versions against the record; a snapshot's weights hash
//! against the record. A corrupted artifact is an error naming the version and the file,
//! and is never served.
//!
//! A snapshot travels to a peer with no weights as an artifact in the delta format
//! ([`Store::snapshot_artifact`]): the delta from the empty checkpoint to it, every tensor
//! added, base and target version both its version (docs/wire-protocol.md §4.4). It is
//! written to a file as it is extracted and served from the file's map, so a hub holds
//! no model-sized buffer for it.
//!
//! # Acceptance rule
//!
//! A delta for version v must start from v-1 (`base_version == v-1`). If version v-1 is
//! known (as a delta's target or as a snapshot), the delta's base hash must equal its
//! weights hash; if version v is known as a snapshot, the delta's target hash must equal
//! it. A snapshot must agree the same way with the deltas into and out of its version.
//! A second, different artifact for a version already stored is refused; the same one
//! again is accepted and changes nothing.
//!
//! # Composed deltas
//!
//! [`Store::composed_artifact`] builds C(a -> v), one exact delta from version a to v,
//! the first time it is asked for: the weights of a are rebuilt from the newest snapshot
//! at or below a whose chain of deltas reaches v (applying the deltas up to a, each
//! verified by its target hash), then `aurora_delta::compose` applies D(a+1..=v) and
//! extracts v against a with the `aurora` encoding. Applied to the weights of a, it
//! reproduces v's weights hash bit for bit (compose checks every link's target hash).
//! It is stored like a delta (crash-safe write, then the record) and re-verified on
//! every read; being deterministic, building it again gives the same artifact.
//! Pruning keeps only the composed deltas whose target is the latest version: any other
//! one is never served again, since an Actor always catches up to the latest.
//!
//! # Catch-up rule
//!
//! An Actor at version a catches up to version v (the latest) by whichever needs fewest
//! bytes: replaying D(a+1..=v), loading a snapshot s <= v and replaying D(s+1..=v), or
//! one composed delta C(a -> v). A composed delta is considered only when the Actor is at
//! least two versions behind (one behind, it would be D(v) itself), and its size is
//! known only once it is built: [`Store::composed_catch_up_plan`] (the hub's, when it
//! serves a lagging Actor) builds it once and stores it; [`Store::catch_up_plan`] (a
//! cheap read, also used by pruning) counts one only if it is already stored. On equal bytes replay wins, then the composed delta, then the
//! later snapshot. See [`Plan`] and `plan::choose`, which is pure: sizes in, plan out.

mod catalog;
mod catch_up;
mod composed;
mod error;
mod files;
mod plan;
mod put;
mod read;
mod retention;

use std::fs;
use std::path::{Path, PathBuf};

use aurora_delta::RunId;
use redb::Database;

pub use catalog::{
    ComposedRecord, DeltaRecord, SCHEMA_VERSION, SnapshotRecord, TrainerData, TrainerDataRecord,
};
pub use error::{Result, StoreError};
pub use plan::Plan;
pub use retention::{PruneReport, should_snapshot};

use catalog::{COMPOSED_TABLE, DELTA_TABLE, SNAPSHOT_TABLE, check_schema};
use error::catalog;
use files::{CATALOG, artifact_dirs};

/// An open checkpoint store. Holds the catalog's lock until dropped.
pub struct Store {
    root: PathBuf,
    db: Database,
    /// The run's id, fixed when the store was made: every statement the trainer signs
    /// for its versions names it.
    run: RunId,
}

impl Store {
    /// Opens (or creates) the store at `root` and deletes files no record names.
    pub fn open(root: impl AsRef<Path>) -> Result<Store> {
        let root = root.as_ref().to_path_buf();
        for dir in artifact_dirs() {
            let path = root.join(dir);
            fs::create_dir_all(&path).map_err(|source| StoreError::Io { path, source })?;
        }
        let db = Database::create(root.join(CATALOG)).map_err(catalog)?;
        // Create every table now so that readers never meet a missing table.
        let txn = db.begin_write().map_err(catalog)?;
        let run = check_schema(&txn)?;
        txn.open_table(DELTA_TABLE).map_err(catalog)?;
        txn.open_table(SNAPSHOT_TABLE).map_err(catalog)?;
        txn.open_table(COMPOSED_TABLE).map_err(catalog)?;
        for kind in TrainerData::ALL {
            txn.open_table(kind.table()).map_err(catalog)?;
        }
        txn.commit().map_err(catalog)?;
        let store = Store { root, db, run };
        store.remove_orphans()?;
        Ok(store)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The run's id: random, fixed when the store was made, named by every statement the
    /// trainer signs for the run's versions (docs/delta-format.md §10).
    pub fn run_id(&self) -> RunId {
        self.run
    }
}

#[cfg(test)]
mod tests;
