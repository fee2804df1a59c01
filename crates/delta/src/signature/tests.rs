use proptest::prelude::*;

use super::*;
use crate::{DeltaHeader, Encoding, Hash};

fn key(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32])
}

fn header() -> DeltaHeader {
    DeltaHeader {
        base_version: 4,
        target_version: 5,
        base_hash: Hash([1; 32]),
        target_hash: Hash([2; 32]),
        encoding: Encoding::Aurora,
        tensors: Vec::new(),
    }
}

const RUN: RunId = RunId([0x5a; 16]);

fn statement() -> Statement {
    Statement::artifact(ArtifactKind::Delta, Hash([9; 32]), &header())
}

#[test]
fn a_signature_verifies_with_its_key_only() {
    let signature = sign(&key(1), &RUN, &statement());
    assert_eq!(
        verify(
            &key(1).verifying_key(),
            &RUN,
            &statement(),
            Some(&signature)
        ),
        Ok(())
    );
    let err = verify(
        &key(2).verifying_key(),
        &RUN,
        &statement(),
        Some(&signature),
    )
    .unwrap_err();
    assert!(matches!(err, SignatureError::Invalid { .. }), "{err}");
    let err = verify(&key(1).verifying_key(), &RUN, &statement(), None).unwrap_err();
    assert!(matches!(err, SignatureError::Missing { .. }), "{err}");
    assert!(err.to_string().contains("carries no signature"), "{err}");
}

#[test]
fn every_field_of_a_statement_is_signed() {
    let signature = sign(&key(1), &RUN, &statement());
    // The statement with one field changed.
    let changed = |change: &dyn Fn(&mut ArtifactKind, &mut Hash, &mut DeltaHeader)| {
        let (mut kind, mut id, mut header) = (ArtifactKind::Delta, Hash([9; 32]), header());
        change(&mut kind, &mut id, &mut header);
        Statement::artifact(kind, id, &header)
    };
    let variants = [
        changed(&|kind, _, _| *kind = ArtifactKind::Composed),
        changed(&|_, id, _| *id = Hash([8; 32])),
        changed(&|_, _, h| h.base_version = 3),
        changed(&|_, _, h| h.target_version = 6),
        changed(&|_, _, h| h.base_hash = Hash([0; 32])),
        changed(&|_, _, h| h.target_hash = Hash([0; 32])),
        changed(&|_, _, h| h.encoding = Encoding::Dense),
    ];
    assert_eq!(changed(&|_, _, _| {}), statement());
    for other in variants {
        assert!(
            verify(&key(1).verifying_key(), &RUN, &other, Some(&signature)).is_err(),
            "{other:?} verified with the signature of {:?}",
            statement()
        );
    }
}

#[test]
fn artifact_and_commit_statements_never_collide() {
    let commit = Statement::Commit {
        version: 5,
        weights_hash: Hash([2; 32]),
    };
    let signature = sign(&key(1), &RUN, &commit);
    assert_eq!(
        verify(&key(1).verifying_key(), &RUN, &commit, Some(&signature)),
        Ok(())
    );
    assert!(
        verify(
            &key(1).verifying_key(),
            &RUN,
            &statement(),
            Some(&signature)
        )
        .is_err()
    );
    let older = Statement::Commit {
        version: 4,
        weights_hash: Hash([2; 32]),
    };
    assert!(verify(&key(1).verifying_key(), &RUN, &older, Some(&signature)).is_err());
    assert!(commit.to_bytes(&RUN).starts_with(COMMIT_DOMAIN));
    assert!(statement().to_bytes(&RUN).starts_with(ARTIFACT_DOMAIN));
    let offer = Statement::offer(ArtifactKind::Delta, 5, &header().encode());
    assert!(offer.to_bytes(&RUN).starts_with(OFFER_DOMAIN));
    let pinned = key(1).verifying_key();
    for other in [commit, statement()] {
        for (signed, checked) in [(&other, &offer), (&offer, &other)] {
            assert!(verify(&pinned, &RUN, checked, Some(&sign(&key(1), &RUN, signed))).is_err());
        }
    }
}

#[test]
fn an_offer_signature_binds_the_kind_the_version_and_every_descriptor_byte() {
    let descriptor = header().encode();
    let offer = Statement::offer(ArtifactKind::Snapshot, 5, &descriptor);
    let signature = sign(&key(1), &RUN, &offer);
    let pinned = key(1).verifying_key();
    assert_eq!(verify(&pinned, &RUN, &offer, Some(&signature)), Ok(()));
    let mut altered = descriptor.clone();
    altered[descriptor.len() - 1] ^= 1;
    for other in [
        Statement::offer(ArtifactKind::Delta, 5, &descriptor),
        Statement::offer(ArtifactKind::Snapshot, 6, &descriptor),
        Statement::offer(ArtifactKind::Snapshot, 5, &altered),
    ] {
        assert!(
            verify(&pinned, &RUN, &other, Some(&signature)).is_err(),
            "{other}"
        );
    }
    let err = verify(&key(2).verifying_key(), &RUN, &offer, Some(&signature)).unwrap_err();
    assert!(
        err.to_string()
            .contains("the Offer of a snapshot to version 5"),
        "{err}"
    );
}

