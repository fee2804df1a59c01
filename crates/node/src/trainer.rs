//! The trainer node: control plane, transport hub and checkpoint store in the trainer's
//! process. It publishes the versions the trainer makes and serves its steps; it does not
//! train (the caller does, with its own engine).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use aurora_control::{PromptId, StepId, Version, WeightsHash};
use aurora_delta::{
    Checkpoint, Encoding, ExtractOptions, Extraction, Hash, SegmentSource, ShardTable, TargetHash,
    TensorSpec,
};
use aurora_hub::{Hub, HubConfig, JoinPoint, Limits, ServeConfig, StepResults, SystemClock};
use aurora_proto::{Identity, Role, VersionRef};
use aurora_store::Store;
use aurora_transport::{NodeConfig, NodeHandle, spawn_hub};
use tokio::runtime::Handle;

use crate::{NodeError, NodeTrust};

/// Settings of a trainer node.
#[derive(Clone, Debug)]
pub struct TrainerSettings {
    /// Holds the checkpoint store (`store/`) and the control plane's database
    /// (`hub.redb`); a node reopening the directory carries on from both.
    pub dir: PathBuf,
    /// The control plane's HTTP API (port 0: any free port).
    pub control_listen: SocketAddr,
    /// The segment transport's hub.
    pub transport_listen: SocketAddr,
    /// How both planes are served: the trainer's certificate, or insecure plaintext.
    pub trust: NodeTrust,
    /// The API's caps and timeouts.
    pub control_limits: Limits,
    /// The segment transport's caps, timeouts and build budget.
    pub transport_limits: aurora_transport::Limits,
    /// Parallel TCP streams per downstream session.
    pub streams: u8,
    /// Every this many versions the store keeps a whole snapshot (version 0 always),
    /// which nodes that join take over the wire.
    pub snapshot_every: u64,
    /// `Aurora` ships deltas; `Dense` every tensor whole (the full-sync baseline).
    pub encoding: Encoding,
    /// The control plane's rules for a fresh database.
    pub control: aurora_control::Config,
    /// The trainer's signing key: every version published, snapshot or composed delta
    /// served and commit is signed with it (docs/security.md). Required with
    /// certificates, unless `insecure_unsigned`.
    pub signing_key: Option<Arc<aurora_delta::SigningKey>>,
    /// INSECURE: serve unsigned versions although the node has certificates
    /// ([`aurora_transport::NodeConfig::insecure_unsigned`]).
    pub insecure_unsigned: bool,
}

impl TrainerSettings {
    pub fn new(dir: impl Into<PathBuf>, trust: NodeTrust) -> TrainerSettings {
        let loopback = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
        TrainerSettings {
            dir: dir.into(),
            control_listen: loopback,
            transport_listen: loopback,
            trust,
            control_limits: Limits::default(),
            transport_limits: aurora_transport::Limits::default(),
            streams: 4,
            snapshot_every: 10,
            encoding: Encoding::Aurora,
            control: aurora_control::Config::default(),
            signing_key: None,
            insecure_unsigned: false,
        }
    }
}

/// The newest published version, with its image when it was published from an image the
/// node shares ([`TrainerNode::publish_image`]): nobody can write that image while the
/// node holds a share, so it still has the hash computed when it was published.
struct Latest {
    version: VersionRef,
    image: Option<Arc<Vec<u8>>>,
}

/// A version as published.
#[derive(Clone, Copy, Debug)]
pub struct Published {
    pub version: u64,
    pub weights_hash: Hash,
    /// Bytes of the artifact streamed out: the delta, or the snapshot's size for the first
    /// version.
    pub artifact_bytes: u64,
}

pub struct TrainerNode {
    hub: Arc<Hub>,
    transport: Arc<NodeHandle>,
    store: Arc<Store>,
    runtime: Handle,
    settings: TrainerSettings,
    control_address: SocketAddr,
    transport_address: SocketAddr,
    latest: Mutex<Option<Latest>>,
    /// Hashes and encodes each version on every core: from the end of training until
    /// every actor has staged it, the version is what the run waits for.
    publishing: rayon::ThreadPool,
}

