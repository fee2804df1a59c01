//! Signatures: a pinned receiver delivers only Seals and Commits the trainer signed; an
//! unpinned one takes unsigned artifacts.

use super::tests::{completed, drain, refused_signature};
use super::*;
use crate::testutil::{
    artifact, artifact_signature, commit, connected, connected_pinned, frames, hub_welcome,
    pinned_receiver, signed_frames, trainer_key,
};

#[test]
fn a_signed_seal_is_delivered_and_its_signature_passed_on() {
    let mut r = connected_pinned();
    let (bytes, _) = artifact(1, 3);
    let key = trainer_key();
    for frame in signed_frames(&bytes, ArtifactKind::Delta, Some(&key)) {
        r.handle_frame(Instant::now(), 1, frame);
    }
    let (events, _) = drain(&mut r);
    assert_eq!(completed(&events), [(1, bytes.clone())]);
    let signature = artifact_signature(&key, &bytes, ArtifactKind::Delta);
    assert!(events.iter().any(|e| matches!(
        e,
        ReceiverEvent::Sealed { signature: Some(s), .. } if *s == signature
    )));
    assert_eq!(r.stats().violations, 0);
}

#[test]
fn a_seal_without_its_valid_signature_is_refused_and_nothing_delivered() {
    let (bytes, _) = artifact(1, 3);
    let key = trainer_key();
    let other_key = aurora_delta::SigningKey::from_bytes(&[7; 32]);
    let (other_artifact, _) = artifact(1, 2);
    let (next_version, _) = artifact(2, 3);
    let cases = [
        ("missing", None),
        (
            "by another key",
            Some(artifact_signature(&other_key, &bytes, ArtifactKind::Delta)),
        ),
        (
            "of another artifact of the same version",
            Some(artifact_signature(
                &key,
                &other_artifact,
                ArtifactKind::Delta,
            )),
        ),
        (
            "of another version",
            Some(artifact_signature(&key, &next_version, ArtifactKind::Delta)),
        ),
        (
            "of the same bytes as another kind",
            Some(artifact_signature(&key, &bytes, ArtifactKind::Composed)),
        ),
    ];
    for (case, signature) in cases {
        let mut r = connected_pinned();
        let mut all = frames(&bytes);
        if let Frame::Seal { signature: s, .. } = &mut all[1] {
            *s = signature;
        }
        // Segments first (cut-through), then the Offer and the Seal.
        all.rotate_left(2);
        for frame in all {
            r.handle_frame(Instant::now(), 1, frame);
        }
        let (events, _) = drain(&mut r);
        assert!(refused_signature(&events), "{case}: {events:?}");
        assert!(
            !events.iter().any(|e| matches!(
                e,
                ReceiverEvent::Sealed { .. } | ReceiverEvent::Complete { .. }
            )),
            "{case}: reported sealed or complete"
        );
        assert_eq!(r.stats().violations, 1, "{case}");
        assert_eq!(r.held_bytes, 0, "{case}: what was held of it is dropped");
        assert!(r.assemblies.is_empty(), "{case}");
    }
}

#[test]
fn an_unpinned_receiver_takes_unsigned_artifacts() {
    let mut r = connected(1);
    let (bytes, _) = artifact(1, 2);
    for frame in frames(&bytes) {
        r.handle_frame(Instant::now(), 1, frame);
    }
    let (events, _) = drain(&mut r);
    assert_eq!(completed(&events), [(1, bytes)]);
}

#[test]
fn a_commit_without_its_valid_signature_is_refused() {
    let key = trainer_key();
    let other_key = aurora_delta::SigningKey::from_bytes(&[7; 32]);
    let signed = commit(5, Some(&key));
    let mut r = connected_pinned();
    r.handle_frame(Instant::now(), 1, Frame::Commit(signed));
    let (events, _) = drain(&mut r);
    assert!(events.contains(&ReceiverEvent::Commit(signed)));
    // A replayed older commit is authentic and reported: the actor core ignores a
    // commit at or below one it has (`ActorCore::commit`). Its signature on a newer
    // version, though, is a forgery.
    let replayed = crate::Commit {
        signature: commit(3, Some(&key)).signature,
        ..commit(6, None)
    };
    let cases = [
        ("missing", commit(6, None)),
        ("by another key", commit(6, Some(&other_key))),
        ("of an older commit", replayed),
    ];
    for (case, forged) in cases {
        let mut r = connected_pinned();
        r.handle_frame(Instant::now(), 1, Frame::Commit(forged));
        let (events, _) = drain(&mut r);
        assert!(refused_signature(&events), "{case}: {events:?}");
        assert!(
            !events.iter().any(|e| matches!(e, ReceiverEvent::Commit(_))),
            "{case}"
        );
    }
}

#[test]
fn a_welcome_with_an_unsigned_commit_is_refused() {
    let now = Instant::now();
    let mut r = pinned_receiver(1, 1, Some(trainer_key().verifying_key()));
    r.start_session(now, 5);
    r.connected(now, 5, 0, 1, None);
    let Frame::Welcome(mut welcome) = hub_welcome(None) else {
        unreachable!()
    };
    welcome.commit = Some(commit(4, None));
    r.handle_frame(now, 1, Frame::Welcome(welcome.clone()));
    let (events, _) = drain(&mut r);
    assert!(refused_signature(&events), "{events:?}");
    assert!(!events.iter().any(|e| matches!(e, ReceiverEvent::Commit(_))));

    r.start_session(now, 6);
    r.connected(now, 6, 0, 2, None);
    welcome.commit = Some(commit(4, Some(&trainer_key())));
    r.handle_frame(now, 2, Frame::Welcome(welcome));
    let (events, _) = drain(&mut r);
    assert!(events.contains(&ReceiverEvent::Commit(commit(4, Some(&trainer_key())))));
}
