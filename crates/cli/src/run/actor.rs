//! The actor node of `aurora run`: a rollout engine on the built-in policy, a transport
//! actor that stages deltas behind generation and activates them at batch boundaries,
//! and a client of the control plane's HTTP API (docs/control-api.md). It starts with
//! no weights, as one on another machine would: the hub's newest snapshot comes over the
//! wire, and it registers once that is active.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use anyhow::{Context, Result};
use aurora_api::{ClaimResponse, WireLease, WireResult};
use aurora_engine::{Policy, Problem};
use aurora_node::{ActorNode, ActorSettings, NodeTrust};
use aurora_proto::{VersionRef, Weights};
use aurora_transport::Engine;
use tokio::sync::{OwnedMutexGuard, watch};

use super::config::RunConfig;

/// How long a stopping actor waits for the control plane to answer its leave.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between claims while there is nothing to do.
const IDLE: Duration = Duration::from_millis(50);
/// Longest wait for the transport to activate a committed version.
const ACTIVATION_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest wait for the snapshot an actor joins from.
const JOIN_TIMEOUT: Duration = Duration::from_secs(300);

pub struct ActorArgs {
    pub run_dir: PathBuf,
    pub id: u64,
    pub region: String,
    pub control: SocketAddr,
    /// Transport upstreams in order of preference: the region's relay, then the hub.
    pub upstreams: Vec<SocketAddr>,
    pub trust: NodeTrust,
}

pub fn run(args: ActorArgs) -> Result<()> {
    let config = RunConfig::load(&args.run_dir.join("config.toml"))?;
    crate::runtime(Some(1))?.block_on(act(args, config))
}

/// The policy generating now, and its version.
struct Current {
    version: VersionRef,
    policy: Arc<Policy>,
}

/// The engine boundary of the transport: a batch holds `gate`; a safe point takes it
/// (waiting for the batch in flight) and keeps it until the new weights are in.
pub struct RlEngine {
    config: aurora_engine::ModelConfig,
    gate: Arc<tokio::sync::Mutex<()>>,
    parked: Mutex<Option<OwnedMutexGuard<()>>>,
    /// None until the transport activates the snapshot the actor joins from.
    current: RwLock<Option<Current>>,
    activated: watch::Sender<Option<u64>>,
}

impl RlEngine {
    /// An engine with no weights: the transport's first activation brings them.
    fn joining(config: aurora_engine::ModelConfig) -> RlEngine {
        RlEngine {
            config,
            gate: Arc::new(tokio::sync::Mutex::new(())),
            parked: Mutex::new(None),
            current: RwLock::new(None),
            activated: watch::channel(None).0,
        }
    }

    fn current(&self) -> Result<(VersionRef, Arc<Policy>)> {
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        let current = current
            .as_ref()
            .context("the engine has no weights: nothing was activated yet")?;
        Ok((current.version, current.policy.clone()))
    }
}

impl Engine for RlEngine {
    async fn safe_point(&self) {
        let guard = self.gate.clone().lock_owned().await;
        *self.parked.lock().unwrap_or_else(|p| p.into_inner()) = Some(guard);
    }

