//! Mutual TLS on loopback sockets, against strangers (docs/security.md §4): a
//! plaintext client, a certificate of another CA, an expired certificate, an upstream of
//! the wrong role, a Hello naming another peer, silent and half-sent handshakes, a
//! flood beyond the caps and one peer's connections beyond its own. Each is refused, counted by reason and stages nothing, while an
//! honest actor of the same hub keeps receiving its versions.

// Each test binary uses a part of the helpers.
#[allow(dead_code)]
mod util;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aurora_proto::frame::{Hello, PROTOCOL_VERSION, RejectCode};
use aurora_proto::{Frame, Role, VersionRef};
use aurora_transport::{
    Limits, NodeConfig, NodeHandle, NodeStatus, Security, read_frame, spawn_hub, write_frame,
};
use aurora_trust::tls::SEGMENT_ALPN;
use aurora_trust::{FleetCa, NodeTls};
use time::OffsetDateTime;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use util::{Chain, active_at, idle_actor, within};

const LIMIT: Duration = Duration::from_secs(60);
/// Short, so that the tests wait on timeouts briefly (loopback handshakes take
/// milliseconds), but with a wide margin for the connections a test holds in their
/// handshake to still be there when it opens the next ones on a loaded machine: if the
/// first batch timed out before the second came, a cap the test waits for would never
/// be reached.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

fn trust_role(role: Role) -> aurora_trust::Role {
    match role {
        Role::Hub => aurora_trust::Role::Trainer,
        Role::Relay => aurora_trust::Role::Relay,
        Role::Actor => aurora_trust::Role::Actor,
    }
}

/// A node's TLS material: a certificate of `ca` for `role` and `name`, valid from
/// `valid.0` to `valid.1` (default: a day from now), trusting `trusted`.
fn tls(
    ca: &FleetCa,
    trusted: &FleetCa,
    role: aurora_trust::Role,
    name: &str,
    valid: Option<(OffsetDateTime, OffsetDateTime)>,
) -> Arc<NodeTls> {
    let identity = aurora_trust::Identity::new(role, name, "eu-west").unwrap();
    let cert = match valid {
        Some((from, to)) => ca.issue_between(&identity, from, to).unwrap(),
        None => ca.issue(&identity, time::Duration::days(1)).unwrap(),
    };
    Arc::new(NodeTls::from_pem(trusted.cert_pem(), &cert.cert_pem, &cert.key_pem).unwrap())
}

/// A node of `ca`'s fleet with TLS and short limits.
fn config(ca: &FleetCa, role: Role, name: &str, upstreams: &[SocketAddr]) -> NodeConfig {
    let mut config = util::config(role, name, upstreams);
    config.security = Security::Tls(tls(ca, ca, trust_role(role), name, None));
    config.limits = Limits {
        handshake_timeout: HANDSHAKE_TIMEOUT,
        max_connections: 10,
        max_unauthenticated_per_address: 5,
        max_connections_per_peer: 3,
        frame_read_timeout: FRAME_READ_TIMEOUT,
        ..Limits::default()
    };
    config
}

/// Short, so that a test waits out a trickled frame briefly.
const FRAME_READ_TIMEOUT: Duration = Duration::from_secs(1);

/// A hub of `ca`'s fleet with an honest actor that has received version 1.
async fn hub_and_actor(ca: &FleetCa, chain: &Chain) -> (NodeHandle, NodeHandle) {
    let hub = spawn_hub(config(ca, Role::Hub, "hub", &[]), None)
        .await
        .unwrap();
    let address = hub.local_addr().unwrap();
    let actor = idle_actor(config(ca, Role::Actor, "1", &[address]), chain.weights(0)).await;
    chain.publish_live(&hub, 1).await;
    active_at(&actor, 1, "the honest actor at version 1").await;
    // A version may arrive over the first stream while the second is still in its
    // handshake; the tests count every connection in a handshake, so none of the
    // actor's may be.
    within(LIMIT, "the honest actor's streams", actor.all_streams_up())
        .await
        .unwrap();
    (hub, actor)
}

