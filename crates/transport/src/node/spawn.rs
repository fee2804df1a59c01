//! Starting a node of each kind: its listener, its upstream sessions and its event loop.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use aurora_delta::{Hash, RunId};
use aurora_proto::{
    KeptSegments, KeptSnapshot, Node, Receiver, RelayOptions, Sender, Upstreams, VersionRef,
    Weights,
};
use aurora_store::Store;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::decode::{DecodeBacklog, DecodePool};
use crate::engine::{Engine, IdleEngine};
use crate::kept::FileSnapshots;
use crate::security::{BuildBudget, RefusalCounters};

use super::accept::{Gate, accept_loop};
use super::driver::{Driver, EVENT_QUEUE};
use super::handle::NodeHandle;
use super::{NodeConfig, NodeStatus, TransportError};

/// Starts a hub: serves published versions, and stored ones from `store` on request.
pub async fn spawn_hub(
    mut config: NodeConfig,
    store: Option<Arc<Store>>,
) -> Result<NodeHandle, TransportError> {
    config.run = Some(hub_run(&config, store.as_deref())?);
    let mut sender = Sender::new(config.sender(store.is_some()));
    if let Some(store) = &store {
        sender.set_loadable(store.latest_version()?);
        sender.set_snapshots(store.records()?.1.into_keys());
    }
    spawn(
        config,
        Node::hub(sender),
        None,
        None::<Arc<IdleEngine>>,
        store,
    )
    .await
}

/// Starts a relay: it holds no weights, receives every version from the newest its
/// first upstream serves on, and forwards each verified segment to its subscribers as
/// it arrives (docs/wire-protocol.md §8). With a [`NodeConfig::snapshot_dir`] it starts
/// from its upstream's newest snapshot instead, and serves it to its region's joiners.
pub async fn spawn_relay(config: NodeConfig) -> Result<NodeHandle, TransportError> {
    if config.upstreams.is_empty() {
        return Err(TransportError::NoUpstream("a relay"));
    }
    let receiver = Receiver::relaying(config.receiver_config());
    let sender = Sender::new(config.sender(false));
    let mut options = RelayOptions {
        keep_snapshots: None,
        suspend_after: config.relay_suspend_after,
    };
    if let Some(dir) = &config.snapshot_dir {
        // Checked now, not when the snapshot's first segment arrives.
        let writable = tempfile::tempfile_in(dir).map(drop);
        writable.map_err(|source| TransportError::SnapshotDir {
            dir: dir.clone(),
            source,
        })?;
        options.keep_snapshots = Some(Arc::new(FileSnapshots::new(dir)));
    }
    let node = Node::relay(receiver, sender, options);
    spawn(config, node, None, None::<Arc<IdleEngine>>, None).await
}

/// How long a relay's fetcher that holds its snapshot may go without completing a
/// version while it catches up with the relay: longer, and its upstream is behind the
/// relay's, or withholds versions, and the try ends.
const FETCH_STALL: Duration = Duration::from_secs(60);

/// A relay's fetch of its upstream's newest snapshot, if it is newer than `newer_than`,
/// on a session of its own (`aurora_proto::Output::FetchSnapshot`): the snapshot,
/// complete and verified, with the complete deltas after it and where their segments
/// are kept, or why there is none. Where the relay (whose status is `relay`) keeps no
/// snapshot once the fetcher holds its own, it no longer holds every delta after it
/// either, so the fetcher first follows the deltas up to the relay's newest version and
/// brings them too. One try: a session that ends first (the upstream has no newer
/// snapshot, or the link failed), or a catch-up that stalls, ends it, and the relay goes
/// on as it was.
pub(super) async fn fetch_snapshot(
    config: NodeConfig,
    newer_than: u64,
    relay: watch::Receiver<NodeStatus>,
) -> Result<(KeptSnapshot, Box<dyn KeptSegments>), String> {
    let dir = config
        .snapshot_dir
        .clone()
        .ok_or("a relay without a snapshot directory keeps no snapshot")?;
    let node = Node::snapshot_fetcher(
        Receiver::relaying(config.receiver_config()),
        Sender::new(config.sender(false)),
        Arc::new(FileSnapshots::new(dir)),
        newer_than,
    );
    let fetcher = spawn(config, node, None, None::<Arc<IdleEngine>>, None)
        .await
        .map_err(|e| super::error_chain(&e))?;
    // Stopped however this ends, the relay's own end included (its driver then drops
    // this future): a fetcher left running would hold its session and its file.
    let fetcher = StopOnDrop(fetcher);
    ready_to_hand_over(fetcher.0.status.clone(), relay, newer_than, FETCH_STALL).await?;
    fetcher
        .0
        .take_kept()
        .await
        .map_err(|e| super::error_chain(&e))
}

