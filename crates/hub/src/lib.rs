//! The control plane's HTTP/JSON shell: a thin driver around the pure core
//! [`aurora_control::ControlPlane`] that owns the sockets, the clock, the timers and
//! the disk.
//!
//! The API (endpoints, authentication, limits, errors, metrics) is specified in
//! `docs/control-api.md`, version 1; the request and response types are in [`wire`].
//! Bodies are capped at [`MAX_BODY_BYTES`] before they are parsed, the token
//! ([`HubConfig::token`]) is compared in time independent of the first differing byte,
//! and no input can make a handler panic.
//!
//! # Persistence, and why an acknowledged acceptance survives a crash
//!
//! The whole core is saved as one serde_json snapshot in a redb database
//! (`control_state`, key 0). Each mutating call, under the core's lock:
//!
//! 1. runs the core method on a copy of the core, at the hub's clock;
//! 2. drains the core's events into the log;
//! 3. saves the copy in one redb write transaction, whose commit fsyncs;
//! 4. only then installs the copy as the live core and lets the handler respond.
//!
//! A client therefore sees an acceptance only after the state recording it is on
//! disk: a crash before step 3 completes loses a call nobody was told about (the
//! actor retries), a crash after it loses nothing. If the save fails, the live core
//! stays equal to the stored one and the client gets a 500. On start,
//! [`Hub::open`] restores the saved state through [`aurora_control::ControlPlane::restore`],
//! which re-checks every invariant, so a corrupt database is a typed [`OpenError`],
//! never a panic. The hub's clock continues from the restored core's clock, since the
//! core never lets time run backwards.
//!
//! # Timers
//!
//! [`run`] spawns a task that calls [`Hub::tick`] when the core's next deadline is due
//! (checking at least every [`HubConfig::tick_interval_max`]), so leases expire and
//! silent actors are removed without requests.

mod http;
mod hub;
mod store;
pub mod wire;

use std::io;
use std::sync::Arc;

use thiserror::Error;
use tokio::net::TcpListener;

pub use http::{MAX_BODY_BYTES, router, run};
pub use hub::{CallError, Hub, HubConfig, OpenError};
pub use store::{LoadError, PersistError};

/// Why [`serve`] stopped.
#[derive(Debug, Error)]
pub enum ServeError {
    /// The hub could not start.
    #[error("opening the hub: {0}")]
    Open(#[from] OpenError),
    /// The server failed.
    #[error("serving: {0}")]
    Io(#[from] io::Error),
}

/// Opens the hub described by `config` and serves its API on `listener` until the
/// server fails.
pub async fn serve(config: HubConfig, listener: TcpListener) -> Result<(), ServeError> {
    // Opening reads and may restore the whole state from disk.
    let hub = tokio::task::spawn_blocking(move || Hub::open(config))
        .await
        .map_err(io::Error::other)??;
    run(Arc::new(hub), listener).await?;
    Ok(())
}
