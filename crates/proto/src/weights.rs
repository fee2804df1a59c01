//! An actor's weights in memory and the two heavy steps of [`crate::ActorAction`]:
//! staging (decode a verified delta against the active weights) and activation (apply
//! the staged patch in place and check the target hash). Pure computation: drivers run
//! it off their event loop.

use aurora_delta::{
    Checkpoint, DeltaError, DeltaFile, Hash, Patch, TensorLayout, check_base, decode,
    safetensors_layout,
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

    /// Decodes `artifact` against these weights: checks that it is a valid delta whose
    /// base is exactly these weights (by the cached, verified hash) and that every
    /// segment decodes. Nothing is written.
    pub fn stage(&self, artifact: &[u8]) -> Result<Patch, DeltaError> {
        let delta = DeltaFile::parse(artifact)?;
        let base = Checkpoint::from_layout(&self.image, &self.layout)?;
        if delta.header().base_version != self.active.version {
            return Err(DeltaError::BaseMismatch(format!(
                "the delta starts from version {}, these weights are version {}",
                delta.header().base_version,
                self.active.version
            )));
        }
        check_base(delta.header(), &base, Some(self.active.hash))?;
        decode(&delta, &base)
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
