//! Relays that keep a snapshot for their region's joins (docs/wire-protocol.md §8): the
//! snapshot they start from or fetch, the deltas after it, and what their joiners are
//! told when it is replaced, withdrawn or never finished.

use super::tests::{feed, poll, relay_sender, subscribe};
use super::*;
use crate::Transmit;
use crate::frame::Frame;
use crate::receiver::ReceiverConfig;
use crate::sender::Sender;
use crate::testutil::{Pair, TOKEN, artifact, frames, frames_of, identity, snapshot_artifact};

/// A relay that keeps a snapshot for its region's joins, its upstream session (5, on
/// conn 1) dialled but not yet welcomed.
fn keeping_relay(now: Instant) -> Node {
    let mut receiver = Receiver::relaying(ReceiverConfig::new(
        identity(Role::Relay, "relay"),
        TOKEN.to_vec(),
    ));
    receiver.start_session(now, 5);
    receiver.connected(now, 5, 0, 1, None);
    let options = RelayOptions {
        keep_snapshots: Some(Arc::new(crate::HeapSnapshots)),
        suspend_after: None,
    };
    let mut relay = Node::relay(receiver, relay_sender(), options);
    poll(&mut relay);
    relay
}

/// The snapshot a Welcome on `conn` offered, if one was written.
fn welcome_on(outputs: &[Output], conn: ConnId) -> Option<Option<u64>> {
    outputs.iter().find_map(|o| match o {
        Output::Transmit(Transmit {
            conn: c,
            frame: Frame::Welcome(welcome),
            ..
        }) if *c == conn => Some(welcome.snapshot),
        _ => None,
    })
}

#[test]
fn a_relay_keeps_the_snapshot_it_starts_from_and_serves_it_while_it_holds_the_deltas_after_it() {
    let now = Instant::now();
    let mut relay = keeping_relay(now);
    // A joiner that comes before the upstream's Welcome is answered after it: answered
    // now, it would hear of no snapshot and fetch its own from the hub.
    let early = subscribe(&mut relay, now, 7, 40);
    assert_eq!(welcome_on(&early, 7), None, "{early:?}");
    let welcomed = feed(&mut relay, crate::testutil::hub_welcome(Some(3)));
    assert_eq!(welcome_on(&welcomed, 7), Some(Some(3)), "{welcomed:?}");
    assert!(welcomed.iter().any(|o| matches!(
        o,
        Output::Transmit(Transmit {
            frame: Frame::Want {
                next_version: 3,
                snapshot: true,
                ..
            },
            ..
        })
    )));

    let (bytes, snapshot) = snapshot_artifact(3, 40);
    let mut outputs = Vec::new();
    for frame in frames_of(&bytes, ArtifactKind::Snapshot) {
        outputs.extend(feed(&mut relay, frame));
    }
    assert!(
        !outputs.iter().any(|o| matches!(
            o,
            Output::Decode { .. } | Output::Notice(Notice::RelayError(_) | Notice::Joined { .. })
        )),
        "a relay decodes nothing and stays on its upstream: {outputs:?}"
    );
    assert!(outputs.contains(&Output::Notice(Notice::Complete { version: 3 })));
    let upstream = relay.receiver().unwrap();
    assert_eq!(
        (upstream.next_version(), upstream.taking_snapshot()),
        (4, None)
    );

    // The deltas after it stay with it, past the four a relay retains, while they add up
    // to no more than what a relay keeps: a joiner takes the snapshot here and goes on
    // with them.
    let snapshot_bytes: u64 = snapshot
        .segments
        .iter()
        .map(|e| u64::from(e.len))
        .sum::<u64>()
        * crate::KEPT_TAIL_SNAPSHOTS;
    let mut tail = 0;
    let mut version = 3;
    while tail <= snapshot_bytes {
        version += 1;
        let (delta, manifest) = artifact(version, 1);
        let descriptor = manifest.header.encode_pending().len() as u64;
        tail += descriptor
            + manifest
                .segments
                .iter()
                .map(|e| u64::from(e.len))
                .sum::<u64>();
        for frame in frames(&delta) {
            feed(&mut relay, frame);
        }
        if tail <= snapshot_bytes {
            assert_eq!(relay.sender().unwrap().latest(), Some(version));
            let conn = 100 + version;
            let welcome = welcome_on(&subscribe(&mut relay, now, conn, 1000 + version), conn);
            assert_eq!(
                welcome,
                Some(Some(3)),
                "v{version}, {tail} of {snapshot_bytes} bytes"
            );
        }
    }
    assert!(version > 9, "more deltas than a relay retains: {version}");
    // The one past that withdraws the snapshot: a joiner would take more here than the
    // hub's newer snapshot, and the relay retains its four deltas again.
    assert_eq!(relay.sender().unwrap().held(ArtifactKind::Snapshot), 0);
    assert_eq!(
        welcome_on(&subscribe(&mut relay, now, 9, 42), 9),
        Some(None)
    );
    assert_eq!(relay.sender().unwrap().held(ArtifactKind::Delta), 4);

    // While it was offered, a joiner took it, and the deltas after it, from here.
    let mut relay = keeping_relay(now);
    feed(&mut relay, crate::testutil::hub_welcome(Some(3)));
    for frame in frames_of(&bytes, ArtifactKind::Snapshot) {
        feed(&mut relay, frame);
    }
    for version in 4..=9 {
        for frame in frames(&artifact(version, 1).0) {
            feed(&mut relay, frame);
        }
    }
    let served = std::mem::replace(relay.sender_mut().unwrap(), relay_sender());
    let mut joiner = Pair::new(served, crate::testutil::joining_receiver(1));
    joiner.pump();
    let complete = joiner.complete();
    assert_eq!(
        complete.first(),
        Some(&(3, bytes)),
        "the snapshot as the hub made it"
    );
    assert_eq!(
        complete.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
        [3, 4, 5, 6, 7, 8, 9]
    );
}

