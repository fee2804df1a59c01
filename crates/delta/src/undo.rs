//! The undo journal of an in-place apply (docs/delta-format.md §7.1).
//!
//! An apply that writes into a file can be interrupted (the process killed, the machine
//! losing power) after some of its writes reached the file, leaving neither the base nor
//! the target. So before its first write the writer saves every byte the patch will
//! overwrite, as this journal, and removes the journal only once the file holds the
//! result. Replaying a journal that is still there writes those bytes back: the file is
//! the base again, byte for byte. Pure, as the rest of the crate: the journal is written
//! to any `io::Write` and replayed from bytes into a buffer.

use std::io::{self, Write};

use crate::apply::{Patch, Placement};
use crate::bits::ByteReader;
use crate::checkpoint::{Hash, TensorLayout};
use crate::codec::Changes;
use crate::error::{DeltaError, Result};

pub const JOURNAL_MAGIC: [u8; 8] = *b"AURUNDO\0";
pub const JOURNAL_VERSION: u32 = 1;

const SPARSE: u8 = 0;
const DENSE: u8 = 1;

/// What a journal says about the apply it guards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalInfo {
    /// Length of the file the journal restores; replaying checks it.
    pub file_len: u64,
    /// The delta whose apply the journal undoes.
    pub delta_id: Hash,
    pub base_version: u64,
    pub target_version: u64,
    /// Bytes of the file the journal restores.
    pub restored_bytes: u64,
}

/// The journal of applying a patch to a buffer: built once the placement of every chunk
/// has been checked, written with [`UndoJournal::write_to`].
pub struct UndoJournal<'a> {
    patch: &'a Patch,
    buffer: &'a [u8],
    placements: Vec<Placement>,
    delta_id: Hash,
}

impl Patch {
    /// The undo journal of applying this patch to `buffer` (laid out as `layout` says,
    /// as for [`Patch::apply_in_place`]) as the delta `delta_id`: the bytes it is about to
    /// overwrite. Fails, as applying would, if a chunk does not fit the buffer.
    pub fn undo_journal<'a>(
        &'a self,
        buffer: &'a [u8],
        layout: &[TensorLayout],
        delta_id: Hash,
    ) -> Result<UndoJournal<'a>> {
        Ok(UndoJournal {
            patch: self,
            buffer,
            placements: self.placements(buffer.len(), layout)?,
            delta_id,
        })
    }
}

impl UndoJournal<'_> {
    /// Writes the journal (§7.1), streaming: a sparse chunk's old values are gathered a
    /// block at a time, never as a copy of the whole patch.
    pub fn write_to(&self, out: &mut impl Write) -> io::Result<()> {
        let mut out = Hashing {
            inner: out,
            hasher: blake3::Hasher::new(),
        };
        let header = &self.patch.header;
        out.write_all(&JOURNAL_MAGIC)?;
        out.write_all(&JOURNAL_VERSION.to_le_bytes())?;
        out.write_all(&(self.buffer.len() as u64).to_le_bytes())?;
        out.write_all(&self.delta_id.0)?;
        out.write_all(&header.base_version.to_le_bytes())?;
        out.write_all(&header.target_version.to_le_bytes())?;
        out.write_all(&(self.placements.len() as u64).to_le_bytes())?;
        let mut block = Vec::with_capacity(1 << 16);
        for placement in &self.placements {
            let old = &self.buffer[placement.bytes.clone()];
            let element_bytes = placement.element_bytes;
            out.write_all(&(placement.bytes.start as u64).to_le_bytes())?;
            match &self.patch.chunks[placement.chunk].changes {
                Changes::Sparse { positions, .. } => {
                    out.write_all(&[SPARSE, element_bytes as u8])?;
                    out.write_all(&(positions.len() as u64).to_le_bytes())?;
                    for run in positions.chunks(1 << 14) {
                        block.clear();
                        block.extend(run.iter().flat_map(|p| p.to_le_bytes()));
                        out.write_all(&block)?;
                    }
                    for run in positions.chunks(1 << 14) {
                        block.clear();
                        for &p in run {
                            let at = p as usize * element_bytes;
                            block.extend_from_slice(&old[at..at + element_bytes]);
                        }
                        out.write_all(&block)?;
                    }
                }
                Changes::Dense(_) => {
                    out.write_all(&[DENSE, element_bytes as u8])?;
                    out.write_all(&(old.len() as u64).to_le_bytes())?;
                    out.write_all(old)?;
                }
            }
        }
        let hash = out.hasher.finalize();
        out.inner.write_all(hash.as_bytes())
    }
}

/// Forwards writes and hashes them.
struct Hashing<'a, W: Write> {
    inner: &'a mut W,
    hasher: blake3::Hasher,
}

