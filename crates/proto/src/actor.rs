//! Staging and activation (docs/wire-protocol.md §7): which verified delta to stage,
//! when to activate it, and what to do with one that does not fit.
//!
//! Sans-IO and free of weights: the driver does the work each [`ActorAction`] names
//! (decoding a delta against its weights, waiting for the engine's safe point, applying
//! the staged patch) and reports the outcome. The rules:
//! - only the delta whose base is the active version, with the active weights hash, is
//!   staged; any other is refused, reported upstream, and the chain is fetched again
//!   from the active version (catch-up);
//! - a staged version is activated once a Commit covers it, at the engine's next safe
//!   point, so rollouts never see a mix of versions;
//! - versions activate one after another, never skipping one, except through a
//!   composed delta ([`ActorCore::composed`]): one delta from the active version straight
//!   to a later one, staged and activated like the next delta;
//! - an actor that joins with no weights ([`ActorCore::joining`]) stages its snapshot
//!   first and activates it at once: its engine has nothing to run before it.

use std::collections::{BTreeMap, VecDeque};

use aurora_delta::{DeltaHeader, Hash};

use crate::EffectError;
use crate::frame::{ArtifactKind, VersionRef};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActorAction {
    /// Decode the delta of `version` against the active weights into a patch, then
    /// report [`ActorCore::staged`].
    Stage { version: u64 },
    /// Ask the engine for its next safe point and report [`ActorCore::safe_point`].
    AwaitSafePoint,
    /// Apply the staged patch of `version` (the engine is paused at its safe point, or
    /// not running yet), check the target hash, hand the weights to the engine, then
    /// report [`ActorCore::activated`].
    Activate { version: u64 },
    /// Forget the artifact of `version` (refused, or older than the active version).
    Discard { version: u64 },
    /// Fetch the chain again from `version` on (after a refusal).
    Rewind { version: u64 },
    /// Fetch a snapshot again, from another upstream (a joining actor refused its
    /// snapshot, or an actor lost its weights), for `reason`.
    Rejoin { reason: String },
    /// Tell the upstream where this actor stands.
    Report { note: String },
}

/// Where an actor stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActorStatus {
    /// None while an actor that joined with no weights has not activated its snapshot.
    pub active: Option<VersionRef>,
    pub staged: Option<u64>,
    pub committed: Option<u64>,
}

struct Pending {
    base: VersionRef,
    target_hash: Hash,
    kind: ArtifactKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Idle,
    Staging(u64),
    Staged(u64),
    /// Waiting for the safe point, then activating.
    Activating(u64),
}

pub struct ActorCore {
    /// None until a joining actor's snapshot is active.
    active: Option<VersionRef>,
    verified: BTreeMap<u64, Pending>,
    stage: Stage,
    committed: Option<VersionRef>,
    safe_point_requested: bool,
    actions: VecDeque<ActorAction>,
    /// Refusals in a row: a chain that keeps failing is reported, not retried forever.
    refusals: u32,
}

/// Refusals in a row after which the actor stops rewinding: its weights and the
/// upstream's chain disagree, which replaying deltas cannot fix.
pub const MAX_REFUSALS: u32 = 3;

impl ActorCore {
    pub fn new(active: VersionRef) -> ActorCore {
        ActorCore::starting(Some(active))
    }

    /// An actor with no weights: it waits for a snapshot ([`ActorCore::snapshot`]).
    pub fn joining() -> ActorCore {
        ActorCore::starting(None)
    }

    fn starting(active: Option<VersionRef>) -> ActorCore {
        ActorCore {
            active,
            verified: BTreeMap::new(),
            stage: Stage::Idle,
            committed: None,
            safe_point_requested: false,
            actions: VecDeque::new(),
            refusals: 0,
        }
    }

    pub fn status(&self) -> ActorStatus {
        ActorStatus {
            active: self.active,
            staged: match self.stage {
                Stage::Staged(v) | Stage::Activating(v) => Some(v),
                _ => None,
            },
            committed: self.committed.map(|c| c.version),
        }
    }

    /// Whether the actor gave up on its upstream's chain ([`MAX_REFUSALS`] in a row).
    pub fn diverged(&self) -> bool {
        self.refusals >= MAX_REFUSALS
    }

    pub fn poll_action(&mut self) -> Option<ActorAction> {
        self.actions.pop_front()
    }

