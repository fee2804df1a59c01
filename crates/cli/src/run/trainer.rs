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
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use aurora_control::{PromptId, Version, WeightsHash};
use aurora_delta::{Checkpoint, Encoding, ExtractOptions, Extraction, Hash};
use aurora_engine::{Policy, RolloutGroup};
use aurora_hub::{Hub, HubConfig, StepResults, SystemClock};
use aurora_proto::{Identity, Role, VersionRef};
use aurora_store::Store;
use aurora_transport::{NodeConfig, NodeHandle, spawn_hub};

use super::config::{RunConfig, SyncMode};
use super::report::{ActorRecord, StepRecord, StepTimes};

/// How often the trainer looks at the control plane while it waits.
const POLL: Duration = Duration::from_millis(20);

pub fn run(run_dir: &Path, bind: IpAddr, token: String) -> Result<()> {
    let config = RunConfig::load(&run_dir.join("config.toml"))?;
    crate::runtime(Some(2))?.block_on(train(run_dir, bind, config, token))
}

/// Every exported version the trainer may still need: the behaviour policy of the
/// rollouts it trains on is one version behind the newest.
struct Exports {
    bytes: BTreeMap<u64, Arc<Vec<u8>>>,
    hashes: BTreeMap<u64, Hash>,
}

impl Exports {
    fn insert(&mut self, version: u64, bytes: Vec<u8>) -> Result<Hash> {
        let hash = Checkpoint::from_safetensors(&bytes)?.weights_hash();
        self.bytes.insert(version, Arc::new(bytes));
        self.hashes.insert(version, hash);
        while self.bytes.len() > 3 {
            self.bytes.pop_first();
        }
        Ok(hash)
    }

    fn get(&self, version: u64) -> Result<Arc<Vec<u8>>> {
        self.bytes
            .get(&version)
            .cloned()
            .with_context(|| format!("version {version} is no longer held"))
    }
}

