//! Model-sized safetensors images in memory the caller chooses.
//!
//! An actor's weights are one safetensors image as large as the model. On the
//! heap, an 8B model is 16 GB of anonymous memory per node; in a file mapped into memory,
//! the kernel pages it like any file, and the node's own memory stays flat whatever the
//! model's size. A staged delta is kept the same way ([`Spill`]): its decoded changes grow
//! with the model (about 1% of its elements, six bytes each), and a dense one is the whole
//! model. This crate does no I/O, so it defines only the interfaces ([`ImageSpace`],
//! [`Spill`]) and the heap ([`Heap`]); the file-backed space is
//! `aurora_checkpoint::FileImages`.

use std::fmt;
use std::io;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};

use crate::checkpoint::{Checkpoint, TensorLayout, safetensors_layout};
use crate::dtype::Dtype;
use crate::error::{DeltaError, Result};

/// The bytes of one image, wherever they live.
pub trait ImageMemory: Send + Sync {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl ImageMemory for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// Where a node's images are allocated.
pub trait ImageSpace: Send + Sync + fmt::Debug {
    /// `len` bytes, every one zero.
    fn allocate(&self, len: usize) -> io::Result<Image>;

    /// A new, empty [`Spill`].
    fn spill(&self) -> io::Result<Arc<dyn Spill>>;
}

/// Bytes a receiver keeps from staging to activation (a delta's decoded changes,
/// `crate::SpilledPatch`), of a size known only once the last segment is decoded: they
/// grow by appends, from any thread, and are read and rewritten in place at activation.
pub trait Spill: Send + Sync + fmt::Debug {
    /// Appends `bytes` and returns the offset they start at.
    fn append(&self, bytes: &[u8]) -> io::Result<u64>;
    /// Fills `out` from `offset`, which earlier appends wrote.
    fn read_at(&self, offset: u64, out: &mut [u8]) -> io::Result<()>;
    /// Overwrites bytes earlier appends wrote.
    fn write_at(&self, offset: u64, bytes: &[u8]) -> io::Result<()>;
}

/// Images on the heap: what tests and small models use.
#[derive(Debug, Clone, Copy, Default)]
pub struct Heap;

impl ImageSpace for Heap {
    fn allocate(&self, len: usize) -> io::Result<Image> {
        // Zeroed allocations come from the kernel's zero pages: nothing is resident until
        // it is written.
        Ok(Image::new(vec![0u8; len]))
    }

    fn spill(&self) -> io::Result<Arc<dyn Spill>> {
        Ok(Arc::new(HeapSpill::default()))
    }
}

/// A [`Spill`] on the heap.
#[derive(Debug, Default)]
struct HeapSpill(Mutex<Vec<u8>>);

impl HeapSpill {
    fn range(bytes: &[u8], offset: u64, len: usize) -> io::Result<std::ops::Range<usize>> {
        usize::try_from(offset)
            .ok()
            .and_then(|start| Some(start..start.checked_add(len)?))
            .filter(|range| range.end <= bytes.len())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("bytes {offset}..+{len} lie past the {} held", bytes.len()),
                )
            })
    }
}

impl Spill for HeapSpill {
    fn append(&self, bytes: &[u8]) -> io::Result<u64> {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let offset = held.len() as u64;
        held.extend_from_slice(bytes);
        Ok(offset)
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        out.copy_from_slice(&held[HeapSpill::range(&held, offset, out.len())?]);
        Ok(())
    }

    fn write_at(&self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let range = HeapSpill::range(&held, offset, bytes.len())?;
        held[range].copy_from_slice(bytes);
        Ok(())
    }
}

/// One image's bytes, in whatever memory its [`ImageSpace`] gave.
pub struct Image(Box<dyn ImageMemory>);

impl Image {
    pub fn new(memory: impl ImageMemory + 'static) -> Image {
        Image(Box::new(memory))
    }
}

impl From<Vec<u8>> for Image {
    fn from(bytes: Vec<u8>) -> Image {
        Image::new(bytes)
    }
}

impl Deref for Image {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.0.bytes()
    }
}

impl DerefMut for Image {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.0.bytes_mut()
    }
}

impl fmt::Debug for Image {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Image").field("len", &self.len()).finish()
    }
}

/// A tensor of an image being built: its data copied from `data`, or zeros.
pub(crate) struct InitialTensor<'a> {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data: Option<&'a [u8]>,
    pub len: usize,
}

