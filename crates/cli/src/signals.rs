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
        Ok(StopSignals::watch(Signals {
            terminate: signal(SignalKind::terminate()).context("handling SIGTERM")?,
            interrupt: Some(signal(SignalKind::interrupt()).context("handling SIGINT")?),
        }))
    }

    /// For the nodes `aurora run` starts: they take their orders from the run. A
    /// terminal's Ctrl-C reaches the whole process group, and it is the run that decides
    /// how its nodes stop (SIGTERM, in order), so SIGINT is ignored here.
    pub fn of_run_node() -> Result<StopSignals> {
        // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code.
        if unsafe { libc::signal(libc::SIGINT, libc::SIG_IGN) } == libc::SIG_ERR {
            return Err(std::io::Error::last_os_error()).context("ignoring SIGINT");
        }
        Ok(StopSignals::watch(Signals {
            terminate: signal(SignalKind::terminate()).context("handling SIGTERM")?,
            interrupt: None,
        }))
    }

    fn watch(mut signals: Signals) -> StopSignals {
        let (asked, watched) = watch::channel(None);
        tokio::spawn(async move {
            let _ = asked.send(Some(signals.next().await));
            let again = signals.next().await;
            tracing::warn!(signal = again, "asked again: stopping at once");
            std::process::exit(ended_by(again));
        });
        StopSignals(watched)
    }

    /// The first signal's name, if one has arrived.
    pub fn asked(&self) -> Option<&'static str> {
        *self.0.borrow()
    }

    /// Resolves with the first signal's name once one has arrived.
    pub async fn recv(&mut self) -> &'static str {
        match self.0.wait_for(Option::is_some).await {
            Ok(asked) => asked.expect("waited for"),
            // The watching task never ends before it has sent, short of a panic.
            Err(_) => std::future::pending().await,
        }
    }
}

/// The status a shell gives a process that `signal` (one of the names above) ended.
pub fn ended_by(signal: &str) -> i32 {
    128 + match signal {
        "SIGTERM" => libc::SIGTERM,
        _ => libc::SIGINT,
    }
}

struct Signals {
    terminate: Signal,
    /// None: SIGINT is ignored.
    interrupt: Option<Signal>,
}

impl Signals {
    async fn next(&mut self) -> &'static str {
        let Signals {
            terminate,
            interrupt,
        } = self;
        let interrupt = async {
            match interrupt {
                Some(interrupt) => interrupt.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt => "SIGINT",
        }
    }
}
