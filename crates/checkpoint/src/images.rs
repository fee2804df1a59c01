//! Images in files mapped into memory: what keeps a relay's or an actor's memory flat
//! whatever the model's size (`aurora_delta::ImageSpace`).

use std::path::{Path, PathBuf};

use aurora_delta::{Image, ImageMemory, ImageSpace};
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
    fn allocate(&self, len: usize) -> Result<Image, String> {
        // A map of zero bytes is refused by the kernel; an empty image needs no file.
        if len == 0 {
            return Ok(Image::new(Vec::new()));
        }
        let in_dir = |e: std::io::Error| format!("in {}: {e}", self.dir.display());
        let file = tempfile::tempfile_in(&self.dir).map_err(in_dir)?;
        // Sparse: blocks are taken as pages are first written, and read as zeros before.
        file.set_len(len as u64).map_err(in_dir)?;
        // SAFETY: the file has no name and only this map refers to it, so nothing else
        // changes it under the map.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(in_dir)?;
        Ok(Image::new(MappedImage(map)))
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
    fn a_missing_directory_is_an_error_naming_it() {
        let images = FileImages::new("/nonexistent/aurora-images");
        let error = images.allocate(16).unwrap_err();
        assert!(error.contains("/nonexistent/aurora-images"), "{error}");
    }
}
