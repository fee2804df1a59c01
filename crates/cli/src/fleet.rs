//! Measurable transfers of one delta: [`transfer`] from a hub to N collectors over S
//! streams (bytes, time, goodput as it goes), and a [`Fleet`] (a hub, relays and actors
//! in regions) timed until every actor has staged. The benchmark harness of `aurora wan`,
//! kept out of the transport library, which it drives through its public API only.
//!
//! Benchmarks choose the addresses and the runtime every node runs on: across emulated
//! regions each region has a runtime whose threads live in its network namespace, since
//! a socket belongs to the namespace of the thread that creates it. All clocks are this
//! process's, and connection set-up is never timed.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aurora_delta::DeltaFile;
use aurora_proto::{Identity, ReceiverStats, Role, SenderStats, Weights};
use bytes::Bytes;
use tokio::runtime::Handle;

use aurora_transport::{
    DecodePool, IdleEngine, NodeConfig, NodeHandle, NodeStatus, Security, SocketOptions,
    TransportError, spawn_actor, spawn_collector, spawn_hub, spawn_relay,
};
use aurora_trust::{FleetCa, NodeTls};

/// How often [`transfer`] samples the bytes its receivers have read.
pub const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

const TOKEN: &[u8] = b"bench";
/// The trainer key and the run of a benchmark's TLS fleet: what a secure deployment
/// signs and checks, so that its rows cost what one does.
const BENCH_KEY: [u8; 32] = [0xbe; 32];
const BENCH_RUN: aurora_delta::RunId = aurora_delta::RunId([0xbe; 16]);

/// A benchmark's transport security: mutual TLS with certificates a fleet CA of its
/// own issues to each node as it starts, or insecure plaintext with a token.
#[derive(Clone, Default)]
pub enum BenchSecurity {
    #[default]
    InsecurePlaintext,
    Tls(Arc<FleetCa>),
}

impl std::fmt::Debug for BenchSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BenchSecurity::InsecurePlaintext => "insecure plaintext",
            BenchSecurity::Tls(_) => "TLS",
        })
    }
}

impl BenchSecurity {
    /// A new fleet CA's TLS.
    pub fn tls() -> Result<BenchSecurity, TransportError> {
        Ok(BenchSecurity::Tls(Arc::new(FleetCa::create("bench")?)))
    }

    /// A node's configuration, with a certificate of `identity` under TLS.
    fn node(&self, identity: Identity) -> Result<NodeConfig, TransportError> {
        let security = match self {
            // The benchmark's nodes all run on this machine, in network namespaces it
            // made (an emulated WAN): a closed network by construction.
            BenchSecurity::InsecurePlaintext => Security::InsecurePlaintext {
                token: TOKEN.to_vec(),
                reach: aurora_trust::PlaintextReach::ClosedNetwork,
            },
            BenchSecurity::Tls(ca) => {
                let role = match identity.role {
                    Role::Hub => aurora_trust::Role::Trainer,
                    Role::Relay => aurora_trust::Role::Relay,
                    Role::Actor => aurora_trust::Role::Actor,
                };
                let certified =
                    aurora_trust::Identity::new(role, &identity.peer_id, &identity.region)
                        .map_err(aurora_trust::TrustError::from)?;
                let cert = ca.issue(&certified, time::Duration::days(1))?;
                let tls = NodeTls::from_pem(ca.cert_pem(), &cert.cert_pem, &cert.key_pem)?;
                Security::Tls(Arc::new(tls))
            }
        };
        let role = identity.role;
        let mut config = NodeConfig::new(identity, security);
        if let BenchSecurity::Tls(_) = self {
            // Every version signed and checked, as certificates require.
            let key = aurora_delta::SigningKey::from_bytes(&BENCH_KEY);
            config.run = Some(BENCH_RUN);
            match role {
                Role::Hub => config.signing_key = Some(Arc::new(key)),
                Role::Relay | Role::Actor => config.trainer_key = Some(key.verifying_key()),
            }
        }
        Ok(config)
    }
}

