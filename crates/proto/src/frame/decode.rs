//! Decoding of frames from their wire bytes, and the bounds-checked reader it uses.

use std::ops::Range;

use aurora_delta::{ArtifactKind, ArtifactSignature, Hash, MAX_SEGMENT_BYTES, RunId, SegmentEntry};
use bytes::Bytes;

use super::{
    Commit, Frame, FrameError, FrameType, HELLO_MAGIC, Hello, MAX_HAVE_RANGES, MAX_NAME_BYTES,
    MAX_REASON_BYTES, MAX_STREAMS, MAX_TOKEN_BYTES, MAX_TRANSFER_SEGMENTS, MAX_WANT_VERSIONS,
    PREFIX_BYTES, PROGRESS_COMPOSED, PROGRESS_OFFER, PROGRESS_SEAL, Progress, RUN_VERSION,
    RejectCode, Role, VersionRef, WANT_COMPOSED, WANT_SNAPSHOT, Welcome, peek_prefix,
};

impl Frame {
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
