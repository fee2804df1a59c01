//! Bringing a restarted trainer back to the version it published last.
//!
//! A trainer keeps its own state now and then (`TrainerData::State`) and, before each
//! version is trained, the rollouts it is trained on (`TrainerData::Rollouts`). After a
//! crash it restores the newest state at or below the latest published version and
//! trains every later version again on its kept rollouts. Training is deterministic, so
//! each version must come out with the weights hash it was published with; one that does
//! not is refused, since publishing it would give one version two contents. What
//! training means is the caller's ([`Retraining`]); the order, the store reads and the
//! checks are here, so `aurora run` and the Python trainer recover the same way.

use aurora_delta::Hash;
use aurora_store::{StoreError, TrainerData};

use crate::TrainerNode;

/// What the caller's steps of [`Retraining`] fail with (its own error, boxed; downcast
/// to get it back).
pub type RetrainingError = Box<dyn std::error::Error + Send + Sync>;

/// The caller's side of [`TrainerNode::recover`].
pub trait Retraining {
    /// The trainer being brought back.
    type Trainer;

    /// The trainer as it was when it published `version`, from the state it kept then.
    fn restore(&mut self, version: u64, state: Vec<u8>) -> Result<Self::Trainer, RetrainingError>;

    /// Trains `trainer` once more into `version`, on the rollouts it was trained on.
    fn retrain(
        &mut self,
        trainer: &mut Self::Trainer,
        version: u64,
        rollouts: Vec<u8>,
    ) -> Result<(), RetrainingError>;

    /// The weights hash of what `trainer` would publish as `version` now.
    fn weights_hash(
        &mut self,
        trainer: &mut Self::Trainer,
        version: u64,
    ) -> Result<Hash, RetrainingError>;
}

/// A trainer brought back by [`TrainerNode::recover`].
#[derive(Debug)]
pub struct Recovered<T> {
    /// The trainer as it was when it published `version`.
    pub trainer: T,
    /// The latest published version: the next one is trained from here.
    pub version: u64,
    /// The version of the state it was restored from; those after it were trained again.
    pub restored_from: u64,
}

/// Why a trainer could not be brought back.
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error("nothing is published in this store: there is no version to recover")]
    NothingPublished,
    #[error(
        "no trainer state is kept at or below version {latest}: keep one with the first version"
    )]
    NoState { latest: u64 },
    /// Reading `what` from the store failed.
    #[error("reading the {what} from the store")]
    Store { what: String, source: StoreError },
    #[error(
        "version {version} was published with weights {published}, and the trainer reproduces {produced}: was its configuration or its data changed?"
    )]
    NotReproduced {
        version: u64,
        published: Hash,
        produced: Hash,
    },
    /// One of the caller's steps ([`Retraining`]) failed.
    #[error("{doing} version {version}")]
    Retraining {
        doing: &'static str,
        version: u64,
        source: RetrainingError,
    },
}

impl TrainerNode {
    /// Brings a restarted trainer back to the latest published version (see the
    /// module): the newest state kept at or below it, restored, then every later version
    /// trained again on its kept rollouts, each checked against the weights hash it was
    /// published with. Blocks its thread.
    pub fn recover<R: Retraining>(
        &self,
        retraining: &mut R,
    ) -> Result<Recovered<R::Trainer>, RecoverError> {
        let store = self.store();
        let read = |what: String| move |source: StoreError| RecoverError::Store { what, source };
        let latest = store
            .latest_version()
            .map_err(read("latest version".into()))?
            .ok_or(RecoverError::NothingPublished)?;
        let restored_from = *store
            .trainer_data_records(TrainerData::State)
            .map_err(read("trainer states".into()))?
            .range(..=latest)
            .next_back()
            .ok_or(RecoverError::NoState { latest })?
            .0;
        let published = store
            .weights_hashes()
            .map_err(read("weights hashes".into()))?;
        let state = store
            .trainer_data(TrainerData::State, restored_from)
            .map_err(read(format!("trainer state of version {restored_from}")))?;
        let failed = |doing: &'static str, version: u64| {
            move |source| RecoverError::Retraining {
                doing,
                version,
                source,
            }
        };
        let mut trainer = retraining
            .restore(restored_from, state)
            .map_err(failed("restoring the state of", restored_from))?;
        for version in restored_from..=latest {
            if version > restored_from {
                let rollouts = store
                    .trainer_data(TrainerData::Rollouts, version)
                    .map_err(read(format!("rollouts of version {version}")))?;
                retraining
                    .retrain(&mut trainer, version, rollouts)
                    .map_err(failed("training again into", version))?;
                tracing::info!(version, "trained again after a restart");
            }
            let produced = retraining
                .weights_hash(&mut trainer, version)
                .map_err(failed("exporting", version))?;
            let published = published.get(&version).copied().ok_or_else(|| {
                read(format!("weights hash of version {version}"))(StoreError::NotFound {
                    kind: "weights hash",
                    version,
                })
            })?;
            if produced != published {
                return Err(RecoverError::NotReproduced {
                    version,
                    published,
                    produced,
                });
            }
        }
        Ok(Recovered {
            trainer,
            version: latest,
            restored_from,
        })
    }
}

