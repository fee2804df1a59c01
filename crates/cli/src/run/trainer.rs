//! The trainer node of `aurora run`: the control plane (HTTP API), the transport hub,
//! the checkpoint store and the GRPO trainer in one process.
//!
//! One-step asynchrony: step k (k >= 1) is generated on version k-1 while the trainer
//! turns step k-1's rollouts into version k, extracts the delta and streams it out, so
//! actors stage version k behind their generation. Opening step k+1 commits version k;
//! actors activate it at their next batch boundary. Every completion is a function of
//! (weights, prompt, seed), so which actor generated a prompt, and when, changes nothing:
//! the same seeds give the same weights at every step, delta or full sync.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use aurora_delta::{Checkpoint, Encoding};
use aurora_engine::{Policy, RolloutGroup, TrainStats, Trainer};
use aurora_hub::{Hub, StepResults};
use aurora_node::NodeTrust;
use aurora_node::{Published, Retraining, RetrainingError, TrainerNode, TrainerSettings};
use aurora_store::{Store, TrainerData};
use serde::{Deserialize, Serialize};

use super::config::{RunConfig, SyncMode};
use super::report::{ActorRecord, StepRecord, StepTimes, sync_held_s};
use crate::signals::StopSignals;

/// Longest wait for a step's rollouts: the lease machinery hands the prompts of a dead
/// actor to the others long before.
const STEP_TIMEOUT: Duration = Duration::from_secs(3600);
/// How long a stopped trainer serves on for its actors to leave.
const FLEET_LEAVE_DEADLINE: Duration = Duration::from_secs(30);
/// How long a stopped trainer serves on after its fleet has left.
const ANSWER_GRACE: Duration = Duration::from_millis(200);

pub fn run(run_dir: &Path, listen: Listen, trust: NodeTrust) -> Result<()> {
    let config = RunConfig::load(&run_dir.join("config.toml"))?;
    let settings = TrainerSettings::new(run_dir, trust);
    crate::runtime(Some(2))?.block_on(train(settings, listen, config))
}

/// Where the trainer node listens: a restarted trainer takes the ports it had, so relays
/// and actors find it again where they left it.
#[derive(Debug, Clone, Copy)]
pub struct Listen {
    pub control: SocketAddr,
    pub transport: SocketAddr,
}

/// Every exported version the trainer may still need: the behaviour policy of the
/// rollouts it trains on is one version behind the newest.
#[derive(Default)]
struct Exports {
    bytes: BTreeMap<u64, Arc<Vec<u8>>>,
}

impl Exports {
    fn insert(&mut self, version: u64, bytes: Vec<u8>) {
        self.bytes.insert(version, Arc::new(bytes));
        while self.bytes.len() > 3 {
            self.bytes.pop_first();
        }
    }

    fn get(&self, version: u64) -> Result<Arc<Vec<u8>>> {
        self.bytes
            .get(&version)
            .cloned()
            .with_context(|| format!("version {version} is no longer held"))
    }
}

/// What the store keeps beside version v (as [`TrainerData::Rollouts`]): the rollouts v
/// was trained on and the version that generated them, everything a restarted trainer
/// needs to train v again.
#[derive(Serialize, Deserialize)]
struct TrainedOn {
    behaviour_version: u64,
    groups: Vec<RolloutGroup>,
}

/// A step's rollouts, stored and waiting to be trained into the next version.
struct Pending {
    trained_on: TrainedOn,
    generation_s: f64,
    events: Vec<String>,
}

