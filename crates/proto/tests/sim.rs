//! Deterministic simulation of the pure state machines (docs/wire-protocol.md §9).
//!
//! One hub, two relays and six actors exchange frames over simulated connections under
//! virtual time, jumping from one event to the next. A seed picks the faults: latency
//! per frame (so frames of different streams overtake each other), connections cut
//! with frames in flight, segment bytes flipped in transit, a relay that crashes for
//! good, actors that crash and restart from the weights they had. The hub publishes
//! ten versions of a small synthetic model as live extractions (segments one by one,
//! the table last) and commits each; its store holds a snapshot every third version.
//! A seventh actor joins mid-run with no weights. Its region's relay keeps the snapshot
//! it started from (wire-protocol §8) and offers it while it holds every delta after it:
//! the joiner takes it from there, or, once the relay no longer offers one (it moved past
//! its window, it crashed, or it suspended while cut off), falls back to the hub. Either
//! way it takes the snapshot over the wire (resuming it across cuts and crashes of its
//! upstream like any delta), then follows the deltas. In a quarter of the seeds the store
//! holds no snapshot until the third version, so relay0 starts keeping none; once it has
//! welcomed the joiner without one, its fetcher (a relay node of its own, as the tokio
//! driver runs one) takes the hub's newest snapshot and the deltas after it up to
//! relay0's newest, and relay0 serves them from then on. The other region's relay keeps
//! none.
//! A restarted actor often asks the hub first: its store plans the catch-up by bytes and
//! serves one composed delta from the actor's version to the latest when that is
//! cheaper than replaying the deltas.
//!
//! The deployment signs: the hub's artifacts, their Offers and its commits carry the
//! trainer's signature, and every relay and actor pins the trainer key. A second test
//! adds a malicious relay in one region that serves forged deltas (other weights, every
//! hash, the table, the id and the target hash made to match) under the trainer's
//! signatures of the real ones, or none: every actor must refuse them and end on the
//! published weights. The joiner dials it first, and it offers forged snapshots whose
//! descriptors claim a 2 TiB tensor, unsigned or signed by another key: the joiner must
//! refuse each at its Offer, never hand a segment of one to a decoder (where an image
//! would be sized from it), and join from the hub.
//!
//! Checkers: no activation ever produces weights other than the published ones; in the
//! end every live actor is at the last version with byte-identical weights, and every
//! live relay (relays hold no weights) holds the last version.
//! A failure prints its seed; `AURORA_SIM_SEED=n` replays one.

use std::collections::{BTreeMap, BinaryHeap};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use aurora_delta::{
    ArtifactKind, Checkpoint, DeltaFile, DeltaHeader, Dtype, Encoding, ExtractOptions, Extraction,
    Hash, RunId, SigningKey, SpilledChunks, TargetHash, TensorChange, TensorEntry, TensorSpec,
};
use aurora_proto::{
    ArtifactKey, Auth, Commit, ConnId, EffectError, Frame, HeapSnapshots, Identity, Node, Notice,
    Output, Receiver, ReceiverConfig, RelayOptions, Role, Sender, SenderConfig, SessionEnd,
    SnapshotSpace, StoredArtifact, Transmit, Upstreams, VersionRef, Violation, Weights,
};
use bytes::Bytes;

#[path = "sim/chain.rs"]
mod chain;
#[path = "sim/events.rs"]
mod events;

use chain::*;

const VERSIONS: u64 = 10;
const SEEDS: u64 = 40;
/// The hub's store holds a snapshot of every version divisible by this.
const SNAPSHOT_EVERY: u64 = 3;
const TOKEN: &[u8] = b"sim-secret";

/// The seed of a peer's backoff jitter: its name's, so a run replays from its seed.
fn jitter_seed(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// splitmix64: a seeded, dependency-free generator, stable forever.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn millis(&mut self, low: u64, high: u64) -> Duration {
        Duration::from_millis(low + self.below(high - low + 1))
    }
}

