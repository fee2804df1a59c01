use std::time::Duration;

use super::*;
use crate::frame::Role;
use crate::testutil::{
    Pair, RUN, another_artifact, artifact, composed_artifact, connected, connected_composed,
    connected_joining, frames, frames_of, hub_welcome, hub_welcome_at, joining_receiver, receiver,
    relaying_receiver, sender, snapshot_artifact,
};

pub(super) fn drain(r: &mut Receiver) -> (Vec<ReceiverEvent>, Vec<(ConnId, Frame)>) {
    (
        std::iter::from_fn(|| r.poll_event()).collect(),
        std::iter::from_fn(|| r.poll_transmit())
            .map(|transmit| (transmit.conn, transmit.frame))
            .collect(),
    )
}

/// The versions delivered, with their bytes.
pub(super) fn completed(events: &[ReceiverEvent]) -> Vec<(u64, Bytes)> {
    events
        .iter()
        .filter_map(|e| match e {
            ReceiverEvent::Complete { version, artifact } => Some((*version, artifact.to_bytes())),
            _ => None,
        })
        .collect()
}

/// Whether the session ended on a signature that does not vouch for what it came with.
pub(super) fn refused_signature(events: &[ReceiverEvent]) -> bool {
    events.iter().any(|e| {
        matches!(
            e,
            ReceiverEvent::UpstreamLost {
                reason: SessionEnd::Violation(Violation::Signature(_))
            }
        )
    })
}

#[test]
fn a_corrupted_segment_is_nacked_and_never_delivered() {
    let mut r = connected(1);
    let now = Instant::now();
    let (bytes, _) = artifact(1, 3);
    let mut all = frames(&bytes);
    let good = all[3].clone();
    if let Frame::Segment { bytes, .. } = &mut all[3] {
        let mut damaged = bytes.to_vec();
        damaged[0] ^= 1;
        *bytes = Bytes::from(damaged);
    }
    for frame in all {
        r.handle_frame(now, 1, frame);
    }
    let (events, out) = drain(&mut r);
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, ReceiverEvent::Complete { .. }))
    );
    assert!(out.contains(&(
        1,
        Frame::Nack {
            version: 1,
            index: 1
        }
    )));
    assert_eq!(r.stats().corrupt, 1);
    r.handle_frame(now, 1, good);
    let (events, _) = drain(&mut r);
    assert_eq!(completed(&events), [(1, bytes)]);
}

#[test]
fn a_segment_that_matches_its_frame_but_not_the_table_is_revoked() {
    // A hostile or buggy upstream: frame hash consistent, table different.
    let mut r = connected(1);
    let now = Instant::now();
    let (bytes, _) = artifact(1, 2);
    let all = frames(&bytes);
    let forged = Bytes::from_static(b"forged");
    r.handle_frame(now, 1, all[0].clone());
    r.handle_frame(
        now,
        1,
        Frame::Segment {
            version: 1,
            index: 0,
            hash: Hash::of(&forged),
            bytes: forged,
        },
    );
    r.handle_frame(now, 1, all[1].clone());
    let (events, out) = drain(&mut r);
    assert!(events.contains(&ReceiverEvent::Revoked {
        version: 1,
        index: 0
    }));
    assert!(out.contains(&(
        1,
        Frame::Nack {
            version: 1,
            index: 0
        }
    )));
    for frame in &all[2..] {
        r.handle_frame(now, 1, frame.clone());
    }
    let (events, _) = drain(&mut r);
    assert_eq!(completed(&events), [(1, bytes)]);
}

#[test]
fn a_segment_corrupted_too_often_gives_the_upstream_up() {
    let mut r = connected(1);
    let now = Instant::now();
    let bad = Frame::Segment {
        version: 1,
        index: 0,
        hash: Hash::default(),
        bytes: Bytes::from_static(b"x"),
    };
    for _ in 0..=r.config.max_segment_failures {
        r.handle_frame(now, 1, bad.clone());
    }
    let (events, _) = drain(&mut r);
    assert!(events.iter().any(|e| matches!(
        e,
        ReceiverEvent::UpstreamLost {
            reason: SessionEnd::Corrupted { failures: 9, .. }
        }
    )));
}

