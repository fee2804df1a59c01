//! Staging while segments arrive: the node asks for each segment of the next version
//! as it is verified, stages once the artifact is complete and every segment was
//! decoded from exactly the bytes its table names, and activates only when no decode
//! still reads the weights.

use super::*;
use crate::receiver::{ReceiverConfig, ReceiverEvent, SessionEnd, Violation};
use crate::sender::{Sender, SenderConfig};
use crate::testutil::{
    Pair, RUN, TOKEN, artifact, connected, connected_joining, frames, frames_of, hello, identity,
    pinned_receiver, relaying_receiver, signed_frames, snapshot_artifact, trainer_key, weights,
    welcomed,
};
use aurora_delta::Statement;

fn actor() -> Node {
    Node::actor(
        connected(1),
        VersionRef {
            version: 0,
            hash: weights(0),
        },
    )
}

fn poll(node: &mut Node) -> Vec<Output> {
    let now = Instant::now();
    std::iter::from_fn(|| node.poll(now)).collect()
}

/// The decodes asked for, as (version, index, hash).
fn decodes(outputs: &[Output]) -> Vec<(u64, u32, Hash)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Decode {
                version,
                index,
                hash,
                ..
            } => Some((*version, *index, *hash)),
            _ => None,
        })
        .collect()
}

fn feed(node: &mut Node, frame: Frame) -> Vec<Output> {
    node.receiver_mut()
        .unwrap()
        .handle_frame(Instant::now(), 1, frame);
    poll(node)
}

fn segment_frame(version: u64, index: u32, bytes: &'static [u8]) -> Frame {
    Frame::Segment {
        version,
        index,
        hash: Hash::of(bytes),
        bytes: Bytes::from_static(bytes),
    }
}

