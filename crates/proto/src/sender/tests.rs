// Have-sets are vectors of ranges; a set with one range is not a mistake.
#![allow(clippy::single_range_in_vec_init)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use aurora_delta::DeltaFile;
use bytes::Bytes;

use super::*;
use crate::frame::{ArtifactKind, Hello, Progress, RejectCode};
use crate::receiver::ReceiverEvent;
use crate::testutil::{
    Pair, RUN, TOKEN, another_artifact, artifact, artifact_signature, commit, composed_artifact,
    composed_receiver, hello, identity, joining_receiver, receiver, sender, snapshot_artifact,
    store_sender, trainer_key, weights,
};

/// Sends a Hello on a fresh connection and returns the answer.
fn handshake(sender: &mut Sender, conn: ConnId, hello: Hello) -> Transmit {
    let now = Instant::now();
    sender.accepted(now, conn, None);
    sender.handle_frame(now, conn, Frame::Hello(hello));
    sender.poll_transmit(now).expect("an answer")
}

/// Opens session 5, one stream, on connection 1 and writes its Welcome.
fn welcomed(sender: &mut Sender, now: Instant) {
    handshake(sender, 1, hello(5, 0, 1));
    sender.on_sent(now, 1);
}

/// A Want on one live stream at epoch 1, from `next_version` on.
fn want(seq: u64, next_version: u64, snapshot: bool, progress: Vec<Progress>) -> Frame {
    Frame::Want {
        seq,
        next_version,
        snapshot,
        composed: false,
        live_streams: 1,
        epochs: vec![1],
        progress,
    }
}

/// Progress on a delta of `version` whose offer and table arrived, holding `have`.
fn holding(version: u64, have: Vec<std::ops::Range<u32>>) -> Progress {
    Progress {
        version,
        has_offer: true,
        has_seal: true,
        composed: false,
        have,
    }
}

/// Writes everything queued on connection 1 and returns it.
fn drain(sender: &mut Sender, now: Instant) -> Vec<Frame> {
    let mut sent = Vec::new();
    while let Some(t) = sender.poll_transmit(now) {
        sender.on_sent(now, 1);
        sent.push(t.frame);
    }
    sent
}

/// Whether the receiver gave up on its upstream for a reason containing `needle`.
fn lost_upstream(pair: &Pair, needle: &str) -> bool {
    pair.events
        .iter()
        .any(|e| matches!(e, ReceiverEvent::UpstreamLost { reason } if reason.to_string().contains(needle)))
}

#[track_caller]
fn refused(transmit: Transmit, code: RejectCode, needle: &str) {
    match transmit.frame {
        Frame::Reject { code: c, reason } => {
            assert_eq!(c, code);
            assert!(reason.contains(needle), "{reason}");
            assert!(transmit.close_after);
        }
        other => panic!("expected a Reject, got {other:?}"),
    }
}

#[test]
fn handshakes_are_checked() {
    let mut s = sender();
    let mut old = hello(1, 0, 1);
    old.protocol_version = 9;
    refused(handshake(&mut s, 1, old), RejectCode::Version, "version 9");
    // A peer of version 1 (before signatures) is told what to upgrade.
    let mut unsigned = hello(1, 0, 1);
    unsigned.protocol_version = 1;
    refused(
        handshake(&mut s, 9, unsigned),
        RejectCode::Version,
        "upgrade the actor",
    );
    let mut flagged = hello(1, 0, 1);
    flagged.flags = 4;
    refused(handshake(&mut s, 2, flagged), RejectCode::Refused, "flags");
    let mut wrong = hello(1, 0, 1);
    wrong.token = b"guess".to_vec();
    refused(
        handshake(&mut s, 3, wrong),
        RejectCode::Auth,
        "token is wrong",
    );
    let mut hub = hello(1, 0, 1);
    hub.role = Role::Hub;
    refused(handshake(&mut s, 4, hub), RejectCode::Refused, "hub");

    let welcome = handshake(&mut s, 5, hello(1, 0, 2));
    assert!(matches!(welcome.frame, Frame::Welcome(_)));
    refused(
        handshake(&mut s, 6, hello(1, 0, 3)),
        RejectCode::Refused,
        "2 streams",
    );
    let mut thief = hello(1, 1, 2);
    thief.peer_id = "a2".into();
    refused(
        handshake(&mut s, 7, thief),
        RejectCode::Refused,
        "another peer",
    );

    let now = Instant::now();
    s.accepted(now, 8, None);
    s.handle_frame(now, 8, Frame::Keepalive);
    refused(
        s.poll_transmit(now).unwrap(),
        RejectCode::Refused,
        "must be Hello",
    );
}

#[test]
fn per_peer_tokens_and_the_session_limit() {
    let mut config = SenderConfig::new(
        identity(Role::Hub, "hub"),
        Auth::PerPeer(BTreeMap::from([("a1".to_string(), b"one".to_vec())])),
    );
    config.max_sessions = 1;
    let mut s = Sender::new(config);
    let mut known = hello(1, 0, 1);
    known.token = b"one".to_vec();
    assert!(matches!(
        handshake(&mut s, 1, known).frame,
        Frame::Welcome(_)
    ));
    let mut stranger = hello(2, 0, 1);
    stranger.peer_id = "zz".into();
    stranger.token = b"one".to_vec();
    refused(handshake(&mut s, 2, stranger), RejectCode::Auth, "unknown");
    let mut second = hello(3, 0, 1);
    second.token = b"one".to_vec();
    refused(
        handshake(&mut s, 3, second),
        RejectCode::Busy,
        "limit of 1 sessions",
    );
}

#[test]
fn a_handshake_that_never_comes_is_closed() {
    let mut s = sender();
    let start = Instant::now();
    s.accepted(start, 1, None);
    let deadline = s.poll_timeout().unwrap();
    assert_eq!(deadline, start + s.config.handshake_timeout);
    s.handle_timeout(deadline);
    assert!(matches!(
        s.poll_event(),
        Some(SenderEvent::Close { conn: 1, .. })
    ));
}

