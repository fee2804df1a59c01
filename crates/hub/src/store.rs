//! The hub's durable state, in one redb database: a checkpoint of the core, the
//! journal of the calls made since, the payloads of accepted rollouts and the hashes
//! of actor tokens.
//!
//! Tables:
//!
//! * `control_state: u64 -> &[u8]`: the checkpoint, a single entry: the core's
//!   snapshot (serde_json text), keyed by the sequence number of the first journal
//!   record it does not include.
//! * `journal: u64 -> &[u8]`: the calls made since the checkpoint, by sequence number,
//!   each a [`Record`] (serde_json text): the command and the time it ran at. The
//!   sequence numbers run on from the checkpoint's key without a gap.
//! * `rollouts: (step, prompt) -> (actor, payload)`: the payload (JSON text) of each
//!   accepted result, written in the same transaction as the record of the call that
//!   accepted it. A step's payloads stay until the next step opens (in that
//!   transaction), so a trainer that stopped between taking a step and opening the
//!   next can read them again.
//! * `actor_tokens: actor -> hash`: the BLAKE3 hash of each member's current token.
//!
//! Every call is one write transaction, so a reader after a crash sees the state before
//! the call or after it, never a torn one, and never an acceptance without its
//! payload. The transaction holds the call's record, the payloads it accepted and the
//! tokens it issued or revoked: what the call changed, not the whole state. A call
//! that must survive a crash is committed with redb's default durability (fsync before
//! `commit` returns); one that need not ([`crate::journal`] says which) without it,
//! and redb then persists it with the next durable commit, in order: a crash loses at
//! most the non-durable commits after the last durable one, never one before it.
//!
//! # Checkpoints
//!
//! When the records since the checkpoint would reach the checkpoint's own size, the
//! transaction writes a new checkpoint (the state after the call, which then needs no
//! record) and empties the journal instead. Whole-state writes therefore never cost
//! more bytes than the records they retire (at most twice the bytes of the records
//! alone, amortized, whatever the size of the state), and a restart replays at most
//! about one checkpoint's worth of records. The rule has no setting to tune: a small
//! state is checkpointed often because it is cheap, a large one rarely.

use std::collections::BTreeMap;
use std::path::Path;

use aurora_control::{ActorId, ControlPlane, PromptId, RestoreError, Snapshot, StepId};
use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
};
use serde_json::value::RawValue;
use thiserror::Error;

use crate::journal::Record;

/// The checkpoint, keyed by the sequence number of the first record it does not
/// include.
/// The database's layout: its tables and the encodings of what they hold. A change to
/// either takes a new number; a database of another number is refused, never misread.
pub const SCHEMA_VERSION: u32 = 1;
const SCHEMA: TableDefinition<&str, u32> = TableDefinition::new("schema");

/// Stamps a new database with [`SCHEMA_VERSION`] and refuses one of another version. A
/// database from before the stamp has this version's layout and is stamped.
fn check_schema(db: &Database) -> Result<(), LoadError> {
    let txn = db.begin_write().map_err(redb::Error::from)?;
    {
        let mut table = txn.open_table(SCHEMA).map_err(redb::Error::from)?;
        let found = table
            .get("version")
            .map_err(redb::Error::from)?
            .map(|v| v.value());
        match found {
            None => {
                table
                    .insert("version", SCHEMA_VERSION)
                    .map_err(redb::Error::from)?;
            }
            Some(SCHEMA_VERSION) => {}
            Some(found) => {
                return Err(LoadError::Schema {
                    found,
                    supported: SCHEMA_VERSION,
                });
            }
        }
    }
    txn.commit().map_err(redb::Error::from)?;
    Ok(())
}

const STATE: TableDefinition<u64, &[u8]> = TableDefinition::new("control_state");
/// The records since the checkpoint, by sequence number.
const JOURNAL: TableDefinition<u64, &[u8]> = TableDefinition::new("journal");
/// Accepted payloads by (step, prompt), with the actor that generated them.
const ROLLOUTS: TableDefinition<(u64, u64), (u64, &[u8])> = TableDefinition::new("rollouts");
/// Token hashes by actor.
const ACTOR_TOKENS: TableDefinition<u64, &[u8]> = TableDefinition::new("actor_tokens");