proptest! {
    /// Any changed byte of the statement or of the signature fails.
    #[test]
    fn any_changed_byte_fails(index in 0usize..200, flip in 1u8..=255) {
        let key = key(7);
        let bytes = statement().to_bytes(&RUN);
        let signature = sign(&key, &RUN, &statement());
        let signed = ed25519_dalek::Signature::from_bytes(&signature.0);
        if index < bytes.len() {
            let mut changed = bytes.clone();
            changed[index] ^= flip;
            prop_assert!(key.verifying_key().verify_strict(&changed, &signed).is_err());
        } else {
            let mut changed = signature;
            changed.0[(index - bytes.len()) % 64] ^= flip;
            prop_assert!(verify(&key.verifying_key(), &RUN, &statement(), Some(&changed)).is_err());
        }
    }
}

#[test]
fn detached_signatures_round_trip_and_name_what_differs() {
    let detached =
        DetachedSignature::sign(&key(1), RUN, ArtifactKind::Delta, Hash([9; 32]), &header());
    let bytes = detached.to_bytes();
    assert_eq!(bytes.len(), DETACHED_BYTES);
    let parsed = DetachedSignature::parse(&bytes).unwrap();
    assert_eq!(parsed, detached);
    let pinned = key(1).verifying_key();
    assert_eq!(
        parsed.verify(&pinned, Some(&RUN), Hash([9; 32]), &header()),
        Ok(())
    );
    assert_eq!(
        parsed.verify(&pinned, None, Hash([9; 32]), &header()),
        Ok(())
    );
    let err = parsed
        .verify(
            &key(2).verifying_key(),
            Some(&RUN),
            Hash([9; 32]),
            &header(),
        )
        .unwrap_err();
    assert!(matches!(err, SignatureError::WrongKey { .. }), "{err}");
    let err = parsed
        .verify(&pinned, Some(&RunId([1; 16])), Hash([9; 32]), &header())
        .unwrap_err();
    assert!(matches!(err, SignatureError::OtherRun { .. }), "{err}");
    let err = parsed
        .verify(&pinned, Some(&RUN), Hash([8; 32]), &header())
        .unwrap_err();
    assert!(matches!(err, SignatureError::OtherArtifact { .. }), "{err}");
    let mut other = header();
    other.target_hash = Hash([3; 32]);
    let err = parsed
        .verify(&pinned, Some(&RUN), Hash([9; 32]), &other)
        .unwrap_err();
    assert!(matches!(err, SignatureError::Invalid { .. }), "{err}");
    let mut unknown_run = bytes.clone();
    unknown_run[43..59].fill(0);
    for bad in [
        &bytes[..10],
        &bytes[1..],
        &[0u8; DETACHED_BYTES][..],
        &unknown_run[..],
    ] {
        assert!(matches!(
            DetachedSignature::parse(bad),
            Err(SignatureError::Malformed(_))
        ));
    }
}

#[test]
fn a_statement_of_one_run_never_verifies_for_another() {
    let other = RunId([0xa5; 16]);
    let commit = Statement::Commit {
        version: 0,
        weights_hash: Hash([2; 32]),
    };
    let offer = Statement::offer(ArtifactKind::Snapshot, 0, &header().encode());
    let pinned = key(1).verifying_key();
    for signed in [statement(), commit, offer] {
        let signature = sign(&key(1), &other, &signed);
        assert_eq!(verify(&pinned, &other, &signed, Some(&signature)), Ok(()));
        let err = verify(&pinned, &RUN, &signed, Some(&signature)).unwrap_err();
        assert!(err.to_string().contains(&RUN.to_hex()), "{err}");
        // The run follows the domain string, before any field.
        let bytes = signed.to_bytes(&RUN);
        assert!(
            [ARTIFACT_DOMAIN, COMMIT_DOMAIN, OFFER_DOMAIN]
                .iter()
                .any(
                    |domain| bytes.starts_with(domain) && bytes[domain.len()..].starts_with(&RUN.0)
                )
        );
    }
}

#[test]
fn run_ids_read_back_from_hex_and_the_unknown_one_is_no_run() {
    assert_eq!(RunId::from_hex(&RUN.to_hex()), Some(RUN));
    assert_eq!(RUN.to_hex().parse::<RunId>(), Ok(RUN));
    assert!("00000000000000000000000000000000".parse::<RunId>().is_err());
    assert!("5a5a".parse::<RunId>().is_err());
    assert!(RunId::from_hex("zz5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a").is_none());
}