/// Writes done as soon as they are handed out leave no segment in flight: every segment
/// rides the session's first stream, the one the last versions kept warm.
#[test]
fn versions_written_at_once_ride_the_session_s_first_stream_and_complete_in_order() {
    let mut s = sender();
    for version in 1..=3 {
        s.insert_artifact(crate::StoredArtifact::unsigned(artifact(version, 10).0))
            .unwrap();
    }
    let pair = Pair::new(s, receiver(4, 1));
    let complete = pair.complete();
    assert_eq!(complete.len(), 3);
    for (version, bytes) in complete {
        assert_eq!(bytes, artifact(version, 10).0);
    }
    let first = pair.conns[0].expect("stream 0 is up");
    let segments: Vec<ConnId> = pair
        .written
        .iter()
        .filter(|(_, f)| matches!(f, Frame::Segment { .. }))
        .map(|(c, _)| *c)
        .collect();
    assert_eq!(segments.len(), 30);
    assert!(
        segments.iter().all(|&c| c == first),
        "every segment on stream 0: {segments:?}"
    );
    assert_eq!(pair.receiver.stats().duplicates, 0);
    assert_eq!(pair.sender.stats().segments_resent, 0);
}

/// A segment goes to the session's stream with the fewest segments in flight, the
/// lowest on a tie, so a transfer of many segments spreads over the streams as they
/// drain; the Offer and the Seal are not segments.
#[test]
fn a_transfer_of_many_segments_spreads_over_the_streams_fewest_in_flight_first() {
    let now = Instant::now();
    let mut s = sender();
    s.insert_artifact(crate::StoredArtifact::unsigned(artifact(1, 20).0))
        .unwrap();
    two_streams_wanting(&mut s, now, 1);
    let mut next = || s.poll_transmit(now).map(|t| t.conn);
    let handed: Vec<ConnId> = std::iter::from_fn(&mut next).collect();
    // Offer, Seal, a segment on stream 0; then a segment each in turn until both
    // windows (four frames) are full.
    assert_eq!(handed, [1, 1, 1, 2, 1, 2, 2, 2]);
    // Stream 1 drains two segments: it has room, stream 0 none.
    s.on_sent(now, 2);
    s.on_sent(now, 2);
    assert_eq!(s.poll_transmit(now).map(|t| t.conn), Some(2));
    // Stream 0 writes its Offer and Seal: two segments in flight against three.
    s.on_sent(now, 1);
    s.on_sent(now, 1);
    assert_eq!(s.poll_transmit(now).map(|t| t.conn), Some(1));
    assert_eq!(
        s.poll_transmit(now).map(|t| t.conn),
        Some(1),
        "a tie: the lowest"
    );
    assert_eq!(s.poll_transmit(now).map(|t| t.conn), Some(2));
    assert!(s.poll_transmit(now).is_none());
}

/// Sessions take turns, whatever their ids and their connections' numbers: one with a
/// large version to send does not hold back another's frames.
#[test]
fn sessions_take_turns() {
    let now = Instant::now();
    for sessions in [[5, 6], [6, 5], [9, 1], [u64::MAX, 3]] {
        let mut s = sender();
        s.insert_artifact(crate::StoredArtifact::unsigned(artifact(1, 6).0))
            .unwrap();
        for (conn, session) in [1, 2].into_iter().zip(sessions) {
            handshake(&mut s, conn, hello(session, 0, 1));
            s.on_sent(now, conn);
            s.handle_frame(now, conn, want(1, 1, false, vec![]));
        }
        let mut order = Vec::new();
        while let Some(t) = s.poll_transmit(now) {
            s.on_sent(now, t.conn);
            order.push(t.conn);
        }
        assert_eq!(
            order.len(),
            16,
            "Offer, Seal and six segments each: {order:?}"
        );
        assert!(
            order.windows(2).all(|pair| pair[0] != pair[1]),
            "sessions {sessions:?} alternate: {order:?}"
        );
    }
}

#[test]
fn a_window_bounds_what_the_driver_holds_and_a_stalled_session_is_dropped() {
    let mut s = sender();
    s.insert_artifact(crate::StoredArtifact::unsigned(artifact(1, 20).0))
        .unwrap();
    let now = Instant::now();
    welcomed(&mut s, now);
    s.handle_frame(now, 1, want(1, 1, false, vec![]));
    let mut handed = 0;
    while s.poll_transmit(now).is_some() {
        handed += 1;
    }
    assert_eq!(handed, s.config.window_frames, "never more than the window");
    s.on_sent(now, 1);
    assert!(s.poll_transmit(now).is_some(), "room again after a write");
    assert!(s.poll_transmit(now).is_none());
    let stall = now + s.config.stall_timeout;
    assert_eq!(s.poll_timeout(), Some(stall));
    s.handle_timeout(stall);
    let events: Vec<SenderEvent> = std::iter::from_fn(|| s.poll_event()).collect();
    assert!(events.contains(&SenderEvent::Close {
        conn: 1,
        reason: format!(
            "no write completed for {:?}: too slow",
            s.config.stall_timeout
        )
    }));
    assert_eq!(s.stats().sessions_dropped, 1);
}

#[test]
fn idle_connections_get_keepalives() {
    let mut s = sender();
    let now = Instant::now();
    welcomed(&mut s, now);
    let later = now + s.config.keepalive_interval;
    s.handle_timeout(later);
    assert_eq!(s.poll_transmit(later).unwrap().frame, Frame::Keepalive);
}

#[test]
fn a_want_resumes_with_only_the_missing_segments() {
    let mut s = sender();
    s.insert_artifact(crate::StoredArtifact::unsigned(artifact(1, 8).0))
        .unwrap();
    let now = Instant::now();
    welcomed(&mut s, now);
    s.handle_frame(
        now,
        1,
        want(1, 1, false, vec![holding(1, vec![0..3, 5..7])]),
    );
    let indices: Vec<u32> = drain(&mut s, now)
        .iter()
        .map(|f| match f {
            Frame::Segment { index, .. } => *index,
            other => panic!("only missing segments, got {other:?}"),
        })
        .collect();
    assert_eq!(indices, [3, 4, 7]);
}

#[test]
fn a_want_overtaken_by_a_later_one_is_ignored() {
    let mut s = sender();
    s.insert_artifact(crate::StoredArtifact::unsigned(artifact(1, 4).0))
        .unwrap();
    let now = Instant::now();
    welcomed(&mut s, now);
    s.handle_frame(now, 1, want(2, 1, false, vec![holding(1, vec![0..3])]));
    s.handle_frame(now, 1, want(1, 1, false, vec![holding(1, vec![])]));
    let sent = drain(&mut s, now);
    assert!(
        matches!(&sent[..], [Frame::Segment { index: 3, .. }]),
        "the stale Want must not undo the later one: {sent:?}"
    );
}

