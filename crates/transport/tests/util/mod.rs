//! Helpers for the loopback tests: a synthetic chain of checkpoints and deltas, node
//! configurations, a fault-injecting proxy and a bounded wait.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use aurora_delta::{DeltaFile, Hash};
use aurora_proto::{Frame, Identity, Role, VersionRef, Weights};
use aurora_transport::{
    IdleEngine, NodeConfig, NodeHandle, NodeStatus, Security, read_frame, write_frame,
};
use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub const TOKEN: &[u8] = b"loopback-secret";

/// Checkpoints 0..=n of a small synthetic model and the deltas between them.
pub struct Chain {
    pub images: Vec<Vec<u8>>,
    pub hashes: Vec<Hash>,
    pub deltas: Vec<Bytes>,
}

impl From<aurora_synth::DeltaChain> for Chain {
    fn from(chain: aurora_synth::DeltaChain) -> Chain {
        Chain {
            images: chain.images,
            hashes: chain.hashes,
            deltas: chain.deltas.into_iter().map(Bytes::from).collect(),
        }
    }
}

impl Chain {
    pub fn new(versions: u64, seed: u64) -> Chain {
        let shape = aurora_synth::preset("tiny").unwrap();
        let mut config = aurora_synth::SynthConfig::new(shape, seed);
        // Larger steps than real training, so every delta spans many segments.
        config.learning_rate = 3e-5;
        Chain::from(aurora_synth::DeltaChain::new(config, versions, 1024))
    }

    /// A chain at the synthetic trainer's own learning rate: steps like real training's,
    /// each changing about 1% of the elements, so a delta is a small part of the model.
    pub fn sparse(versions: u64, seed: u64) -> Chain {
        let shape = aurora_synth::preset("tiny").unwrap();
        let config = aurora_synth::SynthConfig::new(shape, seed);
        Chain::from(aurora_synth::DeltaChain::new(config, versions, 1024))
    }

    pub fn weights(&self, version: u64) -> Weights {
        Weights::new(self.images[version as usize].clone(), version).unwrap()
    }

    pub fn at(&self, version: u64) -> VersionRef {
        VersionRef {
            version,
            hash: self.hashes[version as usize],
        }
    }

    pub fn delta(&self, version: u64) -> &Bytes {
        &self.deltas[version as usize - 1]
    }

    pub fn segments(&self, version: u64) -> usize {
        DeltaFile::parse(self.delta(version))
            .unwrap()
            .segment_count()
    }

    /// Publishes D(version) on `hub` the way a live extraction does (header, segments
    /// one by one, manifest), then commits it.
    pub async fn publish_live(&self, hub: &NodeHandle, version: u64) {
        self.publish_part(hub, version, 0..self.segments(version))
            .await;
        self.seal(hub, version).await;
    }

    /// Begins D(version) (on the first part) and publishes the segments in `range`.
    pub async fn publish_part(
        &self,
        hub: &NodeHandle,
        version: u64,
        range: std::ops::Range<usize>,
    ) {
        let file = DeltaFile::parse(self.delta(version)).unwrap();
        if range.start == 0 {
            let descriptor = Bytes::from(file.header().encode_pending());
            assert_eq!(hub.begin(descriptor).await.unwrap(), version);
        }
        for index in range {
            let bytes = file.verify_segment(index).unwrap().to_vec();
            let segment = aurora_delta::Segment {
                index: index as u32,
                hash: file.manifest.segments[index].hash,
                bytes,
            };
            hub.segment(version, segment).await.unwrap();
        }
    }

    pub async fn seal(&self, hub: &NodeHandle, version: u64) {
        let file = DeltaFile::parse(self.delta(version)).unwrap();
        hub.seal(version, file.manifest.clone()).await.unwrap();
        hub.commit(self.at(version)).await.unwrap();
    }
}

/// The trainer's signing key of every test deployment.
pub fn trainer_key() -> aurora_delta::SigningKey {
    aurora_delta::SigningKey::from_bytes(&[0x3c; 32])
}

/// A node of a signed deployment: a hub signs with [`trainer_key`], every other node
/// pins it.
pub fn config(role: Role, name: &str, upstreams: &[SocketAddr]) -> NodeConfig {
    // Logs for a failing test: AURORA_LOG=debug cargo test -p aurora-transport.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AURORA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off")),
        )
        .with_test_writer()
        .try_init();
    let identity = Identity {
        role,
        peer_id: name.into(),
        region: "eu-west".into(),
    };
    // The fault proxy reads frames: these tests run in plaintext (tests/tls.rs covers TLS).
    let security = Security::loopback_plaintext(TOKEN);
    let mut config = NodeConfig::new(identity, security);
    config.upstreams = upstreams.to_vec();
    config.streams = 2;
    // These tests count duplicates to prove that resuming sends only what is missing;
    // copies of overdue versions (a loaded machine's late Wants) would blur that. The
    // copies are tested in aurora-proto's sender tests and simulation.
    config.hedge_max_bytes = 0;
    if role != Role::Actor {
        config.listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    }
    if role == Role::Hub {
        config.signing_key = Some(Arc::new(trainer_key()));
    } else {
        config.trainer_key = Some(trainer_key().verifying_key());
    }
    config
}

