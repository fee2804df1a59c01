//! The redb catalog, the store's truth: the record types, the tables and their value
//! encodings (under [`SCHEMA_VERSION`]), and the keyed reads every other part builds on.

use std::collections::BTreeMap;

use aurora_delta::{ArtifactSignature, Hash, RunId};
use redb::{ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction};

use crate::error::catalog;
use crate::{Result, Store, StoreError};

/// The catalog record of a stored delta D(version).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaRecord {
    pub version: u64,
    pub base_version: u64,
    pub id: Hash,
    pub base_hash: Hash,
    pub target_hash: Hash,
    pub size_bytes: u64,
    /// The trainer's signature over the delta (`aurora_delta::Statement::artifact`);
    /// None for a delta of an unsigned deployment or stored before signatures.
    pub signature: Option<ArtifactSignature>,
}

/// What a trainer keeps beside each version so that it can go on after a crash: opaque
/// bytes in its own serialization, hashed and immutable like every artifact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TrainerData {
    /// The rollouts the version was trained on: the run's data, never pruned.
    Rollouts,
    /// The trainer's state once it produced the version (master weights, optimizer
    /// moments, counters): where a restarted trainer resumes from. Pruning keeps the
    /// newest.
    State,
}

impl TrainerData {
    pub const ALL: [TrainerData; 2] = [TrainerData::Rollouts, TrainerData::State];

    pub fn name(self) -> &'static str {
        match self {
            TrainerData::Rollouts => "rollouts",
            TrainerData::State => "trainer state",
        }
    }

    pub(crate) fn table(self) -> TableDefinition<'static, u64, TrainerDataValue> {
        match self {
            TrainerData::Rollouts => ROLLOUTS_TABLE,
            TrainerData::State => TRAINER_STATE_TABLE,
        }
    }

    /// The directory under the store's root, and the files' extension there.
    pub(crate) fn location(self) -> (&'static str, &'static str) {
        match self {
            TrainerData::Rollouts => ("rollouts", "json"),
            TrainerData::State => ("trainer", "state"),
        }
    }
}

/// The catalog record of one version's [`TrainerData`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainerDataRecord {
    pub kind: TrainerData,
    pub version: u64,
    /// BLAKE3 of the stored bytes.
    pub hash: Hash,
    pub size_bytes: u64,
}

/// The catalog record of a stored snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub version: u64,
    pub weights_hash: Hash,
    pub size_bytes: u64,
}

/// The catalog record of a stored composed delta C(base_version -> target_version).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComposedRecord {
    pub base_version: u64,
    pub target_version: u64,
    pub id: Hash,
    pub base_hash: Hash,
    pub target_hash: Hash,
    pub size_bytes: u64,
}

/// (base version, id, base hash, target hash, size in bytes, signature)
type DeltaValue = (u64, [u8; 32], [u8; 32], [u8; 32], u64, Option<[u8; 64]>);
/// A delta's value before schema 3: no signature.
pub(crate) type UnsignedDeltaValue = (u64, [u8; 32], [u8; 32], [u8; 32], u64);
/// (weights hash, size in bytes)
type SnapshotValue = ([u8; 32], u64);
/// (id, base hash, target hash, size in bytes)
type ComposedValue = ([u8; 32], [u8; 32], [u8; 32], u64);
/// (hash of the file, size in bytes)
pub(crate) type TrainerDataValue = ([u8; 32], u64);

/// The catalog's layout: its tables and their value encodings. A change to either takes
/// a new number; a catalog of another number is refused, never misread.
///
/// 2 added the `trainer_state` table; a catalog of version 1 is upgraded on open (its
/// tables are unchanged, the new one starts empty).
/// 3 added the trainer's signature to each delta's value; a catalog of version 1 or 2 is
/// upgraded on open: each delta's value is rewritten with no signature, so its deltas
/// stay readable (and a deployment that signs refuses to serve them).
/// 4 added the run's id (the `run` table), which every signed statement names
/// (docs/delta-format.md §10); a catalog of version 1 to 3 is upgraded on open: it gets a
/// new run id and its deltas lose their signatures, which were made without one and can
/// verify under no run.
pub const SCHEMA_VERSION: u32 = 4;
pub(crate) const SCHEMA_TABLE: TableDefinition<&str, u32> = TableDefinition::new("schema");
/// "id" → the run's id.
pub(crate) const RUN_TABLE: TableDefinition<&str, [u8; 16]> = TableDefinition::new("run");

