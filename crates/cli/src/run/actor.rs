//! The actor node of `aurora run`: a rollout engine on the built-in policy, a transport
//! actor that stages deltas behind generation and activates them at batch boundaries,
//! and a client of the control plane's HTTP API (docs/control-api.md).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use aurora_delta::Checkpoint;
use aurora_engine::{Policy, Problem};
use aurora_hub::wire::{
    ActorRequest, ClaimResponse, RegisterRequest, RegisterResponse, SubmitRequest, SubmitResponse,
    VersionsRequest, WireLease, WireResult,
};
use aurora_proto::{Identity, Role, VersionRef, Weights};
use aurora_transport::{Engine, NodeConfig, spawn_actor};
use tokio::sync::{OwnedMutexGuard, watch};

use super::client::Client;
use super::config::RunConfig;

/// Pause between claims while there is nothing to do.
const IDLE: Duration = Duration::from_millis(50);
/// Heartbeat period; the run's control plane declares an actor dead after a few.
const HEARTBEAT: Duration = Duration::from_millis(1000);
/// Pause before retrying a failed report.
const RETRY: Duration = Duration::from_millis(200);
/// Longest wait for the transport to activate a committed version.
const ACTIVATION_TIMEOUT: Duration = Duration::from_secs(60);

pub struct ActorArgs {
    pub run_dir: PathBuf,
    pub id: u64,
    pub region: String,
    pub control: SocketAddr,
    /// Transport upstreams in order of preference: the region's relay, then the hub.
    pub upstreams: Vec<SocketAddr>,
    pub token: String,
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
    current: RwLock<Current>,
    activated: watch::Sender<u64>,
    tokens_per_s_bits: AtomicU64,
}

impl RlEngine {
    fn new(
        config: aurora_engine::ModelConfig,
        version: VersionRef,
        weights: &[u8],
    ) -> Result<RlEngine> {
        let policy = Arc::new(Policy::from_safetensors(&config, weights)?);
        Ok(RlEngine {
            config,
            gate: Arc::new(tokio::sync::Mutex::new(())),
            parked: Mutex::new(None),
            current: RwLock::new(Current { version, policy }),
            activated: watch::channel(version.version).0,
            tokens_per_s_bits: AtomicU64::new(0f64.to_bits()),
        })
    }

    fn current(&self) -> (VersionRef, Arc<Policy>) {
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        (current.version, current.policy.clone())
    }
}

impl Engine for RlEngine {
    async fn safe_point(&self) {
        let guard = self.gate.clone().lock_owned().await;
        *self.parked.lock().unwrap_or_else(|p| p.into_inner()) = Some(guard);
    }

