//! The engine boundary for an engine driven from outside the runtime.
//!
//! The transport asks for a safe point when it has a committed version to activate, and
//! hands the new weights over once they are in (docs: `aurora_transport::Engine`). An
//! inference loop written in Python cannot await that: it calls
//! [`Handoff::at_safe_point`] between its batches instead. If the transport is waiting
//! for a safe point, the call lets it proceed and blocks until the activated weights come
//! back, which the loop then loads into its engine before the next batch; if not, the
//! call returns at once, so generation never waits for a version that is not ready.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use aurora_delta::ChangeSet;
use aurora_proto::{VersionRef, Weights};
use aurora_transport::Engine;

use crate::NodeError;

/// Longest wait for the weights of an activation the driver let start: applying a delta
/// in place takes seconds even for the largest models; this bounds a stuck transport.
const ACTIVATION_TIMEOUT: Duration = Duration::from_secs(600);

/// Weights the transport activated, for the engine to load. Until this and every
/// [`Activation::guard`] made from it are dropped, the next activation waits (and, where
/// the changes came first, the node's copy waits for them).
pub struct Activation {
    /// The version the engine is to run, and its weights hash.
    pub active: VersionRef,
    /// The whole image of `active` (its hash checked by the transport); where
    /// `changes_first`, the image of the version the engine runs now, which `changed`'s
    /// elements make `active`.
    pub weights: Arc<Weights>,
    /// What changed from the weights the engine ran before (every tensor of the snapshot
    /// a node joins from, whole; nothing after a failed activation, which left the old
    /// weights): changed elements where the handoff was made for an engine that writes
    /// them ([`Handoff::writing_elements`]).
    pub changed: ChangeSet,
    /// The changes come before the node's copy has them ([`Engine::takes_changes_first`]).
    pub changes_first: bool,
    /// Counts the driver's holds (the transport holds the weights too).
    held: Arc<Held>,
}

/// The driver's hold on an activation: its end wakes a transport waiting to write the
/// weights ([`Engine::released`]).
struct Held(Arc<tokio::sync::Notify>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

impl Activation {
    /// Keeps the weights alive, and the next activation waiting, while it lives: for a
    /// view of the weights that outlives this value.
    pub fn guard(&self) -> ActivationGuard {
        ActivationGuard {
            _weights: self.weights.clone(),
            _held: self.held.clone(),
        }
    }
}

/// See [`Activation::guard`].
#[derive(Clone)]
pub struct ActivationGuard {
    // Dropped before the hold, so that the weights are free when the hold's end says so.
    _weights: Arc<Weights>,
    _held: Arc<Held>,
}

impl std::fmt::Debug for Activation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Activation")
            .field("active", &self.active)
            .field("changed", &self.changed.tensors.len())
            .finish()
    }
}

#[derive(Default)]
pub struct Handoff {
    /// The driver's engine writes changed elements in place.
    writes_elements: bool,
    /// ... and takes them before the node's copy ([`Engine::takes_changes_first`]).
    changes_first: bool,
    /// Woken when the driver's last hold on an activation ends.
    released: Arc<tokio::sync::Notify>,
    state: Mutex<State>,
    /// Wakes the engine's driver when weights arrive.
    arrived: Condvar,
    /// Wakes the transport's safe-point wait.
    resume: tokio::sync::Notify,
}

#[derive(Default)]
struct State {
    /// The transport waits for a safe point.
    transport_waiting: bool,
    /// The driver reached one and lets the transport go on.
    resumed: bool,
    /// Activated weights not yet taken by the driver.
    pending: Option<Activation>,
    /// The driver's holds on the weights it took last: the next activation writes them
    /// in place, so it waits until the driver has let go of them.
    taken: Weak<Held>,
}

impl Handoff {
    pub fn new() -> Arc<Handoff> {
        Arc::new(Handoff::default())
    }

