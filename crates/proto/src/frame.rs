//! Frames of the segment protocol, version 5 (docs/wire-protocol.md §3 and §4).
//!
//! ```text
//! frame   length:u32  type:u8  body[length - 1]
//! ```
//! `length` counts the type byte and the body. A decoder checks it against the limit of
//! the frame's type as soon as the five prefix bytes are in, before buffering the body,
//! so a hostile peer cannot make a receiver allocate more than [`MAX_FRAME_BYTES`].
//! Decoding tells an incomplete buffer ([`FrameError::Incomplete`]: read more) from an
//! invalid one (every other variant: close the connection).

use std::ops::Range;

pub use aurora_delta::ArtifactKind;
use aurora_delta::{ArtifactSignature, Hash, MAX_SEGMENT_BYTES, RunId, SegmentEntry, Statement};
use bytes::{BufMut, Bytes};

/// The protocol version this build speaks (docs/wire-protocol.md §2). 2 added the
/// trainer's signatures to Seal, Commit and Welcome; 3 its signature of the descriptor
/// to Offer; 4 moved the target's weights hash from the Offer's descriptor (pending
/// there) to the Seal; 5 added the run to every signed statement and to the Welcome, and
/// a joiner's snapshot floor to the Hello. A Hello or Welcome of an older version still
/// decodes (without the fields it lacks), so its peer is refused with a clear reason.
pub const PROTOCOL_VERSION: u16 = 5;
/// The first version whose Hello carries a snapshot floor and whose Welcome a run.
const RUN_VERSION: u16 = 5;
/// First bytes of every Hello body: a peer that is not an aurora transport is refused
/// with a clear error instead of a confusing parse failure.
pub const HELLO_MAGIC: [u8; 8] = *b"AURORA\x00\x01";
/// Bytes before a frame's body: the length and the type.
pub const PREFIX_BYTES: usize = 5;

/// Largest frame of any type: a Segment frame with a segment of the delta format's
/// maximum size, plus its fixed fields.
pub const MAX_FRAME_BYTES: usize = MAX_SEGMENT_BYTES as usize + 64;
/// Largest Hello, Welcome, Reject, Nack, Unavailable, Commit, Status, Keepalive or
/// Goodbye frame.
pub const MAX_CONTROL_FRAME_BYTES: usize = 16 << 10;
/// Largest Want frame: the largest a receiver builds, [`MAX_STREAMS`] epochs and
/// [`MAX_WANT_VERSIONS`] versions of [`MAX_HAVE_RANGES`] ranges (type byte, sequence
/// number, next version, flags, live streams, epochs, versions; each version's number,
/// flags, range count and ranges). It is the largest frame a downstream ever sends.
pub const MAX_WANT_FRAME_BYTES: usize = 1
    + 8
    + 8
    + 1
    + 8
    + 1
    + 4 * MAX_STREAMS as usize
    + 1
    + MAX_WANT_VERSIONS * (8 + 1 + 4 + 8 * MAX_HAVE_RANGES);
/// Peer ids and regions are short names.
pub const MAX_NAME_BYTES: usize = 64;
/// Authentication tokens (shared secrets for now).
pub const MAX_TOKEN_BYTES: usize = 128;
/// Free-text reasons in Reject, Unavailable, Status and Goodbye.
pub const MAX_REASON_BYTES: usize = 1024;
/// Streams one session may open (the stream mask of a Want is a u64).
pub const MAX_STREAMS: u8 = 64;
/// The largest frame a downstream sends, so the most a hub or relay reads of one frame
/// from a subscriber, authenticated or not: a Want at its largest.
pub const MAX_DOWNSTREAM_FRAME_BYTES: usize = MAX_WANT_FRAME_BYTES;
/// Versions a Want may report progress for.
pub const MAX_WANT_VERSIONS: usize = 16;
/// Ranges in one version's have-set; a receiver with a more fragmented set reports a
/// subset, which costs duplicates but never loses a segment.
pub const MAX_HAVE_RANGES: usize = 4096;
/// Bit 0 of a Want's flags: its next version is wanted as a snapshot.
const WANT_SNAPSHOT: u8 = 1;
/// Bit 1 of a Want's flags: the downstream accepts a composed delta for catch-up.
const WANT_COMPOSED: u8 = 2;
/// Progress flags: holds the Offer, holds a verified Seal, the artifact is a composed
/// delta.
const PROGRESS_OFFER: u8 = 1;
const PROGRESS_SEAL: u8 = 2;
const PROGRESS_COMPOSED: u8 = 4;
/// Segments of one artifact on the wire: its Seal frame must fit [`MAX_FRAME_BYTES`].
/// The delta format allows more (2^22); a writer at the default 256 KiB segments needs
/// 256 GiB of payload to reach this.
pub const MAX_TRANSFER_SEGMENTS: u32 = 1 << 20;