#[test]
fn a_relay_that_keeps_snapshots_follows_from_the_newest_version_when_its_upstream_offers_none() {
    let now = Instant::now();
    let mut relay = keeping_relay(now);
    subscribe(&mut relay, now, 7, 40);
    let welcomed = feed(&mut relay, crate::testutil::hub_welcome_at(Some(5)));
    assert_eq!(welcome_on(&welcomed, 7), Some(None), "{welcomed:?}");
    let receiver = relay.receiver().unwrap();
    assert_eq!(
        (receiver.next_version(), receiver.taking_snapshot()),
        (5, None)
    );
    let (delta, _) = artifact(5, 2);
    let mut outputs = Vec::new();
    for frame in frames(&delta) {
        outputs.extend(feed(&mut relay, frame));
    }
    assert!(outputs.contains(&Output::Notice(Notice::Complete { version: 5 })));
    assert_eq!(relay.sender().unwrap().latest(), Some(5));
}

#[test]
fn a_relay_whose_upstream_is_lost_answers_the_joiners_it_held() {
    let now = Instant::now();
    let mut relay = keeping_relay(now);
    subscribe(&mut relay, now, 7, 40);
    relay.abandon_session("cut off");
    let outputs = poll(&mut relay);
    assert_eq!(welcome_on(&outputs, 7), Some(None), "{outputs:?}");
}

/// A keeping relay that took the snapshot of `version` (40 segments) from its upstream.
fn relay_keeping(now: Instant, version: u64) -> Node {
    let mut relay = keeping_relay(now);
    feed(&mut relay, crate::testutil::hub_welcome(Some(version)));
    for frame in frames_of(&snapshot_artifact(version, 40).0, ArtifactKind::Snapshot) {
        feed(&mut relay, frame);
    }
    relay
}

/// Feeds deltas `versions` (one segment each) to `relay`, and calls `asked` with the
/// relay, the version and `newer_than` for each snapshot it asks for.
fn feed_deltas(
    relay: &mut Node,
    versions: std::ops::RangeInclusive<u64>,
    mut asked: impl FnMut(&Node, u64, u64),
) {
    for version in versions {
        for frame in frames(&artifact(version, 1).0) {
            for output in feed(relay, frame) {
                if let Output::FetchSnapshot { newer_than } = output {
                    asked(relay, version, newer_than);
                }
            }
        }
    }
}

