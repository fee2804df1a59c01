//! Checks behind the segment-protocol targets (`proto_frames`, `proto_state`).
//!
//! - [`check_frames`]: arbitrary bytes as a stream of frames. Nothing may panic; every
//!   frame that decodes re-encodes to exactly the bytes it came from (the encoding is
//!   canonical), and a frame the decoder calls incomplete really is cut short.
//! - [`check_state`]: arbitrary bytes as frames fed to the receiver (first byte 0 mod 4),
//!   a receiver joining with no weights (2 mod 4), a receiver that pins the trainer key
//!   of [`trainer_key`] (3 mod 4) or the sender (1 mod 4) state machines, on two streams.
//!   Nothing may panic, and whatever the receiver delivers as complete must be a valid
//!   artifact whose every segment verifies; a pinned receiver takes only an Offer that
//!   carries the trainer's signature of its descriptor, delivers only an artifact whose
//!   Seal carried the trainer's signature, and reports only signed commits.

use std::time::{Duration, Instant};

use aurora_delta::{
    DeltaFile, DeltaHeader, Encoding, Hash, RunId, SigningKey, Statement, assemble,
};
use aurora_proto::frame::{ArtifactKind, Hello, PROTOCOL_VERSION, Progress, Welcome};
use aurora_proto::{
    Auth, Commit, Frame, Identity, Receiver, ReceiverConfig, ReceiverEvent, Role, Sender,
    SenderConfig, StoredArtifact, VersionRef,
};
use bytes::Bytes;

const TOKEN: &[u8] = b"fuzz";
/// The run of the fuzzed hub: its Welcomes and its signatures name it.
const RUN: RunId = RunId([0x3e; 16]);

/// Decodes `data` frame by frame until the bytes run out or a frame is invalid.
pub fn frames(data: &[u8]) -> Vec<Frame> {
    let mut buf = Bytes::copy_from_slice(data);
    let mut out = Vec::new();
    while let Ok((frame, used)) = Frame::decode(&buf) {
        out.push(frame);
        buf = buf.slice(used..);
    }
    out
}

pub fn check_frames(data: &[u8]) {
    let mut buf = Bytes::copy_from_slice(data);
    loop {
        match Frame::decode(&buf) {
            Ok((frame, used)) => {
                assert_eq!(frame.to_bytes(), &buf[..used], "{frame:?} is not canonical");
                assert_eq!(frame.encoded_len(), used);
                buf = buf.slice(used..);
            }
            Err(error) if error.is_incomplete() => {
                // More bytes could complete it: the prefix announces more than is here.
                let announced = buf.get(..4).map_or(usize::MAX, |p| {
                    u32::from_le_bytes(p.try_into().unwrap()) as usize + 4
                });
                assert!(buf.len() < announced.max(5), "{error} on a complete frame");
                return;
            }
            Err(_) => return,
        }
    }
}

fn identity(role: Role, name: &str) -> Identity {
    Identity {
        role,
        peer_id: name.into(),
        region: "fuzz".into(),
    }
}

/// The artifact both state machines know: D(1) with three segments.
pub fn artifact() -> (Bytes, DeltaHeader) {
    let header = DeltaHeader {
        base_version: 0,
        target_version: 1,
        base_hash: Hash::of(b"base"),
        target_hash: Hash::of(b"target"),
        encoding: Encoding::Aurora,
        tensors: Vec::new(),
    };
    let segments = vec![b"one".to_vec(), b"two!".to_vec(), b"three".to_vec()];
    let (_, bytes) = assemble(&header, &segments);
    (Bytes::from(bytes), header)
}

/// The trainer key of the signed seeds.
pub fn trainer_key() -> SigningKey {
    SigningKey::from_bytes(&[0xf0; 32])
}

pub fn check_state(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let frames = frames(rest);
    match selector % 4 {
        0 => receiver_state(&frames, false, false),
        2 => receiver_state(&frames, true, false),
        3 => receiver_state(&frames, false, true),
        _ => sender_state(&frames),
    }
}

/// A receiver from version 1 on, or one joining with no weights (its upstream offers
/// snapshot 1); `pinned`, it pins [`trainer_key`].
fn receiver_state(frames: &[Frame], joining: bool, pinned: bool) {
    let mut config = ReceiverConfig::new(identity(Role::Actor, "a"), TOKEN.to_vec());
    config.streams = 2;
    config.max_held_bytes = 1 << 20;
    let key = trainer_key().verifying_key();
    config.trainer_key = pinned.then_some(key);
    config.run = pinned.then_some(RUN);
    let mut receiver = if joining {
        Receiver::joining(config)
    } else {
        Receiver::new(config, 1, VersionRef::default())
    };
    let mut now = Instant::now();
    receiver.start_session(now, 7);
    for stream in 0..2 {
        receiver.connected(now, 7, stream, u64::from(stream) + 1, None);
        let welcome = Welcome {
            protocol_version: PROTOCOL_VERSION,
            role: Role::Hub,
            peer_id: "hub".into(),
            region: "fuzz".into(),
            latest: None,
            commit: None,
            snapshot: joining.then_some(1),
            run: RUN,
        };
        receiver.handle_frame(now, u64::from(stream) + 1, Frame::Welcome(welcome));
    }
    for (i, frame) in frames.iter().enumerate() {
        now += Duration::from_millis(10);
        receiver.handle_frame(now, (i % 2) as u64 + 1, frame.clone());
        receiver.handle_timeout(now);
        while let Some(event) = receiver.poll_event() {
            match event {
                ReceiverEvent::Complete { version, artifact } => {
                    let bytes = artifact.to_bytes();
                    let file = DeltaFile::parse(&bytes).expect("a delivered artifact parses");
                    assert_eq!(file.header().target_version, version);
                    for index in 0..file.segment_count() {
                        file.verify_segment(index)
                            .expect("a delivered segment verifies");
                    }
                }
                ReceiverEvent::Offered {
                    version,
                    kind,
                    descriptor,
                    signature,
                    ..
                } if pinned => {
                    let statement = Statement::offer(kind, version, &descriptor);
                    aurora_delta::verify(&key, &RUN, &statement, signature.as_ref())
                        .expect("a pinned receiver takes only signed offers");
                }
                ReceiverEvent::Sealed {
                    version, signature, ..
                } if pinned => {
                    assert!(signature.is_some(), "version {version} sealed unsigned");
                }
                ReceiverEvent::Commit(commit) if pinned => {
                    aurora_delta::verify(
                        &key,
                        &RUN,
                        &commit.statement(),
                        commit.signature.as_ref(),
                    )
                    .expect("a pinned receiver reports only signed commits");
                }
                _ => {}
            }
        }
        while let Some(aurora_proto::Transmit { frame, .. }) = receiver.poll_transmit() {
            frame.validate().expect("the receiver writes valid frames");
        }
    }
}

