//! How long TCP takes to move a given number of bytes over a link.
//!
//! A transfer is slow start followed by the steady state. Each stream starts with an
//! initial window of [`INITIAL_WINDOW_SEGMENTS`] and doubles it every round trip until
//! the streams together reach their steady rate, which is the smallest of:
//!
//! * the link's rate times the goodput efficiency measured with BBR on a clean link
//!   (headers, pacing and the emulator's queue, [`TcpModel::goodput_efficiency`]);
//! * under CUBIC, the loss bound per stream, `C * MSS / (RTT * sqrt(loss))` (Mathis et
//!   al., 1997), with `C` fitted to `aurora wan bench` over lossy links rather than
//!   taken from the paper (where `C` is about 1.22 for Reno); BBR does not back off on
//!   random loss, so it has no such bound.
//!
//! Streams that share a bottleneck share its rate; [`TcpModel::fan_out_s`] divides a
//! sender's uplink between flows to several receivers by max-min fairness.

use super::calibration::{BBR_SWEEP, CUBIC_LOSSY};

/// Payload bytes per segment at a 1,500-byte MTU with timestamps.
pub const MSS_BYTES: f64 = 1_448.0;
/// Linux's initial congestion window (RFC 6928).
pub const INITIAL_WINDOW_SEGMENTS: f64 = 10.0;

/// The congestion control on every stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CongestionControl {
    /// Loss-based: each stream is bounded by its loss rate.
    Cubic,
    /// Model-based: fills the link whatever its random loss.
    Bbr,
}

/// One network path.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Bottleneck rate, bits per second.
    pub rate_bps: f64,
    /// Round-trip time, seconds.
    pub rtt_s: f64,
    /// Packet loss probability (random, not from congestion).
    pub loss: f64,
}

/// Receivers of a fan-out in one region, each a VM behind its own path of the region's
/// rate (a cross-cloud VM's bandwidth is its own): they share only the sender's uplink.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Flow {
    /// The path from the sender's uplink to each receiver.
    pub link: Link,
    /// Parallel TCP streams to each receiver.
    pub streams: u32,
    /// Receivers (the region's relay alone, or every actor without one).
    pub receivers: u32,
}

/// The transfer-time model with its two calibrated constants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TcpModel {
    /// `C` in the loss bound of a CUBIC stream.
    pub mathis_constant: f64,
    /// Goodput over the link's rate on a clean link.
    pub goodput_efficiency: f64,
}

impl TcpModel {
    /// The model fitted to this project's measurements: `C` is the median over the
    /// lossy CUBIC runs of goodput per stream over `MSS / (RTT sqrt(loss))`; the
    /// efficiency is the median goodput over rate of the clean BBR sweep.
    pub fn calibrated() -> TcpModel {
        let mut constants: Vec<f64> = CUBIC_LOSSY
            .iter()
            .map(|&(_, rtt_ms, loss, streams, goodput_mbps)| {
                let per_stream_bps = goodput_mbps * 1e6 / f64::from(streams);
                per_stream_bps / (MSS_BYTES * 8.0 / (rtt_ms / 1e3 * loss.sqrt()))
            })
            .collect();
        let mut efficiencies: Vec<f64> = BBR_SWEEP
            .iter()
            .map(|&(rate_mbps, _, _, _, goodput_mbps)| goodput_mbps / rate_mbps)
            .collect();
        TcpModel {
            mathis_constant: median(&mut constants),
            goodput_efficiency: median(&mut efficiencies),
        }
    }

    /// The most one stream can carry on `link` because of its loss, bits per second.
    pub fn loss_bound_bps(&self, link: Link, cc: CongestionControl) -> f64 {
        match cc {
            CongestionControl::Cubic if link.loss > 0.0 => {
                self.mathis_constant * MSS_BYTES * 8.0 / (link.rtt_s * link.loss.sqrt())
            }
            CongestionControl::Cubic | CongestionControl::Bbr => f64::INFINITY,
        }
    }