#[test]
fn protocol_violations_give_the_upstream_up() {
    let check = |frame: Frame, needle: &str| {
        let mut r = connected(1);
        r.handle_frame(Instant::now(), 1, frame);
        let (events, _) = drain(&mut r);
        assert!(
            events.iter().any(|e| matches!(
                e,
                ReceiverEvent::UpstreamLost { reason } if reason.to_string().contains(needle)
            )),
            "{needle}: {events:?}"
        );
    };
    check(
        Frame::Segment {
            version: 99,
            index: 0,
            hash: Hash::default(),
            bytes: Bytes::new(),
        },
        "beyond the window",
    );
    let (bytes, _) = artifact(1, 1);
    let offer = frames(&bytes).remove(0);
    let Frame::Offer { descriptor, .. } = offer else {
        unreachable!()
    };
    check(
        Frame::Offer {
            version: 2,
            kind: crate::frame::ArtifactKind::Delta,
            descriptor,
            signature: None,
        },
        "carries the header of version 1",
    );
    check(
        Frame::Offer {
            version: 1,
            kind: crate::frame::ArtifactKind::Delta,
            descriptor: Bytes::from_static(b"junk"),
            signature: None,
        },
        "offer of version 1",
    );
    // Protocol version 4: the target hash comes with the Seal, never in the Offer.
    let named = aurora_delta::DeltaFile::parse(&bytes)
        .unwrap()
        .header()
        .encode();
    check(
        Frame::Offer {
            version: 1,
            kind: crate::frame::ArtifactKind::Delta,
            descriptor: Bytes::from(named),
            signature: None,
        },
        "names a target hash",
    );
    check(
        Frame::Want {
            seq: 1,
            next_version: 1,
            snapshot: false,
            composed: false,
            live_streams: 1,
            epochs: vec![1],
            progress: vec![],
        },
        "protocol violation",
    );
    check(
        Frame::Unavailable {
            version: 1,
            reason: "pruned".into(),
        },
        "unavailable there: pruned",
    );
}

#[test]
fn a_bad_table_or_target_hash_gives_the_upstream_up() {
    let damages: [fn(&mut Hash); 2] = [|id| id.0[0] ^= 1, |target| target.0[0] ^= 1];
    for (which, damage) in damages.into_iter().enumerate() {
        let mut r = connected(1);
        let (bytes, _) = artifact(1, 2);
        let mut all = frames(&bytes);
        if let Frame::Seal {
            id, target_hash, ..
        } = &mut all[1]
        {
            damage(if which == 0 { id } else { target_hash });
        }
        r.handle_frame(Instant::now(), 1, all[0].clone());
        r.handle_frame(Instant::now(), 1, all[1].clone());
        let (events, _) = drain(&mut r);
        assert!(
            events.iter().any(|e| matches!(
                e,
                ReceiverEvent::UpstreamLost {
                    reason: SessionEnd::WrongTable { .. }
                }
            )),
            "damage {which}"
        );
    }
}

#[test]
fn segments_of_another_publication_with_the_same_descriptor_give_way_at_the_seal() {
    // A publication of version 1 that never sealed (its trainer stopped), then another:
    // the descriptors are equal, so only the Seal tells them apart.
    let mut r = connected(1);
    let (failed, _) = another_artifact(1, 3);
    let (bytes, _) = artifact(1, 2);
    let stale = frames(&failed);
    let (offer, segments) = (stale[0].clone(), &stale[2..]);
    r.handle_frame(Instant::now(), 1, offer);
    for segment in segments {
        r.handle_frame(Instant::now(), 1, segment.clone());
    }
    let (events, _) = drain(&mut r);
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, ReceiverEvent::Sealed { .. }))
    );
    let fresh = frames(&bytes);
    // The same Offer again changes nothing; the Seal revokes every stale segment and
    // asks again for those within its table.
    r.handle_frame(Instant::now(), 1, fresh[0].clone());
    r.handle_frame(Instant::now(), 1, fresh[1].clone());
    let (events, out) = drain(&mut r);
    let revoked: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            ReceiverEvent::Revoked { index, .. } => Some(*index),
            _ => None,
        })
        .collect();
    assert_eq!(revoked, [0, 1, 2]);
    let nacked: Vec<u32> = out
        .iter()
        .filter_map(|(_, f)| match f {
            Frame::Nack { index, .. } => Some(*index),
            _ => None,
        })
        .collect();
    assert_eq!(nacked, [0, 1]);
    for segment in &fresh[2..] {
        r.handle_frame(Instant::now(), 1, segment.clone());
    }
    let (events, _) = drain(&mut r);
    let complete = events.iter().find_map(|e| match e {
        ReceiverEvent::Complete { artifact, .. } => Some(artifact.to_bytes()),
        _ => None,
    });
    assert_eq!(complete, Some(bytes));
}