async fn train(mut settings: TrainerSettings, listen: Listen, config: RunConfig) -> Result<()> {
    let started = Instant::now();
    // Taken at once, so that a stop asked during the warm-up or a resume is not lost.
    let mut stop = StopSignals::of_run_node()?;
    let run_dir: &Path = &settings.dir.clone();
    settings.control_listen = listen.control;
    settings.transport_listen = listen.transport;
    settings.streams = config.streams;
    settings.snapshot_every = config.snapshot_every;
    settings.encoding = match config.sync {
        SyncMode::Delta => Encoding::Aurora,
        SyncMode::Full => Encoding::Dense,
    };
    settings.control = super::control_config();
    settings.signing_key = Some(super::signing_key(run_dir)?);
    // The node opens the store and the control plane's journal as a crash left them, so
    // relays and actors reconnect while the trainer catches up below.
    let node = Arc::new(
        TrainerNode::start(settings)
            .await
            .context("starting the trainer node")?,
    );
    let (hub, store) = (node.hub().clone(), node.store().clone());
    let (control_address, transport_address) = (node.control_address(), node.transport_address());
    let resumed_at = store.latest_version()?;

    let (mut trainer, mut exports, first_step) = match resumed_at {
        None => {
            let trainer = {
                let (config, run_dir) = (config.clone(), run_dir.to_path_buf());
                tokio::task::spawn_blocking(move || super::warmup::warmed_up(&config, &run_dir))
                    .await??
            };
            let mut exports = Exports::default();
            exports.insert(0, trainer.export_bf16()?);
            let (node, base) = (node.clone(), exports.get(0)?);
            tokio::task::spawn_blocking(move || node.publish_first_image(0, base)).await??;
            store.put_trainer_data(TrainerData::State, 0, &trainer.save_state()?)?;
            (trainer, exports, 0)
        }
        Some(latest) => {
            let resuming = Instant::now();
            let (config, node) = (config.clone(), node.clone());
            let (trainer, exports, replayed) =
                tokio::task::spawn_blocking(move || resume(&config, &node)).await??;
            announce(&format!(
                "resumed {}",
                serde_json::json!({
                    "version": latest,
                    "replayed": replayed,
                    "seconds": resuming.elapsed().as_secs_f64(),
                })
            ))?;
            (trainer, exports, latest + 1)
        }
    };
    let base = store.weights_image(0)?;
    announce(&format!("control {control_address}"))?;
    announce(&format!("transport {transport_address}"))?;
    announce(&format!(
        "ready {}",
        serde_json::json!({
            "accuracy": evaluate(&config, &base)?,
            "warmup_s": started.elapsed().as_secs_f64(),
            "parameters": config.model.parameters(),
            "dense_bytes": base.len(),
        })
    ))?;
    let reference = config
        .rl
        .kl_coef
        .gt(&0.0)
        .then(|| Policy::from_safetensors(&config.model, &base))
        .transpose()?;

    // After a restart at version L: if step L was opened, its results train L + 1
    // first (stored before the trainer stopped, or taken from the control plane now);
    // if not, the run goes on by opening it.
    let opened = hub.inspect(|core| core.step_progress().map(|p| p.step.0));
    let (first_step, mut previous) = match resumed_at {
        Some(latest) if latest < config.steps && opened.is_some_and(|s| s >= latest) => (
            latest + 1,
            Some(pending_after_restart(&config, &node, latest + 1).await?),
        ),
        Some(latest) if latest < config.steps => (latest, None),
        _ => (first_step, None),
    };
    let activations: Arc<std::sync::Mutex<BTreeMap<u64, f64>>> = Arc::default();
    for k in first_step..=config.steps {
        if let Some(signal) = stop.asked() {
            return stopped(signal, &trainer, &node).await;
        }
        let mut times = StepTimes::default();
        let opened = Instant::now();
        // Commit the newest version: actors activate it at their next batch boundary,
        // and only then can they stage the one trained below. A step the trainer opened
        // before a restart is open already.
        let open = hub.inspect(|core| core.step_progress().map(|p| p.step.0));
        if k < config.steps && open.is_none_or(|open| open < k) {
            node.open_step(&config.prompts(k))?;
        }
        if k < config.steps {
            announce(&format!("open {k}"))?;
        }
        // Watched from the opening: the step is generated once its last result is
        // accepted, whatever the trainer does meanwhile.
        let generated = (k < config.steps).then(|| tokio::spawn(until_generated(hub.clone(), k)));
        let latest = node.commit().await?;
        let activation = (latest.version > 0).then(|| {
            tokio::spawn(measure_activation(
                hub.clone(),
                latest.version,
                activations.clone(),
            ))
        });

        // Train on the previous step while this one generates.
        let mut record = None;
        let mut trained_at = 0.0;
        if let Some(Pending {
            trained_on,
            generation_s,
            mut events,
        }) = previous.take()
        {
            let trained = k;
            let training = Instant::now();
            let (stats, bytes) = train_version(
                &config,
                &mut trainer,
                (&exports, &store),
                reference.as_ref(),
                &trained_on,
            )?;
            times.training_s = training.elapsed().as_secs_f64();
            times.generation_s = generation_s;
            exports.insert(trained, bytes);

            trained_at = opened.elapsed().as_secs_f64();
            let extraction = Instant::now();
            // Watched from the start, so what the trainer does after publishing (such as
            // checkpointing its state) is not counted as transfer time.
            let staged = tokio::spawn(wait_until_staged(hub.clone(), trained, extraction));
            let published = publish(&node, &exports, trained).await?;
            times.extraction_s = extraction.elapsed().as_secs_f64();
            if published.version != trained {
                bail!("published version {}, trained {trained}", published.version);
            }
            if trained % config.checkpoint_every == 0 || trained == config.steps {
                let state = trainer.save_state()?;
                store.put_trainer_data(TrainerData::State, trained, &state)?;
                events.push(format!(
                    "trainer state of v{trained} checkpointed ({} bytes)",
                    state.len()
                ));
            }
            let sync_bytes = published.artifact_bytes;
            times.transfer_s = staged.await?;
            // Counted once every actor has staged the version: a measurement, kept off
            // the way of its segments.
            let changed = count_changed(&exports, trained).await?;
            let accuracy = (trained % config.eval_every == 0 || trained == config.steps)
                .then(|| evaluate(&config, &exports.get(trained)?))
                .transpose()?;
            let groups = &trained_on.groups;
            let tokens: u64 = groups.iter().map(|g| g.tokens() as u64).sum();
            record = Some(StepRecord {
                step: k - 1,
                version: trained_on.behaviour_version,
                trained_version: trained,
                weights_hash: published.weights_hash.to_hex(),
                train: stats,
                accuracy,
                tokens,
                tokens_per_s: tokens as f64 / generation_s.max(1e-3),
                sync_bytes,
                dense_bytes: exports.get(trained)?.len() as u64,
                changed_elements: changed.elements,
                elements: changed.of,
                times,
                actors: Vec::new(),
                events,
            });
        }

        let mut generation_s = 0.0;
        // A stop asked while the step generates ends the wait: what the actors have
        // submitted stays in the control plane, and a resumed run takes it from there.
        let mut interrupted = None;
        if let Some(generated) = generated {
            let results = tokio::select! {
                results = node.wait_step(STEP_TIMEOUT) => Some(results?),
                signal = stop.recv() => {
                    interrupted = Some(signal);
                    None
                }
            };
            if let Some(results) = results {
                generation_s = generated.await?.duration_since(opened).as_secs_f64();
                previous = Some(store_pending(
                    &config,
                    &store,
                    k + 1,
                    &results,
                    generation_s,
                )?);
            } else {
                generated.abort();
                generation_s = opened.elapsed().as_secs_f64();
            }
        }
        let activation_s = match activation {
            Some(activation) if interrupted.is_none() => activation.await?,
            Some(activation) => {
                activation.abort();
                0.0
            }
            None => 0.0,
        };
        if let Some(mut record) = record {
            if let Some(signal) = interrupted {
                record.events.push(format!(
                    "the run stopped ({signal}) while step {k} generated: its generation time is up to then"
                ));
            }
            record.times.sync_held_s = sync_held_s(
                trained_at,
                trained_at + record.times.transfer_s,
                generation_s,
                activation_s,
            );
            // The activation of the version this step generated on, measured when the
            // step opened (zero for the initial version, which is loaded, not applied).
            record.times.activation_s = activations
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&record.version)
                .copied()
                .unwrap_or(0.0);
            record.actors = actors(&hub);
            announce(&format!("step {}", serde_json::to_string(&record)?))?;
        }
        // An interrupted step is never the last (that one opens nothing): the next
        // round's first look stops the trainer.
    }
    // Every actor ends on the final version, checked by its hash on activation.
    let last = node.commit().await?;
    measure_activation(hub.clone(), last.version, activations.clone()).await;
    announce(&format!(
        "final {}",
        serde_json::json!({ "version": last.version, "weights_hash": last.hash.to_hex(), "actors": actors(&hub) })
    ))?;
    announce("done")?;
    Ok(())
}

