//! The control plane's HTTP/JSON shell: a thin driver around the pure core
//! [`aurora_control::ControlPlane`] that owns the sockets, the clock, the timers, the
//! tokens and the disk.
//!
//! The API (endpoints, authentication, limits, errors, metrics) is specified in
//! `docs/control-api.md`, version 1; the request and response types are the crate
//! [`aurora_api`], which clients use without this server, and
//! `examples/python/worker.py` drives it from the Python standard library.
//! Everything a client controls is bounded (see the `http` limits: [`MAX_BODY_BYTES`],
//! [`aurora_api::MAX_PAYLOAD_BYTES`], [`REQUEST_TIMEOUT`], [`HEADER_READ_TIMEOUT`],
//! [`MAX_CONCURRENT_REQUESTS`]), and no input can make a handler panic.
//!
//! # Authentication
//!
//! The fleet token ([`HubConfig::token`]) admits registration, status and metrics.
//! Registering returns the actor's own token, which every later call of that actor
//! must present: one actor cannot act for another, and a re-registration rotates the
//! token. Only BLAKE3 hashes of tokens are kept, compared in constant time (module
//! `auth`).
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
mod metrics;
mod store;

use std::convert::Infallible;
use std::sync::Arc;

use thiserror::Error;
use tokio::net::TcpListener;

pub use auth::{ActorToken, AuthError};
pub use clock::{Clock, ManualClock, SystemClock};
pub use http::{
    HEADER_READ_TIMEOUT, MAX_BODY_BYTES, MAX_CONCURRENT_REQUESTS, REQUEST_TIMEOUT, router, run,
};
pub use hub::{CallError, Hub, HubConfig, OpenError, StepResults};
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

/// Opens the hub described by `config` and serves its API on `listener`; returns if the
/// hub cannot start, or once it has stopped, so that the process exits and its
/// supervisor restarts it from the database rather than leaving it answering 503.
pub async fn serve(config: HubConfig, listener: TcpListener) -> Result<Infallible, ServeError> {
    // Opening reads and may restore the whole state from disk.
    let hub = Arc::new(tokio::task::spawn_blocking(move || Hub::open(config)).await??);
    tokio::select! {
        never = run(Arc::clone(&hub), listener) => match never {},
        () = hub.wait_stopped() => Err(ServeError::Stopped),
    }
}