/// Stamps a new catalog with [`SCHEMA_VERSION`] and a new run id, upgrades one of an
/// older version and refuses one of a newer. A catalog from before the stamp has
/// version 1's layout. Returns the run's id.
pub(crate) fn check_schema(txn: &WriteTransaction) -> Result<RunId> {
    let mut table = txn.open_table(SCHEMA_TABLE).map_err(catalog)?;
    let found = table.get("version").map_err(catalog)?.map(|v| v.value());
    match found {
        None => {
            table.insert("version", SCHEMA_VERSION).map_err(catalog)?;
            new_run(txn)
        }
        Some(SCHEMA_VERSION) => {
            let runs = txn.open_table(RUN_TABLE).map_err(catalog)?;
            let id = runs.get("id").map_err(catalog)?.map(|v| RunId(v.value()));
            id.ok_or(StoreError::NoRunId)
        }
        Some(found @ 1..=3) => {
            tracing::warn!(
                "upgrading the catalog from schema {found} to {SCHEMA_VERSION}: the run gets \
                 an id, and the deltas stored before lose their signatures (made without one)"
            );
            rewrite_deltas_unsigned(txn, found)?;
            table.insert("version", SCHEMA_VERSION).map_err(catalog)?;
            new_run(txn)
        }
        Some(found) => Err(StoreError::Schema {
            found,
            supported: SCHEMA_VERSION,
        }),
    }
}

/// Draws a run id from the operating system's randomness and records it.
fn new_run(txn: &WriteTransaction) -> Result<RunId> {
    let mut id = [0u8; 16];
    getrandom::fill(&mut id).map_err(|error| StoreError::Random(error.to_string()))?;
    let run = RunId(id);
    debug_assert!(run.is_known(), "16 random bytes are not all zero");
    txn.open_table(RUN_TABLE)
        .map_err(catalog)?
        .insert("id", id)
        .map_err(catalog)?;
    Ok(run)
}

/// Rewrites the deltas table of a catalog of schema `found` (1 to 3) with the value
/// type of 3 on, each delta unsigned. One write transaction: the upgrade happens whole
/// or not at all.
fn rewrite_deltas_unsigned(txn: &WriteTransaction, found: u32) -> Result<()> {
    let mut deltas = Vec::new();
    if found < 3 {
        let table = txn.open_table(UNSIGNED_DELTA_TABLE).map_err(catalog)?;
        for item in table.iter().map_err(catalog)? {
            let (version, value) = item.map_err(catalog)?;
            let (base, id, base_hash, target_hash, size) = value.value();
            deltas.push((
                version.value(),
                (base, id, base_hash, target_hash, size, None),
            ));
        }
        drop(table);
        txn.delete_table(UNSIGNED_DELTA_TABLE).map_err(catalog)?;
    } else {
        let table = txn.open_table(DELTA_TABLE).map_err(catalog)?;
        for item in table.iter().map_err(catalog)? {
            let (version, value) = item.map_err(catalog)?;
            let (base, id, base_hash, target_hash, size, _) = value.value();
            deltas.push((
                version.value(),
                (base, id, base_hash, target_hash, size, None),
            ));
        }
    }
    let mut table = txn.open_table(DELTA_TABLE).map_err(catalog)?;
    for (version, value) in deltas {
        table.insert(version, value).map_err(catalog)?;
    }
    Ok(())
}

pub(crate) const DELTA_TABLE: TableDefinition<u64, DeltaValue> = TableDefinition::new("deltas");
/// The deltas table before schema 3.
pub(crate) const UNSIGNED_DELTA_TABLE: TableDefinition<u64, UnsignedDeltaValue> =
    TableDefinition::new("deltas");
pub(crate) const SNAPSHOT_TABLE: TableDefinition<u64, SnapshotValue> =
    TableDefinition::new("snapshots");
/// version → (hash of the file, size in bytes), for each kind of [`TrainerData`]
const ROLLOUTS_TABLE: TableDefinition<u64, TrainerDataValue> = TableDefinition::new("rollouts");
const TRAINER_STATE_TABLE: TableDefinition<u64, TrainerDataValue> =
    TableDefinition::new("trainer_state");
