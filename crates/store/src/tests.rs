use super::*;
use crate::catalog::SCHEMA_TABLE;
use crate::files::{CATALOG, COMPOSED, DELTAS, SNAPSHOT_ARTIFACTS, SNAPSHOTS};
use aurora_delta::{
    Checkpoint, DeltaFile, Dtype, Encoding, ExtractOptions, Extraction, Hash, OwnedTensor,
    owned_checkpoint,
};
use redb::ReadableDatabase;

/// The weights of `version` in one lineage: 256 F32 values, each step nudging one of
/// them. `lineage` shifts every value, so two lineages never share a weights hash.
fn weights(lineage: f32, version: u64) -> Vec<OwnedTensor> {
    let mut values: Vec<f32> = (0..256).map(|i| i as f32 * 0.5 + lineage).collect();
    for step in 1..=version {
        values[(step * 7 % 256) as usize] += 1.0;
    }
    vec![OwnedTensor {
        name: "w".into(),
        dtype: Dtype::F32,
        shape: vec![16, 16],
        data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }]
}

fn delta_in(lineage: f32, base_version: u64, target_version: u64) -> Vec<u8> {
    let (base, target) = (
        weights(lineage, base_version),
        weights(lineage, target_version),
    );
    let (base, target) = (
        owned_checkpoint(&base).unwrap(),
        owned_checkpoint(&target).unwrap(),
    );
    let options = ExtractOptions {
        base_version,
        target_version,
        ..Default::default()
    };
    Extraction::new(&base, &target, options)
        .unwrap()
        .to_bytes()
        .unwrap()
        .1
}

fn delta(version: u64) -> Vec<u8> {
    delta_in(0.0, version - 1, version)
}

fn snapshot(version: u64) -> Vec<u8> {
    aurora_checkpoint::safetensors_bytes(&weights(0.0, version)).unwrap()
}

/// A store holding snapshot 0 and D(1..=latest).
fn store_with(root: &Path, latest: u64) -> Store {
    let store = Store::open(root).unwrap();
    store.put_snapshot(0, &snapshot(0)).unwrap();
    for version in 1..=latest {
        store.put_delta(&delta(version), None).unwrap();
    }
    store
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn flip_byte_in_middle(path: &Path) {
    let mut bytes = fs::read(path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    fs::write(path, bytes).unwrap();
}

#[test]
fn put_then_get_round_trips_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let record = {
        let store = store_with(dir.path(), 2);
        assert_eq!(store.latest_version().unwrap(), Some(2));
        store.put_delta(&delta(3), None).unwrap()
    };
    assert_eq!((record.version, record.base_version), (3, 2));
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.latest_version().unwrap(), Some(3));
    assert_eq!(store.delta(3).unwrap().bytes(), delta(3).as_slice());
    assert_eq!(store.snapshot(0).unwrap().bytes(), snapshot(0).as_slice());
    assert_eq!(
        files(&dir.path().join(DELTAS))[2],
        format!("3-{}.adelta", record.id)
    );
    assert!(dir.path().join("rollouts").is_dir());
    assert!(dir.path().join("trainer").is_dir());
    assert!(matches!(
        store.delta(4),
        Err(StoreError::NotFound { version: 4, .. })
    ));
}

#[test]
fn the_same_artifact_again_is_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), 1);
    let first = store.put_delta(&delta(2), None).unwrap();
    assert_eq!(store.put_delta(&delta(2), None).unwrap(), first);
    let snap = store.put_snapshot(2, &snapshot(2)).unwrap();
    assert_eq!(store.put_snapshot(2, &snapshot(2)).unwrap(), snap);
    assert_eq!(files(&dir.path().join(DELTAS)).len(), 2);
    assert_eq!(files(&dir.path().join(SNAPSHOTS)).len(), 2);
}

