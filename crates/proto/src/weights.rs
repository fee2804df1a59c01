//! An actor's weights in memory and the two heavy steps of staging and activation:
//! decoding each verified segment against the active weights, and applying the staged
//! patch and checking the target hash. Pure computation: drivers run it off their event
//! loop.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};

use aurora_delta::{
    ChangeSet, Checkpoint, DeltaError, DeltaHeader, Hash, Heap, Image, ImageSpace, Spill,
    SpilledChunks, SpilledPatch, TargetImage, TensorLayout, check_base, checkpoint_image,
    decode_segment, safetensors_layout,
};

use crate::effect::EffectError;
use crate::frame::{ArtifactKind, VersionRef};

/// A checkpoint held as a safetensors image, with its version and verified hash.
///
/// The image lives in the weights' [`ImageSpace`] (the heap, or a mapped file on a node
/// that must stay flat in memory whatever the model's size), and so does every image
/// that replaces it: a snapshot being built, a patch that changes the layout. A staged
/// delta's decoded changes go to the same space's [`Spill`].
pub struct Weights {
    image: Image,
    layout: Vec<TensorLayout>,
    active: VersionRef,
    space: Arc<dyn ImageSpace>,
    /// The snapshot a joining node is taking, built in place as its segments are
    /// decoded (on any thread: decodes share the weights).
    building: Mutex<Option<TargetImage>>,
    /// Where the decodes of the delta being staged (its target version and hash) keep
    /// their changes.
    staging: Mutex<Option<(VersionRef, Arc<dyn Spill>)>>,
}

/// What an activation applies: a patch to the active weights, or the image a snapshot's
/// segments were decoded into.
pub enum Staged {
    Patch(SpilledPatch),
    /// A patch whose target hash over the active weights was checked when it was staged
    /// ([`Weights::verify`]): activating it only writes its changes.
    Verified(SpilledPatch),
    /// [`Weights::decode_segment`] wrote every segment of the snapshot `header` names.
    Snapshot(Arc<DeltaHeader>),
}

impl Staged {
    pub fn target_version(&self) -> u64 {
        match self {
            Staged::Patch(patch) | Staged::Verified(patch) => patch.header().target_version,
            Staged::Snapshot(header) => header.target_version,
        }
    }

    /// What the engine must load: with `elements`, a patch's changed elements (see
    /// [`SpilledPatch::change_set`]); every tensor whole for a snapshot. A spill that
    /// cannot be read for the indices gives whole tensors, which are always right.
    pub fn change_set(&self, elements: bool) -> ChangeSet {
        match self {
            Staged::Patch(patch) | Staged::Verified(patch) => patch.change_set(elements).unwrap_or_else(|error| {
                tracing::warn!(%error, "the changed elements could not be read: loading whole tensors");
                ChangeSet::whole(patch.changed_tensors())
            }),
            Staged::Snapshot(_) => ChangeSet::whole(self.changed_tensors()),
        }
    }

    /// The tensors an engine must reload, in name order (every one for a snapshot).
    pub fn changed_tensors(&self) -> Vec<String> {
        match self {
            Staged::Patch(patch) | Staged::Verified(patch) => patch.changed_tensors(),
            Staged::Snapshot(header) => {
                let mut names: Vec<String> = header
                    .tensors
                    .iter()
                    .filter(|entry| entry.change.target().is_some())
                    .map(|entry| entry.name.clone())
                    .collect();
                names.sort();
                names
            }
        }
    }
}

impl Weights {
    /// Takes a safetensors image of `version`, on the heap; its weights hash is computed
    /// here.
    pub fn new(image: Vec<u8>, version: u64) -> Result<Weights, DeltaError> {
        let layout = safetensors_layout(&image)?;
        let hash = Checkpoint::from_layout(&image, &layout)?.weights_hash();
        Ok(Weights {
            image: image.into(),
            layout,
            active: VersionRef { version, hash },
            space: Arc::new(Heap),
            building: Mutex::new(None),
            staging: Mutex::new(None),
        })
    }

