// Have-sets are vectors of ranges; a set with one range is not a mistake.
#![allow(clippy::single_range_in_vec_init)]

use super::*;
use proptest::prelude::*;

pub(super) fn decode(bytes: &[u8]) -> Result<(Frame, usize), FrameError> {
    Frame::decode(&Bytes::copy_from_slice(bytes))
}

/// Encodes `frame`, compares with the annotated golden bytes, and decodes them back.
#[track_caller]
fn golden(frame: Frame, parts: &[&[u8]]) {
    let expected: Vec<u8> = parts.concat();
    let bytes = frame.to_bytes();
    assert_eq!(
        bytes,
        expected,
        "encoding of {:?} changed:\n{}",
        frame.frame_type(),
        hex(&bytes)
    );
    assert_eq!(frame.encoded_len(), bytes.len());
    let mut split = Vec::new();
    let payload = frame.encode_split(&mut split).cloned().unwrap_or_default();
    split.extend_from_slice(&payload);
    assert_eq!(split, bytes, "a split encoding writes the same bytes");
    assert_eq!(decode(&expected).unwrap(), (frame, expected.len()));
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x} ")).collect()
}

pub(super) fn hello() -> Hello {
    Hello {
        protocol_version: 4,
        flags: 0,
        role: Role::Actor,
        peer_id: "a1".into(),
        region: "eu".into(),
        token: b"tk".to_vec(),
        session: 0x0102,
        stream: 1,
        streams: 4,
        epoch: 2,
        active: VersionRef {
            version: 3,
            hash: Hash([0xAB; 32]),
        },
        staged: Some(4),
        snapshot_floor: 0,
    }
}

// Golden bytes: version 4 of the wire protocol must never change
// (docs/wire-protocol.md §4 shows the same layouts).

#[test]
fn hello_golden_bytes() {
    golden(
        Frame::Hello(hello()),
        &[
            &[86, 0, 0, 0],               // length: type + body
            &[0x01],                      // type Hello
            b"AURORA\x00\x01",            // magic
            &[4, 0],                      // protocol version 4
            &[0, 0],                      // flags
            &[3],                         // role actor
            &[2, b'a', b'1'],             // peer id "a1"
            &[2, b'e', b'u'],             // region "eu"
            &[2, b't', b'k'],             // token
            &[2, 1, 0, 0, 0, 0, 0, 0],    // session 0x0102
            &[1, 4],                      // stream 1 of 4
            &[2, 0, 0, 0],                // epoch 2: its second connection
            &[3, 0, 0, 0, 0, 0, 0, 0],    // active version 3
            &[0xAB; 32],                  // active weights hash
            &[1, 4, 0, 0, 0, 0, 0, 0, 0], // staged: some(4)
        ],
    );
}

#[test]
fn version_5_adds_the_snapshot_floor_to_the_hello_and_the_run_to_the_welcome() {
    let mut joining = hello();
    joining.protocol_version = 5;
    joining.active = VersionRef::default();
    joining.staged = None;
    joining.snapshot_floor = 10;
    golden(
        Frame::Hello(joining),
        &[
            &[86, 0, 0, 0],
            &[0x01],                    // type Hello
            b"AURORA\x00\x01",          // magic
            &[5, 0],                    // protocol version 5
            &[0, 0],                    // flags
            &[3],                       // role actor
            &[2, b'a', b'1'],           // peer id "a1"
            &[2, b'e', b'u'],           // region "eu"
            &[2, b't', b'k'],           // token
            &[2, 1, 0, 0, 0, 0, 0, 0],  // session 0x0102
            &[1, 4],                    // stream 1 of 4
            &[2, 0, 0, 0],              // epoch 2
            &[0; 8],                    // active version 0 ...
            &[0; 32],                   // ... with the zero hash: no weights
            &[0],                       // staged: none
            &[10, 0, 0, 0, 0, 0, 0, 0], // no snapshot older than version 10
        ],
    );
    golden(
        Frame::Welcome(Welcome {
            protocol_version: 5,
            role: Role::Hub,
            peer_id: "h".into(),
            region: "".into(),
            latest: Some(9),
            commit: None,
            snapshot: Some(5),
            run: RunId([0x77; 16]),
        }),
        &[
            &[42, 0, 0, 0],
            &[0x02],                      // type Welcome
            &[5, 0],                      // protocol version 5
            &[1],                         // role hub
            &[1, b'h'],                   // peer id
            &[0],                         // region ""
            &[1, 9, 0, 0, 0, 0, 0, 0, 0], // latest: some(9)
            &[0],                         // commit: none
            &[1, 5, 0, 0, 0, 0, 0, 0, 0], // snapshot: some(5)
            &[0x77; 16],                  // the run it serves
        ],
    );
}