#[derive(Debug, Clone)]
pub struct TransferSpec {
    /// A complete delta artifact.
    pub artifact: Bytes,
    pub receivers: usize,
    pub streams: u8,
    /// Where the hub listens (port 0 picks one).
    pub listen: SocketAddr,
    /// Where receivers connect; `None` uses the hub's bound address.
    pub connect: Option<SocketAddr>,
    pub socket: SocketOptions,
    /// Let receivers tune their stream count (`streams` is then the upper bound; they
    /// start with one).
    pub tune_interval: Option<Duration>,
    /// Stop after this long and report what each receiver holds by then (the goodput of
    /// a transfer too slow to finish); `None` waits for every receiver.
    pub time_limit: Option<Duration>,
    /// An artifact of the version before `artifact`'s, sent over the same sessions
    /// before the clock starts and followed by this much idle time: the timed transfer
    /// then runs on connections that have carried data before, as each step's does in a
    /// long session (congestion control past its start-up).
    pub warm_up: Option<(Bytes, Duration)>,
    /// Give up after this long.
    pub timeout: Duration,
    /// The runtimes the hub and the receivers run on; `None`: the caller's.
    pub hub_runtime: Option<Handle>,
    pub receiver_runtime: Option<Handle>,
    pub security: BenchSecurity,
}