#[test]
fn the_seal_completes_the_pending_header_of_the_offer() {
    let mut r = connected(1);
    let (bytes, _) = artifact(1, 2);
    let file = aurora_delta::DeltaFile::parse(&bytes).unwrap();
    for frame in frames(&bytes) {
        r.handle_frame(Instant::now(), 1, frame);
    }
    let (events, _) = drain(&mut r);
    let offered = events.iter().find_map(|e| match e {
        ReceiverEvent::Offered { header, .. } => Some(header.clone()),
        _ => None,
    });
    assert!(offered.expect("offered").target_pending());
    let sealed = events.iter().find_map(|e| match e {
        ReceiverEvent::Sealed { target_hash, .. } => Some(*target_hash),
        _ => None,
    });
    assert_eq!(sealed, Some(file.header().target_hash));
    let artifact = events
        .iter()
        .find_map(|e| match e {
            ReceiverEvent::Complete { artifact, .. } => Some(artifact.clone()),
            _ => None,
        })
        .expect("complete");
    assert_eq!(**artifact.header(), *file.header());
    // Its bytes are the artifact as the trainer wrote it, complete header included.
    assert_eq!(artifact.to_bytes(), bytes);
}

#[test]
fn frames_before_welcome_and_refusals_end_the_session() {
    let now = Instant::now();
    let mut r = receiver(1, 1);
    r.start_session(now, 5);
    r.connected(now, 5, 0, 1, None);
    let (_, out) = drain(&mut r);
    assert!(matches!(&out[0], (1, Frame::Hello(h)) if h.session == 5 && h.streams == 1));
    r.handle_frame(
        now,
        1,
        Frame::Reject {
            code: crate::frame::RejectCode::Auth,
            reason: "bad token".into(),
        },
    );
    let (events, out) = drain(&mut r);
    assert!(matches!(&out[..], [(1, Frame::Goodbye { reason })] if reason.contains("bad token")));
    assert!(events.iter().any(|e| matches!(
        e,
        ReceiverEvent::UpstreamLost { reason } if reason.to_string().contains("bad token")
    )));
}

#[test]
fn a_silent_upstream_is_lost_after_the_idle_timeout() {
    let mut r = connected(1);
    let deadline = r.poll_timeout().unwrap();
    r.handle_timeout(deadline - Duration::from_millis(1));
    assert!(drain(&mut r).0.is_empty());
    r.handle_timeout(deadline);
    assert!(
        drain(&mut r)
            .0
            .iter()
            .any(|e| matches!(e, ReceiverEvent::UpstreamLost { .. }))
    );
}

#[test]
fn a_lost_stream_is_redialled_and_reported_in_the_next_want() {
    let mut r = connected(3);
    assert_eq!(r.welcomed_streams(), 3);
    r.closed(2);
    assert_eq!(r.welcomed_streams(), 2);
    let (events, out) = drain(&mut r);
    assert!(events.contains(&ReceiverEvent::Dial {
        session: 5,
        stream: 1
    }));
    assert!(out.iter().any(|(_, f)| matches!(
        f,
        Frame::Want {
            live_streams: 0b101,
            ..
        }
    )));
    r.closed(1);
    r.closed(3);
    let (events, _) = drain(&mut r);
    assert!(
        events
            .iter()
            .any(|e| matches!(e, ReceiverEvent::UpstreamLost { .. }))
    );
    assert_eq!(r.welcomed_streams(), 0);
}