#[test]
fn snapshots_can_come_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), 1);
    let path = dir.path().join("outside.safetensors");
    fs::write(&path, snapshot(1)).unwrap();
    let record = store.put_snapshot_file(1, &path).unwrap();
    assert_eq!(
        record.weights_hash,
        store.records().unwrap().0[&1].target_hash
    );
}

#[test]
fn a_delta_that_does_not_continue_the_store_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), 1);
    // Another lineage's D(2) starts from weights the store does not have at version 1.
    let error = store.put_delta(&delta_in(100.0, 1, 2), None).unwrap_err();
    assert!(
        matches!(error, StoreError::WrongBase { version: 2, .. }),
        "{error}"
    );
    assert!(error.to_string().contains("stored version 1"), "{error}");
    // Skipping a version is refused before anything else.
    let error = store.put_delta(&delta_in(0.0, 1, 3), None).unwrap_err();
    assert!(matches!(
        error,
        StoreError::NotConsecutive {
            version: 3,
            base_version: 1
        }
    ));
    // A different artifact for a version already stored.
    let error = store.put_delta(&delta_in(100.0, 0, 1), None).unwrap_err();
    assert!(matches!(
        error,
        StoreError::Conflict {
            kind: "delta",
            version: 1,
            ..
        }
    ));
    // A snapshot that disagrees with the delta into its version.
    let error = store.put_snapshot(1, &snapshot(2)).unwrap_err();
    assert!(matches!(
        error,
        StoreError::WrongWeights {
            kind: "snapshot",
            version: 1,
            ..
        }
    ));
    // Nothing refused reached the disk.
    assert_eq!(files(&dir.path().join(DELTAS)).len(), 1);
    assert_eq!(files(&dir.path().join(SNAPSHOTS)).len(), 1);
    assert_eq!(store.latest_version().unwrap(), Some(1));
}

#[test]
fn a_damaged_artifact_is_refused_before_it_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let mut bytes = delta(1);
    let middle = bytes.len() / 2;
    bytes[middle] ^= 1;
    assert!(matches!(
        store.put_delta(&bytes, None),
        Err(StoreError::InvalidDelta(_))
    ));
    assert!(matches!(
        store.put_snapshot(0, b"not safetensors"),
        Err(StoreError::InvalidSnapshot { version: 0, .. })
    ));
    assert!(files(&dir.path().join(DELTAS)).is_empty());
}

#[test]
fn corrupted_files_are_reported_and_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), 1);
    let delta_file = dir
        .path()
        .join(DELTAS)
        .join(&files(&dir.path().join(DELTAS))[0]);
    flip_byte_in_middle(&delta_file);
    let Err(error) = store.delta(1) else {
        panic!("a corrupted delta was served")
    };
    assert!(
        matches!(
            error,
            StoreError::Corrupted {
                kind: "delta",
                version: 1,
                ..
            }
        ),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .contains(&delta_file.display().to_string()),
        "{error}"
    );

    let snapshot_file = dir
        .path()
        .join(SNAPSHOTS)
        .join(&files(&dir.path().join(SNAPSHOTS))[0]);
    flip_byte_in_middle(&snapshot_file);
    let Err(error) = store.snapshot(0) else {
        panic!("a corrupted snapshot was served")
    };
    assert!(
        matches!(
            error,
            StoreError::Corrupted {
                kind: "snapshot",
                version: 0,
                ..
            }
        ),
        "{error}"
    );

    fs::remove_file(&snapshot_file).unwrap();
    assert!(matches!(
        store.snapshot(0),
        Err(StoreError::Missing { version: 0, .. })
    ));
}