/// The safetensors image of `tensors` in `space`, byte for byte what
/// `safetensors::serialize` writes, without ever holding a second copy: the header is
/// written first, then each tensor's data where it goes (or nothing, for zeros).
pub(crate) fn safetensors_image(
    space: &dyn ImageSpace,
    mut tensors: Vec<InitialTensor<'_>>,
) -> Result<(Image, Vec<TensorLayout>)> {
    let header = safetensors_header(&mut tensors)?;
    let data_len: usize = tensors.iter().map(|t| t.len).sum();
    let total = header.len() + data_len;
    let mut image = space.allocate(total).map_err(|source| DeltaError::Image {
        doing: format!("allocating a {total}-byte image"),
        source,
    })?;
    image[..header.len()].copy_from_slice(&header);
    let mut at = header.len();
    for tensor in &tensors {
        if let Some(data) = tensor.data {
            image[at..at + tensor.len].copy_from_slice(data);
        }
        at += tensor.len;
    }
    let layout = safetensors_layout(&image)?;
    Ok((image, layout))
}

/// The image of a checkpoint's tensors in `space`.
pub fn checkpoint_image(
    checkpoint: &Checkpoint<'_>,
    space: &dyn ImageSpace,
) -> Result<(Image, Vec<TensorLayout>)> {
    let tensors = checkpoint
        .tensors()
        .iter()
        .map(|tensor| InitialTensor {
            name: tensor.name.clone(),
            dtype: tensor.dtype,
            shape: tensor.shape.clone(),
            data: Some(tensor.data),
            len: tensor.data.len(),
        })
        .collect();
    safetensors_image(space, tensors)
}

/// The length prefix and JSON header `safetensors::serialize` writes for `tensors`, which
/// it puts in the order their data follows in: by descending dtype alignment, then name.
/// The crate writes the header only together with every tensor's data, in one buffer the
/// size of the model, so the header is made here from its public metadata types.
fn safetensors_header(tensors: &mut [InitialTensor<'_>]) -> Result<Vec<u8>> {
    tensors.sort_by(|left, right| {
        (right.dtype.to_safetensors())
            .cmp(&left.dtype.to_safetensors())
            .then_with(|| left.name.cmp(&right.name))
    });
    let mut offset = 0;
    let infos = tensors
        .iter()
        .map(|tensor| {
            let info = safetensors::tensor::TensorInfo {
                dtype: tensor.dtype.to_safetensors(),
                shape: tensor.shape.iter().map(|&d| d as usize).collect(),
                data_offsets: (offset, offset + tensor.len),
            };
            offset += tensor.len;
            (tensor.name.clone(), info)
        })
        .collect();
    let invalid = |e: &dyn fmt::Display| DeltaError::Checkpoint(format!("the image header: {e}"));
    let metadata = safetensors::tensor::Metadata::new(None, infos).map_err(|e| invalid(&e))?;
    let mut json = serde_json::to_vec(&metadata).map_err(|e| invalid(&e))?;
    // The crate pads the header with spaces to a multiple of 8 bytes, so that the data
    // after it is aligned.
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut header = Vec::with_capacity(8 + json.len());
    header.extend_from_slice(&(json.len() as u64).to_le_bytes());
    header.extend_from_slice(&json);
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::TensorView;

    #[test]
    fn an_image_is_byte_for_byte_what_safetensors_writes() {
        let (a, b, c) = (vec![1u8; 12], vec![2u8; 6], vec![3u8; 8]);
        let view = |name: &str, dtype, shape: &[u64], data| TensorView {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            data,
        };
        // Dtypes of three alignments, names out of order: the crate's order is by dtype
        // first.
        let checkpoint = Checkpoint::new(vec![
            view("z.bf16", Dtype::Bf16, &[2, 3], &a),
            view("a.bf16", Dtype::Bf16, &[3], &b),
            view("m.f32", Dtype::F32, &[2], &c),
        ])
        .unwrap();
        let (image, layout) = checkpoint_image(&checkpoint, &Heap).unwrap();
        assert!(*image == *checkpoint.to_safetensors().unwrap());
        let reread = Checkpoint::from_layout(&image, &layout).unwrap();
        assert_eq!(reread.weights_hash(), checkpoint.weights_hash());
    }

    #[test]
    fn a_space_that_cannot_allocate_is_an_error_naming_the_size() {
        #[derive(Debug)]
        struct Full;
        impl ImageSpace for Full {
            fn allocate(&self, _: usize) -> io::Result<Image> {
                Err(io::Error::from(io::ErrorKind::StorageFull))
            }

            fn spill(&self) -> io::Result<Arc<dyn Spill>> {
                Err(io::Error::from(io::ErrorKind::StorageFull))
            }
        }
        let data = [0u8; 4];
        let checkpoint = Checkpoint::new(vec![TensorView {
            name: "t".into(),
            dtype: Dtype::F32,
            shape: vec![1],
            data: &data,
        }])
        .unwrap();
        let error = checkpoint_image(&checkpoint, &Full).unwrap_err();
        assert!(
            matches!(
                &error,
                DeltaError::Image { doing, source }
                    if doing.ends_with("-byte image") && source.kind() == io::ErrorKind::StorageFull
            ),
            "{error}"
        );
    }
}