    fn activate(&self, weights: &[u8], version: VersionRef) {
        match Policy::from_safetensors(&self.config, weights) {
            Ok(policy) => {
                *self.current.write().unwrap_or_else(|p| p.into_inner()) = Current {
                    version,
                    policy: Arc::new(policy),
                };
                self.activated.send_replace(version.version);
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

    fn throughput(&self) -> f64 {
        f64::from_bits(self.tokens_per_s_bits.load(Ordering::Relaxed))
    }
}

/// The newest snapshot in the store directory, checked against the hash in its name
/// (`snapshots/<version>-<hash>.safetensors`).
pub fn latest_snapshot(run_dir: &Path) -> Result<(u64, Vec<u8>)> {
    let directory = run_dir.join("store").join("snapshots");
    let mut newest: Option<(u64, PathBuf, String)> = None;
    for entry in
        std::fs::read_dir(&directory).with_context(|| format!("listing {}", directory.display()))?
    {
        let path = entry?.path();
        let Some(stem) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".safetensors"))
        else {
            continue;
        };
        let Some((version, hash)) = stem.split_once('-') else {
            continue;
        };
        let Ok(version) = version.parse::<u64>() else {
            continue;
        };
        if newest.as_ref().is_none_or(|(v, _, _)| version > *v) {
            newest = Some((version, path.clone(), hash.to_string()));
        }
    }
    let (version, path, hash) =
        newest.with_context(|| format!("no snapshot in {}", directory.display()))?;
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let actual = Checkpoint::from_safetensors(&bytes)
        .with_context(|| format!("parsing {}", path.display()))?
        .weights_hash();
    if actual.to_hex() != hash {
        bail!(
            "{} has weights hash {}, not the one in its name",
            path.display(),
            actual.to_hex()
        );
    }
    Ok((version, bytes))
}

async fn act(args: ActorArgs, config: RunConfig) -> Result<()> {
    let (snapshot_version, image) = latest_snapshot(&args.run_dir)?;
    let weights = Weights::new(image, snapshot_version)?;
    let engine = Arc::new(RlEngine::new(
        config.model,
        weights.active(),
        weights.image(),
    )?);
    let mut node = NodeConfig::new(
        Identity {
            role: Role::Actor,
            peer_id: format!("actor-{}", args.id),
            region: args.region.clone(),
        },
        args.token.clone().into_bytes(),
    );
    node.upstreams = args.upstreams.clone();
    node.streams = config.streams;
    let transport = spawn_actor(node, weights, engine.clone()).await?;

    let fleet = Client::new(args.control, args.token.clone());
    let registered: RegisterResponse = fleet
        .post(
            "/v1/register",
            &RegisterRequest {
                actor: args.id,
                region: args.region.clone(),
                can_relay: false,
                active: snapshot_version,
                staged: None,
            },
        )
        .await?;
    tracing::info!(actor = args.id, version = snapshot_version, readiness = ?registered.readiness, "registered");
    let client = Arc::new(Client::new(args.control, registered.token));

    // Heartbeats, and the versions the transport reaches, go to the control plane.
    let heartbeat = {
        let client = client.clone();
        let actor = args.id;
        tokio::spawn(async move {
            loop {
                if let Err(error) = client
                    .post::<_, serde_json::Value>("/v1/heartbeat", &ActorRequest { actor })
                    .await
                {
                    tracing::warn!("heartbeat: {error:#}");
                }
                tokio::time::sleep(HEARTBEAT).await;
            }
        })
    };
    let reporter = {
        let client = client.clone();
        let actor = args.id;
        let mut status = transport.watch();
        tokio::spawn(async move {
            let mut reported = None;
            loop {
                let versions = {
                    let status = status.borrow_and_update();
                    status.active.map(|active| (active.version, status.staged))
                };
                if let Some((active, staged)) = versions
                    && reported != Some((active, staged))
                {
                    let request = VersionsRequest {
                        actor,
                        active,
                        staged,
                    };
                    match client
                        .post::<_, serde_json::Value>("/v1/versions", &request)
                        .await
                    {
                        Ok(_) => reported = Some((active, staged)),
                        Err(error) => {
                            tracing::warn!("reporting versions: {error:#}");
                            tokio::time::sleep(RETRY).await;
                            continue;
                        }
                    }
                }
                if status.changed().await.is_err() {
                    return;
                }
            }
        })
    };

    let outcome = generate_forever(&args, &config, &client, &engine).await;
    heartbeat.abort();
    reporter.abort();
    transport.kill();
    outcome
}

async fn generate_forever(
    args: &ActorArgs,
    config: &RunConfig,
    client: &Client,
    engine: &Arc<RlEngine>,
) -> Result<()> {
    let mut activated = engine.activated.subscribe();
    loop {
        let claim: ClaimResponse = client
            .post("/v1/claim", &ActorRequest { actor: args.id })
            .await?;
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
            tokio::time::timeout(ACTIVATION_TIMEOUT, activated.wait_for(|v| *v >= version))
                .await
                .with_context(|| {
                    format!("version {version} was not activated within {ACTIVATION_TIMEOUT:?}")
                })??;
        }
        // A batch: no activation until it is generated.
        let batch = engine.gate.clone().lock_owned().await;
        let (version, policy) = engine.current();
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
        let seconds = generation.elapsed.as_secs_f64().max(1e-6);
        engine.tokens_per_s_bits.store(
            (generation.tokens_generated as f64 / seconds).to_bits(),
            Ordering::Relaxed,
        );

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
        let answer: SubmitResponse = client
            .post(
                "/v1/submit",
                &SubmitRequest {
                    actor: args.id,
                    results,
                },
            )
            .await?;
        tracing::debug!(outcomes = ?answer.outcomes, "submitted");
    }
}
