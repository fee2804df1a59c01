//! The accept loop: connection caps, the TLS handshake (mutual, TLS 1.3, against the
//! fleet CA) with its timeout, and hyper's HTTP/1 on each connection, every request of
//! which carries the [`Peer`] it came from.
//!
//! A connection is counted against the total and its source address as soon as it is
//! accepted, before a byte is read, so an unauthenticated peer holds at most
//! [`Limits::max_connections_per_address`] connections, each for at most
//! [`Limits::handshake_timeout`] unless it completes a handshake; once the handshake
//! has verified its certificate, against its identity too. A connection over a cap is
//! closed at once, and one whose peer stops taking its responses after
//! [`Limits::write_timeout`].

use std::convert::Infallible;
use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use aurora_trust::{Identity, NodeTls, Role, TrustError, tls::CONTROL_ALPN};
use axum::Router;
use axum::extract::Request;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use rustls::{AlertDescription, CertificateError};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

use crate::hub::Hub;
use crate::limits::{Counts, Limits};
use crate::refusals::{ConnectionLimit, HandshakeFailure, Refusal, Refusals, Timeout};

/// Pause after a failed accept (out of file descriptors, say), so that the loop does
/// not spin while the condition lasts.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Shortest pause between two ticks.
const TICK_WAIT_MIN: Duration = Duration::from_millis(10);

/// How peers reach the API and prove who they are.
#[derive(Clone)]
pub enum Security {
    /// HTTPS with mutual TLS 1.3: every client presents a certificate of the fleet CA,
    /// whose identity decides what it may call.
    MutualTls(Arc<rustls::ServerConfig>),
    /// Plain HTTP with the fleet token: anyone on the path reads the tokens and may
    /// replay requests. For loopback and tests only.
    InsecurePlaintext {
        /// The fleet token: registration, status and metrics require it.
        fleet_token: String,
    },
}

impl fmt::Debug for Security {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the token.
        f.write_str(match self {
            Security::MutualTls(_) => "MutualTls",
            Security::InsecurePlaintext { .. } => "InsecurePlaintext",
        })
    }
}

/// Why the API's security could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    /// Clients accept only a trainer's certificate as the control plane's.
    #[error(
        "the control plane's certificate must be a trainer's (clients refuse any other), but it is {0}'s"
    )]
    NotTrainer(Identity),
    #[error(transparent)]
    Trust(#[from] TrustError),
    /// An empty fleet token would let anyone in.
    #[error("the fleet token is empty")]
    EmptyToken,
}

impl Security {
    /// Mutual TLS with `tls`, which must be a trainer's certificate.
    pub fn mutual_tls(tls: &NodeTls) -> Result<Security, SecurityError> {
        if tls.identity().role != Role::Trainer {
            return Err(SecurityError::NotTrainer(tls.identity().clone()));
        }
        Ok(Security::MutualTls(tls.server_config(CONTROL_ALPN)?))
    }

    /// Plain HTTP with `fleet_token`, which must not be empty.
    pub fn insecure_plaintext(fleet_token: &str) -> Result<Security, SecurityError> {
        if fleet_token.is_empty() {
            return Err(SecurityError::EmptyToken);
        }
        Ok(Security::InsecurePlaintext {
            fleet_token: fleet_token.to_owned(),
        })
    }
}

/// How the API is served.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub security: Security,
    pub limits: Limits,
}

/// Who sent a request: its address, and over TLS the identity its certificate proved.
/// Every request served by [`run`] carries one in its extensions.
#[derive(Clone, Debug)]
pub(crate) struct Peer {
    pub address: SocketAddr,
    pub identity: Option<Identity>,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.identity {
            Some(identity) => write!(f, "{identity} at {}", self.address),
            None => write!(f, "{}", self.address),
        }
    }
}

/// Serves the API on `listener` and runs the tick task, forever: a failed accept (out
/// of file descriptors, say) is logged and retried. Dropping the future stops the tick
/// task and closes every connection.
pub async fn run(hub: Arc<Hub>, listener: TcpListener, config: ServeConfig) -> Infallible {
    let _ticker = AbortOnDrop(tokio::spawn(tick_forever(Arc::clone(&hub))));
    if let Security::InsecurePlaintext { .. } = config.security {
        tracing::warn!(
            "serving the control API over INSECURE PLAINTEXT HTTP: the fleet and actor tokens \
             cross the network in clear and anyone on the path can read and replay them; \
             use --ca/--cert/--key beyond loopback"
        );
    }
    let acceptor = match &config.security {
        Security::MutualTls(server) => Some(TlsAcceptor::from(Arc::clone(server))),
        Security::InsecurePlaintext { .. } => None,
    };
    let router = crate::http::router(Arc::clone(&hub), &config);
    let connections = Arc::new(Connections::default());
    let limits = Arc::new(config.limits);
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let (stream, address) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                if !is_connection_error(&error) {
                    tracing::warn!(%error, "accepting connections failed; retrying");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                }
                continue;
            }
        };
        // Forget finished connections, so the set holds only live ones.
        while tasks.try_join_next().is_some() {}
        let Some(slots) = connections.admit(address, &limits, hub.refusals()) else {
            continue;
        };
        let connection = Connection {
            hub: Arc::clone(&hub),
            limits: Arc::clone(&limits),
            connections: Arc::clone(&connections),
            router: router.clone(),
            address,
        };
        let acceptor = acceptor.clone();
        tasks.spawn(async move {
            // Held until the connection ends.
            let _slots = slots;
            match acceptor {
                Some(acceptor) => connection.serve_tls(acceptor, stream).await,
                None => connection.serve(stream, None).await,
            }
        });
    }
}

