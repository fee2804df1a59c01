//! A session's streams: a version overdue on one goes out again on another, and streams
//! that say goodbye end the session.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::tests::{drain_all, handshake, two_stream_want, two_streams_wanting};
use super::*;
use crate::testutil::{RUN, artifact, commit, hello, sender};

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