impl<W: Write> Write for Hashing<'_, W> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let written = self.inner.write(bytes)?;
        self.hasher.update(&bytes[..written]);
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// One region of a parsed journal.
enum Region<'a> {
    Sparse {
        offset: usize,
        element_bytes: usize,
        positions: &'a [u8],
        values: &'a [u8],
    },
    Dense {
        offset: usize,
        bytes: &'a [u8],
    },
}

/// Checks a journal entirely (its hash, that it belongs to a buffer of this length,
/// that every region lies inside it), then writes the saved bytes back into `buffer`.
/// Nothing is written unless the whole journal is valid. Replaying twice is harmless:
/// the journal holds old values, not differences.
pub fn replay_undo_journal(journal: &[u8], buffer: &mut [u8]) -> Result<JournalInfo> {
    let (info, regions) = parse(journal, buffer.len())?;
    for region in regions {
        match region {
            Region::Sparse {
                offset,
                element_bytes,
                positions,
                values,
            } => {
                for (position, value) in positions
                    .chunks_exact(4)
                    .zip(values.chunks_exact(element_bytes))
                {
                    let at = offset
                        + u32::from_le_bytes(position.try_into().expect("4 bytes")) as usize
                            * element_bytes;
                    buffer[at..at + element_bytes].copy_from_slice(value);
                }
            }
            Region::Dense { offset, bytes } => {
                buffer[offset..offset + bytes.len()].copy_from_slice(bytes)
            }
        }
    }
    Ok(info)
}

fn invalid(reason: impl Into<String>) -> DeltaError {
    DeltaError::Journal(reason.into())
}