    /// Copies `checkpoint`, as `version`, into an image in `space`, tensor by tensor;
    /// its weights hash is computed here.
    pub fn from_checkpoint(
        checkpoint: &Checkpoint<'_>,
        version: u64,
        space: Arc<dyn ImageSpace>,
    ) -> Result<Weights, DeltaError> {
        let (image, layout) = checkpoint_image(checkpoint, space.as_ref())?;
        let hash = Checkpoint::from_layout(&image, &layout)?.weights_hash();
        Ok(Weights {
            image,
            layout,
            active: VersionRef { version, hash },
            space,
            building: Mutex::new(None),
            staging: Mutex::new(None),
        })
    }

    /// A copy in the same space, without hashing the image again.
    pub fn try_clone(&self) -> Result<Weights, DeltaError> {
        let mut image =
            self.space
                .allocate(self.image.len())
                .map_err(|source| DeltaError::Image {
                    doing: "copying the weights' image".into(),
                    source,
                })?;
        image.copy_from_slice(&self.image);
        Ok(Weights {
            image,
            layout: self.layout.clone(),
            active: self.active,
            space: self.space.clone(),
            building: Mutex::new(None),
            staging: Mutex::new(None),
        })
    }

    /// No tensors at all: what a peer that joins over the wire holds until its snapshot
    /// is activated. Only a snapshot decodes against it; its image is built in `space`.
    pub fn empty(space: Arc<dyn ImageSpace>) -> Weights {
        Weights {
            image: Vec::new().into(),
            layout: Vec::new(),
            active: VersionRef {
                version: 0,
                hash: crate::snapshot::empty_weights_hash(),
            },
            space,
            building: Mutex::new(None),
            staging: Mutex::new(None),
        }
    }

    /// Whether these are the weights of [`Weights::empty`]: nothing an engine can run.
    pub fn is_empty(&self) -> bool {
        self.layout.is_empty()
    }

    pub fn active(&self) -> VersionRef {
        self.active
    }

    /// The safetensors image of the active version.
    pub fn image(&self) -> &[u8] {
        &self.image
    }

    /// Where each tensor lies in [`Weights::image`].
    pub fn layout(&self) -> &[TensorLayout] {
        &self.layout
    }

    /// Decodes one verified segment of the delta `header` describes against these
    /// weights, after checking that they are exactly the delta's base (by the cached,
    /// verified hash). The weights are not written; segments may be decoded in any
    /// order, in parallel, and their chunks, kept in the weights' spill, joined into a
    /// [`SpilledPatch`]. A snapshot's segments are written into the image it builds, so
    /// they return no chunks.
    pub fn decode_segment(
        &self,
        kind: ArtifactKind,
        header: &DeltaHeader,
        index: u32,
        segment: &[u8],
    ) -> Result<SpilledChunks, DeltaError> {
        // A snapshot (its header checked by the receiver) names its own version as its
        // base: the base check below (no tensors, the empty checkpoint's hash) is what
        // makes it fit.
        if kind != ArtifactKind::Snapshot && header.base_version != self.active.version {
            return Err(DeltaError::BaseMismatch(format!(
                "the delta starts from version {}, these weights are version {}",
                header.base_version, self.active.version
            )));
        }
        let base = Checkpoint::from_layout(&self.image, &self.layout)?;
        check_base(header, &base, Some(self.active.hash))?;
        let chunks = decode_segment(header, index, segment, &base)?;
        if kind != ArtifactKind::Snapshot {
            return SpilledChunks::write(&self.staging_spill(header)?, chunks);
        }
        // A snapshot's chunks go straight into its image: holding them until the last
        // segment would hold the model twice.
        let mut building = self.building.lock().unwrap_or_else(PoisonError::into_inner);
        let image = match building.take() {
            Some(image) if image.header() == header => building.insert(image),
            // A decode of a snapshot superseded by a newer one: it must not take the
            // newer one's image away, and its result is not wanted.
            Some(image) if image.header().target_version > header.target_version => {
                *building = Some(image);
                return Ok(SpilledChunks::default());
            }
            _ => building.insert(TargetImage::new(header.clone(), self.space.as_ref())?),
        };
        image.write(chunks)?;
        Ok(SpilledChunks::default())
    }