async fn train(run_dir: &Path, bind: IpAddr, config: RunConfig, token: String) -> Result<()> {
    let started = Instant::now();
    let warm = {
        let (config, run_dir) = (config.clone(), run_dir.to_path_buf());
        tokio::task::spawn_blocking(move || super::warmup::warmed_up(&config, &run_dir)).await??
    };
    let mut trainer = warm;
    let store = Arc::new(Store::open(run_dir.join("store")).context("opening the store")?);
    let hub = Arc::new(
        Hub::open(HubConfig {
            token: token.clone(),
            db_path: run_dir.join("hub.redb"),
            control: super::control_config(),
            tick_interval_max: Duration::from_millis(200),
            clock: Arc::new(SystemClock::new()),
        })
        .context("opening the control plane")?,
    );
    let http = tokio::net::TcpListener::bind(SocketAddr::new(bind, 0)).await?;
    let control_address = http.local_addr()?;
    tokio::spawn(aurora_hub::run(hub.clone(), http));

    let mut node = NodeConfig::new(
        Identity {
            role: Role::Hub,
            peer_id: "hub".into(),
            region: "hub".into(),
        },
        token.into_bytes(),
    );
    node.listen = Some(SocketAddr::new(bind, 0));
    node.streams = config.streams;
    let transport = Arc::new(spawn_hub(node, Some(store.clone())).await?);
    let transport_address = transport
        .local_addr()
        .context("the transport hub has no address")?;

    let mut exports = Exports {
        bytes: BTreeMap::new(),
        hashes: BTreeMap::new(),
    };
    let base = trainer.export_bf16()?;
    let base_hash = exports.insert(0, base.clone())?;
    store.put_snapshot(0, &base)?;
    transport.store_changed().await?;
    hub.publish_version(Version(0), WeightsHash(base_hash.0))?;
    let base_accuracy = evaluate(&config, &base)?;
    announce(&format!("control {control_address}"))?;
    announce(&format!("transport {transport_address}"))?;
    announce(&format!(
        "ready {}",
        serde_json::json!({
            "accuracy": base_accuracy,
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

    // Each step's rollouts are trained on in the next iteration, so what was measured
    // about a step waits here until its record is written.
    let mut previous: Option<(StepResults, f64)> = None;
    let activations: Arc<std::sync::Mutex<BTreeMap<u64, f64>>> = Arc::default();
    for k in 0..=config.steps {
        let mut times = StepTimes::default();
        let mut events = Vec::new();
        let opened = Instant::now();
        // Commit the newest version: actors activate it at their next batch boundary,
        // and only then can they stage the one trained below.
        let (latest, latest_hash) = hub
            .inspect(|core| core.latest_version())
            .context("no published version")?;
        if k < config.steps {
            let prompts: Vec<PromptId> = config.prompts(k).into_iter().map(PromptId).collect();
            hub.open_step(&prompts)?;
            announce(&format!("open {k}"))?;
        }
        if latest.0 > 0 {
            transport
                .commit(VersionRef {
                    version: latest.0,
                    hash: Hash(latest_hash.0),
                })
                .await?;
            tokio::spawn(measure_activation(
                hub.clone(),
                latest.0,
                activations.clone(),
            ));
        }

        // Train on the previous step while this one generates.
        let mut record = None;
        if let Some((results, generation_s)) = previous.take() {
            let trained = k;
            let behaviour_version = results.outcome.version.0;
            let groups = rollout_groups(&config, &results, &mut events)?;
            let behaviour =
                Policy::from_safetensors(&config.model, &exports.get(behaviour_version)?)?;
            let training = Instant::now();
            let stats = trainer.train_step(
                &config.task,
                &groups,
                &behaviour,
                reference.as_ref(),
                &config.rl,
            )?;
            let bytes = trainer.export_bf16()?;
            times.training_s = training.elapsed().as_secs_f64();
            // What this version was trained on, kept beside it in the store.
            store.put_rollouts(trained, &serde_json::to_vec(&groups)?)?;
            times.generation_s = generation_s;
            let hash = exports.insert(trained, bytes)?;
            // Published to the control plane first, so actors may report it staged.
            hub.publish_version(Version(trained), WeightsHash(hash.0))?;

            let extraction = Instant::now();
            let (sync_bytes, density) = publish(&config, &transport, &exports, trained).await?;
            times.extraction_s = extraction.elapsed().as_secs_f64();
            // The hub sends the newest snapshot to every actor and relay that starts (they
            // hold no weights).
            if trained % config.snapshot_every == 0 {
                store.put_snapshot(trained, &exports.get(trained)?)?;
                transport.store_changed().await?;
            }
            times.transfer_s = wait_until_staged(&hub, trained, extraction).await;
            let accuracy = (trained % config.eval_every == 0 || trained == config.steps)
                .then(|| evaluate(&config, &exports.get(trained)?))
                .transpose()?;
            let tokens: u64 = groups.iter().map(|g| g.tokens() as u64).sum();
            record = Some(StepRecord {
                step: k - 1,
                version: behaviour_version,
                trained_version: trained,
                weights_hash: hash.to_hex(),
                train: stats,
                accuracy,
                tokens,
                tokens_per_s: tokens as f64 / generation_s.max(1e-3),
                sync_bytes,
                dense_bytes: exports.get(trained)?.len() as u64,
                density,
                times,
                actors: Vec::new(),
                events,
            });
        }

        if k < config.steps {
            let results = wait_for_step(&hub).await?;
            previous = Some((results, opened.elapsed().as_secs_f64()));
        }
        if let Some(mut record) = record {
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
    }
    // Every actor ends on the final version, checked by its hash on activation.
    let (last, last_hash) = hub
        .inspect(|core| core.latest_version())
        .context("no published version")?;
    transport
        .commit(VersionRef {
            version: last.0,
            hash: Hash(last_hash.0),
        })
        .await?;
    measure_activation(hub.clone(), last.0, activations.clone()).await;
    announce(&format!(
        "final {}",
        serde_json::json!({ "version": last.0, "weights_hash": Hash(last_hash.0).to_hex(), "actors": actors(&hub) })
    ))?;
    announce("done")?;
    Ok(())
}

/// Records how long after the commit of `version` every live actor runs it.
async fn measure_activation(
    hub: Arc<Hub>,
    version: u64,
    into: Arc<std::sync::Mutex<BTreeMap<u64, f64>>>,
) {
    let seconds = until_every_actor(&hub, Instant::now(), |m| m.active.0 >= version).await;
    into.lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(version, seconds);
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

/// Extracts version `trained` against its predecessor and streams it out as the encoder
/// produces segments (the hub node stores it too). Returns the artifact's bytes and the
/// share of elements that changed.
async fn publish(
    config: &RunConfig,
    transport: &Arc<NodeHandle>,
    exports: &Exports,
    trained: u64,
) -> Result<(u64, f64)> {
    let base = exports.get(trained - 1)?;
    let target = exports.get(trained)?;
    let options = ExtractOptions {
        encoding: match config.sync {
            SyncMode::Delta => Encoding::Aurora,
            SyncMode::Full => Encoding::Dense,
        },
        base_version: trained - 1,
        target_version: trained,
        base_hash: exports.hashes.get(&(trained - 1)).copied(),
        target_hash: exports.hashes.get(&trained).copied(),
        ..ExtractOptions::default()
    };
    let transport = transport.clone();
    tokio::task::spawn_blocking(move || -> Result<(u64, f64)> {
        let base = Checkpoint::from_safetensors(&base)?;
        let target = Checkpoint::from_safetensors(&target)?;
        let changed: u64 = base
            .tensors()
            .iter()
            .zip(target.tensors())
            .map(|(b, t)| aurora_delta::count_changed(b.data, t.data, b.dtype.size_bytes()))
            .sum();
        let elements: u64 = target.tensors().iter().map(|t| t.element_count()).sum();
        let extraction = Extraction::new(&base, &target, options)?;
        let manifest = transport.publish_extraction(&extraction)?;
        let artifact_bytes = manifest.header.encode().len() as u64
            + manifest.payload_bytes()
            + manifest.encode_tail().len() as u64;
        Ok((artifact_bytes, changed as f64 / elements.max(1) as f64))
    })
    .await?
}

/// Seconds from `since` until every live actor has staged or activated `version`.
async fn wait_until_staged(hub: &Hub, version: u64, since: Instant) -> f64 {
    until_every_actor(hub, since, |m| {
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
    let deadline = since + Duration::from_secs(60);
    loop {
        let done = hub.inspect(|core| {
            core.members()
                .values()
                .filter(|m| m.leaving_at.is_none())
                .all(&condition)
        });
        if done || Instant::now() > deadline {
            return since.elapsed().as_secs_f64();
        }
        tokio::time::sleep(POLL).await;
    }
}

async fn wait_for_step(hub: &Hub) -> Result<StepResults> {
    loop {
        if let Some(results) = hub.take_step_outcome()? {
            return Ok(results);
        }
        tokio::time::sleep(POLL).await;
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
fn announce(line: &str) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")?;
    stdout.flush()?;
    Ok(())
}