#[derive(Debug)]
enum Event {
    /// A frame arrives at the far end of `conn`, written by `from`.
    Deliver {
        conn: ConnId,
        from: usize,
        frame: Frame,
        close_after: bool,
    },
    /// `node` learns that `conn` is gone.
    Closed {
        node: usize,
        conn: ConnId,
    },
    /// The server accepts `conn`, then the client learns it is connected.
    Accept {
        conn: ConnId,
    },
    Connected {
        conn: ConnId,
    },
    DialFailed {
        node: usize,
        session: u64,
        stream: u8,
    },
    Timer {
        node: usize,
    },
    NewSession {
        node: usize,
    },
    Decoded {
        node: usize,
        version: u64,
        index: u32,
        hash: Hash,
        outcome: Result<SpilledChunks, EffectError>,
    },
    /// `node`'s driver checked its staged delta ([`Output::Verify`]).
    Verified {
        node: usize,
        version: u64,
        outcome: Result<(), EffectError>,
    },
    SafePoint {
        node: usize,
    },
    /// `node`'s driver answers its sender's [`Output::Load`].
    Loaded {
        node: usize,
        key: ArtifactKey,
    },
    /// A peer with no weights starts.
    Join {
        node: usize,
    },
    Publish {
        version: u64,
        step: usize,
    },
    CutConnection,
    /// Every connection of `node` is cut: its session is lost.
    CutPeer {
        node: usize,
    },
    CrashRelay {
        node: usize,
    },
    /// The relay `node` cannot reach the hub (nor the hub it) for `duration`; its
    /// actors still reach both.
    IsolateRelay {
        node: usize,
        duration: Duration,
    },
    CrashActor {
        node: usize,
    },
    RestartActor {
        node: usize,
    },
}

