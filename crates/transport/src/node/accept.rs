//! Accepting connections: the caps a stranger meets first, the TLS handshake within the
//! handshake timeout, and the identity the handshake proves.
//!
//! Before a peer is authenticated it costs a socket, a task and a TLS session's buffers
//! at most: connections are capped per source address while in their handshake and in
//! total, the handshake and the Hello after it share one deadline, and the first frame
//! read is no larger than a Hello (`conn::FIRST_FRAME_LIMIT`).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aurora_trust::peer_identity;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

use crate::conn::{SocketOptions, Stream};
use crate::security::{Limits, Refusal, RefusalCounters, describe, segment_identity};

use super::driver::Event;

/// The connection caps of one node, shared by its accept loop and its event loop.
pub(crate) struct Gate {
    limits: Limits,
    /// Inbound connections open, from accept to close.
    total: AtomicUsize,
    /// Connections in their TLS handshake, by source address.
    unauthenticated: Mutex<HashMap<IpAddr, usize>>,
    pub(crate) refusals: Arc<RefusalCounters>,
    events: mpsc::Sender<Event>,
}

/// An inbound connection's place under the total cap, given back when dropped (with
/// the connection).
pub(crate) struct Permit(Arc<Gate>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.total.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection's place under its address's cap while it is in its handshake.
struct Unauthenticated {
    gate: Arc<Gate>,
    address: IpAddr,
}

impl Drop for Unauthenticated {
    fn drop(&mut self) {
        let mut counts = self.gate.unauthenticated.lock().expect("never poisoned");
        if let Some(count) = counts.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.address);
            }
        }
    }
}

impl Gate {
    pub(crate) fn new(
        limits: Limits,
        refusals: Arc<RefusalCounters>,
        events: mpsc::Sender<Event>,
    ) -> Arc<Gate> {
        Arc::new(Gate {
            limits,
            total: AtomicUsize::new(0),
            unauthenticated: Mutex::new(HashMap::new()),
            refusals,
            events,
        })
    }

    /// Counts and logs a refusal, once per event, and has the node publish its status.
    pub(crate) fn refuse(&self, refusal: Refusal, peer: impl std::fmt::Display, why: &str) {
        self.refusals.record(refusal, &peer, &why);
        // A full queue means the loop is busy and publishes its status soon anyway.
        let _ = self.events.try_send(Event::Refused);
    }

    fn admit(
        self: &Arc<Gate>,
        address: IpAddr,
    ) -> Result<(Permit, Unauthenticated), (Refusal, String)> {
        let open = self.total.fetch_add(1, Ordering::Relaxed);
        let permit = Permit(self.clone());
        if open >= self.limits.max_connections {
            return Err((
                Refusal::TotalCap,
                format!(
                    "{open} connections are open, the cap is {}",
                    self.limits.max_connections
                ),
            ));
        }
        let mut counts = self.unauthenticated.lock().expect("never poisoned");
        let count = counts.entry(address).or_default();
        let cap = self.limits.max_unauthenticated_per_address;
        if *count >= cap {
            return Err((
                Refusal::AddressCap,
                format!(
                    "{count} connections from {address} are in their handshake, the cap is {cap}"
                ),
            ));
        }
        *count += 1;
        drop(counts);
        Ok((
            permit,
            Unauthenticated {
                gate: self.clone(),
                address,
            },
        ))
    }
}

/// Accepts connections while the node lives; each is admitted under the caps, then
/// (with TLS) authenticated on a task of its own, and handed to the loop. The handshake
/// tasks are this task's: killing the node ends them too.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    options: SocketOptions,
    acceptor: Option<TlsAcceptor>,
    gate: Arc<Gate>,
) {
    let mut handshakes = JoinSet::new();
    loop {
        while handshakes.try_join_next().is_some() {}
        let (stream, address) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors and the like: back off instead of spinning.
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let accepted_at = Instant::now();
        let (permit, unauthenticated) = match gate.admit(address.ip()) {
            Ok(admitted) => admitted,
            Err((refusal, why)) => {
                gate.refuse(refusal, address, &why);
                continue;
            }
        };
        if let Err(error) = options.apply(&stream) {
            tracing::warn!(%address, %error, "socket options refused; closing");
            continue;
        }
        match &acceptor {
            None => {
                drop(unauthenticated);
                let accepted = Event::Accepted {
                    stream: Stream::Plain(stream),
                    peer: None,
                    address,
                    accepted_at,
                    permit,
                };
                if gate.events.send(accepted).await.is_err() {
                    return;
                }
            }
            Some(acceptor) => {
                handshakes.spawn(handshake(
                    acceptor.clone(),
                    stream,
                    address,
                    accepted_at,
                    (permit, unauthenticated),
                    gate.clone(),
                ));
            }
        }
    }
}

/// The TLS handshake of one accepted connection, within the handshake timeout; a peer
/// that completes it is handed to the loop with the identity its certificate proves.
async fn handshake(
    acceptor: TlsAcceptor,
    stream: TcpStream,
    address: SocketAddr,
    accepted_at: Instant,
    (permit, unauthenticated): (Permit, Unauthenticated),
    gate: Arc<Gate>,
) {
    let timeout = gate.limits.handshake_timeout;
    let handshake =
        tokio::time::timeout_at((accepted_at + timeout).into(), acceptor.accept(stream));
    let result = handshake.await;
    drop(unauthenticated);
    let stream = match result {
        Err(_) => {
            let why = format!("no TLS handshake within {timeout:?}");
            return gate.refuse(Refusal::HandshakeTimeout, address, &why);
        }
        Ok(Err(error)) => {
            let (why, refusal) = describe(&error);
            return gate.refuse(refusal, address, &format!("TLS handshake failed: {why}"));
        }
        Ok(Ok(stream)) => stream,
    };
    let certified = peer_identity(stream.get_ref().1.peer_certificates())
        .map_err(|error| (Refusal::Handshake, error.to_string()))
        .and_then(|identity| {
            segment_identity(&identity).map_err(|why| (Refusal::WrongRole, why.to_string()))
        });
    let peer = match certified {
        Ok(peer) => peer,
        Err((refusal, why)) => return gate.refuse(refusal, address, &why),
    };
    let accepted = Event::Accepted {
        stream: Stream::Tls(Box::new(stream.into())),
        peer: Some(peer),
        address,
        accepted_at,
        permit,
    };
    let _ = gate.events.send(accepted).await;
}
