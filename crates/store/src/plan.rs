//! Choosing how an Actor catches up, by bytes to transfer.

use std::collections::BTreeMap;
use std::ops::Range;

/// How an Actor at some version reaches the store's latest version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// The Actor already has the latest version.
    UpToDate { version: u64 },
    /// Apply the stored deltas of the versions in `deltas` (half-open), in order, to the
    /// Actor's weights.
    Replay { deltas: Range<u64>, bytes: u64 },
    /// Load the stored snapshot of version `snapshot`, then apply `deltas` (half-open;
    /// empty when the snapshot is the latest version).
    Snapshot {
        snapshot: u64,
        deltas: Range<u64>,
        bytes: u64,
    },
    /// One exact delta from `base_version` straight to `target_version`
    /// (`Store::composed_artifact`): changes that cancel out along the chain vanish, so
    /// it can be far smaller than the deltas it replaces. Considered only for an Actor at
    /// least two versions behind, and only once its size is known (it has been built).
    Composed {
        base_version: u64,
        target_version: u64,
        bytes: u64,
    },
}

/// The cheapest plan by bytes, from the artifact sizes the catalog lists (`deltas` and
/// `snapshots` map a version to its file size; `composed` is the size of the composed
/// delta from `actor` to `latest` where one is known). `None` when no complete chain
/// reaches `latest` from the Actor or from any snapshot and no composed delta does.
/// Requires `actor <= latest`.
///
/// A composed delta counts only for an Actor at least two versions behind: one version
/// behind, it would be the stored delta itself. On equal bytes replay wins (the Actor
/// keeps its weights and applies stored artifacts), then the composed delta (one
/// artifact, no full reload), then the later snapshot (fewer deltas to apply).
pub(crate) fn choose(
    actor: u64,
    latest: u64,
    deltas: &BTreeMap<u64, u64>,
    snapshots: &BTreeMap<u64, u64>,
    composed: Option<u64>,
) -> Option<Plan> {
    assert!(
        actor <= latest,
        "the caller checks that the actor is not ahead"
    );
    if actor == latest {
        return Some(Plan::UpToDate { version: latest });
    }
    // tail[x] = bytes of D(x+1..=latest), for every x from which the chain is complete.
    let mut tail = BTreeMap::from([(latest, 0u64)]);
    let (mut from, mut bytes) = (latest, 0u64);
    while from > 0 {
        let Some(size) = deltas.get(&from) else { break };
        bytes = bytes.saturating_add(*size);
        from -= 1;
        tail.insert(from, bytes);
    }
    let mut best = tail.get(&actor).map(|&bytes| Plan::Replay {
        deltas: actor + 1..latest + 1,
        bytes,
    });
    if let Some(bytes) = composed.filter(|_| actor + 2 <= latest)
        && best.as_ref().is_none_or(|b| bytes < b.bytes())
    {
        best = Some(Plan::Composed {
            base_version: actor,
            target_version: latest,
            bytes,
        });
    }
    for (&snapshot, &size) in snapshots.range(..=latest).rev() {
        let Some(&chain) = tail.get(&snapshot) else {
            continue;
        };
        let bytes = size.saturating_add(chain);
        if best.as_ref().is_none_or(|b| bytes < b.bytes()) {
            best = Some(Plan::Snapshot {
                snapshot,
                deltas: snapshot + 1..latest + 1,
                bytes,
            });
        }
    }
    best
}