/// (base version, target version) → (id, base hash, target hash, size in bytes)
pub(crate) const COMPOSED_TABLE: TableDefinition<(u64, u64), ComposedValue> =
    TableDefinition::new("composed");

/// Every entry of `table`, as `entry` makes it (a map key and a record), in key order.
fn read_all<K, V, M: Ord, R>(
    txn: &redb::ReadTransaction,
    table: TableDefinition<K, V>,
    entry: impl Fn(K::SelfType<'_>, V::SelfType<'_>) -> (M, R),
) -> Result<BTreeMap<M, R>>
where
    K: redb::Key + 'static,
    V: redb::Value + 'static,
{
    let table = txn.open_table(table).map_err(catalog)?;
    let mut records = BTreeMap::new();
    for item in table.iter().map_err(catalog)? {
        let (key, value) = item.map_err(catalog)?;
        let (key, record) = entry(key.value(), value.value());
        records.insert(key, record);
    }
    Ok(records)
}

/// The highest version in `table`: a lookup at the end of its key order, not a read of
/// the table.
fn last_version<V: redb::Value + 'static>(
    txn: &redb::ReadTransaction,
    table: TableDefinition<u64, V>,
) -> Result<Option<u64>> {
    let table = txn.open_table(table).map_err(catalog)?;
    Ok(table.last().map_err(catalog)?.map(|(key, _)| key.value()))
}

pub(crate) fn trainer_data_record(
    kind: TrainerData,
    version: u64,
    (hash, size_bytes): TrainerDataValue,
) -> TrainerDataRecord {
    TrainerDataRecord {
        kind,
        version,
        hash: Hash(hash),
        size_bytes,
    }
}

pub(crate) fn delta_value(r: &DeltaRecord) -> DeltaValue {
    (
        r.base_version,
        r.id.0,
        r.base_hash.0,
        r.target_hash.0,
        r.size_bytes,
        r.signature.map(|s| s.0),
    )
}

pub(crate) fn delta_record(version: u64, v: DeltaValue) -> DeltaRecord {
    DeltaRecord {
        version,
        base_version: v.0,
        id: Hash(v.1),
        base_hash: Hash(v.2),
        target_hash: Hash(v.3),
        size_bytes: v.4,
        signature: v.5.map(ArtifactSignature),
    }
}

pub(crate) fn composed_value(r: &ComposedRecord) -> ComposedValue {
    (r.id.0, r.base_hash.0, r.target_hash.0, r.size_bytes)
}

pub(crate) fn composed_record(
    (base_version, target_version): (u64, u64),
    v: ComposedValue,
) -> ComposedRecord {
    ComposedRecord {
        base_version,
        target_version,
        id: Hash(v.0),
        base_hash: Hash(v.1),
        target_hash: Hash(v.2),
        size_bytes: v.3,
    }
}

pub(crate) fn snapshot_value(r: &SnapshotRecord) -> SnapshotValue {
    (r.weights_hash.0, r.size_bytes)
}

pub(crate) fn snapshot_record(version: u64, v: SnapshotValue) -> SnapshotRecord {
    SnapshotRecord {
        version,
        weights_hash: Hash(v.0),
        size_bytes: v.1,
    }
}

pub(crate) fn get_delta(
    table: &impl ReadableTable<u64, DeltaValue>,
    version: u64,
) -> Result<Option<DeltaRecord>> {
    let value = table.get(version).map_err(catalog)?;
    Ok(value.map(|v| delta_record(version, v.value())))
}

pub(crate) fn get_snapshot(
    table: &impl ReadableTable<u64, SnapshotValue>,
    version: u64,
) -> Result<Option<SnapshotRecord>> {
    let value = table.get(version).map_err(catalog)?;
    Ok(value.map(|v| snapshot_record(version, v.value())))
}

/// The weights hash of `version` if the store knows it, as a delta's target or a snapshot.
pub(crate) fn known_weights(
    deltas: &impl ReadableTable<u64, DeltaValue>,
    snapshots: &impl ReadableTable<u64, SnapshotValue>,
    version: u64,
) -> Result<Option<Hash>> {
    if let Some(delta) = get_delta(deltas, version)? {
        return Ok(Some(delta.target_hash));
    }
    Ok(get_snapshot(snapshots, version)?.map(|s| s.weights_hash))
}

