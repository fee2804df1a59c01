//! Why an effect a driver carried out for a node failed: the typed outcome of
//! [`crate::Output::Decode`], [`crate::Output::Verify`] and [`crate::Output::Activate`],
//! which the node turns into the refusal it reports.

use std::sync::Arc;

use aurora_delta::DeltaError;

#[derive(Debug, Clone, thiserror::Error)]
pub enum EffectError {
    /// The delta or the weights did not do what they must: a segment that does not
    /// decode, a target hash that does not match, a spill that cannot be read.
    #[error(transparent)]
    Delta(Arc<DeltaError>),
    /// The driver no longer held what the effect needed.
    #[error("the staged patch is {0}")]
    Patch(PatchState),
    /// Segment `index` of the artifact being staged failed to decode.
    #[error("segment {index}: {error}")]
    Segment { index: u32, error: Box<EffectError> },
    /// An engine that took a version's changes first still held the weights it ran
    /// before this long after: the node's copy of them could not take the version.
    #[error(
        "the engine still held the weights it ran before {0:?} after it took the version's changes: the node's copy cannot take them"
    )]
    EngineHeld(std::time::Duration),
    /// Writing the version into the node's copy panicked (a bug, named rather than
    /// left to end the task that held the weights). `intact`: the copy still hashes to
    /// the version it held before, which stays active; otherwise the copy is no
    /// version's, and the node rejoins from a snapshot.
    #[error("activating panicked: {message}; {}", if *intact {
        "the node's copy is as it was"
    } else {
        "the node's copy is no longer any version's: it rejoins from a snapshot"
    })]
    ActivationPanicked { message: String, intact: bool },
    /// A write that failed could not be undone either, and the node's copy no longer
    /// hashes to the version it held: the node rejoins from a snapshot.
    #[error("{0}; the node's copy is no longer any version's: it rejoins from a snapshot")]
    WeightsLost(Arc<DeltaError>),
}

impl EffectError {
    /// The node's weights were lost with this failure: nothing may read them again.
    pub fn lost_weights(&self) -> bool {
        matches!(
            self,
            EffectError::ActivationPanicked { intact: false, .. } | EffectError::WeightsLost(_)
        )
    }
}

/// Where a staged patch was when an effect needed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchState {
    /// A decode of it is still out, or its weights are shared.
    NotReady,
    /// Another version replaced it.
    Gone,
}

impl std::fmt::Display for PatchState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PatchState::NotReady => "not ready",
            PatchState::Gone => "gone",
        })
    }
}

impl From<DeltaError> for EffectError {
    fn from(error: DeltaError) -> EffectError {
        EffectError::Delta(Arc::new(error))
    }
}
