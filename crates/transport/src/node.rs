//! The event loop of one node: owns the sans-IO [`aurora_proto::Node`], its sockets, its
//! timers and, for relays and actors, its weights and engine.
//!
//! Every socket has a reader and a writer task; they and the listener report to the loop
//! through one bounded channel, so the loop is the only place where protocol state
//! changes. Heavy work (staging, activation, store reads and writes, building snapshot
//! artifacts) runs on blocking threads and reports back the same way. Everything a node spawns lives in one
//! `JoinSet`, so killing the loop's task closes every socket at once, as a crash would.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aurora_delta::{DeltaError, Extraction, Hash, Manifest, PatchChunk, Segment};
use aurora_proto::{
    ArtifactKey, Auth, ConnId, Identity, Node, Notice, Output, Receiver, ReceiverConfig,
    ReceiverStats, Sender, SenderConfig, SenderError, SenderStats, VersionRef, Weights,
};
use aurora_store::{Store, StoreError};
use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{AbortHandle, JoinSet};

use crate::conn::{SocketOptions, WriteCmd, dial, spawn_conn};
use crate::decode::DecodePool;
use crate::engine::{Engine, IdleEngine};

/// Settings shared by every kind of node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub identity: Identity,
    /// Accept subscribers here (hubs and relays).
    pub listen: Option<SocketAddr>,
    /// Who may subscribe (hubs and relays).
    pub auth: Auth,
    /// Upstreams in order of preference (relays and actors): the region's relay first,
    /// then the hub or a peer relay to fall back to.
    pub upstreams: Vec<SocketAddr>,
    /// Token presented to upstreams.
    pub token: Vec<u8>,
    /// Parallel streams per upstream session (the upper bound when tuned).
    pub streams: u8,
    /// Tune the stream count from measured goodput at this interval.
    pub tune_interval: Option<Duration>,
    pub socket: SocketOptions,
    pub connect_timeout: Duration,
    pub idle_timeout: Duration,
    pub keepalive_interval: Duration,
    pub stall_timeout: Duration,
    /// Versions a relay keeps in memory for its subscribers.
    pub retain_versions: usize,
    /// Frames in flight per connection (the sender's window).
    pub window_frames: usize,
    /// Segment size of the snapshot artifacts a hub builds from its store for peers that
    /// join with no weights. Hubs that serve one store must agree on it: the same
    /// snapshot then gives the same artifact, and a join resumes across them.
    pub snapshot_segment_bytes: usize,
    /// Where a relay or an actor decodes deltas as their segments arrive, at a lower
    /// priority than the process ([`DecodePool`]). `None`: a pool of its own, one
    /// thread per core. Nodes of one process may share a pool: they then take turns,
    /// one segment each. Hubs and collectors decode nothing.
    pub decode_pool: Option<Arc<DecodePool>>,
}

impl NodeConfig {
    pub fn new(identity: Identity, token: Vec<u8>) -> NodeConfig {
        NodeConfig {
            identity,
            listen: None,
            auth: Auth::Shared(token.clone()),
            upstreams: Vec::new(),
            token,
            streams: 4,
            tune_interval: None,
            socket: SocketOptions::default(),
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(2),
            stall_timeout: Duration::from_secs(30),
            retain_versions: 4,
            window_frames: 4,
            snapshot_segment_bytes: 256 << 10,
            decode_pool: None,
        }
    }

    fn sender(&self, store_backed: bool) -> SenderConfig {
        let mut config = SenderConfig::new(self.identity.clone(), self.auth.clone());
        config.store_backed = store_backed;
        config.keepalive_interval = self.keepalive_interval;
        config.stall_timeout = self.stall_timeout;
        config.retain_versions = self.retain_versions;
        config.window_frames = self.window_frames;
        config
    }

    fn receiver_config(&self) -> ReceiverConfig {
        let mut config = ReceiverConfig::new(self.identity.clone(), self.token.clone());
        config.streams = self.streams;
        config.idle_timeout = self.idle_timeout;
        config.tune_interval = self.tune_interval;
        config
    }

    /// A receiver from `active` on, or one that joins from a snapshot (no weights).
    fn receiver(&self, active: Option<VersionRef>) -> Receiver {
        match active {
            Some(active) => Receiver::new(self.receiver_config(), active.version + 1, active),
            None => Receiver::joining(self.receiver_config()),
        }
    }
}