impl TransferSpec {
    pub fn new(artifact: Bytes, receivers: usize, streams: u8) -> TransferSpec {
        TransferSpec {
            artifact,
            receivers,
            streams,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            connect: None,
            socket: SocketOptions::default(),
            tune_interval: None,
            time_limit: None,
            warm_up: None,
            timeout: Duration::from_secs(600),
            hub_runtime: None,
            receiver_runtime: None,
            security: BenchSecurity::default(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ReceiverReport {
    /// From publication to this receiver holding the verified artifact; `None` if it
    /// did not within the time limit.
    pub elapsed: Option<Duration>,
    /// The session's counters, warm-up included.
    pub stats: ReceiverStats,
    /// Streams welcomed at the end (the tuner's choice when tuning).
    pub streams: u8,
    /// Bytes read from the hub by the end since the clock started
    /// ([`NodeHandle::upstream_bytes`]).
    pub bytes_read: u64,
}

#[derive(Debug, Clone)]
pub struct TransferReport {
    pub artifact_bytes: u64,
    /// From publication to the last receiver done, or to the time limit.
    pub elapsed: Duration,
    pub receivers: Vec<ReceiverReport>,
    pub sender: SenderStats,
    /// Bytes all receivers had read from the hub, every [`PROGRESS_INTERVAL`] from
    /// publication on.
    pub progress: Vec<(Duration, u64)>,
}

impl TransferReport {
    /// Whether every receiver got the whole artifact.
    pub fn complete(&self) -> bool {
        self.receivers.iter().all(|r| r.elapsed.is_some())
    }

    /// The artifact once per receiver that got it, plus what the others had read by
    /// the time limit (segments can be megabytes each, so counting only whole ones
    /// would make a slow transfer's goodput jump in steps).
    pub fn delivered_bytes(&self) -> u64 {
        self.receivers
            .iter()
            .map(|r| match r.elapsed {
                Some(_) => self.artifact_bytes,
                None => r.bytes_read,
            })
            .sum()
    }

    /// The network's goodput once the first `warmup` is over (slow start, a tuner's
    /// first probes): the bytes read from the first sample at or after `warmup` to the
    /// last sample that saw bytes arrive, over that time. It leaves out the start and
    /// the verification and assembly of the artifact after its last byte. `None` when
    /// no byte arrived after `warmup`.
    pub fn steady_goodput(&self, warmup: Duration) -> Option<f64> {
        let &(from, held) = self.progress.iter().find(|(at, _)| *at >= warmup)?;
        let &(to, read) = self
            .progress
            .windows(2)
            .rev()
            .find(|pair| pair[1].1 > pair[0].1)
            .map(|pair| &pair[1])?;
        let span = to.checked_sub(from)?.as_secs_f64();
        (span > 0.0).then(|| (read - held) as f64 / span)
    }
}

/// Runs `start` (a node's start) on `runtime`, so the node's sockets and tasks live
/// there; on the caller's runtime when `None`.
async fn start_on<T: Send + 'static>(
    runtime: Option<&Handle>,
    start: impl Future<Output = Result<T, TransportError>> + Send + 'static,
) -> Result<T, TransportError> {
    let Some(runtime) = runtime else {
        return start.await;
    };
    match runtime.spawn(start).await {
        Ok(result) => result,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(_) => Err(TransportError::Stopped),
    }
}

fn identity(role: Role, peer_id: String, region: &str) -> Identity {
    Identity {
        role,
        peer_id,
        region: region.into(),
    }
}

/// Publishes `spec.artifact` on a fresh hub and waits until every receiver holds it,
/// verified, or the time limit. Receivers have all their streams up before the clock
/// starts.
pub async fn transfer(spec: TransferSpec) -> Result<TransferReport, TransportError> {
    let version_of = |artifact: &Bytes| {
        DeltaFile::parse(artifact)
            .map(|file| file.header().target_version)
            .map_err(TransportError::Extraction)
    };
    let version = version_of(&spec.artifact)?;
    let first_version = match &spec.warm_up {
        Some((warm_up, _)) => version_of(warm_up)?,
        None => version,
    };
    // Receivers take versions in order: any other warm-up would leave them waiting for
    // the version between until the timeout.
    if spec.warm_up.is_some() && first_version.checked_add(1) != Some(version) {
        let before = version
            .checked_sub(1)
            .map_or("none".into(), |v| v.to_string());
        return Err(TransportError::InvalidSpec(format!(
            "the warm-up is version {first_version}, not {before}, the one before the timed \
             artifact's {version}"
        )));
    }
    let mut hub_config = spec
        .security
        .node(identity(Role::Hub, "hub".into(), "bench"))?;
    hub_config.listen = Some(spec.listen);
    hub_config.socket = spec.socket.clone();
    hub_config.retain_versions = 1;
    let hub = start_on(spec.hub_runtime.as_ref(), spawn_hub(hub_config, None)).await?;
    let address = spec
        .connect
        .unwrap_or(hub.local_addr().expect("the hub listens"));
    let mut receivers = Vec::with_capacity(spec.receivers);
    for index in 0..spec.receivers {
        let mut config = spec
            .security
            .node(identity(Role::Actor, index.to_string(), "bench"))?;
        config.upstreams = vec![address];
        config.streams = spec.streams;
        config.socket = spec.socket.clone();
        config.tune_interval = spec.tune_interval;
        let receiver = start_on(
            spec.receiver_runtime.as_ref(),
            spawn_collector(config, first_version),
        )
        .await;
        match receiver {
            Ok(receiver) => receivers.push(receiver),
            Err(error) => {
                hub.kill();
                receivers.iter().for_each(NodeHandle::kill);
                return Err(error);
            }
        }
    }
    let outcome = tokio::time::timeout(spec.timeout, async {
        for receiver in &receivers {
            receiver.all_streams_up().await?;
        }
        if let Some((warm_up, idle)) = &spec.warm_up {
            hub.publish(warm_up.clone()).await?;
            for receiver in &receivers {
                receiver
                    .wait_for(|s| s.completed.contains(&first_version))
                    .await?;
            }
            tokio::time::sleep(*idle).await;
        }
        let start = Instant::now();
        // Bytes of the warm-up are not the timed transfer's.
        let read_before: Vec<u64> = receivers.iter().map(NodeHandle::upstream_bytes).collect();
        let warm_up_bytes: u64 = read_before.iter().sum();
        hub.publish(spec.artifact.clone()).await?;
        let mut waits = tokio::task::JoinSet::new();
        for (index, receiver) in receivers.iter().enumerate() {
            let mut watch = receiver.watch();
            waits.spawn(async move {
                watch
                    .wait_for(|s| s.completed.contains(&version))
                    .await
                    .map_err(|_| TransportError::Stopped)?;
                Ok::<_, TransportError>((index, start.elapsed()))
            });
        }
        let mut finished = vec![None; receivers.len()];
        let mut progress = Vec::new();
        let mut ticks = tokio::time::interval(PROGRESS_INTERVAL);
        let deadline = spec.time_limit.map(|limit| start + limit);
        loop {
            let limit = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                done = waits.join_next() => match done {
                    Some(done) => {
                        let (index, elapsed) = done.expect("the wait does not panic")?;
                        finished[index] = Some(elapsed);
                    }
                    None => break,
                },
                _ = ticks.tick() => {
                    let read: u64 = receivers.iter().map(NodeHandle::upstream_bytes).sum();
                    progress.push((start.elapsed(), read - warm_up_bytes));
                }
                () = limit => break,
            }
        }
        Ok::<_, TransportError>((start.elapsed(), finished, progress, read_before))
    })
    .await;
    let sender = hub.status().sender.unwrap_or_default();
    hub.kill();
    let statuses: Vec<(NodeStatus, u64)> = receivers
        .iter()
        .map(|r| (r.status(), r.upstream_bytes()))
        .collect();
    receivers.iter().for_each(NodeHandle::kill);
    let (elapsed, finished, progress, read_before) =
        outcome.map_err(|_| TransportError::TimedOut(spec.timeout))??;
    let receivers = statuses
        .into_iter()
        .zip(finished)
        .zip(read_before)
        .map(|(((status, bytes_read), elapsed), before)| ReceiverReport {
            elapsed,
            stats: status.receiver.unwrap_or_default(),
            streams: status.streams,
            bytes_read: bytes_read - before,
        })
        .collect();
    Ok(TransferReport {
        artifact_bytes: spec.artifact.len() as u64,
        elapsed,
        receivers,
        sender,
        progress,
    })
}

/// One region of a [`Fleet`].
#[derive(Debug, Clone)]
pub struct FleetRegion {
    pub name: String,
    /// Actors in the region; with relays, the relay is one of them.
    pub actors: usize,
    /// The region's address; its relay listens there.
    pub address: IpAddr,
    /// The runtime its nodes run on; `None`: the caller's.
    pub runtime: Option<Handle>,
}

#[derive(Debug, Clone)]
pub struct FleetSpec {
    pub regions: Vec<FleetRegion>,
    /// Each region's first actor is a relay the others subscribe to (falling back to
    /// the hub); without relays every actor subscribes to the hub.
    pub relays: bool,
    /// Where the hub listens (port 0 picks one).
    pub hub_listen: SocketAddr,
    pub hub_runtime: Option<Handle>,
    pub streams: u8,
    pub socket: SocketOptions,
    pub tune_interval: Option<Duration>,
    /// Give up starting or waiting after this long.
    pub timeout: Duration,
    pub security: BenchSecurity,
}

/// A relay or an actor of a [`Fleet`].
pub struct Member {
    pub region: String,
    pub name: String,
    pub role: Role,
    pub node: NodeHandle,
}

/// When a member held a version and when it had staged it.
#[derive(Debug, Clone)]
pub struct StagedReport {
    pub region: String,
    pub name: String,
    pub role: Role,
    /// The version received and verified (observed at the latest when staged).
    pub received: Duration,
    pub staged: Duration,
}

/// A hub and, in every region, actors, maybe behind a relay. Dropping it kills every
/// node.
pub struct Fleet {
    pub hub: NodeHandle,
    pub members: Vec<Member>,
    timeout: Duration,
}

impl Fleet {
    /// Starts the hub and every region's relay and actors, each with a copy of
    /// `weights` (the base of what will be published); returns once every member has
    /// all its streams up, so what follows times transfers, not connections.
    pub async fn start(spec: &FleetSpec, weights: &Weights) -> Result<Fleet, TransportError> {
        let mut hub_config = spec
            .security
            .node(identity(Role::Hub, "hub".into(), "hub"))?;
        hub_config.listen = Some(spec.hub_listen);
        hub_config.socket = spec.socket.clone();
        let hub = start_on(spec.hub_runtime.as_ref(), spawn_hub(hub_config, None)).await?;
        let hub_address = hub.local_addr().expect("the hub listens");
        let mut fleet = Fleet {
            hub,
            members: Vec::new(),
            timeout: spec.timeout,
        };
        // The members decode on one pool, taking turns: they progress together, as on
        // machines of their own, and the cores see one decode thread each.
        let decode_pool = DecodePool::new(None)?;
        let config = |role, name: &str, region: &str, upstreams| {
            let mut config = spec.security.node(identity(role, name.into(), region))?;
            config.decode_pool = Some(decode_pool.clone());
            config.upstreams = upstreams;
            config.streams = spec.streams;
            config.socket = spec.socket.clone();
            config.tune_interval = spec.tune_interval;
            Ok::<_, TransportError>(config)
        };
        // An actor's id is its number (one spelling, as a certificate names it); its
        // name, the region's and its index there, is for the reports.
        let mut actors = 0u32;
        for region in &spec.regions {
            let runtime = region.runtime.as_ref();
            let mut upstreams = vec![hub_address];
            for index in 0..region.actors {
                let relay = spec.relays && index == 0;
                let (role, name, id) = if relay {
                    let name = format!("{}-relay", region.name);
                    (Role::Relay, name.clone(), name)
                } else {
                    actors += 1;
                    let name = format!("{}-actor{index}", region.name);
                    (Role::Actor, name, actors.to_string())
                };
                let node = if relay {
                    let mut config = config(role, &id, &region.name, vec![hub_address])?;
                    config.listen = Some(SocketAddr::new(region.address, 0));
                    let relay = start_on(runtime, spawn_relay(config)).await?;
                    upstreams.insert(0, relay.local_addr().expect("a relay listens"));
                    relay
                } else {
                    let config = config(role, &id, &region.name, upstreams.clone())?;
                    let engine = std::sync::Arc::new(IdleEngine::default());
                    let weights = weights.try_clone()?;
                    start_on(runtime, spawn_actor(config, weights, engine)).await?
                };
                fleet.members.push(Member {
                    region: region.name.clone(),
                    name,
                    role,
                    node,
                });
            }
        }
        tokio::time::timeout(spec.timeout, async {
            for member in &fleet.members {
                member.node.all_streams_up().await?;
            }
            Ok::<_, TransportError>(())
        })
        .await
        .map_err(|_| TransportError::TimedOut(spec.timeout))??;
        Ok(fleet)
    }

    /// Waits until every actor has staged `version` (or activated it) and every relay
    /// holds it (relays hold no weights); times are from `start`, in members' order.
    pub async fn staged(
        &self,
        version: u64,
        start: Instant,
    ) -> Result<Vec<StagedReport>, TransportError> {
        let mut waits = tokio::task::JoinSet::new();
        for (index, member) in self.members.iter().enumerate() {
            let mut watch = member.node.watch();
            let relay = member.role == Role::Relay;
            waits.spawn(async move {
                let mut received = None;
                loop {
                    let status = watch.borrow_and_update().clone();
                    if received.is_none() && status.completed.contains(&version) {
                        received = Some(start.elapsed());
                    }
                    let staged = (relay && received.is_some())
                        || status.staged == Some(version)
                        || status.active.is_some_and(|a| a.version >= version);
                    if staged {
                        let staged = start.elapsed();
                        return Ok((index, received.unwrap_or(staged), staged));
                    }
                    if status.diverged {
                        return Err(TransportError::Diverged(version));
                    }
                    watch.changed().await.map_err(|_| TransportError::Stopped)?;
                }
            });
        }
        let mut reports: Vec<Option<StagedReport>> = vec![None; self.members.len()];
        tokio::time::timeout(self.timeout, async {
            while let Some(done) = waits.join_next().await {
                let (index, received, staged) = done.expect("the wait does not panic")?;
                let member = &self.members[index];
                reports[index] = Some(StagedReport {
                    region: member.region.clone(),
                    name: member.name.clone(),
                    role: member.role,
                    received,
                    staged,
                });
            }
            Ok::<_, TransportError>(())
        })
        .await
        .map_err(|_| TransportError::TimedOut(self.timeout))??;
        Ok(reports.into_iter().flatten().collect())
    }

    /// Kills every node, downstream first so that none sees its upstream go and falls
    /// back, and waits until each has let go of its weights and sockets.
    pub async fn stop(mut self) {
        // Members are in region order, each relay before its actors.
        let members = std::mem::take(&mut self.members);
        let nodes = members.iter().rev().map(|m| &m.node);
        for node in nodes.chain(std::iter::once(&self.hub)) {
            node.kill();
            let mut watch = node.watch();
            // The status channel closes when the node's task is gone.
            while watch.changed().await.is_ok() {}
        }
    }

    fn kill(&self) {
        self.hub.kill();
        for member in &self.members {
            member.node.kill();
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deltas of the tiny shape, with steps larger than real training so that each
    /// spans many segments.
    fn deltas(versions: u64, seed: u64) -> Vec<Bytes> {
        let shape = aurora_synth::preset("tiny").unwrap();
        let mut config = aurora_synth::SynthConfig::new(shape, seed);
        config.learning_rate = 3e-5;
        let chain = aurora_synth::DeltaChain::new(config, versions, 1024);
        chain.deltas.into_iter().map(Bytes::from).collect()
    }

    /// A hang fails the test instead of stalling the suite.
    async fn within<T>(future: impl Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(120), future)
            .await
            .expect("the transfer hung")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_bench_transfer_reports_bytes_time_and_streams() {
        let deltas = deltas(1, 17);
        let spec = TransferSpec::new(deltas[0].clone(), 3, 4);
        let report = within(transfer(spec)).await.unwrap();
        assert_eq!(report.receivers.len(), 3);
        let payload: u64 = DeltaFile::parse(&deltas[0])
            .unwrap()
            .manifest
            .payload_bytes();
        for receiver in &report.receivers {
            assert_eq!(receiver.stats.segment_bytes, payload);
            assert_eq!(receiver.stats.stream_bytes.len(), 4, "one count per stream");
            assert_eq!(receiver.stats.stream_bytes.iter().sum::<u64>(), payload);
        }
        assert_eq!(report.sender.segment_bytes_sent, 3 * payload);
        assert!(report.complete());
        assert_eq!(report.delivered_bytes(), 3 * report.artifact_bytes);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bench_warm_up_that_is_not_the_version_before_is_refused_at_once() {
        let deltas = deltas(2, 19);
        let mut spec = TransferSpec::new(deltas[0].clone(), 1, 2);
        spec.warm_up = Some((deltas[1].clone(), std::time::Duration::ZERO));
        let error = within(transfer(spec)).await.unwrap_err();
        assert!(
            error
                .to_string()
                .contains("the warm-up is version 2, not 0"),
            "{error}"
        );
    }
}
