//! The delta artifact's byte layout, version 1 (docs/delta-format.md §4).
//!
//! ```text
//! preamble  magic[8] format_version:u16 flags:u16 header_len:u32
//! header    versions, weights hashes, encoding, tensor table          (header_len bytes)
//! segments  segment 0 .. segment n-1                                   (lengths in the table)
//! table     segment_count:u32 { length:u32 hash[32] } * n
//! trailer   table_len:u32 reserved:u32 manifest_hash[32] end_magic[8]
//! ```
//! The manifest is preamble + header + table; its BLAKE3 hash is the artifact id. The
//! table follows the segments so a writer can stream segments as extraction produces
//! them and seal the artifact at the end.

use crate::bits::ByteReader;
use crate::checkpoint::{Hash, TensorLayout, checked_byte_len};
use crate::codec::Encoding;
use crate::dtype::Dtype;
use crate::error::{DeltaError, Result};

pub const MAGIC: [u8; 8] = *b"\x89ADELTA\x1a";
pub const END_MAGIC: [u8; 8] = *b"ADLTEND\n";
pub const FORMAT_VERSION: u16 = 1;
pub const PREAMBLE_BYTES: usize = 16;
/// Where the target's weights hash lies in the encoded preamble and header (§4, §4.1):
/// after the preamble, the two versions and the base hash.
const TARGET_HASH_AT: usize = PREAMBLE_BYTES + 8 + 8 + 32;
pub const TRAILER_BYTES: usize = 4 + 4 + 32 + 8;

/// Limits a reader enforces before allocating or looping on a declared count.
pub const MAX_HEADER_BYTES: u32 = 64 << 20;
pub const MAX_TENSORS: u32 = 1 << 20;
pub const MAX_NAME_BYTES: usize = 1024;
pub const MAX_DIMS: usize = 8;
pub const MAX_SEGMENTS: u32 = 1 << 22;
pub const MAX_SEGMENT_BYTES: u32 = 64 << 20;
/// A chunk covers at most this many elements, which bounds a decoder's allocations.
pub const MAX_CHUNK_ELEMENTS: u64 = 1 << 24;

/// Dtype and shape of one side of a tensor.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TensorSpec {
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

impl TensorSpec {
    pub fn element_count(&self) -> u64 {
        self.shape.iter().product()
    }

    pub fn byte_len(&self) -> u64 {
        checked_byte_len(self.dtype, &self.shape).expect("validated when parsed or built")
    }
}

/// What happened to a tensor between base and target. Renames are a removal plus an
/// addition, and reshapes or dtype changes are replacements: nothing changes silently.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TensorChange {
    /// Same dtype and shape on both sides; chunks carry the changed ranges.
    Patched(TensorSpec),
    /// Only in the target; dense chunks cover it entirely.
    Added(TensorSpec),
    /// Only in the base.
    Removed(TensorSpec),
    /// Dtype or shape changed; dense chunks cover the new tensor entirely.
    Replaced {
        base: TensorSpec,
        target: TensorSpec,
    },
}

impl TensorChange {
    fn code(&self) -> u8 {
        match self {
            TensorChange::Patched(_) => 1,
            TensorChange::Added(_) => 2,
            TensorChange::Removed(_) => 3,
            TensorChange::Replaced { .. } => 4,
        }
    }

    pub fn base(&self) -> Option<&TensorSpec> {
        match self {
            TensorChange::Patched(spec) | TensorChange::Removed(spec) => Some(spec),
            TensorChange::Replaced { base, .. } => Some(base),
            TensorChange::Added(_) => None,
        }
    }

