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
use bytes::Bytes;

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
}

mod decode;
mod encode;

#[cfg(test)]
mod limit_tests;
#[cfg(test)]
mod tests;