#[test]
fn catch_up_plans_replay_or_start_from_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), 3);
    assert_eq!(
        store.catch_up_plan(3).unwrap(),
        Plan::UpToDate { version: 3 }
    );
    // A few small deltas cost less than a snapshot.
    let deltas = store.records().unwrap().0;
    let replay = deltas[&2].size_bytes + deltas[&3].size_bytes;
    assert_eq!(
        store.catch_up_plan(1).unwrap(),
        Plan::Replay {
            deltas: 2..4,
            bytes: replay
        }
    );
    // A snapshot of the latest version beats replaying three deltas only if it is smaller.
    let snap = store.put_snapshot(3, &snapshot(3)).unwrap();
    let expected = if snap.size_bytes < replay + deltas[&1].size_bytes {
        Plan::Snapshot {
            snapshot: 3,
            deltas: 4..4,
            bytes: snap.size_bytes,
        }
    } else {
        Plan::Replay {
            deltas: 1..4,
            bytes: replay + deltas[&1].size_bytes,
        }
    };
    assert_eq!(store.catch_up_plan(0).unwrap(), expected);
    assert!(matches!(
        store.catch_up_plan(9),
        Err(StoreError::ActorAhead { actor: 9, .. })
    ));
}

#[test]
fn prune_keeps_what_live_actors_and_new_actors_need() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), 6);
    store.put_snapshot(4, &snapshot(4)).unwrap();
    let before = store.catch_up_plan(1).unwrap();
    // Joiners took both snapshots: their artifacts go with them.
    store.snapshot_artifact(0, 64).unwrap();
    store.snapshot_artifact(4, 64).unwrap();
    store.snapshot_artifact(4, 128).unwrap();

    let report = store.prune(5, &[1]).unwrap();
    assert_eq!(report.deltas, vec![1]);
    assert_eq!(report.snapshots, vec![0]);
    let artifacts = files(&dir.path().join(SNAPSHOT_ARTIFACTS));
    assert_eq!(artifacts.len(), 2, "{artifacts:?}");
    assert!(
        artifacts.iter().all(|name| name.starts_with("4-")),
        "{artifacts:?}"
    );
    assert!(report.bytes_freed > 0);
    // The live actor's plan is unchanged and every artifact in it is still served.
    assert_eq!(store.catch_up_plan(1).unwrap(), before);
    for version in 2..=6 {
        store.delta(version).unwrap();
    }
    store.snapshot(4).unwrap();
    assert_eq!(files(&dir.path().join(DELTAS)).len(), 5);
    assert_eq!(files(&dir.path().join(SNAPSHOTS)).len(), 1);

    // Once the actor is gone, only the newest snapshot and the deltas after it remain;
    // any actor, new or old, can still catch up from that snapshot.
    let report = store.prune(5, &[]).unwrap();
    assert_eq!(report.deltas, vec![2, 3, 4]);
    assert!(report.snapshots.is_empty());
    assert!(matches!(
        store.catch_up_plan(1).unwrap(),
        Plan::Snapshot { snapshot: 4, .. }
    ));
}

#[test]
fn a_crash_before_the_catalog_commit_leaves_nothing_served() {
    let dir = tempfile::tempdir().unwrap();
    drop(store_with(dir.path(), 1));
    // The crash: D(2) and a snapshot fully written, a temporary file half written, no
    // record committed for any of them.
    let orphan = delta(2);
    let id = DeltaFile::parse(&orphan).unwrap().id;
    fs::write(
        dir.path().join(DELTAS).join(format!("2-{id}.adelta")),
        &orphan,
    )
    .unwrap();
    fs::write(
        dir.path().join(SNAPSHOTS).join("2-feed.safetensors"),
        snapshot(2),
    )
    .unwrap();
    fs::write(
        dir.path().join(DELTAS).join(".3-x.adelta.4242.tmp"),
        b"torn",
    )
    .unwrap();

    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.latest_version().unwrap(), Some(1));
    assert!(matches!(
        store.delta(2),
        Err(StoreError::NotFound { version: 2, .. })
    ));
    assert_eq!(files(&dir.path().join(DELTAS)).len(), 1);
    assert_eq!(files(&dir.path().join(SNAPSHOTS)).len(), 1);
    // The interrupted put can simply be retried.
    store.put_delta(&orphan, None).unwrap();
    assert_eq!(store.delta(2).unwrap().bytes(), orphan.as_slice());
}