/// Feeds deltas `versions` to `relay` and says, for each newer snapshot it asked for,
/// after which version, newer than which, and whether the deltas after the kept one had
/// come to half its size.
fn asks_for_newer(
    relay: &mut Node,
    versions: std::ops::RangeInclusive<u64>,
) -> Vec<(u64, u64, bool)> {
    let (_, snapshot_bytes) = relay.sender().unwrap().kept_tail().unwrap();
    let mut asked = Vec::new();
    feed_deltas(relay, versions, |relay, version, newer_than| {
        let (tail, _) = relay.sender().unwrap().kept_tail().unwrap();
        let half = snapshot_bytes * crate::KEPT_TAIL_SNAPSHOTS;
        asked.push((version, newer_than, tail * 2 >= half));
    });
    asked
}

/// Feeds deltas `versions` to `relay` and says after which version it asked for a
/// snapshot, and newer than which.
fn fetches(relay: &mut Node, versions: std::ops::RangeInclusive<u64>) -> Vec<(u64, u64)> {
    let mut asked = Vec::new();
    feed_deltas(relay, versions, |_, version, newer_than| {
        asked.push((version, newer_than));
    });
    asked
}

/// A keeping relay that took the snapshot of 3, served it to a joiner, and took the
/// deltas 4 to 10, then was cut off past its upstream's window: it holds the deltas from
/// 8 on, and withdrew its snapshot.
fn relay_withdrawn(now: Instant) -> Node {
    let mut relay = relay_keeping(now, 3);
    subscribe(&mut relay, now, 6, 39);
    want_snapshot(&mut relay, now, 6, 3);
    assert_eq!(fetches(&mut relay, 4..=10), [], "the deltas came to little");
    relay.sender_mut().unwrap().set_floor(8);
    assert_eq!(relay.sender().unwrap().kept_snapshot(), None);
    relay
}

/// A relay that no longer keeps a snapshot takes a newer one once a joiner was welcomed
/// without one, and its fetcher brings the deltas after it that the relay no longer
/// holds: the next joiner takes the snapshot and every version after it from here.
#[test]
fn a_relay_without_a_snapshot_takes_one_and_the_deltas_it_lacks_once_a_joiner_asks() {
    let now = Instant::now();
    let mut relay = relay_withdrawn(now);
    assert_eq!(
        fetches(&mut relay, 11..=11),
        [],
        "nobody asked since: the joiner before took the withdrawn one"
    );
    assert_eq!(
        welcome_on(&subscribe(&mut relay, now, 7, 40), 7),
        Some(None)
    );
    assert_eq!(
        fetches(&mut relay, 12..=12),
        [(12, 3)],
        "newer than the one it kept"
    );
    assert_eq!(fetches(&mut relay, 13..=13), [], "once");

    // The fetcher took its upstream's snapshot of 6 and followed it to 13.
    let mut fetcher = relay_keeping(now, 6);
    fetches(&mut fetcher, 7..=13);
    let (newer, file) = fetcher.take_kept().unwrap();
    relay.adopt_snapshot(newer, file);
    assert_eq!(relay.sender().unwrap().kept_snapshot(), Some(6));
    assert_eq!(
        welcome_on(&subscribe(&mut relay, now, 9, 42), 9),
        Some(Some(6))
    );
    let served = std::mem::replace(relay.sender_mut().unwrap(), relay_sender());
    let mut joiner = Pair::new(served, crate::testutil::joining_receiver(1));
    joiner.pump();
    let complete: Vec<u64> = joiner.complete().iter().map(|(v, _)| *v).collect();
    assert_eq!(complete, (6..=13).collect::<Vec<_>>());
}

