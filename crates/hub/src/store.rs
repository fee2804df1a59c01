//! The hub's durable state: one serialized [`ControlPlane`] in a redb database.
//!
//! One table, `control_state: u64 -> &[u8]`, holds the snapshot (serde_json text of
//! the core) under key [`STATE_KEY`]. Every save is one write transaction committed
//! with redb's default durability (fsync before `commit` returns), so a reader after a
//! crash sees the previous snapshot or the new one, never a torn one.

use std::path::Path;

use aurora_control::{ControlPlane, Millis, RestoreError, Snapshot};
use redb::{Database, ReadableDatabase, TableDefinition};
use thiserror::Error;

/// The table holding the snapshot.
const STATE: TableDefinition<u64, &[u8]> = TableDefinition::new("control_state");
/// The snapshot's key: there is one state per database.
const STATE_KEY: u64 = 0;

/// A snapshot could not be written; the call that produced it was not acknowledged.
#[derive(Debug, Error)]
pub enum PersistError {
    /// The database refused the write.
    #[error("state database: {0}")]
    Database(#[from] redb::Error),
    /// The core could not be serialized (a bug: its state is plain data).
    #[error("serializing the state: {0}")]
    Encode(#[from] serde_json::Error),
}

/// The stored state could not be opened.
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
}

/// The open database.
pub(crate) struct StateStore {
    db: Database,
}

impl StateStore {
    /// Opens (creating if needed) the database at `path`, and restores the core it
    /// holds, if any. redb locks the file, so two hubs can never share one state.
    pub(crate) fn open(path: &Path) -> Result<(StateStore, Option<ControlPlane>), LoadError> {
        let db = Database::create(path).map_err(redb::Error::from)?;
        let store = StateStore { db };
        let core = match store.load()? {
            None => None,
            Some(bytes) => {
                let snapshot: Snapshot =
                    serde_json::from_slice(&bytes).map_err(LoadError::Corrupt)?;
                // The hub's new clock starts at the stored clock (see `Hub::open`), so
                // restoring "at the beginning of time" means "at the stored clock".
                Some(ControlPlane::restore(snapshot, Millis(0))?)
            }
        };
        Ok((store, core))
    }

    fn load(&self) -> Result<Option<Vec<u8>>, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = match txn.open_table(STATE) {
            Ok(table) => table,
            // Nothing was ever saved: a fresh hub.
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(error) => return Err(error.into()),
        };
        Ok(table.get(STATE_KEY)?.map(|value| value.value().to_vec()))
    }

    /// Writes `core` durably: when this returns `Ok`, a crash cannot lose it.
    pub(crate) fn save(&self, core: &ControlPlane) -> Result<(), PersistError> {
        let bytes = serde_json::to_vec(core)?;
        let txn = self.db.begin_write().map_err(redb::Error::from)?;
        {
            let mut table = txn.open_table(STATE).map_err(redb::Error::from)?;
            table
                .insert(STATE_KEY, bytes.as_slice())
                .map_err(redb::Error::from)?;
        }
        txn.commit().map_err(redb::Error::from)?;
        Ok(())
    }
}