    /// A verified delta, or composed delta (the receiver checked that it starts from the
    /// version before the one it expected next), arrived: staged once its base is the
    /// active version.
    pub fn delta(&mut self, kind: ArtifactKind, header: &DeltaHeader) {
        debug_assert_ne!(kind, ArtifactKind::Snapshot, "snapshots come by `snapshot`");
        let stale = self
            .active
            .is_some_and(|a| header.target_version <= a.version);
        self.receive(header, kind, stale);
    }

    /// A verified snapshot arrived (its header checked by the receiver). Only an actor
    /// with no weights has a use for it.
    pub fn snapshot(&mut self, header: &DeltaHeader) {
        self.receive(header, ArtifactKind::Snapshot, self.active.is_some());
    }

    fn receive(&mut self, header: &DeltaHeader, kind: ArtifactKind, discard: bool) {
        let version = header.target_version;
        if discard {
            self.actions.push_back(ActorAction::Discard { version });
            return;
        }
        self.verified.insert(
            version,
            Pending {
                base: VersionRef {
                    version: header.base_version,
                    hash: header.base_hash,
                },
                target_hash: header.target_hash,
                kind,
            },
        );
        self.advance();
    }

    pub fn commit(&mut self, commit: VersionRef) {
        if self.committed.is_some_and(|c| c.version >= commit.version) {
            return;
        }
        self.committed = Some(commit);
        if let Some(active) = self.active
            && commit.version > active.version
            && self.verified.is_empty()
        {
            // Behind with nothing on the way: say so, the upstream's status shows it.
            self.actions.push_back(ActorAction::Report {
                note: format!(
                    "committed version {} but active is {} with nothing staged",
                    commit.version, active.version
                ),
            });
        }
        self.advance();
    }

    /// The driver staged `version` (or could not).
    pub fn staged(&mut self, version: u64, outcome: Result<(), EffectError>) {
        if self.stage != Stage::Staging(version) {
            return;
        }
        match outcome {
            Ok(()) => self.stage = Stage::Staged(version),
            Err(reason) => {
                self.stage = Stage::Idle;
                self.refuse(version, format!("staging failed: {reason}"));
            }
        }
        self.advance();
    }

    /// The engine reached its safe point and is paused there.
    pub fn safe_point(&mut self) {
        self.safe_point_requested = false;
        if let Stage::Staged(version) = self.stage {
            self.stage = Stage::Activating(version);
            self.actions.push_back(ActorAction::Activate { version });
        }
    }

    /// The driver applied (or failed to apply) the staged patch of `version`; on
    /// failure its weights are unchanged.
    pub fn activated(&mut self, version: u64, outcome: Result<Hash, EffectError>) {
        if self.stage != Stage::Activating(version) {
            return;
        }
        self.stage = Stage::Idle;
        let expected = self.verified.remove(&version).map(|p| p.target_hash);
        match outcome {
            Ok(hash) if expected.is_none_or(|e| e == hash) => {
                self.active = Some(VersionRef { version, hash });
                self.refusals = 0;
                // A snapshot or a composed delta lands ahead of anything older still
                // queued.
                let behind: Vec<u64> = self.verified.range(..version).map(|(v, _)| *v).collect();
                for old in behind {
                    self.verified.remove(&old);
                    self.actions
                        .push_back(ActorAction::Discard { version: old });
                }
                self.actions.push_back(ActorAction::Discard { version });
                self.actions.push_back(ActorAction::Report {
                    note: format!("activated version {version}"),
                });
            }
            Ok(hash) => self.refuse(
                version,
                format!("activation produced weights {hash}, not the artifact's target"),
            ),
            Err(reason) => {
                // Weights that are no version's hold nothing to build on: only a
                // snapshot starts the actor again. The failure is this node's, not its
                // upstream's chain, so it does not count towards giving up on the
                // upstream, which would leave no rejoin.
                if reason.lost_weights() {
                    self.active = None;
                    self.refusals = 0;
                }
                self.refuse(version, format!("activation failed: {reason}"));
            }
        }
        self.advance();
    }

    fn refuse(&mut self, version: u64, reason: String) {
        tracing::warn!(
            version,
            active = ?self.active.map(|a| a.version),
            reason,
            "refusing an artifact"
        );
        self.refusals += 1;
        let mut discarded: Vec<u64> = self.verified.keys().copied().collect();
        if !discarded.contains(&version) {
            discarded.push(version);
        }
        self.verified.clear();
        for v in discarded {
            self.actions.push_back(ActorAction::Discard { version: v });
        }
        self.actions.push_back(ActorAction::Report {
            note: format!("refused version {version}: {reason}"),
        });
        if !self.diverged() {
            self.actions.push_back(match self.active {
                Some(active) => ActorAction::Rewind {
                    version: active.version + 1,
                },
                None => ActorAction::Rejoin {
                    reason: format!("version {version}: {reason}"),
                },
            });
        }
    }