async fn refusals_reach(hub: &NodeHandle, what: &str, condition: impl FnMut(&NodeStatus) -> bool) {
    within(LIMIT, what, hub.wait_for(condition)).await.unwrap();
}

/// Dials `address` with `client` as a downstream does, and reads until the server
/// ends the connection: a refused client learns nothing but that.
async fn refused_client(client: &NodeTls, address: SocketAddr) {
    let connector = TlsConnector::from(
        client
            .client_config(SEGMENT_ALPN, &[aurora_trust::Role::Trainer])
            .unwrap(),
    );
    let tcp = TcpStream::connect(address).await.unwrap();
    // TLS 1.3 clients finish before the server has checked their certificate: the
    // refusal arrives as an alert on the first read.
    if let Ok(mut stream) = connector
        .connect(aurora_trust::tls::server_name(), tcp)
        .await
    {
        assert!(read_frame(&mut stream).await.is_err());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_refused_by_reason_while_an_honest_actor_receives_its_versions() {
    let ca = FleetCa::create("ours").unwrap();
    let chain = Chain::new(2, 11);
    let (hub, actor) = hub_and_actor(&ca, &chain).await;
    let address = hub.local_addr().unwrap();

    // A version 1 peer: a plaintext Hello on the TLS port.
    let mut plain = TcpStream::connect(address).await.unwrap();
    write_frame(&mut plain, &Frame::Hello(hello("1")))
        .await
        .unwrap();
    assert!(read_frame(&mut plain).await.is_err());
    refusals_reach(&hub, "a plaintext client refused", |s| {
        s.refusals.not_tls == 1
    })
    .await;

    // A certificate of another CA, by a client that knows ours.
    let theirs = FleetCa::create("theirs").unwrap();
    let foreign = tls(&theirs, &ca, aurora_trust::Role::Actor, "1", None);
    refused_client(&foreign, address).await;
    refusals_reach(&hub, "another CA's certificate refused", |s| {
        s.refusals.unknown_ca == 1
    })
    .await;

    // An expired certificate of our CA.
    let now = OffsetDateTime::now_utc();
    let past = Some((now - time::Duration::days(2), now - time::Duration::days(1)));
    let expired = tls(&ca, &ca, aurora_trust::Role::Actor, "1", past);
    refused_client(&expired, address).await;
    refusals_reach(&hub, "an expired certificate refused", |s| {
        s.refusals.expired == 1
    })
    .await;

    // A fleet member whose Hello names another peer: refused by the protocol.
    let a9 = tls(&ca, &ca, aurora_trust::Role::Actor, "9", None);
    let connector = TlsConnector::from(
        a9.client_config(SEGMENT_ALPN, &[aurora_trust::Role::Trainer])
            .unwrap(),
    );
    let tcp = TcpStream::connect(address).await.unwrap();
    let mut impostor = connector
        .connect(aurora_trust::tls::server_name(), tcp)
        .await
        .unwrap();
    write_frame(&mut impostor, &Frame::Hello(hello("1")))
        .await
        .unwrap();
    match read_frame(&mut impostor).await.unwrap() {
        Frame::Reject { code, reason } => {
            assert_eq!(code, RejectCode::Auth);
            assert!(
                reason.contains("names actor '1' but the connection's certificate is actor '9'"),
                "{reason}"
            );
        }
        other => panic!("expected a Reject, got {other:?}"),
    }

    // Meanwhile the honest actor takes version 2; nobody else ever subscribed.
    chain.publish_live(&hub, 2).await;
    let status = active_at(&actor, 2, "the honest actor at version 2").await;
    assert_eq!(status.failed_activations, 0);
    let hub_status = hub.status();
    assert_eq!(hub_status.sender.as_ref().unwrap().refused_auth, 1);
    assert_eq!(hub_status.subscribers, 1);
    assert_eq!(hub_status.refusals.total(), 3, "{:?}", hub_status.refusals);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_downstream_refuses_an_upstream_of_the_wrong_role_before_sending_anything() {
    let ca = FleetCa::create("ours").unwrap();
    let chain = Chain::new(1, 12);
    // A fleet actor's certificate serving on a port an actor was told is its relay.
    let impostor = tls(&ca, &ca, aurora_trust::Role::Actor, "7", None);
    let acceptor = TlsAcceptor::from(impostor.server_config(SEGMENT_ALPN).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (received_tx, mut received) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            if let Ok(mut stream) = acceptor.accept(tcp).await {
                // Whatever the downstream sends after the handshake: nothing, it must be.
                let _ = received_tx.send(read_frame(&mut stream).await.ok());
            }
        }
    });
    let actor = idle_actor(config(&ca, Role::Actor, "1", &[address]), chain.weights(0)).await;
    let status = within(
        LIMIT,
        "the wrong role refused",
        actor.wait_for(|s| s.refusals.wrong_role >= 2),
    )
    .await
    .unwrap();
    assert!(!status.connected);
    assert_eq!(status.active.map(|a| a.version), Some(0), "nothing staged");
    assert!(status.completed.is_empty());
    assert!(received.try_recv().is_err(), "the actor sent no frame");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_loris_and_a_flood_are_capped_and_timed_out_while_versions_flow() {
    let ca = FleetCa::create("ours").unwrap();
    let chain = Chain::new(2, 13);
    let (hub, actor) = hub_and_actor(&ca, &chain).await;
    let address = hub.local_addr().unwrap();
    assert_eq!(hub.status().refusals.total(), 0);

    // From 127.0.0.1: four silent connections and one half a ClientHello, up to the
    // cap of five in their handshake from one address; two more are refused at once.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(address).await.unwrap());
    }
    let mut partial = TcpStream::connect(address).await.unwrap();
    partial.write_all(&[0x16, 0x03, 0x01, 0x02]).await.unwrap();
    held.push(partial);
    for _ in 0..2 {
        held.push(TcpStream::connect(address).await.unwrap());
    }
    refusals_reach(&hub, "the address cap", |s| s.refusals.address_cap == 2).await;

    // From 127.0.0.2: the honest actor's two streams and five strangers leave room for
    // three more under the total cap of ten.
    for _ in 0..5 {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        held.push(socket.connect(address).await.unwrap());
    }
    refusals_reach(&hub, "the total cap", |s| s.refusals.total_cap == 2).await;

    // Versions flow meanwhile.
    chain.publish_live(&hub, 2).await;
    active_at(&actor, 2, "the honest actor at version 2").await;

    // Every stranger admitted is cut off at the handshake timeout.
    refusals_reach(&hub, "the handshake timeouts", |s| {
        s.refusals.handshake_timeout == 8
    })
    .await;
    let status = hub.status();
    assert_eq!(status.subscribers, 1);
    assert_eq!(
        status.refusals.total(),
        12,
        "two over the address cap, two over the total, eight timed out: {:?}",
        status.refusals
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_s_connections_are_capped_while_versions_flow() {
    let ca = FleetCa::create("ours").unwrap();
    let chain = Chain::new(2, 14);
    let (hub, actor) = hub_and_actor(&ca, &chain).await;
    let address = hub.local_addr().unwrap();

    // A fleet member opens connections and completes their handshakes: three are
    // admitted (the cap of one peer), the fourth is refused once its certificate has
    // named the peer.
    let a9 = tls(&ca, &ca, aurora_trust::Role::Actor, "9", None);
    let connector = TlsConnector::from(
        a9.client_config(SEGMENT_ALPN, &[aurora_trust::Role::Trainer])
            .unwrap(),
    );
    let mut held = Vec::new();
    for _ in 0..4 {
        let tcp = TcpStream::connect(address).await.unwrap();
        held.push(
            connector
                .connect(aurora_trust::tls::server_name(), tcp)
                .await
                .unwrap(),
        );
    }
    refusals_reach(&hub, "one peer's cap", |s| s.refusals.peer_cap == 1).await;

    // The honest actor, another peer, is served meanwhile.
    chain.publish_live(&hub, 2).await;
    active_at(&actor, 2, "the honest actor at version 2").await;
    let status = hub.status();
    assert_eq!(status.subscribers, 1);
    assert_eq!(status.refusals.total(), 1, "{:?}", status.refusals);
    drop(held);
}

/// What an authenticated peer may send once its Hello is taken (docs/security.md §4): a
/// downstream's frames only, each no larger than the largest Want, each whole within its
/// deadline. The attack that grew a hub by 240 MiB, four Segment frames of 60 MiB each
/// announced and never sent, is refused at each frame's five-byte prefix; a Want
/// trickled a byte at a time is cut off at its deadline. Meanwhile the honest actor of
/// the same hub takes its versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authenticated_subscriber_s_frames_are_bounded_in_kind_size_and_time() {
    let ca = FleetCa::create("ours").unwrap();
    let chain = Chain::new(2, 15);
    let (hub, actor) = hub_and_actor(&ca, &chain).await;
    let address = hub.local_addr().unwrap();
    let a9 = tls(&ca, &ca, aurora_trust::Role::Actor, "9", None);
    let connector = TlsConnector::from(
        a9.client_config(SEGMENT_ALPN, &[aurora_trust::Role::Trainer])
            .unwrap(),
    );
    // Each connection a session of its own, welcomed.
    let subscribed = |session: u64| {
        let connector = connector.clone();
        async move {
            let tcp = TcpStream::connect(address).await.unwrap();
            let mut stream = connector
                .connect(aurora_trust::tls::server_name(), tcp)
                .await
                .unwrap();
            let hello = Hello {
                session,
                ..hello("9")
            };
            write_frame(&mut stream, &Frame::Hello(hello))
                .await
                .unwrap();
            let answer = read_frame(&mut stream).await.unwrap();
            assert!(matches!(answer, Frame::Welcome(_)), "{answer:?}");
            stream
        }
    };
    // Segment frames announcing 60 MiB each, their bodies never sent.
    let mut held = Vec::new();
    for session in 1..=3 {
        let mut stream = subscribed(session).await;
        let announced = (60u32 << 20).to_le_bytes();
        stream
            .write_all(&[announced[0], announced[1], announced[2], announced[3], 0x06])
            .await
            .unwrap();
        stream.flush().await.unwrap();
        held.push(stream);
    }
    refusals_reach(&hub, "the Segment frames refused", |s| {
        s.refusals.frame_kind == 3
    })
    .await;
    // A Want trickled a byte at a time, slower than its deadline allows.
    let mut trickling = subscribed(4).await;
    let mut want = Vec::new();
    Frame::Want {
        seq: 1,
        next_version: 1,
        snapshot: false,
        composed: false,
        live_streams: 1,
        epochs: vec![1],
        progress: Vec::new(),
    }
    .encode(&mut want);
    let trickle = tokio::spawn(async move {
        for byte in want {
            if trickling.write_all(&[byte]).await.is_err() || trickling.flush().await.is_err() {
                return;
            }
            tokio::time::sleep(FRAME_READ_TIMEOUT / 4).await;
        }
    });
    refusals_reach(&hub, "the trickled Want cut off", |s| {
        s.refusals.frame_timeout == 1
    })
    .await;
    trickle.abort();

    // The honest actor is served throughout.
    chain.publish_live(&hub, 2).await;
    let status = active_at(&actor, 2, "the honest actor at version 2").await;
    assert_eq!(status.failed_activations, 0);
    let status = hub.status();
    assert_eq!(status.refusals.frame_kind, 3, "{:?}", status.refusals);
    assert_eq!(status.refusals.frame_timeout, 1, "{:?}", status.refusals);
    drop(held);
}

fn hello(peer_id: &str) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        flags: 0,
        role: Role::Actor,
        peer_id: peer_id.into(),
        region: "eu-west".into(),
        token: Vec::new(),
        session: 99,
        stream: 0,
        streams: 1,
        epoch: 1,
        active: VersionRef::default(),
        staged: None,
        snapshot_floor: 0,
    }
}
