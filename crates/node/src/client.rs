//! A JSON client of the control plane's HTTP API (docs/control-api.md) over hyper's
//! pooled client: an actor makes a few small requests per batch to one address.
//!
//! Over mutual TLS ([`ControlSecurity::MutualTls`]) it presents the node's certificate
//! and accepts only a server whose certificate the fleet CA issued to a trainer,
//! checked before a byte of a request is sent; such a refusal is final, never retried.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use aurora_trust::tls::{CONTROL_ALPN, explain, server_name};
use aurora_trust::{NodeTls, Role, TrustError};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Uri;
use hyper_util::client::legacy::Client as Pool;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::NodeError;

/// Longest wait for one answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a call is retried while the control plane cannot be reached or answers
/// that it is unavailable: a trainer node restarting after a crash comes back within
/// this, so its actors wait for it rather than give up.
const OUTAGE_PATIENCE: Duration = Duration::from_secs(120);
/// The bound of the pause after a first failed try; it doubles with each one after.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// The longest pause between two tries.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// Answers larger than this are refused (the hub's largest is the status view).
const MAX_ANSWER_BYTES: usize = 4 << 20;
/// How long an idle pooled connection is kept: less than the hub's header read timeout
/// (10 s), so the client closes it first rather than reuse one the hub is closing, and
/// the hub does not count it as a slow client.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// How a client reaches the control plane and proves who it is.
#[derive(Clone)]
pub enum ControlSecurity {
    /// HTTPS with mutual TLS: the node's certificate proves its identity, and only a
    /// trainer's certificate is accepted as the control plane's.
    MutualTls(Arc<rustls::ClientConfig>),
    /// Plain HTTP with the fleet token: anyone on the path reads it and the actor's
    /// token, and may replay requests. For loopback and tests only.
    InsecurePlaintext { fleet_token: String },
}

impl ControlSecurity {
    /// Mutual TLS as the node `tls` is.
    pub fn mutual_tls(tls: &NodeTls) -> Result<ControlSecurity, TrustError> {
        Ok(ControlSecurity::MutualTls(
            tls.client_config(CONTROL_ALPN, &[Role::Trainer])?,
        ))
    }
}

impl std::fmt::Debug for ControlSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.write_str(match self {
            ControlSecurity::MutualTls(_) => "MutualTls",
            ControlSecurity::InsecurePlaintext { .. } => "InsecurePlaintext",
        })
    }
}

#[derive(Clone)]
pub struct ControlClient {
    pool: Pool<Connector, Full<Bytes>>,
    base: String,
    /// The bearer token sent: the fleet token over plaintext, then the actor's token.
    authorization: Option<String>,
}

impl ControlClient {
    pub fn new(address: SocketAddr, security: &ControlSecurity) -> ControlClient {
        let (scheme, tls, authorization) = match security {
            ControlSecurity::MutualTls(config) => {
                ("https", Some(TlsConnector::from(Arc::clone(config))), None)
            }
            ControlSecurity::InsecurePlaintext { fleet_token } => {
                tracing::warn!(
                    %address,
                    "calling the control plane over INSECURE PLAINTEXT HTTP: the tokens cross \
                     the network in clear"
                );
                ("http", None, Some(format!("Bearer {fleet_token}")))
            }
        };
        ControlClient {
            pool: Pool::builder(TokioExecutor::new())
                .pool_idle_timeout(POOL_IDLE_TIMEOUT)
                .build(Connector { tls }),
            base: format!("{scheme}://{address}"),
            authorization,
        }
    }

    /// The same client (and connections) presenting an actor's token, which
    /// `/v1/register` returned: it binds every later call to that registration.
    pub fn with_actor_token(&self, token: &str) -> ControlClient {
        ControlClient {
            authorization: Some(format!("Bearer {token}")),
            ..self.clone()
        }
    }

    /// POSTs `body` as JSON to `path` and parses the JSON answer; a non-2xx status is
    /// an error carrying the hub's message. While the control plane cannot be reached
    /// or answers 503 (a trainer node restarting), the call is tried again, backing off,
    /// for up to [`OUTAGE_PATIENCE`]: every call is safe to repeat (the control plane
    /// judges a repeated submission as a duplicate).
    pub async fn post<B: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<R, NodeError> {
        let body = serde_json::to_vec(body).map_err(|e| NodeError::Api {
            path: format!("POST {path}"),
            reason: e.to_string(),
        })?;
        self.call(hyper::Method::POST, path, Some(Bytes::from(body)))
            .await
    }

    /// GETs `path` and parses the JSON answer, as [`ControlClient::post`] does.
    pub async fn get<R: DeserializeOwned>(&self, path: &str) -> Result<R, NodeError> {
        self.call(hyper::Method::GET, path, None).await
    }