#[test]
fn a_held_bytes_limit_bounds_memory() {
    let mut r = connected(1);
    r.config.max_held_bytes = 10;
    let big = Bytes::from(vec![1u8; 11]);
    r.handle_frame(
        Instant::now(),
        1,
        Frame::Segment {
            version: 1,
            index: 0,
            hash: Hash::of(&big),
            bytes: big,
        },
    );
    assert!(drain(&mut r).0.iter().any(|e| matches!(
        e,
        ReceiverEvent::UpstreamLost {
            reason: SessionEnd::OverBudget { limit: 10 }
        }
    )));
}

#[test]
fn a_new_session_after_a_lost_upstream_resumes_without_duplicates() {
    let mut s = sender();
    s.insert_artifact(crate::StoredArtifact::unsigned(artifact(1, 12).0))
        .unwrap();
    let mut pair = Pair::new(s, receiver(2, 1));
    assert_eq!(pair.complete().len(), 1);
    assert_eq!(pair.receiver.stats().duplicates, 0);

    // Version 2 arrives halfway, then the upstream goes away.
    let (bytes, manifest) = artifact(2, 12);
    let file = aurora_delta::DeltaFile::parse(&bytes).unwrap();
    pair.sender
        .begin_artifact(
            ArtifactKind::Delta,
            Bytes::from(file.header().encode_pending()),
            None,
        )
        .unwrap();
    for index in 0..6 {
        let segment = Bytes::copy_from_slice(file.verify_segment(index).unwrap());
        pair.sender
            .add_segment(
                crate::ArtifactKey::Delta(2),
                index as u32,
                manifest.segments[index].hash,
                segment,
            )
            .unwrap();
    }
    pair.pump();
    let before = pair.receiver.stats().segments;
    pair.receiver.abandon("test");
    pair.pump();
    // Another upstream with the whole of version 2.
    let mut other = sender();
    other
        .insert_artifact(crate::StoredArtifact::unsigned(bytes.clone()))
        .unwrap();
    pair.sender = other;
    pair.receiver.start_session(pair.now, 78);
    pair.pump();
    assert_eq!(pair.complete().last(), Some(&(2, bytes)));
    assert_eq!(
        pair.receiver.stats().segments - before,
        6,
        "only the missing half"
    );
    assert_eq!(pair.receiver.stats().duplicates, 0);
    assert_eq!(pair.sender.stats().segments_sent, 6);
}

#[test]
fn the_stream_count_follows_the_tuner_and_never_closes_a_stream() {
    let mut r = receiver(4, 1);
    r.config.tune_interval = Some(Duration::from_secs(1));
    let start = Instant::now();
    r.start_session(start, 5);
    let dials = |events: &[ReceiverEvent]| -> Vec<u8> {
        events
            .iter()
            .filter_map(|e| match e {
                ReceiverEvent::Dial { stream, .. } => Some(*stream),
                _ => None,
            })
            .collect()
    };
    let (events, _) = drain(&mut r);
    assert_eq!(
        dials(&events),
        [0],
        "a tuned session starts with one stream"
    );
    r.connected(start, 5, 0, 1, None);
    // Goodput that doubles with each stream, then stays flat: warm-up, baseline, two
    // streams that pay, one that does not.
    let mut opened = Vec::new();
    for (second, bytes) in [(1u64, 100u64), (2, 1000), (3, 2000), (4, 4000), (5, 4000)] {
        r.stats.segment_bytes += bytes;
        r.handle_timeout(start + Duration::from_secs(second));
        let (events, _) = drain(&mut r);
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, ReceiverEvent::Close { .. })),
            "{events:?}"
        );
        opened.extend(dials(&events));
    }
    assert_eq!(opened, [1, 2, 3]);
    assert_eq!(r.stream_count(), 4);
}

#[test]
fn an_untuned_session_opens_every_stream() {
    let mut r = receiver(3, 1);
    r.start_session(Instant::now(), 5);
    let (events, _) = drain(&mut r);
    let dials = events
        .iter()
        .filter(|e| matches!(e, ReceiverEvent::Dial { .. }))
        .count();
    assert_eq!(dials, 3);
    assert_eq!(r.stream_count(), 3);
}

