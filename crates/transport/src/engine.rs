//! The engine boundary: where an actor's rollout engine meets the transport.
//!
//! The transport stages deltas while the engine generates, then activates a committed
//! version at the engine's next safe point (the end of its current batch): it waits for
//! [`Engine::safe_point`], writes the new weights, and hands them over with
//! [`Engine::activate`]. Between the two the engine generates nothing, so rollouts never
//! see a mix of versions.

use std::future::Future;
use std::sync::Mutex;

use aurora_proto::VersionRef;

pub trait Engine: Send + Sync + 'static {
    /// Resolves once the engine is between batches; it then holds its next batch back
    /// until [`Engine::activate`] returns.
    fn safe_point(&self) -> impl Future<Output = ()> + Send + '_;

    /// The new weights (a safetensors image, already verified against `version.hash`),
    /// while the engine is paused at its safe point. The engine copies or maps what it
    /// needs, then resumes generating on `version`.
    fn activate(&self, weights: &[u8], version: VersionRef);

    /// Recent generation throughput in tokens per second (reported to the scheduler).
    fn throughput(&self) -> f64;
}

/// An engine that generates nothing: every instant is a safe point. It records what it
/// was given, for tests and for relays that serve no rollouts.
#[derive(Debug, Default)]
pub struct IdleEngine {
    activations: Mutex<Vec<VersionRef>>,
}

impl IdleEngine {
    /// Every version activated so far, in order.
    pub fn activations(&self) -> Vec<VersionRef> {
        self.activations
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone()
    }
}

impl Engine for IdleEngine {
    async fn safe_point(&self) {}

    fn activate(&self, weights: &[u8], version: VersionRef) {
        debug_assert!(!weights.is_empty());
        self.activations
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .push(version);
    }

    fn throughput(&self) -> f64 {
        0.0
    }
}
