//! The relay node: a region's relay of the segment protocol (docs/wire-protocol.md §8). It
//! forwards each verified segment to the region's actors as it arrives, holds no weights,
//! and keeps (where told) the snapshot it started from for the region's joins. It has no
//! part in the control plane: actors report their versions themselves.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use aurora_delta::{RunId, VerifyingKey};
use aurora_proto::{Identity, Role};
use aurora_transport::{NodeConfig, NodeHandle, SocketOptions, spawn_relay};

use crate::{NodeError, NodeTrust};

/// Settings of a relay node.
#[derive(Clone, Debug)]
pub struct RelaySettings {
    /// The relay's id on the segment protocol. With certificates the certificate names
    /// it, and a value here must repeat it; in plaintext it is required.
    pub id: Option<String>,
    /// Its region, named or repeated the same way (in plaintext "default" when unset).
    pub region: Option<String>,
    /// Where the region's actors connect (port 0: any free one).
    pub transport_listen: SocketAddr,
    /// Upstreams in order of preference: the hub, or a peer relay to fall back to.
    pub upstreams: Vec<SocketAddr>,
    pub trust: NodeTrust,
    /// Parallel TCP streams per upstream session (the upper bound when tuned).
    pub streams: u8,
    /// Tune the stream count from measured goodput at this interval; `None`: fixed.
    pub tune_interval: Option<Duration>,
    /// What the upstream may make this node hold, and what subscribers may ask of it.
    pub transport_limits: aurora_transport::Limits,
    /// The trainer's public key: every artifact and commit must carry its signature
    /// (docs/security.md). Required with certificates, unless `insecure_unsigned`.
    pub trainer_key: Option<VerifyingKey>,
    /// INSECURE: forward unsigned versions although the node has certificates.
    pub insecure_unsigned: bool,
    /// The run to serve; `None`: learned from the trainer's own hub, never from a relay.
    pub run: Option<RunId>,
    /// Keep the snapshot it starts from in an unnamed file here and serve it to the
    /// region's joiners (`NodeConfig::snapshot_dir`); `None`: joiners go to the hub.
    pub snapshot_dir: Option<PathBuf>,
    /// Back to the first upstream after this long on another, between versions; `None`
    /// never.
    pub return_after: Option<Duration>,
    /// With no working upstream for this long, send the subscribers away until there is
    /// one again (`NodeConfig::relay_suspend_after`); `None`: they wait.
    pub suspend_after: Option<Duration>,
    /// TCP options of every socket (congestion control).
    pub socket: SocketOptions,
}

impl RelaySettings {
    /// A relay listening on `transport_listen` behind `upstreams`, with the transport's
    /// defaults for everything else.
    pub fn new(
        transport_listen: SocketAddr,
        upstreams: Vec<SocketAddr>,
        trust: NodeTrust,
    ) -> RelaySettings {
        let defaults = NodeConfig::new(
            Identity {
                role: Role::Relay,
                peer_id: String::new(),
                region: String::new(),
            },
            trust.transport(),
        );
        RelaySettings {
            id: None,
            region: None,
            transport_listen,
            upstreams,
            trust,
            streams: defaults.streams,
            tune_interval: defaults.tune_interval,
            transport_limits: defaults.limits,
            trainer_key: None,
            insecure_unsigned: false,
            run: None,
            snapshot_dir: None,
            return_after: defaults.return_after,
            suspend_after: defaults.relay_suspend_after,
            socket: defaults.socket,
        }
    }
}

/// How a relay's graceful stop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stopped {
    /// Subscribers still connected when the deadline passed (0: every one moved on).
    pub subscribers_left: usize,
}

pub struct RelayNode {
    transport: NodeHandle,
    address: SocketAddr,
}

impl RelayNode {
    /// Checks the settings, binds the listening address and starts following the
    /// upstreams.
    pub async fn start(settings: RelaySettings) -> Result<RelayNode, NodeError> {
        if settings.upstreams.is_empty() {
            return Err(NodeError::NoUpstream);
        }
        let identity = settings
            .trust
            .identity_as(Role::Relay, settings.id, settings.region)?;
        let mut config = NodeConfig::new(identity, settings.trust.transport());
        config.listen = Some(settings.transport_listen);
        config.upstreams = settings.upstreams;
        config.streams = settings.streams;
        config.tune_interval = settings.tune_interval;
        config.limits = settings.transport_limits;
        config.trainer_key = settings.trainer_key;
        config.insecure_unsigned = settings.insecure_unsigned;
        config.run = settings.run;
        config.snapshot_dir = settings.snapshot_dir;
        config.return_after = settings.return_after;
        config.relay_suspend_after = settings.suspend_after;
        config.socket = settings.socket;
        let transport = spawn_relay(config).await?;
        let address = transport
            .local_addr()
            .ok_or(NodeError::NoTransportAddress)?;
        Ok(RelayNode { transport, address })
    }