#[test]
fn segments_are_decoded_as_they_arrive_and_staged_once_complete() {
    let mut node = actor();
    let (bytes, _) = artifact(1, 3);
    let all = frames(&bytes);
    let (offer, seal, segments) = (&all[0], &all[1], &all[2..]);
    assert!(decodes(&feed(&mut node, offer.clone())).is_empty());
    let first = decodes(&feed(&mut node, segments[0].clone()));
    assert_eq!(
        first.len(),
        1,
        "the first segment is decoded before the rest arrive"
    );
    let (_, _, hash) = first[0];
    node.decoded(1, 0, hash, Ok(SpilledChunks::default()));
    assert!(decodes(&feed(&mut node, seal.clone())).is_empty());
    let mut asked = Vec::new();
    for segment in &segments[1..] {
        asked.extend(decodes(&feed(&mut node, segment.clone())));
    }
    assert_eq!(asked.iter().map(|d| d.1).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(node.actor_status().unwrap().staged, None);
    // Each segment went to its decode as it came: the complete artifact holds only
    // their hashes, never the delta whole.
    let held: Vec<usize> = node.artifacts[&1]
        .segments()
        .map(|(_, _, bytes)| bytes.len())
        .collect();
    assert_eq!(held, [0, 0, 0]);
    for (version, index, hash) in asked {
        node.decoded(version, index, hash, Ok(SpilledChunks::default()));
    }
    poll(&mut node);
    assert_eq!(node.actor_status().unwrap().staged, Some(1));
    assert!(
        node.artifacts.is_empty(),
        "staged: the patch is what activates"
    );
    assert!(node.take_staged(1).is_some());
}

#[test]
fn a_revoked_segment_is_decoded_again_and_activation_waits_for_the_stale_decode() {
    let mut node = actor();
    let (bytes, _) = artifact(1, 2);
    let all = frames(&bytes);
    feed(&mut node, all[0].clone());
    // Consistent with its frame, not with the table that follows.
    let forged = decodes(&feed(&mut node, segment_frame(1, 0, b"forged")));
    assert_eq!(forged.len(), 1);
    feed(&mut node, all[1].clone());
    let mut asked = Vec::new();
    for segment in &all[2..] {
        asked.extend(decodes(&feed(&mut node, segment.clone())));
    }
    assert_eq!(asked.iter().map(|d| d.1).collect::<Vec<_>>(), [0, 1]);
    assert_ne!(asked[0].2, forged[0].2);
    for (version, index, hash) in asked {
        node.decoded(version, index, hash, Ok(SpilledChunks::default()));
    }
    let outputs = poll(&mut node);
    assert_eq!(node.actor_status().unwrap().staged, Some(1));

    node.receiver_mut().unwrap().handle_frame(
        Instant::now(),
        1,
        Frame::Commit(crate::testutil::commit(1, None)),
    );
    let outputs = [outputs, poll(&mut node)].concat();
    assert!(outputs.contains(&Output::AwaitSafePoint));
    node.safe_point();
    assert!(
        !poll(&mut node).contains(&Output::Activate { version: 1 }),
        "the forged segment's decode still reads the weights"
    );
    // Its result comes back late and is not used.
    node.decoded(1, 0, forged[0].2, Err("garbage".into()));
    assert!(poll(&mut node).contains(&Output::Activate { version: 1 }));
    assert!(node.take_staged(1).is_some());
}

#[test]
fn a_segment_that_does_not_decode_refuses_the_version() {
    let mut node = actor();
    let (bytes, _) = artifact(1, 2);
    let mut asked = Vec::new();
    for frame in frames(&bytes) {
        asked.extend(decodes(&feed(&mut node, frame)));
    }
    assert_eq!(asked.len(), 2);
    node.decoded(1, 0, asked[0].2, Ok(SpilledChunks::default()));
    node.decoded(1, 1, asked[1].2, Err("chunk 3 is truncated".into()));
    poll(&mut node);
    let status = node.actor_status().unwrap();
    assert_eq!(
        (status.active.map(|a| a.version), status.staged),
        (Some(0), None)
    );
    assert!(node.take_staged(1).is_none());
}

#[test]
fn a_version_whose_base_is_not_active_is_not_decoded_early() {
    let mut node = actor();
    let (bytes, _) = artifact(2, 2);
    let mut outputs = Vec::new();
    for frame in frames(&bytes) {
        outputs.extend(feed(&mut node, frame));
    }
    assert!(decodes(&outputs).is_empty());
}

#[test]
fn a_joining_actor_stages_its_snapshot_as_it_arrives_and_activates_it_without_a_safe_point() {
    let mut node = Node::joining_actor(connected_joining(1, 3));
    assert_eq!(node.actor_status().unwrap().active, None);
    let (bytes, _) = snapshot_artifact(3, 3);
    let all = frames_of(&bytes, ArtifactKind::Snapshot);
    feed(&mut node, all[0].clone());
    let first = decodes(&feed(&mut node, all[2].clone()));
    assert_eq!(
        first.len(),
        1,
        "decoded against no weights before the rest arrive"
    );
    let mut asked = first;
    for frame in &all[3..] {
        asked.extend(decodes(&feed(&mut node, frame.clone())));
    }
    let mut outputs = feed(&mut node, all[1].clone());
    for (version, index, hash) in asked {
        node.decoded(version, index, hash, Ok(SpilledChunks::default()));
    }
    outputs.extend(poll(&mut node));
    assert!(
        outputs.contains(&Output::Activate { version: 3 }),
        "{outputs:?}"
    );
    assert!(!outputs.contains(&Output::AwaitSafePoint));
    assert!(node.take_staged(3).is_some());
    node.activated(3, Ok(weights(3)));
    poll(&mut node);
    assert_eq!(
        node.actor_status().unwrap().active,
        Some(VersionRef {
            version: 3,
            hash: weights(3)
        })
    );
}

fn relay_sender() -> Sender {
    Sender::new(SenderConfig::new(
        identity(Role::Relay, "relay"),
        crate::Auth::Shared(TOKEN.to_vec()),
    ))
}

#[test]
fn a_relay_forwards_from_its_upstream_s_newest_version_and_decodes_nothing() {
    let mut node = Node::relay(relaying_receiver(Some(3)), relay_sender());
    poll(&mut node);
    assert_eq!(node.receiver().unwrap().next_version(), 3);
    let (bytes, _) = artifact(3, 2);
    let mut outputs = Vec::new();
    for frame in frames(&bytes) {
        outputs.extend(feed(&mut node, frame));
    }
    assert!(
        !outputs.iter().any(|o| matches!(
            o,
            Output::Decode { .. }
                | Output::AwaitSafePoint
                | Output::Activate { .. }
                | Output::Notice(Notice::RelayError(_))
        )),
        "a relay holds no weights: {outputs:?}"
    );
    assert!(outputs.contains(&Output::Notice(Notice::Complete { version: 3 })));
    assert_eq!(node.sender().unwrap().latest(), Some(3));
    assert_eq!(node.actor_status(), None);
    // What it holds is what its reports (and later Hellos) say.
    let held = VersionRef {
        version: 3,
        hash: weights(3),
    };
    assert!(
        outputs.iter().any(|o| matches!(
            o,
            Output::Transmit { frame: Frame::Status { active, staged: None, .. }, .. } if *active == held
        )),
        "{outputs:?}"
    );

    // A downstream that wants a version from before the relay's start is told it is not
    // held here: its actor falls back to the hub. (That a relay serves what it holds is
    // the next test's.)
    let served = std::mem::replace(node.sender_mut().unwrap(), crate::testutil::sender());
    let mut behind = Pair::new(served, crate::testutil::receiver(1, 2));
    behind.pump();
    assert!(
        behind.events.iter().any(|e| matches!(
            e,
            ReceiverEvent::UpstreamLost {
                reason: SessionEnd::Unavailable { version: 2, .. }
            }
        )),
        "{:?}",
        behind.events
    );
}

#[test]
fn a_relay_that_moves_its_start_before_holding_a_version_drops_what_it_began() {
    let mut node = Node::relay(relaying_receiver(Some(3)), relay_sender());
    poll(&mut node);
    let (bytes, _) = artifact(3, 2);
    feed(&mut node, frames(&bytes)[0].clone());
    assert_eq!(
        node.sender().unwrap().latest(),
        Some(3),
        "begun at its Offer"
    );
    // The session is lost before version 3 is complete; the next upstream's newest is 5.
    let now = Instant::now();
    let receiver = node.receiver_mut().unwrap();
    receiver.start_session(now, 6);
    receiver.connected(now, 6, 0, 2, None);
    receiver.handle_frame(now, 2, crate::testutil::hub_welcome_at(Some(5)));
    poll(&mut node);
    assert_eq!(node.receiver().unwrap().next_version(), 5);
    assert_eq!(
        node.sender().unwrap().latest(),
        None,
        "version 3 would never be complete here"
    );
}

/// A joining actor that pins the trainer key, welcomed by a hub offering the snapshot of
/// `snapshot`.
fn pinned_joiner(snapshot: u64) -> Node {
    let mut config = ReceiverConfig::new(identity(Role::Actor, "a1"), TOKEN.to_vec());
    config.trainer_key = Some(trainer_key().verifying_key());
    Node::joining_actor(welcomed(Receiver::joining(config), Some(snapshot)))
}

/// The descriptor of a snapshot of `version` that claims one BF16 tensor of 2 TiB: it
/// parses and names a snapshot, so only a signature tells it from the trainer's.
fn huge_snapshot_descriptor(version: u64) -> Bytes {
    let header = DeltaHeader {
        base_version: version,
        target_version: version,
        base_hash: crate::snapshot::empty_weights_hash(),
        target_hash: weights(version),
        encoding: aurora_delta::Encoding::Dense,
        tensors: vec![aurora_delta::TensorEntry {
            name: "model.embed_tokens.weight".into(),
            change: aurora_delta::TensorChange::Added(aurora_delta::TensorSpec {
                dtype: aurora_delta::Dtype::Bf16,
                shape: vec![1 << 20, 1 << 20],
            }),
        }],
    };
    Bytes::from(header.encode_pending())
}

/// Whether `outputs` end the session on a signature refusal whose message has `what`.
fn refused_signature(outputs: &[Output], what: &str) -> bool {
    outputs.iter().any(|o| {
        matches!(
            o,
            Output::UpstreamLost {
                reason: SessionEnd::Violation(Violation::Signature(error)),
            } if error.to_string().contains(what)
        )
    })
}

#[test]
fn a_forged_snapshot_offer_is_refused_at_the_offer_before_anything_is_built_from_it() {
    let key = trainer_key();
    let (honest, _) = snapshot_artifact(3, 2);
    let honest = signed_frames(&honest, ArtifactKind::Snapshot, Some(&key));
    let Frame::Offer {
        signature: trainer_signature,
        ..
    } = honest[0].clone()
    else {
        unreachable!("the first frame is the Offer")
    };
    let descriptor = huge_snapshot_descriptor(3);
    let stranger = aurora_delta::SigningKey::from_bytes(&[0x13; 32]);
    let forged_statement = Statement::offer(ArtifactKind::Snapshot, 3, &descriptor);
    let forgeries = [
        (None, "carries no signature"),
        (
            Some(aurora_delta::sign(&stranger, &RUN, &forged_statement)),
            "does not verify",
        ),
        // The trainer's signature of the real descriptor, moved onto the forged one.
        (trainer_signature, "does not verify"),
    ];
    for (signature, why) in forgeries {
        let mut node = pinned_joiner(3);
        let outputs = feed(
            &mut node,
            Frame::Offer {
                version: 3,
                kind: ArtifactKind::Snapshot,
                descriptor: descriptor.clone(),
                signature,
            },
        );
        assert!(
            refused_signature(&outputs, "the Offer of a snapshot to version 3"),
            "refused at the Offer ({why}): {outputs:?}"
        );
        assert!(refused_signature(&outputs, why), "{outputs:?}");
        assert_eq!(node.receiver().unwrap().stats().violations, 1);
        // A segment behind the Offer is never handed to a decoder, the only place an
        // image is allocated from a descriptor.
        let outputs = feed(&mut node, honest[2].clone());
        assert!(decodes(&outputs).is_empty(), "{outputs:?}");
        let status = node.actor_status().unwrap();
        assert_eq!((status.active, status.staged), (None, None));
    }

    // The trainer's own Offer is taken, and its segments decoded as they come.
    let mut node = pinned_joiner(3);
    let outputs = feed(&mut node, honest[0].clone());
    assert!(!refused_signature(&outputs, ""), "{outputs:?}");
    assert_eq!(decodes(&feed(&mut node, honest[2].clone())).len(), 1);
}

#[test]
fn a_relay_forwards_the_trainer_s_offer_signature_and_a_pinned_actor_takes_the_version() {
    let key = trainer_key();
    let pinned = Some(key.verifying_key());
    let mut config = SenderConfig::new(
        identity(Role::Relay, "relay"),
        crate::Auth::Shared(TOKEN.to_vec()),
    );
    config.trainer_key = pinned;
    let mut receiver = ReceiverConfig::new(identity(Role::Relay, "relay"), TOKEN.to_vec());
    receiver.trainer_key = pinned;
    let mut relay = Node::relay(
        welcomed(Receiver::relaying(receiver), None),
        Sender::new(config),
    );
    let (bytes, _) = artifact(1, 3);
    let frames = signed_frames(&bytes, ArtifactKind::Delta, Some(&key));
    for frame in frames.clone() {
        let outputs = feed(&mut relay, frame);
        assert!(
            !outputs.iter().any(|o| matches!(
                o,
                Output::Notice(Notice::RelayError(_)) | Output::UpstreamLost { .. }
            )),
            "{outputs:?}"
        );
    }
    // What the relay serves, to an actor that pins the key: it takes nothing unsigned.
    let served = std::mem::replace(relay.sender_mut().unwrap(), crate::testutil::sender());
    let mut pair = Pair::new(served, pinned_receiver(1, 1, pinned));
    pair.pump();
    assert_eq!(pair.complete(), [(1, bytes)]);
    let Frame::Offer { signature, .. } = &frames[0] else {
        unreachable!("the first frame is the Offer")
    };
    assert!(signature.is_some());
    assert!(pair.events.iter().any(|e| matches!(
        e,
        ReceiverEvent::Offered { signature: forwarded, .. } if forwarded == signature
    )));
}

/// Opens a one-stream session of actor `a1` on the relay's connection `conn` and says
/// what the relay answered.
fn subscribe(relay: &mut Node, now: Instant, conn: ConnId, session: u64) -> Vec<Output> {
    let sender = relay.sender_mut().unwrap();
    sender.accepted(now, conn, None);
    sender.handle_frame(now, conn, Frame::Hello(hello(session, 0, 1)));
    std::iter::from_fn(|| relay.poll(now)).collect()
}

fn lose_upstream(relay: &mut Node, now: Instant) {
    relay.receiver_mut().unwrap().abandon("cut off");
    let outputs: Vec<Output> = std::iter::from_fn(|| relay.poll(now)).collect();
    assert!(
        outputs
            .iter()
            .any(|o| matches!(o, Output::UpstreamLost { .. })),
        "{outputs:?}"
    );
}

fn reconnect(relay: &mut Node, now: Instant, session: u64, conn: ConnId) {
    let receiver = relay.receiver_mut().unwrap();
    receiver.start_session(now, session);
    receiver.connected(now, session, 0, conn, None);
    receiver.handle_frame(now, conn, crate::testutil::hub_welcome_at(Some(3)));
    std::iter::from_fn(|| relay.poll(now)).for_each(drop);
}

#[test]
fn a_relay_without_a_working_upstream_sends_its_subscribers_away_until_it_has_one_again() {
    let after = Duration::from_secs(5);
    let start = Instant::now();
    let mut relay = Node::relay(relaying_receiver(Some(3)), relay_sender());
    relay.suspend_after(after);
    let serves = |outputs: &[Output], conn: ConnId| {
        outputs.iter().any(|o| {
            matches!(o, Output::Transmit { conn: c, frame: Frame::Welcome(_), .. } if *c == conn)
        })
    };
    let welcome = subscribe(&mut relay, start, 10, 100);
    assert!(serves(&welcome, 10), "{welcome:?}");
    // A cut mended within the time, the next session delivering a version: nobody is
    // sent away.
    lose_upstream(&mut relay, start);
    assert_eq!(
        relay.poll_timeout().map(|at| at <= start + after),
        Some(true)
    );
    reconnect(&mut relay, start + after / 4, 6, 2);
    let (bytes, _) = artifact(3, 2);
    let now = start + after / 2;
    for frame in frames(&bytes) {
        relay.receiver_mut().unwrap().handle_frame(now, 2, frame);
    }
    let outputs: Vec<Output> = std::iter::from_fn(|| relay.poll(now)).collect();
    assert!(
        outputs
            .iter()
            .any(|o| matches!(o, Output::Notice(Notice::Complete { version: 3 }))),
        "{outputs:?}"
    );
    relay.handle_timeout(start + after);
    assert!(!relay.sender().unwrap().is_suspended());
    assert_eq!(relay.sender().unwrap().sessions(), 1);
    // Cut off: once `after` has passed without a working session, the subscriber is
    // sent away and a new one refused.
    let lost = start + after;
    lose_upstream(&mut relay, lost);
    relay.handle_timeout(lost + after - Duration::from_millis(1));
    assert_eq!(relay.sender().unwrap().sessions(), 1, "not yet");
    relay.handle_timeout(lost + after);
    let outputs: Vec<Output> = std::iter::from_fn(|| relay.poll(lost + after)).collect();
    assert!(
        outputs
            .iter()
            .any(|o| matches!(o, Output::Close { conn: 10 })),
        "{outputs:?}"
    );
    assert_eq!(relay.sender().unwrap().sessions(), 0);
    let refused = subscribe(&mut relay, lost + after, 11, 101);
    assert!(
        refused.iter().any(|o| matches!(
            o,
            Output::Transmit {
                conn: 11,
                frame: Frame::Reject { code: crate::frame::RejectCode::Busy, reason },
                ..
            } if reason.contains("no working upstream")
        )),
        "{refused:?}"
    );
    // A Welcome alone is not enough: the session must deliver or last `after`.
    let back = lost + 2 * after;
    reconnect(&mut relay, back, 7, 3);
    relay.handle_timeout(back + after / 2);
    assert!(relay.sender().unwrap().is_suspended());
    assert!(!serves(
        &subscribe(&mut relay, back + after / 2, 12, 102),
        12
    ));
    assert_eq!(
        relay.poll_timeout().map(|at| at <= back + after),
        Some(true)
    );
    relay.handle_timeout(back + after);
    assert!(!relay.sender().unwrap().is_suspended());
    assert!(serves(&subscribe(&mut relay, back + after, 13, 103), 13));
}

/// A relay that keeps a snapshot for its region's joins, its upstream session (5, on
/// conn 1) dialled but not yet welcomed.
fn keeping_relay(now: Instant) -> Node {
    let mut receiver = Receiver::relaying(ReceiverConfig::new(
        identity(Role::Relay, "relay"),
        TOKEN.to_vec(),
    ));
    receiver.start_session(now, 5);
    receiver.connected(now, 5, 0, 1, None);
    let mut relay = Node::relay(receiver, relay_sender());
    relay.keep_snapshots(Arc::new(crate::HeapSnapshots));
    poll(&mut relay);
    relay
}

/// The snapshot a Welcome on `conn` offered, if one was written.
fn welcome_on(outputs: &[Output], conn: ConnId) -> Option<Option<u64>> {
    outputs.iter().find_map(|o| match o {
        Output::Transmit {
            conn: c,
            frame: Frame::Welcome(welcome),
            ..
        } if *c == conn => Some(welcome.snapshot),
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
        Output::Transmit {
            frame: Frame::Want {
                next_version: 3,
                snapshot: true,
                ..
            },
            ..
        }
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
    relay.receiver_mut().unwrap().abandon("cut off");
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
            relay.receiver_mut().unwrap().handle_frame(now, 2, frame);
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
    relay.receiver_mut().unwrap().abandon("cut off");
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
    relay.sender_mut().unwrap().handle_frame(now, conn, want);
}