/// A change could not be written; the call that produced it was not acknowledged.
#[derive(Debug, Error)]
pub enum PersistError {
    /// The database refused the write.
    #[error("state database: {0}")]
    Database(#[from] redb::Error),
    /// The core or a record could not be serialized (a bug: both are plain data).
    #[error("serializing the state or a journal record: {0}")]
    Encode(#[from] serde_json::Error),
    /// The journal's sequence numbers have run out (only a corrupt checkpoint key
    /// can bring them near the end).
    #[error("the journal's sequence numbers are exhausted")]
    SequenceExhausted,
}

/// The stored state could not be read.
#[derive(Debug, Error)]
pub enum LoadError {
    /// The database file could not be opened or read.
    #[error("state database: {0}")]
    Database(#[from] redb::Error),
    /// The database has another schema version than this build's.
    #[error(
        "the state database has schema version {found}, and this build reads version {supported} only: {}",
        if *found > *supported { "it was written by a newer aurora" } else { "it is not one aurora wrote" }
    )]
    Schema {
        /// The database's version.
        found: u32,
        /// This build's.
        supported: u32,
    },
    /// The stored bytes are not a snapshot.
    #[error("stored state is not a valid snapshot: {0}")]
    Corrupt(#[source] serde_json::Error),
    /// The state table holds more than one checkpoint.
    #[error("the state table holds {0} checkpoints, not one")]
    Checkpoints(u64),
    /// A journal record is not a valid call.
    #[error("journal record {seq} is not a valid call: {source}")]
    CorruptRecord {
        /// Its sequence number.
        seq: u64,
        /// What the parser said.
        source: serde_json::Error,
    },
    /// The journal's sequence numbers do not run on from the checkpoint without a
    /// gap: a record is missing, or one is left from before the checkpoint.
    #[error("journal record {found} where record {expected} was expected")]
    JournalGap {
        /// The sequence number that should come next.
        expected: u64,
        /// The one found.
        found: u64,
    },
    /// The journal holds records but there is no checkpoint to replay them on.
    #[error("the journal starts at record {0} but there is no checkpoint")]
    NoCheckpoint(u64),
    /// The stored snapshot breaks an invariant of the core.
    #[error("stored state refused: {0}")]
    Restore(#[from] RestoreError),
    /// A stored token hash is not 32 bytes.
    #[error("stored token hash of {0} is {1} bytes, not 32")]
    CorruptToken(ActorId, usize),
    /// The stored payloads of a step are not exactly its accepted results.
    #[error("the stored payloads of {step} disagree with its accepted results at {prompt}")]
    RolloutsMismatch {
        /// The step.
        step: StepId,
        /// The first prompt at which they differ.
        prompt: PromptId,
    },
    /// A stored payload is not JSON.
    #[error("stored payload of {prompt} in {step} is not JSON: {source}")]
    CorruptPayload {
        /// Its step.
        step: StepId,
        /// Its prompt.
        prompt: PromptId,
        /// What the parser said.
        source: serde_json::Error,
    },
}

/// An accepted result's rollout, as the trainer gets it.
#[derive(Clone, Debug)]
pub struct AcceptedRollout {
    /// Its prompt.
    pub prompt: PromptId,
    /// The actor that generated it.
    pub actor: ActorId,
    /// The payload exactly as the actor sent it: any JSON value.
    pub payload: Box<RawValue>,
}

/// What one call changes besides the core, committed with it.
#[derive(Debug, Default)]
pub(crate) struct Changes<'a> {
    /// Payloads of results accepted by the call.
    pub(crate) accepted: Vec<(StepId, PromptId, ActorId, &'a RawValue)>,
    /// A token issued by the call (a registration).
    pub(crate) issued_token: Option<(ActorId, blake3::Hash)>,
    /// Tokens of actors that are no longer members.
    pub(crate) revoked_tokens: Vec<ActorId>,
    /// Set when a step opens: payloads of earlier steps are dropped.
    pub(crate) drop_rollouts_before: Option<StepId>,
}

/// Where the journal stands; kept with the live core, under the hub's lock, and
/// advanced only by a successful commit.
#[derive(Debug, Default)]
pub(crate) struct Journal {
    /// The sequence number of the next call.
    next: u64,
    /// Bytes of the records since the checkpoint.
    bytes: u64,
    /// Bytes of the checkpoint; zero before the first, so the first call writes one.
    checkpoint_bytes: u64,
}

/// What [`StateStore::open`] found.
pub(crate) struct Stored {
    /// The checkpoint's snapshot, if one was saved (still to be checked).
    pub(crate) snapshot: Option<Snapshot>,
    /// The records since the checkpoint, in order, to replay on it.
    pub(crate) records: Vec<Record>,
    /// Where the journal stands after them.
    pub(crate) journal: Journal,
    /// Token hashes by actor.
    pub(crate) tokens: BTreeMap<ActorId, blake3::Hash>,
}

/// The open database.
pub(crate) struct StateStore {
    db: Database,
}

impl StateStore {
    /// Opens (creating if needed) the database at `path` and reads what it holds.
    /// redb locks the file, so two hubs can never share one state.
    pub(crate) fn open(path: &Path) -> Result<(StateStore, Stored), LoadError> {
        let db = Database::create(path).map_err(redb::Error::from)?;
        check_schema(&db)?;
        let store = StateStore { db };
        let txn = store.db.begin_read().map_err(redb::Error::from)?;
        let mut journal = Journal::default();
        let mut snapshot = None;
        if let Some(table) = open_if_exists(&txn, STATE)? {
            let count = table.len().map_err(redb::Error::from)?;
            if count > 1 {
                return Err(LoadError::Checkpoints(count));
            }
            if let Some((next, bytes)) = table.first().map_err(redb::Error::from)? {
                let bytes = bytes.value();
                snapshot = Some(serde_json::from_slice(bytes).map_err(LoadError::Corrupt)?);
                journal.next = next.value();
                journal.checkpoint_bytes = byte_count(bytes);
            }
        }
        let mut records = Vec::new();
        if let Some(table) = open_if_exists(&txn, JOURNAL)? {
            for entry in table.iter().map_err(redb::Error::from)? {
                let (seq, bytes) = entry.map_err(redb::Error::from)?;
                let (seq, bytes) = (seq.value(), bytes.value());
                if snapshot.is_none() {
                    return Err(LoadError::NoCheckpoint(seq));
                }
                if seq != journal.next {
                    return Err(LoadError::JournalGap {
                        expected: journal.next,
                        found: seq,
                    });
                }
                let record = serde_json::from_slice(bytes)
                    .map_err(|source| LoadError::CorruptRecord { seq, source })?;
                records.push(record);
                // Keys are unique, so a saturated `next` meets no further record;
                // the next commit then refuses to go on (`SequenceExhausted`).
                journal.next = journal.next.saturating_add(1);
                journal.bytes = journal.bytes.saturating_add(byte_count(bytes));
            }
        }
        let mut tokens = BTreeMap::new();
        if let Some(table) = open_if_exists(&txn, ACTOR_TOKENS)? {
            for entry in table.iter().map_err(redb::Error::from)? {
                let (actor, hash) = entry.map_err(redb::Error::from)?;
                let actor = ActorId(actor.value());
                let hash = <[u8; 32]>::try_from(hash.value())
                    .map_err(|_| LoadError::CorruptToken(actor, hash.value().len()))?;
                tokens.insert(actor, blake3::Hash::from_bytes(hash));
            }
        }
        drop(txn);
        let stored = Stored {
            snapshot,
            records,
            journal,
            tokens,
        };
        Ok((store, stored))
    }

    /// Saves one call in one transaction: its `record` (or, when the journal has
    /// grown to the checkpoint's size, a checkpoint of `core`, the state after the
    /// call) and its `changes`. When this returns `Ok` and the call was `durable`, a
    /// crash cannot lose them; otherwise they are on disk once a later durable call
    /// returns.
    pub(crate) fn commit(
        &self,
        journal: &mut Journal,
        core: &ControlPlane,
        record: &Record,
        changes: &Changes<'_>,
        durable: bool,
    ) -> Result<(), PersistError> {
        let record = serde_json::to_vec(record)?;
        let seq = journal.next;
        let next = seq.checked_add(1).ok_or(PersistError::SequenceExhausted)?;
        let journal_bytes = journal.bytes.saturating_add(byte_count(&record));
        let checkpoint = if journal_bytes >= journal.checkpoint_bytes {
            Some(serde_json::to_vec(core)?)
        } else {
            None
        };
        let mut txn = self.db.begin_write().map_err(redb::Error::from)?;
        if !durable {
            // Refused only after a persistent savepoint changed in the transaction,
            // and the hub makes none.
            txn.set_durability(Durability::None)
                .map_err(redb::Error::from)?;
        }
        {
            let mut records = txn.open_table(JOURNAL).map_err(redb::Error::from)?;
            match &checkpoint {
                Some(state) => {
                    let mut checkpoints = txn.open_table(STATE).map_err(redb::Error::from)?;
                    checkpoints
                        .retain(|_, _| false)
                        .map_err(redb::Error::from)?;
                    // The checkpoint includes this call: the journal restarts after it.
                    checkpoints
                        .insert(next, state.as_slice())
                        .map_err(redb::Error::from)?;
                    records.retain(|_, _| false).map_err(redb::Error::from)?;
                }
                None => {
                    records
                        .insert(seq, record.as_slice())
                        .map_err(redb::Error::from)?;
                }
            }
            let mut rollouts = txn.open_table(ROLLOUTS).map_err(redb::Error::from)?;
            if let Some(step) = changes.drop_rollouts_before {
                rollouts
                    .retain_in(..(step.0, 0), |_, _| false)
                    .map_err(redb::Error::from)?;
            }
            for (step, prompt, actor, payload) in &changes.accepted {
                rollouts
                    .insert((step.0, prompt.0), (actor.0, payload.get().as_bytes()))
                    .map_err(redb::Error::from)?;
            }
            let mut tokens = txn.open_table(ACTOR_TOKENS).map_err(redb::Error::from)?;
            for actor in &changes.revoked_tokens {
                tokens.remove(actor.0).map_err(redb::Error::from)?;
            }
            if let Some((actor, hash)) = &changes.issued_token {
                tokens
                    .insert(actor.0, hash.as_bytes().as_slice())
                    .map_err(redb::Error::from)?;
            }
        }
        txn.commit().map_err(redb::Error::from)?;
        journal.next = next;
        match checkpoint {
            Some(state) => {
                journal.bytes = 0;
                journal.checkpoint_bytes = byte_count(&state);
            }
            None => journal.bytes = journal_bytes,
        }
        Ok(())
    }

    /// The stored payloads of `step`, by prompt id.
    pub(crate) fn rollouts(&self, step: StepId) -> Result<Vec<AcceptedRollout>, LoadError> {
        let txn = self.db.begin_read().map_err(redb::Error::from)?;
        let Some(table) = open_if_exists(&txn, ROLLOUTS)? else {
            return Ok(Vec::new());
        };
        let mut rollouts = Vec::new();
        let range = table
            .range((step.0, 0)..=(step.0, u64::MAX))
            .map_err(redb::Error::from)?;
        for entry in range {
            let (key, value) = entry.map_err(redb::Error::from)?;
            let prompt = PromptId(key.value().1);
            let (actor, payload) = value.value();
            let payload = String::from_utf8(payload.to_vec())
                .map_err(<serde_json::Error as serde::de::Error>::custom)
                .and_then(RawValue::from_string)
                .map_err(|source| LoadError::CorruptPayload {
                    step,
                    prompt,
                    source,
                })?;
            rollouts.push(AcceptedRollout {
                prompt,
                actor: ActorId(actor),
                payload,
            });
        }
        Ok(rollouts)
    }
}

/// Opens a table for reading; `None` if nothing was ever written to it.
fn open_if_exists<K: redb::Key + 'static, V: redb::Value + 'static>(
    txn: &redb::ReadTransaction,
    table: TableDefinition<K, V>,
) -> Result<Option<redb::ReadOnlyTable<K, V>>, LoadError> {
    match txn.open_table(table) {
        Ok(table) => Ok(Some(table)),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
        Err(error) => Err(LoadError::Database(error.into())),
    }
}

/// A length as the journal counts bytes.
fn byte_count(bytes: &[u8]) -> u64 {
    u64::try_from(bytes.len()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_of_another_schema_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hub.redb");
        drop(StateStore::open(&path).unwrap());
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(SCHEMA)
                .unwrap()
                .insert("version", SCHEMA_VERSION + 1)
                .unwrap();
            txn.commit().unwrap();
        }
        let error = StateStore::open(&path).err().expect("refused").to_string();
        assert!(
            error.contains("schema version 2") && error.contains("newer aurora"),
            "{error}"
        );
    }
}