/// Frame type codes. Codes never change meaning; retired codes are never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameType {
    Hello = 0x01,
    Welcome = 0x02,
    Reject = 0x03,
    Want = 0x04,
    Offer = 0x05,
    Segment = 0x06,
    Seal = 0x07,
    Nack = 0x08,
    Unavailable = 0x09,
    Commit = 0x0A,
    Status = 0x0B,
    Keepalive = 0x0C,
    Goodbye = 0x0D,
}

impl FrameType {
    pub fn from_code(code: u8) -> Option<FrameType> {
        use FrameType::*;
        Some(match code {
            0x01 => Hello,
            0x02 => Welcome,
            0x03 => Reject,
            0x04 => Want,
            0x05 => Offer,
            0x06 => Segment,
            0x07 => Seal,
            0x08 => Nack,
            0x09 => Unavailable,
            0x0A => Commit,
            0x0B => Status,
            0x0C => Keepalive,
            0x0D => Goodbye,
            _ => return None,
        })
    }

    /// The largest `length` (type byte plus body) a frame of this type may declare.
    pub fn max_len(self) -> usize {
        match self {
            FrameType::Offer | FrameType::Segment | FrameType::Seal => MAX_FRAME_BYTES,
            FrameType::Want => MAX_WANT_FRAME_BYTES,
            _ => MAX_CONTROL_FRAME_BYTES,
        }
    }

    /// Whether the end of a connection that is `from` ever sends frames of this type
    /// (docs/wire-protocol.md §3.1): a downstream never sends an Offer, a Segment or a
    /// Seal, an upstream never a Hello or a Want.
    pub fn sent_by(self, from: Side) -> bool {
        use FrameType::*;
        match from {
            Side::Downstream => matches!(self, Hello | Want | Nack | Status | Keepalive | Goodbye),
            Side::Upstream => matches!(
                self,
                Welcome
                    | Reject
                    | Offer
                    | Segment
                    | Seal
                    | Unavailable
                    | Commit
                    | Keepalive
                    | Goodbye
            ),
        }
    }

    /// Whether frames of this type open a connection (and only open it): a Hello from a
    /// downstream, a Welcome or a Reject from an upstream.
    fn opens_connection(self, from: Side) -> bool {
        match from {
            Side::Downstream => self == FrameType::Hello,
            Side::Upstream => matches!(self, FrameType::Welcome | FrameType::Reject),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FrameType::Hello => "Hello",
            FrameType::Welcome => "Welcome",
            FrameType::Reject => "Reject",
            FrameType::Want => "Want",
            FrameType::Offer => "Offer",
            FrameType::Segment => "Segment",
            FrameType::Seal => "Seal",
            FrameType::Nack => "Nack",
            FrameType::Unavailable => "Unavailable",
            FrameType::Commit => "Commit",
            FrameType::Status => "Status",
            FrameType::Keepalive => "Keepalive",
            FrameType::Goodbye => "Goodbye",
        }
    }
}

/// Which end of a connection sends a frame: the downstream dialed it (a relay or an
/// actor), the upstream accepted it (a hub or a relay).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Downstream,
    Upstream,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Downstream => "a downstream",
            Side::Upstream => "an upstream",
        })
    }
}

/// What a peer is in the dissemination tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Role {
    Hub = 1,
    Relay = 2,
    Actor = 3,
}

impl Role {
    fn from_code(code: u8) -> Option<Role> {
        match code {
            1 => Some(Role::Hub),
            2 => Some(Role::Relay),
            3 => Some(Role::Actor),
            _ => None,
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Hub => "hub",
            Role::Relay => "relay",
            Role::Actor => "actor",
        })
    }
}

/// A version and the weights hash that goes with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VersionRef {
    pub version: u64,
    pub hash: Hash,
}

/// Why an upstream refuses a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum RejectCode {
    /// The Hello's protocol version is not one this peer speaks.
    Version = 1,
    /// Unknown peer or wrong token.
    Auth = 2,
    /// The Hello is well-formed but makes no sense here (wrong role, stream index out
    /// of range, a session already at its stream limit, unknown flags).
    Refused = 3,
    /// The upstream is at its subscriber limit.
    Busy = 4,
}

impl RejectCode {
    fn from_code(code: u16) -> Option<RejectCode> {
        match code {
            1 => Some(RejectCode::Version),
            2 => Some(RejectCode::Auth),
            3 => Some(RejectCode::Refused),
            4 => Some(RejectCode::Busy),
            _ => None,
        }
    }
}