#[cfg(test)]
mod tests {
    use aurora_delta::{Checkpoint, Dtype, TensorView};

    use super::*;
    use crate::trainer::tests::started;

    /// A deterministic trainer of eight F32 weights: each step adds the rollouts' bytes
    /// times its rate.
    struct Linear {
        rate: f32,
    }

    fn bytes(weights: &[f32]) -> Vec<u8> {
        weights.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    fn checkpoint(data: &[u8]) -> Checkpoint<'_> {
        let tensor = TensorView {
            name: "w".into(),
            dtype: Dtype::F32,
            shape: vec![(data.len() / 4) as u64],
            data,
        };
        Checkpoint::new(vec![tensor]).unwrap()
    }

    impl Retraining for Linear {
        type Trainer = Vec<f32>;

        fn restore(&mut self, _: u64, state: Vec<u8>) -> Result<Vec<f32>, RetrainingError> {
            Ok(state
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect())
        }

        fn retrain(
            &mut self,
            weights: &mut Vec<f32>,
            _: u64,
            rollouts: Vec<u8>,
        ) -> Result<(), RetrainingError> {
            for (weight, rollout) in weights.iter_mut().zip(rollouts) {
                *weight += self.rate * f32::from(rollout);
            }
            Ok(())
        }

        fn weights_hash(
            &mut self,
            weights: &mut Vec<f32>,
            _: u64,
        ) -> Result<Hash, RetrainingError> {
            Ok(checkpoint(&bytes(weights)).weights_hash())
        }
    }

    fn rollouts(version: u64) -> Vec<u8> {
        (0..8).map(|i| version as u8 * 3 + i).collect()
    }

    /// Publishes versions 0 to `latest` from `node`, keeping each version's rollouts
    /// before training it and the trainer's state at the versions in `states`; then
    /// trains one more version and crashes before publishing it. Returns the weights of
    /// `latest`. Blocks its thread.
    fn published(node: &TrainerNode, latest: u64, states: &[u64]) -> Vec<f32> {
        let (store, mut trainer) = (node.store(), Linear { rate: 0.5 });
        let mut weights = vec![1.0f32; 8];
        node.publish_first(0, &checkpoint(&bytes(&weights)))
            .unwrap();
        for version in 0..=latest + 1 {
            if version > 0 {
                store
                    .put_trainer_data(TrainerData::Rollouts, version, &rollouts(version))
                    .unwrap();
                let before = weights.clone();
                trainer
                    .retrain(&mut weights, version, rollouts(version))
                    .unwrap();
                if version > latest {
                    return before;
                }
                node.publish(&checkpoint(&bytes(&before)), &checkpoint(&bytes(&weights)))
                    .unwrap();
            }
            if states.contains(&version) {
                store
                    .put_trainer_data(TrainerData::State, version, &bytes(&weights))
                    .unwrap();
            }
        }
        unreachable!("the loop returns at the crash")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restarted_trainer_comes_back_to_its_latest_version() {
        let (_dir, node) = started().await;
        tokio::task::spawn_blocking(move || {
            let expected = published(&node, 3, &[0, 2]);
            let recovered = node.recover(&mut Linear { rate: 0.5 }).unwrap();
            assert_eq!((recovered.version, recovered.restored_from), (3, 2));
            assert_eq!(recovered.trainer, expected);
        })
        .await
        .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_trainer_that_trains_otherwise_is_refused_at_the_first_version_it_changes() {
        let (_dir, node) = started().await;
        tokio::task::spawn_blocking(move || {
            published(&node, 3, &[0]);
            let error = node.recover(&mut Linear { rate: 0.25 }).unwrap_err();
            assert!(
                matches!(error, RecoverError::NotReproduced { version: 1, .. }),
                "{error}"
            );
        })
        .await
        .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_a_version_or_a_state_there_is_nothing_to_recover() {
        let (_dir, node) = started().await;
        tokio::task::spawn_blocking(move || {
            let error = node.recover(&mut Linear { rate: 0.5 }).unwrap_err();
            assert!(matches!(error, RecoverError::NothingPublished), "{error}");
            published(&node, 2, &[]);
            let error = node.recover(&mut Linear { rate: 0.5 }).unwrap_err();
            assert!(
                matches!(error, RecoverError::NoState { latest: 2 }),
                "{error}"
            );
        })
        .await
        .unwrap();
    }
}