/// The connections held, by cap.
#[derive(Default)]
struct Connections {
    total: Counts<()>,
    by_address: Counts<IpAddr>,
    by_identity: Counts<Identity>,
}

/// A connection's slots in the total and its address's count.
type AdmittedSlots = (crate::limits::Slot<()>, crate::limits::Slot<IpAddr>);

impl Connections {
    /// Slots for a connection just accepted from `address`, or `None` (refused and
    /// counted) if a cap is reached; dropping the stream then closes it.
    fn admit(
        &self,
        address: SocketAddr,
        limits: &Limits,
        refusals: &Refusals,
    ) -> Option<AdmittedSlots> {
        let Some(total) = self.total.try_take((), limits.max_connections) else {
            refusals.record(
                Refusal::Connection(ConnectionLimit::Total),
                &address,
                &format_args!("{} connections are open already", limits.max_connections),
            );
            return None;
        };
        let Some(by_address) = self
            .by_address
            .try_take(address.ip(), limits.max_connections_per_address)
        else {
            refusals.record(
                Refusal::Connection(ConnectionLimit::PerAddress),
                &address,
                &format_args!(
                    "{} connections from {} are open already",
                    limits.max_connections_per_address,
                    address.ip()
                ),
            );
            return None;
        };
        Some((total, by_address))
    }
}

/// One accepted connection and what serving it needs.
struct Connection {
    hub: Arc<Hub>,
    limits: Arc<Limits>,
    connections: Arc<Connections>,
    router: Router,
    address: SocketAddr,
}

impl Connection {
    /// The handshake within its timeout, the identity's cap, then HTTP.
    async fn serve_tls(self, acceptor: TlsAcceptor, stream: TcpStream) {
        let refusals = self.hub.refusals();
        let stream = match tokio::time::timeout(
            self.limits.handshake_timeout,
            acceptor.accept(stream),
        )
        .await
        {
            Ok(Ok(stream)) => stream,
            Ok(Err(error)) => {
                let (reason, detail) = handshake_failure(&error);
                refusals.record(
                    Refusal::Handshake(reason),
                    &self.address,
                    &format_args!("TLS handshake failed: {detail}"),
                );
                return;
            }
            Err(_) => {
                refusals.record(
                    Refusal::Timeout(Timeout::Handshake),
                    &self.address,
                    &format_args!(
                        "no TLS handshake within {:?}",
                        self.limits.handshake_timeout
                    ),
                );
                return;
            }
        };
        let identity = match aurora_trust::peer_identity(stream.get_ref().1.peer_certificates()) {
            Ok(identity) => identity,
            Err(error) => {
                refusals.record(
                    Refusal::Handshake(HandshakeFailure::NoIdentity),
                    &self.address,
                    &format_args!("the client certificate verified, but {error}"),
                );
                return;
            }
        };
        let Some(_slot) = self
            .connections
            .by_identity
            .try_take(identity.clone(), self.limits.max_connections_per_identity)
        else {
            let peer = Peer {
                address: self.address,
                identity: Some(identity),
            };
            refusals.record(
                Refusal::Connection(ConnectionLimit::PerIdentity),
                &peer,
                &format_args!(
                    "{} connections of this identity are open already",
                    self.limits.max_connections_per_identity
                ),
            );
            return;
        };
        self.serve(stream, Some(identity)).await;
    }

