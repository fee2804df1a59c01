//! What one direction of a link does to packets: check, lose, delay. The sans-IO core
//! of the emulator (`emulator` is its driver).
//!
//! The driver hands every frame it reads (a `virtio_net_hdr`, then an IP packet, maybe
//! a TCP super-packet: see `gso`) to [`Impairment::on_frame`], sends whatever
//! [`Impairment::poll_transmit`] returns, reports each send with
//! [`Impairment::record_send`], and sleeps until [`Impairment::poll_timeout`] or the
//! next frame. Loss applies to each wire packet, so a super-packet that loses some of
//! its segments is cut and only the survivors travel on. Counts are in wire packets.

use std::time::Duration;

use serde::Serialize;

use crate::delay::DelayLine;
use crate::gso::{self, VnetHeader};
use crate::loss::{Loss, LossModel};
use crate::packet::{self, Malformed};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ImpairmentConfig {
    pub delay: Duration,
    pub loss: LossModel,
    pub seed: u64,
    /// Bound of the delay line; a frame that does not fit is dropped and counted.
    pub delay_line_bytes: usize,
}

/// A packet (maybe a super-packet) ready to leave, with its virtio header and the
/// EtherType to send it with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub ethertype: u16,
    pub header: VnetHeader,
    pub packet: Vec<u8>,
    pub wire_packets: usize,
}

/// What became of a frame handed to [`Impairment::on_frame`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Queued,
    /// Some wire packets were lost; this many survivors were queued.
    PartlyLost {
        queued: usize,
    },
    Lost,
    Overflowed,
    Malformed(Malformed),
}

/// How the driver's send of an [`Outgoing`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOutcome {
    Sent,
    /// The bottleneck queue behind the emulator was full: the link's tail drop.
    QueueFull,
    /// Any other refusal (too large for the link, interface gone).
    Failed,
}

/// Counts of one direction since it started, in wire packets (a frame that is not a
/// well-formed super-packet counts as one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counters {
    pub packets_in: u64,
    pub bytes_in: u64,
    pub malformed: u64,
    /// Dropped by the loss model.
    pub lost: u64,
    /// Dropped because the delay line was full.
    pub overflowed: u64,
    pub packets_out: u64,
    pub bytes_out: u64,
    /// Dropped by the rate limiter's full queue (which takes super-packets whole:
    /// see `plan::MIN_BURST_BYTES`).
    pub queue_full: u64,
    pub send_failed: u64,
}

#[derive(Debug)]
pub struct Impairment {
    loss: Loss,
    line: DelayLine<Outgoing>,
    delay_line_bytes: usize,
    counters: Counters,
    /// Which wire packets of the current frame are lost; kept to avoid an allocation
    /// per frame.
    lost: Vec<bool>,
}

impl Impairment {
    pub fn new(config: ImpairmentConfig) -> Impairment {
        Impairment {
            loss: Loss::new(config.loss, config.seed),
            line: DelayLine::new(config.delay, config.delay_line_bytes),
            delay_line_bytes: config.delay_line_bytes,
            counters: Counters::default(),
            lost: Vec::new(),
        }
    }

    /// Takes a frame read at `now`; copies what it queues.
    pub fn on_frame(&mut self, now: Duration, frame: &[u8]) -> Verdict {
        let checked = VnetHeader::parse(frame)
            .and_then(|(header, packet)| Ok((header, packet, packet::ethertype(packet)?)));
        let (header, packet, ethertype) = match checked {
            Ok(checked) => checked,
            Err(malformed) => {
                self.counters.packets_in += 1;
                self.counters.bytes_in += frame.len() as u64;
                self.counters.malformed += 1;
                return Verdict::Malformed(malformed);
            }
        };
        let wire_packets = gso::wire_packets(&header, packet);
        self.counters.packets_in += wire_packets as u64;
        self.counters.bytes_in += packet.len() as u64;

        self.lost.clear();
        self.lost
            .extend((0..wire_packets).map(|_| self.loss.drops()));
        let lost = self.lost.iter().filter(|&&lost| lost).count();
        if lost == 0 {
            return self.queue(now, ethertype, header, wire_packets, packet);
        }
        let survivors = (lost < wire_packets)
            .then(|| gso::segment(&header, packet, |index| !self.lost[index]))
            .flatten();
        let Some(survivors) = survivors else {
            // All lost, or a frame that cannot be cut: it goes as a whole.
            self.counters.lost += wire_packets as u64;
            return Verdict::Lost;
        };
        self.counters.lost += lost as u64;
        let mut queued = 0;
        for survivor in survivors {
            let plain = VnetHeader::default();
            if self.queue(now, ethertype, plain, 1, &survivor) == Verdict::Queued {
                queued += 1;
            }
        }
        Verdict::PartlyLost { queued }
    }