#[test]
fn welcome_and_reject_golden_bytes() {
    golden(
        Frame::Welcome(Welcome {
            protocol_version: 4,
            role: Role::Hub,
            peer_id: "h".into(),
            region: "".into(),
            latest: Some(9),
            commit: None,
            snapshot: Some(5),
            run: RunId::UNKNOWN,
        }),
        &[
            &[26, 0, 0, 0],
            &[0x02],                      // type Welcome
            &[4, 0],                      // protocol version
            &[1],                         // role hub
            &[1, b'h'],                   // peer id
            &[0],                         // region ""
            &[1, 9, 0, 0, 0, 0, 0, 0, 0], // latest: some(9)
            &[0],                         // commit: none
            &[1, 5, 0, 0, 0, 0, 0, 0, 0], // snapshot: some(5), for a peer with no weights
        ],
    );
    golden(
        Frame::Welcome(Welcome {
            protocol_version: 4,
            role: Role::Relay,
            peer_id: "r".into(),
            region: "".into(),
            latest: None,
            commit: Some(Commit {
                target: VersionRef {
                    version: 2,
                    hash: Hash([0x44; 32]),
                },
                signature: Some(ArtifactSignature([0x55; 64])),
            }),
            snapshot: None,
            run: RunId::UNKNOWN,
        }),
        &[
            &[115, 0, 0, 0],
            &[0x02],                   // type Welcome
            &[4, 0],                   // protocol version
            &[2],                      // role relay
            &[1, b'r'],                // peer id
            &[0],                      // region ""
            &[0],                      // latest: none
            &[1],                      // commit: some
            &[2, 0, 0, 0, 0, 0, 0, 0], // version 2
            &[0x44; 32],               // its weights hash
            &[1],                      // signed:
            &[0x55; 64],               // the trainer's signature of the commit
            &[0],                      // snapshot: none (a relay serves none)
        ],
    );
    golden(
        Frame::Reject {
            code: RejectCode::Auth,
            reason: "no".into(),
        },
        &[
            &[7, 0, 0, 0],
            &[0x03],             // type Reject
            &[2, 0],             // code 2: auth
            &[2, 0, b'n', b'o'], // reason
        ],
    );
}

#[test]
fn want_golden_bytes() {
    golden(
        Frame::Want {
            seq: 3,
            next_version: 5,
            snapshot: true,
            composed: false,
            live_streams: 0b1011,
            epochs: vec![1, 2, 0, 1],
            progress: vec![Progress {
                version: 5,
                has_offer: true,
                has_seal: false,
                composed: false,
                have: vec![0..2, 5..6],
            }],
        },
        &[
            &[73, 0, 0, 0],
            &[0x04],                                           // type Want
            &[3, 0, 0, 0, 0, 0, 0, 0],                         // sequence number
            &[5, 0, 0, 0, 0, 0, 0, 0],                         // next version
            &[0b1],                                            // flags: 5 as a snapshot
            &[0b1011, 0, 0, 0, 0, 0, 0, 0],                    // live streams 0, 1, 3
            &[4],                                              // four stream epochs
            &[1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], // 1, 2, 0 (never connected), 1
            &[1],                                              // one version
            &[5, 0, 0, 0, 0, 0, 0, 0],                         // version 5
            &[0b01],                                           // has offer, no seal
            &[2, 0, 0, 0],                                     // two ranges
            &[0, 0, 0, 0, 2, 0, 0, 0],                         // 0..2
            &[5, 0, 0, 0, 6, 0, 0, 0],                         // 5..6
        ],
    );
}