pub(crate) fn sizes(
    deltas: &BTreeMap<u64, DeltaRecord>,
    snapshots: &BTreeMap<u64, SnapshotRecord>,
) -> (BTreeMap<u64, u64>, BTreeMap<u64, u64>) {
    (
        deltas.iter().map(|(&v, d)| (v, d.size_bytes)).collect(),
        snapshots.iter().map(|(&v, s)| (v, s.size_bytes)).collect(),
    )
}

impl Store {
    /// The highest version the store holds, as a delta's target or a snapshot.
    pub fn latest_version(&self) -> Result<Option<u64>> {
        let txn = self.db.begin_read().map_err(catalog)?;
        Ok(last_version(&txn, DELTA_TABLE)?.max(last_version(&txn, SNAPSHOT_TABLE)?))
    }

    /// Every delta and snapshot record, by version.
    pub fn records(&self) -> Result<(BTreeMap<u64, DeltaRecord>, BTreeMap<u64, SnapshotRecord>)> {
        let txn = self.db.begin_read().map_err(catalog)?;
        Ok((
            read_all(&txn, DELTA_TABLE, |v, value| (v, delta_record(v, value)))?,
            read_all(&txn, SNAPSHOT_TABLE, |v, value| {
                (v, snapshot_record(v, value))
            })?,
        ))
    }

    /// The weights hash of every stored version: a delta's target, else a snapshot's.
    pub fn weights_hashes(&self) -> Result<BTreeMap<u64, Hash>> {
        let (deltas, snapshots) = self.records()?;
        Ok(snapshots
            .into_values()
            .map(|s| (s.version, s.weights_hash))
            .chain(deltas.into_values().map(|d| (d.version, d.target_hash)))
            .collect())
    }

    /// The record of the stored delta D(version), with the trainer's signature if it
    /// has one.
    pub fn delta_record(&self, version: u64) -> Result<DeltaRecord> {
        self.stored("delta", DELTA_TABLE, version, delta_record)
    }

    /// Every composed delta record, by (base version, target version).
    pub fn composed_records(&self) -> Result<BTreeMap<(u64, u64), ComposedRecord>> {
        let txn = self.db.begin_read().map_err(catalog)?;
        read_all(&txn, COMPOSED_TABLE, |key, value| {
            (key, composed_record(key, value))
        })
    }

    /// Every record of `kind`, by version.
    pub fn trainer_data_records(
        &self,
        kind: TrainerData,
    ) -> Result<BTreeMap<u64, TrainerDataRecord>> {
        let txn = self.db.begin_read().map_err(catalog)?;
        read_all(&txn, kind.table(), |v, value| {
            (v, trainer_data_record(kind, v, value))
        })
    }

    /// The record of the stored composed delta C(base -> target), if there is one.
    pub fn composed_record(&self, base: u64, target: u64) -> Result<Option<ComposedRecord>> {
        self.lookup(COMPOSED_TABLE, (base, target), |value| {
            composed_record((base, target), value)
        })
    }

    /// The record of `version` in `table` (of artifacts of `kind`), or `NotFound`.
    pub(crate) fn stored<V: redb::Value + 'static, R>(
        &self,
        kind: &'static str,
        table: TableDefinition<u64, V>,
        version: u64,
        record: impl FnOnce(u64, V::SelfType<'_>) -> R,
    ) -> Result<R> {
        self.lookup(table, version, |value| record(version, value))?
            .ok_or(StoreError::NotFound { kind, version })
    }

    /// What `record` makes of the value under `key` in `table`, if there is one: a
    /// keyed read, not a read of the whole table.
    fn lookup<K, V, R>(
        &self,
        table: TableDefinition<K, V>,
        key: K,
        record: impl FnOnce(V::SelfType<'_>) -> R,
    ) -> Result<Option<R>>
    where
        K: redb::Key + std::borrow::Borrow<K::SelfType<'static>> + 'static,
        V: redb::Value + 'static,
    {
        let txn = self.db.begin_read().map_err(catalog)?;
        let table = txn.open_table(table).map_err(catalog)?;
        Ok(table
            .get(key)
            .map_err(catalog)?
            .map(|value| record(value.value())))
    }
}
