//! The delay/loss emulator: one thread per direction of a link, inside the sending
//! region's namespace, driving an [`Impairment`].
//!
//! The region routes traffic for the link into a TUN device; the thread reads each
//! packet, lets the impairment lose or delay it, and when it falls due sends it out of
//! the link's veth to the peer's MAC address through a packet socket. The packet thus
//! passes the veth's rate limiter (a tbf queue, the link's bottleneck) and enters the
//! peer namespace's IP stack as if it had crossed a wire: TCP sees the real delay, the
//! real losses and the real queue.
//!
//! A thread rather than a child process: the [`crate::Network`] that starts it also
//! stops it, a test process needs no helper binary, and `setns` only moves the one
//! thread.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::WanError;
use crate::impair::{Counters, Impairment, ImpairmentConfig, SendOutcome};
use crate::netns::{NetnsThread, spawn_in_netns};
use crate::sys::{self, EventFd, PacketSender};

/// The largest frame: a virtio header and the largest IP packet. The read buffer holds
/// one, so no frame is ever truncated.
pub const MAX_FRAME_BYTES: usize = crate::gso::VNET_HEADER_BYTES + 65_535;
/// Frames read per wake-up before due ones are sent, so a flood on the TUN device
/// cannot hold back releases.
const READ_BATCH: usize = 64;
/// How late past its due time the kernel may wake the thread.
const TIMER_SLACK: Duration = Duration::from_micros(1);

/// Where one direction's emulator reads, how it impairs, and where it sends.
#[derive(Debug, Clone)]
pub struct EmulatorSpec {
    /// Names the direction in errors and logs.
    pub label: String,
    pub netns: String,
    pub tun: String,
    pub veth: String,
    pub local_mac: [u8; 6],
    pub peer_mac: [u8; 6],
    pub send_buffer_bytes: usize,
    pub impairment: ImpairmentConfig,
}

/// A running emulator thread; [`Emulator::stop`] ends it.
pub struct Emulator {
    label: String,
    wake: Arc<EventFd>,
    counters: Arc<Mutex<Counters>>,
    thread: Option<NetnsThread<std::io::Result<()>>>,
}

impl Emulator {
    /// Starts the thread and returns once its TUN device exists.
    pub fn start(spec: EmulatorSpec) -> Result<Emulator, WanError> {
        let failed = |label: &str, source| WanError::Emulator {
            label: label.to_string(),
            source,
        };
        let wake = Arc::new(EventFd::new().map_err(|e| failed(&spec.label, e))?);
        let counters = Arc::new(Mutex::new(Counters::default()));
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let label = spec.label.clone();
        let thread_name = format!("wan {}", spec.tun);
        let thread = {
            let wake = Arc::clone(&wake);
            let counters = Arc::clone(&counters);
            spawn_in_netns(&spec.netns, thread_name, move || {
                let step = |what: String| {
                    move |error: std::io::Error| {
                        std::io::Error::new(error.kind(), format!("{what}: {error}"))
                    }
                };
                let setup = (|| -> std::io::Result<(OwnedFd, PacketSender)> {
                    sys::set_timer_slack(TIMER_SLACK)
                        .map_err(step("setting timer slack".into()))?;
                    let tun = sys::create_tun(&spec.tun)
                        .map_err(step(format!("creating TUN device {}", spec.tun)))?;
                    let sender = PacketSender::new(
                        &spec.veth,
                        spec.local_mac,
                        spec.peer_mac,
                        spec.send_buffer_bytes,
                    )
                    .map_err(step(format!("opening a packet socket on {}", spec.veth)))?;
                    Ok((tun, sender))
                })();
                let (tun, sender) = match setup {
                    Ok(ready) => {
                        let _ = ready_tx.send(Ok(()));
                        ready
                    }
                    Err(error) => {
                        let message = error.to_string();
                        let _ = ready_tx.send(Err(error));
                        return Err(std::io::Error::other(message));
                    }
                };
                let result = run(
                    &tun,
                    sender,
                    Impairment::new(spec.impairment),
                    &wake,
                    &counters,
                );
                if let Err(error) = &result {
                    tracing::error!(emulator = spec.label, ?error, "emulator stopped");
                }
                result
            })?
        };
        let mut emulator = Emulator {
            label,
            wake,
            counters,
            thread: Some(thread),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(emulator),
            Ok(Err(source)) => {
                let _ = emulator.stop();
                Err(failed(&emulator.label, source))
            }
            Err(_) => {
                let _ = emulator.stop();
                Err(failed(
                    &emulator.label,
                    std::io::Error::other("the thread ended before it was ready"),
                ))
            }
        }
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    /// Counts as of the thread's last wake-up.
    pub fn counters(&self) -> Counters {
        *self.counters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ends the thread (its TUN device disappears with it); idempotent. Reports an
    /// error the thread stopped on.
    pub fn stop(&mut self) -> Result<(), WanError> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        let failed = |source| WanError::Emulator {
            label: self.label.clone(),
            source,
        };
        self.wake.signal().map_err(failed)?;
        thread.join()?.map_err(failed)
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        if let Err(error) = self.stop() {
            tracing::warn!(?error, "stopping an emulator");
        }
    }
}

fn run(
    tun: &OwnedFd,
    mut sender: PacketSender,
    mut impairment: Impairment,
    wake: &EventFd,
    counters: &Mutex<Counters>,
) -> std::io::Result<()> {
    let start = Instant::now();
    let mut buffer = vec![0u8; MAX_FRAME_BYTES + 1];
    loop {
        while let Some(outgoing) = impairment.poll_transmit(start.elapsed()) {
            let header = outgoing
                .header
                .behind_link_header(sys::ETHERNET_HEADER_BYTES as u16)
                .to_bytes();
            let outcome = match sender.send(&header, outgoing.ethertype, &outgoing.packet) {
                Ok(()) => SendOutcome::Sent,
                // The rate limiter's queue dropping at its limit. (A full send buffer,
                // EAGAIN, would be the emulator's fault, not the link's: it counts as a
                // failure, and the buffer is sized so that it does not happen.)
                Err(error) if error.raw_os_error() == Some(libc::ENOBUFS) => SendOutcome::QueueFull,
                Err(error) => {
                    tracing::debug!(%error, size = outgoing.packet.len(), "send failed");
                    SendOutcome::Failed
                }
            };
            impairment.record_send(&outgoing, outcome);
        }
        *counters.lock().unwrap_or_else(PoisonError::into_inner) = impairment.counters();

        let timeout = impairment
            .poll_timeout()
            .map(|due| due.saturating_sub(start.elapsed()));
        let [packets_waiting, woken] = sys::wait_readable([tun, wake.fd()], timeout)?;
        if woken {
            return Ok(());
        }
        if packets_waiting {
            for _ in 0..READ_BATCH {
                let Some(size) = sys::read_packet(tun, &mut buffer)? else {
                    break;
                };
                impairment.on_frame(start.elapsed(), &buffer[..size]);
            }
        }
    }
}