    fn activate(&self, weights: Arc<Weights>, _changed: aurora_delta::ChangeSet) {
        let version = weights.active();
        match Policy::from_safetensors(&self.config, weights.image()) {
            Ok(policy) => {
                *self.current.write().unwrap_or_else(|p| p.into_inner()) = Some(Current {
                    version,
                    policy: Arc::new(policy),
                });
                self.activated.send_replace(Some(version.version));
                tracing::info!(version = version.version, "activated");
            }
            // The transport verified the weights hash, so this is a bug, not bad input.
            Err(error) => tracing::error!(
                version = version.version,
                "cannot load activated weights: {error}"
            ),
        }
        self.parked.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    fn resume(&self, active: VersionRef) {
        tracing::warn!(version = active.version, "resuming on the weights it runs");
        self.parked.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

async fn act(args: ActorArgs, config: RunConfig) -> Result<()> {
    let engine = Arc::new(RlEngine::joining(config.model));
    let settings = ActorSettings {
        id: args.id,
        region: args.region.clone(),
        control: args.control,
        upstreams: args.upstreams.clone(),
        trust: args.trust.clone(),
        streams: config.streams,
        transport_limits: aurora_node::TransportLimits::default(),
        trainer_key: Some(super::trainer_key(&args.run_dir)?),
        insecure_unsigned: false,
        // The built-in models are small, and the engine holds its own copy anyway.
        images: Arc::new(aurora_delta::Heap),
        return_after: Some(aurora_node::RETURN_AFTER),
        behind_timeout: aurora_node::BEHIND_TIMEOUT,
    };
    // Taken before joining, so a stop asked meanwhile is not lost.
    let mut stop = crate::signals::StopSignals::of_run_node()?;
    let node = ActorNode::join(settings, engine.clone(), JOIN_TIMEOUT).await?;
    let outcome = tokio::select! {
        outcome = generate_forever(&config, &node, &engine) => outcome,
        signal = stop.recv() => {
            // The paper's graceful leave: the control plane hands this actor's leases to
            // others now, instead of after they expire.
            tracing::info!(signal, "asked to stop: leaving the fleet");
            // A control plane that stops with the run may take the leave and be gone
            // before its answer arrives: past the deadline the actor stops anyway.
            match tokio::time::timeout(LEAVE_TIMEOUT, node.leave()).await {
                Ok(left) => left.context("leaving the fleet"),
                Err(_) => {
                    tracing::warn!("no answer to the leave within {LEAVE_TIMEOUT:?}: stopping");
                    Ok(())
                }
            }
        }
    };
    node.stop();
    outcome
}

async fn generate_forever(
    config: &RunConfig,
    node: &ActorNode,
    engine: &Arc<RlEngine>,
) -> Result<()> {
    let mut activated = engine.activated.subscribe();
    loop {
        let claim = node.claim().await?;
        let (commit, leases) = match claim {
            ClaimResponse::Work { commit, leases } if !leases.is_empty() => (commit, leases),
            ClaimResponse::Leaving { .. } => {
                tracing::info!("preempted: leaving");
                return Ok(());
            }
            _ => {
                tokio::time::sleep(IDLE).await;
                continue;
            }
        };
        if let Some(version) = commit {
            tokio::time::timeout(
                ACTIVATION_TIMEOUT,
                activated.wait_for(|v| v.is_some_and(|v| v >= version)),
            )
            .await
            .with_context(|| {
                format!("version {version} was not activated within {ACTIVATION_TIMEOUT:?}")
            })??;
        }
        // A batch: no activation until it is generated.
        let batch = engine.gate.clone().lock_owned().await;
        let (version, policy) = engine.current()?;
        let (usable, stale): (Vec<WireLease>, Vec<WireLease>) = leases
            .into_iter()
            .partition(|lease| lease.version == version.version);
        if !stale.is_empty() {
            tracing::warn!(
                count = stale.len(),
                active = version.version,
                "leases for another version; letting them expire"
            );
        }
        if usable.is_empty() {
            drop(batch);
            continue;
        }
        let problems: Vec<Problem> = usable
            .iter()
            .map(|lease| config.task.problem(lease.prompt))
            .collect::<Result<_, _>>()?;
        let (sampling, seed) = (config.sampling, config.sampling_seed(version.version));
        let generation =
            tokio::task::spawn_blocking(move || policy.generate(&problems, &sampling, seed))
                .await??;
        drop(batch);

        let results = usable
            .iter()
            .zip(&generation.groups)
            .map(|(lease, group)| {
                Ok(WireResult {
                    lease: lease.lease,
                    version: version.version,
                    weights_hash: version.hash.to_hex(),
                    tokens: group.tokens() as u64,
                    payload: serde_json::value::to_raw_value(group)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let answer = node.submit(results).await?;
        tracing::debug!(outcomes = ?answer.outcomes, "submitted");
    }
}