/// Waits until a fetcher (whose status is `fetcher`) holds what its relay needs: its
/// snapshot newer than `newer_than`, however long that takes (it is one version), and
/// then, where the relay keeps no snapshot, the deltas up to the relay's newest version.
/// Both follow the same upstream, so the fetcher soon holds what the relay does; a
/// catch-up that completes no version for `stall` fails, naming where it stood.
async fn ready_to_hand_over(
    mut fetcher: watch::Receiver<NodeStatus>,
    relay: watch::Receiver<NodeStatus>,
    newer_than: u64,
    stall: Duration,
) -> Result<(), String> {
    let ended = |status: &NodeStatus| status.upstream_switches > 0;
    let stopped = |_| "the fetcher stopped".to_string();
    let mut status = fetcher
        .wait_for(|s| !s.completed.is_empty() || ended(s))
        .await
        .map_err(stopped)?
        .clone();
    // Decided once per status, so a version the relay completes meanwhile cannot turn
    // a hand-over into a failure.
    loop {
        if ended(&status) {
            return Err(format!(
                "the session ended before a snapshot newer than version {newer_than} came"
            ));
        }
        let (keeps, newest) = {
            let relay = relay.borrow();
            (
                relay.kept_snapshot.is_some(),
                relay.completed.last().copied(),
            )
        };
        let holds = status.completed.last().copied();
        if keeps || holds >= newest {
            return Ok(());
        }
        let progressed = fetcher.wait_for(|s| s.completed.last().copied() != holds || ended(s));
        status = tokio::time::timeout(stall, progressed)
            .await
            .map_err(|_| {
                format!(
                    "the fetcher completed no version for {stall:?} while it caught up \
                     with the relay's version {newest:?} from {holds:?}"
                )
            })?
            .map_err(stopped)?
            .clone();
    }
}

/// A node stopped when this is dropped.
struct StopOnDrop(NodeHandle);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.kill();
    }
}

/// Starts an actor: it receives from its upstreams, stages each delta against its
/// weights and activates committed versions at the engine's safe points.
pub async fn spawn_actor<E: Engine>(
    config: NodeConfig,
    weights: Weights,
    engine: Arc<E>,
) -> Result<NodeHandle, TransportError> {
    start_actor(config, Some(weights), engine).await
}

/// Starts an actor with no weights (a newcomer on another machine): it takes the newest
/// snapshot an upstream offers over the wire, activates it at once (the engine gets its
/// weights through [`Engine::activate`] before any safe point), then goes on as
/// [`spawn_actor`] does. Its status has no active version until then.
pub async fn spawn_joining_actor<E: Engine>(
    config: NodeConfig,
    engine: Arc<E>,
) -> Result<NodeHandle, TransportError> {
    start_actor(config, None, engine).await
}

pub(super) async fn start_actor<E: Engine>(
    config: NodeConfig,
    weights: Option<Weights>,
    engine: Arc<E>,
) -> Result<NodeHandle, TransportError> {
    if config.upstreams.is_empty() {
        return Err(TransportError::NoUpstream("an actor"));
    }
    let active = weights.as_ref().map(Weights::active);
    let receiver = config.receiver(active);
    let mut node = match active {
        Some(active) => Node::actor(receiver, active),
        None => Node::joining_actor(receiver),
    };
    // The target hash is checked behind generation, not at the safe point.
    node.verify_at_staging();
    let weights = weights.unwrap_or_else(|| Weights::empty(config.images.clone()));
    spawn(config, node, Some(weights), Some(engine), None).await
}

/// Starts a receiver that only collects verified artifacts from `first_version` (at
/// least 1) on (benchmarks).
pub async fn spawn_collector(
    config: NodeConfig,
    first_version: u64,
) -> Result<NodeHandle, TransportError> {
    if config.upstreams.is_empty() {
        return Err(TransportError::NoUpstream("a collector"));
    }
    let start = VersionRef {
        version: first_version.saturating_sub(1),
        hash: Hash::default(),
    };
    let receiver = config.receiver(Some(start));
    spawn(
        config,
        Node::collector(receiver),
        None,
        None::<Arc<IdleEngine>>,
        None,
    )
    .await
}