    fn advance(&mut self) {
        if self.stage == Stage::Idle {
            match self.active {
                // Nothing but a snapshot can start an actor with no weights; a delta
                // still queued from before a refused snapshot waits or goes.
                None => {
                    if let Some((&version, _)) = self
                        .verified
                        .iter()
                        .find(|(_, p)| p.kind == ArtifactKind::Snapshot)
                    {
                        self.stage = Stage::Staging(version);
                        self.actions.push_back(ActorAction::Stage { version });
                    }
                }
                Some(active) => {
                    if let Some((&version, pending)) = self.verified.first_key_value() {
                        let next = active.version + 1;
                        // A composed delta skips versions: only its base must be the
                        // active one.
                        let follows = match pending.kind {
                            ArtifactKind::Delta => version == next,
                            ArtifactKind::Composed => version > active.version,
                            ArtifactKind::Snapshot => false,
                        };
                        if follows && pending.base == active {
                            self.stage = Stage::Staging(version);
                            self.actions.push_back(ActorAction::Stage { version });
                        } else if version == next || self.chain_broken(active) {
                            let base = pending.base;
                            self.refuse(
                                version,
                                format!(
                                    "its base is version {} with weights {}, the active weights are version {} with {}",
                                    base.version, base.hash, active.version, active.hash
                                ),
                            );
                        }
                    }
                }
            }
        }
        if let Stage::Staged(version) = self.stage {
            if self.active.is_none() {
                // A joining actor's engine runs nothing yet: no safe point to wait for.
                self.stage = Stage::Activating(version);
                self.actions.push_back(ActorAction::Activate { version });
            } else if self.committed.is_some_and(|c| c.version >= version)
                && !self.safe_point_requested
            {
                self.safe_point_requested = true;
                self.actions.push_back(ActorAction::AwaitSafePoint);
            }
        }
    }

