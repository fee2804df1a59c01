//! Staging while segments arrive: the node asks for each segment of the next version
//! as it is verified, stages once the artifact is complete and every segment was
//! decoded from exactly the bytes its table names, and activates only when no decode
//! still reads the weights.

use super::*;
use crate::Transmit;
use crate::frame::Frame;
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

pub(super) fn poll(node: &mut Node) -> Vec<Output> {
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

pub(super) fn feed(node: &mut Node, frame: Frame) -> Vec<Output> {
    node.handle_frame(Instant::now(), 1, frame);
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

    node.handle_frame(
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
    let garbage = aurora_delta::DeltaError::Malformed("garbage".into());
    node.decoded(1, 0, forged[0].2, Err(garbage.into()));
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
    let truncated = aurora_delta::DeltaError::Malformed("chunk 3 is truncated".into());
    node.decoded(1, 1, asked[1].2, Err(truncated.into()));
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

pub(super) fn relay_sender() -> Sender {
    Sender::new(SenderConfig::new(
        identity(Role::Relay, "relay"),
        crate::Auth::Shared(TOKEN.to_vec()),
    ))
}

#[test]
fn a_relay_forwards_from_its_upstream_s_newest_version_and_decodes_nothing() {
    let mut node = Node::relay(
        relaying_receiver(Some(3)),
        relay_sender(),
        RelayOptions::default(),
    );
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
            Output::Transmit(Transmit { frame: Frame::Status { active, staged: None, .. }, .. }) if *active == held
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
    let mut node = Node::relay(
        relaying_receiver(Some(3)),
        relay_sender(),
        RelayOptions::default(),
    );
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
        RelayOptions::default(),
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
pub(super) fn subscribe(relay: &mut Node, now: Instant, conn: ConnId, session: u64) -> Vec<Output> {
    let sender = relay.sender_mut().unwrap();
    sender.accepted(now, conn, None);
    sender.handle_frame(now, conn, Frame::Hello(hello(session, 0, 1)));
    std::iter::from_fn(|| relay.poll(now)).collect()
}

fn lose_upstream(relay: &mut Node, now: Instant) {
    relay.abandon_session("cut off");
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

/// Whether `outputs` refuse the Hello on `conn` as Busy, for a reason that says `why`.
fn busy(outputs: &[Output], conn: ConnId, why: &str) -> bool {
    outputs.iter().any(|o| {
        matches!(
            o,
            Output::Transmit(Transmit {
                conn: c,
                frame: Frame::Reject { code: crate::frame::RejectCode::Busy, reason },
                ..
            }) if *c == conn && reason.contains(why)
        )
    })
}

#[test]
fn a_relay_without_a_working_upstream_sends_its_subscribers_away_until_it_has_one_again() {
    let after = Duration::from_secs(5);
    let start = Instant::now();
    let mut relay = Node::relay(
        relaying_receiver(Some(3)),
        relay_sender(),
        RelayOptions {
            suspend_after: Some(after),
            ..RelayOptions::default()
        },
    );
    let serves = |outputs: &[Output], conn: ConnId| {
        outputs.iter().any(|o| {
            matches!(o, Output::Transmit(Transmit { conn: c, frame: Frame::Welcome(_), .. }) if *c == conn)
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
        relay.handle_frame(now, 2, frame);
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
    assert!(busy(&refused, 11, "no working upstream"), "{refused:?}");
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

#[test]
fn a_relay_that_stops_serving_sends_its_subscribers_away_for_good() {
    let now = Instant::now();
    let mut relay = Node::relay(
        relaying_receiver(Some(3)),
        relay_sender(),
        RelayOptions {
            suspend_after: Some(Duration::from_secs(5)),
            ..RelayOptions::default()
        },
    );
    subscribe(&mut relay, now, 10, 100);
    assert_eq!(relay.sender().unwrap().sessions(), 1);
    relay.stop_serving("the relay is stopping (SIGTERM)".into());
    let outputs: Vec<Output> = std::iter::from_fn(|| relay.poll(now)).collect();
    assert!(
        outputs
            .iter()
            .any(|o| matches!(o, Output::Close { conn: 10 })),
        "{outputs:?}"
    );
    // Its upstream delivering a version does not bring it back, as it would a relay
    // that had lost its upstream.
    lose_upstream(&mut relay, now);
    reconnect(&mut relay, now, 6, 2);
    let (bytes, _) = artifact(3, 2);
    for frame in frames(&bytes) {
        relay.handle_frame(now, 2, frame);
    }
    std::iter::from_fn(|| relay.poll(now)).for_each(drop);
    relay.handle_timeout(now + Duration::from_secs(60));
    assert!(relay.sender().unwrap().is_suspended());
    let refused = subscribe(&mut relay, now + Duration::from_secs(60), 11, 101);
    assert!(busy(&refused, 11, "stopping"), "{refused:?}");
}

#[test]
fn an_artifact_offered_while_the_actor_activates_is_not_decoded_against_the_weights_it_writes() {
    let mut node = Node::actor(
        crate::testutil::connected_composed(1),
        VersionRef {
            version: 0,
            hash: weights(0),
        },
    );
    let (bytes, _) = artifact(1, 1);
    let mut asked = Vec::new();
    for frame in frames(&bytes) {
        asked.extend(decodes(&feed(&mut node, frame)));
    }
    for (version, index, hash) in asked {
        node.decoded(version, index, hash, Ok(SpilledChunks::default()));
    }
    poll(&mut node);
    node.handle_frame(
        Instant::now(),
        1,
        Frame::Commit(crate::testutil::commit(1, None)),
    );
    poll(&mut node);
    node.safe_point();
    assert!(poll(&mut node).contains(&Output::Activate { version: 1 }));
    assert!(node.take_staged(1).is_some());
    // The driver writes the weights now, so nothing may be decoded against them: the
    // receiver holds the version being activated, and refuses a catch-up from the one
    // still active.
    let (composed, _) = crate::testutil::composed_artifact(0, 3, 2);
    let mut outputs = Vec::new();
    for frame in frames_of(&composed, crate::frame::ArtifactKind::Composed) {
        outputs.extend(feed(&mut node, frame));
    }
    assert!(decodes(&outputs).is_empty(), "{outputs:?}");
}