fn wrong_base(latest: VersionRef, base_hash: Hash) -> NodeError {
    NodeError::BaseNotPublished {
        version: latest.version,
        base: base_hash,
        published: latest.hash,
    }
}

impl TrainerNode {
    /// Opens (or reopens) the store and the control plane's database in `settings.dir`
    /// and starts serving both planes on the current runtime.
    pub async fn start(settings: TrainerSettings) -> Result<TrainerNode, NodeError> {
        std::fs::create_dir_all(&settings.dir).map_err(NodeError::io(format!(
            "creating {}",
            settings.dir.display()
        )))?;
        let store = Arc::new(Store::open(settings.dir.join("store"))?);
        let hub = Arc::new(Hub::open(HubConfig {
            db_path: settings.dir.join("hub.redb"),
            control: settings.control.clone(),
            tick_interval_max: Duration::from_millis(200),
            clock: Arc::new(SystemClock::new()),
        })?);
        settings.trust.check_address(
            "the control plane's listen address",
            settings.control_listen,
        )?;
        let http = tokio::net::TcpListener::bind(settings.control_listen)
            .await
            .map_err(NodeError::io(format!(
                "listening on {}",
                settings.control_listen
            )))?;
        let control_address = http
            .local_addr()
            .map_err(NodeError::io("the control plane's address"))?;
        tokio::spawn(aurora_hub::run(
            hub.clone(),
            http,
            ServeConfig {
                security: settings.trust.control_server()?,
                limits: settings.control_limits.clone(),
            },
        ));

        let plaintext = Identity {
            role: Role::Hub,
            peer_id: "hub".into(),
            region: "hub".into(),
        };
        let mut node = NodeConfig::new(
            settings.trust.identity(plaintext)?,
            settings.trust.transport(),
        );
        node.listen = Some(settings.transport_listen);
        node.limits = settings.transport_limits.clone();
        node.streams = settings.streams;
        node.signing_key = settings.signing_key.clone();
        node.insecure_unsigned = settings.insecure_unsigned;
        if let Some(key) = &settings.signing_key {
            let fingerprint = aurora_delta::key_fingerprint(&key.verifying_key());
            tracing::info!(key = %fingerprint, "signing every version with the trainer key");
        }
        let transport = Arc::new(spawn_hub(node, Some(store.clone())).await?);
        let transport_address = transport
            .local_addr()
            .ok_or(NodeError::NoTransportAddress)?;
        let latest = catch_up_control_plane(&hub, &store)?;
        let committed = committed_before(&hub, &store, latest)?;
        if let Some(committed) = committed {
            // What a previous run committed last: joining nodes go straight to it.
            transport.commit(committed).await?;
        }
        announce_join_point(&hub, &store, committed.map(|c| c.version))?;
        tracing::info!(
            %control_address,
            %transport_address,
            ?latest,
            run = %store.run_id(),
            "trainer node serving"
        );
        Ok(TrainerNode {
            hub,
            transport,
            store,
            runtime: Handle::current(),
            settings,
            control_address,
            transport_address,
            latest: Mutex::new(latest.map(|version| Latest {
                version,
                image: None,
            })),
            publishing: rayon::ThreadPoolBuilder::new()
                .num_threads(std::thread::available_parallelism().map_or(1, |n| n.get()))
                .thread_name(|index| format!("aurora-publish-{index}"))
                .build()
                .map_err(|error| NodeError::Io {
                    what: "starting the publishing threads".into(),
                    source: std::io::Error::other(error),
                })?,
        })
    }

    pub fn control_address(&self) -> SocketAddr {
        self.control_address
    }

    pub fn transport_address(&self) -> SocketAddr {
        self.transport_address
    }

    /// The control plane, for what the node does not wrap (its members, its metrics).
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The newest published version.
    pub fn latest(&self) -> Option<VersionRef> {
        self.lock_latest().as_ref().map(|latest| latest.version)
    }