pub(super) async fn spawn<E: Engine>(
    config: NodeConfig,
    node: Node,
    weights: Option<Weights>,
    engine: Option<Arc<E>>,
    store: Option<Arc<Store>>,
) -> Result<NodeHandle, TransportError> {
    if let Some(certified) = config.security.certified_identity() {
        let certified = certified.map_err(|why| TransportError::NotTheCertificate {
            configured: config.identity.clone(),
            certified: why.to_string(),
        })?;
        if certified.role != config.identity.role || certified.peer_id != config.identity.peer_id {
            return Err(TransportError::NotTheCertificate {
                configured: config.identity.clone(),
                certified: format!("{} '{}'", certified.role, certified.peer_id),
            });
        }
    }
    check_signed(&config, node.receiver().is_some())?;
    if let Some(address) = config.listen {
        config
            .security
            .check_address("the transport's listen address", address)?;
    }
    for &address in &config.upstreams {
        config.security.check_address("the upstream", address)?;
    }
    let tls = config.security.endpoints()?;
    let mut tasks = JoinSet::new();
    let (events_tx, events) = mpsc::channel(EVENT_QUEUE);
    let refusals = Arc::new(RefusalCounters::default());
    let mut local_addr = None;
    if let Some(address) = config.listen {
        let listener = TcpListener::bind(address)
            .await
            .map_err(|source| TransportError::Listen { address, source })?;
        local_addr = Some(
            listener
                .local_addr()
                .map_err(|source| TransportError::Listen { address, source })?,
        );
        let gate = Gate::new(config.limits.clone(), refusals.clone(), events_tx.clone());
        tasks.spawn(accept_loop(
            listener,
            config.socket.clone(),
            tls.as_ref().map(|tls| tls.acceptor.clone()),
            gate,
        ));
    }
    let (commands_tx, commands) = mpsc::channel(64);
    let initial = NodeStatus {
        active: node.actor_status().and_then(|s| s.active),
        run: node
            .sender()
            .and_then(Sender::run)
            .or_else(|| node.receiver().and_then(Receiver::run)),
        ..NodeStatus::default()
    };
    let (status_tx, status) = watch::channel(initial);
    let upstream_bytes = Arc::new(AtomicU64::new(0));
    // Only nodes that hold weights decode: a hub or a collector needs no pool.
    let decoder = match (&weights, &config.decode_pool) {
        (None, _) => None,
        (Some(_), Some(shared)) => Some(shared.clone()),
        (Some(_), None) => Some(DecodePool::new(None)?),
    }
    .map(|pool| {
        let member = pool.member();
        (pool, member)
    });
    let backlog = DecodeBacklog::new(config.limits.max_decode_backlog_bytes);
    let upstreams = Upstreams::new(
        config.upstreams.clone(),
        config.return_after.map(jittered),
        RandomState::new().build_hasher().finish(),
    );
    let mut driver = Driver {
        upstream_bytes: upstream_bytes.clone(),
        config,
        node,
        weights: weights.map(Arc::new),
        decoder,
        backlog,
        engine,
        prepared: None,
        store,
        live: BTreeMap::new(),
        conns: HashMap::new(),
        peer_conns: HashMap::new(),
        builds: BuildBudget::default(),
        checkpoint_bytes: 0,
        refusals,
        connector: tls.map(|tls| tls.connector),
        next_conn: 1,
        upstreams,
        new_session_at: None,
        tasks,
        events_tx,
        status_tx,
        status: NodeStatus::default(),
    };
    driver.status = driver.status_tx.borrow().clone();
    driver.read_store(None);
    if driver.node.receiver().is_some() {
        driver.new_session_at = Some(Instant::now());
    }
    let span = tracing::info_span!("node", peer = %driver.config.identity.peer_id);
    let task = tokio::spawn(tracing::Instrument::instrument(
        driver.run(events, commands),
        span,
    ));
    Ok(NodeHandle {
        commands: commands_tx,
        status,
        local_addr,
        task,
        upstream_bytes,
    })
}

/// The run a hub serves: its store's, which the configuration may only repeat; without
/// a store, the configuration's, or a new one (a hub that publishes from memory is a run
/// of its own).
fn hub_run(config: &NodeConfig, store: Option<&Store>) -> Result<RunId, TransportError> {
    match (store.map(Store::run_id), config.run) {
        (Some(stored), Some(configured)) if stored != configured => {
            Err(TransportError::OtherRun { configured, stored })
        }
        (Some(run), _) | (None, Some(run)) => Ok(run),
        (None, None) => {
            let mut id = [0u8; 16];
            getrandom::fill(&mut id).map_err(|e| TransportError::Random(e.to_string()))?;
            Ok(RunId(id))
        }
    }
}