    /// Steady goodput of `streams` streams alone on `link`, bits per second.
    pub fn steady_bps(&self, link: Link, cc: CongestionControl, streams: u32) -> f64 {
        let usable = link.rate_bps * self.goodput_efficiency;
        (f64::from(streams.max(1)) * self.loss_bound_bps(link, cc)).min(usable)
    }

    /// Seconds to deliver `bytes` over `link` on `streams` fresh streams.
    pub fn transfer_s(&self, bytes: f64, link: Link, cc: CongestionControl, streams: u32) -> f64 {
        transfer_at_rate_s(
            bytes,
            link.rtt_s,
            streams,
            self.steady_bps(link, cc, streams),
        )
    }

    /// Seconds to deliver `bytes` on streams that carried a transfer before and kept
    /// their window (BBR keeps its path model across idle periods; aurora keeps its
    /// sessions between steps): no slow start.
    pub fn warm_transfer_s(
        &self,
        bytes: f64,
        link: Link,
        cc: CongestionControl,
        streams: u32,
    ) -> f64 {
        bytes * 8.0 / self.steady_bps(link, cc, streams) + link.rtt_s / 2.0
    }

    /// Seconds until every receiver of a fan-out has `bytes`: the flows share the
    /// sender's uplink (`uplink_bps`, before efficiency) by max-min fairness, each
    /// capped by its receivers' paths; the slowest flow finishes last.
    pub fn fan_out_s(
        &self,
        bytes: f64,
        flows: &[Flow],
        uplink_bps: f64,
        cc: CongestionControl,
    ) -> f64 {
        let caps: Vec<f64> = flows
            .iter()
            .map(|flow| f64::from(flow.receivers) * self.steady_bps(flow.link, cc, flow.streams))
            .collect();
        let shares = max_min_shares(&caps, uplink_bps * self.goodput_efficiency);
        flows
            .iter()
            .zip(shares)
            .map(|(flow, rate_bps)| {
                transfer_at_rate_s(
                    bytes,
                    flow.link.rtt_s,
                    flow.streams,
                    rate_bps / f64::from(flow.receivers.max(1)),
                )
            })
            .fold(0.0, f64::max)
    }
}

/// Slow start by whole round trips until the window carries `steady_bps` (or the bytes
/// run out), the rest at `steady_bps`, and half a round trip for the last byte to land.
fn transfer_at_rate_s(bytes: f64, rtt_s: f64, streams: u32, steady_bps: f64) -> f64 {
    let steady_window_bytes = steady_bps * rtt_s / 8.0;
    let mut window_bytes = f64::from(streams.max(1)) * INITIAL_WINDOW_SEGMENTS * MSS_BYTES;
    let (mut sent_bytes, mut elapsed_s) = (0.0, 0.0);
    // Doubling from one segment to any link this model meets takes under 64 rounds.
    for _ in 0..64 {
        if window_bytes >= steady_window_bytes || sent_bytes + window_bytes >= bytes {
            break;
        }
        sent_bytes += window_bytes;
        elapsed_s += rtt_s;
        window_bytes *= 2.0;
    }
    elapsed_s + (bytes - sent_bytes) * 8.0 / steady_bps + rtt_s / 2.0
}

/// Water-filling: each claimant gets an equal share of `capacity` or its cap, whichever
/// is less, and what capped claimants leave is shared again among the rest.
fn max_min_shares(caps: &[f64], capacity: f64) -> Vec<f64> {
    let mut shares = vec![0.0; caps.len()];
    let mut open: Vec<usize> = (0..caps.len()).collect();
    let mut left = capacity;
    while !open.is_empty() {
        let equal = left / open.len() as f64;
        let (capped, rest): (Vec<usize>, Vec<usize>) =
            open.iter().partition(|&&index| caps[index] <= equal);
        if capped.is_empty() {
            for index in rest {
                shares[index] = equal;
            }
            break;
        }
        for index in capped {
            shares[index] = caps[index];
            left -= caps[index];
        }
        open = rest;
    }
    shares
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    if values.len().is_multiple_of(2) {
        (values[middle - 1] + values[middle]) / 2.0
    } else {
        values[middle]
    }
}