    fn lock_latest(&self) -> std::sync::MutexGuard<'_, Option<Latest>> {
        self.latest.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes the first version, `weights`: stored as a snapshot (written tensor by
    /// tensor, never as one image in memory), which every node that joins takes over the
    /// wire.
    pub fn publish_first(
        &self,
        version: u64,
        weights: &Checkpoint<'_>,
    ) -> Result<Published, NodeError> {
        let published = self.publish_first_checked(version, weights)?;
        self.set_latest(version, published.weights_hash, None);
        Ok(published)
    }

    /// [`TrainerNode::publish_first`] from a safetensors image the node may keep a share
    /// of, as [`TrainerNode::publish_image`] does: the next version, published against
    /// it, then starts without hashing its base again.
    pub fn publish_first_image(
        &self,
        version: u64,
        image: Arc<Vec<u8>>,
    ) -> Result<Published, NodeError> {
        let published =
            self.publish_first_checked(version, &Checkpoint::from_safetensors(&image)?)?;
        self.set_latest(version, published.weights_hash, Some(image));
        Ok(published)
    }

    fn publish_first_checked(
        &self,
        version: u64,
        weights: &Checkpoint<'_>,
    ) -> Result<Published, NodeError> {
        if let Some(latest) = self.latest() {
            return Err(NodeError::AlreadyPublished {
                version: latest.version,
            });
        }
        let record = self.store.put_snapshot_checkpoint(version, weights)?;
        self.runtime.block_on(self.transport.store_changed())?;
        self.hub
            .publish_version(Version(version), WeightsHash(record.weights_hash.0))?;
        Ok(Published {
            version,
            weights_hash: record.weights_hash,
            artifact_bytes: record.size_bytes,
        })
    }

    /// Publishes `target` as the version after the latest: extracted against `base` (the
    /// latest version's weights, checked by their hash) and streamed to every subscriber
    /// as the encoder produces segments, while the store keeps it. Every
    /// `snapshot_every` versions the store also keeps a snapshot, built from `target` (one
    /// copy of the model, written and dropped). Blocks the calling thread, which must not
    /// be an async task's.
    pub fn publish(
        &self,
        base: &Checkpoint<'_>,
        target: &Checkpoint<'_>,
    ) -> Result<Published, NodeError> {
        self.publish_checked(base, target, None, None)
    }

    /// [`TrainerNode::publish`] for a caller that knows `base` is the latest version's
    /// weights as it published them, untouched since (the Python trainer, by torch's
    /// counts of in-place writes): the base is not hashed again, which is a third of
    /// publishing's work. Were it changed all the same, the delta would not reproduce
    /// the target's hash, which every actor checks before it activates the version.
    pub fn publish_over_latest(
        &self,
        base: &Checkpoint<'_>,
        target: &Checkpoint<'_>,
    ) -> Result<Published, NodeError> {
        let latest = self.latest_or_refuse()?;
        self.publish_checked(base, target, Some(latest.hash), None)
    }

    /// [`TrainerNode::publish`] from safetensors images the node may keep a share of (a
    /// trainer's exports): `target` is kept as the newest version's image, so when the
    /// next version is published against it as `base`, its weights hash is the one
    /// computed now instead of being computed again. A base the node does not hold
    /// (the first version after a restart, another allocation) is hashed and checked.
    pub fn publish_image(
        &self,
        base: &Arc<Vec<u8>>,
        target: Arc<Vec<u8>>,
    ) -> Result<Published, NodeError> {
        self.publish_checked(
            &Checkpoint::from_safetensors(base)?,
            &Checkpoint::from_safetensors(&target)?,
            self.known_hash(base),
            Some(target.clone()),
        )
    }

    /// The weights hash of `image` if it is the newest version's image, held since it was
    /// published (the same allocation: equal bytes elsewhere could be written meanwhile).
    fn known_hash(&self, image: &Arc<Vec<u8>>) -> Option<Hash> {
        self.lock_latest().as_ref().and_then(|latest| {
            let held = latest.image.as_ref()?;
            Arc::ptr_eq(held, image).then_some(latest.version.hash)
        })
    }

    /// Publishes `target` against `base`, whose weights hash is `known_base` when the
    /// caller knows it for certain; `image`, the target's safetensors image if the node
    /// keeps a share of it.
    fn publish_checked(
        &self,
        base: &Checkpoint<'_>,
        target: &Checkpoint<'_>,
        known_base: Option<Hash>,
        image: Option<Arc<Vec<u8>>>,
    ) -> Result<Published, NodeError> {
        let latest = self.latest_or_refuse()?;
        let extraction = Extraction::new(
            base,
            target,
            ExtractOptions {
                encoding: self.settings.encoding,
                base_version: latest.version,
                target_version: latest.version + 1,
                // As published; a base that is not is found out before the Seal.
                base_hash: Some(latest.hash),
                target_hash: TargetHash::Later,
                ..ExtractOptions::default()
            },
        )?;
        // Hashed beside the encoder, which takes as long.
        let hashes = || {
            rayon::join(
                || known_base.unwrap_or_else(|| base.weights_hash()),
                || target.weights_hash(),
            )
        };
        self.stream_version(latest, &extraction, hashes, image, |version| {
            self.store.put_snapshot_checkpoint(version, target)
        })
    }

    /// Publishes the version after the latest from the parts of a sharded trainer's
    /// ranks (`aurora_delta::ShardTable::extract`, each over the ranks' own element
    /// ranges of `tensors`, with this node's encoding): no process ever holds the model
    /// whole. The parts must cover every tensor exactly once, and their base must be the
    /// latest version as published (both checked by the weights hashes the parts
    /// compose). A snapshot, when one is due, is rebuilt by the store from the previous
    /// one and the deltas since.
    pub fn publish_shards(
        &self,
        tensors: Vec<(String, TensorSpec)>,
        parts: &[&[u8]],
    ) -> Result<Published, NodeError> {
        let latest = self.latest_or_refuse()?;
        let table = ShardTable::new(tensors, self.settings.encoding)?;
        let assembly = table.assemble(latest.version, latest.hash, parts)?;
        // Known before anything is sent, so a wrong base sends nothing.
        let base_hash = assembly.parts_base_hash();
        if base_hash != latest.hash {
            return Err(wrong_base(latest, base_hash));
        }
        let hashes = || (base_hash, assembly.target_hash());
        self.stream_version(latest, &assembly, hashes, None, |version| {
            self.store.put_snapshot_rebuilt(version)
        })
    }

    fn latest_or_refuse(&self) -> Result<VersionRef, NodeError> {
        self.latest().ok_or(NodeError::NothingPublished)
    }

    /// Streams `delta`, the version after `latest`, to every subscriber as its segments
    /// come, while the store keeps it; `hashes` (run beside the segments) returns the
    /// weights hashes of its base, which must be `latest` as published, and of its target.
    /// Once sealed, the version is the latest (with `image`); every `snapshot_every`
    /// versions `snapshot` then stores it whole, and an error of it is returned though the
    /// version is published.
    fn stream_version(
        &self,
        latest: VersionRef,
        delta: &impl SegmentSource,
        hashes: impl FnOnce() -> (Hash, Hash) + Send,
        image: Option<Arc<Vec<u8>>>,
        snapshot: impl FnOnce(u64) -> Result<aurora_store::SnapshotRecord, aurora_store::StoreError>,
    ) -> Result<Published, NodeError> {
        let version = latest.version + 1;
        let started = Instant::now();
        // The target's hash goes out in the Seal (docs/wire-protocol.md §4.4), and the
        // base's is checked before it. Nothing extracted from other weights than the
        // published ones is sealed: the segments sent stay unsealed, and a later
        // publication of the version replaces them (§4.4).
        let phases = Mutex::new((Duration::ZERO, Duration::ZERO));
        let hash_and_announce = || -> Result<Hash, NodeError> {
            let (base_hash, target_hash) = hashes();
            let hashed = started.elapsed();
            if base_hash != latest.hash {
                return Err(wrong_base(latest, base_hash));
            }
            // Published to the control plane before the Seal, so actors may report it
            // staged. A node that stopped between the two announced it already: the
            // version it trains again must be the same weights.
            match self.hub.inspect(|core| core.latest_version()) {
                Some((announced, hash)) if announced.0 == version => {
                    if hash.0 != target_hash.0 {
                        return Err(NodeError::NotReproduced {
                            version,
                            announced: Hash(hash.0),
                            produced: target_hash,
                        });
                    }
                }
                _ => self
                    .hub
                    .publish_version(Version(version), WeightsHash(target_hash.0))?,
            }
            *phases.lock().unwrap_or_else(PoisonError::into_inner) = (hashed, started.elapsed());
            Ok(target_hash)
        };
        let manifest = self
            .publishing
            .install(|| self.transport.publish_delta(delta, hash_and_announce))?;
        let (hashed, announced) = *phases.lock().unwrap_or_else(PoisonError::into_inner);
        let target_hash = manifest.header.target_hash;
        tracing::info!(
            version,
            hashed_s = hashed.as_secs_f64(),
            announced_s = announced.as_secs_f64(),
            // Sealed and stored: the Seal went out before the store's write.
            stored_s = started.elapsed().as_secs_f64(),
            "published"
        );
        // The latest from the Seal on: a snapshot that fails below must not keep the next
        // version from being published.
        self.set_latest(version, target_hash, image);
        if self.settings.snapshot_every > 0 && version.is_multiple_of(self.settings.snapshot_every)
        {
            snapshot(version)?;
            self.runtime.block_on(self.transport.store_changed())?;
        }
        Ok(Published {
            version,
            weights_hash: target_hash,
            artifact_bytes: manifest.header.encode().len() as u64
                + manifest.payload_bytes()
                + manifest.encode_tail().len() as u64,
        })
    }

    /// Commits the latest version: actors activate it at their next safe point.
    pub async fn commit(&self) -> Result<VersionRef, NodeError> {
        let latest = self.latest().ok_or(NodeError::NothingPublished)?;
        if latest.version > 0 {
            self.transport.commit(latest).await?;
        }
        announce_join_point(&self.hub, &self.store, Some(latest.version))?;
        Ok(latest)
    }

    /// The run this node's store was made for: every statement it signs names it, and
    /// the nodes that pin it take no other run's versions.
    pub fn run_id(&self) -> aurora_delta::RunId {
        self.store.run_id()
    }

    /// Opens a step on the latest version: its prompts are leased to the actors.
    pub fn open_step(&self, prompts: &[u64]) -> Result<u64, NodeError> {
        let prompts: Vec<PromptId> = prompts.iter().copied().map(PromptId).collect();
        Ok(self.hub.open_step(&prompts)?.0)
    }

    /// The open step's outcome once it is complete (every prompt accepted), once.
    pub fn take_step(&self) -> Result<Option<StepResults>, NodeError> {
        Ok(self.hub.take_step_outcome()?)
    }

    /// The results of `step` if they were handed over already and the next step has not
    /// opened: what a trainer that stopped between taking them and keeping them reads
    /// again after its restart.
    pub fn taken_step_results(&self, step: u64) -> Result<Option<StepResults>, NodeError> {
        let results = self.hub.taken_step_results()?;
        Ok(results.filter(|results| results.outcome.step == StepId(step)))
    }

    /// Waits up to `timeout` for the open step to complete, woken by the call that
    /// completes it.
    pub async fn wait_step(&self, timeout: Duration) -> Result<StepResults, NodeError> {
        let completed = self.hub.wait_for(|core| core.step_outcome().map(|_| ()));
        tokio::time::timeout(timeout, completed)
            .await
            .map_err(|_| NodeError::Timeout {
                what: "the step's completion".into(),
                timeout,
            })?;
        // Only this node takes outcomes, so the one just seen is still there.
        self.take_step()?.ok_or(NodeError::OutcomeTaken)
    }

    fn set_latest(&self, version: u64, hash: Hash, image: Option<Arc<Vec<u8>>>) {
        *self.lock_latest() = Some(Latest {
            version: VersionRef { version, hash },
            image,
        });
    }
}

/// Publishes to the control plane every version the store holds beyond the control
/// plane's latest (a store filled before this node first ran, or a crash between the two
/// writes), and returns the latest version. A version the two disagree on is an error.
/// The version a previous run of this node had committed, as far as what it left shows:
/// that of a step still open (its actors must run that version to finish it, and a
/// trainer commits the version it opens a step on), else the latest published one.
fn committed_before(
    hub: &Hub,
    store: &Store,
    latest: Option<VersionRef>,
) -> Result<Option<VersionRef>, NodeError> {
    let open = hub.inspect(|core| {
        core.step_progress()
            .filter(|step| step.completion.is_none())
            .map(|step| step.version.0)
    });
    let Some(version) = open.filter(|&open| latest.is_some_and(|l| open < l.version)) else {
        return Ok(latest.filter(|latest| latest.version > 0));
    };
    let hash = *store
        .weights_hashes()?
        .get(&version)
        .ok_or(NodeError::StoreLacksVersion { version })?;
    // Version 0 is where every node starts: nothing to commit.
    Ok((version > 0).then_some(VersionRef { version, hash }))
}

/// Tells the control plane what joiners pin (`GET /v1/join`): the run, `committed`, and
/// the snapshot the hub's sender offers for it (the newest stored at or below it, as
/// `aurora_proto::Sender` chooses).
fn announce_join_point(hub: &Hub, store: &Store, committed: Option<u64>) -> Result<(), NodeError> {
    let (_, snapshots) = store.records()?;
    let snapshot = snapshots
        .range(..=committed.unwrap_or(u64::MAX))
        .next_back()
        .map(|(&version, _)| version);
    hub.set_join_point(JoinPoint {
        run: store.run_id(),
        committed,
        snapshot,
    });
    Ok(())
}

fn catch_up_control_plane(hub: &Hub, store: &Store) -> Result<Option<VersionRef>, NodeError> {
    let stored = store.weights_hashes()?;
    let published = hub.inspect(|core| core.latest_version());
    if let Some((version, hash)) = published
        && stored
            .get(&version.0)
            .is_some_and(|stored| stored.0 != hash.0)
    {
        return Err(NodeError::HashesDisagree { version: version.0 });
    }
    let next = published.map_or(0, |(version, _)| version.0 + 1);
    for (&version, hash) in stored.range(next..) {
        hub.publish_version(Version(version), WeightsHash(hash.0))?;
    }
    // The control plane may be one version ahead (announced, then the node stopped
    // before the store had it): the newest version is the store's, which the next
    // publish makes again.
    Ok(stored
        .last_key_value()
        .map(|(&version, &hash)| VersionRef { version, hash }))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use aurora_synth::{Synth, SynthConfig, preset};

    /// Safetensors images of `count` successive versions of a small synthetic model.
    fn images(count: usize) -> Vec<Arc<Vec<u8>>> {
        let shape = preset("tiny").expect("the tiny preset");
        let mut synth = Synth::new(SynthConfig::new(shape, 7));
        (0..count)
            .map(|_| {
                let image = aurora_checkpoint::safetensors_bytes(&synth.export()).unwrap();
                synth.step();
                Arc::new(image)
            })
            .collect()
    }

    /// A trainer node over plaintext in a fresh directory (kept alive by the caller).
    pub(crate) async fn started() -> (tempfile::TempDir, Arc<TrainerNode>) {
        let dir = tempfile::tempdir().unwrap();
        let trust =
            NodeTrust::insecure_plaintext("fleet", aurora_trust::PlaintextReach::Loopback).unwrap();
        let node = TrainerNode::start(TrainerSettings::new(dir.path(), trust))
            .await
            .unwrap();
        (dir, Arc::new(node))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_step_wait_ends_with_the_submission_that_completes_the_step_or_times_out() {
        use aurora_api::RolloutResult;
        use aurora_control::{
            ActorId, Assignment, Capabilities, Region, Registration, RolloutReport,
        };
        let (_dir, node) = started().await;
        let image = images(1).remove(0);
        let publishing = node.clone();
        let v0 = tokio::task::spawn_blocking(move || {
            publishing.publish_first(0, &Checkpoint::from_safetensors(&image).unwrap())
        })
        .await
        .unwrap()
        .unwrap();
        node.open_step(&[5]).unwrap();
        let timeout = Duration::from_millis(50);
        let error = node.wait_step(timeout).await.unwrap_err();
        assert!(
            error
                .to_string()
                .contains("the step's completion did not happen"),
            "{error}"
        );

        let waiting = node.clone();
        let completed =
            tokio::spawn(async move { waiting.wait_step(Duration::from_secs(60)).await });
        let (hub, actor) = (node.hub(), ActorId(1));
        let registration = Registration {
            region: Region::new("us").unwrap(),
            capabilities: Capabilities { can_relay: false },
            active: Version(0),
            staged: None,
        };
        hub.register(actor, registration).unwrap();
        let Assignment::Work { leases, .. } = hub.claim(actor).unwrap().0 else {
            panic!("no work for the only actor");
        };
        let results: Vec<RolloutResult> = leases
            .iter()
            .map(|grant| RolloutResult {
                report: RolloutReport {
                    lease: grant.lease,
                    version: grant.version,
                    weights_hash: WeightsHash(v0.weights_hash.0),
                    tokens: 10,
                },
                payload: serde_json::value::RawValue::from_string("{}".into()).unwrap(),
            })
            .collect();
        hub.submit(actor, &results).unwrap();
        let results = completed.await.unwrap().unwrap();
        assert_eq!(results.outcome.accepted, [(PromptId(5), actor)]);
        // Taken once: the next wait finds no completed step.
        assert!(node.wait_step(timeout).await.is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_first_version_published_from_an_image_vouches_for_the_next_base() {
        let (_dir, node) = started().await;
        let images = images(2);
        let publishing = node.clone();
        tokio::task::spawn_blocking(move || {
            let node = publishing;
            let v0 = node.publish_first_image(0, images[0].clone()).unwrap();
            assert_eq!(
                v0.weights_hash,
                Checkpoint::from_safetensors(&images[0])
                    .unwrap()
                    .weights_hash()
            );
            assert_eq!(node.known_hash(&images[0]), Some(v0.weights_hash));
            let error = node.publish_first_image(0, images[0].clone()).unwrap_err();
            assert!(
                matches!(error, NodeError::AlreadyPublished { version: 0 }),
                "{error}"
            );
            let v1 = node.publish_image(&images[0], images[1].clone()).unwrap();
            assert_eq!(v1.version, 1);
            assert_eq!(node.known_hash(&images[0]), None);
        })
        .await
        .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_the_image_published_last_and_still_held_skips_the_base_check() {
        let (_dir, node) = started().await;
        let images = images(4);
        let publishing = node.clone();
        tokio::task::spawn_blocking(move || {
            let node = publishing;
            node.publish_first(0, &Checkpoint::from_safetensors(&images[0]).unwrap())
                .unwrap();
            // Published from a borrowed checkpoint: nothing is held.
            assert_eq!(node.known_hash(&images[0]), None);
            let v1 = node.publish_image(&images[0], images[1].clone()).unwrap();
            assert_eq!(node.known_hash(&images[1]), Some(v1.weights_hash));
            // The same bytes in another allocation are not vouched for.
            let copy = Arc::new(images[1].as_ref().clone());
            assert_eq!(node.known_hash(&copy), None);
            // A base that is not the newest version is still refused.
            let error = node
                .publish_image(&images[0], images[2].clone())
                .unwrap_err();
            assert!(
                matches!(error, NodeError::BaseNotPublished { version: 1, .. }),
                "{error}"
            );
            // The copy is hashed, found to be version 1, and published against.
            let v2 = node.publish_image(&copy, images[2].clone()).unwrap();
            assert_eq!(v2.version, 2);
            let v3 = node.publish_image(&images[2], images[3].clone()).unwrap();
            assert_eq!(v3.version, 3);
            assert_eq!(
                v3.weights_hash,
                Checkpoint::from_safetensors(&images[3])
                    .unwrap()
                    .weights_hash()
            );
            assert_eq!(node.known_hash(&images[2]), None);
        })
        .await
        .unwrap();
    }
}
