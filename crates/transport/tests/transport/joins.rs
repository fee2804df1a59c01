//! Joins over the wire: an actor with no weights takes a snapshot from the hub, or from a
//! relay that keeps one for its region, resumes it across cuts, and keeps up after it.

use super::*;

/// Segments of the snapshot artifacts [`snapshot_hub`] serves: small, so a snapshot of
/// the test chain's model has several.
const SNAPSHOT_SEGMENT_BYTES: usize = 16 << 10;

/// A hub whose store (in the returned directory) holds the snapshot of `chain`'s version
/// 0, which it serves to joiners.
pub(crate) async fn snapshot_hub(chain: &Chain) -> (tempfile::TempDir, Arc<Store>, NodeHandle) {
    store_hub(Some(&chain.images[0])).await
}

/// A hub whose store holds the snapshot of version 0 if it is given.
async fn store_hub(v0: Option<&[u8]>) -> (tempfile::TempDir, Arc<Store>, NodeHandle) {
    let root = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(root.path()).unwrap());
    if let Some(image) = v0 {
        store.put_snapshot(0, image).unwrap();
    }
    let mut hub_config = config(Role::Hub, "hub", &[]);
    hub_config.snapshot_segment_bytes = SNAPSHOT_SEGMENT_BYTES;
    let hub = spawn_hub(hub_config, Some(store.clone())).await.unwrap();
    (root, store, hub)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_with_no_weights_joins_over_the_wire_resumes_its_snapshot_and_keeps_up() {
    const VERSIONS: u64 = 8;
    let chain = Chain::new(VERSIONS, 21);
    let (_root, store, hub) = snapshot_hub(&chain).await;
    let hub_address = hub.local_addr().unwrap();
    let relay = connected_relay(config(Role::Relay, "relay", &[hub_address])).await;
    let relay_address = relay.local_addr().unwrap();
    let veteran = idle_actor(
        actor_config(&hub, "veteran", &[relay_address, hub_address]),
        chain.weights(0),
    )
    .await;
    within(LIMIT, "connect", veteran.wait_for(|s| s.connected))
        .await
        .unwrap();
    for version in 1..=3 {
        chain.publish_live(&hub, version).await;
    }
    active_at(&veteran, 3, "the veteran").await;
    // A snapshot put behind the hub's back, as the trainer does.
    store.put_snapshot(3, &chain.images[3]).unwrap();
    hub.store_changed().await.unwrap();

    let snapshot_segments = aurora_delta::DeltaFile::parse(
        store
            .snapshot_artifact(3, SNAPSHOT_SEGMENT_BYTES)
            .unwrap()
            .bytes(),
    )
    .unwrap()
    .segment_count();
    assert!(snapshot_segments >= 4, "{snapshot_segments} segments");
    let cut_at = snapshot_segments / 2;
    let proxy = Proxy::start(hub_address, Fault::CutInSegment { nth: cut_at }).await;
    // The region's relay first: it keeps no snapshot, so the newcomer falls back to
    // the hub (through a proxy that cuts its only stream once, mid-snapshot), then
    // returns to the relay for the deltas.
    let mut newcomer_config = actor_config(&hub, "newcomer", &[relay_address, proxy.address]);
    newcomer_config.streams = 1;
    let engine = Arc::new(IdleEngine::default());
    let newcomer = spawn_joining_actor(newcomer_config, engine.clone())
        .await
        .unwrap();
    assert_eq!(
        newcomer.status().active,
        None,
        "no weights until the snapshot"
    );
    // The relay turned it away, then the cut ended its session with the hub; it comes
    // back (after the relay again, and backoffs) with a new session.
    within(
        LIMIT,
        "the cut",
        newcomer.wait_for(|s| s.upstream_switches >= 2),
    )
    .await
    .unwrap();
    assert!(proxy.fired.load(std::sync::atomic::Ordering::SeqCst));
    within(
        LIMIT,
        "the hub drops the cut session",
        hub.wait_for(|s| s.subscribers == 1),
    )
    .await
    .unwrap();
    let held = newcomer.status().receiver.unwrap().segments as usize;
    assert!(held < snapshot_segments, "the cut came mid-snapshot");
    let sent_before = hub.status().sender.unwrap().segments_sent;
    active_at(&newcomer, 3, "the newcomer joins").await;
    assert_eq!(
        hub.status().sender.unwrap().segments_sent - sent_before,
        (snapshot_segments - held) as u64,
        "the new session sent only the segments it did not hold"
    );

    for version in 4..=VERSIONS {
        chain.publish_live(&hub, version).await;
    }
    held_at(&relay, VERSIONS, "relay").await;
    for (node, name) in [(&veteran, "veteran"), (&newcomer, "newcomer")] {
        let status = active_at(node, VERSIONS, name).await;
        assert_eq!(status.active, Some(chain.at(VERSIONS)), "{name}");
        assert_eq!(status.failed_activations, 0, "{name}");
    }
    assert_eq!(
        engine.activations(),
        (3..=VERSIONS).map(|v| chain.at(v)).collect::<Vec<_>>(),
        "the snapshot of 3 first, then every delta after it"
    );
    let status = newcomer.status();
    assert_eq!(status.upstream, Some(relay_address), "back on its relay");
    assert!(
        status.upstream_switches >= 4,
        "the relay, the cut, the relay again, back to the relay: {}",
        status.upstream_switches
    );
    let deltas: usize = (4..=VERSIONS).map(|v| chain.segments(v)).sum();
    let received = status.receiver.unwrap();
    assert_eq!(
        received.segments,
        (snapshot_segments + deltas) as u64,
        "every segment accepted once"
    );
    assert_eq!(received.duplicates, 0, "nothing it held was sent again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_with_a_snapshot_directory_serves_its_region_s_joins_from_one_copy() {
    let chain = Chain::new(3, 31);
    let (_root, store, hub) = snapshot_hub(&chain).await;
    let hub_address = hub.local_addr().unwrap();
    let kept = tempfile::tempdir().unwrap();
    let mut relay_config = config(Role::Relay, "relay", &[hub_address]);
    relay_config.snapshot_dir = Some(kept.path().to_path_buf());
    // Not waited for: joiners that say Hello before the relay's upstream has named the
    // snapshot wait for it, rather than being sent to the hub.
    let relay = aurora_transport::spawn_relay(relay_config).await.unwrap();
    let relay_address = relay.local_addr().unwrap();
    let mut joiners = Vec::new();
    for name in ["j1", "j2"] {
        let joiner_config = actor_config(&hub, name, &[relay_address, hub_address]);
        let engine = Arc::new(IdleEngine::default());
        let joiner = spawn_joining_actor(joiner_config, engine).await.unwrap();
        joiners.push((name, joiner));
    }
    for (name, joiner) in &joiners {
        active_at(joiner, 0, name).await;
    }
    let snapshot = store.snapshot_artifact(0, SNAPSHOT_SEGMENT_BYTES).unwrap();
    let snapshot_segments = aurora_delta::DeltaFile::parse(snapshot.bytes())
        .unwrap()
        .segment_count() as u64;
    let sent = || hub.status().sender.unwrap().segments_sent;
    assert_eq!(
        sent(),
        snapshot_segments,
        "one copy of the snapshot, the relay's"
    );

    for version in 1..=3 {
        chain.publish_live(&hub, version).await;
    }
    for (name, joiner) in &joiners {
        let status = active_at(joiner, 3, name).await;
        assert_eq!(status.active, Some(chain.at(3)), "{name}");
        assert_eq!(status.upstream, Some(relay_address), "{name}");
        assert_eq!(status.upstream_switches, 0, "{name} never left its relay");
    }
    let deltas: u64 = (1..=3).map(|v| chain.segments(v) as u64).sum();
    assert_eq!(
        sent(),
        snapshot_segments + deltas,
        "and one copy of each delta"
    );
    assert_eq!(
        std::fs::read_dir(kept.path()).unwrap().count(),
        0,
        "the file the snapshot is kept in has no name"
    );

    // A directory it cannot keep a snapshot in stops a relay as it starts, naming it.
    let mut unusable = config(Role::Relay, "relay2", &[hub_address]);
    let missing = kept.path().join("missing");
    unusable.snapshot_dir = Some(missing.clone());
    let Err(error) = aurora_transport::spawn_relay(unusable).await else {
        panic!("a relay started without a place for its snapshot");
    };
    let error = format!("{error}: {}", std::error::Error::source(&error).unwrap());
    assert!(error.contains(&missing.display().to_string()), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_takes_a_newer_snapshot_before_the_deltas_after_its_own_outgrow_it() {
    const VERSIONS: u64 = 150;
    let chain = Chain::sparse(VERSIONS, 41);
    let (_root, store, hub) = snapshot_hub(&chain).await;
    let kept = tempfile::tempdir().unwrap();
    let mut relay_config = config(Role::Relay, "relay", &[hub.local_addr().unwrap()]);
    relay_config.snapshot_dir = Some(kept.path().to_path_buf());
    let relay = connected_relay(relay_config).await;
    held_at(&relay, 0, "the relay takes the snapshot of 0").await;
    // A peer of the region joins: the relay's snapshot is worth keeping fresh.
    let first = Arc::new(IdleEngine::default());
    let first_config = actor_config(&hub, "first", &[relay.local_addr().unwrap()]);
    let first_joiner = spawn_joining_actor(first_config, first.clone())
        .await
        .unwrap();
    active_at(&first_joiner, 0, "the first joiner").await;
    for version in 1..=2 {
        chain.publish_live(&hub, version).await;
    }
    held_at(&relay, 2, "relay").await;
    // The trainer stores a newer snapshot. The relay takes it, on a session of its own,
    // once the deltas after its own have grown to half its size.
    store.put_snapshot(2, &chain.images[2]).unwrap();
    hub.store_changed().await.unwrap();
    let mut version = 2;
    while relay.status().kept_snapshot != Some(2) {
        version += 1;
        assert!(
            version <= VERSIONS,
            "no newer snapshot taken: {:?}",
            relay.status().kept_snapshot
        );
        chain.publish_live(&hub, version).await;
        held_at(&relay, version, "relay").await;
    }
    assert!(
        version > 4,
        "the deltas came to half a snapshot at once: {version}"
    );
    // A joiner takes the newer snapshot from the relay, then the deltas after it.
    let engine = Arc::new(IdleEngine::default());
    let joiner_config = actor_config(&hub, "joiner", &[relay.local_addr().unwrap()]);
    let joiner = spawn_joining_actor(joiner_config, engine.clone())
        .await
        .unwrap();
    let status = active_at(&joiner, version, "joiner").await;
    assert_eq!(status.active, Some(chain.at(version)));
    assert_eq!(
        engine.activations().first(),
        Some(&chain.at(2)),
        "the newer snapshot first"
    );
    assert_eq!(engine.activations().len() as u64, version - 1);
    assert_eq!(
        active_at(&first_joiner, version, "the first joiner")
            .await
            .active,
        Some(chain.at(version))
    );
}

/// A relay that keeps no snapshot (its upstream offered none when it started, as after a
/// withdrawal) takes one once it has welcomed a joiner without one, with the deltas
/// after it that it no longer holds from its fetcher, and serves the next joiners.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_without_a_snapshot_takes_one_once_a_joiner_asks_and_serves_the_next() {
    let chain = Chain::new(8, 43);
    let (_root, store, hub) = store_hub(None).await;
    let hub_address = hub.local_addr().unwrap();
    let kept = tempfile::tempdir().unwrap();
    let mut relay_config = config(Role::Relay, "relay", &[hub_address]);
    relay_config.snapshot_dir = Some(kept.path().to_path_buf());
    let relay = connected_relay(relay_config).await;
    let relay_address = relay.local_addr().unwrap();
    for version in 1..=7 {
        chain.publish_live(&hub, version).await;
    }
    held_at(&relay, 7, "relay").await;
    store.put_snapshot(2, &chain.images[2]).unwrap();
    hub.store_changed().await.unwrap();
    assert_eq!(relay.status().kept_snapshot, None);

    // The first joiner finds none at the relay and takes the hub's.
    let first_config = actor_config(&hub, "first", &[relay_address, hub_address]);
    let first = spawn_joining_actor(first_config, Arc::new(IdleEngine::default()))
        .await
        .unwrap();
    active_at(&first, 7, "the first joiner").await;
    // At its next version the relay takes the hub's snapshot of 2, and the deltas after
    // it up to its own newest: it holds only the four newest (5 to 8) itself.
    chain.publish_live(&hub, 8).await;
    within(
        LIMIT,
        "the relay keeps the hub's snapshot",
        relay.wait_for(|s| s.kept_snapshot == Some(2)),
    )
    .await
    .unwrap();

    // The next joiner knows only the relay.
    let engine = Arc::new(IdleEngine::default());
    let next_config = actor_config(&hub, "next", &[relay_address]);
    let next = spawn_joining_actor(next_config, engine.clone())
        .await
        .unwrap();
    let status = active_at(&next, 8, "the next joiner").await;
    assert_eq!(status.active, Some(chain.at(8)));
    assert_eq!(engine.activations().first(), Some(&chain.at(2)));
    assert_eq!(engine.activations().len(), 7, "the snapshot, then 3 to 8");
    assert_eq!(status.upstream_switches, 0);
}
