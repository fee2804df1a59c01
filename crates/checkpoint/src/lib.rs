//! Checkpoints and deltas on disk.
//!
//! The I/O shell around the pure `aurora-delta` core: checkpoints are memory-mapped,
//! never read whole into memory; every file is written crash-safely (a temporary file
//! in the same directory, fsync, rename, fsync of the directory), so a reader sees the
//! old file or the new one, never a torn one.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use aurora_delta::{
    Checkpoint, DeltaError, DeltaFile, Hash, Manifest, OwnedTensor, Segment, TensorLayout,
    check_base, decode, safetensors_layout,
};
use memmap2::{Mmap, MmapMut};

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    // The source is printed by the error chain (`{:#}`), not repeated here.
    #[error("{path}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}")]
    Delta { path: PathBuf, source: DeltaError },
    #[error("writing safetensors {path}: {reason}")]
    Serialize { path: PathBuf, reason: String },
}

pub type Result<T, E = FileError> = std::result::Result<T, E>;

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> FileError + '_ {
    move |source| FileError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn delta_error(path: &Path) -> impl FnOnce(DeltaError) -> FileError + '_ {
    move |source| FileError::Delta {
        path: path.to_path_buf(),
        source,
    }
}

/// A read-only memory map of a whole file.
pub struct MappedFile {
    path: PathBuf,
    map: Option<Mmap>,
}

impl MappedFile {
    pub fn open(path: impl AsRef<Path>) -> Result<MappedFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(io_error(path))?;
        let len = file.metadata().map_err(io_error(path))?.len();
        // An empty file cannot be mapped; it is still a (malformed) input to report on.
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the map is read-only and checkpoints are replaced by rename, never
            // modified in place while mapped, except by `apply_in_place`, which takes the
            // file exclusively.
            Some(unsafe { Mmap::map(&file) }.map_err(io_error(path))?)
        };
        Ok(MappedFile {
            path: path.to_path_buf(),
            map,
        })
    }

    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn checkpoint(&self) -> Result<Checkpoint<'_>> {
        Checkpoint::from_safetensors(self.bytes()).map_err(delta_error(&self.path))
    }

    pub fn delta(&self) -> Result<DeltaFile<'_>> {
        DeltaFile::parse(self.bytes()).map_err(delta_error(&self.path))
    }
}