/// An error and its sources on one line: what a downstream is told in an Unavailable.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("the node has stopped")]
    Stopped,
    #[error("listening on {address}")]
    Listen {
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Publish(#[from] SenderError),
    #[error("storing the artifact")]
    Store(#[from] StoreError),
    #[error("extraction failed")]
    Extraction(#[from] DeltaError),
    #[error("building the decode thread pool: {0}")]
    Pool(String),
    #[error("invalid benchmark: {0}")]
    InvalidSpec(String),
    #[error("{0} needs at least one upstream")]
    NoUpstream(&'static str),
    #[error("gave up after {0:?}")]
    TimedOut(Duration),
    #[error("an actor refused the chain to version {0} from every upstream")]
    Diverged(u64),
}

/// Where a node stands; published after every event it handles.
#[derive(Debug, Clone, Default)]
pub struct NodeStatus {
    /// The active weights (relays and actors).
    pub active: Option<VersionRef>,
    pub staged: Option<u64>,
    pub committed: Option<u64>,
    /// Versions completed and verified by the receiver, in order.
    pub completed: Vec<u64>,
    /// The upstream of the current session.
    pub upstream: Option<SocketAddr>,
    pub connected: bool,
    /// Streams of the upstream session its upstream has welcomed.
    pub streams: u8,
    /// Streams the upstream session uses now (one at first when tuned).
    pub target_streams: u8,
    pub upstream_switches: u64,
    pub receiver: Option<ReceiverStats>,
    pub sender: Option<SenderStats>,
    /// Status reports received from subscribers (peer id, active version, note),
    /// the latest [`MAX_REPORTS`] of them.
    pub reports: Vec<(String, VersionRef, String)>,
    /// Sessions currently subscribed (hubs and relays).
    pub subscribers: usize,
    /// The actor refused its upstreams' chain [`aurora_proto::MAX_REFUSALS`] times.
    pub diverged: bool,
    /// Activations whose target hash did not match (the weights were restored).
    pub failed_activations: u64,
}

/// Reports kept in [`NodeStatus::reports`].
pub const MAX_REPORTS: usize = 256;
/// Events queued between the sockets and the loop.
const EVENT_QUEUE: usize = 1024;
/// Longest wait before a new upstream session after repeated failures.
const BACKOFF_MAX: Duration = Duration::from_secs(2);

pub(crate) enum Event {
    Accepted {
        stream: TcpStream,
    },
    Frame {
        conn: ConnId,
        frame: aurora_proto::Frame,
    },
    Closed {
        conn: ConnId,
        reason: String,
    },
    Sent {
        conn: ConnId,
    },
    Dialed {
        session: u64,
        stream: u8,
        result: Result<TcpStream, String>,
    },
    Decoded {
        version: u64,
        index: u32,
        hash: Hash,
        result: Result<Vec<PatchChunk>, DeltaError>,
    },
    SafePoint,
    Activated {
        version: u64,
        weights: Weights,
        /// The tensors the activation changed (none when it failed).
        changed: Vec<String>,
        result: Result<Hash, DeltaError>,
    },
    /// The artifact the sender asked for, or why there is none.
    Loaded {
        key: ArtifactKey,
        result: Result<Bytes, String>,
    },
    /// The store now holds `version`.
    Stored {
        version: u64,
    },
}

/// The bytes of the artifact `key` names (blocking: reads, and may build, from the
/// store), or why there are none. A composed delta is declined when replaying is no
/// dearer.
fn read_stored(
    key: ArtifactKey,
    store: &Store,
    snapshot_segment_bytes: usize,
) -> Result<Bytes, String> {
    let chain = |e: StoreError| error_chain(&e);
    match key {
        ArtifactKey::Delta(version) => store
            .delta(version)
            .map(|file| Bytes::copy_from_slice(file.bytes()))
            .map_err(chain),
        ArtifactKey::Snapshot(version) => store
            .snapshot_artifact(version, snapshot_segment_bytes)
            .map(Bytes::from)
            .map_err(chain),
        ArtifactKey::Composed { base, target } => {
            let (plan, bytes) = store.composed_catch_up(base, target).map_err(chain)?;
            tracing::info!(base, target, ?plan, bytes = plan.bytes(), "catch-up plan");
            bytes
                .map(Bytes::from)
                .ok_or_else(|| format!("the catch-up plan is {plan:?}"))
        }
    }
}

enum Command {
    Begin {
        descriptor: Bytes,
        reply: oneshot::Sender<Result<u64, TransportError>>,
    },
    Segment {
        version: u64,
        segment: Segment,
        reply: oneshot::Sender<Result<(), TransportError>>,
    },
    Seal {
        version: u64,
        manifest: Manifest,
        reply: oneshot::Sender<Result<(), TransportError>>,
    },
    Publish {
        artifact: Bytes,
        reply: oneshot::Sender<Result<u64, TransportError>>,
    },
    Commit(VersionRef),
    StoreChanged {
        reply: oneshot::Sender<Result<(), TransportError>>,
    },
}

/// A running node. Dropping the handle leaves the node running; [`NodeHandle::kill`]
/// stops it at once, closing every socket.
pub struct NodeHandle {
    commands: mpsc::Sender<Command>,
    status: watch::Receiver<NodeStatus>,
    local_addr: Option<SocketAddr>,
    task: tokio::task::JoinHandle<()>,
    upstream_bytes: Arc<AtomicU64>,
}

impl NodeHandle {
    /// The address subscribers connect to (hubs and relays).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local_addr
    }

    pub fn status(&self) -> NodeStatus {
        self.status.borrow().clone()
    }

    /// Bytes read from upstream connections so far, frames of every kind, counted as
    /// they arrive rather than per complete frame: the live progress of a transfer whose
    /// segments take seconds each.
    pub fn upstream_bytes(&self) -> u64 {
        self.upstream_bytes.load(Ordering::Relaxed)
    }

    /// A receiver of every status update.
    pub fn watch(&self) -> watch::Receiver<NodeStatus> {
        self.status.clone()
    }

    /// Waits until the status satisfies `condition`.
    pub async fn wait_for(
        &self,
        mut condition: impl FnMut(&NodeStatus) -> bool,
    ) -> Result<NodeStatus, TransportError> {
        let mut watch = self.status.clone();
        let status = watch
            .wait_for(|s| condition(s))
            .await
            .map_err(|_| TransportError::Stopped)?;
        Ok(status.clone())
    }

    /// Stops the node abruptly, as a crash would: no goodbye, every socket closed.
    pub fn kill(&self) {
        self.task.abort();
    }

    async fn call<T>(
        &self,
        command: impl FnOnce(oneshot::Sender<Result<T, TransportError>>) -> Command,
    ) -> Result<T, TransportError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(command(reply))
            .await
            .map_err(|_| TransportError::Stopped)?;
        answer.await.map_err(|_| TransportError::Stopped)?
    }

    /// Starts publishing a delta whose segments follow (hubs): `descriptor` is its
    /// preamble and header ([`aurora_delta::DeltaHeader::encode`]).
    pub async fn begin(&self, descriptor: Bytes) -> Result<u64, TransportError> {
        self.call(|reply| Command::Begin { descriptor, reply })
            .await
    }

    /// Publishes one segment of a version begun with [`NodeHandle::begin`]; it goes out
    /// to subscribers at once.
    pub async fn segment(&self, version: u64, segment: Segment) -> Result<(), TransportError> {
        self.call(|reply| Command::Segment {
            version,
            segment,
            reply,
        })
        .await
    }

    /// Closes a version with its manifest; a hub with a store stores the artifact.
    pub async fn seal(&self, version: u64, manifest: Manifest) -> Result<(), TransportError> {
        self.call(|reply| Command::Seal {
            version,
            manifest,
            reply,
        })
        .await
    }

    /// Publishes a complete delta artifact (and stores it, on a hub with a store).
    pub async fn publish(&self, artifact: Bytes) -> Result<u64, TransportError> {
        self.call(|reply| Command::Publish { artifact, reply })
            .await
    }

    /// The store was written behind the hub's back (a snapshot put by the trainer): the
    /// hub serves what the store holds now, and offers its newest snapshot to peers that
    /// join with no weights. Returns once the hub has read the catalog.
    pub async fn store_changed(&self) -> Result<(), TransportError> {
        self.call(|reply| Command::StoreChanged { reply }).await
    }

    /// Announces a commit to every subscriber.
    pub async fn commit(&self, commit: VersionRef) -> Result<(), TransportError> {
        self.commands
            .send(Command::Commit(commit))
            .await
            .map_err(|_| TransportError::Stopped)
    }

    /// Runs `extraction` and publishes it cut-through: the header first, each segment as
    /// the encoder finishes it, the manifest last. Blocks the calling thread, which must
    /// not be an async task's (use `spawn_blocking`).
    pub fn publish_extraction(&self, extraction: &Extraction) -> Result<Manifest, TransportError> {
        self.publish_extraction_observed(extraction, |_| {})
    }

    /// [`NodeHandle::publish_extraction`], calling `observe` with each segment as it
    /// leaves the encoder, before it is published (benchmarks time the first one).
    pub fn publish_extraction_observed(
        &self,
        extraction: &Extraction,
        mut observe: impl FnMut(&Segment) + Send,
    ) -> Result<Manifest, TransportError> {
        let descriptor = Bytes::from(extraction.header().encode());
        let version = block_on_reply(&self.commands, |reply| Command::Begin { descriptor, reply })?;
        let manifest = extraction.run(|segment: Segment| {
            observe(&segment);
            block_on_reply(&self.commands, |reply| Command::Segment {
                version,
                segment,
                reply,
            })
        })?;
        block_on_reply(&self.commands, |reply| Command::Seal {
            version,
            manifest: manifest.clone(),
            reply,
        })?;
        Ok(manifest)
    }
}

fn block_on_reply<T>(
    commands: &mpsc::Sender<Command>,
    command: impl FnOnce(oneshot::Sender<Result<T, TransportError>>) -> Command,
) -> Result<T, TransportError> {
    let (reply, answer) = oneshot::channel();
    commands
        .blocking_send(command(reply))
        .map_err(|_| TransportError::Stopped)?;
    answer
        .blocking_recv()
        .map_err(|_| TransportError::Stopped)?
}

/// Starts a hub: serves published versions, and stored ones from `store` on request.
pub async fn spawn_hub(
    config: NodeConfig,
    store: Option<Arc<Store>>,
) -> Result<NodeHandle, TransportError> {
    let mut sender = Sender::new(config.sender(store.is_some()));
    if let Some(store) = &store {
        sender.set_loadable(store.latest_version()?);
        sender.set_snapshot_loadable(store.newest_snapshot()?);
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

/// Starts a relay with its weights: it receives from its upstreams, activates every
/// version itself, and forwards each verified segment to its subscribers as it arrives.
pub async fn spawn_relay(
    config: NodeConfig,
    weights: Weights,
) -> Result<NodeHandle, TransportError> {
    start_relay(config, Some(weights)).await
}

/// Starts a relay with no weights (a new region's): it takes the newest snapshot an
/// upstream offers over the wire, activates it, then serves the versions after it as
/// [`spawn_relay`] does.
pub async fn spawn_joining_relay(config: NodeConfig) -> Result<NodeHandle, TransportError> {
    start_relay(config, None).await
}

async fn start_relay(
    config: NodeConfig,
    weights: Option<Weights>,
) -> Result<NodeHandle, TransportError> {
    if config.upstreams.is_empty() {
        return Err(TransportError::NoUpstream("a relay"));
    }
    let active = weights.as_ref().map(Weights::active);
    let receiver = config.receiver(active);
    let sender = Sender::new(config.sender(false));
    let node = match active {
        Some(active) => Node::relay(receiver, sender, active),
        None => Node::joining_relay(receiver, sender),
    };
    let engine = Arc::new(IdleEngine::default());
    spawn(
        config,
        node,
        Some(weights.unwrap_or_else(Weights::empty)),
        Some(engine),
        None,
    )
    .await
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

async fn start_actor<E: Engine>(
    config: NodeConfig,
    weights: Option<Weights>,
    engine: Arc<E>,
) -> Result<NodeHandle, TransportError> {
    if config.upstreams.is_empty() {
        return Err(TransportError::NoUpstream("an actor"));
    }
    let active = weights.as_ref().map(Weights::active);
    let receiver = config.receiver(active);
    let node = match active {
        Some(active) => Node::actor(receiver, active),
        None => Node::joining_actor(receiver),
    };
    let weights = weights.unwrap_or_else(Weights::empty);
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

async fn spawn<E: Engine>(
    config: NodeConfig,
    node: Node,
    weights: Option<Weights>,
    engine: Option<Arc<E>>,
    store: Option<Arc<Store>>,
) -> Result<NodeHandle, TransportError> {
    let mut tasks = JoinSet::new();
    let (events_tx, events) = mpsc::channel(EVENT_QUEUE);
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
        tasks.spawn(accept_loop(
            listener,
            config.socket.clone(),
            events_tx.clone(),
        ));
    }
    let (commands_tx, commands) = mpsc::channel(64);
    let initial = NodeStatus {
        active: node.actor_status().and_then(|s| s.active),
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
    let mut driver = Driver {
        upstream_bytes: upstream_bytes.clone(),
        config,
        node,
        weights: weights.map(Arc::new),
        decoder,
        engine,
        store,
        live: BTreeMap::new(),
        conns: HashMap::new(),
        next_conn: 1,
        upstream: 0,
        failures: 0,
        back_to_first: false,
        new_session_at: None,
        tasks,
        events_tx,
        status_tx,
        status: NodeStatus::default(),
    };
    driver.status = driver.status_tx.borrow().clone();
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

async fn accept_loop(listener: TcpListener, options: SocketOptions, events: mpsc::Sender<Event>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                if let Err(error) = options.apply(&stream) {
                    tracing::warn!(%peer, %error, "socket options refused; closing");
                    continue;
                }
                if events.send(Event::Accepted { stream }).await.is_err() {
                    return;
                }
            }
            Err(error) => {
                // Out of descriptors and the like: back off instead of spinning.
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

struct ConnEntry {
    writer: mpsc::Sender<WriteCmd>,
    inbound: bool,
    reader: AbortHandle,
}

/// An artifact being published live, kept (as shared buffers) to store it when sealed.
struct Live {
    descriptor: Bytes,
    segments: BTreeMap<u32, Bytes>,
}

struct Driver<E: Engine> {
    config: NodeConfig,
    node: Node,
    /// Shared with the decodes out; the node starts an activation only when none is.
    weights: Option<Arc<Weights>>,
    /// The pool this node decodes on and its member key there.
    decoder: Option<(Arc<DecodePool>, u64)>,
    engine: Option<Arc<E>>,
    store: Option<Arc<Store>>,
    live: BTreeMap<u64, Live>,
    conns: HashMap<ConnId, ConnEntry>,
    next_conn: ConnId,
    /// Index into the upstreams of the current (or next) session.
    upstream: usize,
    /// Upstream sessions lost in a row, for the backoff.
    failures: u32,
    /// The session is being left on purpose for the first upstream (a joiner, once its
    /// snapshot is in).
    back_to_first: bool,
    new_session_at: Option<Instant>,
    tasks: JoinSet<()>,
    events_tx: mpsc::Sender<Event>,
    status_tx: watch::Sender<NodeStatus>,
    status: NodeStatus,
    /// Bytes read from upstream connections (see [`NodeHandle::upstream_bytes`]).
    upstream_bytes: Arc<AtomicU64>,
}

impl<E: Engine> Driver<E> {
    async fn run(
        mut self,
        mut events: mpsc::Receiver<Event>,
        mut commands: mpsc::Receiver<Command>,
    ) {
        loop {
            let wake = [self.node.poll_timeout(), self.new_session_at]
                .into_iter()
                .flatten()
                .min();
            let sleep = async {
                match wake {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                event = events.recv() => {
                    let Some(event) = event else { return };
                    self.on_event(event);
                    // Take what else is ready before publishing the status.
                    while let Ok(event) = events.try_recv() {
                        self.on_event(event);
                        self.drain();
                    }
                }
                command = commands.recv() => {
                    let Some(command) = command else {
                        // Every handle is gone: keep serving until killed.
                        commands = mpsc::channel(1).1;
                        continue;
                    };
                    self.on_command(command);
                }
                () = sleep => {
                    let now = Instant::now();
                    if self.new_session_at.is_some_and(|at| now >= at) {
                        self.new_session_at = None;
                        self.start_session(now);
                    }
                    self.node.handle_timeout(now);
                }
            }
            self.drain();
            self.publish_status();
            while self.tasks.try_join_next().is_some() {}
        }
    }

    fn start_session(&mut self, now: Instant) {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(self.next_conn);
        let session = hasher.finish();
        let upstream = self.current_upstream();
        tracing::info!(%upstream, session, "starting an upstream session");
        self.status.upstream = Some(upstream);
        if let Some(receiver) = self.node.receiver_mut() {
            receiver.start_session(now, session);
        }
    }

    fn current_upstream(&self) -> SocketAddr {
        self.config.upstreams[self.upstream % self.config.upstreams.len()]
    }

    fn on_event(&mut self, event: Event) {
        let now = Instant::now();
        match event {
            Event::Accepted { stream } => {
                let conn = self.add_conn(stream, true);
                if let Some(sender) = self.node.sender_mut() {
                    sender.accepted(now, conn);
                }
            }
            Event::Frame { conn, frame } => {
                let Some(entry) = self.conns.get(&conn) else {
                    return;
                };
                if entry.inbound {
                    if let Some(sender) = self.node.sender_mut() {
                        sender.handle_frame(now, conn, frame);
                    }
                } else if let Some(receiver) = self.node.receiver_mut() {
                    receiver.handle_frame(now, conn, frame);
                }
            }
            Event::Closed { conn, reason } => {
                let Some(entry) = self.conns.remove(&conn) else {
                    return;
                };
                tracing::debug!(conn, reason, inbound = entry.inbound, "connection closed");
                if entry.inbound {
                    if let Some(sender) = self.node.sender_mut() {
                        sender.closed(conn);
                    }
                } else if let Some(receiver) = self.node.receiver_mut() {
                    receiver.closed(conn);
                }
            }
            Event::Sent { conn } => self.node.sent(now, conn),
            Event::Dialed {
                session,
                stream,
                result,
            } => match result {
                Ok(socket) => {
                    let conn = self.add_conn(socket, false);
                    if let Some(receiver) = self.node.receiver_mut() {
                        receiver.connected(now, session, stream, conn);
                    }
                }
                Err(reason) => {
                    tracing::debug!(reason, "dial failed");
                    if let Some(receiver) = self.node.receiver_mut() {
                        receiver.dial_failed(session, stream, &reason);
                    }
                }
            },
            Event::Decoded {
                version,
                index,
                hash,
                result,
            } => {
                let outcome = result.map_err(|e| e.to_string());
                self.node.decoded(version, index, hash, outcome);
            }
            Event::SafePoint => self.node.safe_point(),
            Event::Activated {
                version,
                weights,
                changed,
                result,
            } => {
                let result = result.map_err(|e| e.to_string());
                let weights = Arc::new(weights);
                // The engine resumes on the new weights, or on the old ones if the patch
                // did not reproduce the target (they were restored). A joining node's
                // engine, whose snapshot failed, was never paused and has nothing to run.
                if let Some(engine) = &self.engine
                    && !weights.is_empty()
                {
                    engine.activate(weights.clone(), changed);
                }
                if result.is_err() {
                    self.status.failed_activations += 1;
                }
                tracing::info!(version, ok = result.is_ok(), "activation");
                self.weights = Some(weights);
                self.node.activated(version, result);
            }
            // Reading the catalog is cheap next to the put that just finished.
            Event::Stored { version } => self.read_store(Some(version)),
            Event::Loaded { key, result } => {
                let Some(sender) = self.node.sender_mut() else {
                    return;
                };
                if let Err(error) = sender.loaded(key, result) {
                    match key {
                        // Declining a composed delta for replaying is the plan working.
                        ArtifactKey::Composed { .. } => {
                            tracing::debug!(%error, "no composed delta")
                        }
                        _ => tracing::warn!(%error, "cannot serve a stored artifact"),
                    }
                }
            }
        }
    }

    /// Tells the sender what the store holds now: the newest version (at least `stored`,
    /// just put) and the newest snapshot.
    fn read_store(&mut self, stored: Option<u64>) {
        let (Some(sender), Some(store)) = (self.node.sender_mut(), &self.store) else {
            return;
        };
        match store
            .latest_version()
            .and_then(|latest| Ok((latest, store.newest_snapshot()?)))
        {
            Ok((latest, newest_snapshot)) => {
                sender.set_loadable(latest.max(stored));
                sender.set_snapshot_loadable(newest_snapshot);
            }
            Err(error) => tracing::warn!(%error, "cannot read the store's catalog"),
        }
    }

    fn add_conn(&mut self, stream: TcpStream, inbound: bool) -> ConnId {
        let conn = self.next_conn;
        self.next_conn += 1;
        let (writer, reader) = spawn_conn(
            &mut self.tasks,
            conn,
            stream,
            self.config.window_frames,
            self.events_tx.clone(),
            (!inbound).then(|| self.upstream_bytes.clone()),
        );
        self.conns.insert(
            conn,
            ConnEntry {
                writer,
                inbound,
                reader,
            },
        );
        conn
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Begin { descriptor, reply } => {
                let result = self
                    .hub_sender()
                    .and_then(|s| s.begin_artifact(descriptor.clone()).map_err(Into::into));
                if let Ok(version) = result {
                    self.live.insert(
                        version,
                        Live {
                            descriptor,
                            segments: BTreeMap::new(),
                        },
                    );
                }
                let _ = reply.send(result);
            }
            Command::Segment {
                version,
                segment,
                reply,
            } => {
                let bytes = Bytes::from(segment.bytes);
                let result = self.hub_sender().and_then(|s| {
                    s.add_segment(version, segment.index, segment.hash, bytes.clone())
                        .map_err(Into::into)
                });
                if result.is_ok()
                    && let Some(live) = self.live.get_mut(&version)
                {
                    live.segments.insert(segment.index, bytes);
                }
                let _ = reply.send(result);
            }
            Command::Seal {
                version,
                manifest,
                reply,
            } => {
                let sealed = self.hub_sender().and_then(|s| {
                    s.seal_artifact(version, manifest.id(), manifest.segments.clone())
                        .map_err(Into::into)
                });
                let live = self.live.remove(&version);
                match (sealed, live) {
                    (Ok(()), Some(live)) => {
                        let mut artifact = live.descriptor.to_vec();
                        for bytes in live.segments.values() {
                            artifact.extend_from_slice(bytes);
                        }
                        artifact.extend_from_slice(&manifest.encode_tail());
                        self.store_then(version, Bytes::from(artifact), |r| {
                            let _ = reply.send(r.map(|_| ()));
                        });
                    }
                    (Ok(()), None) => {
                        let _ = reply.send(Ok(()));
                    }
                    (Err(error), _) => {
                        let _ = reply.send(Err(error));
                    }
                }
            }
            Command::Publish { artifact, reply } => {
                let inserted = self
                    .hub_sender()
                    .and_then(|s| s.insert_artifact(artifact.clone()).map_err(Into::into));
                match inserted {
                    Ok(version) => self.store_then(version, artifact, |r| {
                        let _ = reply.send(r);
                    }),
                    Err(error) => {
                        let _ = reply.send(Err(error));
                    }
                }
            }
            Command::Commit(commit) => {
                if let Some(sender) = self.node.sender_mut() {
                    sender.commit(commit);
                }
            }
            Command::StoreChanged { reply } => {
                self.read_store(None);
                let _ = reply.send(Ok(()));
            }
        }
    }

    fn hub_sender(&mut self) -> Result<&mut Sender, TransportError> {
        self.node.sender_mut().ok_or(TransportError::Stopped)
    }

    /// Stores a sealed artifact (on a hub with a store) on a blocking thread, then
    /// answers. The version is servable from memory meanwhile.
    fn store_then(
        &mut self,
        version: u64,
        artifact: Bytes,
        answer: impl FnOnce(Result<u64, TransportError>) + Send + 'static,
    ) {
        let Some(store) = self.store.clone() else {
            return answer(Ok(version));
        };
        let events = self.events_tx.clone();
        self.tasks.spawn_blocking(move || {
            let stored = store.put_delta(&artifact).map(|r| r.version);
            if stored.is_ok() {
                let _ = events.blocking_send(Event::Stored { version });
            }
            answer(stored.map_err(Into::into));
        });
    }

    /// Reads (or builds) the artifact `key` names from the store on a blocking thread
    /// and reports it as [`Event::Loaded`].
    fn load(&mut self, key: ArtifactKey) {
        let Some(store) = self.store.clone() else {
            if let Some(sender) = self.node.sender_mut() {
                let _ = sender.loaded(key, Err("no store".into()));
            }
            return;
        };
        let segment_bytes = self.config.snapshot_segment_bytes;
        let events = self.events_tx.clone();
        self.tasks.spawn_blocking(move || {
            let result = read_stored(key, &store, segment_bytes);
            let _ = events.blocking_send(Event::Loaded { key, result });
        });
    }

    /// Carries out everything the node wants done.
    fn drain(&mut self) {
        let now = Instant::now();
        while let Some(output) = self.node.poll(now) {
            self.output(output);
        }
    }

    fn output(&mut self, output: Output) {
        match output {
            Output::Transmit {
                conn,
                frame,
                close_after,
            } => {
                let Some(entry) = self.conns.get(&conn) else {
                    return;
                };
                if entry
                    .writer
                    .try_send(WriteCmd::Frame { frame, close_after })
                    .is_err()
                {
                    // Only an outbound connection can get here (inbound ones have a
                    // window): its peer is not reading our control frames.
                    tracing::warn!(conn, "write queue full; closing the connection");
                    self.close(conn);
                }
            }
            Output::Close { conn } => self.close(conn),
            Output::Dial { session, stream } => {
                let address = self.current_upstream();
                let timeout = self.config.connect_timeout;
                let options = self.config.socket.clone();
                let events = self.events_tx.clone();
                self.tasks.spawn(async move {
                    let result = dial(address, timeout, &options).await;
                    let _ = events
                        .send(Event::Dialed {
                            session,
                            stream,
                            result,
                        })
                        .await;
                });
            }
            Output::UpstreamLost { reason } => {
                let from = self.current_upstream();
                self.status.upstream_switches += 1;
                self.status.connected = false;
                if std::mem::take(&mut self.back_to_first) {
                    self.upstream = 0;
                    tracing::info!(%from, next = %self.current_upstream(), %reason, "switching upstream");
                    self.new_session_at = Some(Instant::now());
                    return;
                }
                self.upstream += 1;
                self.failures += 1;
                tracing::warn!(%from, next = %self.current_upstream(), %reason, "upstream lost; falling back");
                let backoff = (Duration::from_millis(50) * self.failures).min(BACKOFF_MAX);
                self.new_session_at = Some(Instant::now() + backoff);
            }
            Output::Load(key) => self.load(key),
            Output::Decode {
                version,
                index,
                hash,
                kind,
                header,
                bytes,
            } => {
                let weights = self.weights.clone().expect("decoding needs the weights");
                let (pool, member) = self
                    .decoder
                    .clone()
                    .expect("a node with weights has a decode pool");
                let events = self.events_tx.clone();
                pool.submit(member, move || {
                    let result = weights.decode_segment(kind, &header, index, &bytes);
                    // Let go of the weights before reporting: once the last decode is
                    // in, the loop takes them for activation, and a share still held
                    // here would fail it as "not ready".
                    drop(weights);
                    let _ = events.blocking_send(Event::Decoded {
                        version,
                        index,
                        hash,
                        result,
                    });
                });
            }
            Output::AwaitSafePoint => {
                let engine = self.engine.clone().expect("actors have an engine");
                let events = self.events_tx.clone();
                self.tasks.spawn(async move {
                    engine.safe_point().await;
                    let _ = events.send(Event::SafePoint).await;
                });
            }
            Output::Activate { version } => {
                let shared = self.weights.take().expect("activation needs the weights");
                let (mut weights, patch) =
                    match (Arc::try_unwrap(shared), self.node.take_patch(version)) {
                        (Ok(weights), Some(patch)) => (weights, patch),
                        (shared, _) => {
                            // The node activates only a staged patch with no decode out.
                            self.weights = Some(shared.map_or_else(|arc| arc, Arc::new));
                            self.node
                                .activated(version, Err("the staged patch is not ready".into()));
                            return;
                        }
                    };
                let events = self.events_tx.clone();
                // Not on the decode pool: the engine is paused at its safe point until
                // this is done, so it runs at the process's own priority.
                self.tasks.spawn_blocking(move || {
                    let changed = patch.changed_tensors();
                    let result = weights.activate(patch);
                    let changed = if result.is_ok() { changed } else { Vec::new() };
                    let _ = events.blocking_send(Event::Activated {
                        version,
                        weights,
                        changed,
                        result,
                    });
                });
            }
            Output::Notice(notice) => self.notice(notice),
        }
    }

    fn notice(&mut self, notice: Notice) {
        match notice {
            Notice::Connected(welcome) => {
                self.failures = 0;
                self.status.connected = true;
                tracing::info!(upstream = welcome.peer_id, latest = ?welcome.latest, "subscribed upstream");
            }
            Notice::Complete { version } => {
                tracing::debug!(version, "version received and verified");
                self.status.completed.push(version);
            }
            Notice::Joined { version } => {
                tracing::info!(version, "received the snapshot to join from");
                // Only a hub serves snapshots: the deltas after it come cheaper from the
                // first upstream, the region's relay, as for every other actor.
                if self.current_upstream() != self.config.upstreams[0]
                    && let Some(receiver) = self.node.receiver_mut()
                {
                    self.back_to_first = true;
                    receiver.abandon("joined; the deltas come from the first upstream");
                }
            }
            Notice::Committed(commit) => tracing::debug!(version = commit.version, "commit"),
            Notice::Subscribed {
                peer_id,
                role,
                region,
            } => tracing::info!(peer_id, %role, region, "subscriber joined"),
            Notice::Dropped { peer_id, reason } => {
                tracing::warn!(peer_id, reason, "subscriber dropped")
            }
            Notice::Status {
                peer_id,
                active,
                staged: _,
                note,
            } => {
                tracing::debug!(peer_id, version = active.version, note, "subscriber status");
                if self.status.reports.len() == MAX_REPORTS {
                    self.status.reports.remove(0);
                }
                self.status.reports.push((peer_id, active, note));
            }
            Notice::RelayError(error) => tracing::warn!(error, "relay cannot republish"),
        }
    }

    fn close(&mut self, conn: ConnId) {
        if let Some(entry) = self.conns.remove(&conn) {
            entry.reader.abort();
        }
        // Dropping the writer's queue makes its task shut the socket down.
    }

    fn publish_status(&mut self) {
        let status = &mut self.status;
        if let Some(actor) = self.node.actor_status() {
            status.active = actor.active;
            status.staged = actor.staged;
            status.committed = actor.committed;
        }
        status.diverged = self.node.actor_diverged();
        status.receiver = self.node.receiver().map(|r| r.stats().clone());
        status.streams = self.node.receiver().map_or(0, Receiver::welcomed_streams);
        status.target_streams = self.node.receiver().map_or(0, Receiver::stream_count);
        status.sender = self.node.sender().map(|s| s.stats().clone());
        status.subscribers = self.node.sender().map_or(0, Sender::sessions);
        let snapshot = status.clone();
        self.status_tx.send_replace(snapshot);
    }
}
