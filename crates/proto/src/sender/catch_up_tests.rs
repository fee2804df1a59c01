//! Catching up: a joiner's snapshot and the deltas after it, what a relay or a store cannot
//! give, and composed deltas for sessions far behind.

// Have-sets are vectors of ranges; a set with one range is not a mistake.
#![allow(clippy::single_range_in_vec_init)]

use std::time::Instant;

use super::tests::{drain, drain_all, handshake, holding, lost_upstream, want, welcomed};
use super::*;
use crate::frame::{ArtifactKind, Progress};
use crate::receiver::ReceiverEvent;
use crate::testutil::{
    Pair, artifact, commit, composed_artifact, composed_receiver, hello, joining_receiver,
    receiver, sender, snapshot_artifact, store_sender,
};

/// The Offers the sender wrote, as (version, kind).
fn offers(pair: &Pair) -> Vec<(u64, ArtifactKind)> {
    pair.written
        .iter()
        .filter_map(|(_, f)| match f {
            Frame::Offer { version, kind, .. } => Some((*version, *kind)),
            _ => None,
        })
        .collect()
}

fn kinds(pair: &Pair) -> Vec<(u64, ArtifactKind)> {
    pair.events
        .iter()
        .filter_map(|e| match e {
            ReceiverEvent::Complete { version, artifact } => Some((*version, artifact.kind())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_join_session_gets_the_snapshot_then_the_deltas_after_it() {
    let mut hub = store_sender(4, 2);
    for version in 1..=4 {
        hub.insert_artifact(crate::StoredArtifact::unsigned(artifact(version, 3).0))
            .unwrap();
    }
    let mut pair = Pair::new(hub, joining_receiver(2));
    assert!(
        pair.sender_events
            .contains(&SenderEvent::Load(ArtifactKey::Snapshot(2))),
        "the snapshot is built on demand"
    );
    assert!(pair.complete().is_empty(), "waits for the load");
    let (bytes, _) = snapshot_artifact(2, 6);
    pair.sender
        .loaded(
            ArtifactKey::Snapshot(2),
            Ok(crate::StoredArtifact::unsigned(bytes.clone())),
        )
        .unwrap();
    pair.pump();
    assert_eq!(
        kinds(&pair),
        [
            (2, ArtifactKind::Snapshot),
            (3, ArtifactKind::Delta),
            (4, ArtifactKind::Delta)
        ]
    );
    assert_eq!(pair.complete()[0], (2, bytes), "the snapshot, not D(2)");
    assert_eq!(
        offers(&pair),
        [
            (2, ArtifactKind::Snapshot),
            (3, ArtifactKind::Delta),
            (4, ArtifactKind::Delta)
        ]
    );
    assert_eq!(
        pair.sender.held(ArtifactKind::Snapshot),
        0,
        "a whole checkpoint is dropped once no session wants it"
    );
    assert_eq!(pair.receiver.stats().duplicates, 0);
    assert_eq!(pair.sender.stats().segments_sent, 6 + 3 + 3);
}

#[test]
fn the_welcome_offers_the_newest_committed_snapshot_and_a_relay_none() {
    let welcome = |sender: &mut Sender| match handshake(sender, 1, hello(5, 0, 1)).frame {
        Frame::Welcome(welcome) => welcome.snapshot,
        other => panic!("{other:?}"),
    };
    assert_eq!(welcome(&mut store_sender(9, 5)), Some(5));
    // Never one beyond the commit: a joiner activates it at once, and would be ahead
    // of the step its actors generate on (a restart can leave newer snapshots stored).
    let mut hub = store_sender(9, 5);
    hub.set_snapshots([0, 3, 6]);
    hub.commit(commit(5, None)).unwrap();
    assert_eq!(welcome(&mut hub), Some(3));
    let mut relay = sender();
    relay.set_snapshots([5]);
    assert_eq!(welcome(&mut relay), None, "no store to build one from");
}

#[test]
fn a_relay_answers_a_snapshot_want_with_unavailable() {
    let mut relay = sender();
    relay
        .insert_artifact(crate::StoredArtifact::unsigned(artifact(3, 2).0))
        .unwrap();
    let now = Instant::now();
    welcomed(&mut relay, now);
    relay.handle_frame(now, 1, want(1, 3, true, vec![]));
    match relay.poll_transmit(now).map(|t| t.frame) {
        Some(Frame::Unavailable { version: 3, reason }) => {
            assert!(reason.contains("no store"), "{reason}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    relay.on_sent(now, 1);
    assert_eq!(
        relay.poll_transmit(now),
        None,
        "D(3) is not a snapshot of 3"
    );

    // A joining receiver does not even ask: the Welcome offers nothing.
    let pair = Pair::new(sender(), joining_receiver(1));
    assert!(lost_upstream(&pair, "offers no snapshot to join from"));
}

#[test]
fn a_snapshot_the_store_cannot_build_is_unavailable() {
    let mut pair = Pair::new(store_sender(4, 2), joining_receiver(1));
    pair.sender
        .loaded(ArtifactKey::Snapshot(2), Err("pruned".into()))
        .unwrap_err();
    pair.pump();
    assert!(lost_upstream(
        &pair,
        "version 2 is unavailable there: pruned"
    ));
}

#[test]
fn a_resumed_join_sends_only_the_missing_segments_of_the_snapshot() {
    let (bytes, _) = snapshot_artifact(2, 12);
    let mut pair = Pair::new(store_sender(2, 2), joining_receiver(2));
    pair.segment_budget = Some(5);
    pair.sender
        .loaded(
            ArtifactKey::Snapshot(2),
            Ok(crate::StoredArtifact::unsigned(bytes.clone())),
        )
        .unwrap();
    pair.pump();
    assert_eq!(pair.receiver.stats().segments, 5);
    pair.receiver.abandon("test");
    pair.pump();

    // Another hub, serving the same snapshot.
    let mut other = store_sender(2, 2);
    other
        .loaded(
            ArtifactKey::Snapshot(2),
            Ok(crate::StoredArtifact::unsigned(bytes.clone())),
        )
        .unwrap();
    assert_eq!(other.held(ArtifactKind::Snapshot), 0, "nobody wants it yet");
    pair.sender = other;
    pair.segment_budget = None;
    pair.receiver.start_session(pair.now, 78);
    pair.pump();
    pair.sender
        .loaded(
            ArtifactKey::Snapshot(2),
            Ok(crate::StoredArtifact::unsigned(bytes.clone())),
        )
        .unwrap();
    pair.pump();
    assert_eq!(pair.complete(), [(2, bytes)]);
    assert_eq!(pair.receiver.stats().segments, 12);
    assert_eq!(pair.receiver.stats().duplicates, 0);
    assert_eq!(
        pair.sender.stats().segments_sent,
        7,
        "only the segments it did not hold"
    );
}

#[test]
fn a_new_upstream_with_another_snapshot_starts_the_join_over() {
    let (old, _) = snapshot_artifact(2, 8);
    let mut pair = Pair::new(store_sender(2, 2), joining_receiver(1));
    pair.segment_budget = Some(4);
    pair.sender
        .loaded(
            ArtifactKey::Snapshot(2),
            Ok(crate::StoredArtifact::unsigned(old)),
        )
        .unwrap();
    pair.pump();
    pair.receiver.abandon("test");
    pair.pump();

    let (new, _) = snapshot_artifact(3, 8);
    let mut hub = store_sender(4, 3);
    hub.insert_artifact(crate::StoredArtifact::unsigned(artifact(4, 2).0))
        .unwrap();
    pair.sender = hub;
    pair.segment_budget = None;
    pair.receiver.start_session(pair.now, 78);
    pair.pump();
    pair.sender
        .loaded(
            ArtifactKey::Snapshot(3),
            Ok(crate::StoredArtifact::unsigned(new.clone())),
        )
        .unwrap();
    pair.pump();
    assert_eq!(
        kinds(&pair),
        [(3, ArtifactKind::Snapshot), (4, ArtifactKind::Delta)]
    );
    assert_eq!(pair.complete()[0], (3, new));
    assert_eq!(
        pair.sender.stats().segments_sent,
        8 + 2,
        "nothing of the other snapshot counts"
    );
    assert_eq!(pair.receiver.stats().duplicates, 0);
}

#[test]
fn a_nack_on_a_snapshot_resends_from_the_snapshot() {
    let mut hub = store_sender(3, 3);
    hub.insert_artifact(crate::StoredArtifact::unsigned(artifact(3, 2).0))
        .unwrap();
    let (bytes, _) = snapshot_artifact(3, 3);
    let now = Instant::now();
    welcomed(&mut hub, now);
    hub.handle_frame(now, 1, want(1, 3, true, vec![holding(3, vec![0..2])]));
    hub.loaded(
        ArtifactKey::Snapshot(3),
        Ok(crate::StoredArtifact::unsigned(bytes)),
    )
    .unwrap();
    let sent = drain(&mut hub, now);
    assert!(
        matches!(
            &sent[..],
            [Frame::Segment {
                version: 3,
                index: 2,
                ..
            }]
        ),
        "{sent:?}"
    );
    hub.handle_frame(
        now,
        1,
        Frame::Nack {
            version: 3,
            index: 2,
        },
    );
    match hub.poll_transmit(now).map(|t| t.frame) {
        Some(Frame::Segment {
            version: 3,
            index: 2,
            bytes,
            ..
        }) => assert_eq!(&bytes[..], b"segment 2 of snapshot 3"),
        other => panic!("{other:?}"),
    }
    assert_eq!(hub.stats().segments_resent, 1);
}

#[test]
fn snapshots_and_deltas_do_not_mix() {
    let (snapshot, _) = snapshot_artifact(2, 2);
    let mut hub = sender();
    assert!(
        hub.insert_artifact(crate::StoredArtifact::unsigned(snapshot))
            .unwrap_err()
            .to_string()
            .contains("goes from version 2 to 2")
    );
    let error = hub
        .loaded(
            ArtifactKey::Snapshot(2),
            Ok(crate::StoredArtifact::unsigned(artifact(2, 2).0)),
        )
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("must name it as base and target"),
        "{error}"
    );
}

/// The composed delta these tests serve: from version 5 to 8.
fn composed_key() -> ArtifactKey {
    ArtifactKey::Composed { base: 5, target: 8 }
}

fn composed_loads(pair: &Pair) -> Vec<(u64, u64)> {
    pair.sender_events
        .iter()
        .filter_map(|e| match e {
            SenderEvent::Load(ArtifactKey::Composed { base, target }) => Some((*base, *target)),
            _ => None,
        })
        .collect()
}

/// A Want of a session at `next_version` that accepts composed catch-up and says it holds
/// parts of a composed delta to `target`.
fn composed_want(seq: u64, next_version: u64, target: u64) -> Frame {
    Frame::Want {
        seq,
        next_version,
        snapshot: false,
        composed: true,
        live_streams: 1,
        epochs: vec![1],
        progress: vec![Progress {
            version: target,
            has_offer: true,
            has_seal: false,
            composed: true,
            have: vec![0..1],
        }],
    }
}

/// The composed deltas `sender` asked its driver to build.
fn builds_asked(sender: &mut Sender) -> Vec<(u64, u64)> {
    std::iter::from_fn(|| sender.poll_event())
        .filter_map(|e| match e {
            SenderEvent::Load(ArtifactKey::Composed { base, target }) => Some((base, target)),
            _ => None,
        })
        .collect()
}

/// What one authenticated actor did to make a hub build and keep six composed deltas:
/// Wants from seven bases, each naming a target of its choosing. It is built one: the
/// first, to the store's latest; the others replay the deltas while it is built or
/// held. Other peers get theirs, up to [`MAX_COMPOSED_PER_TARGET`] bases of one target.
#[test]
fn one_peer_gets_one_composed_build_at_a_time_whatever_bases_and_targets_it_names() {
    let now = Instant::now();
    let mut s = store_sender(20, 0);
    handshake(&mut s, 1, hello(5, 0, 1));
    let mut asked = Vec::new();
    for (seq, base) in (3..10).rev().enumerate() {
        s.handle_frame(now, 1, composed_want(seq as u64, base + 1, 15 + base));
        drain_all(&mut s, now);
        asked.extend(builds_asked(&mut s));
    }
    assert_eq!(asked, [(9, 20)], "one build, to the latest");
    assert_eq!(s.stats().composed_refused, 6);

    // Other actors: one at the same base shares the build; one at each other base
    // gets its own until the target has four.
    let mut asked = Vec::new();
    for (peer, base) in [(2u64, 9u64), (3, 8), (4, 7), (5, 6), (6, 5)] {
        let conn = 10 + peer;
        let mut other = hello(50 + peer, 0, 1);
        other.peer_id = format!("a{peer}");
        handshake(&mut s, conn, other);
        s.handle_frame(now, conn, composed_want(0, base + 1, 20));
        drain_all(&mut s, now);
        asked.extend(builds_asked(&mut s));
    }
    assert_eq!(asked, [(8, 20), (7, 20), (6, 20)]);
    assert_eq!(
        s.stats().composed_refused,
        7,
        "the fifth base of one target"
    );
}

#[test]
fn a_session_three_behind_is_served_one_composed_delta() {
    // The actor is at 5; the store's latest is 8; D(9) is being published.
    let mut hub = store_sender(8, 0);
    hub.insert_artifact(crate::StoredArtifact::unsigned(artifact(9, 2).0))
        .unwrap();
    let mut pair = Pair::new(hub, composed_receiver(2, 6));
    assert_eq!(composed_loads(&pair), [(5, 8)]);
    assert!(
        pair.written
            .iter()
            .all(|(_, f)| !matches!(f, Frame::Offer { .. }))
    );
    let (composed, _) = composed_artifact(5, 8, 6);
    pair.sender
        .loaded(
            composed_key(),
            Ok(crate::StoredArtifact::unsigned(composed.clone())),
        )
        .unwrap();
    pair.pump();
    assert_eq!(
        offers(&pair),
        [(8, ArtifactKind::Composed), (9, ArtifactKind::Delta)]
    );
    assert_eq!(
        kinds(&pair),
        [(8, ArtifactKind::Composed), (9, ArtifactKind::Delta)]
    );
    assert_eq!(pair.complete()[0], (8, composed));
    assert_eq!(pair.receiver.next_version(), 10);
    assert_eq!(pair.sender.stats().composed_offers, 1);
    assert_eq!(pair.sender.stats().segments_sent, 6 + 2);
    assert_eq!(pair.receiver.stats().duplicates, 0);
    assert_eq!(
        pair.sender.held(ArtifactKind::Composed),
        0,
        "dropped once no session is at its base"
    );
    assert!(
        !pair
            .sender_events
            .iter()
            .any(|e| matches!(e, SenderEvent::Load(ArtifactKey::Delta(_)))),
        "no delta of 6..=8 is loaded"
    );
}

#[test]
fn a_declined_composed_delta_replays_the_deltas() {
    let mut pair = Pair::new(store_sender(8, 0), composed_receiver(1, 6));
    assert_eq!(composed_loads(&pair), [(5, 8)]);
    pair.sender
        .loaded(composed_key(), Err("replaying is cheaper".into()))
        .unwrap_err();
    pair.pump();
    for version in 6..=8 {
        pair.sender
            .insert_artifact(crate::StoredArtifact::unsigned(artifact(version, 2).0))
            .unwrap();
        pair.pump();
    }
    assert_eq!(
        kinds(&pair),
        [
            (6, ArtifactKind::Delta),
            (7, ArtifactKind::Delta),
            (8, ArtifactKind::Delta)
        ]
    );
    assert_eq!(pair.sender.stats().composed_offers, 0);
    // One version behind, or a receiver that does not accept one: no composed delta.
    let pair = Pair::new(store_sender(8, 0), composed_receiver(1, 8));
    assert!(composed_loads(&pair).is_empty());
    let pair = Pair::new(store_sender(8, 0), receiver(1, 6));
    assert!(composed_loads(&pair).is_empty());
    // A relay has no store to build one from.
    let mut relay = sender();
    relay
        .insert_artifact(crate::StoredArtifact::unsigned(artifact(6, 1).0))
        .unwrap();
    relay
        .insert_artifact(crate::StoredArtifact::unsigned(artifact(7, 1).0))
        .unwrap();
    let pair = Pair::new(relay, composed_receiver(1, 6));
    assert!(composed_loads(&pair).is_empty());
    assert_eq!(
        kinds(&pair),
        [(6, ArtifactKind::Delta), (7, ArtifactKind::Delta)]
    );
}

#[test]
fn a_resumed_composed_transfer_sends_only_the_missing_segments() {
    let (composed, _) = composed_artifact(5, 8, 10);
    let mut pair = Pair::new(store_sender(8, 0), composed_receiver(2, 6));
    pair.segment_budget = Some(4);
    pair.sender
        .loaded(
            composed_key(),
            Ok(crate::StoredArtifact::unsigned(composed.clone())),
        )
        .unwrap();
    pair.pump();
    assert_eq!(pair.receiver.stats().segments, 4);
    pair.receiver.abandon("test");
    pair.pump();
    assert_eq!(
        pair.sender.held(ArtifactKind::Composed),
        0,
        "no session is at its base"
    );

    // The store's latest moved on meanwhile; the new session resumes the same target,
    // which its Want reports parts of.
    pair.sender.set_loadable(Some(9));
    pair.segment_budget = None;
    pair.receiver.start_session(pair.now, 78);
    pair.pump();
    assert_eq!(composed_loads(&pair), [(5, 8), (5, 8)]);
    pair.sender
        .loaded(
            composed_key(),
            Ok(crate::StoredArtifact::unsigned(composed.clone())),
        )
        .unwrap();
    pair.pump();
    assert_eq!(pair.complete(), [(8, composed)]);
    assert_eq!(pair.receiver.stats().segments, 10);
    assert_eq!(pair.receiver.stats().duplicates, 0);
    assert_eq!(
        pair.sender.stats().segments_sent,
        10,
        "only the segments it did not hold"
    );
    // Then D(9), as a delta.
    assert_eq!(pair.receiver.next_version(), 9);
}