/// The wait after a failed fetch is for that snapshot: once the relay withdraws it, a
/// joiner welcomed without one is asked for at once.
#[test]
fn a_withdrawal_ends_the_wait_after_a_failed_fetch() {
    let now = Instant::now();
    let mut relay = relay_keeping(now, 3);
    subscribe(&mut relay, now, 6, 39);
    want_snapshot(&mut relay, now, 6, 3);
    // The deltas come to half of what it keeps: it asks, and the try fails.
    let mut version = 3;
    let asked = loop {
        version += 1;
        assert!(version < 100, "never asked");
        let asked = fetches(&mut relay, version..=version);
        if !asked.is_empty() {
            break asked;
        }
    };
    assert_eq!(asked, [(version, 3)]);
    relay.snapshot_not_fetched("the hub had no newer one");
    // Cut off past its upstream's window: the snapshot goes.
    relay.sender_mut().unwrap().set_floor(version);
    assert_eq!(relay.sender().unwrap().kept_snapshot(), None);
    assert_eq!(
        welcome_on(&subscribe(&mut relay, now, 7, 40), 7),
        Some(None)
    );
    version += 1;
    assert_eq!(
        fetches(&mut relay, version..=version),
        [(version, 3)],
        "not {} versions on",
        crate::node::keeping::FETCH_RETRY_VERSIONS
    );
}

/// A fetched snapshot without every delta between it and the relay's oldest is not
/// served, and the relay asks again some versions on, twice as many after each failure
/// in a row: a failure after the snapshot came cost a snapshot across the WAN.
#[test]
fn a_fetched_snapshot_that_leaves_a_gap_is_not_served_and_asked_for_again_later_each_time() {
    let now = Instant::now();
    let mut relay = relay_withdrawn(now);
    subscribe(&mut relay, now, 7, 40);
    assert_eq!(fetches(&mut relay, 11..=11), [(11, 3)]);
    let wait = crate::node::keeping::FETCH_RETRY_VERSIONS;
    // The relay's newest version when the fetcher's snapshot is refused.
    let mut latest = 11;
    for failures in 0..3 {
        let mut short = relay_keeping(now, 5);
        fetches(&mut short, 6..=6);
        let (newer, file) = short.take_kept().unwrap();
        relay.adopt_snapshot(newer, file);
        assert_eq!(relay.sender().unwrap().kept_snapshot(), None);
        let again = latest + (wait << failures);
        assert_eq!(
            fetches(&mut relay, latest + 1..=again + 1),
            [(again, 3)],
            "failure {failures}"
        );
        latest = again + 1;
    }
}

#[test]
fn a_relay_asks_for_a_newer_snapshot_once_and_adopts_only_one_it_can_serve() {
    let now = Instant::now();
    // Nobody joined: a newer snapshot is not worth its bytes.
    assert_eq!(asks_for_newer(&mut relay_keeping(now, 3), 4..=12), []);
    // A joiner wanted it: once the deltas after it come to half of what the relay
    // keeps, once.
    let mut relay = relay_keeping(now, 3);
    subscribe(&mut relay, now, 7, 40);
    want_snapshot(&mut relay, now, 7, 3);
    let asked = asks_for_newer(&mut relay, 4..=12);
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert_eq!((asked[0].1, asked[0].2), (3, true), "{asked:?}");

    // What a fetcher took is served in its place, and the deltas up to it go as on any
    // relay.
    let mut fetcher = relay_keeping(now, 8);
    let (newer, segments) = fetcher.take_kept().unwrap();
    assert_eq!(newer.version(), 8);
    relay.adopt_snapshot(newer, segments);
    let sender = relay.sender().unwrap();
    assert_eq!(sender.kept_snapshot(), Some(8));
    assert_eq!(
        sender.held(ArtifactKind::Snapshot),
        2,
        "the old one stays while the joiner that wanted it is served it"
    );
    assert_eq!(
        welcome_on(&subscribe(&mut relay, now, 9, 42), 9),
        Some(Some(8))
    );
    // An older one is not.
    let (older, segments) = relay_keeping(now, 6).take_kept().unwrap();
    relay.adopt_snapshot(older, segments);
    assert_eq!(relay.sender().unwrap().kept_snapshot(), Some(8));
    // Nor one whose deltas after it are gone (and the kept one, whose deltas are gone
    // too, was withdrawn).
    let mut cut_off = relay_keeping(now, 3);
    cut_off.sender_mut().unwrap().set_floor(7);
    assert_eq!(cut_off.sender().unwrap().kept_snapshot(), None);
    let (gone, segments) = relay_keeping(now, 5).take_kept().unwrap();
    cut_off.adopt_snapshot(gone, segments);
    assert_eq!(cut_off.sender().unwrap().kept_snapshot(), None);
}

