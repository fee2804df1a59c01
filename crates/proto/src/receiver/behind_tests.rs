//! Relays that fall behind: one that trickles or withholds a committed version is given up,
//! a hub or a snapshot being joined is waited for.

use std::time::Duration;

use super::tests::{completed, drain, lost};
use super::*;
use crate::frame::Role;
use crate::testutil::{
    artifact, commit, connected, connected_joining, frames, hub_welcome, receiver,
};

/// Keeps the session heard (keepalives every second) from `from` to `to`, and says
/// whether it was lost on the way.
fn kept_alive(r: &mut Receiver, from: Instant, to: Instant) -> bool {
    let mut now = from;
    while now < to {
        r.handle_frame(now, 1, Frame::Keepalive);
        r.handle_timeout(now);
        if !r.is_connected() {
            return false;
        }
        now += Duration::from_secs(1);
    }
    true
}

/// A relay's Welcome, the hub's newest version unknown to it.
fn relay_welcome() -> Frame {
    let Frame::Welcome(mut welcome) = hub_welcome(None) else {
        unreachable!("a Welcome")
    };
    welcome.role = Role::Relay;
    Frame::Welcome(welcome)
}

/// A receiver for version 1 welcomed by a relay on one stream (conn 1).
fn relayed() -> Receiver {
    let mut r = receiver(1, 1);
    let now = Instant::now();
    r.start_session(now, 5);
    r.connected(now, 5, 0, 1, None);
    r.handle_frame(now, 1, relay_welcome());
    drain(&mut r);
    r
}

/// New segments count as progress by their bytes: a relay that trickles a committed
/// version a segment at a time is given up `behind_timeout` after its last descriptor,
/// while one that brings `behind_progress_bytes` within each `behind_timeout` is kept.
#[test]
fn a_relay_that_trickles_a_committed_version_is_given_up() {
    let (bytes, _) = artifact(1, 12);
    let parts = frames(&bytes);
    let segments: Vec<&Frame> = parts
        .iter()
        .filter(|f| matches!(f, Frame::Segment { .. }))
        .collect();
    let segment_bytes = |f: &Frame| match f {
        Frame::Segment { bytes, .. } => bytes.len() as u64,
        _ => 0,
    };
    let mut sizes: Vec<u64> = segments.iter().map(|f| segment_bytes(f)).collect();
    sizes.sort_unstable();
    let (smallest, two_largest) = (sizes[0], sizes[sizes.len() - 2..].iter().sum::<u64>());
    let pace = |r: &mut Receiver, per_step: usize| -> Option<Duration> {
        let behind = r.config.behind_timeout;
        let step = behind / 2;
        let start = Instant::now();
        r.expect_committed(start, 1);
        r.handle_frame(start, 1, parts[0].clone());
        let mut now = start;
        for chunk in segments[..segments.len() - 1].chunks(per_step) {
            now += step;
            for segment in chunk {
                r.handle_frame(now, 1, (*segment).clone());
            }
            r.handle_timeout(now);
            if !r.is_connected() {
                return Some(now - start);
            }
        }
        None
    };
    // One segment each half `behind_timeout`, the threshold more than any two: given up
    // once a whole `behind_timeout` has brought less.
    let mut r = relayed();
    r.config.behind_progress_bytes = two_largest + 1;
    let behind = r.config.behind_timeout;
    assert_eq!(pace(&mut r, 1), Some(behind));
    lost(
        &mut r,
        "version 1 is committed and this relay brought too little of it",
    );
    // Two segments each half `behind_timeout`: kept.
    let mut r = relayed();
    r.config.behind_progress_bytes = 2 * smallest;
    assert_eq!(pace(&mut r, 2), None);
    assert!(r.is_connected());
}

#[test]
fn a_relay_that_brings_nothing_new_while_a_version_is_committed_is_given_up() {
    let mut r = relayed();
    let behind = r.config.behind_timeout;
    let second = Duration::from_secs(1);
    let start = Instant::now();
    // Nothing known to be committed: a relay that only keeps the session alive is
    // waited for.
    assert!(kept_alive(&mut r, start, start + 2 * behind));
    // Version 1 is committed (the control plane said so): the relay has
    // `behind_timeout` to bring something new.
    let told = start + 2 * behind;
    r.expect_committed(told, 1);
    assert!(kept_alive(&mut r, told, told + behind - second));
    // Its Offer comes: the clock starts again.
    let (bytes, _) = artifact(1, 3);
    let parts = frames(&bytes);
    let came = told + behind - second / 2;
    r.handle_frame(came, 1, parts[0].clone());
    // Nothing new after it restarts the clock: the same Offer again, a segment of a
    // version the receiver has.
    let old_segment = Frame::Segment {
        version: 0,
        index: 0,
        hash: Hash::of(b"old"),
        bytes: Bytes::from_static(b"old"),
    };
    let mut now = came;
    while now < came + behind - second {
        r.handle_frame(now, 1, parts[0].clone());
        r.handle_frame(now, 1, old_segment.clone());
        r.handle_timeout(now);
        assert!(r.is_connected());
        now += second;
    }
    drain(&mut r);
    r.handle_timeout(came + behind);
    lost(
        &mut r,
        "version 1 is committed and this relay brought too little of it",
    );
    // A new session delivers the version, but no Commit of it: still lacking.
    let again = came + behind;
    r.start_session(again, 9);
    r.connected(again, 9, 0, 1, None);
    r.handle_frame(again, 1, relay_welcome());
    for frame in parts {
        r.handle_frame(again, 1, frame);
    }
    assert_eq!(completed(&drain(&mut r).0), [(1, bytes)]);
    assert!(kept_alive(&mut r, again, again + behind - second));
    drain(&mut r);
    r.handle_timeout(again + behind);
    lost(&mut r, "version 1 is committed");
    // With the Commit, nothing is lacking: keepalives alone do again.
    let then = again + behind;
    r.start_session(then, 10);
    r.connected(then, 10, 0, 1, None);
    r.handle_frame(then, 1, relay_welcome());
    r.handle_frame(then, 1, Frame::Commit(commit(1, None)));
    assert!(kept_alive(&mut r, then, then + 2 * behind));
    r.expect_committed(then, 1);
    assert!(kept_alive(&mut r, then + 2 * behind, then + 4 * behind));
}

#[test]
fn a_hub_or_a_snapshot_being_joined_is_waited_for_however_long_it_takes() {
    // A hub may take minutes to build a composed delta or a snapshot from its store.
    let mut r = connected(1);
    let behind = r.config.behind_timeout;
    let start = Instant::now();
    r.expect_committed(start, 5);
    assert!(kept_alive(&mut r, start, start + 3 * behind));
    let mut joining = connected_joining(1, 4);
    joining.expect_committed(start, 6);
    assert!(kept_alive(&mut joining, start, start + 3 * behind));
}