/// The first frame on every connection, from the connecting (downstream) side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub protocol_version: u16,
    /// Reserved for mutual TLS; peers send 0 and refuse anything else (signatures
    /// travel in Seal, Commit and Welcome, each with a flag of its own).
    pub flags: u16,
    pub role: Role,
    pub peer_id: String,
    pub region: String,
    pub token: Vec<u8>,
    /// Names the session this connection belongs to; the S connections of one session
    /// share it.
    pub session: u64,
    /// Index of this connection within the session, below `streams`.
    pub stream: u8,
    /// Connections the session opens at most.
    pub streams: u8,
    /// How many times this stream has been connected in this session, this time
    /// included (1 for the first). Lets the upstream order this connection against the
    /// Wants that describe the session's streams (docs/wire-protocol.md §5.5).
    pub epoch: u32,
    pub active: VersionRef,
    pub staged: Option<u64>,
    /// A downstream with no weights takes no snapshot older than this (what the control
    /// plane told it the trainer's joinable snapshot is; docs/wire-protocol.md §6.6); 0
    /// for any, and for a downstream with weights. An upstream whose snapshot is older
    /// offers none, so the joiner goes on to its next upstream at once.
    pub snapshot_floor: u64,
}

/// The upstream's answer to an accepted Hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    pub protocol_version: u16,
    pub role: Role,
    pub peer_id: String,
    pub region: String,
    /// The newest version the upstream can serve, if any.
    pub latest: Option<u64>,
    /// The newest version committed so far, if any, with its signature.
    pub commit: Option<Commit>,
    /// The newest version a downstream holding no weights can join from, as a snapshot
    /// (docs/wire-protocol.md §5.10); None where the upstream cannot serve one (a relay).
    pub snapshot: Option<u64>,
    /// The run the upstream serves (every signed statement names it); all zero where a
    /// relay has not learned it yet.
    pub run: RunId,
}

/// What a receiver holds of one version it is receiving.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Progress {
    pub version: u64,
    pub has_offer: bool,
    pub has_seal: bool,
    /// What it holds is of a composed delta to this version, not of D(version): the two
    /// are different artifacts, and a sender resumes only the kind it serves.
    pub composed: bool,
    /// Indices of the verified segments it holds: sorted, disjoint, non-empty and
    /// non-adjacent half-open ranges.
    pub have: Vec<Range<u32>>,
}

/// A Commit: activate `target`, with the trainer's signature over it
/// ([`Statement::Commit`]) where the deployment signs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    pub target: VersionRef,
    pub signature: Option<ArtifactSignature>,
}