#[test]
fn a_crash_after_a_prune_commit_leaves_only_orphans() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), 2);
    // The crash: prune committed the removal of D(1)'s record, then stopped before
    // deleting its file.
    let txn = store.db.begin_write().unwrap();
    txn.open_table(DELTA_TABLE).unwrap().remove(1).unwrap();
    txn.commit().unwrap();
    drop(store);

    let store = Store::open(dir.path()).unwrap();
    assert_eq!(files(&dir.path().join(DELTAS)).len(), 1);
    assert!(matches!(
        store.delta(1),
        Err(StoreError::NotFound { version: 1, .. })
    ));
    store.delta(2).unwrap();
}

#[test]
fn snapshot_policy() {
    let check =
        |version, every_k, expected| assert_eq!(should_snapshot(version, every_k), expected);
    check(0, 0, true);
    check(5, 0, false);
    check(10, 5, true);
    check(11, 5, false);
}

#[test]
fn a_snapshot_travels_as_the_delta_from_the_empty_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), 4);
    let snapshots = |store: &Store| store.records().unwrap().1.into_keys().collect::<Vec<_>>();
    assert_eq!(snapshots(&store), [0]);
    let record = store.put_snapshot(3, &snapshot(3)).unwrap();
    assert_eq!(snapshots(&store), [0, 3]);

    let bytes = store.snapshot_artifact(3, 64).unwrap().bytes().to_vec();
    let file = DeltaFile::parse(&bytes).unwrap();
    let header = file.header();
    assert_eq!((header.base_version, header.target_version), (3, 3));
    assert_eq!(header.base_hash, Checkpoint::default().weights_hash());
    assert_eq!(header.target_hash, record.weights_hash);
    assert_eq!(header.encoding, Encoding::Dense);
    assert!(
        header
            .tensors
            .iter()
            .all(|t| matches!(t.change, aurora_delta::TensorChange::Added(_)))
    );
    let applied = aurora_delta::apply(&file, &Checkpoint::default(), None).unwrap();
    assert_eq!(applied, weights(0.0, 3), "it rebuilds the snapshot exactly");
    let built = |store: &Store, segment_bytes| {
        store
            .snapshot_artifact(3, segment_bytes)
            .unwrap()
            .bytes()
            .to_vec()
    };
    assert_eq!(
        built(&store, 64),
        bytes,
        "the same snapshot always gives the same artifact"
    );

    // Built once, kept beside the snapshot while it is stored, reopened or not.
    let artifacts = dir.path().join(SNAPSHOT_ARTIFACTS);
    let artifact = artifacts.join(format!("3-{}-64.adelta", record.weights_hash));
    assert_eq!(
        files(&artifacts),
        [format!("3-{}-64.adelta", record.weights_hash)]
    );
    drop(store);
    let store = Store::open(dir.path()).unwrap();
    assert!(artifact.exists());
    // A damaged artifact is never served: it is built again.
    flip_byte_in_middle(&artifact);
    assert_eq!(built(&store, 64), bytes);

    assert!(matches!(
        store.snapshot_artifact(2, 64),
        Err(StoreError::NotFound {
            kind: "snapshot",
            version: 2
        })
    ));
    // A damaged snapshot builds nothing.
    let path = dir
        .path()
        .join(SNAPSHOTS)
        .join(format!("3-{}.safetensors", record.weights_hash));
    flip_byte_in_middle(&path);
    assert!(matches!(
        store.snapshot_artifact(3, 32),
        Err(StoreError::Corrupted { version: 3, .. })
    ));
    assert!(
        !artifacts
            .join(format!("3-{}-32.adelta", record.weights_hash))
            .exists()
    );
}