fn parse(journal: &[u8], buffer_len: usize) -> Result<(JournalInfo, Vec<Region<'_>>)> {
    let Some(body_len) = journal.len().checked_sub(32) else {
        return Err(invalid(format!("{} bytes is too short", journal.len())));
    };
    let (body, trailer) = journal.split_at(body_len);
    if !body.starts_with(&JOURNAL_MAGIC) {
        return Err(invalid("bad magic bytes"));
    }
    if blake3::hash(body).as_bytes() != trailer {
        return Err(invalid("its hash does not match: the journal is corrupted"));
    }
    // From here on the bytes are the writer's, so a field cut short is a writer's bug,
    // still reported rather than trusted.
    let cut_short = |error: DeltaError| match error {
        DeltaError::Truncated { what, .. } => invalid(format!("{what} is cut short")),
        other => other,
    };
    let mut reader = ByteReader::new(&body[JOURNAL_MAGIC.len()..]);
    let version = reader.u32("journal version").map_err(cut_short)?;
    if version != JOURNAL_VERSION {
        return Err(invalid(format!(
            "version {version} (this build reads version {JOURNAL_VERSION})"
        )));
    }
    let file_len = reader.u64("file length").map_err(cut_short)?;
    if file_len != buffer_len as u64 {
        return Err(invalid(format!(
            "it restores a file of {file_len} bytes, not of {buffer_len}"
        )));
    }
    let delta_id = Hash(reader.array::<32>("delta id").map_err(cut_short)?);
    let base_version = reader.u64("base version").map_err(cut_short)?;
    let target_version = reader.u64("target version").map_err(cut_short)?;
    let count = reader.u64("region count").map_err(cut_short)?;
    let mut regions = Vec::new();
    let mut restored_bytes = 0u64;
    let mut end_of_previous = 0usize;
    for index in 0..count {
        let offset = reader.u64("region offset").map_err(cut_short)?;
        let kind = reader.u8("region kind").map_err(cut_short)?;
        let element_bytes = usize::from(reader.u8("element size").map_err(cut_short)?);
        let len = reader.u64("region length").map_err(cut_short)?;
        let outside = || invalid(format!("region {index} lies outside the file"));
        let offset = usize::try_from(offset)
            .ok()
            .filter(|&o| o >= end_of_previous && o <= buffer_len)
            .ok_or_else(|| {
                invalid(format!(
                    "region {index} starts at {offset}, outside the file or before the previous region's end"
                ))
            })?;
        let space = buffer_len - offset;
        if element_bytes == 0 || element_bytes > 8 {
            return Err(invalid(format!(
                "region {index} has {element_bytes}-byte elements"
            )));
        }
        match kind {
            SPARSE => {
                // Both lists must be in the journal, which bounds `len` before any
                // multiplication could overflow.
                if len > (reader.remaining() / (4 + element_bytes)) as u64 {
                    return Err(invalid(format!("region {index} is cut short")));
                }
                let len = len as usize;
                let positions = reader.take(4 * len, "positions").map_err(cut_short)?;
                let values = reader
                    .take(element_bytes * len, "old values")
                    .map_err(cut_short)?;
                let mut last = None;
                for position in positions.chunks_exact(4) {
                    let position = u32::from_le_bytes(position.try_into().expect("4 bytes"));
                    if last.is_some_and(|l| position <= l) {
                        return Err(invalid(format!(
                            "region {index}'s positions are not ascending"
                        )));
                    }
                    last = Some(position);
                }
                // In 64 bits: on a 32-bit target the last position's end could wrap.
                let end = last.map_or(0, |l| (u64::from(l) + 1) * element_bytes as u64);
                if end > space as u64 {
                    return Err(outside());
                }
                end_of_previous = offset + end as usize;
                restored_bytes += (element_bytes * len) as u64;
                regions.push(Region::Sparse {
                    offset,
                    element_bytes,
                    positions,
                    values,
                });
            }
            DENSE => {
                if len > space as u64 {
                    return Err(outside());
                }
                let bytes = reader.take(len as usize, "old bytes").map_err(cut_short)?;
                end_of_previous = offset + bytes.len();
                restored_bytes += len;
                regions.push(Region::Dense { offset, bytes });
            }
            other => return Err(invalid(format!("region {index} has unknown kind {other}"))),
        }
    }
    if !reader.is_empty() {
        return Err(invalid(format!(
            "{} bytes follow the last region",
            reader.remaining()
        )));
    }
    Ok((
        JournalInfo {
            file_len,
            delta_id,
            base_version,
            target_version,
            restored_bytes,
        },
        regions,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        Checkpoint, DeltaFile, Dtype, ExtractOptions, Extraction, OwnedTensor, check_base, decode,
        owned_checkpoint, safetensors_layout,
    };

    /// A base and a target: a BF16 matrix with about 1% of its elements one step apart
    /// (coded sparse) and an F32 vector that changed everywhere (coded dense).
    fn pair() -> (Vec<OwnedTensor>, Vec<OwnedTensor>) {
        let mut state = 7u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            state >> 33
        };
        let matrix: Vec<u16> = (0..20_000)
            .map(|_| 0x3C00 + (next() % 512) as u16)
            .collect();
        let moved: Vec<u16> = matrix
            .iter()
            .map(|&w| if next() % 100 == 0 { w + 1 } else { w })
            .collect();
        let vector: Vec<f32> = (0..300).map(|i| i as f32 * 0.5).collect();
        let tensors = |matrix: &[u16], offset: f32| {
            vec![
                OwnedTensor {
                    name: "layer.weight".into(),
                    dtype: Dtype::Bf16,
                    shape: vec![100, 200],
                    data: matrix.iter().flat_map(|w| w.to_le_bytes()).collect(),
                },
                OwnedTensor {
                    name: "norm.weight".into(),
                    dtype: Dtype::F32,
                    shape: vec![300],
                    data: vector
                        .iter()
                        .flat_map(|v| (v + offset).to_le_bytes())
                        .collect(),
                },
            ]
        };
        (tensors(&matrix, 0.0), tensors(&moved, 1.0))
    }

    fn image_of(tensors: &[OwnedTensor]) -> Vec<u8> {
        let views = tensors.iter().map(|t| {
            let shape = t.shape.iter().map(|&d| d as usize).collect();
            let view =
                safetensors::tensor::TensorView::new(t.dtype.to_safetensors(), shape, &t.data)
                    .unwrap();
            (t.name.clone(), view)
        });
        safetensors::serialize(views, None).unwrap()
    }

    /// A base image, a patch to its target, the patch's journal and the delta.
    fn journal_case() -> (Vec<u8>, Patch, Vec<u8>, DeltaFile<'static>) {
        let (base, target) = pair();
        let base_view = owned_checkpoint(&base).unwrap();
        let target_view = owned_checkpoint(&target).unwrap();
        let (_, bytes) = Extraction::new(&base_view, &target_view, ExtractOptions::default())
            .unwrap()
            .to_bytes()
            .unwrap();
        let delta = DeltaFile::parse(Box::leak(bytes.into_boxed_slice())).unwrap();
        let image = image_of(&base);
        let layout = safetensors_layout(&image).unwrap();
        let patch = {
            let view = Checkpoint::from_layout(&image, &layout).unwrap();
            check_base(delta.header(), &view, None).unwrap();
            decode(&delta, &view).unwrap()
        };
        let kinds: Vec<bool> = patch
            .chunks
            .iter()
            .map(|c| matches!(c.changes, Changes::Dense(_)))
            .collect();
        assert!(
            kinds.contains(&true) && kinds.contains(&false),
            "both a sparse and a dense chunk: {kinds:?}"
        );
        let mut journal = Vec::new();
        patch
            .undo_journal(&image, &layout, delta.id)
            .unwrap()
            .write_to(&mut journal)
            .unwrap();
        (image, patch, journal, delta)
    }

    #[test]
    fn replaying_the_journal_of_an_interrupted_apply_restores_the_base() {
        let (image, mut patch, journal, delta) = journal_case();
        let layout = safetensors_layout(&image).unwrap();
        let mut buffer = image.clone();
        patch.apply_in_place(&mut buffer, &layout).unwrap();
        assert_ne!(buffer, image);
        // An apply cut short: only the first half of the file's changes were written.
        let half = buffer.len() / 2;
        let mut torn = image.clone();
        torn[..half].copy_from_slice(&buffer[..half]);
        assert_ne!(torn, image);
        for written in [torn, buffer] {
            let mut restored = written;
            let info = replay_undo_journal(&journal, &mut restored).unwrap();
            assert_eq!(restored, image);
            assert_eq!(info.delta_id, delta.id);
            assert_eq!(info.target_version, delta.header().target_version);
            assert!(info.restored_bytes > 0);
            // Replaying again changes nothing.
            replay_undo_journal(&journal, &mut restored).unwrap();
            assert_eq!(restored, image);
        }
    }

    /// The base image with the patch applied: what a journal would write into, so a
    /// journal that wrote before its checks would change it.
    fn patched(image: &[u8], patch: &Patch) -> Vec<u8> {
        let mut buffer = image.to_vec();
        let layout = safetensors_layout(image).unwrap();
        patch.clone().apply_in_place(&mut buffer, &layout).unwrap();
        assert_ne!(buffer, image);
        buffer
    }

    #[test]
    fn a_damaged_journal_is_refused_before_any_byte_is_written() {
        let (image, patch, journal, _) = journal_case();
        let target = patched(&image, &patch);
        let mut cases: Vec<(Vec<u8>, &str)> = vec![
            (journal[..journal.len() - 1].to_vec(), "hash does not match"),
            (journal[..20].to_vec(), "too short"),
            (Vec::new(), "too short"),
        ];
        let mut flipped = journal.clone();
        flipped[100] ^= 1;
        cases.push((flipped, "hash does not match"));
        let mut foreign = journal.clone();
        foreign[0] = b'X';
        cases.push((foreign, "bad magic"));
        for (bad, expected) in cases {
            let mut buffer = target.clone();
            let error = replay_undo_journal(&bad, &mut buffer).unwrap_err();
            assert!(error.to_string().contains(expected), "{error}");
            assert_eq!(buffer, target);
        }
        let mut longer = image.clone();
        longer.push(0);
        let error = replay_undo_journal(&journal, &mut longer).unwrap_err();
        assert!(error.to_string().contains("not of"), "{error}");
    }

    /// A journal whose hash is right but whose regions are hostile (a writer's bug, or a
    /// crafted file) is refused too, region by region.
    #[test]
    fn a_hostile_journal_with_a_valid_hash_is_refused() {
        let (image, patch, journal, _) = journal_case();
        let target = patched(&image, &patch);
        let body = &journal[..journal.len() - 32];
        let first_region = 8 + 4 + 8 + 32 + 8 + 8 + 8;
        // The F32 vector comes first in the image (safetensors orders by alignment): a
        // dense region, then the matrix's sparse one.
        assert_eq!(body[first_region + 8], DENSE);
        let dense_len = u64::from_le_bytes(body[first_region + 10..][..8].try_into().unwrap());
        let second_region = first_region + 18 + dense_len as usize;
        assert_eq!(body[second_region + 8], SPARSE);
        let rehash = |mut body: Vec<u8>| {
            let hash = blake3::hash(&body);
            body.extend_from_slice(hash.as_bytes());
            body
        };
        let patch_at = |at: usize, bytes: &[u8]| {
            let mut edited = body.to_vec();
            edited[at..at + bytes.len()].copy_from_slice(bytes);
            rehash(edited)
        };
        let cases = [
            (patch_at(8, &2u32.to_le_bytes()), "version 2"),
            (
                patch_at(first_region, &(image.len() as u64 + 1).to_le_bytes()),
                "outside the file",
            ),
            (patch_at(first_region + 8, &[7]), "unknown kind 7"),
            (patch_at(first_region + 9, &[0]), "0-byte elements"),
            (
                patch_at(first_region + 10, &u64::MAX.to_le_bytes()),
                "outside the file",
            ),
            (
                patch_at(second_region + 10, &u64::MAX.to_le_bytes()),
                "cut short",
            ),
            (
                rehash([body, &[0u8][..]].concat()),
                "follow the last region",
            ),
        ];
        for (bad, expected) in cases {
            let mut buffer = target.clone();
            let Err(error) = replay_undo_journal(&bad, &mut buffer) else {
                panic!("accepted a journal with {expected}");
            };
            assert!(error.to_string().contains(expected), "{expected}: {error}");
            assert_eq!(buffer, target);
        }
    }
}
