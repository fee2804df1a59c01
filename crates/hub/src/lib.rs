//! The control plane's HTTP/JSON shell: a thin driver around the pure core
//! [`aurora_control::ControlPlane`] that owns the sockets, the clock, the timers, the
//! tokens and the disk.
//!
//! The API (endpoints, authentication, limits, errors, metrics) is specified in
//! `docs/control-api.md`, version 1; the request and response types are the crate
//! [`aurora_api`], which clients use without this server, and
//! `examples/python/worker.py` drives it from the Python standard library.
//! Everything a client controls is bounded ([`MAX_BODY_BYTES`],
//! [`aurora_api::MAX_PAYLOAD_BYTES`], and the caps and timeouts of [`Limits`]:
//! connections in total, per source address and per identity, requests in progress in
//! total and per identity, the handshake, the request head and the request), and no
//! input can make a handler panic. Every refusal is counted ([`Refusals`], in
//! `/metrics`) and logged once.
//!
//! # Authentication and authorization
//!
//! [`Security::MutualTls`] serves HTTPS with mutual TLS 1.3 against the fleet CA
//! (module `listen`): a peer is who its certificate says (`aurora_trust::Identity`),
//! and its role decides what it may call (module `auth`; the matrix is in
//! docs/control-api.md): an actor calls the actor routes for its own id only, readers
//! (observer, trainer, relay) read status and metrics. [`Security::InsecurePlaintext`]
//! serves plain HTTP where the fleet token admits registration, status and metrics, for
//! loopback and tests. Either way registering returns the actor's own token, which every
//! later call of that actor must present: it binds the calls to the registration, so a
//! re-registration (a new process) locks the old process out. Only BLAKE3 hashes of
//! tokens are kept, compared in constant time.
//!
//! # Persistence, and why an acknowledged acceptance survives a crash
//!
//! One redb database holds a checkpoint of the core (a serde_json snapshot), the
//! journal of the calls made since, the payload of every accepted result and the
//! hashes of the actor tokens (modules `store` and `journal`). Each mutating call,
//! under the core's lock:
//!
//! 1. runs the core method on the live core, at the hub's clock;
//! 2. drains the core's events into the log;
//! 3. commits the call's journal record (the call, its arguments and the clock time),
//!    the payloads it accepted and the tokens it issued or revoked in one redb write
//!    transaction, whose commit fsyncs;
//! 4. only then lets the handler respond.
//!
//! A call thus writes what it changed, not the whole state: the state is written
//! whole only as a checkpoint, when the journal since the last one has grown to its
//! size, so whole-state writes cost at most as much again as the records.
//!
//! A client sees an acceptance only after the record of it, payload included, is on
//! disk: a crash before step 3 completes loses a call nobody was told about (the
//! actor retries), a crash after it loses nothing, and nothing is accepted twice. If
//! the commit fails, memory is ahead of disk, so the hub stops: the client gets a 500
//! and every later call a 503 until the hub is restarted (module `hub` explains why
//! it does not try to undo the call). On start, [`Hub::open`] checks the checkpoint
//! with [`aurora_control::ControlPlane::from_snapshot`], replays the journal through
//! the same code the live calls ran (the core is deterministic, so the replay ends in
//! the state the calls left), checks every invariant again, and carries on at the
//! clock's time ([`aurora_control::ControlPlane::resume`], itself journaled). A
//! corrupt database, a damaged record included, is a typed [`OpenError`] naming what
//! is wrong, never a panic.
//!
//! The trainer side is in-process: [`Hub::publish_version`], [`Hub::open_step`] and
//! [`Hub::take_step_outcome`], which hands over a completed step's accepted results
//! with their payloads, by prompt id.
//!
//! # Time
//!
//! The hub reads time through a [`Clock`]: [`SystemClock`] in production, whose
//! origin (the Unix epoch) survives restarts, so leases outstanding at a crash are
//! honoured or expire as if the hub had never stopped; [`ManualClock`] in tests.
//! [`run`] spawns a task that calls [`Hub::tick`] when the core's next deadline is due
//! (checking at least every [`HubConfig::tick_interval_max`]), so leases expire and
//! silent actors are removed without requests.

mod auth;
mod clock;
mod http;
mod hub;
mod journal;
mod limits;
mod listen;
mod metrics;
mod refusals;
mod store;

use std::convert::Infallible;
use std::sync::Arc;

use thiserror::Error;
use tokio::net::TcpListener;

pub use auth::{ActorToken, AuthError, Forbidden};
pub use clock::{Clock, ManualClock, SystemClock};
pub use http::{MAX_BODY_BYTES, MAX_SMALL_BODY_BYTES, router};
pub use hub::{CallError, Hub, HubConfig, JoinPoint, OpenError, StepResults};
pub use limits::{
    HANDSHAKE_TIMEOUT, HEADER_READ_TIMEOUT, Limits, MAX_CONCURRENT_REQUESTS, REQUEST_TIMEOUT,
};
pub use listen::{Security, SecurityError, ServeConfig, run};
pub use refusals::{ConnectionLimit, HandshakeFailure, Refusal, Refusals, RequestRule, Timeout};
pub use store::{AcceptedRollout, LoadError, PersistError};

/// Why [`serve`] stopped.
#[derive(Debug, Error)]
pub enum ServeError {
    /// The hub could not start.
    #[error("opening the hub: {0}")]
    Open(#[from] OpenError),
    /// The task opening the hub failed.
    #[error("opening the hub: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// A call could not be saved (see [`CallError::Stopped`]).
    #[error("{}", CallError::Stopped)]
    Stopped,
}

/// Opens the hub described by `config` and serves its API on `listener` as `serve`
/// says; returns if the hub cannot start, or once it has stopped, so that the process
/// exits and its supervisor restarts it from the database rather than leaving it
/// answering 503.
pub async fn serve(
    config: HubConfig,
    listener: TcpListener,
    serve: ServeConfig,
) -> Result<Infallible, ServeError> {
    // Opening reads and may restore the whole state from disk.
    let hub = Arc::new(tokio::task::spawn_blocking(move || Hub::open(config)).await??);
    tokio::select! {
        never = run(Arc::clone(&hub), listener, serve) => match never {},
        () = hub.wait_stopped() => Err(ServeError::Stopped),
    }
}