#[test]
fn a_composed_delta_rebuilds_the_target_exactly_from_the_base() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), 6);
    store.put_snapshot(2, &snapshot(2)).unwrap();
    // Base 3 is rebuilt from the snapshot at 2 and D(3); base 2 is the snapshot itself.
    for base in [2, 3] {
        let bytes = store.composed_artifact(base, 6).unwrap();
        let file = DeltaFile::parse(&bytes).unwrap();
        let header = file.header();
        assert_eq!((header.base_version, header.target_version), (base, 6));
        let base_weights = weights(0.0, base);
        let applied =
            aurora_delta::apply(&file, &owned_checkpoint(&base_weights).unwrap(), None).unwrap();
        assert_eq!(applied, weights(0.0, 6), "bit for bit");
        assert_eq!(
            owned_checkpoint(&applied).unwrap().weights_hash(),
            store.records().unwrap().0[&6].target_hash
        );
    }
    // Cached: asking again reads the stored artifact, the same bytes.
    let record = store.composed_records().unwrap()[&(3, 6)];
    assert_eq!(
        store.composed_artifact(3, 6).unwrap().len() as u64,
        record.size_bytes
    );
    assert_eq!(files(&dir.path().join(COMPOSED)).len(), 2);
    // Only forward, to a stored version.
    assert!(matches!(
        store.composed_artifact(6, 6),
        Err(StoreError::NoComposed { .. })
    ));
    assert!(matches!(
        store.composed_artifact(3, 9),
        Err(StoreError::NoComposed { .. })
    ));

    // A damaged cached artifact is an error, never served, and survives no reopen
    // as anything else.
    let path = dir
        .path()
        .join(COMPOSED)
        .join(format!("3-6-{}.adelta", record.id));
    flip_byte_in_middle(&path);
    assert!(matches!(
        store.composed_artifact(3, 6),
        Err(StoreError::Corrupted {
            kind: "composed delta",
            version: 6,
            ..
        })
    ));
    fs::remove_file(&path).unwrap();
    assert!(matches!(
        store.composed_artifact(3, 6),
        Err(StoreError::Missing { version: 6, .. })
    ));
}

#[test]
fn catch_up_plans_consider_a_composed_delta_by_its_size() {
    let dir = tempfile::tempdir().unwrap();
    // Every step of this lineage nudges a different element, so the composed delta
    // from 1 to 6 carries five changes in one artifact: far less than five deltas.
    let store = store_with(dir.path(), 6);
    let deltas = store.records().unwrap().0;
    let replay: u64 = (2..=6).map(|v| deltas[&v].size_bytes).sum();
    // Not built yet: the cheap plan does not know its size.
    assert_eq!(
        store.catch_up_plan(1).unwrap(),
        Plan::Replay {
            deltas: 2..7,
            bytes: replay
        }
    );
    // Planning builds it to learn its size, and keeps nothing.
    let plan = store.composed_catch_up_plan(1, 6).unwrap();
    assert!(store.composed_records().unwrap().is_empty());
    // Serving it keeps it: the plan chose it.
    let (served, bytes) = store.composed_catch_up(1, 6).unwrap();
    assert_eq!(served, plan);
    let composed = store.composed_records().unwrap()[&(1, 6)].size_bytes;
    assert_eq!(bytes.map(|b| b.len() as u64), Some(composed));
    assert!(composed < replay, "{composed} vs {replay}");
    assert_eq!(
        plan,
        Plan::Composed {
            base_version: 1,
            target_version: 6,
            bytes: composed
        }
    );
    // Now stored, the cheap plan sees it too.
    assert_eq!(store.catch_up_plan(1).unwrap(), plan);
    // One version behind is a single delta: replayed, nothing composed.
    assert_eq!(
        store.composed_catch_up_plan(5, 6).unwrap(),
        Plan::Replay {
            deltas: 6..7,
            bytes: deltas[&6].size_bytes
        }
    );
    assert!(!store.composed_records().unwrap().contains_key(&(5, 6)));
    // A snapshot of the target, smaller than the composed delta, wins.
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    store.put_snapshot(0, &snapshot(0)).unwrap();
    for version in 1..=3 {
        store.put_delta(&delta(version), None).unwrap();
    }
    let (plan, _) = store.composed_catch_up(0, 3).unwrap();
    let composed = store.composed_records().unwrap()[&(0, 3)].size_bytes;
    let snap = store.put_snapshot(3, &snapshot(3)).unwrap();
    let expected = if snap.size_bytes < composed {
        Plan::Snapshot {
            snapshot: 3,
            deltas: 4..4,
            bytes: snap.size_bytes,
        }
    } else {
        plan.clone()
    };
    assert_eq!(store.catch_up_plan(0).unwrap(), expected);
    // Over the wire a peer holding weights is never sent a snapshot: its plan weighs
    // only the composed delta against replaying. (This data's snapshot is the larger,
    // so the line checks the contract, not the case of a smaller snapshot.)
    assert_eq!(store.composed_catch_up_plan(0, 3).unwrap(), plan);
    assert!(matches!(
        store.composed_catch_up_plan(0, 9),
        Err(StoreError::NotFound { version: 9, .. })
    ));
}