    /// A delta that cannot follow the active version however long we wait: it starts
    /// at or before the active version but is not the next one.
    fn chain_broken(&self, active: VersionRef) -> bool {
        self.verified
            .values()
            .next()
            .is_some_and(|p| p.base.version <= active.version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aurora_delta::Encoding;

    fn hash(n: u8) -> Hash {
        Hash([n; 32])
    }

    fn at(version: u64) -> VersionRef {
        VersionRef {
            version,
            hash: hash(version as u8),
        }
    }

    fn header(base: VersionRef, target: u64) -> DeltaHeader {
        DeltaHeader {
            base_version: base.version,
            target_version: target,
            base_hash: base.hash,
            target_hash: hash(target as u8),
            encoding: Encoding::Aurora,
            tensors: Vec::new(),
        }
    }

    fn drain(core: &mut ActorCore) -> Vec<ActorAction> {
        std::iter::from_fn(|| core.poll_action()).collect()
    }

    #[test]
    fn stages_then_activates_on_commit_at_a_safe_point() {
        let mut core = ActorCore::new(at(3));
        core.delta(ArtifactKind::Delta, &header(at(3), 4));
        assert_eq!(drain(&mut core), [ActorAction::Stage { version: 4 }]);
        core.staged(4, Ok(()));
        assert_eq!(drain(&mut core), [], "no commit yet: stays staged");
        assert_eq!(core.status().staged, Some(4));
        core.commit(at(4));
        assert_eq!(drain(&mut core), [ActorAction::AwaitSafePoint]);
        core.safe_point();
        assert_eq!(drain(&mut core), [ActorAction::Activate { version: 4 }]);
        core.activated(4, Ok(hash(4)));
        assert_eq!(core.status().active, Some(at(4)));
        assert_eq!(
            drain(&mut core),
            [
                ActorAction::Discard { version: 4 },
                ActorAction::Report {
                    note: "activated version 4".into()
                }
            ]
        );
    }

    #[test]
    fn a_composed_delta_from_the_active_version_skips_to_its_target() {
        let mut core = ActorCore::new(at(3));
        core.commit(at(8));
        drain(&mut core);
        core.delta(ArtifactKind::Composed, &header(at(3), 8));
        assert_eq!(drain(&mut core), [ActorAction::Stage { version: 8 }]);
        core.staged(8, Ok(()));
        assert_eq!(drain(&mut core), [ActorAction::AwaitSafePoint]);
        core.safe_point();
        assert_eq!(drain(&mut core), [ActorAction::Activate { version: 8 }]);
        core.activated(8, Ok(hash(8)));
        assert_eq!(core.status().active, Some(at(8)));

        // One from another base is refused, and the chain fetched again.
        let mut core = ActorCore::new(at(3));
        core.delta(ArtifactKind::Composed, &header(at(2), 8));
        let actions = drain(&mut core);
        assert!(
            actions.contains(&ActorAction::Rewind { version: 4 }),
            "{actions:?}"
        );
        let mut core = ActorCore::new(at(3));
        core.delta(
            ArtifactKind::Composed,
            &header(
                VersionRef {
                    version: 3,
                    hash: hash(99),
                },
                8,
            ),
        );
        let actions = drain(&mut core);
        assert!(
            actions.contains(&ActorAction::Rewind { version: 4 }),
            "{actions:?}"
        );
    }

    #[test]
    fn a_commit_ahead_activates_every_version_in_order() {
        let mut core = ActorCore::new(at(0));
        core.commit(at(2));
        drain(&mut core);
        core.delta(ArtifactKind::Delta, &header(at(1), 2));
        assert_eq!(drain(&mut core), [], "version 2 waits for version 1");
        core.delta(ArtifactKind::Delta, &header(at(0), 1));
        assert_eq!(drain(&mut core), [ActorAction::Stage { version: 1 }]);
        for version in 1..=2 {
            core.staged(version, Ok(()));
            assert_eq!(drain(&mut core), [ActorAction::AwaitSafePoint]);
            core.safe_point();
            core.activated(version, Ok(hash(version as u8)));
            let actions = drain(&mut core);
            assert_eq!(actions[0], ActorAction::Activate { version });
            if version == 1 {
                assert_eq!(actions.last(), Some(&ActorAction::Stage { version: 2 }));
            }
        }
        assert_eq!(core.status().active, Some(at(2)));
    }

    #[test]
    fn a_delta_with_the_wrong_base_is_refused_reported_and_fetched_again() {
        // Same version number, other weights: the actor's chain diverged.
        let mut core = ActorCore::new(at(3));
        let foreign = VersionRef {
            version: 3,
            hash: hash(99),
        };
        core.delta(ArtifactKind::Delta, &header(foreign, 4));
        let actions = drain(&mut core);
        assert_eq!(actions[0], ActorAction::Discard { version: 4 });
        assert!(
            matches!(&actions[1], ActorAction::Report { note } if note.contains("refused version 4"))
        );
        assert_eq!(actions[2], ActorAction::Rewind { version: 4 });
        assert_eq!(core.status().active, Some(at(3)), "never activated");
    }

    #[test]
    fn a_stale_actor_refuses_a_delta_that_skips_versions_and_catches_up() {
        let mut core = ActorCore::new(at(3));
        core.commit(at(10));
        drain(&mut core);
        // D(10) starts from 9: it can never follow version 3 directly, but 4..9 may
        // still come, so the actor waits rather than refusing.
        core.delta(ArtifactKind::Delta, &header(at(9), 10));
        assert_eq!(drain(&mut core), []);
        // D(5) over base 4 arrives before D(4): still waiting.
        core.delta(ArtifactKind::Delta, &header(at(4), 5));
        assert_eq!(drain(&mut core), []);
        core.delta(ArtifactKind::Delta, &header(at(3), 4));
        assert_eq!(drain(&mut core), [ActorAction::Stage { version: 4 }]);
    }

    #[test]
    fn a_delta_older_than_the_active_version_is_discarded() {
        let mut core = ActorCore::new(at(5));
        core.delta(ArtifactKind::Delta, &header(at(4), 5));
        assert_eq!(drain(&mut core), [ActorAction::Discard { version: 5 }]);
    }

    /// Whether `actions` rejoin, naming the version refused.
    fn rejoins(actions: &[ActorAction]) -> bool {
        actions
            .iter()
            .any(|a| matches!(a, ActorAction::Rejoin { reason } if reason.starts_with("version ")))
    }

    /// An actor at version 1 activating the committed version 2.
    fn activating_2() -> ActorCore {
        let mut core = ActorCore::new(at(1));
        core.commit(at(2));
        core.delta(ArtifactKind::Delta, &header(at(1), 2));
        drain(&mut core);
        core.staged(2, Ok(()));
        core.safe_point();
        drain(&mut core);
        core
    }

    #[test]
    fn a_failed_activation_keeps_the_weights_and_refetches() {
        let mut core = activating_2();
        let mismatch = aurora_delta::DeltaError::TargetMismatch {
            expected: hash(2),
            actual: hash(3),
        };
        core.activated(2, Err(mismatch.into()));
        let actions = drain(&mut core);
        assert!(actions.contains(&ActorAction::Rewind { version: 2 }));
        assert_eq!(core.status().active, Some(at(1)));
    }

    /// An activation that panicked and left the weights no version's: the actor has
    /// nothing to build on, so it rejoins; one that left them intact rewinds as usual.
    #[test]
    fn an_activation_that_lost_the_weights_rejoins() {
        for intact in [true, false] {
            let mut core = activating_2();
            if !intact {
                // Lost weights rejoin even after refusals that nearly gave up.
                core.refusals = MAX_REFUSALS - 1;
            }
            let panicked = EffectError::ActivationPanicked {
                message: "a bug".into(),
                intact,
            };
            core.activated(2, Err(panicked));
            let actions = drain(&mut core);
            if intact {
                assert!(actions.contains(&ActorAction::Rewind { version: 2 }));
                assert_eq!(core.status().active, Some(at(1)));
            } else {
                assert!(rejoins(&actions), "{actions:?}");
                assert_eq!(core.status().active, None);
            }
        }
    }

    #[test]
    fn refusals_in_a_row_stop_at_the_limit() {
        let mut core = ActorCore::new(at(1));
        let foreign = VersionRef {
            version: 1,
            hash: hash(77),
        };
        for _ in 0..MAX_REFUSALS {
            core.delta(ArtifactKind::Delta, &header(foreign, 2));
        }
        assert!(core.diverged());
        let rewinds = drain(&mut core)
            .into_iter()
            .filter(|a| matches!(a, ActorAction::Rewind { .. }))
            .count();
        assert_eq!(rewinds as u32, MAX_REFUSALS - 1);
    }

    fn snapshot(version: u64) -> DeltaHeader {
        DeltaHeader {
            base_version: version,
            target_version: version,
            base_hash: crate::snapshot::empty_weights_hash(),
            target_hash: hash(version as u8),
            encoding: Encoding::Dense,
            tensors: Vec::new(),
        }
    }

    #[test]
    fn a_joining_actor_activates_its_snapshot_at_once_then_follows_deltas() {
        let mut core = ActorCore::joining();
        assert_eq!(core.status().active, None);
        core.commit(at(6));
        assert_eq!(
            drain(&mut core),
            [],
            "nothing to report before the snapshot"
        );
        core.snapshot(&snapshot(5));
        assert_eq!(drain(&mut core), [ActorAction::Stage { version: 5 }]);
        core.delta(ArtifactKind::Delta, &header(at(5), 6));
        assert_eq!(drain(&mut core), [], "the delta waits for the snapshot");
        core.staged(5, Ok(()));
        assert_eq!(
            drain(&mut core),
            [ActorAction::Activate { version: 5 }],
            "no safe point: the engine runs nothing yet"
        );
        core.activated(5, Ok(hash(5)));
        assert_eq!(core.status().active, Some(at(5)));
        let actions = drain(&mut core);
        assert_eq!(actions.last(), Some(&ActorAction::Stage { version: 6 }));
        core.staged(6, Ok(()));
        assert_eq!(drain(&mut core), [ActorAction::AwaitSafePoint]);
    }

    #[test]
    fn a_joining_actor_waits_for_a_snapshot_and_refetches_a_bad_one() {
        let mut core = ActorCore::joining();
        core.delta(ArtifactKind::Delta, &header(at(2), 3));
        assert_eq!(drain(&mut core), [], "a delta cannot start an actor");
        core.snapshot(&snapshot(4));
        assert_eq!(drain(&mut core), [ActorAction::Stage { version: 4 }]);
        core.staged(4, Ok(()));
        drain(&mut core);
        core.activated(4, Ok(hash(99)));
        let actions = drain(&mut core);
        assert!(rejoins(&actions), "{actions:?}");
        assert!(
            actions.contains(&ActorAction::Discard { version: 3 }),
            "what was queued behind it goes too: {actions:?}"
        );
        assert_eq!(core.status().active, None);
    }

    #[test]
    fn an_actor_with_weights_discards_a_snapshot() {
        let mut core = ActorCore::new(at(3));
        core.snapshot(&snapshot(5));
        assert_eq!(drain(&mut core), [ActorAction::Discard { version: 5 }]);
    }
}