/// One RL step on `trained_on`, against the behaviour policy that generated it (held,
/// or rebuilt from the store after a restart); the step's statistics and the version it
/// makes, exported.
fn train_version(
    config: &RunConfig,
    trainer: &mut Trainer,
    (exports, store): (&Exports, &Store),
    reference: Option<&Policy>,
    trained_on: &TrainedOn,
) -> Result<(TrainStats, Vec<u8>)> {
    let version = trained_on.behaviour_version;
    let weights = match exports.get(version) {
        Ok(held) => held,
        Err(_) => Arc::new(store.weights_image(version)?),
    };
    let behaviour = Policy::from_safetensors(&config.model, &weights)?;
    let stats = trainer.train_step(
        &config.task,
        &trained_on.groups,
        &behaviour,
        reference,
        &config.rl,
    )?;
    Ok((stats, trainer.export_bf16()?))
}

/// Validates a completed step's rollouts and stores them as what version `version`
/// will be trained on, before the next step opens (which drops them from the control
/// plane): from then on a crash loses none of them.
fn store_pending(
    config: &RunConfig,
    store: &Store,
    version: u64,
    results: &StepResults,
    generation_s: f64,
) -> Result<Pending> {
    let mut events = Vec::new();
    let trained_on = TrainedOn {
        behaviour_version: results.outcome.version.0,
        groups: rollout_groups(config, results, &mut events)?,
    };
    store.put_trainer_data(
        TrainerData::Rollouts,
        version,
        &serde_json::to_vec(&trained_on)?,
    )?;
    Ok(Pending {
        trained_on,
        generation_s,
        events,
    })
}