    pub fn target(&self) -> Option<&TensorSpec> {
        match self {
            TensorChange::Patched(spec) | TensorChange::Added(spec) => Some(spec),
            TensorChange::Replaced { target, .. } => Some(target),
            TensorChange::Removed(_) => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TensorEntry {
    pub name: String,
    pub change: TensorChange,
}

/// Everything about a delta that is known before extraction starts.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeltaHeader {
    pub base_version: u64,
    pub target_version: u64,
    pub base_hash: Hash,
    pub target_hash: Hash,
    pub encoding: Encoding,
    /// Sorted by name, names unique.
    pub tensors: Vec<TensorEntry>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SegmentEntry {
    pub len: u32,
    pub hash: Hash,
}

/// Header plus segment table: everything needed to verify an artifact.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Manifest {
    pub header: DeltaHeader,
    pub segments: Vec<SegmentEntry>,
}

impl DeltaHeader {
    /// Where the target's tensors go in one buffer of host memory, in name order, each at
    /// an offset that is a multiple of `align` (a power of two), and the buffer's length:
    /// what a caller allocates for [`Patch::materialize_into`]. Fails on a target whose
    /// size does not fit the address space.
    ///
    /// [`Patch::materialize_into`]: crate::Patch::materialize_into
    pub fn target_layout(&self, align: usize) -> Result<(Vec<TensorLayout>, usize)> {
        assert!(align.is_power_of_two(), "alignment {align}");
        let too_large = || DeltaError::LimitExceeded {
            what: "target size in bytes",
            value: u64::MAX,
            limit: usize::MAX as u64,
        };
        let mut end = 0usize;
        let mut layout = Vec::with_capacity(self.tensors.len());
        for entry in &self.tensors {
            let Some(spec) = entry.change.target() else {
                continue;
            };
            let start = end.checked_next_multiple_of(align).ok_or_else(too_large)?;
            let len = usize::try_from(spec.byte_len()).map_err(|_| too_large())?;
            end = start.checked_add(len).ok_or_else(too_large)?;
            layout.push(TensorLayout {
                name: entry.name.clone(),
                dtype: spec.dtype,
                shape: spec.shape.clone(),
                bytes: start..end,
            });
        }
        Ok((layout, end))
    }

    /// The preamble and header as an Offer carries them (wire-protocol §4.4, since
    /// protocol version 4): the target's weights hash left pending, all zero. A hub
    /// offers a delta while the hash of its target is still being computed and sends
    /// the hash in the Seal, so one artifact has one descriptor, live or stored.
    pub fn encode_pending(&self) -> Vec<u8> {
        let mut out = self.encode();
        out[TARGET_HASH_AT..TARGET_HASH_AT + 32].fill(0);
        out
    }

    /// Whether the target's weights hash is pending (all zero), as in an Offer's
    /// descriptor.
    pub fn target_pending(&self) -> bool {
        self.target_hash == Hash::ZERO
    }

    /// This header with the target's weights hash `target_hash` (a Seal's).
    pub fn with_target_hash(&self, target_hash: Hash) -> DeltaHeader {
        DeltaHeader {
            target_hash,
            ..self.clone()
        }
    }

    /// Whether `self` is `pending` (a header whose target hash is pending) with the
    /// target hash filled in: the same artifact, once sealed.
    pub fn completes(&self, pending: &DeltaHeader) -> bool {
        pending.target_pending()
            && self.base_version == pending.base_version
            && self.target_version == pending.target_version
            && self.base_hash == pending.base_hash
            && self.encoding == pending.encoding
            && self.tensors == pending.tensors
    }

    /// Preamble and header bytes: the start of the artifact.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(&self.base_version.to_le_bytes());
        body.extend_from_slice(&self.target_version.to_le_bytes());
        body.extend_from_slice(&self.base_hash.0);
        body.extend_from_slice(&self.target_hash.0);
        body.push(self.encoding.code());
        body.extend_from_slice(&(self.tensors.len() as u32).to_le_bytes());
        for entry in &self.tensors {
            body.extend_from_slice(&(entry.name.len() as u16).to_le_bytes());
            body.extend_from_slice(entry.name.as_bytes());
            body.push(entry.change.code());
            match &entry.change {
                TensorChange::Patched(spec)
                | TensorChange::Added(spec)
                | TensorChange::Removed(spec) => write_spec(&mut body, spec),
                TensorChange::Replaced { base, target } => {
                    write_spec(&mut body, base);
                    write_spec(&mut body, target);
                }
            }
        }
        let mut out = Vec::with_capacity(PREAMBLE_BYTES + body.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Parses preamble and header from the start of `bytes`; returns the header and the
    /// number of bytes it took.
    pub fn decode(bytes: &[u8]) -> Result<(DeltaHeader, usize)> {
        let mut reader = ByteReader::new(bytes);
        if reader.array::<8>("magic")? != MAGIC {
            return Err(DeltaError::BadMagic);
        }
        let version = reader.u16("format version")?;
        if version != FORMAT_VERSION {
            return Err(DeltaError::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let flags = reader.u16("flags")?;
        if flags != 0 {
            return Err(DeltaError::Malformed(format!(
                "unknown header flags {flags:#x}"
            )));
        }
        let header_len = reader.u32("header length")?;
        limit(
            "header length",
            u64::from(header_len),
            u64::from(MAX_HEADER_BYTES),
        )?;
        let mut body = ByteReader::new(reader.take(header_len as usize, "header")?);
        let base_version = body.u64("base version")?;
        let target_version = body.u64("target version")?;
        let base_hash = Hash(body.array("base hash")?);
        let target_hash = Hash(body.array("target hash")?);
        let encoding = Encoding::from_code(body.u8("encoding")?)?;
        let count = body.u32("tensor count")?;
        limit("tensor count", u64::from(count), u64::from(MAX_TENSORS))?;
        let mut tensors: Vec<TensorEntry> = Vec::with_capacity(count.min(4096) as usize);
        for _ in 0..count {
            let name_len = body.u16("tensor name length")? as usize;
            limit("tensor name length", name_len as u64, MAX_NAME_BYTES as u64)?;
            let name = std::str::from_utf8(body.take(name_len, "tensor name")?)
                .map_err(|_| DeltaError::Malformed("tensor name is not UTF-8".into()))?
                .to_string();
            if let Some(previous) = tensors.last()
                && previous.name >= name
            {
                return Err(DeltaError::Malformed(format!(
                    "tensor table not sorted or not unique at '{name}'"
                )));
            }
            let change = match body.u8("tensor change kind")? {
                1 => TensorChange::Patched(read_spec(&mut body)?),
                2 => TensorChange::Added(read_spec(&mut body)?),
                3 => TensorChange::Removed(read_spec(&mut body)?),
                4 => TensorChange::Replaced {
                    base: read_spec(&mut body)?,
                    target: read_spec(&mut body)?,
                },
                other => {
                    return Err(DeltaError::Malformed(format!(
                        "unknown change kind {other} for tensor '{name}'"
                    )));
                }
            };
            tensors.push(TensorEntry { name, change });
        }
        if !body.is_empty() {
            return Err(DeltaError::Malformed(format!(
                "{} unexpected bytes at the end of the header",
                body.remaining()
            )));
        }
        let header = DeltaHeader {
            base_version,
            target_version,
            base_hash,
            target_hash,
            encoding,
            tensors,
        };
        Ok((header, reader.position()))
    }
}

fn write_spec(out: &mut Vec<u8>, spec: &TensorSpec) {
    out.push(spec.dtype as u8);
    out.push(spec.shape.len() as u8);
    for dim in &spec.shape {
        out.extend_from_slice(&dim.to_le_bytes());
    }
}

fn read_spec(reader: &mut ByteReader<'_>) -> Result<TensorSpec> {
    let dtype = Dtype::from_code(reader.u8("tensor dtype")?)?;
    let dims = reader.u8("tensor rank")? as usize;
    limit("tensor rank", dims as u64, MAX_DIMS as u64)?;
    let shape = (0..dims)
        .map(|_| reader.u64("tensor dimension"))
        .collect::<Result<Vec<_>>>()?;
    checked_byte_len(dtype, &shape)
        .ok_or_else(|| DeltaError::Malformed(format!("tensor shape {shape:?} overflows")))?;
    Ok(TensorSpec { dtype, shape })
}

fn limit(what: &'static str, value: u64, max: u64) -> Result<()> {
    if value > max {
        return Err(DeltaError::LimitExceeded {
            what,
            value,
            limit: max,
        });
    }
    Ok(())
}

impl Manifest {
    /// Segment table bytes.
    fn encode_table(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + 36 * self.segments.len());
        out.extend_from_slice(&(self.segments.len() as u32).to_le_bytes());
        for segment in &self.segments {
            out.extend_from_slice(&segment.len.to_le_bytes());
            out.extend_from_slice(&segment.hash.0);
        }
        out
    }

    /// The artifact id: BLAKE3 over preamble, header and segment table.
    pub fn id(&self) -> Hash {
        manifest_hash(&self.header.encode(), &self.encode_table())
    }

    /// Segment table and trailer: the end of the artifact.
    pub fn encode_tail(&self) -> Vec<u8> {
        let table = self.encode_table();
        let id = manifest_hash(&self.header.encode(), &table);
        let mut out = table;
        let table_len = out.len() as u32;
        out.extend_from_slice(&table_len.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&id.0);
        out.extend_from_slice(&END_MAGIC);
        out
    }

    pub fn payload_bytes(&self) -> u64 {
        self.segments.iter().map(|s| u64::from(s.len)).sum()
    }
}

fn manifest_hash(head: &[u8], table: &[u8]) -> Hash {
    let mut hasher = blake3::Hasher::new();
    hasher.update(head);
    hasher.update(table);
    Hash(*hasher.finalize().as_bytes())
}

/// A parsed artifact: its manifest and borrowed segment bytes. Parsing checks the
/// structure and the manifest hash; segment hashes are checked by
/// [`DeltaFile::verify_segment`] so a caller can verify lazily or in parallel.
#[derive(Debug, Clone)]
pub struct DeltaFile<'a> {
    pub manifest: Manifest,
    pub id: Hash,
    segments: Vec<&'a [u8]>,
}

impl<'a> DeltaFile<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<DeltaFile<'a>> {
        let (header, head_len) = DeltaHeader::decode(bytes)?;
        let after_head = bytes.len() - head_len;
        if after_head < TRAILER_BYTES {
            return Err(DeltaError::Truncated {
                what: "trailer",
                needed: TRAILER_BYTES as u64,
                available: after_head as u64,
            });
        }
        let mut trailer = ByteReader::new(&bytes[bytes.len() - TRAILER_BYTES..]);
        let table_len = trailer.u32("segment table length")? as usize;
        let reserved = trailer.u32("reserved")?;
        let stored_id = Hash(trailer.array("manifest hash")?);
        if trailer.array::<8>("end magic")? != END_MAGIC {
            return Err(DeltaError::Truncated {
                what: "end magic (file cut short or extended)",
                needed: TRAILER_BYTES as u64,
                available: after_head as u64,
            });
        }
        if reserved != 0 {
            return Err(DeltaError::Malformed(
                "reserved trailer field is not zero".into(),
            ));
        }
        if table_len > after_head - TRAILER_BYTES {
            return Err(DeltaError::Malformed(format!(
                "segment table of {table_len} bytes does not fit the file"
            )));
        }
        let table_start = bytes.len() - TRAILER_BYTES - table_len;
        let table = &bytes[table_start..bytes.len() - TRAILER_BYTES];
        let id = manifest_hash(&bytes[..head_len], table);
        if id != stored_id {
            return Err(DeltaError::ManifestCorrupted);
        }
        let mut reader = ByteReader::new(table);
        let count = reader.u32("segment count")?;
        limit("segment count", u64::from(count), u64::from(MAX_SEGMENTS))?;
        if table_len != 4 + 36 * count as usize {
            return Err(DeltaError::Malformed(format!(
                "segment table of {table_len} bytes cannot hold {count} entries"
            )));
        }
        let mut entries = Vec::with_capacity(count as usize);
        let mut segments = Vec::with_capacity(count as usize);
        let mut offset = head_len;
        for _ in 0..count {
            let len = reader.u32("segment length")?;
            limit(
                "segment length",
                u64::from(len),
                u64::from(MAX_SEGMENT_BYTES),
            )?;
            let hash = Hash(reader.array("segment hash")?);
            let end = offset + len as usize;
            if end > table_start {
                return Err(DeltaError::Malformed(
                    "segments overrun the segment table".into(),
                ));
            }
            segments.push(&bytes[offset..end]);
            entries.push(SegmentEntry { len, hash });
            offset = end;
        }
        if offset != table_start {
            return Err(DeltaError::Malformed(format!(
                "{} bytes between the last segment and the segment table",
                table_start - offset
            )));
        }
        Ok(DeltaFile {
            manifest: Manifest {
                header,
                segments: entries,
            },
            id,
            segments,
        })
    }

    pub fn header(&self) -> &DeltaHeader {
        &self.manifest.header
    }

    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// The bytes of segment `index`, after checking them against the manifest.
    pub fn verify_segment(&self, index: usize) -> Result<&'a [u8]> {
        let bytes = self.segments[index];
        let expected = self.manifest.segments[index].hash;
        let actual = Hash::of(bytes);
        if actual != expected {
            return Err(DeltaError::SegmentCorrupted {
                index: index as u32,
                expected,
                actual,
            });
        }
        Ok(bytes)
    }
}

/// Builds a whole artifact in memory from a header and its segments.
pub fn assemble(header: &DeltaHeader, segments: &[Vec<u8>]) -> (Manifest, Vec<u8>) {
    let manifest = Manifest {
        header: header.clone(),
        segments: segments
            .iter()
            .map(|s| SegmentEntry {
                len: s.len() as u32,
                hash: Hash::of(s),
            })
            .collect(),
    };
    let mut out = header.encode();
    for segment in segments {
        out.extend_from_slice(segment);
    }
    out.extend_from_slice(&manifest.encode_tail());
    (manifest, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> DeltaHeader {
        DeltaHeader {
            base_version: 6,
            target_version: 7,
            base_hash: Hash([0xAA; 32]),
            target_hash: Hash([0xBB; 32]),
            encoding: Encoding::Aurora,
            tensors: vec![
                TensorEntry {
                    name: "a".into(),
                    change: TensorChange::Patched(TensorSpec {
                        dtype: Dtype::Bf16,
                        shape: vec![2, 3],
                    }),
                },
                TensorEntry {
                    name: "b".into(),
                    change: TensorChange::Replaced {
                        base: TensorSpec {
                            dtype: Dtype::F32,
                            shape: vec![4],
                        },
                        target: TensorSpec {
                            dtype: Dtype::Bf16,
                            shape: vec![2, 2],
                        },
                    },
                },
            ],
        }
    }

    /// Golden bytes: the header layout of format version 1 must never change.
    #[test]
    fn a_pending_descriptor_is_the_header_with_its_target_hash_zeroed_and_completes_back() {
        let complete = header();
        let pending_bytes = complete.encode_pending();
        let (pending, used) = DeltaHeader::decode(&pending_bytes).unwrap();
        assert_eq!(used, pending_bytes.len());
        assert!(pending.target_pending());
        assert_eq!(pending, complete.with_target_hash(Hash::ZERO));
        // Only the 32 bytes of the target hash differ.
        let differing: Vec<usize> = (0..used)
            .filter(|&i| pending_bytes[i] != complete.encode()[i])
            .collect();
        assert_eq!(
            differing,
            (TARGET_HASH_AT..TARGET_HASH_AT + 32).collect::<Vec<_>>()
        );
        assert!(complete.completes(&pending));
        assert_eq!(pending.with_target_hash(complete.target_hash), complete);
        // Another artifact, or a header that is not pending, is not completed.
        assert!(!complete.completes(&complete));
        let mut other = pending.clone();
        other.base_version = 5;
        assert!(!complete.completes(&other));
    }

    #[test]
    fn header_golden_bytes() {
        let bytes = header().encode();
        let mut expected = Vec::new();
        expected.extend_from_slice(b"\x89ADELTA\x1a"); // magic
        expected.extend_from_slice(&[1, 0]); // format version 1
        expected.extend_from_slice(&[0, 0]); // flags
        expected.extend_from_slice(&[139, 0, 0, 0]); // header length
        expected.extend_from_slice(&[6, 0, 0, 0, 0, 0, 0, 0]); // base version
        expected.extend_from_slice(&[7, 0, 0, 0, 0, 0, 0, 0]); // target version
        expected.extend_from_slice(&[0xAA; 32]); // base weights hash
        expected.extend_from_slice(&[0xBB; 32]); // target weights hash
        expected.push(2); // encoding: aurora
        expected.extend_from_slice(&[2, 0, 0, 0]); // tensor count
        expected.extend_from_slice(&[1, 0, b'a', 1]); // name "a", patched
        expected.extend_from_slice(&[7, 2]); // BF16, rank 2
        expected.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
        expected.extend_from_slice(&[1, 0, b'b', 4]); // name "b", replaced
        expected.extend_from_slice(&[10, 1, 4, 0, 0, 0, 0, 0, 0, 0]); // base F32 [4]
        expected.extend_from_slice(&[7, 2, 2, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(bytes, expected);
        assert_eq!(
            DeltaHeader::decode(&bytes).unwrap(),
            (header(), bytes.len())
        );
    }

    #[test]
    fn artifact_round_trips_and_detects_every_kind_of_damage() {
        let segments = vec![b"first".to_vec(), b"second!".to_vec()];
        let (manifest, bytes) = assemble(&header(), &segments);
        let file = DeltaFile::parse(&bytes).unwrap();
        assert_eq!(file.manifest, manifest);
        assert_eq!(file.id, manifest.id());
        assert_eq!(file.verify_segment(1).unwrap(), b"second!");

        let error = |bytes: &[u8]| DeltaFile::parse(bytes).unwrap_err().to_string();
        for cut in [0, 10, bytes.len() / 2, bytes.len() - 1] {
            let message = error(&bytes[..cut]);
            assert!(
                message.contains("truncated")
                    || message.contains("magic")
                    || message.contains("does not fit"),
                "cut at {cut}: {message}"
            );
        }
        let mut foreign = bytes.clone();
        foreign[1] = b'Z';
        assert_eq!(error(&foreign), "not an aurora delta: bad magic bytes");
        let mut future = bytes.clone();
        future[8] = 9;
        assert!(error(&future).contains("unsupported delta format version 9"));
        let mut header_flip = bytes.clone();
        header_flip[30] ^= 1;
        assert!(error(&header_flip).contains("manifest hash mismatch"));

        let head_len = header().encode().len();
        let mut segment_flip = bytes.clone();
        segment_flip[head_len + 2] ^= 1;
        let file = DeltaFile::parse(&segment_flip).unwrap();
        assert!(
            file.verify_segment(0)
                .unwrap_err()
                .to_string()
                .starts_with("segment 0 is corrupted")
        );
        assert!(file.verify_segment(1).is_ok());

        // Segments swapped on disk: structure holds, hashes catch it.
        let mut reordered = header().encode();
        reordered.extend_from_slice(b"second!first");
        reordered.extend_from_slice(&manifest.encode_tail());
        let file = DeltaFile::parse(&reordered).unwrap();
        assert!(file.verify_segment(0).is_err());
        assert!(file.verify_segment(1).is_err());
    }

    #[test]
    fn declared_limits_are_enforced() {
        let mut bytes = header().encode();
        bytes[12..16].copy_from_slice(&(MAX_HEADER_BYTES + 1).to_le_bytes());
        assert!(matches!(
            DeltaHeader::decode(&bytes),
            Err(DeltaError::LimitExceeded {
                what: "header length",
                ..
            })
        ));

        let mut bytes = header().encode();
        let count_at = PREAMBLE_BYTES + 8 + 8 + 32 + 32 + 1;
        bytes[count_at..count_at + 4].copy_from_slice(&(MAX_TENSORS + 1).to_le_bytes());
        assert!(matches!(
            DeltaHeader::decode(&bytes),
            Err(DeltaError::LimitExceeded {
                what: "tensor count",
                ..
            })
        ));

        let mut long_name = header();
        long_name.tensors[0].name = "x".repeat(MAX_NAME_BYTES + 1);
        assert!(matches!(
            DeltaHeader::decode(&long_name.encode()),
            Err(DeltaError::LimitExceeded {
                what: "tensor name length",
                ..
            })
        ));

        let mut deep = header();
        deep.tensors[0].change = TensorChange::Patched(TensorSpec {
            dtype: Dtype::Bf16,
            shape: vec![1; MAX_DIMS + 1],
        });
        assert!(matches!(
            DeltaHeader::decode(&deep.encode()),
            Err(DeltaError::LimitExceeded {
                what: "tensor rank",
                ..
            })
        ));

        let manifest = Manifest {
            header: header(),
            segments: vec![SegmentEntry {
                len: MAX_SEGMENT_BYTES + 1,
                hash: Hash::default(),
            }],
        };
        let mut bytes = header().encode();
        bytes.extend_from_slice(&manifest.encode_tail());
        assert!(matches!(
            DeltaFile::parse(&bytes),
            Err(DeltaError::LimitExceeded {
                what: "segment length",
                ..
            })
        ));
    }

    #[test]
    fn a_segment_count_over_the_limit_is_refused_before_allocating() {
        // A sealed (correctly hashed) artifact whose table claims too many segments.
        let head = header().encode();
        let table = (MAX_SEGMENTS + 1).to_le_bytes().to_vec();
        let mut bytes = head.clone();
        bytes.extend_from_slice(&table);
        bytes.extend_from_slice(&(table.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes());
        bytes.extend_from_slice(&manifest_hash(&head, &table).0);
        bytes.extend_from_slice(&END_MAGIC);
        assert!(matches!(
            DeltaFile::parse(&bytes),
            Err(DeltaError::LimitExceeded {
                what: "segment count",
                ..
            })
        ));
    }

    #[test]
    fn unsorted_tensor_tables_are_rejected() {
        let mut unsorted = header();
        unsorted.tensors.reverse();
        assert!(
            DeltaHeader::decode(&unsorted.encode())
                .unwrap_err()
                .to_string()
                .contains("not sorted")
        );
    }
}