    /// A handoff whose activations list the changed elements of every tensor a delta
    /// changes, for an engine that writes them in place; with `changes_first`, handed
    /// over before the node's copy has them, for an engine that reads no tensor of the
    /// image it does not load whole ([`Activation::changes_first`]).
    pub fn writing_elements(changes_first: bool) -> Arc<Handoff> {
        Arc::new(Handoff {
            writes_elements: true,
            changes_first,
            ..Handoff::default()
        })
    }

    fn hand_over(
        &self,
        active: VersionRef,
        weights: Arc<Weights>,
        changed: ChangeSet,
        changes_first: bool,
    ) {
        self.lock().pending = Some(Activation {
            active,
            weights,
            changed,
            changes_first,
            held: Arc::new(Held(self.released.clone())),
        });
        self.arrived.notify_all();
    }

    /// Called by the engine's driver between batches. Returns weights to load before the
    /// next batch: ones activated since the last call (such as the snapshot a joining
    /// node starts from), or those of an activation the transport asks a safe point for
    /// within `wait`, which this call lets proceed and waits for. Returns None when no
    /// activation starts within `wait` (zero: at once). Refuses while the weights it
    /// returned last are still held: the next activation writes them in place.
    pub fn at_safe_point(&self, wait: Duration) -> Result<Option<Activation>, NodeError> {
        let mut state = self.lock();
        if state.taken.strong_count() > 0 {
            return Err(NodeError::ActivationStillHeld);
        }
        state = self
            .arrived
            .wait_timeout_while(state, wait, |state| {
                state.pending.is_none() && !state.transport_waiting
            })
            .unwrap_or_else(|poison| poison.into_inner())
            .0;
        if state.pending.is_none() {
            if !state.transport_waiting {
                return Ok(None);
            }
            state.resumed = true;
            self.resume.notify_one();
            state = self
                .arrived
                .wait_timeout_while(state, ACTIVATION_TIMEOUT, |state| state.pending.is_none())
                .unwrap_or_else(|poison| poison.into_inner())
                .0;
        }
        let Some(activation) = state.pending.take() else {
            return Err(NodeError::Timeout {
                what: "the activation of a committed version".into(),
                timeout: ACTIVATION_TIMEOUT,
            });
        };
        state.taken = Arc::downgrade(&activation.held);
        Ok(Some(activation))
    }