/// After a restart at `version - 1`: the rollouts `version` is trained on, from the
/// store if the trainer stored them before it stopped, else from the control plane once
/// their step completes, or again if the trainer took them but stopped before storing
/// them (a step's results stay there until the next one opens).
async fn pending_after_restart(
    config: &RunConfig,
    node: &TrainerNode,
    version: u64,
) -> Result<Pending> {
    let store = node.store();
    if store
        .trainer_data_records(TrainerData::Rollouts)?
        .contains_key(&version)
    {
        let trained_on: TrainedOn =
            serde_json::from_slice(&store.trainer_data(TrainerData::Rollouts, version)?)?;
        return Ok(Pending {
            trained_on,
            generation_s: 0.0,
            events: vec![format!(
                "v{version} trained on rollouts stored before the restart"
            )],
        });
    }
    let waiting = Instant::now();
    let results = match node.taken_step_results(version - 1)? {
        Some(results) => results,
        None => node.wait_step(STEP_TIMEOUT).await?,
    };
    store_pending(
        config,
        store,
        version,
        &results,
        waiting.elapsed().as_secs_f64(),
    )
}

/// The run's side of [`TrainerNode::recover`]: the engine's trainer state, a version
/// trained again on its stored [`TrainedOn`], and the exports the next step needs.
struct Retrain<'a> {
    config: &'a RunConfig,
    store: &'a Store,
    reference: Option<Policy>,
    exports: Exports,
}

impl Retraining for Retrain<'_> {
    type Trainer = Trainer;

    fn restore(&mut self, _: u64, state: Vec<u8>) -> Result<Trainer, RetrainingError> {
        Ok(Trainer::load_state(&state)?)
    }

    fn retrain(
        &mut self,
        trainer: &mut Trainer,
        version: u64,
        rollouts: Vec<u8>,
    ) -> Result<(), RetrainingError> {
        let trained_on: TrainedOn = serde_json::from_slice(&rollouts)?;
        let (_, bytes) = train_version(
            self.config,
            trainer,
            (&self.exports, self.store),
            self.reference.as_ref(),
            &trained_on,
        )?;
        self.exports.insert(version, bytes);
        Ok(())
    }

    fn weights_hash(
        &mut self,
        trainer: &mut Trainer,
        version: u64,
    ) -> Result<aurora_delta::Hash, RetrainingError> {
        // The restored state's export is made here; a retrained one's by `retrain`.
        if !self.exports.bytes.contains_key(&version) {
            self.exports.insert(version, trainer.export_bf16()?);
        }
        Ok(Checkpoint::from_safetensors(&self.exports.get(version)?)?.weights_hash())
    }
}