#[test]
fn composed_catch_up_golden_bytes() {
    golden(
        Frame::Want {
            seq: 2,
            next_version: 4,
            snapshot: false,
            composed: true,
            live_streams: 0b1,
            epochs: vec![1],
            progress: vec![Progress {
                version: 8,
                has_offer: true,
                has_seal: true,
                composed: true,
                have: vec![0..3],
            }],
        },
        &[
            &[53, 0, 0, 0],
            &[0x04],                     // type Want
            &[2, 0, 0, 0, 0, 0, 0, 0],   // sequence number
            &[4, 0, 0, 0, 0, 0, 0, 0],   // next version
            &[0b10],                     // flags: composed catch-up accepted
            &[0b1, 0, 0, 0, 0, 0, 0, 0], // live streams 0
            &[1],                        // one stream epoch
            &[1, 0, 0, 0],               // 1
            &[1],                        // one version
            &[8, 0, 0, 0, 0, 0, 0, 0],   // version 8
            &[0b111],                    // offer, seal, of a composed delta
            &[1, 0, 0, 0],               // one range
            &[0, 0, 0, 0, 3, 0, 0, 0],   // 0..3
        ],
    );
    golden(
        Frame::Offer {
            version: 8,
            kind: ArtifactKind::Composed,
            descriptor: Bytes::from_static(b"HDR"),
            signature: None,
        },
        &[
            &[18, 0, 0, 0],
            &[0x05],                   // type Offer
            &[8, 0, 0, 0, 0, 0, 0, 0], // version
            &[3],                      // kind composed delta
            &[3, 0, 0, 0],             // descriptor length
            b"HDR",
            &[0], // unsigned
        ],
    );
}

#[test]
fn transfer_frames_golden_bytes() {
    golden(
        Frame::Offer {
            version: 7,
            kind: ArtifactKind::Delta,
            descriptor: Bytes::from_static(b"HDR"),
            signature: None,
        },
        &[
            &[18, 0, 0, 0],
            &[0x05],                   // type Offer
            &[7, 0, 0, 0, 0, 0, 0, 0], // version
            &[1],                      // kind delta
            &[3, 0, 0, 0],             // descriptor length
            b"HDR",
            &[0], // unsigned
        ],
    );
    golden(
        Frame::Offer {
            version: 7,
            kind: ArtifactKind::Snapshot,
            descriptor: Bytes::from_static(b"HDR"),
            signature: Some(ArtifactSignature([0x66; 64])),
        },
        &[
            &[82, 0, 0, 0],
            &[0x05],                   // type Offer
            &[7, 0, 0, 0, 0, 0, 0, 0], // version
            &[2],                      // kind snapshot
            &[3, 0, 0, 0],             // descriptor length
            b"HDR",
            &[1], // signed: the trainer's signature of the descriptor
            &[0x66; 64],
        ],
    );
    golden(
        Frame::Segment {
            version: 7,
            index: 2,
            hash: Hash([0x11; 32]),
            bytes: Bytes::from_static(b"seg"),
        },
        &[
            &[52, 0, 0, 0],
            &[0x06],                   // type Segment
            &[7, 0, 0, 0, 0, 0, 0, 0], // version
            &[2, 0, 0, 0],             // index
            &[0x11; 32],               // BLAKE3 of the bytes (as the sender claims)
            &[3, 0, 0, 0],             // length
            b"seg",
        ],
    );
    golden(
        Frame::Seal {
            version: 7,
            id: Hash([0x22; 32]),
            target_hash: Hash([0x33; 32]),
            segments: vec![SegmentEntry {
                len: 3,
                hash: Hash([0x11; 32]),
            }],
            signature: Some(ArtifactSignature([0x66; 64])),
        },
        &[
            &[178, 0, 0, 0],
            &[0x07],                   // type Seal
            &[7, 0, 0, 0, 0, 0, 0, 0], // version
            &[0x22; 32],               // artifact id
            &[0x33; 32],               // the target's weights hash
            &[1, 0, 0, 0],             // one segment
            &[3, 0, 0, 0],             // its length
            &[0x11; 32],               // its hash
            &[1],                      // signed:
            &[0x66; 64],               // the trainer's signature of the artifact
        ],
    );
    // An unsigned deployment's Seal: the flag alone.
    golden(
        Frame::Seal {
            version: 7,
            id: Hash([0x22; 32]),
            target_hash: Hash([0x33; 32]),
            segments: Vec::new(),
            signature: None,
        },
        &[
            &[78, 0, 0, 0],
            &[0x07],                   // type Seal
            &[7, 0, 0, 0, 0, 0, 0, 0], // version
            &[0x22; 32],               // artifact id
            &[0x33; 32],               // the target's weights hash
            &[0, 0, 0, 0],             // no segments
            &[0],                      // unsigned
        ],
    );
}

