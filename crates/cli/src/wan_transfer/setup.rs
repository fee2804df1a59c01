//! The emulated network a transfer runs across: a tokio runtime inside each region's
//! namespace, and the point-to-point pair `encodings` and `streams` share.

use std::net::SocketAddr;
use std::time::Duration;

use crate::fleet::TransferSpec;
use anyhow::{Context, Result};
use aurora_wan::{Network, Scenario};
use bytes::Bytes;

use crate::wan_cmd::endpoints;

/// Worker threads of each region's runtime; every node shares this machine's cores.
const REGION_WORKERS: usize = 2;
/// A transfer or fan-out that takes longer has failed.
pub(super) const TIMEOUT: Duration = Duration::from_secs(600);

/// A runtime whose threads live in `region`'s network namespace, so the sockets of the
/// nodes started on it belong to that region. Its workers are spawned while it is
/// built, on a thread inside the namespace, and the threads it adds later (blocking
/// work) are spawned by them, so they inherit it.
pub(super) fn runtime_in(network: &Network, region: &str) -> Result<tokio::runtime::Runtime> {
    network
        .run_in(region, || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(REGION_WORKERS)
                .enable_all()
                .build()
        })?
        .with_context(|| format!("starting a runtime in region {region}"))
}

/// The rate of the link between two regions, if they share one with a rate limit.
fn link_rate_mbps(scenario: &Scenario, a: &str, b: &str) -> Option<f64> {
    scenario
        .links
        .iter()
        .find(|link| link.between.contains(&a.to_string()) && link.between.contains(&b.to_string()))
        .and_then(|link| link.rate_mbps)
}

/// The hub's region, one receiving region, and a runtime in each: what `encodings` and
/// `streams` run on.
pub(super) struct PointToPoint {
    pub(super) network: Network,
    hub: String,
    hub_runtime: tokio::runtime::Runtime,
    remote_runtime: tokio::runtime::Runtime,
    pub(super) link_mbps: Option<f64>,
}

impl PointToPoint {
    pub(super) fn up(scenario: &Scenario) -> Result<PointToPoint> {
        let (hub, remote) = endpoints(scenario, None, None)?;
        let network = Network::up(scenario)?;
        Ok(PointToPoint {
            hub_runtime: runtime_in(&network, &hub)?,
            remote_runtime: runtime_in(&network, &remote)?,
            link_mbps: link_rate_mbps(scenario, &hub, &remote),
            hub,
            network,
        })
    }

    pub(super) fn spec(&self, artifact: &Bytes, streams: u8) -> Result<TransferSpec> {
        let mut spec = TransferSpec::new(artifact.clone(), 1, streams);
        spec.listen = SocketAddr::new(self.network.address(&self.hub)?.into(), 0);
        spec.hub_runtime = Some(self.hub_runtime.handle().clone());
        spec.receiver_runtime = Some(self.remote_runtime.handle().clone());
        spec.timeout = TIMEOUT;
        Ok(spec)
    }

    pub(super) fn down(self) -> Result<()> {
        // The nodes' sockets close with their runtimes, before the namespaces go.
        drop(self.hub_runtime);
        drop(self.remote_runtime);
        Ok(self.network.down()?)
    }
}