#[test]
fn a_nack_resends_that_segment() {
    let mut s = sender();
    s.insert_artifact(crate::StoredArtifact::unsigned(artifact(1, 3).0))
        .unwrap();
    let now = Instant::now();
    welcomed(&mut s, now);
    s.handle_frame(now, 1, want(1, 1, false, vec![]));
    let segments: Vec<u32> = drain(&mut s, now)
        .iter()
        .filter_map(|f| match f {
            Frame::Segment { index, .. } => Some(*index),
            _ => None,
        })
        .collect();
    assert_eq!(segments, [0, 1, 2]);
    s.handle_frame(
        now,
        1,
        Frame::Nack {
            version: 1,
            index: 1,
        },
    );
    let again = s.poll_transmit(now).unwrap().frame;
    assert!(
        matches!(again, Frame::Segment { index: 1, .. }),
        "{again:?}"
    );
    assert_eq!(s.stats().nacks, 1);
    assert_eq!(s.stats().segments_resent, 1);
    assert!(s.poll_transmit(now).is_none());
}

#[test]
fn a_nack_for_a_segment_never_held_is_ignored_whatever_its_index() {
    // Found by fuzzing: a hostile index used to size a per-segment table.
    let mut s = sender();
    s.insert_artifact(crate::StoredArtifact::unsigned(artifact(1, 2).0))
        .unwrap();
    let now = Instant::now();
    welcomed(&mut s, now);
    let have = vec![0..2, MAX_TRANSFER_SEGMENTS - 1..MAX_TRANSFER_SEGMENTS];
    s.handle_frame(now, 1, want(1, 1, false, vec![holding(1, have)]));
    for index in [2, MAX_TRANSFER_SEGMENTS - 1, u32::MAX] {
        s.handle_frame(now, 1, Frame::Nack { version: 1, index });
    }
    assert_eq!(s.poll_transmit(now), None, "nothing to resend");
    assert_eq!(s.stats().nacks, 3);
}

/// `sender`, configured by `configure`, holding the deltas `versions` (complete).
fn sender_holding(
    versions: std::ops::RangeInclusive<u64>,
    configure: impl FnOnce(&mut Sender),
) -> Sender {
    let mut s = sender();
    configure(&mut s);
    for version in versions {
        s.insert_artifact(crate::StoredArtifact::unsigned(artifact(version, 2).0))
            .unwrap();
    }
    s
}

/// Whether a receiver from version 1 is told version 1 is gone and 3 is the oldest held.
fn from_version_3(relay: Sender) -> bool {
    lost_upstream(
        &Pair::new(relay, receiver(1, 1)),
        "version 1 is unavailable there: version 1 is not held here (versions from 3 are)",
    )
}

#[test]
fn a_relay_keeps_at_most_its_byte_budget_of_versions_and_always_the_newest() {
    // What a sender holds of a delta: descriptor and segments, not the table.
    let size = |version| {
        let (bytes, manifest) = artifact(version, 2);
        (bytes.len() - manifest.encode_tail().len()) as u64
    };
    // Room for versions 3 and 4, not for a third: the count would allow four.
    let budget = size(3) + size(4);
    assert!(from_version_3(sender_holding(1..=4, |s| s
        .config
        .retain_bytes =
        budget)));
    // A delta larger than the budget is kept all the same while it is the newest.
    let relay = sender_holding(1..=2, |s| s.config.retain_bytes = 1);
    let pair = Pair::new(relay, receiver(1, 2));
    assert_eq!(pair.complete(), [(2, artifact(2, 2).0)]);
}

#[test]
fn a_relay_reports_versions_it_no_longer_holds_and_a_store_loads_them() {
    assert!(from_version_3(sender_holding(1..=4, |s| s
        .config
        .retain_versions =
        2)));

    let mut hub = sender_holding(1..=4, |s| {
        s.config.store_backed = true;
        s.config.retain_versions = 2;
    });
    hub.set_loadable(Some(4));
    let mut pair = Pair::new(hub, receiver(1, 1));
    assert!(
        pair.sender_events
            .contains(&SenderEvent::Load(ArtifactKey::Delta(1)))
    );
    assert!(pair.complete().is_empty(), "waits for the load");
    pair.sender
        .insert_artifact(crate::StoredArtifact::unsigned(artifact(1, 2).0))
        .unwrap();
    pair.pump();
    pair.sender
        .insert_artifact(crate::StoredArtifact::unsigned(artifact(2, 2).0))
        .unwrap();
    pair.pump();
    assert_eq!(
        pair.complete().iter().map(|(v, _)| *v).collect::<Vec<_>>(),
        [1, 2, 3, 4]
    );
}

#[test]
fn a_failed_load_is_reported_unavailable() {
    let mut hub = sender();
    hub.config.store_backed = true;
    hub.set_loadable(Some(3));
    let mut pair = Pair::new(hub, receiver(1, 1));
    pair.sender
        .loaded(ArtifactKey::Delta(1), Err("pruned".into()))
        .unwrap_err();
    pair.pump();
    assert!(lost_upstream(&pair, "pruned"));
}

#[test]
fn live_publishing_sends_segments_as_they_come_and_the_table_last() {
    let (bytes, manifest) = artifact(1, 4);
    let file = DeltaFile::parse(&bytes).unwrap();
    let head = file.header().encode_pending();
    let mut pair = Pair::new(sender(), receiver(2, 1));
    pair.sender
        .begin_artifact(ArtifactKind::Delta, Bytes::from(head.clone()), None)
        .unwrap();
    let mut offset = head.len();
    for (index, entry) in manifest.segments.iter().enumerate() {
        let segment = bytes.slice(offset..offset + entry.len as usize);
        offset += entry.len as usize;
        pair.sender
            .add_segment(ArtifactKey::Delta(1), index as u32, entry.hash, segment)
            .unwrap();
        pair.pump();
        let delivered = pair
            .events
            .iter()
            .filter(|e| matches!(e, ReceiverEvent::Segment { .. }))
            .count();
        assert_eq!(delivered, index + 1, "cut-through: each segment at once");
    }
    assert!(pair.complete().is_empty());
    pair.sender
        .seal_artifact(
            ArtifactKey::Delta(1),
            manifest.header.target_hash,
            manifest.id(),
            manifest.segments.clone(),
            None,
        )
        .unwrap();
    pair.pump();
    assert_eq!(pair.complete(), [(1, bytes)]);
}