#[test]
fn small_frames_golden_bytes() {
    golden(
        Frame::Nack {
            version: 7,
            index: 2,
        },
        &[
            &[13, 0, 0, 0],
            &[0x08],
            &[7, 0, 0, 0, 0, 0, 0, 0],
            &[2, 0, 0, 0],
        ],
    );
    golden(
        Frame::Unavailable {
            version: 1,
            reason: "x".into(),
        },
        &[
            &[12, 0, 0, 0],
            &[0x09],
            &[1, 0, 0, 0, 0, 0, 0, 0],
            &[1, 0, b'x'],
        ],
    );
    golden(
        Frame::Commit(Commit {
            target: VersionRef {
                version: 8,
                hash: Hash([0x33; 32]),
            },
            signature: Some(ArtifactSignature([0x77; 64])),
        }),
        &[
            &[106, 0, 0, 0],
            &[0x0A],
            &[8, 0, 0, 0, 0, 0, 0, 0],
            &[0x33; 32],
            &[1],        // signed:
            &[0x77; 64], // the trainer's signature of the commit
        ],
    );
    golden(
        Frame::Commit(Commit {
            target: VersionRef {
                version: 8,
                hash: Hash([0x33; 32]),
            },
            signature: None,
        }),
        &[
            &[42, 0, 0, 0],
            &[0x0A],
            &[8, 0, 0, 0, 0, 0, 0, 0],
            &[0x33; 32],
            &[0],
        ],
    );
    // A signature flag other than 0 or 1 is malformed.
    let mut bad = Frame::Commit(Commit {
        target: VersionRef::default(),
        signature: None,
    })
    .to_bytes();
    *bad.last_mut().unwrap() = 2;
    assert!(matches!(
        decode(&bad).unwrap_err(),
        FrameError::Malformed { .. }
    ));
    golden(
        Frame::Status {
            active: VersionRef {
                version: 8,
                hash: Hash([0x33; 32]),
            },
            staged: None,
            note: "ok".into(),
        },
        &[
            &[46, 0, 0, 0],
            &[0x0B],
            &[8, 0, 0, 0, 0, 0, 0, 0],
            &[0x33; 32],
            &[0], // staged: none
            &[2, 0, b'o', b'k'],
        ],
    );
    golden(Frame::Keepalive, &[&[1, 0, 0, 0], &[0x0C]]);
    golden(
        Frame::Goodbye { reason: "".into() },
        &[&[3, 0, 0, 0], &[0x0D], &[0, 0]],
    );
}