    async fn call<R: DeserializeOwned>(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<R, NodeError> {
        let fail = |reason: String| NodeError::Api {
            path: format!("{method} {path}"),
            reason,
        };
        let give_up = Instant::now() + OUTAGE_PATIENCE;
        let mut backoff = crate::backoff(FIRST_BACKOFF, MAX_BACKOFF);
        loop {
            match self.try_call(&method, path, body.clone()).await {
                Err(Attempt::Unavailable(reason)) if Instant::now() < give_up => {
                    let wait = backoff.failed();
                    tracing::warn!(
                        path,
                        reason,
                        ?wait,
                        "the control plane is unavailable; trying again"
                    );
                    tokio::time::sleep(wait).await;
                }
                Err(Attempt::Unavailable(reason) | Attempt::Failed(reason)) => {
                    return Err(fail(reason));
                }
                Ok(answer) => {
                    return serde_json::from_slice(&answer)
                        .map_err(|e| fail(format!("parsing the answer: {e}")));
                }
            }
        }
    }

    async fn try_call(
        &self,
        method: &hyper::Method,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<Bytes, Attempt> {
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if body.is_some() {
            request = request.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        if let Some(authorization) = &self.authorization {
            request = request.header(hyper::header::AUTHORIZATION, authorization);
        }
        let request = request
            .body(Full::new(body.unwrap_or_default()))
            .map_err(|e| Attempt::Failed(e.to_string()))?;
        let response = tokio::time::timeout(REQUEST_TIMEOUT, self.pool.request(request))
            .await
            .map_err(|_| Attempt::Failed(format!("no answer within {REQUEST_TIMEOUT:?}")))?
            .map_err(|e| match tls_refusal(&e) {
                // The server is not the fleet's trainer, or refused our certificate:
                // trying again would not change who it is.
                Some(refusal) => Attempt::Failed(format!(
                    "the TLS handshake with the control plane failed: {}",
                    explain(refusal)
                )),
                // No answer at all: refused, reset, or a pooled connection to a process
                // that is gone. Every call is safe to repeat, so each is worth another try.
                None => {
                    use std::error::Error;
                    Attempt::Unavailable(
                        e.source()
                            .map_or(e.to_string(), |cause| format!("{e}: {cause}")),
                    )
                }
            })?;
        let status = response.status();
        let answer = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| Attempt::Failed(format!("reading the answer: {e}")))?
            .to_bytes();
        let reason = || format!("{status}: {}", String::from_utf8_lossy(&answer));
        match status {
            _ if status.is_success() => Ok(answer),
            hyper::StatusCode::SERVICE_UNAVAILABLE => Err(Attempt::Unavailable(reason())),
            _ => Err(Attempt::Failed(reason())),
        }
    }
}

/// Why one try of a call failed: worth trying again, or not.
enum Attempt {
    Unavailable(String),
    Failed(String),
}

/// The TLS error behind a failed request, if a handshake failed: rustls's error travels
/// inside an `io::Error` (whose `source` skips it) inside hyper's.
fn tls_refusal<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if let Some(tls) = error.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        let inner = error
            .downcast_ref::<io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        if inner.is_some() {
            return inner;
        }
        cause = error.source();
    }
    None
}

/// Connects to the control plane: TCP, then TLS when the client has a configuration.
#[derive(Clone)]
struct Connector {
    tls: Option<TlsConnector>,
}

impl tower::Service<Uri> for Connector {
    type Response = TokioIo<Stream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<Stream>>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = self.tls.clone();
        Box::pin(async move {
            let authority = uri.authority().ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("no address in {uri}"))
            })?;
            let tcp = TcpStream::connect(authority.as_str()).await?;
            tcp.set_nodelay(true)?;
            let stream = match tls {
                // Servers are recognised by the role in their certificate, not by a
                // host name (see `aurora_trust::tls`).
                Some(tls) => Stream::Tls(Box::new(tls.connect(server_name(), tcp).await?)),
                None => Stream::Plain(tcp),
            };
            Ok(TokioIo::new(stream))
        })
    }
}

