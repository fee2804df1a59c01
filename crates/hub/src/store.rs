//! The hub's durable state: the serialized [`ControlPlane`], the payloads of accepted
//! rollouts and the hashes of actor tokens, in one redb database.
//!
//! Tables:
//!
//! * `control_state: u64 -> &[u8]`: the core's snapshot (serde_json text) under key
//!   [`STATE_KEY`].
//! * `rollouts: (step, prompt) -> (actor, payload)`: the payload (JSON text) of each
//!   accepted result, written in the same transaction as the acceptance. A step's
//!   payloads stay until the next step opens (in that transaction), so a trainer that
//!   stopped between taking a step and opening the next can read them again.
//! * `actor_tokens: actor -> hash`: the BLAKE3 hash of each member's current token.
//!
//! Every change is one write transaction committed with redb's default durability
//! (fsync before `commit` returns), so a reader after a crash sees the state before
//! the change or after it, never a torn one, and never an acceptance without its
//! payload.

use std::collections::BTreeMap;
use std::path::Path;

use aurora_control::{ActorId, ControlPlane, PromptId, RestoreError, Snapshot, StepId};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde_json::value::RawValue;
use thiserror::Error;

/// The table holding the snapshot.
const STATE: TableDefinition<u64, &[u8]> = TableDefinition::new("control_state");
/// The snapshot's key: there is one state per database.
const STATE_KEY: u64 = 0;
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
    /// The core could not be serialized (a bug: its state is plain data).
    #[error("serializing the state: {0}")]
    Encode(#[from] serde_json::Error),
}

/// The stored state could not be read.
#[derive(Debug, Error)]
pub enum LoadError {
    /// The database file could not be opened or read.
    #[error("state database: {0}")]
    Database(#[from] redb::Error),
    /// The stored bytes are not a snapshot.
    #[error("stored state is not a valid snapshot: {0}")]
    Corrupt(#[source] serde_json::Error),
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

/// What [`StateStore::open`] found.
pub(crate) struct Stored {
    /// The core's snapshot, if one was saved (still to be restored and checked).
    pub(crate) snapshot: Option<Snapshot>,
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
        let store = StateStore { db };
        let txn = store.db.begin_read().map_err(redb::Error::from)?;
        let snapshot = match open_if_exists(&txn, STATE)? {
            None => None,
            Some(table) => match table.get(STATE_KEY).map_err(redb::Error::from)? {
                None => None,
                Some(bytes) => {
                    Some(serde_json::from_slice(bytes.value()).map_err(LoadError::Corrupt)?)
                }
            },
        };
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
        Ok((store, Stored { snapshot, tokens }))
    }

    /// Writes `core` and `changes` in one transaction: when this returns `Ok`, a crash
    /// cannot lose them.
    pub(crate) fn commit(
        &self,
        core: &ControlPlane,
        changes: &Changes<'_>,
    ) -> Result<(), PersistError> {
        let bytes = serde_json::to_vec(core)?;
        let txn = self.db.begin_write().map_err(redb::Error::from)?;
        {
            let mut state = txn.open_table(STATE).map_err(redb::Error::from)?;
            state
                .insert(STATE_KEY, bytes.as_slice())
                .map_err(redb::Error::from)?;
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