/// An actor of `hub`'s deployment ([`config`]), pinned to the run the hub serves, as
/// an actor node is once the control plane named it: it takes the run from no relay.
pub fn actor_config(hub: &NodeHandle, name: &str, upstreams: &[SocketAddr]) -> NodeConfig {
    let mut config = config(Role::Actor, name, upstreams);
    config.run = hub.status().run;
    config
}

/// Awaits `future`, failing the test (instead of hanging) after `limit`.
pub async fn within<T>(limit: Duration, what: &str, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: not done after {limit:?}"),
    }
}

/// Waits until `node` is active at `version`, and returns its status.
pub async fn active_at(node: &NodeHandle, version: u64, name: &str) -> NodeStatus {
    within(Duration::from_secs(60), name, async {
        node.wait_for(|s| s.active.is_some_and(|a| a.version == version))
            .await
            .unwrap()
    })
    .await
}

/// Starts a relay and waits until its upstream session is up, so that it forwards from
/// the versions published after this (a relay starts from its upstream's newest).
pub async fn connected_relay(config: NodeConfig) -> NodeHandle {
    let relay = aurora_transport::spawn_relay(config).await.unwrap();
    within(
        Duration::from_secs(60),
        "relay connects",
        relay.wait_for(|s| s.connected),
    )
    .await
    .unwrap();
    relay
}

/// An actor with an engine that generates nothing, started from `weights`.
pub async fn idle_actor(config: NodeConfig, weights: Weights) -> NodeHandle {
    aurora_transport::spawn_actor(config, weights, Arc::new(IdleEngine::default()))
        .await
        .unwrap()
}

/// Waits until the relay `node` holds `version` complete (relays hold no weights).
pub async fn held_at(node: &NodeHandle, version: u64, name: &str) -> NodeStatus {
    within(Duration::from_secs(60), name, async {
        node.wait_for(|s| s.completed.contains(&version))
            .await
            .unwrap()
    })
    .await
}

/// What the proxy does to the server-to-client direction.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Flip one bit in the payload of the n-th segment frame (counted over every
    /// connection through the proxy), once.
    FlipSegment { nth: usize },
    /// Forward the first half of the n-th segment frame, then cut that connection.
    CutInSegment { nth: usize },
    /// Pose as a relay (its Welcome says so) that passes on no part of any version, nor
    /// a Commit (the handshake and keepalives go through): stuck behind, or withholding.
    Withhold,
    /// Nothing but what [`Proxy::partition`] does.
    None,
}

/// A TCP proxy in front of an upstream that injects one fault, and can be cut off.
pub struct Proxy {
    pub address: SocketAddr,
    pub fired: Arc<AtomicBool>,
    partitioned: watch::Sender<bool>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr, fault: Fault) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let fired = Arc::new(AtomicBool::new(false));
        let segments = Arc::new(AtomicUsize::new(0));
        let flag = fired.clone();
        let (partitioned, watching) = watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if *watching.borrow() {
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                tokio::spawn(relay_pair(
                    client,
                    server,
                    fault,
                    segments.clone(),
                    flag.clone(),
                    watching.clone(),
                ));
            }
        });
        Proxy {
            address,
            fired,
            partitioned,
        }
    }

    /// Cuts every connection through the proxy and refuses new ones until [`Proxy::heal`].
    pub fn partition(&self) {
        self.partitioned.send_replace(true);
    }

    pub fn heal(&self) {
        self.partitioned.send_replace(false);
    }
}

async fn relay_pair(
    client: TcpStream,
    server: TcpStream,
    fault: Fault,
    segments: Arc<AtomicUsize>,
    fired: Arc<AtomicBool>,
    mut partitioned: watch::Receiver<bool>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upward = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
        let _ = server_write.shutdown().await;
    });
    loop {
        let mut frame = tokio::select! {
            frame = read_frame(&mut server_read) => match frame {
                Ok(frame) => frame,
                Err(_) => break,
            },
            _ = partitioned.wait_for(|cut| *cut) => break,
        };
        if matches!(fault, Fault::Withhold) {
            match &mut frame {
                Frame::Welcome(welcome) => {
                    welcome.role = aurora_proto::Role::Relay;
                    welcome.commit = None;
                }
                Frame::Offer { .. }
                | Frame::Segment { .. }
                | Frame::Seal { .. }
                | Frame::Commit(_) => {
                    continue;
                }
                _ => {}
            }
        }
        if let Frame::Segment { bytes, .. } = &mut frame {
            let n = segments.fetch_add(1, Ordering::SeqCst);
            match fault {
                Fault::FlipSegment { nth } if n == nth && !fired.swap(true, Ordering::SeqCst) => {
                    let mut damaged = bytes.to_vec();
                    let middle = damaged.len() / 2;
                    damaged[middle] ^= 0x10;
                    *bytes = Bytes::from(damaged);
                }
                Fault::CutInSegment { nth } if n == nth && !fired.swap(true, Ordering::SeqCst) => {
                    let encoded = frame.to_bytes();
                    let _ = client_write.write_all(&encoded[..encoded.len() / 2]).await;
                    upward.abort();
                    return;
                }
                _ => {}
            }
        }
        if write_frame(&mut client_write, &frame).await.is_err() {
            break;
        }
    }
    let _ = client_write.shutdown().await;
    upward.abort();
}