#[track_caller]
pub(super) fn lost(r: &mut Receiver, needle: &str) {
    let (events, _) = drain(r);
    assert!(
        events.iter().any(|e| matches!(
            e,
            ReceiverEvent::UpstreamLost { reason } if reason.to_string().contains(needle)
        )),
        "{needle}: {events:?}"
    );
}

#[test]
fn a_snapshot_version_at_the_end_of_the_numbers_is_refused() {
    let mut r = joining_receiver(1);
    let now = Instant::now();
    r.start_session(now, 5);
    r.connected(now, 5, 0, 1, None);
    r.handle_frame(now, 1, hub_welcome(Some(u64::MAX - 1)));
    let (events, _) = drain(&mut r);
    assert!(
        events.iter().any(|e| matches!(
            e,
            ReceiverEvent::UpstreamLost { reason } if reason.to_string().contains("too close to the last version number")
        )),
        "{events:?}"
    );
}

#[test]
fn a_relaying_receiver_starts_at_its_upstream_s_newest_version_until_it_holds_one() {
    let now = Instant::now();
    let mut r = relaying_receiver(Some(0));
    assert_eq!(
        r.next_version(),
        1,
        "version 0 comes as no delta: it starts from 1"
    );
    // A session before anything is delivered starts again from the newest.
    r.start_session(now, 6);
    r.connected(now, 6, 0, 2, None);
    r.handle_frame(now, 2, hub_welcome_at(Some(4)));
    assert_eq!(r.next_version(), 4);
    let (_, out) = drain(&mut r);
    assert!(
        out.iter().any(|(_, f)| matches!(
            f,
            Frame::Want {
                next_version: 4,
                snapshot: false,
                composed: false,
                ..
            }
        )),
        "{out:?}"
    );
    let (bytes, _) = artifact(4, 2);
    for frame in frames(&bytes) {
        r.handle_frame(now, 2, frame);
    }
    assert_eq!(completed(&drain(&mut r).0), [(4, bytes)]);
    // Holding a version, it follows on from it whatever the next Welcome says.
    r.start_session(now, 7);
    r.connected(now, 7, 0, 3, None);
    r.handle_frame(now, 3, hub_welcome_at(Some(9)));
    assert_eq!(r.next_version(), 5);
}

#[test]
fn a_relay_whose_next_version_is_gone_upstream_starts_again_at_the_newest() {
    let now = Instant::now();
    let mut r = relaying_receiver(Some(4));
    let (bytes, _) = artifact(4, 2);
    for frame in frames(&bytes) {
        r.handle_frame(now, 1, frame);
    }
    assert_eq!(completed(&drain(&mut r).0), [(4, bytes)]);
    // Cut off for longer than its upstream keeps deltas: version 5 is gone there.
    r.handle_frame(
        now,
        1,
        Frame::Unavailable {
            version: 5,
            reason: "versions from 12 are held".into(),
        },
    );
    let (events, _) = drain(&mut r);
    assert!(
        events
            .iter()
            .any(|e| matches!(e, ReceiverEvent::UpstreamLost { .. })),
        "{events:?}"
    );
    assert!(r.choosing_start());
    r.start_session(now, 8);
    r.connected(now, 8, 0, 3, None);
    r.handle_frame(now, 3, hub_welcome_at(Some(15)));
    assert_eq!(r.next_version(), 15, "it follows on from the newest, not 5");
    let (_, out) = drain(&mut r);
    assert!(
        out.iter().any(|(_, f)| matches!(
            f,
            Frame::Want {
                next_version: 15,
                ..
            }
        )),
        "{out:?}"
    );
    // An Unavailable for a version beyond its next one is no reason to move.
    let (bytes, _) = artifact(15, 2);
    for frame in frames(&bytes) {
        r.handle_frame(now, 3, frame);
    }
    assert!(!r.choosing_start());
    r.handle_frame(
        now,
        3,
        Frame::Unavailable {
            version: 17,
            reason: "not yet".into(),
        },
    );
    assert!(!r.choosing_start());
}

#[test]
fn a_relaying_receiver_refuses_a_start_at_the_end_of_the_numbers() {
    let mut r = relaying_receiver(Some(u64::MAX - 1));
    lost(&mut r, "names version 18446744073709551614 to start from");
}

