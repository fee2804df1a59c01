//! An actor's weights in memory and the two heavy steps of staging and activation:
//! decoding each verified segment against the active weights, and applying the staged
//! patch in place and checking the target hash. Pure computation: drivers run
//! it off their event loop.

use aurora_delta::{
    Checkpoint, DeltaError, DeltaHeader, Hash, Patch, PatchChunk, TensorLayout, check_base,
    decode_segment, safetensors_layout,
};

use crate::frame::VersionRef;

/// A checkpoint held as a safetensors image, with its version and verified hash.
/// Cloning copies the image without hashing it again.
#[derive(Clone)]
pub struct Weights {
    image: Vec<u8>,
    layout: Vec<TensorLayout>,
    active: VersionRef,
}

impl Weights {
    /// Takes a safetensors image of `version`; its weights hash is computed here.
    pub fn new(image: Vec<u8>, version: u64) -> Result<Weights, DeltaError> {
        let layout = safetensors_layout(&image)?;
        let hash = Checkpoint::from_layout(&image, &layout)?.weights_hash();
        Ok(Weights {
            image,
            layout,
            active: VersionRef { version, hash },
        })
    }

    pub fn active(&self) -> VersionRef {
        self.active
    }

    /// The safetensors image of the active version.
    pub fn image(&self) -> &[u8] {
        &self.image
    }

    /// Decodes one verified segment of the delta `header` describes against these
    /// weights, after checking that they are exactly the delta's base (by the cached,
    /// verified hash). Nothing is written; segments may be decoded in any order, in
    /// parallel, and their chunks joined into a [`Patch`].
    pub fn decode_segment(
        &self,
        header: &DeltaHeader,
        index: u32,
        segment: &[u8],
    ) -> Result<Vec<PatchChunk>, DeltaError> {
        if header.base_version != self.active.version {
            return Err(DeltaError::BaseMismatch(format!(
                "the delta starts from version {}, these weights are version {}",
                header.base_version, self.active.version
            )));
        }
        let base = Checkpoint::from_layout(&self.image, &self.layout)?;
        check_base(header, &base, Some(self.active.hash))?;
        decode_segment(header, index, segment, &base)
    }

    /// Applies a staged patch in place. On a target hash mismatch the weights are
    /// restored and the error returned; on success the weights are the target version.
    pub fn activate(&mut self, mut patch: Patch) -> Result<Hash, DeltaError> {
        let version = patch.header.target_version;
        let hash = patch.apply_in_place(&mut self.image, &self.layout)?;
        self.active = VersionRef { version, hash };
        Ok(hash)
    }
}