struct Scheduled {
    at: Instant,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

struct Conn {
    client: usize,
    server: usize,
    session: u64,
    stream: u8,
    open: bool,
    /// Delivery time of the last frame each way, so each direction stays FIFO.
    last_to_server: Instant,
    last_to_client: Instant,
}

struct Peer {
    node: Option<Node>,
    name: String,
    /// Its upstreams in order of preference, and the tokio driver's policy over them.
    upstreams: Vec<usize>,
    route: Upstreams<usize>,
    weights: Option<Weights>,
    timer: Option<Instant>,
}

struct Sim {
    seed: u64,
    rng: Rng,
    now: Instant,
    start: Instant,
    seq: u64,
    queue: BinaryHeap<Scheduled>,
    conns: BTreeMap<ConnId, Conn>,
    next_conn: ConnId,
    next_session: u64,
    peers: Vec<Peer>,
    corrupt_percent: u64,
    /// The actor whose first activation of a delta at or past the version loses its
    /// weights (a panic midway through writing them), in half of the seeds.
    lose_weights_at: Option<(usize, u64)>,
    faults: Faults,
    /// Composed deltas the hub's "store" built, by (base, target).
    composed: BTreeMap<(u64, u64), Bytes>,
    /// Sessions each peer ended on a missing or bad signature, by peer.
    refused: BTreeMap<usize, u64>,
    /// Relays cut off from the hub, until when.
    isolated: BTreeMap<usize, Instant>,
    /// Each running snapshot fetcher (a peer of its own, after the rogue's slot) and the
    /// relay it fetches for.
    fetchers: BTreeMap<usize, usize>,
    /// The oldest version the hub's store holds a snapshot of.
    first_snapshot: u64,
}

/// What a run went through, so the seeds can be checked to cover every fault.
#[derive(Debug, Default, Clone, Copy)]
struct Faults {
    corruptions: u64,
    cuts: u64,
    relay_crashes: u64,
    actor_restarts: u64,
    upstream_switches: u64,
    /// Segments that reached a receiver holding them already.
    duplicates: u64,
    /// Snapshots activated by peers that joined with no weights.
    joins: u64,
    /// Sessions of a joining peer lost before its snapshot was active (a relay that
    /// offers none, a cut, a crashed upstream).
    join_sessions_lost: u64,
    /// Of those, sessions lost with segments in hand: the next one resumes the snapshot.
    join_resumes: u64,
    /// Joins whose snapshot a relay served.
    joins_from_relay: u64,
    /// Activations of a composed delta: an actor skipped versions in one step.
    composed_activations: u64,
    /// Activations that lost the actor's weights: it rejoined from a snapshot.
    lost_weights: u64,
    /// Sessions that ended on a missing or bad signature.
    signatures_refused: u64,
    /// Sessions on a fallback left to go back to the first upstream.
    returns: u64,
    /// Relays cut off from the hub for a while.
    relay_isolations: u64,
    /// Times a relay without an upstream sent its subscribers away.
    relay_suspensions: u64,
    /// Newer snapshots a relay's fetcher took and the relay then served, of those it
    /// asked for; and of the adopted, those taken with the deltas the relay lacked.
    snapshot_fetches: u64,
    snapshots_adopted: u64,
    adopted_with_deltas: u64,
}

const HUB: usize = 0;
const RELAYS: [usize; 2] = [1, 2];
/// The peer that joins mid-run with no weights.
const JOINER: usize = 9;
/// The first of the six actors that start with weights (after the hub and the relays).
const FIRST_ACTOR: usize = 3;
/// The malicious relay, where there is one; actors of `RELAYS[0]`'s region dial it
/// first.
const ROGUE: usize = 10;
/// How long a session on a fallback lasts before it goes back to the first upstream:
/// shorter than the run, so returns happen, to relays up and down.
const RETURN_AFTER: Duration = Duration::from_millis(1000);
/// How long a relay without an upstream keeps its subscribers: shorter than its
/// isolations, which happen.
const RELAY_SUSPEND_AFTER: Duration = Duration::from_millis(400);

/// A sender of the simulation; without `hedging`, overdue versions are never sent again
/// (wire-protocol §5.13), so any segment a receiver gets twice was resent by resume.
fn sender_config(role: Role, name: &str, store_backed: bool, hedging: bool) -> SenderConfig {
    let mut config = SenderConfig::new(identity(role, name), Auth::Shared(TOKEN.to_vec()));
    config.store_backed = store_backed;
    if !hedging {
        config.hedge_max_bytes = 0;
    }
    config.keepalive_interval = Duration::from_millis(200);
    config.stall_timeout = Duration::from_secs(3);
    config.handshake_timeout = Duration::from_secs(1);
    config.trainer_key = Some(trainer_key().verifying_key());
    // The hub serves its store's run; a relay learns it from the hub's Welcome.
    if role == Role::Hub {
        config.run = Some(RUN);
    }
    config
}

fn identity(role: Role, name: &str) -> Identity {
    Identity {
        role,
        peer_id: name.into(),
        region: "r".into(),
    }
}

fn receiver_config(role: Role, name: &str, streams: u8) -> ReceiverConfig {
    let mut config = ReceiverConfig::new(identity(role, name), TOKEN.to_vec());
    config.streams = streams;
    config.idle_timeout = Duration::from_secs(1);
    config.trainer_key = Some(trainer_key().verifying_key());
    // An actor pins the run the control plane names; a relay learns it from the hub.
    if role == Role::Actor {
        config.run = Some(RUN);
    }
    config
}

fn receiver(role: Role, name: &str, streams: u8, active: VersionRef) -> Receiver {
    Receiver::new(
        receiver_config(role, name, streams),
        active.version + 1,
        active,
    )
}

/// A peer with no weights, as it starts (or restarts before its snapshot is active).
fn joiner(name: &str, streams: u8) -> Node {
    verifying(Node::joining_actor(Receiver::joining(receiver_config(
        Role::Actor,
        name,
        streams,
    ))))
}

/// An actor that checks each staged delta behind generation, as the transport's are.
fn verifying(mut node: Node) -> Node {
    node.verify_at_staging();
    node
}

fn version_ref(version: u64) -> VersionRef {
    VersionRef {
        version,
        hash: chain().hashes[version as usize],
    }
}

impl Sim {
    /// A run under the faults `seed` picks; with `rogue`, a malicious relay in the
    /// region of `RELAYS[0]` that its actors dial first.
    fn new(seed: u64, rogue: bool, hedging: bool) -> Sim {
        let mut rng = Rng(seed);
        let start = Instant::now();
        let mut peers = Vec::new();
        let mut hub = Sender::new(sender_config(Role::Hub, "hub", true, hedging));
        hub.set_loadable(None);
        // In a quarter of the seeds the store holds no snapshot before the first
        // `SNAPSHOT_EVERY`: relay0 starts keeping none, and takes one once a joiner asks.
        let first_snapshot = if seed % 4 == 1 { SNAPSHOT_EVERY } else { 0 };
        hub.set_snapshots([0].into_iter().filter(|v| *v >= first_snapshot));
        peers.push(Peer::new(Node::hub(hub), "hub", vec![], None));
        for (i, _) in RELAYS.iter().enumerate() {
            let name = format!("relay{i}");
            let options = RelayOptions {
                keep_snapshots: (i == 0).then(|| Arc::new(HeapSnapshots) as Arc<dyn SnapshotSpace>),
                suspend_after: Some(RELAY_SUSPEND_AFTER),
            };
            let node = Node::relay(
                Receiver::relaying(receiver_config(Role::Relay, &name, 2)),
                Sender::new(sender_config(Role::Relay, &name, false, hedging)),
                options,
            );
            peers.push(Peer::new(node, &name, vec![HUB], None));
        }
        for i in 0..6 {
            let name = format!("actor{i}");
            let relay = RELAYS[i % 2];
            let streams = 1 + rng.below(4) as u8;
            let mut node = Node::actor(
                receiver(Role::Actor, &name, streams, version_ref(0)),
                version_ref(0),
            );
            // Half the actors check staged deltas before reporting them, the other
            // half at activation: both orders are exercised.
            if i % 2 == 0 {
                node = verifying(node);
            }
            let mut upstreams = vec![relay, HUB, RELAYS[(i + 1) % 2]];
            if rogue && relay == RELAYS[0] {
                upstreams.insert(0, ROGUE);
            }
            peers.push(Peer::new(node, &name, upstreams, Some(0)));
        }
        // Joins later (node None until then), its region's relay first, or the rogue.
        let mut upstreams = vec![RELAYS[0], HUB, RELAYS[1]];
        if rogue {
            upstreams.insert(0, ROGUE);
        }
        peers.push(Peer {
            node: None,
            name: "joiner".into(),
            route: Upstreams::new(upstreams.clone(), Some(RETURN_AFTER), jitter_seed("joiner")),
            upstreams,
            weights: None,
            timer: None,
        });
        if rogue {
            // It checks nothing it is given: it serves what it forged, snapshots included
            // (it poses as a hub with a store).
            let mut config = sender_config(Role::Relay, "rogue", true, hedging);
            config.trainer_key = None;
            // It names the fleet's run, as anyone who saw a Welcome can.
            config.run = Some(RUN);
            let mut rogue = Sender::new(config);
            rogue.set_snapshots([0]);
            peers.push(Peer::new(Node::hub(rogue), "rogue", vec![], None));
        } else {
            // Its slot stays empty: fetchers come after it.
            peers.push(Peer {
                node: None,
                name: "no rogue".into(),
                route: Upstreams::new(Vec::new(), None, 0),
                upstreams: Vec::new(),
                weights: None,
                timer: None,
            });
        }
        let mut sim = Sim {
            seed,
            corrupt_percent: rng.below(4),
            lose_weights_at: seed
                .is_multiple_of(2)
                .then(|| (FIRST_ACTOR + (seed / 2 % 6) as usize, 2 + seed / 12 % 4)),
            rng,
            now: start,
            start,
            seq: 0,
            queue: BinaryHeap::new(),
            conns: BTreeMap::new(),
            next_conn: 1,
            next_session: 1,
            peers,
            faults: Faults::default(),
            composed: BTreeMap::new(),
            refused: BTreeMap::new(),
            isolated: BTreeMap::new(),
            fetchers: BTreeMap::new(),
            first_snapshot,
        };
        for node in 1..=JOINER {
            sim.at(Duration::ZERO, Event::NewSession { node });
        }
        let mut at = Duration::from_millis(100);
        for version in 1..=VERSIONS {
            sim.at(at, Event::Publish { version, step: 0 });
            at += sim.rng.millis(200, 1500);
        }
        for _ in 0..sim.rng.below(6) {
            let when = sim.rng.millis(50, 8000);
            sim.at(when, Event::CutConnection);
        }
        if sim.rng.chance(60) {
            let relay = RELAYS[sim.rng.below(2) as usize];
            let when = sim.rng.millis(300, 6000);
            sim.at(when, Event::CrashRelay { node: relay });
        }
        if sim.rng.chance(50) {
            let relay = RELAYS[sim.rng.below(2) as usize];
            let when = sim.rng.millis(300, 6000);
            let duration = sim.rng.millis(500, 3000);
            sim.at(
                when,
                Event::IsolateRelay {
                    node: relay,
                    duration,
                },
            );
        }
        if sim.rng.chance(60) {
            let actor = 3 + sim.rng.below(6) as usize;
            let when = sim.rng.millis(300, 6000);
            sim.at(when, Event::CrashActor { node: actor });
        }
        let join = sim.rng.millis(200, 7000);
        sim.at(join, Event::Join { node: JOINER });
        if sim.rng.chance(70) {
            // Often while its snapshot is on the wire: the next session resumes it.
            let when = join + sim.rng.millis(80, 500);
            sim.at(when, Event::CutPeer { node: JOINER });
        }
        if sim.rng.chance(40) {
            // Often while its snapshot is on the wire.
            let when = join + sim.rng.millis(50, 1500);
            sim.at(when, Event::CrashActor { node: JOINER });
        }
        sim
    }

