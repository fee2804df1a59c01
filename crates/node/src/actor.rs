//! The actor node: the transport actor that keeps the weights current, and the actor's
//! side of the control plane's API. It does not generate: the caller claims work,
//! generates with its engine, and submits (the engine meets the transport through
//! [`aurora_transport::Engine`], for example a [`crate::Handoff`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aurora_api::{
    Ack, ActorRequest, ClaimResponse, JoinResponse, RegisterRequest, RegisterResponse,
    SubmitRequest, SubmitResponse, VersionsRequest, WireReadiness, WireResult,
};
use aurora_delta::RunId;
use aurora_proto::{Identity, JoinFloor, Role, VersionRef, Weights};
use aurora_transport::{Engine, NodeConfig, NodeHandle, spawn_actor, spawn_joining_actor};
use tokio::task::JoinHandle;

use crate::{ControlClient, NodeError, NodeTrust};

/// Heartbeat period; a control plane declares an actor dead after a few missed.
const HEARTBEAT: Duration = Duration::from_millis(1000);
/// The bound of the pause after a first failed version report (it doubles with each
/// failure in a row), and the longest.
const REPORT_BACKOFF: Duration = Duration::from_millis(200);
const REPORT_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Settings of an actor node.
#[derive(Clone, Debug)]
pub struct ActorSettings {
    /// Unique in the fleet.
    pub id: u64,
    pub region: String,
    /// The control plane's HTTP API.
    pub control: SocketAddr,
    /// Transport upstreams in order of preference: the region's relay, then the hub.
    pub upstreams: Vec<SocketAddr>,
    /// How both planes are reached: the actor's certificate (its id must be the
    /// actor's number), or insecure plaintext with the fleet token. Registering gives
    /// the actor a token of its own for every later control call.
    pub trust: NodeTrust,
    /// Parallel TCP streams per upstream session.
    pub streams: u8,
    /// What the upstream may make this node hold, and what peers may ask of it.
    pub transport_limits: aurora_transport::Limits,
    /// The trainer's public key: every artifact and commit must carry its signature
    /// (docs/security.md). Required with certificates, unless `insecure_unsigned`.
    pub trainer_key: Option<aurora_delta::VerifyingKey>,
    /// INSECURE: take unsigned versions although the node has certificates
    /// ([`aurora_transport::NodeConfig::insecure_unsigned`]).
    pub insecure_unsigned: bool,
    /// Where the image of a snapshot taken over the wire is built (and the images
    /// after it): the heap, or mapped files (`aurora_checkpoint::FileImages`).
    pub images: Arc<dyn aurora_delta::ImageSpace>,
    /// Back to the first upstream after this long on another, between versions
    /// (`NodeConfig::return_after`; default [`aurora_transport::RETURN_AFTER`]); `None`
    /// never.
    pub return_after: Option<Duration>,
    /// A relay that brings too little of a committed version this actor lacks for this
    /// long (nothing new but less than 8 MiB of segments) is given up
    /// (`NodeConfig::behind_timeout`; default [`aurora_transport::BEHIND_TIMEOUT`]).
    pub behind_timeout: Duration,
}

pub struct ActorNode {
    id: u64,
    transport: NodeHandle,
    client: Arc<ControlClient>,
    tasks: Vec<JoinHandle<()>>,
}

impl ActorNode {
    /// Starts with no weights, as on a new machine: takes the newest snapshot an
    /// upstream offers over the wire, activates it (the engine gets it at once), waits
    /// up to `join_timeout` for that, and registers with the control plane.
    pub async fn join<E: Engine>(
        settings: ActorSettings,
        engine: Arc<E>,
        join_timeout: Duration,
    ) -> Result<ActorNode, NodeError> {
        let (config, fleet) = node_config(&settings, true).await?;
        let transport = spawn_joining_actor(config, engine).await?;
        ActorNode::register(settings, fleet, transport, join_timeout).await
    }

    /// Starts from local `weights` (their version and hash are reported as active).
    pub async fn start<E: Engine>(
        settings: ActorSettings,
        weights: Weights,
        engine: Arc<E>,
    ) -> Result<ActorNode, NodeError> {
        let (config, fleet) = node_config(&settings, false).await?;
        let transport = spawn_actor(config, weights, engine).await?;
        ActorNode::register(settings, fleet, transport, Duration::ZERO).await
    }