#[cfg(test)]
mod tests {
    use super::super::calibration::TRANSPORT_TRANSFERS;
    use super::*;

    fn clean(rate_bps: f64, rtt_s: f64) -> Link {
        Link {
            rate_bps,
            rtt_s,
            loss: 0.0,
        }
    }

    #[test]
    fn calibration_lands_near_the_textbook_constants() {
        let model = TcpModel::calibrated();
        assert!(
            (1.2..3.5).contains(&model.mathis_constant),
            "{model:?}: Reno's 1.22 and CUBIC's gain over it bound C"
        );
        assert!(
            (0.9..0.965).contains(&model.goodput_efficiency),
            "{model:?}"
        );
    }

    #[test]
    fn matches_a_hand_computation() {
        let model = TcpModel {
            mathis_constant: 1.0,
            goodput_efficiency: 1.0,
        };
        // 1 Mbps, 100 ms: the steady window is 12,500 bytes, below the first window of
        // 14,480, so there is no slow start: 1 MB at 1 Mbps is 8 s, plus 50 ms.
        let slow = model.transfer_s(1e6, clean(1e6, 0.1), CongestionControl::Bbr, 1);
        assert!((slow - 8.05).abs() < 1e-9, "{slow}");
        // 1 Gbps, 10 ms: the steady window is 1.25 MB. Windows of 14,480 bytes doubling
        // for 7 rounds (ending at 926,720 < 1.25 MB) send 1,838,960 bytes in 70 ms; the
        // remaining 8,161,040 bytes of 10 MB take 65.28832 ms; plus 5 ms.
        let fast = model.transfer_s(1e7, clean(1e9, 0.01), CongestionControl::Bbr, 1);
        assert!((fast - 0.140_288_32).abs() < 1e-9, "{fast}");
        // The loss bound: C * MSS * 8 / (RTT sqrt(p)) = 11,584 / (0.1 * 0.01) bps.
        let lossy = Link {
            rate_bps: 1e9,
            rtt_s: 0.1,
            loss: 1e-4,
        };
        let bound = model.steady_bps(lossy, CongestionControl::Cubic, 1);
        assert!((bound - 11_584_000.0).abs() < 1e-3, "{bound}");
        assert_eq!(model.steady_bps(lossy, CongestionControl::Bbr, 1), 1e9);
    }

    #[test]
    fn more_rate_or_more_streams_never_take_longer() {
        let model = TcpModel::calibrated();
        let lossy = |rate_bps| Link {
            rate_bps,
            rtt_s: 0.05,
            loss: 1e-4,
        };
        for bytes in [1e5, 1e7, 1e9, 1e11] {
            for cc in [CongestionControl::Cubic, CongestionControl::Bbr] {
                let mut previous = f64::INFINITY;
                for rate_bps in [1e8, 2.5e8, 1e9, 1e10] {
                    let time = model.transfer_s(bytes, lossy(rate_bps), cc, 4);
                    assert!(time <= previous, "{bytes} {cc:?} {rate_bps}");
                    previous = time;
                }
                let mut previous = f64::INFINITY;
                for streams in [1, 2, 4, 8, 16, 64] {
                    let time = model.transfer_s(bytes, lossy(1e9), cc, streams);
                    assert!(time <= previous, "{bytes} {cc:?} {streams}");
                    previous = time;
                }
            }
        }
    }