#[test]
fn composed_deltas_are_kept_to_the_latest_version_only_and_go_with_their_base() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), 5);
    // One to an older target is built for whoever asks, and never kept.
    store.composed_artifact(1, 4).unwrap();
    assert!(store.composed_records().unwrap().is_empty());
    let (before, _) = store.composed_catch_up(1, 5).unwrap();
    assert!(matches!(before, Plan::Composed { .. }), "{before:?}");
    store.composed_catch_up(2, 5).unwrap();
    assert_eq!(files(&dir.path().join(COMPOSED)).len(), 2);

    // A prune keeps what a live actor's plan starts from, and drops the rest of what
    // spans pruned versions.
    let report = store.prune(2, &[1]).unwrap();
    assert!(report.composed.is_empty(), "{report:?}");
    assert_eq!(store.catch_up_plan(1).unwrap(), before);
    let report = store.prune(3, &[]).unwrap();
    assert_eq!(report.composed, vec![(1, 5), (2, 5)]);
    assert!(files(&dir.path().join(COMPOSED)).is_empty());

    // A newer version drops every composed delta to the older latest, at its put.
    store.composed_catch_up(3, 5).unwrap();
    assert_eq!(files(&dir.path().join(COMPOSED)).len(), 1);
    store.put_delta(&delta(6), None).unwrap();
    assert!(store.composed_records().unwrap().is_empty());
    assert!(files(&dir.path().join(COMPOSED)).is_empty());
    // An unrecorded file in composed/ (a crash before the commit) goes at open.
    fs::write(dir.path().join(COMPOSED).join("1-6-orphan.adelta"), b"x").unwrap();
    drop(store);
    Store::open(dir.path()).unwrap();
    assert!(files(&dir.path().join(COMPOSED)).is_empty());
}

#[test]
fn trainer_data_is_stored_immutable_verified_and_kept_across_reopen() {
    for (kind, file) in [
        (TrainerData::Rollouts, "rollouts/3-{}.json"),
        (TrainerData::State, "trainer/3-{}.state"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let batch = br#"[{"prompt":7,"completions":["12","13"]}]"#;
        let record = store.put_trainer_data(kind, 3, batch).unwrap();
        assert_eq!(record.hash, Hash::of(batch));
        // The same bytes again are a no-op; others for the same version a conflict.
        assert_eq!(store.put_trainer_data(kind, 3, batch).unwrap(), record);
        let error = store.put_trainer_data(kind, 3, b"[]").unwrap_err();
        assert!(
            matches!(error, StoreError::Conflict { kind: k, version: 3, .. } if k == kind.name()),
            "{error}"
        );
        assert!(matches!(
            store.trainer_data(kind, 4).unwrap_err(),
            StoreError::NotFound { kind: k, version: 4 } if k == kind.name()
        ));
        // The kinds are apart: one's record is not the other's.
        let other = TrainerData::ALL.into_iter().find(|k| *k != kind).unwrap();
        assert!(store.trainer_data(other, 3).is_err());
        drop(store);

        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.trainer_data(kind, 3).unwrap(), batch);
        assert_eq!(store.trainer_data_records(kind).unwrap()[&3], record);
        flip_byte_in_middle(
            &dir.path()
                .join(file.replace("{}", &record.hash.to_string())),
        );
        let error = store.trainer_data(kind, 3).unwrap_err();
        assert!(
            matches!(error, StoreError::Corrupted { kind: k, version: 3, .. } if k == kind.name()),
            "{error}"
        );
    }
}