#[test]
fn incomplete_is_told_apart_from_invalid() {
    let bytes = Frame::Segment {
        version: 1,
        index: 0,
        hash: Hash::of(b"abc"),
        bytes: Bytes::from_static(b"abc"),
    }
    .to_bytes();
    for cut in 0..bytes.len() {
        let error = decode(&bytes[..cut]).unwrap_err();
        assert!(error.is_incomplete(), "cut at {cut}: {error}");
    }
    let mut two = bytes.clone();
    two.extend_from_slice(&Frame::Keepalive.to_bytes());
    let (_, used) = decode(&two).unwrap();
    assert_eq!(used, bytes.len(), "one frame at a time");

    let mut unknown = bytes.clone();
    unknown[4] = 0xEE;
    assert_eq!(decode(&unknown).unwrap_err(), FrameError::UnknownType(0xEE));
    let mut short_body = Frame::Keepalive.to_bytes();
    short_body[0] = 3;
    short_body.extend_from_slice(&[0, 0]);
    assert!(matches!(
        decode(&short_body).unwrap_err(),
        FrameError::Malformed {
            frame: "Keepalive",
            ..
        }
    ));
    let mut zero = Frame::Keepalive.to_bytes();
    zero[0] = 0;
    assert!(matches!(
        decode(&zero).unwrap_err(),
        FrameError::TooLarge { len: 0, .. }
    ));
}

#[test]
fn a_truncated_field_inside_a_complete_frame_is_malformed() {
    let mut bytes = Frame::Nack {
        version: 1,
        index: 2,
    }
    .to_bytes();
    bytes.truncate(bytes.len() - 1);
    bytes[0] -= 1;
    let error = decode(&bytes).unwrap_err();
    assert_eq!(
        error.to_string(),
        "Nack frame is malformed: segment index needs 4 bytes but 3 remain"
    );
}

fn arb_hash() -> impl Strategy<Value = Hash> {
    any::<[u8; 32]>().prop_map(Hash)
}

fn arb_name() -> impl Strategy<Value = String> {
    "[a-z0-9-]{0,64}"
}

fn arb_text() -> impl Strategy<Value = String> {
    ".{0,40}"
}

fn arb_version_ref() -> impl Strategy<Value = VersionRef> {
    (any::<u64>(), arb_hash()).prop_map(|(version, hash)| VersionRef { version, hash })
}

fn arb_signature() -> impl Strategy<Value = Option<ArtifactSignature>> {
    prop::option::of(prop::array::uniform32(any::<u8>()).prop_map(|half| {
        let mut bytes = [0u8; 64];
        bytes[..32].copy_from_slice(&half);
        bytes[32..].copy_from_slice(&half.map(|b| !b));
        ArtifactSignature(bytes)
    }))
}

fn arb_commit() -> impl Strategy<Value = Commit> {
    (arb_version_ref(), arb_signature())
        .prop_map(|(target, signature)| Commit { target, signature })
}

fn arb_role() -> impl Strategy<Value = Role> {
    prop_oneof![Just(Role::Hub), Just(Role::Relay), Just(Role::Actor)]
}

fn arb_ranges() -> impl Strategy<Value = Vec<Range<u32>>> {
    prop::collection::vec((1u32..5, 1u32..5), 0..6).prop_map(|steps| {
        let mut at = 0;
        steps
            .into_iter()
            .map(|(gap, len)| {
                let start = at + gap;
                at = start + len;
                start..at
            })
            .collect()
    })
}