    #[test]
    fn a_warm_transfer_skips_slow_start() {
        let model = TcpModel::calibrated();
        let link = clean(1e10, 0.03);
        let cold = model.transfer_s(2e8, link, CongestionControl::Bbr, 4);
        let warm = model.warm_transfer_s(2e8, link, CongestionControl::Bbr, 4);
        let steady_s = 2e8 * 8.0 / (1e10 * model.goodput_efficiency);
        assert!((warm - steady_s - 0.015).abs() < 1e-12, "{warm}");
        assert!(cold > warm + 5.0 * 0.03, "{cold} {warm}");
    }

    #[test]
    fn small_transfers_are_bound_by_slow_start_not_by_the_rate() {
        let model = TcpModel::calibrated();
        let rtt_s = 0.05;
        let time =
            |rate_bps| model.transfer_s(5e6, clean(rate_bps, rtt_s), CongestionControl::Bbr, 1);
        // Ten times the rate buys far less than ten times the speed: 5 MB needs about
        // 8 round trips of doubling whatever the link.
        assert!(time(1e9) / time(1e10) < 1.5, "{} {}", time(1e9), time(1e10));
        assert!(time(1e10) > 8.0 * rtt_s);
    }

    #[test]
    fn streams_on_a_lossy_link_add_up_until_the_link_is_full() {
        let model = TcpModel::calibrated();
        let lossy = Link {
            rate_bps: 1e9,
            rtt_s: 0.03,
            loss: 0.001,
        };
        let one = model.steady_bps(lossy, CongestionControl::Cubic, 1);
        assert!((model.steady_bps(lossy, CongestionControl::Cubic, 4) / one - 4.0).abs() < 1e-9);
        let many = model.steady_bps(lossy, CongestionControl::Cubic, 1000);
        assert!((many - 1e9 * model.goodput_efficiency).abs() < 1.0);
    }

    #[test]
    fn fan_out_shares_the_uplink_and_never_beats_one_receiver() {
        let model = TcpModel::calibrated();
        let link = clean(1e9, 0.04);
        let flow = |receivers| Flow {
            link,
            streams: 4,
            receivers,
        };
        let alone = model.transfer_s(1e8, link, CongestionControl::Bbr, 4);
        let one = model.fan_out_s(1e8, &[flow(1)], 1e10, CongestionControl::Bbr);
        assert!((one - alone).abs() < 1e-9, "{one} {alone}");
        // Three regions each behind their own 1 Gbps path, on a 1 Gbps uplink: the
        // uplink carries three copies.
        let three = model.fan_out_s(
            1e8,
            &[flow(1), flow(1), flow(1)],
            1e9,
            CongestionControl::Bbr,
        );
        let uplink_s = 3e8 * 8.0 / (1e9 * model.goodput_efficiency);
        assert!(
            three > uplink_s && three < 3.0 * alone,
            "{three} {alone} {uplink_s}"
        );
        // Two receivers, each behind a path of its own: as fast as one while the uplink
        // carries both, as slow as two copies through it when it does not.
        let both = model.fan_out_s(1e8, &[flow(2)], 1e10, CongestionControl::Bbr);
        assert!((both - alone).abs() < 1e-9, "{both} {alone}");
        let squeezed = model.fan_out_s(1e8, &[flow(2)], 1e9, CongestionControl::Bbr);
        let two_copies_s = 2e8 * 8.0 / (1e9 * model.goodput_efficiency);
        assert!(
            squeezed > two_copies_s && squeezed < 2.0 * alone,
            "{squeezed} {alone}"
        );
    }

    #[test]
    fn predicts_the_segment_transport_within_a_quarter() {
        let model = TcpModel::calibrated();
        for (bytes, rate_mbps, rtt_ms, streams, measured_s) in TRANSPORT_TRANSFERS {
            let link = clean(rate_mbps * 1e6, rtt_ms / 1e3);
            let predicted_s = model.transfer_s(bytes, link, CongestionControl::Bbr, streams);
            let error = predicted_s / measured_s - 1.0;
            assert!(
                error.abs() < 0.25,
                "{bytes} bytes on {streams}: {predicted_s} s against {measured_s} s"
            );
        }
    }
}
