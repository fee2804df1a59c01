//! An engine that takes each version's changed elements before the node's copy
//! ([`Engine::takes_changes_first`]): what it is handed reproduces the version, the node's
//! copy follows once it lets go, and an engine that does not let go costs the version,
//! not the node.

use std::sync::Mutex;

use aurora_delta::ChangeSet;
use aurora_proto::{VersionRef, Weights};
use aurora_transport::Engine;

use super::*;

/// Lays every version's changes over the weights it was handed and records the version
/// the result hashes to; while `keep` is set it holds on to those weights until
/// [`ChangesFirst::let_go`].
#[derive(Default)]
struct ChangesFirst {
    keep: std::sync::atomic::AtomicBool,
    kept: Mutex<Vec<Arc<Weights>>>,
    let_go: tokio::sync::Notify,
    /// The version each set of changes reproduced, laid over the weights handed with it.
    reproduced: Mutex<Vec<VersionRef>>,
    /// Weights handed back whole by the node, and the tensors it named.
    handed_back: Mutex<Vec<(VersionRef, Vec<String>)>>,
}

impl ChangesFirst {
    fn let_go(&self) {
        self.keep.store(false, std::sync::atomic::Ordering::SeqCst);
        self.kept.lock().unwrap().clear();
        self.let_go.notify_waiters();
    }
}

impl Engine for ChangesFirst {
    /// Not while it holds the weights it ran before: the next activation writes them (as
    /// `aurora_node`'s handoff refuses its safe point).
    async fn safe_point(&self) {
        self.released().await;
    }

    fn activate(&self, weights: Arc<Weights>, changed: ChangeSet) {
        let names = changed.tensors.into_iter().map(|t| t.name).collect();
        self.handed_back
            .lock()
            .unwrap()
            .push((weights.active(), names));
    }

    fn resume(&self, _active: VersionRef) {}

    fn writes_elements(&self) -> bool {
        true
    }

    fn takes_changes_first(&self) -> bool {
        true
    }

    fn activate_changes_first(
        &self,
        before: Arc<Weights>,
        version: VersionRef,
        changed: ChangeSet,
    ) {
        let mut image = before.image().to_vec();
        for tensor in &changed.tensors {
            let layout = before
                .layout()
                .iter()
                .find(|l| l.name == tensor.name)
                .unwrap();
            let elements = tensor
                .elements
                .as_ref()
                .expect("changed elements, not tensors");
            let size = layout.dtype.size_bytes();
            for (index, value) in elements.indices.iter().zip(elements.values.chunks(size)) {
                let at = layout.bytes.start + *index as usize * size;
                image[at..at + size].copy_from_slice(value);
            }
        }
        let laid_over = Weights::new(image, version.version).unwrap().active();
        self.reproduced.lock().unwrap().push(laid_over);
        if self.keep.load(std::sync::atomic::Ordering::SeqCst) {
            self.kept.lock().unwrap().push(before);
        }
    }

    async fn released(&self) {
        loop {
            let let_go = self.let_go.notified();
            if self.kept.lock().unwrap().is_empty() {
                return;
            }
            let_go.await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_taking_changes_first_is_handed_each_version_and_the_node_follows() {
    let chain = Chain::new(3, 29);
    let hub = hub(None).await;
    let engine = Arc::new(ChangesFirst::default());
    let config = actor_config(&hub, "a1", &[hub.local_addr().unwrap()]);
    let actor = spawn_actor(config, chain.weights(0), engine.clone())
        .await
        .unwrap();
    for version in 1..=3 {
        chain.publish_live(&hub, version).await;
        // The node's copy took the changes too: its hash is the version's.
        let status = active_at(&actor, version, "a1").await;
        assert_eq!(status.active, Some(chain.at(version)));
    }
    let reproduced: Vec<VersionRef> = (1..=3).map(|v| chain.at(v)).collect();
    assert_eq!(*engine.reproduced.lock().unwrap(), reproduced);
    assert!(engine.handed_back.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_keeps_the_weights_it_ran_fails_the_version_and_runs_the_copy_again() {
    let chain = Chain::new(1, 31);
    let hub = hub(None).await;
    let engine = Arc::new(ChangesFirst::default());
    engine.keep.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut config = actor_config(&hub, "a1", &[hub.local_addr().unwrap()]);
    config.release_timeout = Duration::from_millis(200);
    let actor = spawn_actor(config, chain.weights(0), engine.clone())
        .await
        .unwrap();
    chain.publish_live(&hub, 1).await;
    let status = within(
        LIMIT,
        "the activation fails",
        actor.wait_for(|s| s.failed_activations > 0),
    )
    .await
    .unwrap();
    assert_eq!(
        status.active,
        Some(chain.at(0)),
        "the node's copy is untouched"
    );
    let why = status.last_failed_activation.as_deref().unwrap_or_default();
    assert!(
        why.starts_with("version 1: ") && why.contains("still held the weights"),
        "{why}"
    );
    assert_eq!(engine.reproduced.lock().unwrap()[0], chain.at(1));
    // The engine runs what the node holds again: every tensor the version changed.
    let handed_back = engine.handed_back.lock().unwrap().clone();
    let (before, after) = (chain.weights(0), chain.weights(1));
    let bytes_of = |weights: &Weights, name: &str| {
        let layout = weights.layout().iter().find(|l| l.name == name).unwrap();
        weights.image()[layout.bytes.clone()].to_vec()
    };
    let mut changed: Vec<String> = before
        .layout()
        .iter()
        .filter(|l| bytes_of(&before, &l.name) != bytes_of(&after, &l.name))
        .map(|l| l.name.clone())
        .collect();
    changed.sort();
    let mut named = handed_back[0].1.clone();
    named.sort();
    assert_eq!(handed_back[0].0, chain.at(0));
    assert_eq!(named, changed);
    // Once the engine lets go, the version is taken again.
    engine.let_go();
    let status = active_at(&actor, 1, "a1 after the engine let go").await;
    assert_eq!(status.active, Some(chain.at(1)));
}