#[test]
fn a_joining_receiver_wants_the_offered_snapshot_with_the_flag() {
    let mut r = connected_joining(1, 4);
    assert!(r.is_joining());
    assert_eq!(r.next_version(), 4);
    // The Want that followed the Welcome was drained by the helper; the stream's next
    // connection makes another.
    let now = Instant::now();
    r.connected(now, 5, 0, 1, None);
    r.handle_frame(now, 1, hub_welcome(Some(4)));
    let (_, out) = drain(&mut r);
    assert!(
        out.iter().any(|(_, f)| matches!(
            f,
            Frame::Want {
                next_version: 4,
                snapshot: true,
                composed: false,
                ..
            }
        )),
        "{out:?}"
    );
    let (bytes, _) = snapshot_artifact(4, 3);
    for frame in frames_of(&bytes, ArtifactKind::Snapshot) {
        r.handle_frame(now, 1, frame);
    }
    let (events, out) = drain(&mut r);
    let complete: Vec<(u64, ArtifactKind)> = events
        .iter()
        .filter_map(|e| match e {
            ReceiverEvent::Complete { version, artifact } => Some((*version, artifact.kind())),
            _ => None,
        })
        .collect();
    assert_eq!(complete, [(4, ArtifactKind::Snapshot)]);
    assert!(!r.is_joining());
    assert!(
        out.iter().any(|(_, f)| matches!(
            f,
            Frame::Want {
                next_version: 5,
                snapshot: false,
                composed: false,
                ..
            }
        )),
        "then deltas, as any receiver: {out:?}"
    );
    // The first Hello of a joining receiver says it holds nothing.
    let mut fresh = joining_receiver(1);
    fresh.start_session(now, 9);
    fresh.connected(now, 9, 0, 1, None);
    let (_, out) = drain(&mut fresh);
    assert!(
        matches!(&out[0], (1, Frame::Hello(h)) if h.active == VersionRef::default() && h.staged.is_none())
    );
}

#[test]
fn a_wrong_kind_for_a_version_is_a_protocol_violation() {
    let (snapshot, _) = snapshot_artifact(1, 1);
    let (delta, _) = artifact(1, 1);
    let offer = |bytes: &Bytes, kind| frames_of(bytes, kind).remove(0);

    let mut r = connected_joining(1, 1);
    r.handle_frame(Instant::now(), 1, offer(&delta, ArtifactKind::Delta));
    lost(&mut r, "version 1 offered as a delta, wanted as a snapshot");

    let mut r = connected(1);
    r.handle_frame(Instant::now(), 1, offer(&snapshot, ArtifactKind::Snapshot));
    lost(&mut r, "version 1 offered as a snapshot, wanted as a delta");

    // The descriptor must be a snapshot's: from the empty checkpoint, every tensor added.
    let mut r = connected_joining(1, 1);
    r.handle_frame(Instant::now(), 1, offer(&delta, ArtifactKind::Snapshot));
    lost(&mut r, "must name it as base and target");

    // Versions after the snapshot are deltas.
    let (next, _) = snapshot_artifact(2, 1);
    let mut r = connected_joining(1, 1);
    r.handle_frame(Instant::now(), 1, offer(&next, ArtifactKind::Snapshot));
    lost(&mut r, "version 2 offered as a snapshot, wanted as a delta");
}

#[test]
fn a_joining_receiver_gives_up_an_upstream_that_offers_no_snapshot() {
    let now = Instant::now();
    let mut r = joining_receiver(2);
    r.start_session(now, 5);
    r.connected(now, 5, 0, 1, None);
    r.handle_frame(
        now,
        1,
        Frame::Welcome(Welcome {
            protocol_version: PROTOCOL_VERSION,
            role: Role::Relay,
            peer_id: "relay-eu".into(),
            region: "eu".into(),
            latest: Some(9),
            commit: None,
            snapshot: None,
            run: RUN,
        }),
    );
    let (events, out) = drain(&mut r);
    assert!(events.iter().any(|e| matches!(
        e,
        ReceiverEvent::UpstreamLost { reason: SessionEnd::NoSnapshot { role: Role::Relay, peer_id } } if peer_id == "relay-eu"
    )));
    assert!(
        !out.iter().any(|(_, f)| matches!(f, Frame::Want { .. })),
        "it asks nothing of it: {out:?}"
    );
    assert!(r.is_joining());
}

