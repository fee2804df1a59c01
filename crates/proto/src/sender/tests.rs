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
    Pair, another_artifact, artifact, commit, hello, identity, receiver, sender, weights,
};

/// Sends a Hello on a fresh connection and returns the answer.
pub(super) fn handshake(sender: &mut Sender, conn: ConnId, hello: Hello) -> Transmit {
    let now = Instant::now();
    sender.accepted(now, conn, None);
    sender.handle_frame(now, conn, Frame::Hello(hello));
    sender.poll_transmit(now).expect("an answer")
}

/// Opens session 5, one stream, on connection 1 and writes its Welcome.
pub(super) fn welcomed(sender: &mut Sender, now: Instant) {
    handshake(sender, 1, hello(5, 0, 1));
    sender.on_sent(now, 1);
}

/// A Want on one live stream at epoch 1, from `next_version` on.
pub(super) fn want(seq: u64, next_version: u64, snapshot: bool, progress: Vec<Progress>) -> Frame {
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
pub(super) fn holding(version: u64, have: Vec<std::ops::Range<u32>>) -> Progress {
    Progress {
        version,
        has_offer: true,
        has_seal: true,
        composed: false,
        have,
    }
}

/// Writes everything queued on connection 1 and returns it.
pub(super) fn drain(sender: &mut Sender, now: Instant) -> Vec<Frame> {
    let mut sent = Vec::new();
    while let Some(t) = sender.poll_transmit(now) {
        sender.on_sent(now, 1);
        sent.push(t.frame);
    }
    sent
}

/// Whether the receiver gave up on its upstream for a reason containing `needle`.
pub(super) fn lost_upstream(pair: &Pair, needle: &str) -> bool {
    pair.events
        .iter()
        .any(|e| matches!(e, ReceiverEvent::UpstreamLost { reason } if reason.to_string().contains(needle)))
}

#[track_caller]
pub(super) fn refused(transmit: Transmit, code: RejectCode, needle: &str) {
    match transmit.frame {
        Frame::Reject { code: c, reason } => {
            assert_eq!(c, code);
            assert!(reason.contains(needle), "{reason}");
            assert!(transmit.close_after);
        }
        other => panic!("expected a Reject, got {other:?}"),
    }
}

/// Everything the sender hands out at `now`, each written at once, with its connection.
pub(super) fn drain_all(sender: &mut Sender, now: Instant) -> Vec<(ConnId, Frame)> {
    let mut sent = Vec::new();
    while let Some(t) = sender.poll_transmit(now) {
        sender.on_sent(now, t.conn);
        if !matches!(t.frame, Frame::Commit(_) | Frame::Keepalive) {
            sent.push((t.conn, t.frame));
        }
    }
    sent
}

/// Opens session 5 with two streams on connections 1 and 2, and passes its Want for
/// `next_version` on.
pub(super) fn two_streams_wanting(sender: &mut Sender, now: Instant, next_version: u64) {
    for (conn, stream) in [(1, 0), (2, 1)] {
        handshake(sender, conn, hello(5, stream, 2));
        sender.on_sent(now, conn);
    }
    sender.handle_frame(now, 1, two_stream_want(1, next_version));
}

pub(super) fn two_stream_want(seq: u64, next_version: u64) -> Frame {
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