#[test]
fn pruning_keeps_every_rollouts_and_the_newest_trainer_state() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    for version in 1..=4 {
        let bytes = version.to_string();
        for kind in TrainerData::ALL {
            store
                .put_trainer_data(kind, version, bytes.as_bytes())
                .unwrap();
        }
    }
    let report = store.prune(3, &[]).unwrap();
    assert_eq!(report.trainer_states, [1, 2]);
    let states = store.trainer_data_records(TrainerData::State).unwrap();
    assert_eq!(states.keys().copied().collect::<Vec<_>>(), [3, 4]);
    let rollouts = store.trainer_data_records(TrainerData::Rollouts).unwrap();
    assert_eq!(rollouts.len(), 4);
    assert_eq!(
        std::fs::read_dir(dir.path().join("trainer"))
            .unwrap()
            .count(),
        2
    );
    // Past every version, only the newest state is left.
    assert_eq!(store.prune(10, &[]).unwrap().trainer_states, [3]);
}

#[test]
fn a_catalog_of_schema_1_is_upgraded_and_keeps_its_records() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    store
        .put_trainer_data(TrainerData::Rollouts, 1, b"[]")
        .unwrap();
    drop(store);
    {
        let db = Database::create(dir.path().join(CATALOG)).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(SCHEMA_TABLE)
            .unwrap()
            .insert("version", 1)
            .unwrap();
        txn.delete_table(TrainerData::State.table()).unwrap();
        replace_with_unsigned_deltas(&txn, &[]);
        txn.commit().unwrap();
    }
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.trainer_data(TrainerData::Rollouts, 1).unwrap(), b"[]");
    assert!(
        store
            .trainer_data_records(TrainerData::State)
            .unwrap()
            .is_empty()
    );
    drop(store);
    let db = Database::create(dir.path().join(CATALOG)).unwrap();
    let txn = db.begin_read().unwrap();
    let table = txn.open_table(SCHEMA_TABLE).unwrap();
    assert_eq!(
        table.get("version").unwrap().unwrap().value(),
        SCHEMA_VERSION
    );
}

#[test]
fn a_rollouts_file_the_catalog_does_not_list_is_removed_on_open() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path()).unwrap());
    let stray = dir.path().join("rollouts").join("9-stray.json");
    std::fs::write(&stray, b"[]").unwrap();
    drop(Store::open(dir.path()).unwrap());
    assert!(!stray.exists());
}

#[test]
fn a_catalog_of_another_schema_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path()).unwrap());
    for (version, says) in [
        (SCHEMA_VERSION + 1, "written by a newer aurora"),
        (0, "not one aurora wrote"),
    ] {
        {
            let db = Database::create(dir.path().join(CATALOG)).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(SCHEMA_TABLE)
                .unwrap()
                .insert("version", version)
                .unwrap();
            txn.commit().unwrap();
        }
        let error = Store::open(dir.path()).err().expect("refused").to_string();
        assert!(
            error.contains(&format!("schema version {version}")) && error.contains(says),
            "{error}"
        );
    }
}

