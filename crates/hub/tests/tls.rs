//! The control API over mutual TLS, attacked on real sockets: a plaintext client, a
//! certificate of another CA, an expired one, an actor acting as another, an observer
//! writing, calls replayed from an earlier registration, slow clients and a flood of
//! connections. Each is refused with one log line and counted in `/metrics`, nothing
//! changes in the control plane, and an honest actor is served meanwhile.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aurora_api::{ClaimResponse, RegisterResponse, WireLease};
use aurora_hub::{
    ConnectionLimit, HandshakeFailure, Limits, Refusal, RequestRule, Security, ServeConfig,
    Timeout, run,
};
use aurora_trust::tls::{CONTROL_ALPN, server_name};
use aurora_trust::{FleetCa, Identity, NodeTls, Role};
use common::{TestHub, error_message, submit_body};
use serde_json::json;
use time::OffsetDateTime;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// A fleet CA, and a hub serving over mutual TLS with a trainer's certificate.
struct Fleet {
    ca: FleetCa,
    hub: TestHub,
    address: SocketAddr,
    logs: Logs,
    _logging: tracing::subscriber::DefaultGuard,
}

impl Fleet {
    /// A hub with a step of `prompts` open, served with `limits`.
    async fn start(prompts: &[u64], limits: Limits) -> Fleet {
        let (logs, logging) = capture_logs();
        let ca = FleetCa::create("test").unwrap();
        let hub = TestHub::with_step(prompts);
        let trainer = node(&ca, Role::Trainer, "trainer");
        let config = ServeConfig {
            security: Security::mutual_tls(&trainer).unwrap(),
            limits,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(run(Arc::clone(&hub.hub), listener, config));
        Fleet {
            ca,
            hub,
            address,
            logs,
            _logging: logging,
        }
    }

    fn node(&self, role: Role, id: &str) -> NodeTls {
        node(&self.ca, role, id)
    }

    /// A TLS connection from 127.0.0.1 as `tls`.
    async fn connect(&self, tls: &NodeTls) -> Conn<TlsStream<TcpStream>> {
        self.connect_from(tls, [127, 0, 0, 1].into()).await
    }

    async fn connect_from(&self, tls: &NodeTls, source: IpAddr) -> Conn<TlsStream<TcpStream>> {
        let tcp = tcp_from(source, self.address).await;
        let connector =
            TlsConnector::from(tls.client_config(CONTROL_ALPN, &[Role::Trainer]).unwrap());
        Conn(connector.connect(server_name(), tcp).await.unwrap())
    }

    /// An honest actor `id`, registered: its connection and token.
    async fn honest_actor(&self, id: u64) -> (Conn<TlsStream<TcpStream>>, String) {
        let mut conn = self.connect(&self.node(Role::Actor, &id.to_string())).await;
        let token = conn.register(id).await;
        (conn, token)
    }

    /// The count of `refusal`.
    fn refused(&self, refusal: Refusal) -> u64 {
        self.hub.hub.refusals().count(refusal)
    }

    /// Checks that `refusal` was counted `count` times, each with one log line holding
    /// `line`, and that `/metrics` shows it.
    async fn assert_refused(&self, refusal: Refusal, count: u64, line: &str) {
        assert_eq!(self.refused(refusal), count, "{refusal:?}");
        let (metric, key, label) = refusal.metric();
        let logged = self.logs.lines_with(&format!("label=\"{label}\""));
        assert_eq!(logged.len() as u64, count, "{refusal:?}: {logged:#?}");
        assert!(
            logged.iter().all(|logged| logged.contains(line)),
            "{refusal:?}: expected {line:?} in {logged:#?}"
        );
        let mut observer = self.connect(&self.node(Role::Observer, "dashboard")).await;
        let (status, metrics) = observer.request("GET", "/metrics", None, "").await;
        assert_eq!(status, 200, "{metrics}");
        let sample = format!("\n{metric}{{{key}=\"{label}\"}} {count}\n");
        assert!(metrics.contains(&sample), "{sample:?} not in {metrics}");
    }
}

/// Timeouts short enough for a test to wait them out, otherwise the defaults.
fn short_limits() -> Limits {
    Limits {
        handshake_timeout: Duration::from_millis(300),
        header_read_timeout: Duration::from_millis(300),
        request_timeout: Duration::from_millis(600),
        write_timeout: Duration::from_millis(300),
        ..Limits::default()
    }
}

/// A certificate of node `id` in region eu-west, where the actors register.
fn node(ca: &FleetCa, role: Role, id: &str) -> NodeTls {
    let identity = Identity::new(role, id, "eu-west").unwrap();
    let cert = ca.issue(&identity, time::Duration::days(1)).unwrap();
    NodeTls::from_pem(ca.cert_pem(), &cert.cert_pem, &cert.key_pem).unwrap()
}

async fn tcp_from(source: IpAddr, address: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(source, 0)).unwrap();
    socket.connect(address).await.unwrap()
}