/// Writes `path` atomically: `fill` writes into a temporary file beside it, which is
/// synced and renamed over `path` only if `fill` succeeds.
pub fn write_atomically<E: From<FileError>>(
    path: &Path,
    fill: impl FnOnce(&mut io::BufWriter<&File>) -> Result<(), E>,
) -> Result<(), E> {
    let directory = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| io_error(path)(io::Error::other("not a file path")))?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| E::from(FileError::Io { path, source })
    };
    let temporary = directory.join(format!(
        ".{}.{}.tmp",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let outcome = (|| {
        let file = File::create(&temporary).map_err(io(&temporary))?;
        let mut writer = io::BufWriter::with_capacity(1 << 20, &file);
        fill(&mut writer)?;
        writer.flush().map_err(io(&temporary))?;
        drop(writer);
        file.sync_all().map_err(io(&temporary))?;
        fs::rename(&temporary, path).map_err(io(path))?;
        File::open(&directory)
            .and_then(|d| d.sync_all())
            .map_err(io(&directory))
    })();
    if outcome.is_err() {
        let _ = fs::remove_file(&temporary);
    }
    outcome
}

/// Writes tensors as a safetensors file (crash-safe).
pub fn write_safetensors(path: &Path, tensors: &[OwnedTensor]) -> Result<()> {
    let bytes = safetensors_bytes(tensors).map_err(|reason| FileError::Serialize {
        path: path.to_path_buf(),
        reason,
    })?;
    write_atomically(path, |w| w.write_all(&bytes).map_err(io_error(path)))
}

/// A safetensors image of `tensors`, in memory.
pub fn safetensors_bytes(tensors: &[OwnedTensor]) -> Result<Vec<u8>, String> {
    let views = tensors
        .iter()
        .map(|t| {
            let shape: Vec<usize> = t.shape.iter().map(|d| *d as usize).collect();
            safetensors::tensor::TensorView::new(t.dtype.to_safetensors(), shape, &t.data)
                .map(|view| (t.name.clone(), view))
                .map_err(|e| format!("tensor '{}': {e}", t.name))
        })
        .collect::<Result<Vec<_>, String>>()?;
    safetensors::serialize(views, None).map_err(|e| e.to_string())
}

/// Writes a delta artifact as extraction produces it: header first, each segment as it
/// arrives, the segment table and trailer last; the file appears under its name only
/// once complete.
pub fn write_delta<E: From<FileError>>(
    path: &Path,
    header_bytes: &[u8],
    produce: impl FnOnce(&mut (dyn FnMut(Segment) -> Result<()> + Send)) -> Result<Manifest, E>,
) -> Result<Manifest, E> {
    let mut manifest = None;
    write_atomically(path, |writer| -> Result<(), E> {
        writer.write_all(header_bytes).map_err(io_error(path))?;
        let mut sink = |segment: Segment| writer.write_all(&segment.bytes).map_err(io_error(path));
        let done = produce(&mut sink)?;
        writer
            .write_all(&done.encode_tail())
            .map_err(io_error(path))?;
        manifest = Some(done);
        Ok(())
    })?;
    Ok(manifest.expect("set on success"))
}

/// Applies a delta in place to the safetensors file at `path` (or to a fused checkpoint
/// when `fused` is set): everything is verified before the first byte changes, and the
/// file is restored if the result does not hash to the delta's target. Returns the
/// target weights hash.
pub fn apply_in_place(path: &Path, delta: &DeltaFile<'_>, fused: bool) -> Result<Hash> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(io_error(path))?;
    // SAFETY: the file is opened read-write by us; concurrent writers are the caller's
    // responsibility, as for any in-place update.
    let mut map = unsafe { MmapMut::map_mut(&file) }.map_err(io_error(path))?;
    let layout = weights_layout(&map, delta, fused).map_err(delta_error(path))?;
    let mut patch = {
        let base = Checkpoint::from_layout(&map, &layout).map_err(delta_error(path))?;
        check_base(delta.header(), &base, None).map_err(delta_error(path))?;
        decode(delta, &base).map_err(delta_error(path))?
    };
    let hash = patch
        .apply_in_place(&mut map, &layout)
        .map_err(delta_error(path))?;
    map.flush().map_err(io_error(path))?;
    Ok(hash)
}

/// Where the delta's tensors live in a checkpoint image: its own layout, or the Hugging
/// Face view of a fused layout.
fn weights_layout(
    image: &[u8],
    delta: &DeltaFile<'_>,
    fused: bool,
) -> aurora_delta::Result<Vec<TensorLayout>> {
    let layout = safetensors_layout(image)?;
    if !fused {
        return Ok(layout);
    }
    let hf: Vec<_> = delta
        .header()
        .tensors
        .iter()
        .filter_map(|e| e.change.base().map(|spec| (e.name.clone(), spec.clone())))
        .collect();
    aurora_delta::fused::hf_layout_in_fused(&layout, &hf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use aurora_delta::{ExtractOptions, Extraction, owned_checkpoint};
    use aurora_synth::{Synth, SynthConfig, preset};

    fn pair() -> (Vec<OwnedTensor>, Vec<OwnedTensor>) {
        let mut synth = Synth::new(SynthConfig::new(preset("tiny").unwrap(), 11));
        let base = synth.export();
        synth.step();
        (base, synth.export())
    }

    #[test]
    fn in_place_apply_reaches_the_target_or_leaves_the_file_alone() {
        let dir = tempfile::tempdir().unwrap();
        let (base, target) = pair();
        let base_path = dir.path().join("base.safetensors");
        write_safetensors(&base_path, &base).unwrap();
        let base_view = owned_checkpoint(&base).unwrap();
        let target_view = owned_checkpoint(&target).unwrap();
        let (_, delta_bytes) = Extraction::new(&base_view, &target_view, ExtractOptions::default())
            .unwrap()
            .to_bytes()
            .unwrap();
        let delta = DeltaFile::parse(&delta_bytes).unwrap();

        let hash = apply_in_place(&base_path, &delta, false).unwrap();
        assert_eq!(hash, target_view.weights_hash());
        let applied = MappedFile::open(&base_path).unwrap();
        assert_eq!(applied.checkpoint().unwrap().weights_hash(), hash);
        drop(applied);

        // Now the file is at the target: applying again is a wrong base and changes nothing.
        let before = fs::read(&base_path).unwrap();
        let error = apply_in_place(&base_path, &delta, false).unwrap_err();
        assert!(
            matches!(
                &error,
                FileError::Delta {
                    source: DeltaError::WrongBase { .. },
                    ..
                }
            ),
            "{error:?}"
        );
        assert_eq!(fs::read(&base_path).unwrap(), before);
    }

    #[test]
    fn atomic_write_leaves_no_file_when_filling_fails() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let result = write_atomically(&path, |_| -> Result<()> {
            Err(FileError::Serialize {
                path: PathBuf::from("x"),
                reason: "boom".into(),
            })
        });
        assert!(result.is_err());
        assert!(!path.exists());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