    fn at(&mut self, after: Duration, event: Event) {
        self.seq += 1;
        self.queue.push(Scheduled {
            at: self.now + after,
            seq: self.seq,
            event,
        });
    }

    /// Whether `client` and `server` cannot reach each other now: a relay and the hub
    /// while the relay is isolated.
    /// Whether `client` (a relay, or its fetcher, which runs on its machine) is cut off
    /// from `server`.
    fn isolated(&self, client: usize, server: usize) -> bool {
        let machine = self.fetchers.get(&client).copied().unwrap_or(client);
        server == HUB
            && self
                .isolated
                .get(&machine)
                .is_some_and(|until| self.now < *until)
    }

    /// The relay `relay` asked for a snapshot newer than `newer_than`: its fetcher, a
    /// relay node of its own, dials the relay's upstream (the tokio driver's
    /// `fetch_snapshot`, crates/transport).
    fn fetch(&mut self, relay: usize, newer_than: u64) {
        self.faults.snapshot_fetches += 1;
        let name = format!("{}-fetcher", self.peers[relay].name);
        let node = Node::snapshot_fetcher(
            Receiver::relaying(receiver_config(Role::Relay, &name, 2)),
            Sender::new(sender_config(Role::Relay, &name, false, false)),
            Arc::new(HeapSnapshots),
            newer_than,
        );
        let upstreams = self.peers[relay].upstreams.clone();
        let fetcher = self.peers.len();
        self.peers.push(Peer::new(node, &name, upstreams, None));
        self.fetchers.insert(fetcher, relay);
        self.at(Duration::ZERO, Event::NewSession { node: fetcher });
    }