/// Publishes `frames` (an Offer, a Seal and segments) into `sender` as a relay does.
fn publish(sender: &mut Sender, frames: Vec<Frame>) {
    for frame in frames {
        let kept = sender.kept_snapshot();
        let key = |version| match kept {
            Some(kept) if kept == version => ArtifactKey::Snapshot(version),
            _ => ArtifactKey::Delta(version),
        };
        match frame {
            Frame::Offer {
                version,
                kind,
                descriptor,
                signature,
            } => {
                assert_eq!(
                    sender.begin_artifact(kind, descriptor, signature).unwrap(),
                    version
                );
            }
            Frame::Seal {
                version,
                id,
                target_hash,
                segments,
                signature,
            } => {
                let key = key(version);
                sender
                    .seal_artifact(key, target_hash, id, segments, signature)
                    .unwrap();
            }
            Frame::Segment {
                version,
                index,
                hash,
                bytes,
            } => sender
                .add_segment(key(version), index, hash, bytes)
                .unwrap(),
            other => panic!("not published: {other:?}"),
        }
    }
}

/// A keeping relay that has the Offer, the Seal and three segments of the snapshot of
/// 3 (40 segments).
fn relay_partway(now: Instant) -> Node {
    let mut relay = keeping_relay(now);
    feed(&mut relay, crate::testutil::hub_welcome(Some(3)));
    let (bytes, _) = snapshot_artifact(3, 40);
    for frame in frames_of(&bytes, ArtifactKind::Snapshot)
        .into_iter()
        .take(5)
    {
        feed(&mut relay, frame);
    }
    relay
}

#[test]
fn a_snapshot_the_relay_will_not_finish_is_withdrawn_and_never_offered_again() {
    let now = Instant::now();
    let mut relay = relay_partway(now);
    assert_eq!(relay.sender().unwrap().kept_snapshot(), Some(3));
    // The upstream cannot go on with it; the next one offers no snapshot.
    feed(
        &mut relay,
        Frame::Unavailable {
            version: 3,
            reason: "deferred".into(),
        },
    );
    reconnect_at(&mut relay, now, crate::testutil::hub_welcome_at(Some(5)));
    assert_eq!(relay.receiver().unwrap().next_version(), 5);
    assert_eq!(relay.sender().unwrap().kept_snapshot(), None);
    assert_eq!(relay.sender().unwrap().held(ArtifactKind::Snapshot), 0);
    assert_eq!(
        welcome_on(&subscribe(&mut relay, now, 9, 42), 9),
        Some(None)
    );
    // Its deltas are retained as on any relay: four, not every one after version 3.
    for version in 5..=12 {
        for frame in frames(&artifact(version, 1).0) {
            relay.handle_frame(now, 2, frame);
            poll(&mut relay);
        }
    }
    assert_eq!(relay.sender().unwrap().latest(), Some(12));
    assert_eq!(relay.sender().unwrap().held(ArtifactKind::Delta), 4);
}

/// Starts a new upstream session on the relay's conn 2, welcomed by `welcome`.
fn reconnect_at(relay: &mut Node, now: Instant, welcome: Frame) {
    let receiver = relay.receiver_mut().unwrap();
    receiver.start_session(now, 6);
    receiver.connected(now, 6, 0, 2, None);
    receiver.handle_frame(now, 2, welcome);
    std::iter::from_fn(|| relay.poll(now)).for_each(drop);
}