#[test]
fn rejoining_forgets_the_snapshot_and_takes_the_next_offer() {
    let mut s = crate::testutil::store_sender(3, 3);
    let (bytes, _) = snapshot_artifact(3, 4);
    let mut pair = Pair::new(s, joining_receiver(1));
    pair.sender
        .loaded(
            crate::ArtifactKey::Snapshot(3),
            Ok(crate::StoredArtifact::unsigned(bytes.clone())),
        )
        .unwrap();
    pair.pump();
    assert_eq!(pair.complete(), [(3, bytes.clone())]);
    // The actor refused it (its weights did not hash to the target): start over.
    pair.receiver.rejoin();
    assert!(pair.receiver.is_joining());
    pair.receiver.abandon("refused");
    pair.pump();
    s = crate::testutil::store_sender(3, 3);
    s.loaded(
        crate::ArtifactKey::Snapshot(3),
        Ok(crate::StoredArtifact::unsigned(bytes.clone())),
    )
    .unwrap();
    pair.sender = s;
    pair.receiver.start_session(pair.now, 90);
    pair.pump();
    pair.sender
        .loaded(
            crate::ArtifactKey::Snapshot(3),
            Ok(crate::StoredArtifact::unsigned(bytes.clone())),
        )
        .unwrap();
    pair.pump();
    assert_eq!(pair.complete(), [(3, bytes.clone()), (3, bytes)]);
    assert_eq!(pair.sender.stats().segments_sent, 4, "all of it again");
}

#[test]
fn a_composed_delta_from_the_version_before_the_next_is_delivered_as_its_target() {
    let mut r = connected_composed(4);
    let now = Instant::now();
    // Beyond the window (4 + 4 ahead), its segments and table overtaking its Offer.
    let (bytes, _) = composed_artifact(3, 12, 3);
    let mut all = frames_of(&bytes, ArtifactKind::Composed);
    all.rotate_left(1);
    for frame in all {
        r.handle_frame(now, 1, frame);
    }
    let (events, out) = drain(&mut r);
    assert_eq!(completed(&events), [(12, bytes)]);
    assert!(events.iter().any(|e| matches!(
        e,
        ReceiverEvent::Complete { artifact, .. } if artifact.kind() == ArtifactKind::Composed
    )));
    assert_eq!(r.next_version(), 13);
    // The next Want goes on from 13, still accepting one.
    assert!(out.iter().any(|(_, f)| matches!(
        f,
        Frame::Want {
            next_version: 13,
            composed: true,
            ..
        }
    )));
}

#[test]
fn a_composed_delta_with_the_wrong_base_is_a_protocol_violation() {
    let offer = |bytes: &Bytes| frames_of(bytes, ArtifactKind::Composed).remove(0);
    let now = Instant::now();
    // The receiver is at 3 (next 4): a composed delta must start from 3.
    let mut r = connected_composed(4);
    r.handle_frame(now, 1, offer(&composed_artifact(2, 8, 1).0));
    lost(&mut r, "starts from version 2");
    // The right version with other weights.
    let (mut bytes, _) = composed_artifact(3, 8, 1);
    let file = aurora_delta::DeltaFile::parse(&bytes).unwrap();
    let mut header = file.header().clone();
    header.base_hash = aurora_delta::Hash([9; 32]);
    let (_, rebuilt) = aurora_delta::assemble(&header, &[b"x".to_vec()]);
    bytes = Bytes::from(rebuilt);
    let mut r = connected_composed(4);
    r.handle_frame(now, 1, offer(&bytes));
    lost(&mut r, "but this receiver is at version 3");
    // Not past the next version.
    let mut r = connected_composed(4);
    r.handle_frame(now, 1, offer(&composed_artifact(3, 4, 1).0));
    lost(&mut r, "does not go past the next version 4");
    // A receiver that did not accept composed catch-up (a relay's).
    let mut r = connected(1);
    r.handle_frame(now, 1, offer(&composed_artifact(0, 3, 1).0));
    lost(&mut r, "which this receiver did not accept");
}