    /// Where the region's actors connect.
    pub fn transport_address(&self) -> SocketAddr {
        self.address
    }

    /// The transport node (its status: versions held, subscribers, upstream).
    pub fn transport(&self) -> &NodeHandle {
        &self.transport
    }

    /// The graceful stop: every subscriber is sent to its next upstream now (not when
    /// the sockets close), new ones are refused as busy, and the relay waits up to
    /// `deadline` for them to go (docs/wire-protocol.md §8). It stops serving for good;
    /// the caller then ends the process or drops the node.
    pub async fn stop(&self, reason: String, deadline: Duration) -> Result<Stopped, NodeError> {
        self.transport.stop_serving(reason).await?;
        let gone = self.transport.wait_for(|status| status.subscribers == 0);
        let subscribers_left = match tokio::time::timeout(deadline, gone).await {
            Ok(_) => 0,
            Err(_) => self.transport.status().subscribers,
        };
        Ok(Stopped { subscribers_left })
    }
}

impl Drop for RelayNode {
    fn drop(&mut self) {
        self.transport.kill();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use aurora_trust::{FleetCa, NodeTls, PlaintextReach};

    use super::*;

    fn certified(ca: &FleetCa, role: aurora_trust::Role, id: &str) -> NodeTrust {
        let identity = aurora_trust::Identity::new(role, id, "eu").unwrap();
        let cert = ca.issue(&identity, time::Duration::days(1)).unwrap();
        NodeTrust::Certificates(Arc::new(
            NodeTls::from_pem(ca.cert_pem(), &cert.cert_pem, &cert.key_pem).unwrap(),
        ))
    }

    #[test]
    fn a_relay_is_who_its_certificate_says_and_names_may_only_repeat_it() {
        let ca = FleetCa::create("test").unwrap();
        let trust = certified(&ca, aurora_trust::Role::Relay, "relay-eu");
        let identity = trust.identity_as(Role::Relay, None, None).unwrap();
        assert_eq!(
            (
                identity.role,
                identity.peer_id.as_str(),
                identity.region.as_str()
            ),
            (Role::Relay, "relay-eu", "eu")
        );
        let repeated = trust.identity_as(Role::Relay, Some("relay-eu".into()), Some("eu".into()));
        assert_eq!(repeated.unwrap(), identity);
        for (id, region) in [(Some("relay-us"), None), (None, Some("us"))] {
            let error = trust
                .identity_as(Role::Relay, id.map(Into::into), region.map(Into::into))
                .unwrap_err();
            assert!(matches!(error, NodeError::NotThisNode { .. }), "{error}");
            assert!(
                error
                    .to_string()
                    .starts_with("the certificate is of relay 'relay-eu' in region 'eu'"),
                "{error}"
            );
        }
        // An actor's certificate makes no relay.
        let actor = certified(&ca, aurora_trust::Role::Actor, "3");
        let error = actor.identity_as(Role::Relay, None, None).unwrap_err();
        assert!(matches!(error, NodeError::NotThisNode { .. }), "{error}");
    }

    #[test]
    fn a_relay_in_plaintext_needs_an_id() {
        let trust = NodeTrust::insecure_plaintext("token", PlaintextReach::Loopback).unwrap();
        let error = trust.identity_as(Role::Relay, None, None).unwrap_err();
        assert!(
            matches!(error, NodeError::NoId { role: Role::Relay }),
            "{error}"
        );
        let named = trust
            .identity_as(Role::Relay, Some("r".into()), None)
            .unwrap();
        assert_eq!(
            (named.peer_id.as_str(), named.region.as_str()),
            ("r", "default")
        );
    }

    #[tokio::test]
    async fn a_relay_starts_behind_its_upstreams_and_stops_with_none_left() {
        let trust = NodeTrust::insecure_plaintext("token", PlaintextReach::Loopback).unwrap();
        let listen = SocketAddr::from(([127, 0, 0, 1], 0));
        let mut settings = RelaySettings::new(listen, Vec::new(), trust);
        settings.id = Some("relay-eu".into());
        let error = RelayNode::start(settings.clone()).await.err().unwrap();
        assert!(matches!(error, NodeError::NoUpstream), "{error}");
        // An upstream that is not there yet: the relay starts and keeps trying.
        settings.upstreams = vec![SocketAddr::from(([127, 0, 0, 1], 9))];
        let relay = RelayNode::start(settings).await.unwrap();
        assert_ne!(relay.transport_address().port(), 0);
        let stopped = relay
            .stop("a test".into(), Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(
            stopped,
            Stopped {
                subscribers_left: 0
            }
        );
    }
}
