//! The engine boundary: where an actor's rollout engine meets the transport.
//!
//! The transport stages deltas while the engine generates, then activates a committed
//! version at the engine's next safe point (the end of its current batch): it waits for
//! [`Engine::safe_point`], writes the new weights, and hands them over with
//! [`Engine::activate`]. Between the two the engine generates nothing, so rollouts never
//! see a mix of versions. An engine that writes changed elements may take them first
//! ([`Engine::takes_changes_first`]): it serves the version one pass over memory sooner,
//! and the node's own copy takes the changes once the engine let go of it.

use std::future::Future;
use std::sync::{Arc, Mutex};

use aurora_delta::ChangeSet;
use aurora_proto::{VersionRef, Weights};

pub trait Engine: Send + Sync + 'static {
    /// Resolves once the engine is between batches; it then holds its next batch back
    /// until [`Engine::activate`] has the new weights.
    fn safe_point(&self) -> impl Future<Output = ()> + Send + '_;

    /// The new weights (a safetensors image, already verified against the hash of
    /// `weights.active()`), while the engine is paused at its safe point, or at once for
    /// the snapshot a joining node starts from. `changed` says what differs from the
    /// weights the engine ran before (every tensor of a snapshot, whole; nothing when a
    /// failed activation left the old weights): tensors, or their changed elements if
    /// [`Engine::writes_elements`]. The engine may read `weights`
    /// after returning, while it loads them, but must let go of them before its next
    /// safe point resolves: the next activation writes them in place.
    fn activate(&self, weights: Arc<Weights>, changed: ChangeSet);

    /// The activation the engine is paused for failed and took the node's weights with
    /// it (a panic midway through writing them), so nothing may read them: the engine
    /// carries on with what it runs, `active` (the version before), while the node
    /// rejoins from a snapshot.
    fn resume(&self, active: VersionRef);

    /// Whether the engine writes changed elements in place, so an activation lists them
    /// (O(changes) to gather); otherwise it names changed tensors only.
    fn writes_elements(&self) -> bool {
        false
    }

    /// Whether the engine takes a verified version's changed elements before the node
    /// writes them into its own copy ([`Engine::activate_changes_first`]). Only an engine
    /// that [`Engine::writes_elements`] can.
    fn takes_changes_first(&self) -> bool {
        false
    }

    /// Like [`Engine::activate`] for an engine that [`Engine::takes_changes_first`]:
    /// `changed` holds the changed elements of `version`, the new values among them, to
    /// lay over `before` (the weights the engine runs now). Once the engine has let go
    /// of `before` ([`Engine::released`]) the node writes the changes into it. If that
    /// fails, or the engine still holds `before` after
    /// [`crate::NodeConfig::release_timeout`], the version fails and the node hands
    /// `before` back with [`Engine::activate`], naming every tensor the version changed,
    /// so that the engine runs what the node holds.
    fn activate_changes_first(
        &self,
        before: Arc<Weights>,
        version: VersionRef,
        changed: ChangeSet,
    ) {
        // Called only where `takes_changes_first` said yes: an engine that did not has
        // its activations after the node's copy, through `activate`.
        let _ = (before, version, changed);
        unreachable!("changes handed first to an engine that does not take them so");
    }

    /// Resolves once the engine holds nothing of the weights it was handed last.
    fn released(&self) -> impl Future<Output = ()> + Send + '_ {
        std::future::ready(())
    }
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

    fn activate(&self, weights: Arc<Weights>, _changed: ChangeSet) {
        debug_assert!(!weights.is_empty());
        self.activations
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .push(weights.active());
    }

    fn resume(&self, _active: VersionRef) {}
}
