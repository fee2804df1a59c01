//! The file a relay keeps its snapshot in (`aurora_proto::SnapshotSpace`,
//! docs/wire-protocol.md §8): each segment is written past the ones before it and served
//! from a map of the file, so what the relay holds of a 16.4 GB snapshot is page cache
//! the kernel writes back and drops under pressure, not the process's memory.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use aurora_proto::{KeptSegments, SnapshotSpace};
use bytes::Bytes;
use memmap2::Mmap;

/// Keeps each snapshot in an unnamed file in `dir` (`O_TMPFILE` where the filesystem
/// has it), so nothing else can open it, and its space goes back when the relay lets
/// the snapshot go, or dies.
#[derive(Debug, Clone)]
pub struct FileSnapshots {
    dir: PathBuf,
}

impl FileSnapshots {
    pub fn new(dir: impl Into<PathBuf>) -> FileSnapshots {
        FileSnapshots { dir: dir.into() }
    }
}

impl SnapshotSpace for FileSnapshots {
    fn create(&self, capacity: u64) -> std::io::Result<Box<dyn KeptSegments>> {
        let in_dir = |e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("in {}: {e}", self.dir.display()))
        };
        let file = tempfile::tempfile_in(&self.dir).map_err(in_dir)?;
        // Sparse: the disk is taken as segments are written, and the map reserves only
        // address space.
        file.set_len(capacity.max(1)).map_err(in_dir)?;
        // SAFETY: the file has no name and only `keep` writes to it, each time past
        // every byte it has handed out, so no byte seen through the map ever changes.
        let map = unsafe { Mmap::map(&file) }.map_err(in_dir)?;
        Ok(Box::new(FileSegments {
            file,
            whole: Bytes::from_owner(map),
            end: 0,
        }))
    }
}

#[derive(Debug)]
struct FileSegments {
    file: File,
    /// The whole file's map; each segment is served as a slice of it.
    whole: Bytes,
    /// Where the next segment goes.
    end: usize,
}

impl KeptSegments for FileSegments {
    fn keep(&mut self, bytes: &[u8]) -> std::io::Result<Bytes> {
        let start = self.end;
        let end = start
            .checked_add(bytes.len())
            .filter(|&end| end <= self.whole.len())
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::StorageFull,
                    format!(
                        "{} bytes more would pass the {} bytes set aside for the snapshot",
                        bytes.len(),
                        self.whole.len()
                    ),
                )
            })?;
        self.file.write_all_at(bytes, start as u64).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("writing {} bytes at {start}: {e}", bytes.len()),
            )
        })?;
        self.end = end;
        Ok(self.whole.slice(start..end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_segments_read_back_from_an_unnamed_file_within_its_room() {
        let dir = tempfile::tempdir().unwrap();
        let mut kept = FileSnapshots::new(dir.path()).create(10).unwrap();
        let first = kept.keep(b"abcd").unwrap();
        let second = kept.keep(b"efgh").unwrap();
        assert_eq!((&first[..], &second[..]), (&b"abcd"[..], &b"efgh"[..]));
        let error = kept.keep(b"ijk").unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::StorageFull, "{error}");
        assert_eq!(&first[..], b"abcd", "what was handed out never changes");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "unnamed");
        let missing = FileSnapshots::new(dir.path().join("missing")).create(10);
        assert_eq!(missing.unwrap_err().kind(), std::io::ErrorKind::NotFound);
    }
}
