//! The catch-up plans the store offers: the catalog's sizes fed to the pure
//! [`plan::choose`](crate::plan), after the checks that need the catalog.

use crate::catalog::{ComposedRecord, sizes};
use crate::{Plan, Result, Store, StoreError, plan};

/// A composed delta built to plan, not stored: its record-to-be and bytes.
type BuiltComposed = (ComposedRecord, Vec<u8>);

impl Store {
    /// The cheapest way by bytes for an Actor at `actor_version` to reach the latest
    /// version (see the catch-up rule in the crate docs). A composed delta counts only
    /// if it is already stored: this is a cheap read; [`Store::composed_catch_up_plan`]
    /// builds one.
    pub fn catch_up_plan(&self, actor_version: u64) -> Result<Plan> {
        let Some(target) = self.latest_version()? else {
            return Err(StoreError::ActorAhead {
                actor: actor_version,
                latest: None,
            });
        };
        let composed = self
            .composed_record(actor_version, target)?
            .map(|c| c.size_bytes);
        self.plan_to(actor_version, target, composed, true)
    }

    /// The cheapest way by bytes for an Actor that holds the weights of `actor_version`
    /// to reach `target` (the version a hub serves, which a newer put may have passed)
    /// over the wire: replaying the deltas or one composed delta. Snapshots are left
    /// out, since the wire serves them only to peers joining without weights (a smaller
    /// snapshot must not turn down a composed delta that beats replaying). Builds the
    /// composed delta first when the Actor is at least two versions behind and none is
    /// stored, so its size is known (a decode of the chain); it is not kept.
    pub fn composed_catch_up_plan(&self, actor_version: u64, target: u64) -> Result<Plan> {
        Ok(self.plan_with_composed(actor_version, target)?.0)
    }

    /// [`Store::composed_catch_up_plan`] and, when it chooses the composed delta, its
    /// bytes, verified: those the plan has just built, or else read from the cache. A
    /// composed delta is stored only where the plan chose it, and only to the latest
    /// version: one built to learn that replaying costs less leaves nothing behind.
    pub fn composed_catch_up(
        &self,
        actor_version: u64,
        target: u64,
    ) -> Result<(Plan, Option<Vec<u8>>)> {
        let (plan, built) = self.plan_with_composed(actor_version, target)?;
        let bytes = match (&plan, built) {
            (Plan::Composed { .. }, Some((record, bytes))) => self.keep_composed(record, bytes)?.1,
            (Plan::Composed { .. }, None) => Some(self.composed_artifact(actor_version, target)?),
            _ => None,
        };
        Ok((plan, bytes))
    }

    /// The plan, and the composed delta's record and bytes if it was built (not
    /// stored) to plan.
    fn plan_with_composed(
        &self,
        actor_version: u64,
        target: u64,
    ) -> Result<(Plan, Option<BuiltComposed>)> {
        let stored = self.composed_record(actor_version, target)?;
        let (composed, built) = if let Some(record) = stored {
            (Some(record.size_bytes), None)
        } else if actor_version + 2 <= target {
            match self.composed_unstored(actor_version, target) {
                Ok((record, bytes)) => (Some(record.size_bytes), Some((record, bytes))),
                // No snapshot and chain rebuild the base: the other plans decide. (A
                // target the store lacks is reported by `plan_to`.)
                Err(StoreError::NoRoute { .. } | StoreError::NoComposed { .. }) => (None, None),
                Err(error) => return Err(error),
            }
        } else {
            (None, None)
        };
        Ok((self.plan_to(actor_version, target, composed, false)?, built))
    }

    /// [`plan::choose`] over the catalog's sizes (snapshots only `with_snapshots`), after
    /// checking that the Actor is not past `target` and `target` is stored.
    fn plan_to(
        &self,
        actor_version: u64,
        target: u64,
        composed: Option<u64>,
        with_snapshots: bool,
    ) -> Result<Plan> {
        let (deltas, snapshots) = self.records()?;
        let latest = deltas.keys().chain(snapshots.keys()).max().copied();
        if latest.is_none_or(|latest| target > latest) {
            return Err(StoreError::NotFound {
                kind: "version",
                version: target,
            });
        }
        if actor_version > target {
            return Err(StoreError::ActorAhead {
                actor: actor_version,
                latest: Some(target),
            });
        }
        let (delta_sizes, mut snapshot_sizes) = sizes(&deltas, &snapshots);
        if !with_snapshots {
            snapshot_sizes.clear();
        }
        plan::choose(
            actor_version,
            target,
            &delta_sizes,
            &snapshot_sizes,
            composed,
        )
        .ok_or(StoreError::NoRoute {
            actor: actor_version,
            latest: target,
        })
    }
}