impl Plan {
    /// Bytes to transfer.
    pub fn bytes(&self) -> u64 {
        match self {
            Plan::Replay { bytes, .. }
            | Plan::Snapshot { bytes, .. }
            | Plan::Composed { bytes, .. } => *bytes,
            Plan::UpToDate { .. } => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(pairs: &[(u64, u64)]) -> BTreeMap<u64, u64> {
        pairs.iter().copied().collect()
    }

    fn check(actor: u64, deltas: &[(u64, u64)], snapshots: &[(u64, u64)], expected: Option<Plan>) {
        check_composed(actor, deltas, snapshots, None, expected);
    }

    fn check_composed(
        actor: u64,
        deltas: &[(u64, u64)],
        snapshots: &[(u64, u64)],
        composed: Option<u64>,
        expected: Option<Plan>,
    ) {
        let latest = deltas.iter().chain(snapshots).map(|p| p.0).max().unwrap();
        assert_eq!(
            choose(actor, latest, &sizes(deltas), &sizes(snapshots), composed),
            expected
        );
    }

    #[test]
    fn small_deltas_are_replayed() {
        let deltas = [(1, 10), (2, 10), (3, 10), (4, 10)];
        check(
            1,
            &deltas,
            &[(0, 1000), (3, 1000)],
            Some(Plan::Replay {
                deltas: 2..5,
                bytes: 30,
            }),
        );
    }

    #[test]
    fn a_snapshot_wins_over_a_long_expensive_chain() {
        let deltas = [(1, 400), (2, 400), (3, 400), (4, 400)];
        check(
            0,
            &deltas,
            &[(0, 1000), (3, 1000)],
            Some(Plan::Snapshot {
                snapshot: 3,
                deltas: 4..5,
                bytes: 1400,
            }),
        );
    }

    #[test]
    fn the_cheapest_snapshot_is_chosen_not_the_latest() {
        // The snapshot at 4 is huge (say the model grew); starting at 2 is cheaper.
        let deltas = [(1, 500), (2, 500), (3, 10), (4, 10)];
        check(
            0,
            &deltas,
            &[(2, 100), (4, 5000)],
            Some(Plan::Snapshot {
                snapshot: 2,
                deltas: 3..5,
                bytes: 120,
            }),
        );
    }

    #[test]
    fn equal_bytes_prefer_replay_then_the_later_snapshot() {
        check(
            1,
            &[(2, 50)],
            &[(2, 50)],
            Some(Plan::Replay {
                deltas: 2..3,
                bytes: 50,
            }),
        );
        // Replay costs 120; the snapshots at 1 and 2 both cost 100.
        check(
            0,
            &[(1, 60), (2, 60)],
            &[(0, 100), (1, 40), (2, 100)],
            Some(Plan::Snapshot {
                snapshot: 2,
                deltas: 3..3,
                bytes: 100,
            }),
        );
    }

    #[test]
    fn a_pruned_delta_forces_a_snapshot_after_the_gap() {
        // D(2) is gone: the actor at 0 cannot replay, nor start from the snapshot at 0.
        let deltas = [(1, 1), (3, 1), (4, 1)];
        check(
            0,
            &deltas,
            &[(0, 10), (2, 10)],
            Some(Plan::Snapshot {
                snapshot: 2,
                deltas: 3..5,
                bytes: 12,
            }),
        );
        check(0, &deltas, &[(0, 10)], None);
    }

    #[test]
    fn an_actor_at_the_latest_version_is_up_to_date() {
        check(4, &[(4, 1)], &[], Some(Plan::UpToDate { version: 4 }));
    }

    #[test]
    fn a_composed_delta_wins_when_it_is_the_smallest() {
        let deltas = [(1, 100), (2, 100), (3, 100), (4, 100)];
        check_composed(
            1,
            &deltas,
            &[(0, 1000)],
            Some(120),
            Some(Plan::Composed {
                base_version: 1,
                target_version: 4,
                bytes: 120,
            }),
        );
        // Replaying 300 bytes beats a composed delta of 300 (a tie) or more.
        check_composed(
            1,
            &deltas,
            &[(0, 1000)],
            Some(300),
            Some(Plan::Replay {
                deltas: 2..5,
                bytes: 300,
            }),
        );
        // A snapshot smaller than the composed delta still wins.
        check_composed(
            0,
            &deltas,
            &[(0, 1000), (4, 150)],
            Some(200),
            Some(Plan::Snapshot {
                snapshot: 4,
                deltas: 5..5,
                bytes: 150,
            }),
        );
    }

    #[test]
    fn one_version_behind_is_never_composed() {
        check_composed(
            3,
            &[(4, 100)],
            &[],
            Some(1),
            Some(Plan::Replay {
                deltas: 4..5,
                bytes: 100,
            }),
        );
    }

    #[test]
    fn a_composed_delta_bridges_a_pruned_chain() {
        // D(2) is gone and no snapshot remains, but the composed delta from 0 reaches 4.
        check_composed(
            0,
            &[(1, 1), (3, 1), (4, 1)],
            &[],
            Some(50),
            Some(Plan::Composed {
                base_version: 0,
                target_version: 4,
                bytes: 50,
            }),
        );
    }
}
