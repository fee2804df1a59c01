//! SIGTERM (a cloud's preemption notice, a scheduler's stop) and SIGINT: the first starts
//! a node's graceful stop, a second ends the process at once, even while the node's own
//! thread is busy (a hub publishing a version).

use anyhow::{Context, Result};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::watch;

/// Whether a stop was asked for, and by which signal.
pub struct StopSignals(watch::Receiver<Option<&'static str>>);

impl StopSignals {
    /// Takes both signals over from their default (ending the process) and watches them
    /// on the runtime it is called in.
    pub fn new() -> Result<StopSignals> {
        let mut signals = Signals {
            terminate: signal(SignalKind::terminate()).context("handling SIGTERM")?,
            interrupt: signal(SignalKind::interrupt()).context("handling SIGINT")?,
        };
        let (asked, watched) = watch::channel(None);
        tokio::spawn(async move {
            let _ = asked.send(Some(signals.next().await));
            let again = signals.next().await;
            tracing::warn!(signal = again, "asked again: stopping at once");
            let number = match again {
                "SIGTERM" => libc::SIGTERM,
                _ => libc::SIGINT,
            };
            // The status a shell gives a process that the signal ended.
            std::process::exit(128 + number);
        });
        Ok(StopSignals(watched))
    }

    /// Resolves with the first signal's name once one has arrived.
    pub async fn recv(mut self) -> &'static str {
        match self.0.wait_for(Option::is_some).await {
            Ok(asked) => asked.expect("waited for"),
            // The watching task never ends before it has sent, short of a panic.
            Err(_) => std::future::pending().await,
        }
    }
}

struct Signals {
    terminate: Signal,
    interrupt: Signal,
}

impl Signals {
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        }
    }
}
