//! Images in files mapped into memory: what keeps a relay's or an actor's memory flat
//! whatever the model's size (`aurora_delta::ImageSpace`).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use aurora_delta::{Image, ImageMemory, ImageSpace, Spill};
use memmap2::MmapMut;

/// Allocates each image as an unnamed file in `dir`, mapped shared: its pages are the
/// file's, which the kernel writes back and drops under pressure, not anonymous memory.
/// The file has no name (`O_TMPFILE` where the filesystem has it; otherwise it is
/// removed as soon as it is made), so nothing else can open it, and its space goes back
/// when the image is dropped, or when the process dies.
#[derive(Debug, Clone)]
pub struct FileImages {
    dir: PathBuf,
}

impl FileImages {
    pub fn new(dir: impl Into<PathBuf>) -> FileImages {
        FileImages { dir: dir.into() }
    }

    /// `error`, naming the directory; its kind kept, so a caller still tells a full disk
    /// from a missing directory.
    fn in_dir(&self, error: io::Error) -> io::Error {
        io::Error::new(error.kind(), format!("in {}: {error}", self.dir.display()))
    }

    /// Files in the directory `path` is in: scratch space for building what will be
    /// written to `path`, on the same disk.
    pub fn beside(path: &Path) -> FileImages {
        let dir = path.parent().filter(|dir| !dir.as_os_str().is_empty());
        FileImages::new(dir.unwrap_or(Path::new(".")))
    }
}

struct MappedImage(MmapMut);

impl ImageMemory for MappedImage {
    fn bytes(&self) -> &[u8] {
        &self.0
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl ImageSpace for FileImages {
    fn allocate(&self, len: usize) -> io::Result<Image> {
        // A map of zero bytes is refused by the kernel; an empty image needs no file.
        if len == 0 {
            return Ok(Image::new(Vec::new()));
        }
        let in_dir = |e| self.in_dir(e);
        let file = tempfile::tempfile_in(&self.dir).map_err(in_dir)?;
        // Sparse: blocks are taken as pages are first written, and read as zeros before.
        file.set_len(len as u64).map_err(in_dir)?;
        // SAFETY: the file has no name and only this map refers to it, so nothing else
        // changes it under the map.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(in_dir)?;
        Ok(Image::new(MappedImage(map)))
    }

    fn spill(&self) -> io::Result<Arc<dyn Spill>> {
        let file = tempfile::tempfile_in(&self.dir).map_err(|e| self.in_dir(e))?;
        Ok(Arc::new(FileSpill {
            file,
            end: AtomicU64::new(0),
        }))
    }
}

/// A [`Spill`] in an unnamed file: what it holds is page cache, written back and dropped
/// under pressure, not the process's memory.
#[derive(Debug)]
struct FileSpill {
    file: File,
    /// Where the next append goes: appends from several threads each take their own
    /// range, then write it without a lock.
    end: AtomicU64,
}

impl Spill for FileSpill {
    fn append(&self, bytes: &[u8]) -> io::Result<u64> {
        let offset = self.end.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.write_at(offset, bytes)?;
        Ok(offset)
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(out, offset).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("reading {} bytes at {offset}: {e}", out.len()),
            )
        })
    }

    fn write_at(&self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        self.file.write_all_at(bytes, offset).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("writing {} bytes at {offset}: {e}", bytes.len()),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapped_image_starts_zero_holds_what_is_written_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let images = FileImages::new(dir.path());
        let mut image = images.allocate(3 << 20).unwrap();
        assert_eq!(image.len(), 3 << 20);
        assert!(image.iter().all(|&b| b == 0));
        image[(2 << 20) + 5] = 7;
        assert_eq!(image[(2 << 20) + 5], 7);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "unnamed");
        assert!(images.allocate(0).unwrap().is_empty());
    }

    #[test]
    fn a_spill_keeps_appends_from_many_threads_apart_and_rewrites_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let spill = FileImages::new(dir.path()).spill().unwrap();
        let offsets: Vec<(u8, u64)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8u8)
                .map(|byte| {
                    let spill = &spill;
                    scope.spawn(move || {
                        (
                            byte,
                            spill.append(&vec![byte; 1000 + byte as usize]).unwrap(),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (byte, offset) in &offsets {
            let mut out = vec![0u8; 1000 + *byte as usize];
            spill.read_at(*offset, &mut out).unwrap();
            assert!(out.iter().all(|b| b == byte), "append of {byte}");
        }
        spill.write_at(offsets[3].1 + 10, &[0xAA; 4]).unwrap();
        let mut out = [0u8; 6];
        spill.read_at(offsets[3].1 + 9, &mut out).unwrap();
        assert_eq!(out, [3, 0xAA, 0xAA, 0xAA, 0xAA, 3]);
        let end = offsets
            .iter()
            .map(|(b, o)| o + 1000 + *b as u64)
            .max()
            .unwrap();
        let error = spill.read_at(end, &mut out).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof, "{error}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "unnamed");
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_it() {
        let images = FileImages::new("/nonexistent/aurora-images");
        let error = images.allocate(16).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::NotFound, "{error}");
        assert!(
            error.to_string().contains("/nonexistent/aurora-images"),
            "{error}"
        );
        let error = images.spill().unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::NotFound, "{error}");
    }
}