/// Makes the deltas table what it was before schema 3 (no signatures), holding `records`.
fn replace_with_unsigned_deltas(txn: &redb::WriteTransaction, records: &[DeltaRecord]) {
    txn.delete_table(crate::catalog::DELTA_TABLE).unwrap();
    let mut table = txn
        .open_table(crate::catalog::UNSIGNED_DELTA_TABLE)
        .unwrap();
    for r in records {
        let value = (
            r.base_version,
            r.id.0,
            r.base_hash.0,
            r.target_hash.0,
            r.size_bytes,
        );
        table.insert(r.version, value).unwrap();
    }
}

#[test]
fn a_delta_keeps_its_signature() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let signature = aurora_delta::ArtifactSignature([0x5a; 64]);
    let signed = store.put_delta(&delta(1), Some(signature)).unwrap();
    assert_eq!(signed.signature, Some(signature));
    let unsigned = store.put_delta(&delta(2), None).unwrap();
    drop(store);
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.delta_record(1).unwrap(), signed);
    assert_eq!(store.delta_record(2).unwrap(), unsigned);
    assert_eq!(store.records().unwrap().0[&1].signature, Some(signature));
}

#[test]
fn a_catalog_of_schema_2_is_upgraded_and_its_deltas_stay_readable_unsigned() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), 2);
    let (records, _) = store.records().unwrap();
    let records: Vec<DeltaRecord> = records.into_values().collect();
    drop(store);
    {
        let db = Database::create(dir.path().join(CATALOG)).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(SCHEMA_TABLE)
            .unwrap()
            .insert("version", 2)
            .unwrap();
        replace_with_unsigned_deltas(&txn, &records);
        txn.commit().unwrap();
    }
    let store = Store::open(dir.path()).unwrap();
    for record in &records {
        assert_eq!(store.delta_record(record.version).unwrap(), *record);
        assert_eq!(record.signature, None);
        store.delta(record.version).unwrap();
    }
    // The upgraded catalog takes signed deltas.
    let signature = aurora_delta::ArtifactSignature([1; 64]);
    let third = store.put_delta(&delta(3), Some(signature)).unwrap();
    assert_eq!(store.delta_record(3).unwrap(), third);
}

#[test]
fn a_store_has_one_run_id_for_life_and_two_stores_have_two() {
    let dir = tempfile::tempdir().unwrap();
    let first = Store::open(dir.path()).unwrap();
    let run = first.run_id();
    assert!(run.is_known());
    drop(first);
    assert_eq!(Store::open(dir.path()).unwrap().run_id(), run);
    let other = tempfile::tempdir().unwrap();
    assert_ne!(Store::open(other.path()).unwrap().run_id(), run);
}

#[test]
fn a_catalog_of_schema_3_gets_a_run_id_and_its_deltas_lose_their_signatures() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let signature = aurora_delta::ArtifactSignature([0x5a; 64]);
    store.put_delta(&delta(1), Some(signature)).unwrap();
    drop(store);
    {
        // What schema 3 was: this layout without the run table.
        let db = Database::create(dir.path().join(CATALOG)).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(SCHEMA_TABLE)
            .unwrap()
            .insert("version", 3)
            .unwrap();
        txn.delete_table(crate::catalog::RUN_TABLE).unwrap();
        txn.commit().unwrap();
    }
    let store = Store::open(dir.path()).unwrap();
    assert!(store.run_id().is_known());
    // Made over a statement without a run, it verifies for no run: it is dropped.
    let record = store.delta_record(1).unwrap();
    assert_eq!(record.signature, None);
    store.delta(1).unwrap();
}

#[test]
fn a_snapshot_is_rebuilt_from_the_previous_one_and_the_deltas_since() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), 4);
    store.put_snapshot(2, &snapshot(2)).unwrap();
    let record = store.put_snapshot_rebuilt(4).unwrap();
    assert_eq!(
        record.weights_hash,
        owned_checkpoint(&weights(0.0, 4)).unwrap().weights_hash()
    );
    assert_eq!(store.snapshot(4).unwrap().bytes(), &snapshot(4)[..]);
    // Nothing to rebuild from past the latest delta.
    assert!(store.put_snapshot_rebuilt(5).is_err());
}