/// A keep-alive HTTP/1.1 connection.
struct Conn<S>(S);

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    /// One request; its status and body.
    async fn request(
        &mut self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: &str,
    ) -> (u16, String) {
        let authorization = token.map_or(String::new(), |token| {
            format!("Authorization: Bearer {token}\r\n")
        });
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: hub\r\n{authorization}\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.0.write_all(request.as_bytes()).await.unwrap();
        self.response().await
    }

    async fn response(&mut self) -> (u16, String) {
        let mut received = Vec::new();
        let head_end = loop {
            if let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            let mut buffer = [0; 4096];
            let read = self.0.read(&mut buffer).await.unwrap();
            assert!(read > 0, "closed before a response: {received:?}");
            received.extend_from_slice(&buffer[..read]);
        };
        let head = String::from_utf8(received[..head_end].to_vec()).unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        let length: usize = head
            .lines()
            .find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().unwrap())
            })
            .unwrap_or(0);
        let mut body = received[head_end..].to_vec();
        while body.len() < length {
            let mut buffer = [0; 4096];
            let read = self.0.read(&mut buffer).await.unwrap();
            assert!(read > 0, "closed within a response");
            body.extend_from_slice(&buffer[..read]);
        }
        (status, String::from_utf8(body).unwrap())
    }

    /// Registers as `actor` on v1 in eu-west; returns the actor's token.
    async fn register(&mut self, actor: u64) -> String {
        let body = format!(r#"{{"actor":{actor},"region":"eu-west","active":1}}"#);
        let (status, body) = self.request("POST", "/v1/register", None, &body).await;
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<RegisterResponse>(&body)
            .unwrap()
            .token
    }

    async fn claim(&mut self, actor: u64, token: &str) -> Vec<WireLease> {
        let body = format!(r#"{{"actor":{actor}}}"#);
        let (status, body) = self.request("POST", "/v1/claim", Some(token), &body).await;
        assert_eq!(status, 200, "{body}");
        match serde_json::from_str(&body).unwrap() {
            ClaimResponse::Work { leases, .. } => leases,
            other => panic!("expected work, got {other:?}"),
        }
    }

    async fn heartbeat(&mut self, actor: u64, token: &str) -> u16 {
        let body = format!(r#"{{"actor":{actor}}}"#);
        self.request("POST", "/v1/heartbeat", Some(token), &body)
            .await
            .0
    }

    /// Reads until the server closes the connection; what it sent is returned (a TLS
    /// alert, say), or the error that ended the read.
    async fn closed(mut self) -> String {
        let mut received = Vec::new();
        match self.0.read_to_end(&mut received).await {
            Ok(_) => String::from_utf8_lossy(&received).into_owned(),
            Err(error) => error.to_string(),
        }
    }
}

/// Log lines, captured from the test's thread (its runtime is single-threaded, so the
/// hub's tasks log there too).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn lines_with(&self, text: &str) -> Vec<String> {
        let bytes = self.0.lock().unwrap();
        String::from_utf8_lossy(&bytes)
            .lines()
            .filter(|line| line.contains(text))
            .map(str::to_owned)
            .collect()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture_logs() -> (Logs, tracing::subscriber::DefaultGuard) {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    (logs, tracing::subscriber::set_default(subscriber))
}

#[tokio::test]
async fn an_actor_works_and_an_observer_reads_over_mutual_tls() {
    let fleet = Fleet::start(&[10], Limits::default()).await;
    let (mut actor, token) = fleet.honest_actor(1).await;
    let leases = actor.claim(1, &token).await;
    let payload = json!({ "completion": "42" });
    let submit = submit_body(1, &[(&leases[0], payload)]);
    let (status, body) = actor
        .request("POST", "/v1/submit", Some(&token), &submit)
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, r#"{"outcomes":[{"status":"accepted","prompt":10}]}"#);

    for (role, id) in [
        (Role::Observer, "dashboard"),
        (Role::Trainer, "t"),
        (Role::Relay, "r"),
    ] {
        let mut reader = fleet.connect(&fleet.node(role, id)).await;
        let (status, body) = reader.request("GET", "/v1/status", None, "").await;
        assert_eq!(status, 200, "{role}: {body}");
        assert!(body.contains(r#""accepted":1"#), "{body}");
    }
    // The status names every member: no actor reads it.
    let (status, body) = actor.request("GET", "/v1/status", None, "").await;
    assert_eq!(status, 403);
    assert_eq!(
        error_message(&body),
        "actor 1 (eu-west) may not read the status and metrics: only observers, trainers and \
         relays may"
    );
}

#[tokio::test]
async fn a_plaintext_client_on_the_https_port_is_refused() {
    let fleet = Fleet::start(&[10], Limits::default()).await;
    let (mut honest, token) = fleet.honest_actor(1).await;
    let mut plaintext = TcpStream::connect(fleet.address).await.unwrap();
    plaintext
        .write_all(b"POST /v1/register HTTP/1.1\r\nHost: hub\r\nContent-Length: 2\r\n\r\n{}")
        .await
        .unwrap();
    let answer = Conn(plaintext).closed().await;
    assert!(!answer.contains("HTTP/1.1"), "{answer}");
    fleet
        .assert_refused(
            Refusal::Handshake(HandshakeFailure::NotTls),
            1,
            "not TLS (a plaintext HTTP client?",
        )
        .await;
    assert_eq!(honest.heartbeat(1, &token).await, 200);
    assert!(fleet.hub.hub.inspect(|core| core.members().len() == 1));
}

#[tokio::test]
async fn certificates_of_another_ca_or_expired_are_refused_at_the_handshake() {
    let fleet = Fleet::start(&[10], Limits::default()).await;
    let (mut honest, token) = fleet.honest_actor(1).await;

    let other_ca = FleetCa::create("other").unwrap();
    // It trusts the hub's CA, but its own certificate is the other CA's.
    let issued = other_ca
        .issue(
            &Identity::new(Role::Actor, "2", "us").unwrap(),
            time::Duration::days(1),
        )
        .unwrap();
    let foreign =
        NodeTls::from_pem(fleet.ca.cert_pem(), &issued.cert_pem, &issued.key_pem).unwrap();
    let now = OffsetDateTime::now_utc();
    let identity = Identity::new(Role::Actor, "3", "us").unwrap();
    let expired = fleet
        .ca
        .issue_between(
            &identity,
            now - time::Duration::days(2),
            now - time::Duration::days(1),
        )
        .unwrap();
    let expired =
        NodeTls::from_pem(fleet.ca.cert_pem(), &expired.cert_pem, &expired.key_pem).unwrap();
    for (client, actor) in [(foreign, 2), (expired, 3)] {
        // TLS 1.3: the client finishes before the server checks its certificate, so
        // the refusal shows on the first read.
        let mut conn = fleet.connect(&client).await;
        let body = format!(r#"{{"actor":{actor},"region":"eu-west","active":1}}"#);
        let request = format!(
            "POST /v1/register HTTP/1.1\r\nHost: hub\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        // The server may have closed already.
        let _ = conn.0.write_all(request.as_bytes()).await;
        let answer = conn.closed().await;
        assert!(!answer.contains("HTTP/1.1"), "{answer}");
    }
    fleet
        .assert_refused(
            Refusal::Handshake(HandshakeFailure::UnknownCa),
            1,
            "TLS handshake failed: invalid peer certificate: UnknownIssuer",
        )
        .await;
    fleet
        .assert_refused(
            Refusal::Handshake(HandshakeFailure::Expired),
            1,
            "TLS handshake failed: invalid peer certificate: certificate expired",
        )
        .await;
    assert_eq!(honest.heartbeat(1, &token).await, 200);
    assert!(fleet.hub.hub.inspect(|core| core.members().len() == 1));
}

#[tokio::test]
async fn an_actor_can_neither_register_nor_act_as_another() {
    let fleet = Fleet::start(&[10, 11], Limits::default()).await;
    let (mut honest, token) = fleet.honest_actor(1).await;
    let (mut impostor, own_token) = fleet.honest_actor(2).await;

    let (status, body) = impostor
        .request(
            "POST",
            "/v1/register",
            None,
            r#"{"actor":1,"region":"eu-west","active":1}"#,
        )
        .await;
    assert_eq!(status, 403);
    let message = "the certificate is actor 2's; it cannot act for actor 1";
    assert_eq!(error_message(&body), message);
    // Its own token, another actor's id in the body.
    let (status, body) = impostor
        .request("POST", "/v1/claim", Some(&own_token), r#"{"actor":1}"#)
        .await;
    assert_eq!(status, 403);
    assert_eq!(error_message(&body), message);
    // Another actor's token (stolen, say) does not go with its certificate.
    let (status, body) = impostor
        .request("POST", "/v1/claim", Some(&token), r#"{"actor":1}"#)
        .await;
    assert_eq!(status, 403);
    assert_eq!(
        error_message(&body),
        "the certificate is actor 2's; it cannot act for actor 1"
    );
    fleet
        .assert_refused(Refusal::Request(RequestRule::OtherActor), 3, message)
        .await;
    // Its own id in another region than its certificate's: the scheduler and the
    // relays place an actor by region, which only the CA says.
    let (status, body) = impostor
        .request(
            "POST",
            "/v1/register",
            None,
            r#"{"actor":2,"region":"us-east","active":1}"#,
        )
        .await;
    assert_eq!(status, 403);
    let message =
        "the certificate puts actor 2 in region \"eu-west\"; it cannot register in \"us-east\"";
    assert_eq!(error_message(&body), message);
    fleet
        .assert_refused(Refusal::Request(RequestRule::OtherRegion), 1, message)
        .await;
    // Actor 1's registration and token are as they were.
    assert_eq!(honest.claim(1, &token).await.len(), 1);
    assert!(fleet.hub.hub.inspect(|core| core.members().len() == 2));
}

#[tokio::test]
async fn an_observer_a_relay_or_the_trainer_cannot_write() {
    let fleet = Fleet::start(&[10], Limits::default()).await;
    let (mut honest, token) = fleet.honest_actor(1).await;
    let mut count = 0;
    for (role, id) in [
        (Role::Observer, "1"),
        (Role::Relay, "1"),
        (Role::Trainer, "1"),
    ] {
        let mut conn = fleet.connect(&fleet.node(role, id)).await;
        for (path, token) in [("/v1/register", None), ("/v1/claim", Some(token.as_str()))] {
            let body = r#"{"actor":1,"region":"eu-west","active":1}"#;
            let (status, body) = conn.request("POST", path, token, body).await;
            assert_eq!(status, 403, "{role} {path}: {body}");
            assert!(
                error_message(&body).starts_with(&format!("{role} 1 (eu-west) may not ")),
                "{body}"
            );
            count += 1;
        }
    }
    fleet
        .assert_refused(
            Refusal::Request(RequestRule::Role),
            count,
            "only actors may",
        )
        .await;
    assert_eq!(honest.claim(1, &token).await.len(), 1);
    // What a joiner pins is for the nodes that take versions: actors and relays. The
    // hub of this test serves no run yet, so they are told to come back (503); an
    // observer is refused outright.
    for (role, status) in [
        (Role::Actor, 503),
        (Role::Relay, 503),
        (Role::Observer, 403),
    ] {
        let mut conn = fleet.connect(&fleet.node(role, "5")).await;
        let (got, body) = conn.request("GET", "/v1/join", None, "").await;
        assert_eq!(got, status, "{role}: {body}");
    }
}

#[tokio::test]
async fn calls_replayed_from_an_earlier_registration_are_refused() {
    let fleet = Fleet::start(&[10, 11], Limits::default()).await;
    let (mut old, old_token) = fleet.honest_actor(1).await;
    let leases = old.claim(1, &old_token).await;
    let recorded_submit = submit_body(1, &[(&leases[0], json!("old"))]);

    // A new process of actor 1 registers: the old one's calls must not count.
    let (mut new, new_token) = fleet.honest_actor(1).await;
    let replays = [
        ("/v1/claim", r#"{"actor":1}"#.to_owned()),
        ("/v1/heartbeat", r#"{"actor":1}"#.to_owned()),
        ("/v1/submit", recorded_submit.clone()),
    ];
    for (path, body) in &replays {
        let (status, answer) = old.request("POST", path, Some(&old_token), body).await;
        assert_eq!(status, 401, "{path}: {answer}");
        assert_eq!(
            error_message(&answer),
            "wrong or outdated token for actor 1: register again to get a new one"
        );
    }
    fleet
        .assert_refused(
            Refusal::Request(RequestRule::OutdatedToken),
            3,
            "wrong or outdated token for actor 1",
        )
        .await;
    assert_eq!(fleet.hub.hub.inspect(|core| core.stats().accepted), 0);
    // The new process is served: it claims and hands in work.
    let leases = new.claim(1, &new_token).await;
    let submit = submit_body(1, &[(&leases[0], json!("new"))]);
    let (status, body) = new
        .request("POST", "/v1/submit", Some(&new_token), &submit)
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("accepted"), "{body}");
}

#[tokio::test]
async fn slow_clients_are_cut_off_by_the_timeouts() {
    let fleet = Fleet::start(&[10], short_limits()).await;
    // The honest actor's idle connection would be closed by the header timeout too, so
    // it calls on a new connection each time.
    let (_, token) = fleet.honest_actor(1).await;
    let honest = fleet.node(Role::Actor, "1");

    // Connects and sends nothing.
    let silent = TcpStream::connect(fleet.address).await.unwrap();
    // Half a ClientHello: a handshake record header announcing more than follows.
    let mut partial = TcpStream::connect(fleet.address).await.unwrap();
    partial
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .await
        .unwrap();
    assert_eq!(fleet.connect(&honest).await.heartbeat(1, &token).await, 200);
    Conn(silent).closed().await;
    Conn(partial).closed().await;
    fleet
        .assert_refused(
            Refusal::Timeout(Timeout::Handshake),
            2,
            "no TLS handshake within 300ms",
        )
        .await;

    // A verified actor whose request head never ends.
    let mut slow = fleet.connect(&fleet.node(Role::Actor, "2")).await;
    slow.0
        .write_all(b"POST /v1/claim HTTP/1.1\r\nHost: hub\r\n")
        .await
        .unwrap();
    assert_eq!(fleet.connect(&honest).await.heartbeat(1, &token).await, 200);
    slow.closed().await;
    fleet
        .assert_refused(
            Refusal::Timeout(Timeout::Header),
            1,
            "no complete request head within 300ms",
        )
        .await;

    // A body that never ends: answered 408 when the request's time is up.
    let (mut stalled, stalled_token) = fleet.honest_actor(3).await;
    let head = format!(
        "POST /v1/claim HTTP/1.1\r\nHost: hub\r\nAuthorization: Bearer {stalled_token}\r\nContent-Type: application/json\r\n\
         Content-Length: 100\r\n\r\n{{\"actor\""
    );
    stalled.0.write_all(head.as_bytes()).await.unwrap();
    let (status, body) = stalled.response().await;
    assert_eq!(status, 408, "{body}");
    fleet
        .assert_refused(
            Refusal::Timeout(Timeout::Request),
            1,
            "request not handled within 600ms; retry",
        )
        .await;
    assert_eq!(fleet.connect(&honest).await.heartbeat(1, &token).await, 200);
}

#[tokio::test]
async fn a_client_that_never_reads_its_answers_is_cut_off() {
    let fleet = Fleet::start(&[10], short_limits()).await;
    // An idle connection would be closed by the header timeout, so the honest actor calls
    // on a new one.
    let (_, token) = fleet.honest_actor(1).await;
    let honest = fleet.node(Role::Actor, "1");

    // A verified observer with a small receive window asks for the metrics again and
    // again and reads none of the answers.
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let tcp = socket.connect(fleet.address).await.unwrap();
    let hoarder = fleet.node(Role::Observer, "hoarder");
    let connector = TlsConnector::from(
        hoarder
            .client_config(CONTROL_ALPN, &[Role::Trainer])
            .unwrap(),
    );
    let mut hoarder = connector.connect(server_name(), tcp).await.unwrap();
    // Its requests are taken as long as the hub writes answers; once those fill the
    // buffers on the way, the hub stops reading, and its next write fails only when
    // the hub has ended the connection.
    let request = b"GET /metrics HTTP/1.1\r\nHost: hub\r\n\r\n";
    while hoarder.write_all(request).await.is_ok() {}
    fleet
        .assert_refused(
            Refusal::Timeout(Timeout::Write),
            1,
            "took none of its response within 300ms",
        )
        .await;
    assert_eq!(fleet.connect(&honest).await.heartbeat(1, &token).await, 200);
}

#[tokio::test]
async fn a_flood_of_connections_beyond_the_caps_is_refused() {
    let limits = Limits {
        max_connections: 9,
        max_connections_per_address: 4,
        ..Limits::default()
    };
    let fleet = Fleet::start(&[10], limits).await;
    // Connected before the flood, from 127.0.0.1.
    let (mut honest, token) = fleet.honest_actor(1).await;
    let mut observer = fleet
        .connect(&fleet.node(Role::Observer, "dashboard"))
        .await;

    // Four connections from 127.0.0.2 are admitted, pending their handshake; the fifth
    // is over the address's cap.
    let mut flood = Vec::new();
    for _ in 0..4 {
        flood.push(tcp_from([127, 0, 0, 2].into(), fleet.address).await);
    }
    Conn(tcp_from([127, 0, 0, 2].into(), fleet.address).await)
        .closed()
        .await;
    // Three more from 127.0.0.3 reach the total (2 + 4 + 3); the next is over it.
    for _ in 0..3 {
        flood.push(tcp_from([127, 0, 0, 3].into(), fleet.address).await);
    }
    Conn(tcp_from([127, 0, 0, 4].into(), fleet.address).await)
        .closed()
        .await;
    // The honest actor's connection is served all along.
    assert_eq!(honest.heartbeat(1, &token).await, 200);
    let (status, metrics) = observer.request("GET", "/metrics", None, "").await;
    assert_eq!(status, 200);
    for (limit, count) in [("per_address", 1), ("total", 1)] {
        let sample = format!("aurora_connections_refused_total{{limit=\"{limit}\"}} {count}\n");
        assert!(metrics.contains(&sample), "{sample} not in {metrics}");
    }
    assert_eq!(
        fleet
            .logs
            .lines_with("connections from 127.0.0.2 are open already")
            .len(),
        1
    );
    assert_eq!(
        fleet
            .logs
            .lines_with("9 connections are open already")
            .len(),
        1
    );
}

#[tokio::test]
async fn an_identity_is_capped_in_connections_and_in_requests_in_progress() {
    let limits = Limits {
        max_connections_per_identity: 2,
        max_requests_per_peer: 1,
        request_timeout: Duration::from_secs(60),
        ..Limits::default()
    };
    let fleet = Fleet::start(&[10], limits).await;
    let (mut honest, token) = fleet.honest_actor(1).await;

    // Actor 2 holds at most two connections.
    let actor2 = fleet.node(Role::Actor, "2");
    let mut first = fleet.connect(&actor2).await;
    let mut second = fleet.connect(&actor2).await;
    fleet.connect(&actor2).await.closed().await;
    assert_eq!(honest.heartbeat(1, &token).await, 200);

    // One request at a time: while one waits for its body, the next is refused at once.
    let token2 = first.register(2).await;
    let head = format!(
        "POST /v1/claim HTTP/1.1\r\nHost: hub\r\nAuthorization: Bearer {token2}\r\nContent-Type: application/json\r\n\
         Content-Length: 11\r\n\r\n{{\"actor\""
    );
    first.0.write_all(head.as_bytes()).await.unwrap();
    first.0.flush().await.unwrap();
    // The hub has read that head once it answers a request sent after it: on this
    // test's single runtime thread, the readable connections are served in turn.
    assert_eq!(honest.heartbeat(1, &token).await, 200);
    let (status, body) = second
        .request("POST", "/v1/heartbeat", Some(&token2), r#"{"actor":2}"#)
        .await;
    assert_eq!(status, 429, "{body}");
    first.0.write_all(b":2}").await.unwrap();
    let (status, body) = first.response().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(second.heartbeat(2, &token2).await, 200);

    fleet
        .assert_refused(
            Refusal::Connection(ConnectionLimit::PerIdentity),
            1,
            "2 connections of this identity are open already",
        )
        .await;
    fleet
        .assert_refused(
            Refusal::Request(RequestRule::PeerConcurrency),
            1,
            "1 requests of this peer are in progress already",
        )
        .await;
    assert_eq!(honest.heartbeat(1, &token).await, 200);
}