    fn queue(
        &mut self,
        now: Duration,
        ethertype: u16,
        header: VnetHeader,
        wire_packets: usize,
        packet: &[u8],
    ) -> Verdict {
        // Checked before copying so a full line costs no allocation.
        if self.line.queued_bytes() + packet.len() > self.delay_line_bytes {
            self.counters.overflowed += wire_packets as u64;
            return Verdict::Overflowed;
        }
        let outgoing = Outgoing {
            ethertype,
            header,
            packet: packet.to_vec(),
            wire_packets,
        };
        match self.line.push(now, outgoing, packet.len()) {
            Ok(()) => Verdict::Queued,
            Err(_) => {
                self.counters.overflowed += wire_packets as u64;
                Verdict::Overflowed
            }
        }
    }

    /// The next frame due at `now`.
    pub fn poll_transmit(&mut self, now: Duration) -> Option<Outgoing> {
        self.line.pop_due(now)
    }

    /// When the next frame falls due, if one is waiting.
    pub fn poll_timeout(&self) -> Option<Duration> {
        self.line.next_release()
    }

    pub fn record_send(&mut self, outgoing: &Outgoing, outcome: SendOutcome) {
        let packets = outgoing.wire_packets as u64;
        match outcome {
            SendOutcome::Sent => {
                self.counters.packets_out += packets;
                self.counters.bytes_out += outgoing.packet.len() as u64;
            }
            SendOutcome::QueueFull => self.counters.queue_full += packets,
            SendOutcome::Failed => self.counters.send_failed += packets,
        }
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::{ETHERTYPE_IPV4, ETHERTYPE_IPV6};

    const MS: Duration = Duration::from_millis(1);

    /// A frame with a plain virtio header and an IPv4 packet of `size` bytes.
    fn ipv4(size: usize, tag: u8) -> Vec<u8> {
        let mut packet = vec![tag; size];
        packet[0] = 0x45;
        packet[2..4].copy_from_slice(&(size as u16).to_be_bytes());
        frame(VnetHeader::default(), &packet)
    }

    fn frame(header: VnetHeader, packet: &[u8]) -> Vec<u8> {
        let mut frame = header.to_bytes().to_vec();
        frame.extend_from_slice(packet);
        frame
    }

    /// A TCP super-packet of `segments` full segments of 1000 bytes.
    fn super_packet(segments: usize) -> Vec<u8> {
        let mut packet = vec![0u8; 40 + 1000 * segments];
        packet[0] = 0x45;
        let total = packet.len() as u16;
        packet[2..4].copy_from_slice(&total.to_be_bytes());
        packet[9] = 6;
        packet[32] = 0x50;
        let header = VnetHeader {
            gso_type: 1,
            gso_size: 1000,
            ..VnetHeader::default()
        };
        frame(header, &packet)
    }

    fn impairment(loss: f64, delay_line_bytes: usize) -> Impairment {
        Impairment::new(ImpairmentConfig {
            delay: 10 * MS,
            loss: LossModel::bernoulli(loss),
            seed: 1,
            delay_line_bytes,
        })
    }

    #[test]
    fn delays_valid_frames_and_counts_them() {
        let mut direction = impairment(0.0, 10_000);
        assert_eq!(
            direction.on_frame(Duration::ZERO, &ipv4(100, 1)),
            Verdict::Queued
        );
        let mut v6 = vec![0u8; 40];
        v6[0] = 0x60;
        let v6 = frame(VnetHeader::default(), &v6);
        assert_eq!(direction.on_frame(MS, &v6), Verdict::Queued);
        assert_eq!(direction.poll_timeout(), Some(10 * MS));
        assert_eq!(direction.poll_transmit(9 * MS), None);
        let first = direction.poll_transmit(10 * MS).unwrap();
        assert_eq!(
            (first.ethertype, first.header, first.wire_packets),
            (ETHERTYPE_IPV4, VnetHeader::default(), 1)
        );
        assert_eq!(first.packet, ipv4(100, 1)[gso::VNET_HEADER_BYTES..]);
        direction.record_send(&first, SendOutcome::Sent);
        let second = direction.poll_transmit(11 * MS).unwrap();
        assert_eq!(second.ethertype, ETHERTYPE_IPV6);
        direction.record_send(&second, SendOutcome::QueueFull);
        assert_eq!(
            direction.counters(),
            Counters {
                packets_in: 2,
                bytes_in: 140,
                packets_out: 1,
                bytes_out: 100,
                queue_full: 1,
                ..Counters::default()
            }
        );
    }

    #[test]
    fn drops_malformed_lost_and_overflowing_frames() {
        let mut direction = impairment(0.0, 250);
        assert_eq!(
            direction.on_frame(Duration::ZERO, &[0; 9]),
            Verdict::Malformed(Malformed::ShortVnetHeader { got: 9 })
        );
        assert_eq!(
            direction.on_frame(Duration::ZERO, &frame(VnetHeader::default(), &[0x45, 0, 0])),
            Verdict::Malformed(Malformed::ShortHeader { got: 3, needed: 20 })
        );
        assert_eq!(
            direction.on_frame(Duration::ZERO, &ipv4(200, 0)),
            Verdict::Queued
        );
        assert_eq!(
            direction.on_frame(Duration::ZERO, &ipv4(51, 0)),
            Verdict::Overflowed
        );
        let sent = direction.poll_transmit(10 * MS).unwrap();
        direction.record_send(&sent, SendOutcome::Failed);
        let mut lossy = impairment(1.0, 10_000);
        assert_eq!(lossy.on_frame(Duration::ZERO, &ipv4(100, 0)), Verdict::Lost);
        assert_eq!(lossy.poll_timeout(), None);

        let counters = direction.counters();
        assert_eq!(
            (
                counters.malformed,
                counters.overflowed,
                counters.send_failed
            ),
            (2, 1, 1)
        );
        assert_eq!(lossy.counters().lost, 1);
    }

    #[test]
    fn super_packets_lose_single_segments() {
        let mut direction = impairment(0.3, 1 << 24);
        let mut outcomes = (0, 0, 0);
        for _ in 0..200 {
            match direction.on_frame(Duration::ZERO, &super_packet(10)) {
                Verdict::Queued => outcomes.0 += 1,
                Verdict::PartlyLost { queued } => {
                    assert!((1..10).contains(&queued), "{queued}");
                    outcomes.1 += 1;
                }
                Verdict::Lost => outcomes.2 += 1,
                other => panic!("{other:?}"),
            }
        }
        // P(no loss in 10) = 0.7^10 = 2.8%, P(all lost) = 6e-6: nearly all are cut.
        assert!(outcomes.1 > 150, "{outcomes:?}");
        let counters = direction.counters();
        assert_eq!(counters.packets_in, 2000);
        let mut sent = 0;
        while let Some(outgoing) = direction.poll_transmit(10 * MS) {
            sent += outgoing.wire_packets as u64;
            if outgoing.wire_packets == 1 {
                assert_eq!(outgoing.packet.len(), 40 + 1000);
                assert_eq!(outgoing.header, VnetHeader::default());
            }
        }
        assert_eq!(sent + counters.lost, 2000);
        let rate = counters.lost as f64 / 2000.0;
        assert!((0.25..0.35).contains(&rate), "loss rate {rate}");
    }

    #[test]
    fn a_lossless_link_passes_super_packets_whole() {
        let mut direction = impairment(0.0, 1 << 20);
        assert_eq!(
            direction.on_frame(Duration::ZERO, &super_packet(40)),
            Verdict::Queued
        );
        let outgoing = direction.poll_transmit(10 * MS).unwrap();
        let whole = super_packet(40);
        let (header, packet) = VnetHeader::parse(&whole).unwrap();
        assert_eq!(outgoing.wire_packets, 40);
        assert_eq!((outgoing.header, &outgoing.packet[..]), (header, packet));
        assert_eq!(direction.counters().packets_in, 40);
    }

    #[test]
    fn malformed_frames_do_not_shift_the_seeded_losses() {
        let mut clean = impairment(0.5, 1 << 20);
        let mut noisy = impairment(0.5, 1 << 20);
        for i in 0..1000 {
            noisy.on_frame(Duration::ZERO, &[0xff; 12]);
            assert_eq!(
                clean.on_frame(Duration::ZERO, &ipv4(40, i as u8)),
                noisy.on_frame(Duration::ZERO, &ipv4(40, i as u8))
            );
        }
    }
}