/// With certificates every version is signed (docs/security.md §5): a node that
/// `receives` pins the trainer's key, a hub signs, unless the configuration says
/// [`NodeConfig::insecure_unsigned`] by name.
fn check_signed(config: &NodeConfig, receives: bool) -> Result<(), TransportError> {
    if config.insecure_unsigned {
        tracing::warn!(
            "INSECURE UNSIGNED VERSIONS: nothing proves the weights are the trainer's; a \
             compromised relay can hand actors any weights"
        );
        return Ok(());
    }
    if !matches!(config.security, crate::Security::Tls(_)) {
        return Ok(());
    }
    match (receives, &config.trainer_key, &config.signing_key) {
        (true, None, _) => Err(TransportError::TrainerKeyRequired),
        (false, _, None) => Err(TransportError::SigningKeyRequired),
        _ => Ok(()),
    }
}

/// `after`, a quarter more or less, drawn afresh for each call.
fn jittered(after: Duration) -> Duration {
    let draw = RandomState::new().build_hasher().finish();
    let factor = 0.75 + 0.5 * (draw as f64 / u64::MAX as f64);
    Duration::try_from_secs_f64(after.as_secs_f64() * factor).unwrap_or(after)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALL: Duration = Duration::from_secs(60);
    const SECOND: Duration = Duration::from_secs(1);

    fn completed(versions: impl IntoIterator<Item = u64>) -> NodeStatus {
        NodeStatus {
            completed: versions.into_iter().collect(),
            ..NodeStatus::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_catch_up_that_completes_nothing_for_the_stall_ends_the_fetch_naming_where_it_stood()
    {
        let (fetcher, fetcher_status) = watch::channel(NodeStatus::default());
        let (_relay, relay_status) = watch::channel(completed(5..=7));
        let fetch = tokio::spawn(ready_to_hand_over(fetcher_status, relay_status, 1, STALL));
        fetcher.send_replace(completed([4]));
        tokio::time::sleep(STALL - SECOND).await;
        // Each version completed starts the wait afresh.
        fetcher.send_replace(completed([4, 5]));
        tokio::time::sleep(STALL - SECOND).await;
        assert!(!fetch.is_finished(), "a catch-up that progresses goes on");
        tokio::time::sleep(2 * SECOND).await;
        assert!(fetch.is_finished(), "a minute without a version ends it");
        let error = fetch.await.unwrap().unwrap_err();
        assert!(
            error.contains("no version for 60s") && error.contains("Some(7) from Some(5)"),
            "{error}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_fetcher_hands_over_once_it_holds_the_relays_newest_version() {
        let (fetcher, fetcher_status) = watch::channel(NodeStatus::default());
        let (relay, relay_status) = watch::channel(completed(5..=7));
        let fetch = tokio::spawn(ready_to_hand_over(fetcher_status, relay_status, 1, STALL));
        fetcher.send_replace(completed([4, 5, 6]));
        tokio::time::sleep(SECOND).await;
        assert!(!fetch.is_finished(), "the fetcher lacks version 7");
        // Where the relay moves on meanwhile, the fetcher follows it there too.
        relay.send_replace(completed(5..=8));
        fetcher.send_replace(completed(4..=7));
        tokio::time::sleep(SECOND).await;
        assert!(!fetch.is_finished(), "the fetcher lacks version 8");
        fetcher.send_replace(completed(4..=8));
        fetch.await.unwrap().unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_relay_that_still_keeps_a_snapshot_takes_the_fetched_one_without_deltas() {
        let (fetcher, fetcher_status) = watch::channel(NodeStatus::default());
        let relay = NodeStatus {
            kept_snapshot: Some(2),
            ..completed(5..=7)
        };
        let (_relay, relay_status) = watch::channel(relay);
        let fetch = tokio::spawn(ready_to_hand_over(fetcher_status, relay_status, 2, STALL));
        fetcher.send_replace(completed([4]));
        fetch.await.unwrap().unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_fetch_whose_session_ends_fails_naming_the_snapshot_it_wanted() {
        let (fetcher, fetcher_status) = watch::channel(NodeStatus::default());
        let (_relay, relay_status) = watch::channel(completed(5..=7));
        let fetch = tokio::spawn(ready_to_hand_over(fetcher_status, relay_status, 3, STALL));
        fetcher.send_replace(NodeStatus {
            upstream_switches: 1,
            ..NodeStatus::default()
        });
        let error = fetch.await.unwrap().unwrap_err();
        assert!(error.contains("newer than version 3"), "{error}");
    }
}