/// A connection to the control plane.
enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Stream::Tls(stream) => Pin::new(stream).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Stream::Tls(stream) => Pin::new(stream).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Stream::Tls(stream) => Pin::new(stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Stream::Tls(stream) => Pin::new(stream).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Serves each of `answers` on a connection of its own (closed after it) at
    /// `address`, once `down_for` has passed: a control plane that restarts.
    async fn restarting_server(
        address: SocketAddr,
        down_for: Duration,
        answers: Vec<&'static str>,
    ) {
        tokio::time::sleep(down_for).await;
        let listener = tokio::net::TcpListener::bind(address).await.unwrap();
        for answer in answers {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                let mut buffer = [0; 1024];
                let read = socket.read(&mut buffer).await.unwrap();
                request.extend_from_slice(&buffer[..read]);
            }
            socket.write_all(answer.as_bytes()).await.unwrap();
        }
    }

    fn free_address() -> SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    }

    fn plaintext() -> ControlSecurity {
        ControlSecurity::InsecurePlaintext {
            fleet_token: "token".into(),
        }
    }

    const UNAVAILABLE: &str =
        "HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";

    #[tokio::test]
    async fn a_call_waits_out_a_control_plane_that_is_down_or_unavailable() {
        let address = free_address();
        let ok = "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}";
        let server = tokio::spawn(restarting_server(
            address,
            Duration::from_millis(300),
            vec![UNAVAILABLE, ok],
        ));
        let client = ControlClient::new(address, &plaintext());
        let answer: serde_json::Value = client.post("/v1/heartbeat", &()).await.unwrap();
        assert_eq!(answer, serde_json::json!({ "ok": true }));
        server.await.unwrap();
    }

    fn tls(ca: &aurora_trust::FleetCa, role: Role, id: &str) -> NodeTls {
        let identity = aurora_trust::Identity::new(role, id, "us").unwrap();
        let cert = ca.issue(&identity, time::Duration::days(1)).unwrap();
        NodeTls::from_pem(ca.cert_pem(), &cert.cert_pem, &cert.key_pem).unwrap()
    }

    #[tokio::test]
    async fn over_mutual_tls_an_actor_registers_with_its_certificate() {
        let ca = aurora_trust::FleetCa::create("test").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let hub = std::sync::Arc::new(
            aurora_hub::Hub::open(aurora_hub::HubConfig {
                db_path: dir.path().join("hub.redb"),
                control: aurora_control::Config::default(),
                tick_interval_max: Duration::from_millis(200),
                clock: Arc::new(aurora_hub::SystemClock::new()),
            })
            .unwrap(),
        );
        let hash = aurora_control::WeightsHash([7; 32]);
        hub.publish_version(aurora_control::Version(1), hash)
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let serve = aurora_hub::ServeConfig {
            security: aurora_hub::Security::mutual_tls(&tls(&ca, Role::Trainer, "t")).unwrap(),
            limits: aurora_hub::Limits::default(),
        };
        tokio::spawn(aurora_hub::run(hub, listener, serve));

        let security = ControlSecurity::mutual_tls(&tls(&ca, Role::Actor, "7")).unwrap();
        let client = ControlClient::new(address, &security);
        let registered: aurora_api::RegisterResponse = client
            .post(
                "/v1/register",
                &aurora_api::RegisterRequest {
                    actor: 7,
                    region: "us".into(),
                    can_relay: false,
                    active: 1,
                    staged: None,
                },
            )
            .await
            .unwrap();
        let actor = client.with_actor_token(&registered.token);
        let _: aurora_api::Ack = actor
            .post("/v1/heartbeat", &aurora_api::ActorRequest { actor: 7 })
            .await
            .unwrap();
        // Without the registration's token, the certificate alone is not enough.
        let error = client
            .post::<_, aurora_api::Ack>("/v1/heartbeat", &aurora_api::ActorRequest { actor: 7 })
            .await
            .unwrap_err();
        assert!(error.to_string().contains("401"), "{error}");
    }

    #[tokio::test]
    async fn a_server_that_is_not_the_fleet_s_trainer_is_refused_and_not_tried_again() {
        let ca = aurora_trust::FleetCa::create("test").unwrap();
        // Another actor listening where the control plane should be.
        let impostor = tls(&ca, Role::Actor, "9");
        let acceptor =
            tokio_rustls::TlsAcceptor::from(impostor.server_config(CONTROL_ALPN).unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            // The client refuses it during the handshake.
            assert!(acceptor.accept(stream).await.is_err());
        });
        let security = ControlSecurity::mutual_tls(&tls(&ca, Role::Actor, "7")).unwrap();
        let error = ControlClient::new(address, &security)
            .post::<_, serde_json::Value>("/v1/heartbeat", &())
            .await
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "POST /v1/heartbeat: the TLS handshake with the control plane failed: invalid peer \
             certificate: the server is actor 9 (us), and only trainer may serve here"
        );
        // One try: a retry would have found the listener gone and ended on that.
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_refusal_is_not_tried_again() {
        let address = free_address();
        let refused = "HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 11\r\n\r\nbad request";
        let server = tokio::spawn(restarting_server(address, Duration::ZERO, vec![refused]));
        let client = ControlClient::new(address, &plaintext());
        let error = client
            .post::<_, serde_json::Value>("/v1/claim", &())
            .await
            .unwrap_err();
        assert!(
            error.to_string().contains("400 Bad Request: bad request"),
            "{error}"
        );
        server.await.unwrap();
    }
}