    /// HTTP/1 on `stream`, each request tagged with the peer.
    async fn serve(self, stream: impl AsyncRead + AsyncWrite + Unpin, identity: Option<Identity>) {
        let peer = Peer {
            address: self.address,
            identity,
        };
        let stream = Watched {
            inner: stream,
            mid_request: Arc::default(),
            write_stall: WriteStall {
                timeout: self.limits.write_timeout,
                deadline: None,
                hub: Arc::clone(&self.hub),
                peer: peer.clone(),
            },
        };
        let mid_request = Arc::clone(&stream.mid_request);
        let tagged = peer.clone();
        let service = TowerToHyperService::new(tower::util::MapRequest::new(
            self.router,
            move |mut request: Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(tagged.clone());
                request
            },
        ));
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.limits.header_read_timeout);
        if let Err(error) = builder
            .serve_connection(TokioIo::new(stream), service)
            .await
        {
            // Hyper's header timeout also ends idle keep-alive connections, which is no
            // refusal: only a request head begun and not finished is.
            if error.is_timeout() && mid_request.load(Ordering::Relaxed) {
                self.hub.refusals().record(
                    Refusal::Timeout(Timeout::Header),
                    &peer,
                    &format_args!(
                        "no complete request head within {:?}",
                        self.limits.header_read_timeout
                    ),
                );
            } else {
                tracing::debug!(%peer, %error, "connection ended with an error");
            }
        }
    }
}

/// A connection's stream, noting whether bytes of a request arrived since the last
/// response was written (a request pipelined behind the previous one and cut short
/// counts as idle: a corner no client of ours reaches), and ending a write the peer
/// does not take in time.
struct Watched<S> {
    inner: S,
    mid_request: Arc<AtomicBool>,
    write_stall: WriteStall,
}

/// The deadline of a write that cannot progress, started when the stream first blocks
/// and cleared by any progress. Hyper has no write timeout of its own.
struct WriteStall {
    timeout: Duration,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    hub: Arc<Hub>,
    peer: Peer,
}

impl WriteStall {
    /// `polled` as it came, unless it is still blocked when the deadline passes: then
    /// the refusal is counted (before the connection closes, so that whoever sees it
    /// closed sees it counted) and the write fails.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if !polled.is_pending() {
            self.deadline = None;
            return polled;
        }
        let timeout = self.timeout;
        let deadline = self
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if deadline.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.hub.refusals().record(
            Refusal::Timeout(Timeout::Write),
            &self.peer,
            &format_args!("took none of its response within {timeout:?}"),
        );
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the peer took none of its response within {timeout:?}"),
        )))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.mid_request.store(true, Ordering::Relaxed);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(written)) = polled
            && written > 0
        {
            self.mid_request.store(false, Ordering::Relaxed);
        }
        self.write_stall.watch(cx, polled)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.write_stall.watch(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Why a handshake failed, as a metric's reason and a log line's detail.
fn handshake_failure(error: &io::Error) -> (HandshakeFailure, String) {
    let Some(tls) = error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    else {
        return (HandshakeFailure::Closed, error.to_string());
    };
    let reason = match tls {
        rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateHandshakeMessage { .. } => {
            HandshakeFailure::NotTls
        }
        rustls::Error::NoCertificatesPresented => HandshakeFailure::NoCertificate,
        rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer | CertificateError::BadSignature,
        ) => HandshakeFailure::UnknownCa,
        rustls::Error::InvalidCertificate(
            CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. },
        ) => HandshakeFailure::Expired,
        rustls::Error::InvalidCertificate(_) => HandshakeFailure::BadCertificate,
        rustls::Error::AlertReceived(
            AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::AccessDenied,
        ) => HandshakeFailure::PeerRefused,
        _ => HandshakeFailure::Protocol,
    };
    let detail = match reason {
        HandshakeFailure::NotTls => format!(
            "{}: not TLS (a plaintext HTTP client? this hub takes https with a fleet certificate)",
            aurora_trust::tls::explain(tls)
        ),
        _ => aurora_trust::tls::explain(tls),
    };
    (reason, detail)
}

/// Whether an accept error concerns only the connection being accepted (the peer
/// gave up), rather than the listener or the process.
fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
    )
}

/// Ticks the core whenever a deadline is due, so that leases expire and silent actors
/// are removed even when no request comes in; ends when the hub has stopped.
async fn tick_forever(hub: Arc<Hub>) {
    loop {
        let ticking = Arc::clone(&hub);
        // Both calls take the core's lock, which a commit may hold through an fsync,
        // so they run on the blocking pool rather than stall a runtime worker.
        let wait = tokio::task::spawn_blocking(move || match ticking.tick() {
            Err(crate::hub::CallError::Stopped) => None,
            Err(error) => {
                tracing::error!(%error, "tick not saved");
                Some(ticking.until_next_tick())
            }
            Ok(_) => Some(ticking.until_next_tick()),
        })
        .await
        .unwrap_or_else(|error| {
            tracing::error!(%error, "tick task failed");
            Some(TICK_WAIT_MIN)
        });
        let Some(wait) = wait else {
            tracing::error!("the hub has stopped: no more ticks until it is restarted");
            return;
        };
        // The floor keeps a tick that keeps failing (the deadline stays due) from spinning.
        tokio::time::sleep(wait.max(TICK_WAIT_MIN)).await;
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