impl Commit {
    /// What the signature vouches for.
    pub fn statement(&self) -> Statement {
        Statement::Commit {
            version: self.target.version,
            weights_hash: self.target.hash,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Hello(Hello),
    Welcome(Welcome),
    Reject {
        code: RejectCode,
        reason: String,
    },
    /// Downstream to upstream: send every version from `next_version` on; here is what
    /// I already hold, and which of my streams are up.
    Want {
        /// Increases with every Want of a session: Wants travel on different streams
        /// and may overtake each other; only the latest counts.
        seq: u64,
        next_version: u64,
        /// `next_version` is wanted as a snapshot: the downstream holds no weights
        /// (flags bit 0).
        snapshot: bool,
        /// The downstream accepts a composed delta from `next_version - 1` to a later
        /// version in place of the deltas in between (flags bit 1; never with
        /// `snapshot`).
        composed: bool,
        live_streams: u64,
        /// The epoch of every stream of the session as the receiver knows it, by index.
        epochs: Vec<u32>,
        progress: Vec<Progress>,
    },
    Offer {
        version: u64,
        kind: ArtifactKind,
        descriptor: Bytes,
        /// The trainer's signature over the descriptor ([`Statement::offer`]), checked
        /// before anything is allocated from it; None in an unsigned deployment.
        signature: Option<ArtifactSignature>,
    },
    Segment {
        version: u64,
        index: u32,
        hash: Hash,
        bytes: Bytes,
    },
    Seal {
        version: u64,
        id: Hash,
        /// The target's weights hash, pending in the Offer's descriptor: the id is that
        /// of the descriptor with it filled in.
        target_hash: Hash,
        segments: Vec<SegmentEntry>,
        /// The trainer's signature over the artifact's statement
        /// ([`Statement::artifact`]); None in an unsigned deployment.
        signature: Option<ArtifactSignature>,
    },
    Nack {
        version: u64,
        index: u32,
    },
    Unavailable {
        version: u64,
        reason: String,
    },
    Commit(Commit),
    Status {
        active: VersionRef,
        staged: Option<u64>,
        note: String,
    },
    Keepalive,
    Goodbye {
        reason: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame incomplete: {needed} more bytes needed")]
    Incomplete { needed: usize },
    #[error("unknown frame type {0:#04x}")]
    UnknownType(u8),
    #[error("{frame} frame declares {len} bytes, over its limit of {limit}")]
    TooLarge {
        frame: &'static str,
        len: usize,
        limit: usize,
    },
    #[error("{frame} frame: {field} of {value} exceeds its limit of {limit}")]
    LimitExceeded {
        frame: &'static str,
        field: &'static str,
        value: u64,
        limit: u64,
    },
    #[error("{frame} frame is malformed: {reason}")]
    Malformed { frame: &'static str, reason: String },
    /// A frame of a type its sender's end never sends (docs/wire-protocol.md §3.1).
    #[error("{from} never sends {frame} frames")]
    WrongSide { frame: &'static str, from: Side },
    /// A frame out of its place: the first of a connection must open it, and frames
    /// that open one come first only.
    #[error("{}", if *first {
        format!("{from} opens a connection with {frame}, which opens none")
    } else {
        format!("{from} sent {frame} after its connection was open")
    })]
    OutOfPlace {
        frame: &'static str,
        from: Side,
        first: bool,
    },
}

impl FrameError {
    pub fn is_incomplete(&self) -> bool {
        matches!(self, FrameError::Incomplete { .. })
    }
}

/// Checks a frame's prefix and returns its type and total size (prefix included), so
/// a reader can refuse an oversized frame before reading its body.
pub fn peek_prefix(prefix: &[u8]) -> Result<(FrameType, usize), FrameError> {
    if prefix.len() < PREFIX_BYTES {
        return Err(FrameError::Incomplete {
            needed: PREFIX_BYTES - prefix.len(),
        });
    }
    let len = u32::from_le_bytes(prefix[..4].try_into().expect("4 bytes")) as usize;
    let kind = FrameType::from_code(prefix[4]).ok_or(FrameError::UnknownType(prefix[4]))?;
    if len == 0 || len > kind.max_len() {
        return Err(FrameError::TooLarge {
            frame: kind.name(),
            len,
            limit: kind.max_len(),
        });
    }
    Ok((kind, 4 + len))
}

/// [`peek_prefix`] as the reader of a connection whose other end is `from`, for its
/// first frame or a later one: the type must be one that end sends, in its place (a
/// connection opens with a Hello or a Welcome/Reject, and with nothing else), and a
/// downstream's frame no larger than [`MAX_DOWNSTREAM_FRAME_BYTES`]. A reader refuses
/// a frame at its prefix, before it reads or holds the body.
pub fn peek_prefix_from(
    prefix: &[u8],
    from: Side,
    first: bool,
) -> Result<(FrameType, usize), FrameError> {
    // The type is judged before the size: a frame of a kind this end never sends is
    // that, whatever it declares.
    if let Some(kind) = prefix.get(4).and_then(|&code| FrameType::from_code(code)) {
        check_side(kind, from, first)?;
    }
    peek_prefix(prefix)
}

fn check_side(kind: FrameType, from: Side, first: bool) -> Result<(), FrameError> {
    if !kind.sent_by(from) {
        return Err(FrameError::WrongSide {
            frame: kind.name(),
            from,
        });
    }
    if kind.opens_connection(from) != first {
        return Err(FrameError::OutOfPlace {
            frame: kind.name(),
            from,
            first,
        });
    }
    Ok(())
}

impl Frame {
    pub fn frame_type(&self) -> FrameType {
        match self {
            Frame::Hello(_) => FrameType::Hello,
            Frame::Welcome(_) => FrameType::Welcome,
            Frame::Reject { .. } => FrameType::Reject,
            Frame::Want { .. } => FrameType::Want,
            Frame::Offer { .. } => FrameType::Offer,
            Frame::Segment { .. } => FrameType::Segment,
            Frame::Seal { .. } => FrameType::Seal,
            Frame::Nack { .. } => FrameType::Nack,
            Frame::Unavailable { .. } => FrameType::Unavailable,
            Frame::Commit(_) => FrameType::Commit,
            Frame::Status { .. } => FrameType::Status,
            Frame::Keepalive => FrameType::Keepalive,
            Frame::Goodbye { .. } => FrameType::Goodbye,
        }
    }

    /// Appends the frame's bytes to `out`. Encoding is infallible for frames built by
    /// this crate's state machines; [`Frame::validate`] states what a frame must satisfy.
    pub fn encode(&self, out: &mut Vec<u8>) {
        self.encode_inner(out, true);
    }

    /// Like [`Frame::encode`], but leaves out a Segment's payload and returns it, so a
    /// writer sends it from its own buffer instead of copying it (the length prefix
    /// counts it).
    pub fn encode_split(&self, out: &mut Vec<u8>) -> Option<&Bytes> {
        match self {
            Frame::Segment { bytes, .. } => {
                self.encode_inner(out, false);
                Some(bytes)
            }
            other => {
                other.encode_inner(out, true);
                None
            }
        }
    }

    fn encode_inner(&self, out: &mut Vec<u8>, with_payload: bool) {
        let start = out.len();
        let mut left_out = 0;
        out.put_u32_le(0);
        out.put_u8(self.frame_type() as u8);
        match self {
            Frame::Hello(h) => {
                out.put_slice(&HELLO_MAGIC);
                out.put_u16_le(h.protocol_version);
                out.put_u16_le(h.flags);
                out.put_u8(h.role as u8);
                put_str8(out, &h.peer_id);
                put_str8(out, &h.region);
                out.put_u8(h.token.len() as u8);
                out.put_slice(&h.token);
                out.put_u64_le(h.session);
                out.put_u8(h.stream);
                out.put_u8(h.streams);
                out.put_u32_le(h.epoch);
                put_version_ref(out, &h.active);
                put_option_u64(out, h.staged);
                if h.protocol_version >= RUN_VERSION {
                    out.put_u64_le(h.snapshot_floor);
                }
            }
            Frame::Welcome(w) => {
                out.put_u16_le(w.protocol_version);
                out.put_u8(w.role as u8);
                put_str8(out, &w.peer_id);
                put_str8(out, &w.region);
                put_option_u64(out, w.latest);
                match &w.commit {
                    None => out.put_u8(0),
                    Some(commit) => {
                        out.put_u8(1);
                        put_commit(out, commit);
                    }
                }
                put_option_u64(out, w.snapshot);
                if w.protocol_version >= RUN_VERSION {
                    out.put_slice(&w.run.0);
                }
            }
            Frame::Reject { code, reason } => {
                out.put_u16_le(*code as u16);
                put_text16(out, reason);
            }
            Frame::Want {
                seq,
                next_version,
                snapshot,
                composed,
                live_streams,
                epochs,
                progress,
            } => {
                out.put_u64_le(*seq);
                out.put_u64_le(*next_version);
                out.put_u8(
                    if *snapshot { WANT_SNAPSHOT } else { 0 }
                        | if *composed { WANT_COMPOSED } else { 0 },
                );
                out.put_u64_le(*live_streams);
                out.put_u8(epochs.len() as u8);
                for epoch in epochs {
                    out.put_u32_le(*epoch);
                }
                out.put_u8(progress.len() as u8);
                for p in progress {
                    out.put_u64_le(p.version);
                    out.put_u8(
                        if p.has_offer { PROGRESS_OFFER } else { 0 }
                            | if p.has_seal { PROGRESS_SEAL } else { 0 }
                            | if p.composed { PROGRESS_COMPOSED } else { 0 },
                    );
                    out.put_u32_le(p.have.len() as u32);
                    for range in &p.have {
                        out.put_u32_le(range.start);
                        out.put_u32_le(range.end);
                    }
                }
            }
            Frame::Offer {
                version,
                kind,
                descriptor,
                signature,
            } => {
                out.put_u64_le(*version);
                out.put_u8(*kind as u8);
                out.put_u32_le(descriptor.len() as u32);
                out.put_slice(descriptor);
                put_option_signature(out, signature.as_ref());
            }
            Frame::Segment {
                version,
                index,
                hash,
                bytes,
            } => {
                out.put_u64_le(*version);
                out.put_u32_le(*index);
                out.put_slice(&hash.0);
                out.put_u32_le(bytes.len() as u32);
                if with_payload {
                    out.put_slice(bytes);
                } else {
                    left_out = bytes.len();
                }
            }
            Frame::Seal {
                version,
                id,
                target_hash,
                segments,
                signature,
            } => {
                out.put_u64_le(*version);
                out.put_slice(&id.0);
                out.put_slice(&target_hash.0);
                out.put_u32_le(segments.len() as u32);
                for segment in segments {
                    out.put_u32_le(segment.len);
                    out.put_slice(&segment.hash.0);
                }
                put_option_signature(out, signature.as_ref());
            }
            Frame::Nack { version, index } => {
                out.put_u64_le(*version);
                out.put_u32_le(*index);
            }
            Frame::Unavailable { version, reason } => {
                out.put_u64_le(*version);
                put_text16(out, reason);
            }
            Frame::Commit(commit) => put_commit(out, commit),
            Frame::Status {
                active,
                staged,
                note,
            } => {
                put_version_ref(out, active);
                put_option_u64(out, *staged);
                put_text16(out, note);
            }
            Frame::Keepalive => {}
            Frame::Goodbye { reason } => put_text16(out, reason),
        }
        let len = (out.len() - start - 4 + left_out) as u32;
        out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    /// Bytes [`Frame::encode`] writes, without encoding (segment frames are large).
    pub fn encoded_len(&self) -> usize {
        PREFIX_BYTES
            + match self {
                Frame::Segment { bytes, .. } => 8 + 4 + 32 + 4 + bytes.len(),
                Frame::Offer {
                    descriptor,
                    signature,
                    ..
                } => 8 + 1 + 4 + descriptor.len() + option_signature_len(signature),
                Frame::Seal {
                    segments,
                    signature,
                    ..
                } => 8 + 32 + 32 + 4 + 36 * segments.len() + option_signature_len(signature),
                other => other.to_bytes().len() - PREFIX_BYTES,
            }
    }

    /// Decodes the frame at the start of `buf` and returns it with the bytes it took.
    /// Large payloads (segments, descriptors) are zero-copy slices of `buf`.
    pub fn decode(buf: &Bytes) -> Result<(Frame, usize), FrameError> {
        let (kind, total) = peek_prefix(buf)?;
        if buf.len() < total {
            return Err(FrameError::Incomplete {
                needed: total - buf.len(),
            });
        }
        let mut reader = Reader {
            frame: kind.name(),
            buf: buf.slice(PREFIX_BYTES..total),
            pos: 0,
        };
        let frame = decode_body(kind, &mut reader)?;
        if reader.pos != reader.buf.len() {
            return Err(reader.malformed(format!(
                "{} bytes left after the last field",
                reader.buf.len() - reader.pos
            )));
        }
        Ok((frame, total))
    }

    /// Checks what the decoder checks, so a state machine never sends a frame its peer
    /// must refuse (a bug of ours becomes an error here, not a dropped connection there).
    pub fn validate(&self) -> Result<(), FrameError> {
        let bytes = Bytes::from(self.to_bytes());
        Frame::decode(&bytes).map(|_| ())
    }
}

fn decode_body(kind: FrameType, r: &mut Reader) -> Result<Frame, FrameError> {
    Ok(match kind {
        FrameType::Hello => {
            if r.array::<8>("magic")? != HELLO_MAGIC {
                return Err(r.malformed("bad magic: the peer is not an aurora transport".into()));
            }
            let protocol_version = r.u16("protocol version")?;
            let flags = r.u16("flags")?;
            let role = r.role()?;
            let peer_id = r.name("peer id")?;
            let region = r.name("region")?;
            let token_len = r.u8("token length")? as usize;
            r.limit("token length", token_len as u64, MAX_TOKEN_BYTES as u64)?;
            let token = r.take(token_len, "token")?.to_vec();
            let session = r.u64("session")?;
            let stream = r.u8("stream")?;
            let streams = r.u8("streams")?;
            r.limit("streams", u64::from(streams), u64::from(MAX_STREAMS))?;
            if streams == 0 || stream >= streams {
                return Err(r.malformed(format!(
                    "stream {stream} is not below the stream count {streams}"
                )));
            }
            let epoch = r.u32("epoch")?;
            let active = r.version_ref()?;
            let staged = r.option_u64("staged version")?;
            let snapshot_floor = if protocol_version >= RUN_VERSION {
                r.u64("snapshot floor")?
            } else {
                0
            };
            Frame::Hello(Hello {
                protocol_version,
                flags,
                role,
                peer_id,
                region,
                token,
                session,
                stream,
                streams,
                epoch,
                active,
                staged,
                snapshot_floor,
            })
        }
        FrameType::Welcome => {
            let protocol_version = r.u16("protocol version")?;
            let role = r.role()?;
            let peer_id = r.name("peer id")?;
            let region = r.name("region")?;
            let latest = r.option_u64("latest version")?;
            let commit = match r.u8("commit flag")? {
                0 => None,
                1 => Some(r.commit()?),
                other => return Err(r.malformed(format!("commit flag {other} is not 0 or 1"))),
            };
            let snapshot = r.option_u64("snapshot version")?;
            let run = if protocol_version >= RUN_VERSION {
                RunId(r.array("run")?)
            } else {
                RunId::UNKNOWN
            };
            Frame::Welcome(Welcome {
                protocol_version,
                role,
                peer_id,
                region,
                latest,
                commit,
                snapshot,
                run,
            })
        }
        FrameType::Reject => {
            let code = r.u16("reject code")?;
            let code = RejectCode::from_code(code)
                .ok_or_else(|| r.malformed(format!("unknown reject code {code}")))?;
            Frame::Reject {
                code,
                reason: r.text16("reason")?,
            }
        }
        FrameType::Want => {
            let seq = r.u64("sequence number")?;
            let next_version = r.u64("next version")?;
            let flags = r.u8("want flags")?;
            if flags & !(WANT_SNAPSHOT | WANT_COMPOSED) != 0 {
                return Err(r.malformed(format!("unknown want flags {flags:#x}")));
            }
            if flags == WANT_SNAPSHOT | WANT_COMPOSED {
                return Err(r.malformed(
                    "a Want cannot ask for a snapshot and composed catch-up at once".into(),
                ));
            }
            let live_streams = r.u64("live streams")?;
            let epoch_count = r.u8("epoch count")?;
            r.limit(
                "epoch count",
                u64::from(epoch_count),
                u64::from(MAX_STREAMS),
            )?;
            let epochs = (0..epoch_count)
                .map(|_| r.u32("epoch"))
                .collect::<Result<Vec<_>, _>>()?;
            let count = r.u8("version count")? as usize;
            r.limit("version count", count as u64, MAX_WANT_VERSIONS as u64)?;
            let mut progress: Vec<Progress> = Vec::with_capacity(count);
            for _ in 0..count {
                let version = r.u64("version")?;
                if version < next_version || progress.last().is_some_and(|p| p.version >= version) {
                    return Err(r.malformed(format!(
                        "progress for version {version} is out of order or below the next version {next_version}"
                    )));
                }
                let flags = r.u8("progress flags")?;
                if flags & !(PROGRESS_OFFER | PROGRESS_SEAL | PROGRESS_COMPOSED) != 0 {
                    return Err(r.malformed(format!("unknown progress flags {flags:#x}")));
                }
                let ranges = r.u32("range count")? as usize;
                r.limit("range count", ranges as u64, MAX_HAVE_RANGES as u64)?;
                let mut have: Vec<Range<u32>> = Vec::with_capacity(ranges);
                for _ in 0..ranges {
                    let start = r.u32("range start")?;
                    let end = r.u32("range end")?;
                    let after_previous = have.last().is_none_or(|p| start > p.end);
                    if start >= end || !after_previous || end > MAX_TRANSFER_SEGMENTS {
                        return Err(r.malformed(format!(
                            "have-range {start}..{end} of version {version} is empty, out of order, adjacent to the previous one or beyond {MAX_TRANSFER_SEGMENTS} segments"
                        )));
                    }
                    have.push(start..end);
                }
                progress.push(Progress {
                    version,
                    has_offer: flags & PROGRESS_OFFER != 0,
                    has_seal: flags & PROGRESS_SEAL != 0,
                    composed: flags & PROGRESS_COMPOSED != 0,
                    have,
                });
            }
            Frame::Want {
                seq,
                next_version,
                snapshot: flags & WANT_SNAPSHOT != 0,
                composed: flags & WANT_COMPOSED != 0,
                live_streams,
                epochs,
                progress,
            }
        }
        FrameType::Offer => {
            let version = r.u64("version")?;
            let code = r.u8("artifact kind")?;
            let kind = ArtifactKind::from_code(code)
                .ok_or_else(|| r.malformed(format!("unknown artifact kind {code}")))?;
            let len = r.u32("descriptor length")? as usize;
            Frame::Offer {
                version,
                kind,
                descriptor: r.bytes(len, "descriptor")?,
                signature: r.option_signature()?,
            }
        }
        FrameType::Segment => {
            let version = r.u64("version")?;
            let index = r.u32("segment index")?;
            r.limit(
                "segment index",
                u64::from(index),
                u64::from(MAX_TRANSFER_SEGMENTS - 1),
            )?;
            let hash = Hash(r.array("segment hash")?);
            let len = r.u32("segment length")?;
            r.limit(
                "segment length",
                u64::from(len),
                u64::from(MAX_SEGMENT_BYTES),
            )?;
            Frame::Segment {
                version,
                index,
                hash,
                bytes: r.bytes(len as usize, "segment bytes")?,
            }
        }
        FrameType::Seal => {
            let version = r.u64("version")?;
            let id = Hash(r.array("artifact id")?);
            let target_hash = Hash(r.array("target hash")?);
            let count = r.u32("segment count")?;
            r.limit(
                "segment count",
                u64::from(count),
                u64::from(MAX_TRANSFER_SEGMENTS),
            )?;
            // The count is bounded and the bytes must be there: check before allocating.
            r.need(count as usize * 36, "segment table")?;
            let mut segments = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let len = r.u32("segment length")?;
                r.limit(
                    "segment length",
                    u64::from(len),
                    u64::from(MAX_SEGMENT_BYTES),
                )?;
                segments.push(SegmentEntry {
                    len,
                    hash: Hash(r.array("segment hash")?),
                });
            }
            Frame::Seal {
                version,
                id,
                target_hash,
                segments,
                signature: r.option_signature()?,
            }
        }
        FrameType::Nack => Frame::Nack {
            version: r.u64("version")?,
            index: r.u32("segment index")?,
        },
        FrameType::Unavailable => Frame::Unavailable {
            version: r.u64("version")?,
            reason: r.text16("reason")?,
        },
        FrameType::Commit => Frame::Commit(r.commit()?),
        FrameType::Status => Frame::Status {
            active: r.version_ref()?,
            staged: r.option_u64("staged version")?,
            note: r.text16("note")?,
        },
        FrameType::Keepalive => Frame::Keepalive,
        FrameType::Goodbye => Frame::Goodbye {
            reason: r.text16("reason")?,
        },
    })
}

fn put_str8(out: &mut Vec<u8>, text: &str) {
    out.put_u8(text.len() as u8);
    out.put_slice(text.as_bytes());
}

fn put_text16(out: &mut Vec<u8>, text: &str) {
    out.put_u16_le(text.len() as u16);
    out.put_slice(text.as_bytes());
}

fn put_version_ref(out: &mut Vec<u8>, v: &VersionRef) {
    out.put_u64_le(v.version);
    out.put_slice(&v.hash.0);
}

fn put_commit(out: &mut Vec<u8>, commit: &Commit) {
    put_version_ref(out, &commit.target);
    put_option_signature(out, commit.signature.as_ref());
}

/// Bytes [`put_option_signature`] writes.
fn option_signature_len(signature: &Option<ArtifactSignature>) -> usize {
    1 + signature.map_or(0, |_| 64)
}

/// A flag (0 or 1), then the 64 bytes of the signature when 1.
fn put_option_signature(out: &mut Vec<u8>, signature: Option<&ArtifactSignature>) {
    match signature {
        None => out.put_u8(0),
        Some(signature) => {
            out.put_u8(1);
            out.put_slice(&signature.0);
        }
    }
}

fn put_option_u64(out: &mut Vec<u8>, value: Option<u64>) {
    match value {
        None => out.put_u8(0),
        Some(v) => {
            out.put_u8(1);
            out.put_u64_le(v);
        }
    }
}

/// Bounds-checked reads from one frame's body. Running out of bytes inside a frame
/// whose length is known is malformed, not incomplete.
struct Reader {
    frame: &'static str,
    buf: Bytes,
    pos: usize,
}

impl Reader {
    fn malformed(&self, reason: String) -> FrameError {
        FrameError::Malformed {
            frame: self.frame,
            reason,
        }
    }

    fn need(&self, n: usize, what: &str) -> Result<(), FrameError> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(self.malformed(format!("{what} needs {n} bytes but {left} remain")));
        }
        Ok(())
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], FrameError> {
        self.need(n, what)?;
        self.pos += n;
        Ok(&self.buf[self.pos - n..self.pos])
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<Bytes, FrameError> {
        self.need(n, what)?;
        self.pos += n;
        Ok(self.buf.slice(self.pos - n..self.pos))
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], FrameError> {
        Ok(self.take(N, what)?.try_into().expect("N bytes"))
    }

    fn u8(&mut self, what: &str) -> Result<u8, FrameError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    fn u32(&mut self, what: &str) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn limit(&self, field: &'static str, value: u64, limit: u64) -> Result<(), FrameError> {
        if value > limit {
            return Err(FrameError::LimitExceeded {
                frame: self.frame,
                field,
                value,
                limit,
            });
        }
        Ok(())
    }

    fn utf8(&mut self, len: usize, what: &str) -> Result<String, FrameError> {
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(text) => Ok(text.to_string()),
            Err(_) => Err(self.malformed(format!("{what} is not UTF-8"))),
        }
    }