/// A segment's buffer that counts its release: whether a sender still holds it.
struct Tracked {
    bytes: Vec<u8>,
    released: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl AsRef<[u8]> for Tracked {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.released
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn a_delta_published_live_is_held_once_its_whole_artifact_is_inserted() {
    let (bytes, manifest) = artifact(1, 3);
    let file = DeltaFile::parse(&bytes).unwrap();
    let released = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut s = sender();
    s.begin_artifact(
        ArtifactKind::Delta,
        Bytes::from(file.header().encode_pending()),
        None,
    )
    .unwrap();
    for (index, entry) in manifest.segments.iter().enumerate() {
        let segment = Bytes::from_owner(Tracked {
            bytes: file.verify_segment(index).unwrap().to_vec(),
            released: released.clone(),
        });
        s.add_segment(ArtifactKey::Delta(1), index as u32, entry.hash, segment)
            .unwrap();
    }
    seal(&mut s, &manifest).unwrap();
    let held = || released.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(held(), 0, "the sender holds every segment it was given");
    // The hub joins the delta to store it: the sender serves the joined bytes from now
    // on, and the buffers the segments came in are freed.
    let whole = Bytes::copy_from_slice(&bytes);
    s.insert_artifact(StoredArtifact::unsigned(whole.clone()))
        .unwrap();
    assert_eq!(held(), 3, "the segments' own buffers are released");
    let pair = Pair::new(s, receiver(1, 1));
    assert_eq!(pair.complete(), [(1, bytes)]);
    let within = whole.as_ptr() as usize..whole.as_ptr() as usize + whole.len();
    for (_, frame) in &pair.written {
        if let Frame::Segment { bytes, .. } = frame {
            assert!(
                within.contains(&(bytes.as_ptr() as usize)),
                "served from `whole`"
            );
        }
    }
}

/// Seals version 1, begun on `s`, with `manifest`'s table, unsigned.
fn seal(s: &mut Sender, manifest: &aurora_delta::Manifest) -> Result<(), SenderError> {
    s.seal_artifact(
        ArtifactKey::Delta(1),
        manifest.header.target_hash,
        manifest.id(),
        manifest.segments.clone(),
        None,
    )
}

/// Segment `index` of the artifact `bytes` and its hash.
fn segment_of(bytes: &Bytes, index: usize) -> (Hash, Bytes) {
    let file = DeltaFile::parse(bytes).unwrap();
    (
        file.manifest.segments[index].hash,
        Bytes::copy_from_slice(file.verify_segment(index).unwrap()),
    )
}

#[test]
fn a_publication_begun_again_starts_over_and_empty_slots_beyond_the_table_are_dropped() {
    // A publication of version 1 fails before its Seal; another, with the same
    // descriptor (the target hash pending) but other segments, follows.
    let (failed, _) = another_artifact(1, 3);
    let (bytes, manifest) = artifact(1, 2);
    let descriptor = Bytes::from(manifest.header.encode_pending());
    let mut s = sender();
    s.begin_artifact(ArtifactKind::Delta, descriptor.clone(), None)
        .unwrap();
    for index in 0..3 {
        let (hash, segment) = segment_of(&failed, index);
        s.add_segment(ArtifactKey::Delta(1), index as u32, hash, segment)
            .unwrap();
    }
    s.begin_artifact(ArtifactKind::Delta, descriptor.clone(), None)
        .unwrap();
    for index in 0..2 {
        let (hash, segment) = segment_of(&bytes, index);
        s.add_segment(ArtifactKey::Delta(1), index as u32, hash, segment)
            .unwrap();
    }
    seal(&mut s, &manifest).unwrap();
    assert_eq!(
        Pair::new(s, receiver(1, 1)).complete(),
        [(1, bytes.clone())]
    );

    // A relay forwarded three segments of the failed one, withdrew them when the table
    // came, and seals with the two of the table: the slot beyond it goes.
    let mut relay = sender();
    relay
        .begin_artifact(ArtifactKind::Delta, descriptor, None)
        .unwrap();
    for index in 0..3 {
        let (hash, segment) = segment_of(&failed, index);
        relay
            .add_segment(ArtifactKey::Delta(1), index as u32, hash, segment)
            .unwrap();
    }
    // Not withdrawn, a segment beyond the table is refused.
    relay.revoke_segment(ArtifactKey::Delta(1), 0);
    relay.revoke_segment(ArtifactKey::Delta(1), 1);
    assert!(matches!(
        seal(&mut relay, &manifest),
        Err(SenderError::SegmentMismatch { index: 2, .. })
    ));
    relay.revoke_segment(ArtifactKey::Delta(1), 2);
    seal(&mut relay, &manifest).unwrap();
    for index in 0..2 {
        let (hash, segment) = segment_of(&bytes, index);
        relay
            .add_segment(ArtifactKey::Delta(1), index as u32, hash, segment)
            .unwrap();
    }
    assert_eq!(Pair::new(relay, receiver(1, 1)).complete(), [(1, bytes)]);
}

#[test]
fn a_relay_sends_the_right_segments_to_a_subscriber_that_asked_before_it_had_them() {
    // A relay forwarded three segments of a publication of version 1 that never sealed;
    // its upstream then sealed another with the same descriptor.
    let (failed, _) = another_artifact(1, 3);
    let (bytes, manifest) = artifact(1, 2);
    let mut relay = sender();
    relay
        .begin_artifact(
            ArtifactKind::Delta,
            Bytes::from(manifest.header.encode_pending()),
            None,
        )
        .unwrap();
    for index in 0..3 {
        let (hash, segment) = segment_of(&failed, index);
        relay
            .add_segment(ArtifactKey::Delta(1), index as u32, hash, segment)
            .unwrap();
    }
    let mut pair = Pair::new(relay, receiver(1, 1));
    pair.pump();
    // The relay withdraws them and seals; its subscriber revokes its copies and nacks
    // them while the relay holds nothing to send.
    for index in 0..3 {
        pair.sender.revoke_segment(ArtifactKey::Delta(1), index);
    }
    seal(&mut pair.sender, &manifest).unwrap();
    pair.pump();
    assert!(pair.complete().is_empty());
    // The right bytes arrive from upstream: they go out without another nack.
    for index in 0..2 {
        let (hash, segment) = segment_of(&bytes, index);
        pair.sender
            .add_segment(ArtifactKey::Delta(1), index as u32, hash, segment)
            .unwrap();
    }
    pair.pump();
    assert_eq!(pair.complete(), [(1, bytes)]);
}

#[test]
fn a_table_that_does_not_match_is_refused() {
    let (bytes, manifest) = artifact(1, 2);
    let head = DeltaFile::parse(&bytes).unwrap().header().encode_pending();
    let mut s = sender();
    s.begin_artifact(ArtifactKind::Delta, Bytes::from(head), None)
        .unwrap();
    let error = s
        .seal_artifact(
            ArtifactKey::Delta(1),
            manifest.header.target_hash,
            Hash::default(),
            manifest.segments.clone(),
            None,
        )
        .unwrap_err();
    assert!(error.to_string().contains("hashes to id"));
    // The id covers the target hash the descriptor left pending: another one is refused.
    let error = s
        .seal_artifact(
            ArtifactKey::Delta(1),
            weights(9),
            manifest.id(),
            manifest.segments.clone(),
            None,
        )
        .unwrap_err();
    assert!(error.to_string().contains("hashes to id"));
    // An Offer leaves the target hash to the Seal: a descriptor that names it is refused.
    let named = Bytes::from(DeltaFile::parse(&bytes).unwrap().header().encode());
    let error = sender()
        .begin_artifact(ArtifactKind::Delta, named, None)
        .unwrap_err();
    assert!(error.to_string().contains("names a target hash"), "{error}");
    s.add_segment(
        ArtifactKey::Delta(1),
        0,
        weights(9),
        Bytes::from_static(b"x"),
    )
    .unwrap();
    let error = s
        .seal_artifact(
            ArtifactKey::Delta(1),
            manifest.header.target_hash,
            manifest.id(),
            manifest.segments.clone(),
            None,
        )
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("segment 0 of version 1 does not match")
    );
    assert!(matches!(
        s.add_segment(ArtifactKey::Delta(2), 0, weights(9), Bytes::new()),
        Err(SenderError::UnknownArtifact {
            key: ArtifactKey::Delta(2)
        })
    ));
    assert!(
        s.begin_artifact(ArtifactKind::Delta, Bytes::from_static(b"garbage"), None)
            .unwrap_err()
            .to_string()
            .contains("artifact refused")
    );
}

#[test]
fn commits_reach_every_session_and_later_handshakes() {
    let mut pair = Pair::new(sender(), receiver(2, 1));
    let commit = commit(3, None);
    pair.sender.commit(commit).unwrap();
    pair.pump();
    assert_eq!(
        pair.events
            .iter()
            .filter(|e| **e == ReceiverEvent::Commit(commit))
            .count(),
        1
    );
    let mut late = hello(9, 0, 1);
    late.peer_id = "a2".into();
    match handshake(&mut pair.sender, 99, late).frame {
        Frame::Welcome(w) => assert_eq!(w.commit, Some(commit)),
        other => panic!("{other:?}"),
    }
    let _ = Duration::ZERO;
}

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

/// A sender that pins the trainer key of the tests.
fn pinned_sender() -> Sender {
    let mut config = SenderConfig::new(identity(Role::Hub, "hub"), Auth::Shared(TOKEN.to_vec()));
    config.trainer_key = Some(trainer_key().verifying_key());
    config.run = Some(RUN);
    Sender::new(config)
}

#[test]
fn a_pinned_sender_serves_only_what_the_trainer_signed() {
    let key = trainer_key();
    let (bytes, manifest) = artifact(1, 2);
    let signature = artifact_signature(&key, &bytes, ArtifactKind::Delta);
    let mut s = pinned_sender();
    let unsigned = s.insert_artifact(StoredArtifact::unsigned(bytes.clone()));
    assert!(
        matches!(unsigned, Err(SenderError::Signature(_))),
        "{unsigned:?}"
    );
    assert!(unsigned.unwrap_err().to_string().contains("no signature"));
    assert_eq!(s.held(ArtifactKind::Delta), 0, "nothing of it is held");
    // Cut-through: the Offer is refused without the signature of its descriptor, or
    // with another's, and so is the Seal; each is taken with its own.
    let descriptor = Bytes::from(manifest.header.encode_pending());
    let offer_signature = crate::offer_signature(&key, &RUN, ArtifactKind::Delta, &bytes).unwrap();
    let other_offer =
        crate::offer_signature(&key, &RUN, ArtifactKind::Delta, &artifact(2, 2).0).unwrap();
    for wrong in [None, Some(other_offer)] {
        let begun = s.begin_artifact(ArtifactKind::Delta, descriptor.clone(), wrong);
        assert!(matches!(begun, Err(SenderError::Signature(_))), "{begun:?}");
        assert_eq!(s.held(ArtifactKind::Delta), 0, "nothing of it is held");
    }
    s.begin_artifact(ArtifactKind::Delta, descriptor, Some(offer_signature))
        .unwrap();
    let other = artifact_signature(&key, &artifact(1, 3).0, ArtifactKind::Delta);
    for wrong in [None, Some(other)] {
        let sealed = s.seal_artifact(
            ArtifactKey::Delta(1),
            manifest.header.target_hash,
            manifest.id(),
            manifest.segments.clone(),
            wrong,
        );
        assert!(
            matches!(sealed, Err(SenderError::Signature(_))),
            "{sealed:?}"
        );
    }
    s.seal_artifact(
        ArtifactKey::Delta(1),
        manifest.header.target_hash,
        manifest.id(),
        manifest.segments.clone(),
        Some(signature),
    )
    .unwrap();

    // A snapshot's signatures are over the snapshot kind: a delta's will not do, for
    // the artifact or for its Offer.
    let (snapshot, _) = snapshot_artifact(2, 2);
    let signed =
        StoredArtifact::signed(snapshot.clone(), ArtifactKind::Snapshot, &key, &RUN).unwrap();
    let as_delta =
        StoredArtifact::signed(snapshot.clone(), ArtifactKind::Delta, &key, &RUN).unwrap();
    let wrong_artifact = StoredArtifact {
        signature: as_delta.signature,
        ..signed.clone()
    };
    let wrong_offer = StoredArtifact {
        offer_signature: as_delta.offer_signature,
        ..signed.clone()
    };
    let no_offer = StoredArtifact {
        offer_signature: None,
        ..signed.clone()
    };
    for wrong in [wrong_artifact, wrong_offer, no_offer] {
        let loaded = s.loaded(ArtifactKey::Snapshot(2), Ok(wrong));
        assert!(
            matches!(loaded, Err(SenderError::Signature(_))),
            "{loaded:?}"
        );
    }
    assert_eq!(s.held(ArtifactKind::Snapshot), 0);

    assert!(matches!(
        s.commit(commit(1, None)),
        Err(SenderError::Signature(_))
    ));
    s.commit(commit(1, Some(&key))).unwrap();
}

#[test]
fn the_signatures_travel_in_the_offer_and_the_seal_as_they_came() {
    let key = trainer_key();
    let (bytes, _) = artifact(1, 2);
    let signed = StoredArtifact::signed(bytes.clone(), ArtifactKind::Delta, &key, &RUN).unwrap();
    let mut pair = Pair::new(
        pinned_sender(),
        crate::testutil::pinned_receiver(1, 1, Some(key.verifying_key())),
    );
    pair.sender.insert_artifact(signed.clone()).unwrap();
    pair.sender.commit(commit(1, Some(&key))).unwrap();
    pair.pump();
    assert_eq!(pair.complete(), [(1, bytes)]);
    assert!(pair.events.iter().any(|e| matches!(
        e,
        ReceiverEvent::Offered { signature: Some(s), .. } if Some(*s) == signed.offer_signature
    )));
    assert!(pair.events.iter().any(|e| matches!(
        e,
        ReceiverEvent::Sealed { signature: Some(s), .. } if Some(*s) == signed.signature
    )));
    assert!(
        pair.events
            .contains(&ReceiverEvent::Commit(commit(1, Some(&key))))
    );
}

/// A hub that authenticates its subscribers by their TLS certificates.
fn certified_sender() -> Sender {
    Sender::new(SenderConfig::new(
        identity(Role::Hub, "hub"),
        Auth::Certificate,
    ))
}

/// A Hello as a downstream sends it over TLS: no token.
fn tls_hello(peer_id: &str, session: u64, stream: u8, streams: u8, epoch: u32) -> Hello {
    Hello {
        peer_id: peer_id.into(),
        token: Vec::new(),
        epoch,
        ..hello(session, stream, streams)
    }
}

/// Sends a Hello on a fresh connection whose certificate proved `peer`.
fn handshake_as(sender: &mut Sender, conn: ConnId, peer: Option<Identity>, hello: Hello) -> Frame {
    let now = Instant::now();
    sender.accepted(now, conn, peer);
    sender.handle_frame(now, conn, Frame::Hello(hello));
    let answer = sender.poll_transmit(now).expect("an answer");
    assert_eq!(answer.conn, conn);
    sender.on_sent(now, conn);
    answer.frame
}

#[track_caller]
fn rejected(frame: Frame, code: RejectCode, needle: &str) {
    match frame {
        Frame::Reject { code: c, reason } => {
            assert_eq!(c, code, "{reason}");
            assert!(reason.contains(needle), "{reason}");
        }
        other => panic!("expected a Reject, got {other:?}"),
    }
}

/// Everything the sender writes on `conn` until it has nothing more.
fn written_on(sender: &mut Sender, conn: ConnId, now: Instant) -> Vec<Frame> {
    let mut frames = Vec::new();
    while let Some(t) = sender.poll_transmit(now) {
        sender.on_sent(now, t.conn);
        if t.conn == conn {
            frames.push(t.frame);
        }
    }
    frames
}

#[test]
fn an_impersonator_is_refused_and_the_real_peer_is_unaffected() {
    let mut s = certified_sender();
    s.insert_artifact(StoredArtifact::unsigned(artifact(1, 4).0))
        .unwrap();
    let now = Instant::now();
    let a1 = identity(Role::Actor, "a1");
    let welcome = handshake_as(&mut s, 1, Some(a1.clone()), tls_hello("a1", 5, 0, 2, 1));
    assert!(matches!(welcome, Frame::Welcome(_)));

    // A fleet member with a valid certificate of its own names a1 to take over the
    // second stream of a1's session.
    let a2 = identity(Role::Actor, "a2");
    let forged = tls_hello("a1", 5, 1, 2, 1);
    rejected(
        handshake_as(&mut s, 2, Some(a2), forged),
        RejectCode::Auth,
        "the Hello names actor 'a1' but the connection's certificate is actor 'a2'",
    );
    // No certificate at all (a plaintext connection reaching a TLS sender).
    rejected(
        handshake_as(&mut s, 3, None, tls_hello("a1", 6, 0, 1, 1)),
        RejectCode::Auth,
        "no certificate",
    );
    // The trainer's certificate names itself truthfully, and still may not subscribe.
    let hub = Hello {
        role: Role::Hub,
        ..tls_hello("hub2", 7, 0, 1, 1)
    };
    rejected(
        handshake_as(&mut s, 4, Some(identity(Role::Hub, "hub2")), hub),
        RejectCode::Auth,
        "may not subscribe",
    );
    assert_eq!(s.stats().refused_auth, 3);
    assert_eq!(s.sessions(), 1);

    // a1 is served all of version 1 on its own connection, as if nothing happened.
    s.handle_frame(now, 1, want(1, 1, false, Vec::new()));
    let frames = written_on(&mut s, 1, now);
    let segments = frames
        .iter()
        .filter(|f| matches!(f, Frame::Segment { version: 1, .. }))
        .count();
    assert_eq!(segments, 4, "{frames:?}");
    assert!(matches!(frames[0], Frame::Offer { version: 1, .. }));
}

#[test]
fn replayed_hellos_of_an_earlier_epoch_or_session_are_refused() {
    let mut s = certified_sender();
    s.insert_artifact(StoredArtifact::unsigned(artifact(1, 2).0))
        .unwrap();
    let now = Instant::now();
    let a1 = || Some(identity(Role::Actor, "a1"));
    let first = tls_hello("a1", 5, 0, 1, 1);
    let second = tls_hello("a1", 5, 0, 1, 2);
    assert!(matches!(
        handshake_as(&mut s, 1, a1(), first.clone()),
        Frame::Welcome(_)
    ));
    // The stream reconnects (epoch 2) and replaces its first connection.
    assert!(matches!(
        handshake_as(&mut s, 2, a1(), second.clone()),
        Frame::Welcome(_)
    ));
    // Either Hello sent again would take the live stream over.
    for (conn, replay) in [(3, first), (4, second.clone())] {
        rejected(
            handshake_as(&mut s, conn, a1(), replay),
            RejectCode::Refused,
            "is stale",
        );
    }
    // The live connection still carries the session.
    s.handle_frame(now, 2, want(1, 1, false, Vec::new()));
    let frames = written_on(&mut s, 2, now);
    assert!(
        matches!(frames[0], Frame::Offer { version: 1, .. }),
        "{frames:?}"
    );

    // Once the session has ended, its Hellos cannot revive it; a new session can start.
    s.closed(2);
    assert_eq!(s.sessions(), 0);
    rejected(
        handshake_as(&mut s, 5, a1(), second),
        RejectCode::Refused,
        "session 5 of peer 'a1' has ended",
    );
    assert!(matches!(
        handshake_as(&mut s, 6, a1(), tls_hello("a1", 6, 0, 1, 1)),
        Frame::Welcome(_)
    ));
    assert_eq!(s.stats().refused_stale, 3);
}

#[test]
fn a_deferred_snapshot_is_unavailable_until_the_next_want_asks_again() {
    let mut pair = Pair::new(store_sender(4, 2), joining_receiver(1));
    let load = crate::SenderEvent::Load(ArtifactKey::Snapshot(2));
    assert!(pair.sender_events.contains(&load));
    pair.sender
        .load_deferred(ArtifactKey::Snapshot(2), "at the build budget".into());
    pair.pump();
    assert!(lost_upstream(&pair, "at the build budget"));
    assert_eq!(pair.sender.stats().loads_deferred, 1);

    // The receiver comes back (a new session): the snapshot is asked for again.
    pair.sender_events.clear();
    pair.receiver.start_session(pair.now, 78);
    pair.pump();
    assert!(
        pair.sender_events.contains(&load),
        "{:?}",
        pair.sender_events
    );
}

/// Opens session 5 with two streams on connections 1 and 2, and passes its Want for
/// `next_version` on.
fn two_streams_wanting(sender: &mut Sender, now: Instant, next_version: u64) {
    for (conn, stream) in [(1, 0), (2, 1)] {
        handshake(sender, conn, hello(5, stream, 2));
        sender.on_sent(now, conn);
    }
    sender.handle_frame(now, 1, two_stream_want(1, next_version));
}

fn two_stream_want(seq: u64, next_version: u64) -> Frame {
    Frame::Want {
        seq,
        next_version,
        snapshot: false,
        composed: false,
        live_streams: 0b11,
        epochs: vec![1, 1],
        progress: vec![],
    }
}

/// Everything the sender hands out at `now`, each written at once, with its connection.
fn drain_all(sender: &mut Sender, now: Instant) -> Vec<(ConnId, Frame)> {
    let mut sent = Vec::new();
    while let Some(t) = sender.poll_transmit(now) {
        sender.on_sent(now, t.conn);
        if !matches!(t.frame, Frame::Commit(_) | Frame::Keepalive) {
            sent.push((t.conn, t.frame));
        }
    }
    sent
}

/// A frame's identity: its type and, for a segment, its index.
fn frame_id(frame: &Frame) -> (&'static str, Option<u32>) {
    match frame {
        Frame::Segment { index, .. } => ("Segment", Some(*index)),
        other => (other.frame_type().name(), None),
    }
}

/// A sender holding versions 1 to `versions` (four segments each), set up by `configure`,
/// with session 5 wanting version 1 on two streams, and what it sent of it at `now`.
fn serving_two_streams(
    versions: u64,
    configure: impl FnOnce(&mut SenderConfig),
    now: Instant,
) -> (Sender, Vec<(ConnId, Frame)>) {
    let mut s = sender();
    for version in 1..=versions {
        s.insert_artifact(crate::StoredArtifact::unsigned(artifact(version, 4).0))
            .unwrap();
    }
    configure(&mut s.config);
    two_streams_wanting(&mut s, now, 1);
    let sent = drain_all(&mut s, now);
    (s, sent)
}

/// A small version whose Want does not come back in time goes out once more, every
/// frame on the stream it did not take the first time, and only once.
#[test]
fn an_overdue_small_version_goes_out_again_once_each_frame_on_the_other_stream() {
    let now = Instant::now();
    let (mut s, first) = serving_two_streams(1, |_| {}, now);
    assert_eq!(first.len(), 6, "Offer, Seal and four segments: {first:?}");
    assert!(
        first.iter().all(|(c, _)| *c == 1),
        "written at once, the version rides stream 0: {first:?}"
    );

    // Nothing is copied before the version is overdue: the session has no delivery time
    // yet, so that is `hedge_first` after its last frame.
    let overdue = now + s.config.hedge_first;
    assert_eq!(s.poll_timeout(), Some(overdue));
    s.handle_timeout(overdue - Duration::from_millis(1));
    assert!(drain_all(&mut s, overdue - Duration::from_millis(1)).is_empty());

    s.handle_timeout(overdue);
    let copies = drain_all(&mut s, overdue);
    let original: BTreeMap<_, ConnId> = first.iter().map(|(c, f)| (frame_id(f), *c)).collect();
    let copied: BTreeMap<_, ConnId> = copies.iter().map(|(c, f)| (frame_id(f), *c)).collect();
    assert_eq!(copies.len(), 6, "each frame once: {copies:?}");
    assert_eq!(copied.len(), 6);
    for (frame, conn) in &copied {
        assert_ne!(original[frame], *conn, "{frame:?} copied on its own stream");
    }
    for (_, frame) in &copies {
        let same = first.iter().any(|(_, f)| f == frame);
        assert!(same, "a copy is the frame itself: {frame:?}");
    }
    assert_eq!(s.stats().frames_hedged, 6);
    assert!(
        s.poll_timeout()
            .is_none_or(|at| at > overdue + Duration::from_secs(1)),
        "nothing more is due"
    );
    s.handle_timeout(overdue + Duration::from_secs(1));
    assert!(drain_all(&mut s, overdue + Duration::from_secs(1)).is_empty());
}

/// The stream that carried an overdue version goes after the session's other streams,
/// so the next versions do not wait on a congestion window regrowing from a timeout,
/// until a version it carried is delivered in time.
#[test]
fn a_stream_whose_version_went_overdue_goes_last_until_one_it_carries_is_in_time() {
    let now = Instant::now();
    let (mut s, first) = serving_two_streams(4, |config| config.versions_ahead = 1, now);
    let conns = |sent: &[(ConnId, Frame)]| sent.iter().map(|(c, _)| *c).collect::<Vec<_>>();
    assert_eq!(conns(&first), [1; 6], "version 1 rides stream 0");
    let overdue = now + s.config.hedge_first;
    s.handle_timeout(overdue);
    assert_eq!(
        conns(&drain_all(&mut s, overdue)),
        [2; 6],
        "copies on stream 1"
    );

    let copied = overdue + Duration::from_millis(10);
    s.handle_frame(copied, 1, two_stream_want(2, 2));
    assert_eq!(
        conns(&drain_all(&mut s, copied)),
        [2; 6],
        "version 2 rides stream 1: stream 0 is late"
    );

    // Version 2 came in time. Version 3 fills stream 1's window and spills onto the
    // late stream, which delivers it in time.
    let delivered = copied + Duration::from_millis(20);
    s.handle_frame(delivered, 1, two_stream_want(3, 3));
    let mut third = Vec::new();
    while let Some(t) = s.poll_transmit(delivered) {
        if t.conn == 1 {
            s.on_sent(delivered, 1);
        }
        third.push(t.conn);
    }
    assert_eq!(
        third,
        [2, 2, 2, 2, 1, 1],
        "Offer, Seal, two segments, then the rest"
    );
    for _ in 0..4 {
        s.on_sent(delivered, 2);
    }
    let in_time = delivered + Duration::from_millis(20);
    s.handle_frame(in_time, 1, two_stream_want(4, 4));
    assert_eq!(
        conns(&drain_all(&mut s, in_time)),
        [1; 6],
        "stream 0 is no longer late: version 4 rides it"
    );
    assert_eq!(s.stats().frames_hedged, 6);
}

/// An actor with no weights welcomed while the kept snapshot is newer than the commit
/// (so none is offered) does not count as wanting one the relay lacks; with none kept,
/// it does ([`Sender::kept_snapshot_wanted`]).
#[test]
fn a_joiner_counts_as_wanting_a_snapshot_only_where_none_is_kept() {
    let mut s = sender();
    s.commit(commit(2, None)).unwrap();
    s.expect_snapshot(5);
    let welcome = handshake(&mut s, 1, hello(5, 0, 1));
    assert!(matches!(welcome.frame, Frame::Welcome(ref w) if w.snapshot.is_none()));
    assert!(!s.kept_snapshot_wanted());
    s.withdraw_snapshot("the test lets it go".into());
    handshake(&mut s, 2, hello(6, 0, 1));
    assert!(s.kept_snapshot_wanted());
}

/// A joiner told of a newer joinable snapshot than the kept one (its Hello's floor) is
/// offered none, so it goes to its next upstream at once; the relay counts the kept one
/// as outdated, and takes a newer one for the next joiner
/// ([`Sender::kept_snapshot_outdated`]).
#[test]
fn a_kept_snapshot_older_than_a_joiner_s_floor_is_not_offered_and_is_outdated() {
    let mut s = sender();
    s.commit(commit(4, None)).unwrap();
    s.expect_snapshot(2);
    let welcome = handshake(&mut s, 1, hello(5, 0, 1));
    assert!(
        matches!(welcome.frame, Frame::Welcome(ref w) if w.snapshot == Some(2) && w.run == RUN)
    );
    assert!(!s.kept_snapshot_outdated());
    let mut told = hello(6, 0, 1);
    told.snapshot_floor = 3;
    let welcome = handshake(&mut s, 2, told);
    assert!(matches!(welcome.frame, Frame::Welcome(ref w) if w.snapshot.is_none()));
    assert!(s.kept_snapshot_wanted() && s.kept_snapshot_outdated());
    // A newer one kept: the demand it met is over.
    s.expect_snapshot(4);
    assert!(!s.kept_snapshot_wanted() && !s.kept_snapshot_outdated());
}

/// A version whose Want comes back in time is never copied, and sets how long later
/// versions may take: twice that. One larger than `hedge_max_bytes` is never copied.
#[test]
fn a_version_delivered_in_time_or_too_large_is_not_sent_again() {
    let now = Instant::now();
    let (mut s, first) = serving_two_streams(2, |config| config.versions_ahead = 1, now);
    assert_eq!(first.len(), 6);
    let delivered = now + Duration::from_millis(40);
    s.handle_frame(delivered, 1, two_stream_want(2, 2));
    assert_eq!(drain_all(&mut s, delivered).len(), 6, "version 2 goes out");
    assert_eq!(s.stats().frames_hedged, 0);
    // Twice the 40 ms version 1 took, from version 2's last frame.
    let overdue = delivered + Duration::from_millis(80);
    assert_eq!(s.poll_timeout(), Some(overdue));
    s.handle_timeout(overdue);
    assert_eq!(drain_all(&mut s, overdue).len(), 6, "version 2 was overdue");

    let (mut large, first) = serving_two_streams(1, |config| config.hedge_max_bytes = 1, now);
    assert_eq!(first.len(), 6);
    let late = now + Duration::from_secs(5);
    large.handle_timeout(late);
    assert!(drain_all(&mut large, late).is_empty());
    assert_eq!(large.stats().frames_hedged, 0);
}

/// A session whose streams all say goodbye ends at once: the driver drops each
/// connection on the sender's Close without reporting it closed, so a session that kept
/// them would linger, its windows never refilled, until its stall timeout dropped it.
#[test]
fn a_session_whose_streams_say_goodbye_ends_at_once() {
    let now = Instant::now();
    let (mut s, _) = serving_two_streams(1, |_| {}, now);
    assert_eq!(s.sessions(), 1);
    for conn in [1, 2] {
        s.handle_frame(
            now,
            conn,
            Frame::Goodbye {
                reason: "moving on".into(),
            },
        );
    }
    let closed: Vec<ConnId> = std::iter::from_fn(|| s.poll_event())
        .filter_map(|event| match event {
            SenderEvent::Close { conn, .. } => Some(conn),
            _ => None,
        })
        .collect();
    assert_eq!(closed, vec![1, 2]);
    assert_eq!(s.sessions(), 0, "the session ended with its last stream");
    let later = now + s.config.stall_timeout;
    s.handle_timeout(later);
    assert!(
        std::iter::from_fn(|| s.poll_event()).next().is_none(),
        "nothing left to drop"
    );
    assert_eq!(s.stats().sessions_dropped, 0);
}
