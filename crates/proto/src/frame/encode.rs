//! Encoding of frames into their wire bytes, and the writers of shared fields.

use aurora_delta::ArtifactSignature;
use bytes::{BufMut, Bytes};

use super::{
    Commit, Frame, HELLO_MAGIC, PREFIX_BYTES, PROGRESS_COMPOSED, PROGRESS_OFFER, PROGRESS_SEAL,
    RUN_VERSION, VersionRef, WANT_COMPOSED, WANT_SNAPSHOT,
};

impl Frame {
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
