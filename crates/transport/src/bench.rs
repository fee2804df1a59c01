//! A measurable transfer: one delta from a hub to N receivers over S streams each.
//! Benchmarks (and the WAN emulator's scenarios) call [`transfer`] with addresses of
//! their choosing; connection set-up is not timed.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use aurora_delta::DeltaFile;
use aurora_proto::{Identity, ReceiverStats, Role, SenderStats};
use bytes::Bytes;

use crate::conn::SocketOptions;
use crate::node::{NodeConfig, TransportError, spawn_collector, spawn_hub};

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
    /// Let receivers tune their stream count (`streams` is then the upper bound).
    pub tune_interval: Option<Duration>,
    /// Give up after this long.
    pub timeout: Duration,
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
            timeout: Duration::from_secs(600),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ReceiverReport {
    /// From publication to this receiver holding the verified artifact.
    pub elapsed: Duration,
    pub stats: ReceiverStats,
}

#[derive(Debug, Clone)]
pub struct TransferReport {
    pub artifact_bytes: u64,
    pub streams: u8,
    /// From publication to the last receiver done.
    pub elapsed: Duration,
    pub receivers: Vec<ReceiverReport>,
    pub sender: SenderStats,
}

impl TransferReport {
    /// Artifact bytes delivered per second, summed over receivers.
    pub fn goodput_bytes_per_second(&self) -> f64 {
        self.artifact_bytes as f64 * self.receivers.len() as f64 / self.elapsed.as_secs_f64()
    }
}

/// Publishes `spec.artifact` on a fresh hub and waits until every receiver holds it,
/// verified. Receivers connect before the clock starts.
pub async fn transfer(spec: TransferSpec) -> Result<TransferReport, TransportError> {
    let version = DeltaFile::parse(&spec.artifact)
        .map_err(TransportError::Extraction)?
        .header()
        .target_version;
    let token = b"bench".to_vec();
    let identity = |role, name: String| Identity {
        role,
        peer_id: name,
        region: "bench".into(),
    };
    let mut hub_config = NodeConfig::new(identity(Role::Hub, "hub".into()), token.clone());
    hub_config.listen = Some(spec.listen);
    hub_config.socket = spec.socket.clone();
    hub_config.retain_versions = 1;
    let hub = spawn_hub(hub_config, None).await?;
    let address = spec
        .connect
        .unwrap_or(hub.local_addr().expect("the hub listens"));
    let mut receivers = Vec::with_capacity(spec.receivers);
    for index in 0..spec.receivers {
        let mut config = NodeConfig::new(identity(Role::Actor, format!("r{index}")), token.clone());
        config.upstreams = vec![address];
        config.streams = spec.streams;
        config.socket = spec.socket.clone();
        config.tune_interval = spec.tune_interval;
        receivers.push(spawn_collector(config, version).await?);
    }
    let outcome = tokio::time::timeout(spec.timeout, async {
        for receiver in &receivers {
            receiver.wait_for(|s| s.connected).await?;
        }
        let start = Instant::now();
        hub.publish(spec.artifact.clone()).await?;
        let mut waits = tokio::task::JoinSet::new();
        for receiver in &receivers {
            let mut watch = receiver.watch();
            waits.spawn(async move {
                let status = watch
                    .wait_for(|s| s.completed.contains(&version))
                    .await
                    .map_err(|_| TransportError::Stopped)?
                    .clone();
                Ok::<_, TransportError>(ReceiverReport {
                    elapsed: start.elapsed(),
                    stats: status.receiver.unwrap_or_default(),
                })
            });
        }
        let mut reports = Vec::new();
        while let Some(done) = waits.join_next().await {
            reports.push(done.expect("the wait does not panic")?);
        }
        Ok::<_, TransportError>((start.elapsed(), reports))
    })
    .await;
    let sender = hub.status().sender.unwrap_or_default();
    hub.kill();
    for receiver in &receivers {
        receiver.kill();
    }
    let (elapsed, receivers) = outcome.map_err(|_| TransportError::TimedOut(spec.timeout))??;
    Ok(TransferReport {
        artifact_bytes: spec.artifact.len() as u64,
        streams: spec.streams,
        elapsed,
        receivers,
        sender,
    })
}