fn arb_frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (
            arb_role(),
            arb_name(),
            arb_name(),
            prop::collection::vec(any::<u8>(), 0..=MAX_TOKEN_BYTES),
            any::<u64>(),
            (1u8..=MAX_STREAMS),
            arb_version_ref(),
            any::<Option<u64>>(),
            (any::<u16>(), any::<u32>())
        )
            .prop_map(
                |(
                    role,
                    peer_id,
                    region,
                    token,
                    session,
                    streams,
                    active,
                    staged,
                    (flags, epoch),
                )| {
                    Frame::Hello(Hello {
                        protocol_version: PROTOCOL_VERSION,
                        flags,
                        role,
                        peer_id,
                        region,
                        token,
                        session,
                        stream: streams - 1,
                        streams,
                        epoch,
                        active,
                        staged,
                        snapshot_floor: session.rotate_left(7),
                    })
                }
            ),
        (
            arb_role(),
            arb_name(),
            arb_name(),
            any::<Option<u64>>(),
            prop::option::of(arb_commit()),
            any::<Option<u64>>()
        )
            .prop_map(|(role, peer_id, region, latest, commit, snapshot)| {
                Frame::Welcome(Welcome {
                    protocol_version: PROTOCOL_VERSION,
                    role,
                    peer_id,
                    region,
                    latest,
                    commit,
                    snapshot,
                    run: RunId([latest.unwrap_or(7) as u8; 16]),
                })
            }),
        (1u16..=4, arb_text()).prop_map(|(code, reason)| Frame::Reject {
            code: RejectCode::from_code(code).unwrap(),
            reason
        }),
        (
            0u64..1000,
            any::<u64>(),
            prop::collection::vec(any::<u32>(), 0..=MAX_STREAMS as usize),
            prop::collection::vec((any::<bool>(), any::<bool>(), arb_ranges()), 0..4)
        )
            .prop_map(
                |(next_version, live_streams, epochs, entries)| Frame::Want {
                    seq: next_version * 3,
                    next_version,
                    snapshot: next_version % 3 == 1,
                    composed: next_version % 3 == 2,
                    live_streams,
                    epochs,
                    progress: entries
                        .into_iter()
                        .enumerate()
                        .map(|(i, (has_offer, has_seal, have))| Progress {
                            version: next_version + 2 * i as u64,
                            has_offer,
                            has_seal,
                            composed: has_offer && i == 0,
                            have,
                        })
                        .collect(),
                }
            ),
        (
            any::<u64>(),
            any::<bool>(),
            prop::collection::vec(any::<u8>(), 0..200),
            arb_signature()
        )
            .prop_map(|(version, snapshot, descriptor, signature)| Frame::Offer {
                version,
                kind: if snapshot {
                    ArtifactKind::Snapshot
                } else {
                    ArtifactKind::Delta
                },
                descriptor: Bytes::from(descriptor),
                signature,
            }),
        (
            any::<u64>(),
            0..MAX_TRANSFER_SEGMENTS,
            arb_hash(),
            prop::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(version, index, hash, bytes)| Frame::Segment {
                version,
                index,
                hash,
                bytes: Bytes::from(bytes)
            }),
        (
            any::<u64>(),
            arb_hash(),
            arb_hash(),
            prop::collection::vec((0..=MAX_SEGMENT_BYTES, arb_hash()), 0..20),
            arb_signature()
        )
            .prop_map(
                |(version, id, target_hash, entries, signature)| Frame::Seal {
                    version,
                    id,
                    target_hash,
                    segments: entries
                        .into_iter()
                        .map(|(len, hash)| SegmentEntry { len, hash })
                        .collect(),
                    signature,
                }
            ),
        (any::<u64>(), any::<u32>()).prop_map(|(version, index)| Frame::Nack { version, index }),
        (any::<u64>(), arb_text())
            .prop_map(|(version, reason)| Frame::Unavailable { version, reason }),
        arb_commit().prop_map(Frame::Commit),
        (arb_version_ref(), any::<Option<u64>>(), arb_text()).prop_map(|(active, staged, note)| {
            Frame::Status {
                active,
                staged,
                note,
            }
        }),
        Just(Frame::Keepalive),
        arb_text().prop_map(|reason| Frame::Goodbye { reason }),
    ]
}

