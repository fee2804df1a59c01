//! Shared helpers of the unit tests: small artifacts and a sender wired to a receiver
//! in memory.

use std::time::Instant;

use aurora_delta::{DeltaHeader, Encoding, Hash, Manifest, assemble};
use bytes::Bytes;

use crate::frame::{Frame, Hello, PROTOCOL_VERSION, Role, VersionRef, Welcome};
use crate::receiver::{Receiver, ReceiverConfig, ReceiverEvent};
use crate::sender::{Auth, Sender, SenderConfig};
use crate::{ConnId, Identity};

pub const TOKEN: &[u8] = b"secret";

pub fn identity(role: Role, peer_id: &str) -> Identity {
    Identity {
        role,
        peer_id: peer_id.into(),
        region: "eu".into(),
    }
}

pub fn weights(version: u64) -> Hash {
    Hash::of(&version.to_le_bytes())
}

/// A delta artifact D(version) with `segments` segments of arbitrary bytes (the
/// protocol never decodes them).
pub fn artifact(version: u64, segments: usize) -> (Bytes, Manifest) {
    let base = (version - 1, weights(version - 1));
    let label = format!("version {version}");
    synthetic(
        base,
        (version, weights(version)),
        Encoding::Aurora,
        segments,
        &label,
    )
}

/// Another publication of `version` than [`artifact`]'s: the same base and layout, so
/// the same descriptor (its target hash pending), but other target weights and
/// `segments` other segments.
pub fn another_artifact(version: u64, segments: usize) -> (Bytes, Manifest) {
    let base = (version - 1, weights(version - 1));
    let label = format!("another version {version}");
    let target = (version, Hash([0xEE; 32]));
    synthetic(base, target, Encoding::Aurora, segments, &label)
}

/// A composed delta from `base` straight to `target` with `segments` segments of
/// arbitrary bytes.
pub fn composed_artifact(base: u64, target: u64, segments: usize) -> (Bytes, Manifest) {
    let label = format!("{base} -> {target}");
    synthetic(
        (base, weights(base)),
        (target, weights(target)),
        Encoding::Aurora,
        segments,
        &label,
    )
}

/// An actor's receiver for `next_version`: it accepts composed catch-up.
pub fn composed_receiver(streams: u8, next_version: u64) -> Receiver {
    let mut r = receiver(streams, next_version);
    r.accept_composed();
    r
}

/// The snapshot artifact of `version` (docs/wire-protocol.md §4.4) with `segments`
/// segments of arbitrary bytes.
pub fn snapshot_artifact(version: u64, segments: usize) -> (Bytes, Manifest) {
    let base = (version, crate::snapshot::empty_weights_hash());
    let label = format!("snapshot {version}");
    synthetic(
        base,
        (version, weights(version)),
        Encoding::Dense,
        segments,
        &label,
    )
}

/// An artifact from `base` (version and weights hash) to `target` whose segments are
/// arbitrary bytes: "segment i of `label`".
fn synthetic(
    (base, base_hash): (u64, Hash),
    (target, target_hash): (u64, Hash),
    encoding: Encoding,
    segments: usize,
    label: &str,
) -> (Bytes, Manifest) {
    let header = DeltaHeader {
        base_version: base,
        target_version: target,
        base_hash,
        target_hash,
        encoding,
        tensors: Vec::new(),
    };
    let bodies: Vec<Vec<u8>> = (0..segments)
        .map(|i| format!("segment {i} of {label}").into_bytes())
        .collect();
    let (manifest, bytes) = assemble(&header, &bodies);
    (Bytes::from(bytes), manifest)
}

/// A hub with a store: it loads deltas up to `latest` and offers the snapshot of
/// `snapshot` to joiners.
pub fn store_sender(latest: u64, snapshot: u64) -> Sender {
    let mut config = SenderConfig::new(identity(Role::Hub, "hub"), Auth::Shared(TOKEN.to_vec()));
    config.store_backed = true;
    config.run = Some(RUN);
    let mut sender = Sender::new(config);
    sender.set_loadable(Some(latest));
    sender.set_snapshots([snapshot]);
    sender
}

pub fn sender() -> Sender {
    let mut config = SenderConfig::new(identity(Role::Hub, "hub"), Auth::Shared(TOKEN.to_vec()));
    config.run = Some(RUN);
    Sender::new(config)
}

pub fn receiver(streams: u8, next_version: u64) -> Receiver {
    pinned_receiver(streams, next_version, None)
}

/// [`receiver`] pinning `trainer_key` where given, and then the run too (as an actor does
/// once the control plane named it).
pub fn pinned_receiver(
    streams: u8,
    next_version: u64,
    trainer_key: Option<aurora_delta::VerifyingKey>,
) -> Receiver {
    let mut config = ReceiverConfig::new(identity(Role::Actor, "a1"), TOKEN.to_vec());
    config.streams = streams;
    config.trainer_key = trainer_key;
    config.run = trainer_key.map(|_| RUN);
    Receiver::new(
        config,
        next_version,
        VersionRef {
            version: next_version - 1,
            hash: weights(next_version - 1),
        },
    )
}