fn sender_state(frames: &[Frame]) {
    let mut config = SenderConfig::new(identity(Role::Hub, "hub"), Auth::Shared(TOKEN.to_vec()));
    config.run = Some(RUN);
    let mut sender = Sender::new(config);
    sender
        .insert_artifact(StoredArtifact::unsigned(artifact().0))
        .expect("the fixed artifact is valid");
    let mut now = Instant::now();
    sender.accepted(now, 1, None);
    sender.accepted(now, 2, None);
    for (i, frame) in frames.iter().enumerate() {
        now += Duration::from_millis(10);
        let conn = (i % 2) as u64 + 1;
        sender.handle_frame(now, conn, frame.clone());
        if i % 3 == 2 {
            sender.on_sent(now, conn);
        }
        sender.handle_timeout(now);
        while sender.poll_event().is_some() {}
        while let Some(transmit) = sender.poll_transmit(now) {
            transmit
                .frame
                .validate()
                .expect("the sender writes valid frames");
            sender.on_sent(now, transmit.conn);
        }
    }
}

/// Seeds: valid conversations, so the fuzzer starts inside the state machines: to a
/// receiver of an unsigned deployment, to one that pins the trainer key (the Offer, the
/// Seal and the Commit signed), and to the sender.
pub fn seed_streams() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("receiver", receiver_seed(None)),
        ("signed-receiver", receiver_seed(Some(&trainer_key()))),
        ("sender", sender_seed()),
    ]
}

/// The fixed artifact's frames and its Commit, signed by `key` if given; the selector
/// picks a receiver that pins the key when there is one.
fn receiver_seed(key: Option<&SigningKey>) -> Vec<u8> {
    let (bytes, _) = artifact();
    let file = DeltaFile::parse(&bytes).expect("valid");
    let mut to_receiver = vec![if key.is_some() { 3u8 } else { 0u8 }];
    let statement = Statement::artifact(ArtifactKind::Delta, file.id, file.header());
    let mut frames = vec![
        Frame::Offer {
            version: 1,
            kind: ArtifactKind::Delta,
            descriptor: Bytes::from(file.header().encode_pending()),
            signature: key.map(|key| {
                aurora_proto::offer_signature(key, &RUN, ArtifactKind::Delta, &bytes)
                    .expect("valid")
            }),
        },
        Frame::Seal {
            version: 1,
            id: file.id,
            target_hash: file.header().target_hash,
            segments: file.manifest.segments.clone(),
            signature: key.map(|key| aurora_delta::sign(key, &RUN, &statement)),
        },
    ];
    for index in 0..file.segment_count() {
        let segment = file.verify_segment(index).expect("valid");
        frames.push(Frame::Segment {
            version: 1,
            index: index as u32,
            hash: Hash::of(segment),
            bytes: Bytes::copy_from_slice(segment),
        });
    }
    let mut commit = Commit {
        target: VersionRef {
            version: 1,
            hash: file.header().target_hash,
        },
        signature: None,
    };
    commit.signature = key.map(|key| aurora_delta::sign(key, &RUN, &commit.statement()));
    frames.push(Frame::Commit(commit));
    for frame in &frames {
        frame.encode(&mut to_receiver);
    }
    to_receiver
}

/// Two Hellos, a Want and a Nack.
fn sender_seed() -> Vec<u8> {
    let mut to_sender = vec![1u8];
    for stream in 0..2 {
        Frame::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            flags: 0,
            role: Role::Actor,
            peer_id: "a".into(),
            region: "fuzz".into(),
            token: TOKEN.to_vec(),
            session: 9,
            stream,
            streams: 2,
            epoch: 1,
            active: VersionRef::default(),
            staged: None,
            snapshot_floor: 0,
        })
        .encode(&mut to_sender);
    }
    Frame::Want {
        seq: 1,
        next_version: 1,
        snapshot: false,
        composed: false,
        live_streams: 0b11,
        epochs: vec![1, 1],
        progress: vec![Progress {
            version: 1,
            has_offer: true,
            has_seal: false,
            composed: false,
            // A have-set of one range.
            have: vec![std::ops::Range { start: 1, end: 2 }],
        }],
    }
    .encode(&mut to_sender);
    Frame::Nack {
        version: 1,
        index: 0,
    }
    .encode(&mut to_sender);
    to_sender
}