/// The trainer as it was when it published the latest version ([`TrainerNode::recover`]).
/// Returns it, the exports a next step needs, and how many versions it trained again.
fn resume(config: &RunConfig, node: &TrainerNode) -> Result<(Trainer, Exports, u64)> {
    let store = node.store();
    let reference = match config.rl.kl_coef > 0.0 {
        true => Some(Policy::from_safetensors(
            &config.model,
            &store.weights_image(0)?,
        )?),
        false => None,
    };
    let mut retrain = Retrain {
        config,
        store,
        reference,
        exports: Exports::default(),
    };
    let recovered = node
        .recover(&mut retrain)
        .context("cannot resume the trainer")?;
    Ok((
        recovered.trainer,
        retrain.exports,
        recovered.version - recovered.restored_from,
    ))
}

/// Seconds from now until every actor runs `version`, also kept in `into`.
async fn measure_activation(
    hub: Arc<Hub>,
    version: u64,
    into: Arc<std::sync::Mutex<BTreeMap<u64, f64>>>,
) -> f64 {
    let seconds = until_every_actor(&hub, Instant::now(), |m| m.active.0 >= version).await;
    into.lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(version, seconds);
    seconds
}

/// When the control plane has step `step` complete (its last result accepted), as the
/// call that completed it returns.
async fn until_generated(hub: Arc<Hub>, step: u64) -> Instant {
    hub.wait_for(|core| {
        core.step_progress()
            .is_some_and(|progress| {
                progress.step.0 > step || (progress.step.0 == step && progress.completion.is_some())
            })
            .then(Instant::now)
    })
    .await
}

/// The accepted rollouts of a step, validated: an actor could send anything.
fn rollout_groups(
    config: &RunConfig,
    results: &StepResults,
    events: &mut Vec<String>,
) -> Result<Vec<RolloutGroup>> {
    let mut groups = Vec::with_capacity(results.rollouts.len());
    for rollout in &results.rollouts {
        let group = serde_json::from_str::<RolloutGroup>(rollout.payload.get())
            .map_err(anyhow::Error::from)
            .and_then(|group| {
                if group.prompt_id != rollout.prompt.0 {
                    bail!(
                        "rollout for prompt {} filed under {}",
                        group.prompt_id,
                        rollout.prompt.0
                    );
                }
                group.validate(&config.model, &config.task, config.rl.samples_per_prompt)?;
                Ok(group)
            });
        match group {
            Ok(group) => groups.push(group),
            Err(error) => {
                tracing::warn!(
                    actor = rollout.actor.0,
                    prompt = rollout.prompt.0,
                    "dropping a rollout: {error:#}"
                );
                events.push(format!(
                    "dropped the rollout of actor {} for prompt {}: {error:#}",
                    rollout.actor.0, rollout.prompt.0
                ));
            }
        }
    }
    Ok(groups)
}

/// Publishes version `trained`: the node extracts it against its predecessor and
/// streams it out as the encoder produces segments (and stores it). The node keeps a
/// share of each export it publishes, so it knows the predecessor's hash already.
async fn publish(node: &Arc<TrainerNode>, exports: &Exports, trained: u64) -> Result<Published> {
    let (node, base, target) = (
        node.clone(),
        exports.get(trained - 1)?,
        exports.get(trained)?,
    );
    tokio::task::spawn_blocking(move || Ok(node.publish_image(&base, target)?)).await?
}

/// The elements of a version that differ from its predecessor's, of all its elements.
struct Changed {
    elements: u64,
    of: u64,
}

/// Counts what version `trained` changed, element by element, whatever the sync mode
/// sends.
async fn count_changed(exports: &Exports, trained: u64) -> Result<Changed> {
    with_checkpoints(exports, trained, |base, target| {
        Ok(Changed {
            elements: base
                .tensors()
                .iter()
                .zip(target.tensors())
                .map(|(b, t)| aurora_delta::count_changed(b.data, t.data, b.dtype.size_bytes()))
                .sum(),
            of: target.tensors().iter().map(|t| t.element_count()).sum(),
        })
    })
    .await
}