    /// The spill the delta `header` describes is staged in, made by its first decode.
    fn staging_spill(&self, header: &DeltaHeader) -> Result<Arc<dyn Spill>, DeltaError> {
        let target = VersionRef {
            version: header.target_version,
            hash: header.target_hash,
        };
        let new_spill = || {
            self.space.spill().map_err(|source| DeltaError::Spill {
                doing: format!("making a place for version {}'s changes", target.version),
                source,
            })
        };
        let mut staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        match &*staging {
            Some((staged, spill)) if *staged == target => Ok(spill.clone()),
            // A decode of a delta superseded by a newer one: its result is not wanted,
            // and it must not take the newer one's spill away.
            Some((staged, _)) if staged.version > target.version => new_spill(),
            _ => Ok(staging.insert((target, new_spill()?)).1.clone()),
        }
    }

    /// Checks that `patch` turns these weights into its target, by hashing them with its
    /// changes laid over (O(model), nothing written): what a node does behind generation
    /// once a delta is staged, so its activation only writes the changes
    /// ([`Staged::Verified`]).
    pub fn verify(&self, patch: &SpilledPatch) -> Result<(), DeltaError> {
        let expected = patch.header().target_hash;
        let actual = patch.target_hash(&self.image, &self.layout)?;
        if actual != expected {
            return Err(DeltaError::TargetMismatch { expected, actual });
        }
        Ok(())
    }