/// A receiver with no weights (it joins from a snapshot).
pub fn joining_receiver(streams: u8) -> Receiver {
    let mut config = ReceiverConfig::new(identity(Role::Actor, "a1"), TOKEN.to_vec());
    config.streams = streams;
    Receiver::joining(config)
}

/// A sender and a receiver joined by perfect in-memory streams.
pub struct Pair {
    pub now: Instant,
    pub sender: Sender,
    pub receiver: Receiver,
    pub session: u64,
    /// Connection ids by stream; `None` while a stream is down.
    pub conns: Vec<Option<ConnId>>,
    next_conn: ConnId,
    pub events: Vec<ReceiverEvent>,
    pub sender_events: Vec<crate::SenderEvent>,
    /// Frames the sender wrote, by connection, in order.
    pub written: Vec<(ConnId, Frame)>,
    /// Segment frames the sender may still write (None: no limit): a transfer stopped
    /// halfway.
    pub segment_budget: Option<usize>,
}

impl Pair {
    pub fn new(sender: Sender, receiver: Receiver) -> Pair {
        let streams = receiver.stream_count() as usize;
        let mut pair = Pair {
            now: Instant::now(),
            sender,
            receiver,
            session: 77,
            conns: vec![None; streams],
            next_conn: 1,
            events: Vec::new(),
            sender_events: Vec::new(),
            written: Vec::new(),
            segment_budget: None,
        };
        pair.receiver.start_session(pair.now, pair.session);
        pair.pump();
        pair
    }

    /// Moves frames and events until nothing moves. Each written frame is delivered at
    /// once and its window credit returned.
    pub fn pump(&mut self) {
        loop {
            let mut moved = false;
            while let Some(event) = self.receiver.poll_event() {
                moved = true;
                match event {
                    ReceiverEvent::Dial { session, stream } => {
                        let conn = self.next_conn;
                        self.next_conn += 1;
                        self.conns[stream as usize] = Some(conn);
                        self.sender.accepted(self.now, conn, None);
                        self.receiver
                            .connected(self.now, session, stream, conn, None);
                    }
                    ReceiverEvent::Close { conn } => {
                        self.sender.closed(conn);
                        for slot in &mut self.conns {
                            if *slot == Some(conn) {
                                *slot = None;
                            }
                        }
                    }
                    other => self.events.push(other),
                }
            }
            while let Some(crate::Transmit {
                conn,
                frame,
                close_after,
            }) = self.receiver.poll_transmit()
            {
                moved = true;
                self.sender.handle_frame(self.now, conn, frame);
                if close_after {
                    self.sender.closed(conn);
                }
            }
            while let Some(event) = self.sender.poll_event() {
                moved = true;
                if let crate::SenderEvent::Close { conn, .. } = &event {
                    self.receiver.closed(*conn);
                }
                self.sender_events.push(event);
            }
            if self.segment_budget == Some(0) {
                if !moved {
                    return;
                }
                continue;
            }
            if let Some(transmit) = self.sender.poll_transmit(self.now) {
                moved = true;
                if matches!(transmit.frame, Frame::Segment { .. })
                    && let Some(budget) = &mut self.segment_budget
                {
                    *budget -= 1;
                }
                self.sender.on_sent(self.now, transmit.conn);
                self.written.push((transmit.conn, transmit.frame.clone()));
                self.receiver
                    .handle_frame(self.now, transmit.conn, transmit.frame);
            }
            if !moved {
                return;
            }
        }
    }

    pub fn complete(&self) -> Vec<(u64, Bytes)> {
        self.events
            .iter()
            .filter_map(|e| match e {
                ReceiverEvent::Complete { version, artifact } => {
                    Some((*version, artifact.to_bytes()))
                }
                _ => None,
            })
            .collect()
    }
}

/// A receiver for version 1 with a welcomed session on `streams` streams (conns 1..).
pub fn connected(streams: u8) -> Receiver {
    welcomed(receiver(streams, 1), None)
}

/// A receiver for version 1 that pins [`trainer_key`], with a welcomed session on one
/// stream (conn 1).
pub fn connected_pinned() -> Receiver {
    welcomed(
        pinned_receiver(1, 1, Some(trainer_key().verifying_key())),
        None,
    )
}

/// [`composed_receiver`] with a welcomed session on one stream (conn 1).
pub fn connected_composed(next_version: u64) -> Receiver {
    welcomed(composed_receiver(1, next_version), None)
}

/// A joining receiver welcomed by a hub that offers the snapshot of `snapshot`.
pub fn connected_joining(streams: u8, snapshot: u64) -> Receiver {
    welcomed(joining_receiver(streams), Some(snapshot))
}