proptest! {
    #[test]
    fn every_frame_round_trips(frame in arb_frame()) {
        let bytes = frame.to_bytes();
        prop_assert_eq!(frame.encoded_len(), bytes.len());
        let (decoded, used) = decode(&bytes).unwrap();
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(decoded, frame);
    }

    #[test]
    fn a_stream_of_frames_decodes_one_by_one(frames in prop::collection::vec(arb_frame(), 1..8)) {
        let mut stream = Vec::new();
        for frame in &frames {
            frame.encode(&mut stream);
        }
        let mut buf = Bytes::from(stream);
        for frame in &frames {
            let (decoded, used) = Frame::decode(&buf).unwrap();
            prop_assert_eq!(&decoded, frame);
            buf = buf.slice(used..);
        }
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn single_byte_damage_never_panics(frame in arb_frame(), at in any::<prop::sample::Index>(), value in any::<u8>()) {
        let mut bytes = frame.to_bytes();
        let at = at.index(bytes.len());
        bytes[at] = value;
        let _ = decode(&bytes);
    }
}

#[test]
fn the_largest_want_a_receiver_builds_is_the_largest_frame_a_downstream_sends() {
    let have: Vec<Range<u32>> = (0..MAX_HAVE_RANGES as u32)
        .map(|i| 2 * i..2 * i + 1)
        .collect();
    let largest = Frame::Want {
        seq: u64::MAX,
        next_version: 1,
        snapshot: false,
        composed: false,
        live_streams: u64::MAX,
        epochs: vec![u32::MAX; MAX_STREAMS as usize],
        progress: (0..MAX_WANT_VERSIONS as u64)
            .map(|i| Progress {
                version: 1 + i,
                has_offer: true,
                has_seal: true,
                composed: false,
                have: have.clone(),
            })
            .collect(),
    };
    largest.validate().unwrap();
    assert_eq!(
        largest.encoded_len(),
        PREFIX_BYTES - 1 + MAX_DOWNSTREAM_FRAME_BYTES
    );
    assert_eq!(MAX_DOWNSTREAM_FRAME_BYTES, 524_780);
}

#[test]
fn a_reader_refuses_at_the_prefix_a_frame_its_peer_s_end_never_sends_or_sends_out_of_place() {
    let prefix = |kind: FrameType, len: u32| {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.push(kind as u8);
        bytes
    };
    // Frames no downstream sends: whatever their size, refused before the body.
    for kind in [
        FrameType::Offer,
        FrameType::Segment,
        FrameType::Seal,
        FrameType::Welcome,
        FrameType::Reject,
        FrameType::Unavailable,
        FrameType::Commit,
    ] {
        for first in [true, false] {
            let error =
                peek_prefix_from(&prefix(kind, 64 << 20), Side::Downstream, first).unwrap_err();
            assert!(
                matches!(
                    error,
                    FrameError::WrongSide {
                        from: Side::Downstream,
                        ..
                    }
                ),
                "{kind:?}: {error}"
            );
            assert!(
                error.to_string().contains("a downstream never sends"),
                "{error}"
            );
        }
    }
    for kind in [
        FrameType::Hello,
        FrameType::Want,
        FrameType::Nack,
        FrameType::Status,
    ] {
        let error = peek_prefix_from(&prefix(kind, 1), Side::Upstream, false).unwrap_err();
        assert!(
            matches!(error, FrameError::WrongSide { .. }),
            "{kind:?}: {error}"
        );
    }
    // A connection opens with a Hello (a Welcome or a Reject the other way), and only so.
    let error = peek_prefix_from(&prefix(FrameType::Want, 9), Side::Downstream, true).unwrap_err();
    assert!(
        error.to_string().contains("opens a connection with Want"),
        "{error}"
    );
    let error =
        peek_prefix_from(&prefix(FrameType::Hello, 9), Side::Downstream, false).unwrap_err();
    assert!(
        error.to_string().contains("after its connection was open"),
        "{error}"
    );
    let error = peek_prefix_from(&prefix(FrameType::Segment, 9), Side::Upstream, true).unwrap_err();
    assert!(
        matches!(error, FrameError::OutOfPlace { first: true, .. }),
        "{error}"
    );
    // What each end does send, where it sends it.
    let taken = [
        (FrameType::Hello, Side::Downstream, true),
        (FrameType::Want, Side::Downstream, false),
        (FrameType::Keepalive, Side::Downstream, false),
        (FrameType::Welcome, Side::Upstream, true),
        (FrameType::Reject, Side::Upstream, true),
        (FrameType::Segment, Side::Upstream, false),
        (FrameType::Goodbye, Side::Upstream, false),
    ];
    for (kind, from, first) in taken {
        assert_eq!(
            peek_prefix_from(&prefix(kind, 9), from, first).unwrap().0,
            kind
        );
    }
    // A Want over the largest a receiver builds is refused at its prefix too.
    let over = (MAX_DOWNSTREAM_FRAME_BYTES + 1) as u32;
    assert!(matches!(
        peek_prefix_from(&prefix(FrameType::Want, over), Side::Downstream, false),
        Err(FrameError::TooLarge { .. })
    ));
}