    async fn register(
        settings: ActorSettings,
        fleet: ControlClient,
        transport: NodeHandle,
        timeout: Duration,
    ) -> Result<ActorNode, NodeError> {
        let joined = tokio::time::timeout(
            timeout,
            transport.wait_for(|status| status.active.is_some()),
        )
        .await
        .map_err(|_| NodeError::Timeout {
            // Why the upstreams failed is what the caller can act on (a trainer key
            // that verifies nothing, a relay that refuses this node).
            what: match transport.status().last_upstream_failure {
                Some(failure) => {
                    format!("a snapshot to join from (the last upstream failure: {failure})")
                }
                None => "a snapshot to join from".into(),
            },
            timeout,
        })?
        .map_err(NodeError::Transport)?;
        let active = joined.active.expect("waited for an active version");
        let registered: RegisterResponse = fleet
            .post(
                "/v1/register",
                &RegisterRequest {
                    actor: settings.id,
                    region: settings.region.clone(),
                    can_relay: false,
                    active: active.version,
                    staged: None,
                },
            )
            .await?;
        tracing::info!(actor = settings.id, version = active.version, readiness = ?registered.readiness, "registered");
        if let WireReadiness::CatchUp { target } = registered.readiness {
            expect_committed(&transport, target).await;
        }
        let client = Arc::new(fleet.with_actor_token(&registered.token));
        let tasks = vec![
            tokio::spawn(heartbeats(client.clone(), settings.id)),
            tokio::spawn(report_versions(
                client.clone(),
                settings.id,
                transport.watch(),
            )),
        ];
        Ok(ActorNode {
            id: settings.id,
            transport,
            client,
            tasks,
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// The transport actor (its status: active, staged and committed versions).
    pub fn transport(&self) -> &NodeHandle {
        &self.transport
    }

    /// The version the engine runs.
    pub fn active(&self) -> Option<VersionRef> {
        self.transport.status().active
    }

    /// Asks for work on the open step (docs/control-api.md, `claim`).
    ///
    /// The version a claim is told to catch up to, or to activate, is committed: the
    /// transport is told ([`NodeHandle::expect_committed`]), and a relay that then
    /// brings nothing new for `behind_timeout` is given up for the next upstream.
    pub async fn claim(&self) -> Result<ClaimResponse, NodeError> {
        let response: ClaimResponse = self
            .client
            .post("/v1/claim", &ActorRequest { actor: self.id })
            .await?;
        if let ClaimResponse::CatchUp { target: version }
        | ClaimResponse::Work {
            commit: Some(version),
            ..
        } = response
        {
            expect_committed(&self.transport, version).await;
        }
        Ok(response)
    }

    /// Hands in results for leases this actor holds; each is judged on its own.
    pub async fn submit(&self, results: Vec<WireResult>) -> Result<SubmitResponse, NodeError> {
        self.client
            .post(
                "/v1/submit",
                &SubmitRequest {
                    actor: self.id,
                    results,
                },
            )
            .await
    }

    /// Leaves the fleet: held leases go back to the pool at once.
    pub async fn leave(&self) -> Result<(), NodeError> {
        let _: Ack = self
            .client
            .post("/v1/leave", &ActorRequest { actor: self.id })
            .await?;
        Ok(())
    }

    /// Stops heartbeats, reports and the transport.
    pub fn stop(&self) {
        for task in &self.tasks {
            task.abort();
        }
        self.transport.kill();
    }
}

impl Drop for ActorNode {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The transport's configuration, and a client of the control plane; also where the
/// settings are checked, before anything starts. The run is pinned as the control plane
/// names it (over mutual TLS, the trainer's word: its certificate is checked), so that
/// no upstream can hand this node another run's versions; a node that `joins` also
/// takes no snapshot or upstream older than the control plane says the trainer offers
/// (docs/wire-protocol.md §6.6).
async fn node_config(
    settings: &ActorSettings,
    joins: bool,
) -> Result<(NodeConfig, ControlClient), NodeError> {
    settings
        .trust
        .check_address("the control plane's address", settings.control)?;
    let fleet = ControlClient::new(settings.control, &settings.trust.control_client()?);
    let point: JoinResponse = fleet.get("/v1/join").await?;
    let run = point
        .run
        .parse::<RunId>()
        .map_err(|reason| NodeError::Api {
            path: "GET /v1/join".into(),
            reason,
        })?;
    tracing::info!(%run, committed = ?point.committed, snapshot = ?point.snapshot, "the run to serve");
    let plaintext = Identity {
        role: Role::Actor,
        peer_id: format!("actor-{}", settings.id),
        region: settings.region.clone(),
    };
    let mut node = NodeConfig::new(
        settings.trust.identity(plaintext)?,
        settings.trust.transport(),
    );
    node.upstreams = settings.upstreams.clone();
    node.streams = settings.streams;
    node.limits = settings.transport_limits.clone();
    node.trainer_key = settings.trainer_key;
    node.insecure_unsigned = settings.insecure_unsigned;
    node.images = settings.images.clone();
    node.return_after = settings.return_after;
    node.behind_timeout = settings.behind_timeout;
    node.run = Some(run);
    if joins {
        node.join_floor = JoinFloor {
            snapshot: point.snapshot.unwrap_or(0),
            commit: point.committed.unwrap_or(0),
        };
    }
    Ok((node, fleet))
}

/// Tells the transport that the control plane has `version` committed; a transport
/// that has stopped says so on its own, and the control plane's answer still stands.
async fn expect_committed(transport: &NodeHandle, version: u64) {
    if let Err(error) = transport.expect_committed(version).await {
        tracing::warn!(
            version,
            "the transport cannot take the committed version: {error}"
        );
    }
}

async fn heartbeats(client: Arc<ControlClient>, actor: u64) {
    loop {
        if let Err(error) = client
            .post::<_, Ack>("/v1/heartbeat", &ActorRequest { actor })
            .await
        {
            tracing::warn!("heartbeat: {error}");
        }
        tokio::time::sleep(HEARTBEAT).await;
    }
}

/// Tells the control plane every active and staged version the transport reaches, so
/// the scheduler knows what this actor can generate on.
async fn report_versions(
    client: Arc<ControlClient>,
    actor: u64,
    mut status: tokio::sync::watch::Receiver<aurora_transport::NodeStatus>,
) {
    let mut reported = None;
    let mut backoff = crate::backoff(REPORT_BACKOFF, REPORT_BACKOFF_MAX);
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
            let reporting = std::time::Instant::now();
            match client.post::<_, Ack>("/v1/versions", &request).await {
                Ok(_) => {
                    // The report's round trip is on the path from a staged version to
                    // the trainer's next step: logged to tell it from the staging.
                    tracing::debug!(
                        active,
                        staged,
                        report_s = reporting.elapsed().as_secs_f64(),
                        "versions reported"
                    );
                    reported = Some((active, staged));
                    backoff.reset();
                }
                Err(error) => {
                    tracing::warn!("reporting versions: {error}");
                    tokio::time::sleep(backoff.failed()).await;
                    continue;
                }
            }
        }
        if status.changed().await.is_err() {
            return;
        }
    }
}