#[test]
fn only_one_version_beyond_the_window_is_held() {
    let mut r = connected_composed(4);
    let now = Instant::now();
    let old = frames_of(&composed_artifact(3, 12, 2).0, ArtifactKind::Composed);
    r.handle_frame(now, 1, old[2].clone());
    let held = r.held_bytes;
    assert!(held > 0);
    // Another target: the old one is dropped, not added to.
    let new = frames_of(&composed_artifact(3, 14, 2).0, ArtifactKind::Composed);
    r.handle_frame(now, 1, new[2].clone());
    assert_eq!(r.assemblies.keys().copied().collect::<Vec<_>>(), [14]);
    assert_eq!(r.held_bytes, held);
    // A receiver that did not accept composed catch-up keeps its window.
    let mut r = connected(1);
    r.handle_frame(now, 1, new[2].clone());
    lost(&mut r, "version 14 is beyond the window");
}

#[test]
fn an_offer_of_the_other_kind_for_a_held_version_drops_it_and_ends_the_session() {
    let mut r = connected_composed(4);
    let now = Instant::now();
    let delta = frames(&artifact(8, 2).0);
    r.handle_frame(now, 1, delta[0].clone());
    r.handle_frame(now, 1, delta[2].clone());
    assert!(r.assemblies.contains_key(&8));
    let composed = frames_of(&composed_artifact(3, 8, 2).0, ArtifactKind::Composed);
    r.handle_frame(now, 1, composed[0].clone());
    lost(&mut r, "version 8 is now offered as a composed delta");
    assert!(!r.assemblies.contains_key(&8), "parts of D(8) are dropped");
    assert_eq!(r.held_bytes, 0);
}

/// What a consumer saw: the segments announced (index and length), and the complete
/// artifact's segments (hash and length).
struct Taken {
    announced: Vec<(u32, usize)>,
    held: Vec<(Hash, usize)>,
}

/// Feeds `frames` of `version` to `r`, the first segment ahead of its Offer, taking the
/// segments as they are announced from the Offer on.
fn taken_as_announced(mut r: Receiver, version: u64, mut frames: Vec<Frame>) -> Taken {
    let now = Instant::now();
    frames.swap(0, 1);
    let mut events = Vec::new();
    for (n, frame) in frames.into_iter().enumerate() {
        r.handle_frame(now, 1, frame);
        events.extend(drain(&mut r).0);
        if n == 1 {
            // The consumer sees the Offer, and the segment that overtook it, and takes
            // what follows as it comes.
            r.take_segments(version);
        }
    }
    let announced = events
        .iter()
        .filter_map(|e| match e {
            ReceiverEvent::Segment { index, bytes, .. } => Some((*index, bytes.len())),
            _ => None,
        })
        .collect();
    let artifact = events
        .iter()
        .find_map(|e| match e {
            ReceiverEvent::Complete { artifact, .. } => Some(artifact),
            _ => None,
        })
        .expect("the artifact is complete");
    let held = artifact
        .segments()
        .map(|(_, hash, bytes)| (hash, bytes.len()))
        .collect();
    Taken { announced, held }
}

#[test]
fn a_receiver_whose_consumer_takes_the_segments_keeps_only_their_hashes() {
    let snapshot = snapshot_artifact(4, 3);
    let delta = artifact(1, 3);
    for (receiver, version, (bytes, manifest), kind) in [
        (connected_joining(1, 4), 4, snapshot, ArtifactKind::Snapshot),
        (connected(1), 1, delta, ArtifactKind::Delta),
    ] {
        let Taken { announced, held } =
            taken_as_announced(receiver, version, frames_of(&bytes, kind));
        let expected: Vec<(u32, usize)> = (0..3)
            .map(|i| (i, manifest.segments[i as usize].len as usize))
            .collect();
        let mut announced = announced;
        announced.sort_unstable();
        assert_eq!(announced, expected, "{kind:?}: each announced once, whole");
        let hashes: Vec<(Hash, usize)> = manifest.segments.iter().map(|s| (s.hash, 0)).collect();
        assert_eq!(held, hashes, "{kind:?}: only the hashes are kept");
    }
}
