//! Trust: a pinned sender serves only what the trainer signed, the signatures travel as
//! they came, and impersonated or replayed Hellos are refused.

use std::time::Instant;

use bytes::Bytes;

use super::tests::{lost_upstream, want};
use super::*;
use crate::frame::{ArtifactKind, Hello, RejectCode};
use crate::receiver::ReceiverEvent;
use crate::testutil::{
    Pair, RUN, TOKEN, artifact, artifact_signature, commit, hello, identity, joining_receiver,
    snapshot_artifact, store_sender, trainer_key,
};

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