    /// Applies a staged patch. A patch that keeps every tensor's dtype and shape is
    /// applied in place; one that adds, removes or reshapes tensors (a snapshot) is
    /// materialised into a new image, hashed once. On a target hash mismatch the weights are left as
    /// they were and the error returned; on success they are the target version.
    pub fn activate(&mut self, staged: Staged) -> Result<Hash, DeltaError> {
        // Whatever the outcome, the spill of this version or an older one is done with.
        let version = staged.target_version();
        let staging = self
            .staging
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if staging
            .as_ref()
            .is_some_and(|(staged, _)| staged.version <= version)
        {
            *staging = None;
        }
        let patch = match staged {
            Staged::Patch(patch) => patch,
            Staged::Verified(patch) => {
                let hash = patch.header().target_hash;
                patch.swap_in(&mut self.image, &self.layout)?;
                self.active = VersionRef { version, hash };
                return Ok(hash);
            }
            Staged::Snapshot(header) => return self.activate_snapshot(&header),
        };
        if patch.preserves_layout() {
            let hash = patch.apply_in_place(&mut self.image, &self.layout)?;
            self.active = VersionRef { version, hash };
            return Ok(hash);
        }
        // A delta that adds, removes or reshapes tensors is rare (a model's first version
        // or a change of architecture): it is read back whole and built into a new image.
        let patch = patch.load()?;
        let expected = patch.header.target_hash;
        // The image is what the engine loads: its own hash is the one checked.
        let base = Checkpoint::from_layout(&self.image, &self.layout)?;
        let (image, layout) = patch.materialize_image(&base, self.space.as_ref())?;
        // No snapshot can be built on weights that hold tensors.
        *self
            .building
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner) = None;
        self.image = image;
        self.layout = layout;
        self.active = VersionRef {
            version,
            hash: expected,
        };
        Ok(expected)
    }

    /// [`Weights::activate`] for a driver: a panic inside it is caught and named, where
    /// it would otherwise end the task that holds the weights, and the node would never
    /// hear how the version went. After a panic the image is hashed once: if it is still
    /// the version active before, that version stays; if not, the weights are no
    /// version's, and [`EffectError::lost_weights`] says nothing may read them.
    pub fn activate_catching_panics(&mut self, staged: Staged) -> Result<Hash, EffectError> {
        self.catching_panics(|weights| weights.activate(staged))
    }

    fn catching_panics(
        &mut self,
        activate: impl FnOnce(&mut Weights) -> Result<Hash, DeltaError>,
    ) -> Result<Hash, EffectError> {
        let before = self.active;
        let intact = |weights: &Weights| {
            Checkpoint::from_layout(&weights.image, &weights.layout)
                .is_ok_and(|checkpoint| checkpoint.weights_hash() == before.hash)
        };
        let payload = match std::panic::catch_unwind(AssertUnwindSafe(|| activate(self))) {
            Ok(Err(error @ DeltaError::RestoreFailed { .. })) if !intact(self) => {
                return Err(EffectError::WeightsLost(Arc::new(error)));
            }
            Ok(result) => return result.map_err(EffectError::from),
            Err(payload) => payload,
        };
        let message = payload
            .downcast_ref::<&str>()
            .map(|message| (*message).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        self.active = before;
        let intact = intact(self);
        tracing::error!(version = before.version, panic = %message, intact, "activation panicked");
        Err(EffectError::ActivationPanicked { message, intact })
    }

    /// Empty weights in the same space: what a node whose weights were lost rejoins with.
    pub fn emptied(&self) -> Weights {
        Weights::empty(self.space.clone())
    }

    /// Becomes the snapshot `header` names, built by the decodes of its segments.
    fn activate_snapshot(&mut self, header: &DeltaHeader) -> Result<Hash, DeltaError> {
        let building = self
            .building
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            // Built from the Offer's header, whose target hash was pending.
            .filter(|image| image.header() == header || header.completes(image.header()))
            .ok_or_else(|| {
                DeltaError::Malformed(format!(
                    "no segment of the snapshot of version {} was decoded",
                    header.target_version
                ))
            })?;
        // The image is what the engine loads: its own hash is the one checked.
        let (image, layout, hash) = building.finish(header.target_hash)?;
        self.image = image;
        self.layout = layout;
        self.active = VersionRef {
            version: header.target_version,
            hash,
        };
        Ok(hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aurora_delta::{DeltaFile, Encoding, ExtractOptions, Extraction};

    /// A synthetic checkpoint's image and the snapshot artifact of it as version 7.
    fn snapshot() -> (Vec<u8>, Vec<u8>) {
        let shape = aurora_synth::preset("tiny").unwrap();
        let synth = aurora_synth::Synth::new(aurora_synth::SynthConfig::new(shape, 3));
        let image = aurora_checkpoint::safetensors_bytes(&synth.export()).unwrap();
        let target = Checkpoint::from_safetensors(&image).unwrap();
        let options = ExtractOptions {
            encoding: Encoding::Dense,
            base_version: 7,
            target_version: 7,
            segment_target_bytes: 4096,
            ..ExtractOptions::default()
        };
        let (_, artifact) = Extraction::new(&Checkpoint::default(), &target, options)
            .unwrap()
            .to_bytes()
            .unwrap();
        (image, artifact)
    }

    /// Decodes every segment of the snapshot `file` into `weights` (in reverse order:
    /// any order builds the same image); what is staged.
    fn decode_all(weights: &Weights, file: &DeltaFile<'_>) -> Staged {
        for index in (0..file.segment_count()).rev() {
            let segment = file.verify_segment(index).unwrap();
            let chunks = weights
                .decode_segment(ArtifactKind::Snapshot, file.header(), index as u32, segment)
                .unwrap();
            assert!(chunks.is_empty(), "written into the image, not held");
        }
        Staged::Snapshot(Arc::new(file.header().clone()))
    }

    /// Stages the delta between two steps of a synthetic trainer in `weights`, holding
    /// the first: its segments decoded last first, each into the weights' spill.
    fn stage_step(weights: &Weights, synth: &mut aurora_synth::Synth) -> (Staged, Vec<u8>) {
        let base = aurora_checkpoint::safetensors_bytes(&synth.export()).unwrap();
        let version = synth.version();
        synth.step();
        let target = aurora_checkpoint::safetensors_bytes(&synth.export()).unwrap();
        let options = ExtractOptions {
            base_version: version,
            target_version: version + 1,
            segment_target_bytes: 256,
            ..ExtractOptions::default()
        };
        let (_, artifact) = Extraction::new(
            &Checkpoint::from_safetensors(&base).unwrap(),
            &Checkpoint::from_safetensors(&target).unwrap(),
            options,
        )
        .unwrap()
        .to_bytes()
        .unwrap();
        let file = DeltaFile::parse(&artifact).unwrap();
        assert!(file.segment_count() > 1);
        let segments: Vec<SpilledChunks> = (0..file.segment_count())
            .rev()
            .map(|index| {
                let segment = file.verify_segment(index).unwrap();
                weights
                    .decode_segment(ArtifactKind::Delta, file.header(), index as u32, segment)
                    .unwrap()
            })
            .collect();
        assert!(segments.iter().any(|chunks| !chunks.is_empty()));
        let patch = SpilledPatch::new(file.header().clone(), segments).unwrap();
        (Staged::Patch(patch), target)
    }

    #[test]
    fn deltas_staged_in_files_activate_bit_exact_step_after_step() {
        let shape = aurora_synth::preset("tiny").unwrap();
        let mut synth = aurora_synth::Synth::new(aurora_synth::SynthConfig::new(shape, 5));
        let dir = tempfile::tempdir().unwrap();
        let image = aurora_checkpoint::safetensors_bytes(&synth.export()).unwrap();
        let mut weights = Weights::from_checkpoint(
            &Checkpoint::from_safetensors(&image).unwrap(),
            synth.version(),
            Arc::new(aurora_checkpoint::FileImages::new(dir.path())),
        )
        .unwrap();
        for _ in 0..3 {
            let (staged, target) = stage_step(&weights, &mut synth);
            let hash = weights.activate(staged).unwrap();
            assert_eq!(
                weights.active(),
                VersionRef {
                    version: synth.version(),
                    hash
                }
            );
            assert!(
                weights.image() == target.as_slice(),
                "version {}",
                synth.version()
            );
            assert!(
                weights.staging.get_mut().unwrap().is_none(),
                "the spill goes with the activation"
            );
        }
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "unnamed files"
        );
    }

    #[test]
    fn a_snapshot_decoded_against_no_weights_activates_into_the_exported_image() {
        let (image, artifact) = snapshot();
        let file = DeltaFile::parse(&artifact).unwrap();
        assert!(file.segment_count() > 1);
        let mut weights = Weights::empty(Arc::new(Heap));
        assert!(weights.is_empty());
        let staged = decode_all(&weights, &file);
        assert_eq!(staged.changed_tensors().len(), file.header().tensors.len());
        let hash = weights.activate(staged).unwrap();
        assert_eq!(hash, file.header().target_hash);
        assert_eq!(weights.active(), VersionRef { version: 7, hash });
        assert!(weights.image() == image.as_slice(), "byte for byte");
        assert!(!weights.is_empty());

        // Weights that hold tensors are no base for a snapshot.
        let segment = file.verify_segment(0).unwrap();
        let error = weights
            .decode_segment(ArtifactKind::Snapshot, file.header(), 0, segment)
            .unwrap_err();
        assert!(matches!(error, DeltaError::BaseMismatch(_)), "{error}");
        // Nor is a snapshot's header a delta: offered as one, it is refused by version.
        let error = Weights::empty(Arc::new(Heap))
            .decode_segment(ArtifactKind::Delta, file.header(), 0, segment)
            .unwrap_err();
        assert!(
            error.to_string().contains("starts from version 7"),
            "{error}"
        );
    }

    /// A panic while the version is written is an error that says whether the copy
    /// survived it: untouched, the version before stays; written, the weights are lost.
    #[test]
    fn a_panicking_activation_is_named_and_says_whether_the_weights_survived() {
        let shape = aurora_synth::preset("tiny").unwrap();
        let mut synth = aurora_synth::Synth::new(aurora_synth::SynthConfig::new(shape, 9));
        let image = aurora_checkpoint::safetensors_bytes(&synth.export()).unwrap();
        let mut weights = Weights::new(image.clone(), synth.version()).unwrap();
        let before = weights.active();

        let error = weights
            .catching_panics(|_| panic!("a bug before any write"))
            .unwrap_err();
        assert!(!error.lost_weights(), "{error}");
        assert!(
            error.to_string().contains("a bug before any write"),
            "{error}"
        );
        assert_eq!(weights.active(), before);

        let (staged, _) = stage_step(&weights, &mut synth);
        let error = weights
            .catching_panics(|weights| {
                let first = weights.layout[0].bytes.start;
                weights.image[first] ^= 0xFF;
                drop(staged);
                panic!("{} half written", "a version")
            })
            .unwrap_err();
        assert!(error.lost_weights(), "{error}");
        assert!(
            error.to_string().contains("a version half written"),
            "{error}"
        );
        assert!(weights.emptied().is_empty());

        // An undo that failed too: lost where the image is no longer the version before,
        // an ordinary failure where it still is.
        let restore_failed = || DeltaError::RestoreFailed {
            error: Box::new(DeltaError::Malformed("a write".into())),
            undo: Box::new(DeltaError::Malformed("its undo".into())),
        };
        let error = weights
            .catching_panics(|_| Err(restore_failed()))
            .unwrap_err();
        assert!(matches!(error, EffectError::WeightsLost(_)), "{error}");
        let mut intact = Weights::new(image.clone(), 3).unwrap();
        let error = intact
            .catching_panics(|_| Err(restore_failed()))
            .unwrap_err();
        assert!(!error.lost_weights(), "{error}");

        // Without a panic, the version lands as it would without the catch.
        let image = aurora_checkpoint::safetensors_bytes(&synth.export()).unwrap();
        let mut weights = Weights::new(image, synth.version()).unwrap();
        let (staged, target) = stage_step(&weights, &mut synth);
        let hash = weights.activate_catching_panics(staged).unwrap();
        assert_eq!(weights.active().hash, hash);
        assert!(weights.image() == target.as_slice());
    }

    #[test]
    fn a_snapshot_that_does_not_reach_its_target_leaves_the_weights_empty() {
        let (_, artifact) = snapshot();
        let file = DeltaFile::parse(&artifact).unwrap();
        // One segment never written: the image misses its target.
        let mut weights = Weights::empty(Arc::new(Heap));
        for index in 1..file.segment_count() {
            let segment = file.verify_segment(index).unwrap();
            weights
                .decode_segment(ArtifactKind::Snapshot, file.header(), index as u32, segment)
                .unwrap();
        }
        let error = weights
            .activate(Staged::Snapshot(Arc::new(file.header().clone())))
            .unwrap_err();
        assert!(
            matches!(error, DeltaError::TargetMismatch { .. }),
            "{error}"
        );
        assert!(weights.is_empty());
        // Nothing decoded at all.
        let error = weights
            .activate(Staged::Snapshot(Arc::new(file.header().clone())))
            .unwrap_err();
        assert!(
            error
                .to_string()
                .contains("no segment of the snapshot of version 7"),
            "{error}"
        );
    }
}