#[test]
fn a_newer_snapshot_adopted_before_its_own_delta_came_leaves_that_delta_a_delta() {
    let now = Instant::now();
    let mut relay = relay_keeping(now, 3);
    for version in 4..=5 {
        for frame in frames(&artifact(version, 1).0) {
            feed(&mut relay, frame);
        }
    }
    let (newer, file) = relay_keeping(now, 6).take_kept().unwrap();
    relay.adopt_snapshot(newer, file);
    assert_eq!(relay.sender().unwrap().kept_snapshot(), Some(6));
    let mut outputs = Vec::new();
    for version in 6..=7 {
        for frame in frames(&artifact(version, 1).0) {
            outputs.extend(feed(&mut relay, frame));
        }
    }
    assert!(
        !outputs
            .iter()
            .any(|o| matches!(o, Output::Notice(Notice::RelayError(_)))),
        "{outputs:?}"
    );
    let sender = relay.sender().unwrap();
    assert!(
        sender.kept_snapshot_complete(),
        "the snapshot of 6 is whole"
    );
    assert_eq!(sender.latest(), Some(7));
    let served = std::mem::replace(relay.sender_mut().unwrap(), relay_sender());
    let mut joiner = Pair::new(served, crate::testutil::joining_receiver(1));
    joiner.pump();
    let versions: Vec<u64> = joiner.complete().iter().map(|(v, _)| *v).collect();
    assert_eq!(versions, [6, 7]);
}

#[test]
fn a_joiner_halfway_through_the_old_snapshot_finishes_it_when_a_newer_one_is_adopted() {
    let now = Instant::now();
    let (bytes, _) = snapshot_artifact(3, 40);
    let mut snapshot = frames_of(&bytes, ArtifactKind::Snapshot);
    let rest = snapshot.split_off(12);
    // Offer, Seal and ten segments: a joiner takes what there is.
    let mut relay = relay_sender();
    relay.expect_snapshot(3);
    publish(&mut relay, snapshot);
    let mut joiner = Pair::new(relay, crate::testutil::joining_receiver(1));
    assert!(joiner.complete().is_empty(), "halfway");
    // The rest comes, and a delta; then a newer snapshot is adopted.
    publish(&mut joiner.sender, rest);
    publish(&mut joiner.sender, frames(&artifact(4, 1).0));
    let (newer, _file) = relay_keeping(now, 4).take_kept().unwrap();
    joiner.sender.adopt_snapshot(newer).unwrap();
    assert_eq!(joiner.sender.kept_snapshot(), Some(4));
    joiner.pump();
    let complete = joiner.complete();
    assert_eq!(complete.first(), Some(&(3, bytes)), "the old one, whole");
    assert_eq!(complete.last().map(|(v, _)| *v), Some(4));
    // Served, it went: only the adopted one is held now.
    assert_eq!(joiner.sender.held(ArtifactKind::Snapshot), 1);
}

#[test]
fn a_snapshot_left_unfinished_for_another_is_withdrawn_from_its_joiners() {
    let now = Instant::now();
    let mut relay = relay_partway(now);
    // The next versions' Offers run ahead of it.
    for version in 4..=5 {
        feed(&mut relay, frames(&artifact(version, 1).0)[0].clone());
    }
    assert_eq!(relay.sender().unwrap().latest(), Some(5));
    // A joiner is being served it when the session ends; the next upstream offers
    // another snapshot.
    subscribe(&mut relay, now, 7, 40);
    want_snapshot(&mut relay, now, 7, 3);
    relay.abandon_session("cut off");
    poll(&mut relay);
    reconnect_at(&mut relay, now, crate::testutil::hub_welcome(Some(5)));
    let sender = relay.sender().unwrap();
    assert_eq!(sender.kept_snapshot(), Some(5));
    assert_eq!(
        sender.held(ArtifactKind::Snapshot),
        0,
        "the unfinished one is gone: its joiner is told so, not left waiting"
    );
}

/// The joiner on `conn` wants the snapshot of `version`.
fn want_snapshot(relay: &mut Node, now: Instant, conn: ConnId, version: u64) {
    let want = Frame::Want {
        seq: 1,
        next_version: version,
        snapshot: true,
        composed: false,
        live_streams: 1,
        epochs: vec![0],
        progress: Vec::new(),
    };
    relay.handle_frame(now, conn, want);
}
