//! Checkpoints and deltas on disk.
//!
//! The I/O shell around the pure `aurora-delta` core: checkpoints are memory-mapped,
//! never read whole into memory; every file is written crash-safely (a temporary file
//! in the same directory, fsync, rename, fsync of the directory), so a reader sees the
//! old file or the new one, never a torn one. The one write in place, applying a delta
//! to a checkpoint file, keeps an undo journal beside it until the file holds the
//! result (docs/delta-format.md §7.1), and holds an exclusive lock on it meanwhile.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use aurora_delta::{
    Checkpoint, DeltaError, DeltaFile, Hash, JournalInfo, Manifest, OwnedTensor, Patch, Segment,
    TensorLayout, check_base, decode, replay_undo_journal, safetensors_layout,
};
use memmap2::{Mmap, MmapMut};

mod images;
pub use images::FileImages;

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    // The source is printed by the error chain (`{:#}`), not repeated here.
    #[error("{path}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}")]
    Delta { path: PathBuf, source: DeltaError },
    #[error("writing safetensors {path}: {reason}")]
    Serialize { path: PathBuf, reason: String },
    /// Applying a delta failed: the delta's own error names whether the base or the delta
    /// is at fault, and the caller names both files.
    #[error(transparent)]
    Apply(DeltaError),
    #[error("{path} is locked: {holder}")]
    Locked { path: PathBuf, holder: &'static str },
    #[error(
        "{path}: an in-place apply to it was interrupted; replaying its undo journal {journal} restores the base (`aurora delta recover`)"
    )]
    Interrupted { path: PathBuf, journal: PathBuf },
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

/// A read-only memory map of a whole file, holding a shared lock on it.
pub struct MappedFile {
    path: PathBuf,
    map: Option<Mmap>,
    /// Open for the lock's sake: [`apply_in_place`] takes the file exclusively, so it
    /// cannot change under the map.
    _file: File,
}