    /// The fetcher delivered a version: once it holds its snapshot and, where the relay
    /// keeps none (so it lacks deltas after it), the deltas after it up to the relay's
    /// newest, it hands them over.
    fn fetched(&mut self, fetcher: usize) {
        let relay = self.fetchers[&fetcher];
        let with_deltas = self.peers[relay]
            .node
            .as_ref()
            .is_some_and(|n| n.sender().unwrap().kept_snapshot().is_none());
        let holds = |peer: &Peer| {
            peer.node
                .as_ref()
                .and_then(|n| n.receiver())
                .map(|r| r.next_version().saturating_sub(1))
        };
        let newest = self.peers[relay]
            .node
            .as_ref()
            .and_then(|n| n.sender()?.latest());
        if with_deltas && holds(&self.peers[fetcher]) < newest {
            return;
        }
        let kept = self.node(fetcher).and_then(Node::take_kept);
        self.stop_fetcher(fetcher);
        let Some(relay_node) = self.node(relay) else {
            return;
        };
        match kept {
            Some((snapshot, file)) => {
                let version = snapshot.version();
                relay_node.adopt_snapshot(snapshot, file);
                if relay_node.sender().unwrap().kept_snapshot() == Some(version) {
                    self.faults.snapshots_adopted += 1;
                    self.faults.adopted_with_deltas += u64::from(with_deltas);
                }
            }
            None => relay_node.snapshot_not_fetched("the fetcher kept no snapshot"),
        }
        self.drain(relay);
    }