    fn name(&mut self, what: &'static str) -> Result<String, FrameError> {
        let len = self.u8(what)? as usize;
        self.limit(what, len as u64, MAX_NAME_BYTES as u64)?;
        self.utf8(len, what)
    }

    fn text16(&mut self, what: &'static str) -> Result<String, FrameError> {
        let len = self.u16(what)? as usize;
        self.limit(what, len as u64, MAX_REASON_BYTES as u64)?;
        self.utf8(len, what)
    }

    fn role(&mut self) -> Result<Role, FrameError> {
        let code = self.u8("role")?;
        Role::from_code(code).ok_or_else(|| self.malformed(format!("unknown role {code}")))
    }

    fn version_ref(&mut self) -> Result<VersionRef, FrameError> {
        Ok(VersionRef {
            version: self.u64("version")?,
            hash: Hash(self.array("weights hash")?),
        })
    }

    fn commit(&mut self) -> Result<Commit, FrameError> {
        Ok(Commit {
            target: self.version_ref()?,
            signature: self.option_signature()?,
        })
    }

    fn option_signature(&mut self) -> Result<Option<ArtifactSignature>, FrameError> {
        match self.u8("signature flag")? {
            0 => Ok(None),
            1 => Ok(Some(ArtifactSignature(self.array("signature")?))),
            other => Err(self.malformed(format!("signature flag {other} is not 0 or 1"))),
        }
    }

    fn option_u64(&mut self, what: &str) -> Result<Option<u64>, FrameError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => Ok(Some(self.u64(what)?)),
            other => Err(self.malformed(format!("{what} flag {other} is not 0 or 1"))),
        }
    }
}

#[cfg(test)]
mod tests;