    /// Waits up to `timeout` for the first weights (a joining node's snapshot) without
    /// taking them; the next [`Handoff::at_safe_point`] returns them.
    pub fn wait_for_weights(&self, timeout: Duration) -> Result<(), NodeError> {
        let state = self
            .arrived
            .wait_timeout_while(self.lock(), timeout, |state| state.pending.is_none())
            .unwrap_or_else(|poison| poison.into_inner())
            .0;
        match state.pending {
            Some(_) => Ok(()),
            None => Err(NodeError::Timeout {
                what: "the snapshot to join from".into(),
                timeout,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

impl Engine for Handoff {
    async fn safe_point(&self) {
        self.lock().transport_waiting = true;
        self.arrived.notify_all();
        loop {
            // Registered before the check, so a resume between the two is not lost.
            let resumed = self.resume.notified();
            {
                let mut state = self.lock();
                if state.resumed {
                    state.resumed = false;
                    state.transport_waiting = false;
                    return;
                }
            }
            resumed.await;
        }
    }

    fn activate(&self, weights: Arc<Weights>, changed: ChangeSet) {
        self.hand_over(weights.active(), weights, changed, false);
    }

    /// The driver is handed nothing to load: an Activation of the version it runs, over
    /// no weights.
    fn resume(&self, active: VersionRef) {
        let nothing = Arc::new(Weights::empty(Arc::new(aurora_delta::Heap)));
        self.hand_over(active, nothing, ChangeSet::default(), false);
    }

    fn writes_elements(&self) -> bool {
        self.writes_elements
    }

    fn takes_changes_first(&self) -> bool {
        self.changes_first
    }

    fn activate_changes_first(
        &self,
        before: Arc<Weights>,
        version: VersionRef,
        changed: ChangeSet,
    ) {
        self.hand_over(version, before, changed, true);
    }

    async fn released(&self) {
        loop {
            // Registered before the check, so a release between the two is not lost.
            let released = self.released.notified();
            {
                let state = self.lock();
                if state.pending.is_none() && state.taken.strong_count() == 0 {
                    return;
                }
            }
            released.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights() -> Arc<Weights> {
        Arc::new(Weights::empty(Arc::new(aurora_delta::Heap)))
    }

    #[test]
    fn nothing_to_activate_returns_at_once() {
        let handoff = Handoff::new();
        assert!(handoff.at_safe_point(Duration::ZERO).unwrap().is_none());
    }

    #[test]
    fn weights_activated_without_a_safe_point_are_taken_at_the_next_one() {
        let handoff = Handoff::new();
        handoff.activate(weights(), ChangeSet::whole(vec!["a".into()]));
        handoff.wait_for_weights(Duration::ZERO).unwrap();
        let taken = handoff.at_safe_point(Duration::ZERO).unwrap().unwrap();
        assert_eq!(taken.changed.names(), ["a"]);
        // Held, through a guard: the next safe point is refused until it is released.
        let guard = taken.guard();
        drop(taken);
        handoff.activate(weights(), ChangeSet::default());
        let error = handoff.at_safe_point(Duration::ZERO).unwrap_err();
        assert!(matches!(error, NodeError::ActivationStillHeld), "{error}");
        drop(guard);
        assert!(handoff.at_safe_point(Duration::ZERO).unwrap().is_some());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiting_transport_resumes_and_hands_back_its_weights() {
        let handoff = Handoff::new();
        let transport = {
            let handoff = handoff.clone();
            tokio::spawn(async move {
                handoff.safe_point().await;
                handoff.activate(weights(), ChangeSet::whole(vec!["w".into()]));
            })
        };
        let driver = handoff.clone();
        let taken = tokio::task::spawn_blocking(move || {
            driver
                .at_safe_point(Duration::from_secs(60))
                .unwrap()
                .unwrap()
        })
        .await
        .unwrap();
        assert_eq!(taken.changed.names(), ["w"]);
        transport.await.unwrap();
    }

    /// Changes that come first: the driver gets the version to run over the weights it
    /// runs now, and the transport's wait for them ends only once the driver let go of
    /// the activation and every view made from it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn changes_first_are_released_only_when_the_driver_let_go() {
        let handoff = Handoff::writing_elements(true);
        assert!(handoff.takes_changes_first() && handoff.writes_elements());
        let target = VersionRef {
            version: 7,
            hash: aurora_delta::Hash::of(b"seven"),
        };
        handoff.activate_changes_first(weights(), target, ChangeSet::whole(vec!["w".into()]));
        let released = {
            let handoff = handoff.clone();
            tokio::spawn(async move { handoff.released().await })
        };
        let driver = handoff.clone();
        let (taken, guard) = tokio::task::spawn_blocking(move || {
            let taken = driver.at_safe_point(Duration::ZERO).unwrap().unwrap();
            let guard = taken.guard();
            (taken, guard)
        })
        .await
        .unwrap();
        assert!(taken.changes_first);
        assert_eq!(taken.active, target);
        drop(taken);
        tokio::task::yield_now().await;
        assert!(!released.is_finished(), "a view still holds the weights");
        drop(guard);
        released.await.unwrap();
        // Nothing held: it resolves at once.
        handoff.released().await;
    }

    #[test]
    fn no_activation_within_the_wait_is_none() {
        let handoff = Handoff::new();
        assert!(
            handoff
                .at_safe_point(Duration::from_millis(1))
                .unwrap()
                .is_none()
        );
    }
}