/// Runs `work` on a blocking thread over the exports of `trained` and its predecessor.
async fn with_checkpoints<T: Send + 'static>(
    exports: &Exports,
    trained: u64,
    work: impl FnOnce(&Checkpoint<'_>, &Checkpoint<'_>) -> Result<T> + Send + 'static,
) -> Result<T> {
    let (base, target) = (exports.get(trained - 1)?, exports.get(trained)?);
    tokio::task::spawn_blocking(move || {
        let base = Checkpoint::from_safetensors(&base)?;
        let target = Checkpoint::from_safetensors(&target)?;
        work(&base, &target)
    })
    .await?
}

/// Seconds from `since` until every live actor has staged or activated `version`.
async fn wait_until_staged(hub: Arc<Hub>, version: u64, since: Instant) -> f64 {
    until_every_actor(&hub, since, |m| {
        m.active.0 >= version || m.staged.is_some_and(|s| s.0 >= version)
    })
    .await
}

/// Seconds from `since` until every live actor satisfies `condition` (or a minute,
/// after which a straggler is the lease machinery's business, not a metric's).
async fn until_every_actor(
    hub: &Hub,
    since: Instant,
    condition: impl Fn(&aurora_control::Member) -> bool,
) -> f64 {
    let deadline = tokio::time::Instant::from_std(since) + Duration::from_secs(60);
    // Woken by each call that changes the core, so the time is that of the report
    // that satisfied the condition, not of a poll after it.
    let satisfied = hub.wait_for(|core| {
        core.members()
            .values()
            .filter(|m| m.leaving_at.is_none())
            .all(&condition)
            .then(Instant::now)
    });
    match tokio::time::timeout_at(deadline, satisfied).await {
        Ok(at) => at.duration_since(since).as_secs_f64(),
        Err(_) => since.elapsed().as_secs_f64(),
    }
}

fn actors(hub: &Hub) -> Vec<ActorRecord> {
    hub.inspect(|core| {
        core.members()
            .iter()
            .map(|(id, member)| ActorRecord {
                id: id.0,
                region: member.region.to_string(),
                version: member.active.0,
                state: if member.leaving_at.is_some() {
                    "leaving"
                } else {
                    "live"
                }
                .into(),
                tokens_per_s: member.estimate.tokens_per_s(),
            })
            .collect()
    })
}

fn evaluate(config: &RunConfig, weights: &[u8]) -> Result<f64> {
    let policy = Policy::from_safetensors(&config.model, weights)?;
    let problems = config.task.held_out(config.held_out)?;
    Ok(policy.accuracy(&config.task, &problems)?.fraction())
}

/// One line on stdout for the orchestrator; logs go to stderr.
/// The graceful stop, between versions: the trainer state of the newest version (the
/// trainer has trained every published one) is saved unless the store has it, so that
/// `aurora run --resume` trains nothing again, and `stopped {"version", "signal"}` is
/// announced. The node then serves on until every
/// actor has left (the run stops them next), so that they hand their leases back to a
/// live control plane.
async fn stopped(signal: &str, trainer: &Trainer, node: &TrainerNode) -> Result<()> {
    let (hub, store) = (node.hub(), node.store());
    let latest = node.latest().map_or(0, |latest| latest.version);
    tracing::info!(signal, version = latest, "asked to stop");
    if !store
        .trainer_data_records(TrainerData::State)?
        .contains_key(&latest)
    {
        store.put_trainer_data(TrainerData::State, latest, &trainer.save_state()?)?;
    }
    announce(&format!(
        "stopped {}",
        serde_json::json!({ "version": latest, "signal": signal })
    ))?;
    let left = hub.wait_for(|core| {
        core.members()
            .values()
            .all(|member| member.leaving_at.is_some())
            .then_some(())
    });
    if tokio::time::timeout(FLEET_LEAVE_DEADLINE, left)
        .await
        .is_err()
    {
        tracing::warn!("actors still in the fleet after {FLEET_LEAVE_DEADLINE:?}: stopping");
    }
    // The last leave is recorded before its answer is written: served a moment longer,
    // so that the answer reaches its actor.
    tokio::time::sleep(ANSWER_GRACE).await;
    Ok(())
}

fn announce(line: &str) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")?;
    stdout.flush()?;
    Ok(())
}