pub fn welcomed(mut r: Receiver, snapshot: Option<u64>) -> Receiver {
    let now = Instant::now();
    let streams = r.stream_count();
    r.start_session(now, 5);
    for stream in 0..streams {
        r.connected(now, 5, stream, u64::from(stream) + 1, None);
        r.handle_frame(now, u64::from(stream) + 1, hub_welcome(snapshot));
    }
    while r.poll_event().is_some() || r.poll_transmit().is_some() {}
    r
}

/// The frames a sender would send for the delta `bytes`: offer, table, segments.
pub fn frames(bytes: &Bytes) -> Vec<Frame> {
    frames_of(bytes, crate::frame::ArtifactKind::Delta)
}

/// The frames a sender would send for `bytes` offered as `kind`, unsigned.
pub fn frames_of(bytes: &Bytes, kind: crate::frame::ArtifactKind) -> Vec<Frame> {
    signed_frames(bytes, kind, None)
}

/// The run of every test's hub, named in its Welcomes and its signatures.
pub const RUN: aurora_delta::RunId = aurora_delta::RunId([0x2a; 16]);

/// The trainer key of signed tests (a fixed seed: the same key in every test).
pub fn trainer_key() -> aurora_delta::SigningKey {
    aurora_delta::SigningKey::from_bytes(&[0x5a; 32])
}

/// `key`'s signature of the artifact `bytes` as `kind`.
pub fn artifact_signature(
    key: &aurora_delta::SigningKey,
    bytes: &Bytes,
    kind: crate::frame::ArtifactKind,
) -> aurora_delta::ArtifactSignature {
    let file = aurora_delta::DeltaFile::parse(bytes).unwrap();
    let statement = aurora_delta::Statement::artifact(kind, file.id, file.header());
    aurora_delta::sign(key, &RUN, &statement)
}

/// The commit of `version` (weights [`weights`]), signed by `key` if given.
pub fn commit(version: u64, key: Option<&aurora_delta::SigningKey>) -> crate::Commit {
    let mut commit = crate::Commit {
        target: VersionRef {
            version,
            hash: weights(version),
        },
        signature: None,
    };
    commit.signature = key.map(|key| aurora_delta::sign(key, &RUN, &commit.statement()));
    commit
}

/// The frames a sender would send for `bytes` offered as `kind`, the Offer and the Seal
/// signed by `key` if given.
pub fn signed_frames(
    bytes: &Bytes,
    kind: crate::frame::ArtifactKind,
    key: Option<&aurora_delta::SigningKey>,
) -> Vec<Frame> {
    let file = aurora_delta::DeltaFile::parse(bytes).unwrap();
    let version = file.header().target_version;
    let mut out = vec![
        Frame::Offer {
            version,
            kind,
            descriptor: Bytes::from(file.header().encode_pending()),
            signature: key.map(|key| crate::offer_signature(key, &RUN, kind, bytes).unwrap()),
        },
        Frame::Seal {
            version,
            id: file.id,
            target_hash: file.header().target_hash,
            segments: file.manifest.segments.clone(),
            signature: key.map(|key| artifact_signature(key, bytes, kind)),
        },
    ];
    for index in 0..file.segment_count() {
        let segment = file.verify_segment(index).unwrap();
        out.push(Frame::Segment {
            version,
            index: index as u32,
            hash: Hash::of(segment),
            bytes: Bytes::copy_from_slice(segment),
        });
    }
    out
}

/// A hub's Welcome, offering `snapshot` to peers that join with no weights.
pub fn hub_welcome(snapshot: Option<u64>) -> Frame {
    Frame::Welcome(Welcome {
        protocol_version: PROTOCOL_VERSION,
        role: Role::Hub,
        peer_id: "hub".into(),
        region: "eu".into(),
        latest: None,
        commit: None,
        snapshot,
        run: RUN,
    })
}

/// A hub's Welcome that names `latest` as the newest version it serves (and no snapshot).
pub fn hub_welcome_at(latest: Option<u64>) -> Frame {
    let Frame::Welcome(welcome) = hub_welcome(None) else {
        unreachable!("a Welcome")
    };
    Frame::Welcome(Welcome { latest, ..welcome })
}

/// A relay's receiver (no weights) on one stream, in session 5 on conn 1, welcomed by a
/// hub whose newest version is `latest`.
pub fn relaying_receiver(latest: Option<u64>) -> Receiver {
    let mut r = Receiver::relaying(ReceiverConfig::new(
        identity(Role::Relay, "relay"),
        TOKEN.to_vec(),
    ));
    let now = Instant::now();
    r.start_session(now, 5);
    r.connected(now, 5, 0, 1, None);
    r.handle_frame(now, 1, hub_welcome_at(latest));
    r
}

/// The Hello of actor `a1` on stream `stream` of a session of `streams`.
pub fn hello(session: u64, stream: u8, streams: u8) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        flags: 0,
        role: Role::Actor,
        peer_id: "a1".into(),
        region: "eu".into(),
        token: TOKEN.to_vec(),
        session,
        stream,
        streams,
        epoch: 1,
        active: VersionRef::default(),
        staged: None,
        snapshot_floor: 0,
    }
}