    fn fetch_failed(&mut self, fetcher: usize, reason: &str) {
        let relay = self.fetchers[&fetcher];
        self.stop_fetcher(fetcher);
        if let Some(relay_node) = self.node(relay) {
            relay_node.snapshot_not_fetched(reason);
            self.drain(relay);
        }
    }

    fn stop_fetcher(&mut self, fetcher: usize) {
        self.fetchers.remove(&fetcher);
        self.crash(fetcher);
    }

    fn latency(&mut self) -> Duration {
        self.rng.millis(1, 25)
    }

    fn node(&mut self, node: usize) -> Option<&mut Node> {
        self.peers[node].node.as_mut()
    }

    fn run(&mut self) {
        let deadline = self.start + Duration::from_secs(120);
        while let Some(next) = self.queue.pop() {
            if next.at > deadline {
                break;
            }
            self.now = next.at;
            self.handle(next.event);
            if self.done() {
                return;
            }
        }
    }

    /// After the last version, runs on (with the faults still due) until every live
    /// actor whose first upstream is a live, honest relay is back on it; the actors
    /// that are not, if a minute of virtual time does not do it.
    fn settle(&mut self) -> Vec<String> {
        let deadline = self.now + Duration::from_secs(60);
        loop {
            let away = self.away_from_home();
            if away.is_empty() {
                return away;
            }
            match self.queue.pop() {
                Some(next) if next.at <= deadline => {
                    self.now = next.at;
                    self.handle(next.event);
                }
                _ => return away,
            }
        }
    }

    fn away_from_home(&self) -> Vec<String> {
        self.peers[3..=JOINER]
            .iter()
            .filter(|p| {
                let Some(node) = &p.node else { return false };
                let first = p.upstreams[0];
                let home_up = first != ROGUE && self.peers[first].node.is_some();
                home_up
                    && !(p.route.on_first() && node.receiver().is_some_and(Receiver::is_connected))
            })
            .map(|p| p.name.clone())
            .collect()
    }