impl MappedFile {
    /// Maps `path`. Refused while another process applies a delta to it in place, and
    /// when such an apply was interrupted (its undo journal is still there), since the
    /// file then holds neither version.
    pub fn open(path: impl AsRef<Path>) -> Result<MappedFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(io_error(path))?;
        lock(&file, path, Lock::Shared)?;
        let journal = journal_path(path);
        if journal.exists() {
            return Err(FileError::Interrupted {
                path: path.to_path_buf(),
                journal,
            });
        }
        let len = file.metadata().map_err(io_error(path))?.len();
        // An empty file cannot be mapped; it is still a (malformed) input to report on.
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the map is read-only, checkpoints are replaced by rename, and the
            // one writer in place (`apply_in_place`) needs the exclusive lock, which our
            // shared one keeps it from taking.
            Some(unsafe { Mmap::map(&file) }.map_err(io_error(path))?)
        };
        Ok(MappedFile {
            path: path.to_path_buf(),
            map,
            _file: file,
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

/// The mapped bytes, so that a map can own a shared buffer (`bytes::Bytes::from_owner`)
/// that serves a file without copying it into memory.
impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

/// Writes `path` atomically: `fill` writes into a temporary file beside it, which is
/// synced and renamed over `path` only if `fill` succeeds.
pub fn write_atomically<E: From<FileError>>(
    path: &Path,
    fill: impl FnOnce(&mut io::BufWriter<&File>) -> Result<(), E>,
) -> Result<(), E> {
    replace_atomically(path, |temporary| {
        let file = File::create(temporary).map_err(io_error(temporary))?;
        let mut writer = io::BufWriter::with_capacity(1 << 20, &file);
        fill(&mut writer)?;
        writer.flush().map_err(io_error(temporary))?;
        Ok(())
    })
}

/// Makes `path` atomically: `make` creates the file at the temporary path it is given,
/// beside `path`; that file is synced and renamed over `path` only if `make` succeeds,
/// and removed otherwise.
fn replace_atomically<E: From<FileError>>(
    path: &Path,
    make: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<(), E> {
    let directory = parent_directory(path);
    let file_name = path
        .file_name()
        .ok_or_else(|| io_error(path)(io::Error::other("not a file path")))?;
    let temporary = directory.join(format!(
        ".{}.{}.tmp",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let outcome = (|| {
        make(&temporary)?;
        File::open(&temporary)
            .and_then(|file| file.sync_all())
            .map_err(io_error(&temporary))?;
        fs::rename(&temporary, path).map_err(io_error(path))?;
        // A journal left by an interrupted in-place apply to the file just replaced
        // belongs to the old file; replayed into the new one it would corrupt it.
        match fs::remove_file(journal_path(path)) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => {
                return Err(E::from(io_error(path)(error)));
            }
            _ => {}
        }
        sync_directory(&directory).map_err(E::from)
    })();
    if outcome.is_err() {
        let _ = fs::remove_file(&temporary);
    }
    outcome
}

fn parent_directory(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Makes a rename or removal in `directory` durable.
fn sync_directory(directory: &Path) -> Result<()> {
    File::open(directory)
        .and_then(|d| d.sync_all())
        .map_err(io_error(directory))
}

/// Writes `checkpoint` as a safetensors file (crash-safe), tensor by tensor from where
/// its data lies: no image of the whole model is made in memory. Returns the file's
/// size.
pub fn write_checkpoint(path: &Path, checkpoint: &Checkpoint<'_>) -> Result<u64> {
    replace_atomically(path, |temporary| {
        safetensors::serialize_to_file(checkpoint.safetensors_views(), None, temporary).map_err(
            |error| FileError::Serialize {
                path: path.to_path_buf(),
                reason: error.to_string(),
            },
        )
    })?;
    Ok(fs::metadata(path).map_err(io_error(path))?.len())
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
///
/// Crash-safe (docs/delta-format.md §7.1): before the first write, the bytes the delta
/// overwrites are saved in an undo journal beside the file ([`journal_path`]), which is
/// removed once the result is on disk. If the process dies in between, the journal
/// stays; [`recover`] (which this function runs first) then restores the base. The file
/// is locked exclusively throughout, so no reader maps it meanwhile.
pub fn apply_in_place(path: &Path, delta: &DeltaFile<'_>, fused: bool) -> Result<Hash> {
    let file = open_exclusively(path)?;
    if let Some(info) = recover_locked(path, &file)? {
        tracing::warn!(
            path = %path.display(),
            target_version = info.target_version,
            "restored the base of an interrupted in-place apply"
        );
    }
    // SAFETY: we hold the file's exclusive lock, so no cooperating process maps it, and
    // the map is dropped before the lock is released (with `file`).
    let mut map = unsafe { MmapMut::map_mut(&file) }.map_err(io_error(path))?;
    let layout = weights_layout(&map, delta, fused).map_err(delta_error(path))?;
    let mut patch = decode_against(&map, &layout, delta).map_err(FileError::Apply)?;
    // Before the journal: a patch that cannot go in place would only be refused later.
    patch.check_in_place().map_err(FileError::Apply)?;
    let journal = journal_path(path);
    {
        let undo = patch
            .undo_journal(&map, &layout, delta.id)
            .map_err(FileError::Apply)?;
        write_atomically(&journal, |writer| {
            undo.write_to(writer).map_err(io_error(&journal))
        })?;
    }
    tracing::debug!(journal = %journal.display(), "undo journal written");
    // The map is flushed before the journal goes, which is the commit point. A target
    // mismatch has been undone in memory by the time it is reported; any other error
    // leaves the file in a state nothing vouches for, so the journal stays for `recover`.
    let outcome = patch.apply_in_place(&mut map, &layout);
    map.flush().map_err(io_error(path))?;
    if matches!(&outcome, Err(error) if !matches!(error, DeltaError::TargetMismatch { .. })) {
        return outcome.map_err(FileError::Apply);
    }
    fs::remove_file(&journal).map_err(io_error(&journal))?;
    sync_directory(&parent_directory(path))?;
    outcome.map_err(FileError::Apply)
}

/// Restores the base of an interrupted in-place apply to `path`, if its undo journal is
/// still there; returns what the journal said, or `None` when there was nothing to do.
/// A damaged journal is reported and left alone, with the file.
pub fn recover(path: &Path) -> Result<Option<JournalInfo>> {
    let file = open_exclusively(path)?;
    recover_locked(path, &file)
}

/// Opens `path` for writing, holding its exclusive lock while the file is open.
fn open_exclusively(path: &Path) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(io_error(path))?;
    lock(&file, path, Lock::Exclusive)?;
    Ok(file)
}

/// [`recover`] with the file open and locked exclusively.
fn recover_locked(path: &Path, file: &File) -> Result<Option<JournalInfo>> {
    let journal = journal_path(path);
    // Mapped, not read: the journal of a dense delta is as large as the model.
    let bytes = match MappedFile::open(&journal) {
        Ok(mapped) => mapped,
        Err(FileError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return Ok(None);
        }
        Err(error) => return Err(error),
    };
    // SAFETY: the caller holds the file's exclusive lock.
    let mut map = unsafe { MmapMut::map_mut(file) }.map_err(io_error(path))?;
    let info = replay_undo_journal(bytes.bytes(), &mut map).map_err(delta_error(&journal))?;
    drop(bytes);
    map.flush().map_err(io_error(path))?;
    fs::remove_file(&journal).map_err(io_error(&journal))?;
    sync_directory(&parent_directory(path))?;
    Ok(Some(info))
}

/// Applies a delta to the checkpoint at `base` (a fused one when `fused` is set) and
/// writes the result to `out`, crash-safely, leaving `base` as it is. Returns the
/// target weights hash.
///
/// Everything is verified before `out` is made. When the delta keeps the layout, `out`
/// starts as a copy of the file (made by the kernel, without passing through this
/// process) and the changes are written into its map, so memory holds the patch, not
/// the model; otherwise the target is built once in an unnamed file beside `out`, then
/// written to it.
pub fn apply_to_file(base: &Path, delta: &DeltaFile<'_>, fused: bool, out: &Path) -> Result<Hash> {
    let base_file = MappedFile::open(base)?;
    let layout = weights_layout(base_file.bytes(), delta, fused).map_err(delta_error(base))?;
    let patch = decode_against(base_file.bytes(), &layout, delta).map_err(FileError::Apply)?;
    if patch.preserves_layout() {
        let mut patch = patch;
        let mut hash = None;
        replace_atomically(out, |temporary| {
            // A new file, not `fs::copy`, which would carry the base's permissions over
            // (a read-only base would give a copy this process cannot patch). `io::copy`
            // between files still copies in the kernel.
            let mut copy = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(temporary)
                .map_err(io_error(temporary))?;
            io::copy(&mut File::open(base).map_err(io_error(base))?, &mut copy)
                .map_err(io_error(temporary))?;
            // SAFETY: the file is ours alone until it is renamed into place.
            let mut map = unsafe { MmapMut::map_mut(&copy) }.map_err(io_error(temporary))?;
            if map.len() != base_file.bytes().len() {
                return Err(io_error(base)(io::Error::other(
                    "the file changed while it was being copied",
                )));
            }
            hash = Some(
                patch
                    .apply_in_place(&mut map, &layout)
                    .map_err(FileError::Apply)?,
            );
            map.flush().map_err(io_error(temporary))
        })?;
        return Ok(hash.expect("set on success"));
    }
    if fused {
        return Err(FileError::Apply(DeltaError::Unsupported {
            name: base.display().to_string(),
            reason:
                "the delta adds, removes or reshapes tensors, which a fused checkpoint cannot take"
                    .into(),
        }));
    }
    let view = base_file.checkpoint()?;
    let scratch = FileImages::beside(out);
    let (image, _) = patch
        .materialize_image(&view, &scratch)
        .map_err(FileError::Apply)?;
    write_atomically(out, |writer| {
        writer.write_all(&image).map_err(io_error(out))
    })?;
    Ok(delta.header().target_hash)
}

/// Checks that `image`, laid out as `layout` says, is the delta's base, and decodes the
/// delta against it.
fn decode_against(
    image: &[u8],
    layout: &[TensorLayout],
    delta: &DeltaFile<'_>,
) -> aurora_delta::Result<Patch> {
    let base = Checkpoint::from_layout(image, layout)?;
    check_base(delta.header(), &base, None)?;
    decode(delta, &base)
}

/// Where the undo journal of an in-place apply to `path` lives: beside it, hidden.
pub fn journal_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    parent_directory(path).join(format!(".{name}.aurora-undo"))
}

enum Lock {
    Shared,
    Exclusive,
}

/// Takes an advisory lock on `file` without waiting. A filesystem without locks (some
/// network ones) is not an error: the lock only keeps cooperating processes apart.
fn lock(file: &File, path: &Path, kind: Lock) -> Result<()> {
    let outcome = match kind {
        Lock::Shared => file.try_lock_shared(),
        Lock::Exclusive => file.try_lock(),
    };
    match outcome {
        Ok(()) => Ok(()),
        Err(fs::TryLockError::WouldBlock) => Err(FileError::Locked {
            path: path.to_path_buf(),
            holder: match kind {
                Lock::Shared => "a delta is being applied to it in place",
                Lock::Exclusive => "it is open for reading or being applied to elsewhere",
            },
        }),
        Err(fs::TryLockError::Error(error)) => {
            tracing::debug!(path = %path.display(), %error, "file locking unavailable");
            Ok(())
        }
    }
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

    /// A base file in a temporary directory, and the delta to the next step.
    struct Case {
        dir: tempfile::TempDir,
        base_path: PathBuf,
        base: Vec<u8>,
        target: Vec<u8>,
        target_hash: Hash,
        delta: Vec<u8>,
    }

    fn case() -> Case {
        let dir = tempfile::tempdir().unwrap();
        let (base, target) = pair();
        let base_path = dir.path().join("base.safetensors");
        write_safetensors(&base_path, &base).unwrap();
        let base_view = owned_checkpoint(&base).unwrap();
        let target_view = owned_checkpoint(&target).unwrap();
        let (_, delta) = Extraction::new(&base_view, &target_view, ExtractOptions::default())
            .unwrap()
            .to_bytes()
            .unwrap();
        Case {
            base: fs::read(&base_path).unwrap(),
            target: safetensors_bytes(&target).unwrap(),
            target_hash: target_view.weights_hash(),
            base_path,
            delta,
            dir,
        }
    }

    /// Files in the directory besides the checkpoint: no journal or temporary file left.
    fn leftovers(case: &Case) -> Vec<PathBuf> {
        fs::read_dir(case.dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| *p != case.base_path)
            .collect()
    }

    #[test]
    fn a_checkpoint_written_tensor_by_tensor_is_its_safetensors_image() {
        let case = case();
        let target = Checkpoint::from_safetensors(&case.target).unwrap();
        let path = case.dir.path().join("written.safetensors");
        let size = write_checkpoint(&path, &target).unwrap();
        assert_eq!(fs::read(&path).unwrap(), target.to_safetensors().unwrap());
        assert_eq!(size, fs::metadata(&path).unwrap().len());
        // Nothing but the two checkpoints: no temporary file left.
        let mut names: Vec<_> = fs::read_dir(case.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names, ["base.safetensors", "written.safetensors"]);
    }

    #[test]
    fn in_place_apply_reaches_the_target_or_leaves_the_file_alone() {
        let case = case();
        let delta = DeltaFile::parse(&case.delta).unwrap();
        let hash = apply_in_place(&case.base_path, &delta, false).unwrap();
        assert_eq!(hash, case.target_hash);
        assert_eq!(fs::read(&case.base_path).unwrap(), case.target);
        assert_eq!(leftovers(&case), Vec::<PathBuf>::new());

        // Now the file is at the target: applying again is a wrong base and changes nothing.
        let error = apply_in_place(&case.base_path, &delta, false).unwrap_err();
        assert!(
            matches!(&error, FileError::Apply(DeltaError::WrongBase { .. })),
            "{error:?}"
        );
        assert_eq!(fs::read(&case.base_path).unwrap(), case.target);
        assert_eq!(leftovers(&case), Vec::<PathBuf>::new());
    }

    /// The state a crash leaves: the journal written, then some of the writes on disk.
    /// Readers refuse the file, and recovery (explicit, or the next in-place apply)
    /// restores the base byte for byte.
    #[test]
    fn an_interrupted_in_place_apply_is_refused_then_restored() {
        let case = case();
        let delta = DeltaFile::parse(&case.delta).unwrap();
        let journal = journal_path(&case.base_path);
        let layout = safetensors_layout(&case.base).unwrap();
        let patch = decode_against(&case.base, &layout, &delta).unwrap();
        let undo = patch.undo_journal(&case.base, &layout, delta.id).unwrap();
        write_atomically(&journal, |w| undo.write_to(w).map_err(io_error(&journal))).unwrap();
        // The first half of the file at the target, the rest still the base.
        let half = case.base.len() / 2;
        let torn = [&case.target[..half], &case.base[half..]].concat();
        assert_ne!(torn, case.base);
        fs::write(&case.base_path, &torn).unwrap();

        let Err(error) = MappedFile::open(&case.base_path) else {
            panic!("a torn checkpoint was opened");
        };
        assert!(matches!(error, FileError::Interrupted { .. }), "{error:?}");
        assert!(error.to_string().contains("interrupted"), "{error}");

        let info = recover(&case.base_path)
            .unwrap()
            .expect("a journal to replay");
        assert_eq!(info.delta_id, delta.id);
        assert_eq!(info.target_version, delta.header().target_version);
        assert_eq!(fs::read(&case.base_path).unwrap(), case.base);
        assert!(!journal.exists());
        assert_eq!(recover(&case.base_path).unwrap(), None);

        // Torn again: the next apply restores the base first, then applies.
        write_atomically(&journal, |w| undo.write_to(w).map_err(io_error(&journal))).unwrap();
        fs::write(&case.base_path, &torn).unwrap();
        apply_in_place(&case.base_path, &delta, false).unwrap();
        assert_eq!(fs::read(&case.base_path).unwrap(), case.target);
        assert_eq!(leftovers(&case), Vec::<PathBuf>::new());
    }

    /// A file replaced whole (here by a crash-safe write) is a new file: the journal of
    /// an apply to the old one goes with it, rather than being replayed into it later.
    #[test]
    fn replacing_a_file_drops_the_journal_of_the_old_one() {
        let case = case();
        let journal = journal_path(&case.base_path);
        fs::write(&journal, b"a journal of the file about to be replaced").unwrap();
        assert!(MappedFile::open(&case.base_path).is_err());
        let (base, _) = pair();
        write_safetensors(&case.base_path, &base).unwrap();
        assert!(!journal.exists());
        assert_eq!(
            MappedFile::open(&case.base_path).unwrap().bytes(),
            &case.base[..]
        );
    }

    /// The output is a new file with the usual permissions, not a copy of the base's: a
    /// read-only base must not make a read-only (or, for another user, unpatchable)
    /// output.
    #[test]
    fn applying_from_a_read_only_base_makes_an_ordinary_file() {
        use std::os::unix::fs::PermissionsExt;
        let case = case();
        fs::set_permissions(&case.base_path, fs::Permissions::from_mode(0o444)).unwrap();
        let delta = DeltaFile::parse(&case.delta).unwrap();
        let out = case.dir.path().join("out.safetensors");
        apply_to_file(&case.base_path, &delta, false, &out).unwrap();
        assert_eq!(fs::read(&out).unwrap(), case.target);
        assert!(!fs::metadata(&out).unwrap().permissions().readonly());
    }

    #[test]
    fn a_damaged_journal_is_reported_and_kept_with_the_file() {
        let case = case();
        let journal = journal_path(&case.base_path);
        fs::write(
            &journal,
            b"AURUNDO\0 not a journal, but long enough to have a hash",
        )
        .unwrap();
        let error = recover(&case.base_path).unwrap_err();
        assert!(error.to_string().contains(".aurora-undo"), "{error}");
        assert!(format!("{:?}", error).contains("Journal"), "{error:?}");
        assert!(journal.exists());
        assert_eq!(fs::read(&case.base_path).unwrap(), case.base);
    }

    #[test]
    fn a_checkpoint_being_read_is_not_applied_to_in_place() {
        let case = case();
        let delta = DeltaFile::parse(&case.delta).unwrap();
        let reader = MappedFile::open(&case.base_path).unwrap();
        let error = apply_in_place(&case.base_path, &delta, false).unwrap_err();
        assert!(matches!(error, FileError::Locked { .. }), "{error:?}");
        assert_eq!(reader.bytes(), &case.base[..]);
        drop(reader);
        apply_in_place(&case.base_path, &delta, false).unwrap();
    }

    #[test]
    fn applying_to_a_new_file_leaves_the_base_alone() {
        let case = case();
        let delta = DeltaFile::parse(&case.delta).unwrap();
        let out = case.dir.path().join("out.safetensors");
        let hash = apply_to_file(&case.base_path, &delta, false, &out).unwrap();
        assert_eq!(hash, case.target_hash);
        assert_eq!(fs::read(&out).unwrap(), case.target);
        assert_eq!(fs::read(&case.base_path).unwrap(), case.base);

        // From the target, the same delta is a wrong base: no output, no temporary file.
        fs::remove_file(&out).unwrap();
        let target_path = case.dir.path().join("target.safetensors");
        fs::write(&target_path, &case.target).unwrap();
        let error = apply_to_file(&target_path, &delta, false, &out).unwrap_err();
        assert!(
            matches!(error, FileError::Apply(DeltaError::WrongBase { .. })),
            "{error:?}"
        );
        let mut names: Vec<_> = fs::read_dir(case.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names, ["base.safetensors", "target.safetensors"]);
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
