//! The transport on real sockets (loopback): a hub, relays and actors as tokio tasks,
//! faults injected by a proxy that understands frames or by killing nodes.

mod util;

use std::sync::Arc;
use std::time::Duration;

use aurora_delta::{Checkpoint, ExtractOptions, Extraction, TargetHash};
use aurora_proto::Role;
use aurora_store::Store;
use aurora_transport::{
    COMPLETED_SHOWN, IdleEngine, NodeHandle, Security, TransportError, spawn_actor, spawn_hub,
    spawn_joining_actor,
};
use util::{
    Chain, Fault, Proxy, active_at, actor_config, config, connected_relay, held_at, idle_actor,
    trainer_key, within,
};

#[path = "transport/changes_first.rs"]
mod changes_first;
#[path = "transport/joins.rs"]
mod joins;

use joins::*;

pub(crate) const LIMIT: Duration = Duration::from_secs(60);

pub(crate) async fn hub(store: Option<Arc<Store>>) -> NodeHandle {
    spawn_hub(config(Role::Hub, "hub", &[]), store)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hub_two_relays_six_actors_end_identical_over_ten_versions() {
    const VERSIONS: u64 = 10;
    let chain = Chain::new(VERSIONS, 3);
    let hub = hub(None).await;
    let hub_address = hub.local_addr().unwrap();
    let mut relays = Vec::new();
    for name in ["relay-eu", "relay-us"] {
        // Connected before the first version, so each region's copy comes through it.
        relays.push(connected_relay(config(Role::Relay, name, &[hub_address])).await);
    }
    let mut actors = Vec::new();
    for index in 0..6 {
        let relay = relays[index % 2].local_addr().unwrap();
        let engine = Arc::new(IdleEngine::default());
        let name = format!("actor{index}");
        let actor = spawn_actor(
            actor_config(&hub, &name, &[relay, hub_address]),
            chain.weights(0),
            engine.clone(),
        )
        .await
        .unwrap();
        actors.push((actor, engine));
    }
    for (actor, _) in &actors {
        within(LIMIT, "actor connects", actor.wait_for(|s| s.connected))
            .await
            .unwrap();
    }
    for version in 1..=VERSIONS {
        chain.publish_live(&hub, version).await;
    }
    for relay in &relays {
        let status = held_at(relay, VERSIONS, "relay").await;
        assert_eq!(status.completed, (1..=VERSIONS).collect::<Vec<_>>());
        assert_eq!(status.active, None, "a relay holds no weights");
    }
    for (index, (actor, engine)) in actors.iter().enumerate() {
        let status = active_at(actor, VERSIONS, &format!("actor{index}")).await;
        assert_eq!(status.active, Some(chain.at(VERSIONS)));
        // Every version activated once, in order, with the hub's weights.
        let expected: Vec<_> = (1..=VERSIONS).map(|v| chain.at(v)).collect();
        assert_eq!(engine.activations(), expected, "actor{index}");
        assert_eq!(status.failed_activations, 0);
        assert_eq!(status.receiver.unwrap().duplicates, 0);
    }
    // Cut-through relays: the hub sent one copy of every segment per region.
    let segments: usize = (1..=VERSIONS).map(|v| chain.segments(v)).sum();
    let hub_sent = hub.status().sender.unwrap().segments_sent;
    assert_eq!(hub_sent, 2 * segments as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_s_status_keeps_only_its_recent_completed_versions() {
    let versions = COMPLETED_SHOWN as u64 + 6;
    let chain = Chain::new(versions, 11);
    let hub = hub(None).await;
    let relay = connected_relay(config(Role::Relay, "relay", &[hub.local_addr().unwrap()])).await;
    // One version at a time: a hub keeps its last few deltas, and a relay that holds
    // nothing yet starts again at the newest when it falls further behind than that.
    for version in 1..=versions {
        chain.publish_live(&hub, version).await;
        held_at(&relay, version, "relay").await;
    }
    let status = relay.status();
    let first = versions - COMPLETED_SHOWN as u64 + 1;
    assert_eq!(status.completed, (first..=versions).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_delta_streams_before_its_target_hash_and_seals_with_it() {
    let chain = Chain::new(1, 5);
    let hub = Arc::new(hub(None).await);
    let actor = Arc::new(
        idle_actor(
            actor_config(&hub, "a1", &[hub.local_addr().unwrap()]),
            chain.weights(0),
        )
        .await,
    );
    within(LIMIT, "connect", actor.wait_for(|s| s.connected))
        .await
        .unwrap();
    let runtime = tokio::runtime::Handle::current();
    let (publisher, watcher) = (hub.clone(), actor.clone());
    let images = (chain.images[0].clone(), chain.images[1].clone());
    let expected = chain.at(1);
    let published = tokio::task::spawn_blocking(move || {
        let base = Checkpoint::from_safetensors(&images.0).unwrap();
        let target = Checkpoint::from_safetensors(&images.1).unwrap();
        let options = ExtractOptions {
            base_version: 0,
            target_version: 1,
            segment_target_bytes: 1024,
            target_hash: TargetHash::Later,
            ..ExtractOptions::default()
        };
        let extraction = Extraction::new(&base, &target, options).unwrap();
        let segments = extraction.to_bytes().unwrap().0.segments.len() as u64;
        assert!(segments > 1);
        // The hash is held back until the actor holds every segment: they do not wait
        // for it. Nothing is complete without the Seal.
        let target_hash = || {
            let status = runtime.block_on(within(
                LIMIT,
                "every segment before the hash",
                watcher.wait_for(|s| s.receiver.as_ref().is_some_and(|r| r.segments == segments)),
            ));
            let status = status.unwrap();
            assert!(status.completed.is_empty(), "completed before its Seal");
            Ok::<_, TransportError>(target.weights_hash())
        };
        publisher.publish_delta(&extraction, target_hash)
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(published.header.target_hash, expected.hash);
    hub.commit(expected).await.unwrap();
    let status = active_at(&actor, 1, "a1").await;
    assert_eq!(status.active, Some(expected));
    assert_eq!(status.receiver.unwrap().duplicates, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actors_of_a_relay_killed_mid_transfer_fall_back_and_finish_without_starting_over() {
    let chain = Chain::new(4, 5);
    let hub = hub(None).await;
    let hub_address = hub.local_addr().unwrap();
    let relay = connected_relay(config(Role::Relay, "relay", &[hub_address])).await;
    let relay_address = relay.local_addr().unwrap();
    let mut actors = Vec::new();
    for name in ["a1", "a2"] {
        let actor = idle_actor(
            actor_config(&hub, name, &[relay_address, hub_address]),
            chain.weights(0),
        )
        .await;
        actors.push(actor);
    }
    for actor in &actors {
        within(LIMIT, "connect", actor.wait_for(|s| s.connected))
            .await
            .unwrap();
    }
    for version in 1..=3 {
        chain.publish_live(&hub, version).await;
    }
    for actor in &actors {
        active_at(actor, 3, "before the kill").await;
    }
    let before: Vec<u64> = actors
        .iter()
        .map(|a| a.status().receiver.unwrap().segments)
        .collect();
    let total = chain.segments(4);
    let half = total / 2;
    chain.publish_part(&hub, 4, 0..half).await;
    for (actor, before) in actors.iter().zip(&before) {
        within(
            LIMIT,
            "half of version 4 through the relay",
            actor.wait_for(|s| s.receiver.as_ref().unwrap().segments >= before + half as u64),
        )
        .await
        .unwrap();
    }
    relay.kill();
    chain.publish_part(&hub, 4, half..total).await;
    chain.seal(&hub, 4).await;
    for (actor, before) in actors.iter().zip(&before) {
        let status = active_at(actor, 4, "after the kill").await;
        assert_eq!(status.active, Some(chain.at(4)));
        assert!(status.upstream_switches >= 1);
        assert_eq!(status.upstream, Some(hub_address), "fell back to the hub");
        let stats = status.receiver.unwrap();
        assert_eq!(
            stats.segments - before,
            total as u64,
            "each segment of version 4 arrived once: nothing started over"
        );
        assert_eq!(stats.duplicates, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_mid_segment_resumes_with_only_the_missing_segments() {
    let chain = Chain::new(1, 7);
    let hub = hub(None).await;
    let proxy = Proxy::start(hub.local_addr().unwrap(), Fault::CutInSegment { nth: 3 }).await;
    let actor = idle_actor(actor_config(&hub, "a1", &[proxy.address]), chain.weights(0)).await;
    // Every stream up first: the cut must leave the session others to go on with.
    within(LIMIT, "connect", actor.all_streams_up())
        .await
        .unwrap();
    hub.publish(chain.delta(1).clone()).await.unwrap();
    hub.commit(chain.at(1)).await.unwrap();
    let status = active_at(&actor, 1, "after the cut").await;
    assert!(proxy.fired.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(status.active, Some(chain.at(1)));
    let received = status.receiver.unwrap();
    let total = chain.segments(1) as u64;
    assert_eq!(
        received.segments, total,
        "every segment accepted exactly once"
    );
    assert_eq!(
        received.duplicates, 0,
        "nothing the actor held was sent again"
    );
    assert_eq!(
        received.sessions, 1,
        "the session survived on its other stream"
    );
    let sent = hub.status().sender.unwrap();
    assert!(
        sent.segments_sent > total,
        "the segments lost with the stream were sent again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_flipped_in_flight_is_detected_re_requested_and_never_staged() {
    let chain = Chain::new(1, 9);
    let hub = hub(None).await;
    let proxy = Proxy::start(hub.local_addr().unwrap(), Fault::FlipSegment { nth: 2 }).await;
    let engine = Arc::new(IdleEngine::default());
    let actor = spawn_actor(
        actor_config(&hub, "a1", &[proxy.address]),
        chain.weights(0),
        engine.clone(),
    )
    .await
    .unwrap();
    within(LIMIT, "connect", actor.wait_for(|s| s.connected))
        .await
        .unwrap();
    hub.publish(chain.delta(1).clone()).await.unwrap();
    hub.commit(chain.at(1)).await.unwrap();
    let status = active_at(&actor, 1, "after the flip").await;
    assert!(proxy.fired.load(std::sync::atomic::Ordering::SeqCst));
    let received = status.receiver.unwrap();
    assert_eq!(received.corrupt, 1, "the flipped segment was detected");
    assert_eq!(received.nacks_sent, 1, "and asked for again");
    assert_eq!(hub.status().sender.unwrap().nacks, 1);
    assert_eq!(status.failed_activations, 0);
    assert_eq!(engine.activations(), [chain.at(1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_actor_catches_up_in_one_composed_delta_from_the_store() {
    let chain = Chain::new(8, 11);
    let root = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(root.path()).unwrap());
    store.put_snapshot(0, &chain.images[0]).unwrap();
    let mut hub_config = config(Role::Hub, "hub", &[]);
    hub_config.retain_versions = 2;
    let hub = spawn_hub(hub_config, Some(store.clone())).await.unwrap();
    let hub_address = hub.local_addr().unwrap();
    let mut relay_config = config(Role::Relay, "relay", &[hub_address]);
    relay_config.retain_versions = 2;
    let relay = connected_relay(relay_config).await;
    let relay_address = relay.local_addr().unwrap();
    let a1_config = actor_config(&hub, "a1", &[relay_address, hub_address]);
    let actor = idle_actor(a1_config.clone(), chain.weights(0)).await;
    // Another actor of the relay that stays up throughout.
    let steady_engine = Arc::new(IdleEngine::default());
    let steady = spawn_actor(
        actor_config(&hub, "a2", &[relay_address, hub_address]),
        chain.weights(0),
        steady_engine.clone(),
    )
    .await
    .unwrap();
    for node in [&actor, &steady] {
        within(LIMIT, "connect", node.wait_for(|s| s.connected))
            .await
            .unwrap();
    }
    for version in 1..=3 {
        chain.publish_live(&hub, version).await;
    }
    active_at(&actor, 3, "before the crash").await;
    actor.kill();
    within(
        LIMIT,
        "the relay sees the crash",
        relay.wait_for(|s| s.subscribers == 1),
    )
    .await
    .unwrap();
    for version in 4..=8 {
        chain.publish_live(&hub, version).await;
    }
    held_at(&relay, 8, "relay").await;
    // The actor comes back with the weights it had: version 3. Neither the relay nor the
    // hub hold version 4 in memory any more. The hub's store plans the catch-up by
    // bytes: one composed delta from 3 to 8 costs less than D(4..=8).
    let engine = Arc::new(IdleEngine::default());
    let restarted = spawn_actor(a1_config, chain.weights(3), engine.clone())
        .await
        .unwrap();
    let status = active_at(&restarted, 8, "after the restart").await;
    assert_eq!(status.active, Some(chain.at(8)));
    assert_eq!(
        engine.activations(),
        [chain.at(8)],
        "versions 4 to 7 are skipped"
    );
    assert_eq!(status.completed, [8], "one artifact: the composed delta");
    assert!(
        status.upstream_switches >= 1,
        "the relay no longer had version 4"
    );
    let hub_status = hub.status();
    assert_eq!(hub_status.sender.unwrap().composed_offers, 1);
    let composed = store.composed_records().unwrap();
    let replay: u64 = (4..=8).map(|v| chain.delta(v).len() as u64).sum();
    assert!(composed[&(3, 8)].size_bytes < replay);
    assert_eq!(store.latest_version().unwrap(), Some(8));
    // The relay's other actor followed every version as before.
    let steady_status = active_at(&steady, 8, "steady").await;
    assert_eq!(steady_status.active, Some(chain.at(8)));
    assert_eq!(
        steady_engine.activations(),
        (1..=8).map(|v| chain.at(v)).collect::<Vec<_>>()
    );
}

/// Waits until `actor` has a session with `upstream`.
/// Waits until `node` serves exactly `count` sessions: an actor that went back to its relay
/// has closed its hub session, but the hub may not have read the close yet and would send
/// it the next version too.
async fn serving(node: &NodeHandle, count: usize, what: &str) {
    within(LIMIT, what, node.wait_for(|s| s.subscribers == count))
        .await
        .unwrap();
}

async fn connected_to(actor: &NodeHandle, upstream: std::net::SocketAddr, what: &str) {
    within(
        LIMIT,
        what,
        actor.wait_for(|s| s.connected && s.upstream == Some(upstream)),
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actors_that_fell_back_to_the_hub_return_to_their_relay_once_it_is_back() {
    let chain = Chain::new(3, 17);
    let hub = hub(None).await;
    let hub_address = hub.local_addr().unwrap();
    let relay = connected_relay(config(Role::Relay, "relay", &[hub_address])).await;
    // The actors reach their relay through a link that can go down.
    let link = Proxy::start(relay.local_addr().unwrap(), Fault::None).await;
    let mut actors = Vec::new();
    for name in ["a1", "a2"] {
        let mut actor_config = actor_config(&hub, name, &[link.address, hub_address]);
        actor_config.return_after = Some(Duration::from_millis(200));
        actors.push(idle_actor(actor_config, chain.weights(0)).await);
    }
    for actor in &actors {
        connected_to(actor, link.address, "on the relay").await;
    }
    chain.publish_live(&hub, 1).await;
    for actor in &actors {
        active_at(actor, 1, "through the relay").await;
    }
    link.partition();
    for actor in &actors {
        connected_to(actor, hub_address, "fell back to the hub").await;
    }
    chain.publish_live(&hub, 2).await;
    for actor in &actors {
        active_at(actor, 2, "from the hub").await;
    }
    link.heal();
    for actor in &actors {
        connected_to(actor, link.address, "back on the relay").await;
    }
    serving(&hub, 1, "the hub serves the relay alone").await;
    // The region's copy comes through the relay again: the hub sends version 3 once.
    let sent = || hub.status().sender.unwrap().segments_sent;
    let before = sent();
    chain.publish_live(&hub, 3).await;
    for actor in &actors {
        let status = active_at(actor, 3, "through the relay again").await;
        assert_eq!(status.active, Some(chain.at(3)));
    }
    assert_eq!(sent() - before, chain.segments(3) as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_actors_of_a_relay_cut_off_from_the_hub_fetch_from_the_hub_then_come_back() {
    let chain = Chain::new(3, 19);
    let hub = hub(None).await;
    let hub_address = hub.local_addr().unwrap();
    // The relay reaches the hub through a link that can go down; its actors reach both.
    let link = Proxy::start(hub_address, Fault::None).await;
    let mut relay_config = config(Role::Relay, "relay", &[link.address]);
    relay_config.relay_suspend_after = Some(Duration::from_millis(300));
    let relay = connected_relay(relay_config).await;
    let relay_address = relay.local_addr().unwrap();
    let mut actor_config = actor_config(&hub, "a1", &[relay_address, hub_address]);
    actor_config.return_after = Some(Duration::from_millis(300));
    let actor = idle_actor(actor_config, chain.weights(0)).await;
    connected_to(&actor, relay_address, "on the relay").await;
    chain.publish_live(&hub, 1).await;
    active_at(&actor, 1, "through the relay").await;
    link.partition();
    chain.publish_live(&hub, 2).await;
    active_at(&actor, 2, "while the relay is cut off").await;
    assert!(
        !relay.status().completed.contains(&2),
        "version 2 came from the hub: the relay has not got it"
    );
    link.heal();
    held_at(&relay, 2, "the relay back").await;
    connected_to(&actor, relay_address, "back on the relay").await;
    serving(&hub, 1, "the hub serves the relay alone").await;
    let sent = || hub.status().sender.unwrap().segments_sent;
    let before = sent();
    chain.publish_live(&hub, 3).await;
    active_at(&actor, 3, "through the relay again").await;
    assert_eq!(
        sent() - before,
        chain.segments(3) as u64,
        "one copy, the relay's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_whose_relay_withholds_committed_versions_fetches_them_from_the_hub() {
    let chain = Chain::new(2, 23);
    let hub = hub(None).await;
    let hub_address = hub.local_addr().unwrap();
    // Its first upstream keeps the session alive and passes on no version.
    let withholding = Proxy::start(hub_address, Fault::Withhold).await;
    let mut actor_config = actor_config(&hub, "a1", &[withholding.address, hub_address]);
    actor_config.behind_timeout = Duration::from_millis(300);
    actor_config.return_after = Some(Duration::from_millis(300));
    let actor = idle_actor(actor_config, chain.weights(0)).await;
    connected_to(&actor, withholding.address, "on the withholding relay").await;
    for version in 1..=2 {
        chain.publish_live(&hub, version).await;
        // The control plane says so (an actor's node passes on what its claims learn).
        actor.expect_committed(version).await.unwrap();
        let status = active_at(&actor, version, "from the hub").await;
        assert_eq!(status.active, Some(chain.at(version)));
        // The return policy tries the relay again.
        connected_to(&actor, withholding.address, "back on the relay").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_cut_off_longer_than_its_upstream_keeps_deltas_follows_on_from_the_newest() {
    // A hub without a store (the benchmark fleet's) keeps only its last deltas: one with
    // a store serves every version from it and never tells a relay one is gone.
    let chain = Chain::new(9, 13);
    let mut hub_config = config(Role::Hub, "hub", &[]);
    hub_config.retain_versions = 2;
    let hub = spawn_hub(hub_config, None).await.unwrap();
    let link = Proxy::start(hub.local_addr().unwrap(), Fault::None).await;
    let relay = connected_relay(config(Role::Relay, "relay", &[link.address])).await;
    for version in 1..=2 {
        chain.publish_live(&hub, version).await;
        held_at(&relay, version, "relay").await;
    }
    link.partition();
    within(
        LIMIT,
        "the hub sees the relay go",
        hub.wait_for(|s| s.subscribers == 0),
    )
    .await
    .unwrap();
    for version in 3..=8 {
        chain.publish_live(&hub, version).await;
    }
    link.heal();
    held_at(&relay, 8, "relay back").await;
    chain.publish_live(&hub, 9).await;
    let status = held_at(&relay, 9, "relay").await;
    assert_eq!(
        status.completed,
        [1, 2, 8, 9],
        "what the hub no longer held is skipped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_actor_offered_a_delta_with_the_wrong_base_refuses_reports_and_catches_up() {
    let chain = Chain::new(5, 13);
    // An upstream serving another chain of the same run, signed by the trainer's key (a
    // trainer restarted from an older state, say): its D(4) starts from a version 3 with
    // other weights than the actor's.
    let run = aurora_delta::RunId([0x13; 16]);
    let same_run = || {
        let mut config = config(Role::Hub, "hub", &[]);
        config.run = Some(run);
        spawn_hub(config, None)
    };
    let foreign = Chain::new(5, 99);
    let rogue = same_run().await.unwrap();
    for version in 1..=4 {
        rogue.publish(foreign.delta(version).clone()).await.unwrap();
    }
    rogue.commit(foreign.at(4)).await.unwrap();
    let hub = same_run().await.unwrap();
    for version in 1..=5 {
        hub.publish(chain.delta(version).clone()).await.unwrap();
    }
    hub.commit(chain.at(5)).await.unwrap();
    let engine = Arc::new(IdleEngine::default());
    let actor = spawn_actor(
        actor_config(
            &hub,
            "stale",
            &[rogue.local_addr().unwrap(), hub.local_addr().unwrap()],
        ),
        chain.weights(3),
        engine.clone(),
    )
    .await
    .unwrap();
    let status = active_at(&actor, 5, "catching up").await;
    assert_eq!(status.active, Some(chain.at(5)));
    assert_eq!(engine.activations(), [chain.at(4), chain.at(5)]);
    assert_eq!(status.failed_activations, 0);
    let reports = rogue.status().reports;
    assert!(
        reports.iter().any(|(peer, active, note)| peer == "stale"
            && *active == chain.at(3)
            && note.contains("refused version 4")),
        "the refusal was reported upstream: {reports:?}"
    );
}

/// A compromised relay's move (docs/security.md §5): an upstream that serves another
/// run signed by the same trainer key, its version 0 and deltas all authentic. An actor
/// pinned to its run refuses it at the Welcome, and one that learns its run takes it
/// from the trainer's hub only: neither stages anything of the other run, and both
/// follow their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_of_another_run_signed_by_the_same_key_is_refused() {
    let chain = Chain::new(3, 21);
    let foreign = Chain::new(3, 22);
    let other_run = hub(None).await;
    let hub = hub(None).await;
    assert_ne!(other_run.status().run, hub.status().run);
    for version in 1..=3 {
        other_run
            .publish(foreign.delta(version).clone())
            .await
            .unwrap();
    }
    other_run.commit(foreign.at(3)).await.unwrap();
    // A relay of the other run, to which the actors' first upstream points.
    let relay = connected_relay(config(
        Role::Relay,
        "relay",
        &[other_run.local_addr().unwrap()],
    ))
    .await;
    let upstreams = [relay.local_addr().unwrap(), hub.local_addr().unwrap()];
    let pinned_engine = Arc::new(IdleEngine::default());
    let pinned = spawn_actor(
        actor_config(&hub, "pinned", &upstreams),
        chain.weights(0),
        pinned_engine.clone(),
    )
    .await
    .unwrap();
    // One that learns its run: from a relay it takes none, from the hub it does.
    let learning_engine = Arc::new(IdleEngine::default());
    let learning = spawn_actor(
        config(Role::Actor, "learning", &upstreams),
        chain.weights(0),
        learning_engine.clone(),
    )
    .await
    .unwrap();
    for version in 1..=3 {
        hub.publish(chain.delta(version).clone()).await.unwrap();
    }
    hub.commit(chain.at(3)).await.unwrap();
    for (actor, engine) in [(&pinned, &pinned_engine), (&learning, &learning_engine)] {
        let status = active_at(actor, 3, "the actor on its own run").await;
        assert_eq!(status.run, hub.status().run);
        assert_eq!(engine.activations(), [1, 2, 3].map(|v| chain.at(v)));
        assert_eq!(status.receiver.unwrap().violations, 0);
    }
    // The relay of the other run served neither a segment.
    assert_eq!(relay.status().sender.unwrap().segments_sent, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_and_the_actor_never_subscribes() {
    let chain = Chain::new(1, 1);
    let hub = hub(None).await;
    let mut intruder = actor_config(&hub, "intruder", &[hub.local_addr().unwrap()]);
    intruder.security = Security::loopback_plaintext(b"guess");
    let actor = idle_actor(intruder, chain.weights(0)).await;
    let status = within(
        LIMIT,
        "refusals",
        actor.wait_for(|s| s.upstream_switches >= 2),
    )
    .await
    .unwrap();
    assert!(!status.connected);
    assert_eq!(hub.status().subscribers, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_pinning_another_trainer_key_refuses_every_version_and_stages_none() {
    let chain = Chain::new(2, 17);
    let root = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(root.path()).unwrap());
    let hub = hub(Some(store.clone())).await;
    let hub_address = hub.local_addr().unwrap();
    let engine = Arc::new(IdleEngine::default());
    let mut impostor = actor_config(&hub, "pinned-elsewhere", &[hub_address]);
    impostor.trainer_key = Some(aurora_delta::SigningKey::from_bytes(&[9; 32]).verifying_key());
    let refusing = spawn_actor(impostor, chain.weights(0), engine.clone())
        .await
        .unwrap();
    let honest_engine = Arc::new(IdleEngine::default());
    let honest = spawn_actor(
        actor_config(&hub, "honest", &[hub_address]),
        chain.weights(0),
        honest_engine.clone(),
    )
    .await
    .unwrap();
    within(LIMIT, "connect", honest.wait_for(|s| s.connected))
        .await
        .unwrap();
    for version in 1..=2 {
        chain.publish_live(&hub, version).await;
    }
    assert_eq!(
        active_at(&honest, 2, "honest").await.active,
        Some(chain.at(2))
    );
    let status = within(
        LIMIT,
        "the signatures are refused",
        refusing.wait_for(|s| s.receiver.as_ref().is_some_and(|r| r.violations >= 2)),
    )
    .await
    .unwrap();
    assert_eq!(status.active, Some(chain.at(0)));
    assert_eq!(status.staged, None);
    assert!(status.completed.is_empty());
    assert!(engine.activations().is_empty());
    // The store kept the hub's signature of every delta.
    for version in 1..=2 {
        let record = store.delta_record(version).unwrap();
        let file = aurora_delta::DeltaFile::parse(chain.delta(version)).unwrap();
        let statement = aurora_delta::Statement::artifact(
            aurora_delta::ArtifactKind::Delta,
            file.id,
            file.header(),
        );
        aurora_delta::verify(
            &trainer_key().verifying_key(),
            &store.run_id(),
            &statement,
            record.signature.as_ref(),
        )
        .unwrap();
    }
}

/// A relay left behind (or a compromised one replaying what it kept) offers a joiner an
/// old authentic snapshot and commit: the joiner, told by the control plane what the
/// trainer has committed and which snapshot its hub offers, refuses it at its Welcome and
/// joins from the hub. It never activates anything older than that snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_refuses_a_relay_behind_the_commit_it_was_told_of_and_joins_from_the_hub() {
    let chain = Chain::new(4, 51);
    let (_root, store, hub) = snapshot_hub(&chain).await;
    let hub_address = hub.local_addr().unwrap();
    // A relay that keeps the snapshot of 0, then loses its upstream at version 1.
    let link = Proxy::start(hub_address, Fault::None).await;
    let kept = tempfile::tempdir().unwrap();
    let mut relay_config = config(Role::Relay, "relay", &[link.address]);
    relay_config.snapshot_dir = Some(kept.path().to_path_buf());
    relay_config.relay_suspend_after = None;
    let relay = connected_relay(relay_config).await;
    chain.publish_live(&hub, 1).await;
    held_at(&relay, 1, "the relay at version 1").await;
    link.partition();
    for version in 2..=4 {
        chain.publish_live(&hub, version).await;
    }
    store.put_snapshot(3, &chain.images[3]).unwrap();
    hub.store_changed().await.unwrap();
    // What the control plane tells the joiner: 4 committed, the snapshot of 3 offered.
    let mut joiner_config =
        actor_config(&hub, "joiner", &[relay.local_addr().unwrap(), hub_address]);
    joiner_config.join_floor = aurora_proto::JoinFloor {
        snapshot: 3,
        commit: 4,
    };
    // Back on its relay for the deltas once joined, it expects the commit it was told
    // of, and gives the stale relay up when it brings nothing of it.
    joiner_config.behind_timeout = Duration::from_millis(500);
    let engine = Arc::new(IdleEngine::default());
    let joiner = spawn_joining_actor(joiner_config, engine.clone())
        .await
        .unwrap();
    let status = active_at(&joiner, 4, "the joiner").await;
    assert_eq!(engine.activations(), [chain.at(3), chain.at(4)]);
    assert_eq!(status.upstream, Some(hub_address));
    assert_eq!(status.receiver.unwrap().violations, 0);
    // The relay served it nothing of its old snapshot.
    assert_eq!(relay.status().sender.unwrap().segments_sent, 0);
}