    fn done(&self) -> bool {
        self.peers[1..=JOINER].iter().all(|p| {
            p.node.as_ref().is_none_or(|n| {
                n.actor_status()
                    .is_some_and(|s| s.active.is_some_and(|a| a.version == VERSIONS))
            })
        }) && self.peers[3..=JOINER].iter().all(|p| p.node.is_some())
    }
}

impl Peer {
    fn new(node: Node, name: &str, upstreams: Vec<usize>, version: Option<u64>) -> Peer {
        Peer {
            node: Some(node),
            name: name.into(),
            route: Upstreams::new(upstreams.clone(), Some(RETURN_AFTER), jitter_seed(name)),
            upstreams,
            weights: version.map(|v| Weights::new(chain().images[v as usize].clone(), v).unwrap()),
            timer: None,
        }
    }
}

fn run(seed: u64) -> Sim {
    run_with(seed, false, true)
}

fn run_with(seed: u64, rogue: bool, hedging: bool) -> Sim {
    let mut sim = Sim::new(seed, rogue, hedging);
    sim.run();
    let away = sim.settle();
    assert!(
        away.is_empty(),
        "seed {seed}: {away:?} never went back to their relay"
    );
    let expected = &chain().images[VERSIONS as usize];
    for peer in &sim.peers[1..=JOINER] {
        let Some(node) = &peer.node else {
            assert!(
                peer.name.starts_with("relay"),
                "seed {seed}: only relays stay down"
            );
            continue;
        };
        let duplicates = node.receiver().unwrap().stats().duplicates;
        if duplicates > 0 && std::env::var_os("AURORA_SIM_TRACE").is_some() {
            eprintln!(
                "seed {seed}: {} received {duplicates} duplicates",
                peer.name
            );
        }
        sim.faults.duplicates += duplicates;
        if peer.name.starts_with("relay") {
            assert_eq!(
                node.sender().unwrap().latest(),
                Some(VERSIONS),
                "seed {seed}: {} does not hold the last version",
                peer.name
            );
            assert!(peer.weights.is_none() && node.actor_status().is_none());
            sim.faults.relay_suspensions += node.sender().unwrap().stats().suspensions;
            continue;
        }
        let status = node.actor_status().unwrap();
        assert_eq!(
            status.active,
            Some(version_ref(VERSIONS)),
            "seed {seed}: {} ended at version {:?} (t = {:?})",
            peer.name,
            status.active.map(|a| a.version),
            sim.now - sim.start
        );
        assert!(
            peer.weights.as_ref().unwrap().image() == expected.as_slice(),
            "seed {seed}: {} holds other bytes than the hub's export",
            peer.name
        );
    }
    sim
}

#[test]
fn every_actor_ends_byte_identical_under_seeded_faults() {
    let seeds: Vec<u64> = match std::env::var("AURORA_SIM_SEED") {
        Ok(seed) => vec![seed.parse().expect("AURORA_SIM_SEED is a number")],
        Err(_) => (0..SEEDS).collect(),
    };
    let mut total = Faults::default();
    for seed in seeds.iter().copied() {
        let f = run_with(seed, false, false).faults;
        // Resuming never sends a receiver a segment it already holds: lost streams and
        // new sessions report exactly what arrived. Only a nack can cost a duplicate (it
        // is sent again when its stream dies, though it may have arrived).
        assert!(
            f.duplicates == 0 || f.corruptions > 0,
            "seed {seed}: {} duplicates without any corruption",
            f.duplicates
        );
        total.corruptions += f.corruptions;
        total.cuts += f.cuts;
        total.relay_crashes += f.relay_crashes;
        total.actor_restarts += f.actor_restarts;
        total.upstream_switches += f.upstream_switches;
        total.duplicates += f.duplicates;
        assert!(
            f.joins >= 1,
            "seed {seed}: the joiner never activated a snapshot"
        );
        total.joins += f.joins;
        total.join_sessions_lost += f.join_sessions_lost;
        total.join_resumes += f.join_resumes;
        total.joins_from_relay += f.joins_from_relay;
        total.composed_activations += f.composed_activations;
        total.lost_weights += f.lost_weights;
        total.returns += f.returns;
        total.relay_isolations += f.relay_isolations;
        total.relay_suspensions += f.relay_suspensions;
        total.snapshot_fetches += f.snapshot_fetches;
        total.snapshots_adopted += f.snapshots_adopted;
        total.adopted_with_deltas += f.adopted_with_deltas;
    }
    assert!(total.duplicates <= total.corruptions, "{total:?}");
    if seeds.len() > 1 {
        assert!(
            total.corruptions > 0
                && total.cuts > 0
                && total.relay_crashes > 0
                && total.actor_restarts > 0
                && total.upstream_switches > 0
                && total.join_sessions_lost > 0
                && total.join_resumes > 0
                && total.joins_from_relay > 0
                && total.joins_from_relay < total.joins
                && total.composed_activations > 0
                && total.lost_weights > 0
                && total.returns > 0
                && total.relay_isolations > 0
                && total.relay_suspensions > 0
                && total.snapshots_adopted > 0
                && total.adopted_with_deltas > 0,
            "the seeds must exercise every fault: {total:?}"
        );
    }
    eprintln!("faults over {} seeds: {total:?}", seeds.len());
}

/// With overdue versions sent again (the default), the same faults end with every
/// actor on the hub's bytes, and the copies were made.
#[test]
fn every_actor_ends_byte_identical_with_overdue_versions_sent_again() {
    let seeds: Vec<u64> = match std::env::var("AURORA_SIM_SEED") {
        Ok(seed) => vec![seed.parse().expect("AURORA_SIM_SEED is a number")],
        Err(_) => (0..SEEDS).collect(),
    };
    let mut hedged = 0;
    for seed in seeds.iter().copied() {
        let sim = run_with(seed, false, true);
        // The hub's and the live relays' copies (actors back on their relays take
        // theirs from it).
        hedged += sim
            .peers
            .iter()
            .filter_map(|peer| peer.node.as_ref()?.sender())
            .map(|sender| sender.stats().frames_hedged)
            .sum::<u64>();
    }
    if seeds.len() > 1 {
        assert!(
            hedged > 0,
            "no version was ever overdue over {} seeds",
            seeds.len()
        );
    }
    eprintln!(
        "frames of overdue versions sent again over {} seeds: {hedged}",
        seeds.len()
    );
}

#[test]
fn the_simulation_is_deterministic() {
    let a = run(7);
    let b = run(7);
    assert_eq!(a.now - a.start, b.now - b.start);
    assert_eq!(a.seq, b.seq);
}

#[test]
fn a_malicious_relay_is_refused_by_every_actor_and_the_honest_path_is_unaffected() {
    let seeds: Vec<u64> = match std::env::var("AURORA_SIM_SEED") {
        Ok(seed) => vec![seed.parse().expect("AURORA_SIM_SEED is a number")],
        Err(_) => (0..8).collect(),
    };
    for seed in seeds {
        // `run_with` checks that every live peer ends on the published weights, and
        // every activation panics on other weights: a forged delta never activates.
        let sim = run_with(seed, true, true);
        for (i, peer) in sim.peers[3..JOINER].iter().enumerate() {
            let node = 3 + i;
            let refused = sim.refused.get(&node).copied().unwrap_or(0);
            if RELAYS[i % 2] == RELAYS[0] {
                // Each actor of the rogue's region dials it first, and refuses it.
                assert!(refused > 0, "seed {seed}: {} never refused it", peer.name);
            } else {
                // The honest region never meets it: not one refusal.
                assert_eq!(refused, 0, "seed {seed}: {}", peer.name);
            }
        }
        // Relays take only the hub's signed artifacts.
        for relay in RELAYS {
            assert!(!sim.refused.contains_key(&relay), "seed {seed}");
        }
        // The joiner dials the rogue first and refuses its forged snapshot at the Offer
        // (`output` checks that none of it reaches a decoder); `run_with` checks that it
        // joined from the hub.
        assert!(
            sim.refused.get(&JOINER).copied().unwrap_or(0) > 0,
            "seed {seed}: the joiner never refused the rogue"
        );
    }
}
