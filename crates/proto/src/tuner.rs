//! Choosing the number of parallel streams from what they deliver
//! (docs/wire-protocol.md §6.5).
//!
//! Parallel TCP streams help where each flow is held below the link's rate by its own
//! window or by random loss (CUBIC on a lossy long link), and cost fairness, memory and
//! a share of every flow's slow start where one flow fills the link (BBR). So the tuner
//! starts with one stream and adds one at a time, keeping on while each addition raises
//! goodput by more than [`TUNER_TOLERANCE`]; the first addition that does not pay, or the
//! upper bound, ends the probing.
//!
//! It never removes a stream. A stream closed mid-transfer discards the segments in
//! flight on it (up to the sender's window of megabyte segments, sent again) and the
//! remaining flows take about a second to claim its share (BENCHMARKS.md, "Stream counts
//! and congestion control on the lossy link"), which costs more than the one stream too
//! many a probe that did not pay leaves open.
//!
//! A long session's path changes (a loss episode, competing flows), and what did not pay
//! when probing may pay then. Once settled, the tuner probes again when goodput stays
//! below the settled level by more than [`REPROBE_DROP`] for [`REPROBE_INTERVALS`] busy
//! intervals in a row. Only consecutive busy intervals count: the intervals at either
//! end of a transfer are partly idle and would look like a drop. A probe that does not
//! pay makes the lower goodput the new reference, so a path that stays slower costs one
//! probe, not a stream per interval.

/// Relative goodput gain an added stream must bring to be followed by another; smaller
/// changes are noise.
pub const TUNER_TOLERANCE: f64 = 0.05;
/// Relative fall of goodput below the settled reference that may start a new probe.
pub const REPROBE_DROP: f64 = 0.25;
/// Busy intervals in a row below the reference before probing again.
pub const REPROBE_INTERVALS: u8 = 3;

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// The first busy interval holds connection set-up and slow start, not the rate of
    /// the count: it is skipped.
    Warming,
    /// The next busy interval is the baseline of the current count.
    Measuring,
    /// One stream was just added; `baseline` is the goodput of the count before.
    Probing { baseline: f64 },
    /// Probing is over; `reference` is the goodput it settled at (raised by any better
    /// interval since), `below` the busy intervals in a row short of it.
    Settled { reference: f64, below: u8 },
}

#[derive(Debug, Clone)]
pub struct StreamTuner {
    max: u8,
    current: u8,
    state: State,
}

impl StreamTuner {
    /// A tuner for a session of at most `max` streams; it starts with one.
    pub fn new(max: u8) -> StreamTuner {
        assert!(max > 0, "at least one stream");
        StreamTuner {
            max,
            current: 1,
            state: State::Warming,
        }
    }

    pub fn current(&self) -> u8 {
        self.current
    }

    /// Takes the goodput (bytes per second) of the last interval, run at
    /// [`StreamTuner::current`] streams, and returns the count for the next one, never
    /// lower. An idle interval (zero goodput) measures nothing; it only breaks a run of
    /// slow intervals.
    pub fn observe(&mut self, goodput: f64) -> u8 {
        if goodput <= 0.0 {
            if let State::Settled { below, .. } = &mut self.state {
                *below = 0;
            }
            return self.current;
        }
        self.state = match self.state {
            State::Warming => State::Measuring,
            State::Measuring => self.probe(goodput),
            State::Probing { baseline } if goodput > baseline * (1.0 + TUNER_TOLERANCE) => {
                self.probe(goodput)
            }
            State::Probing { baseline } => State::Settled {
                reference: baseline.max(goodput),
                below: 0,
            },
            State::Settled { reference, below } if goodput < reference * (1.0 - REPROBE_DROP) => {
                if below + 1 >= REPROBE_INTERVALS {
                    self.probe(goodput)
                } else {
                    State::Settled {
                        reference,
                        below: below + 1,
                    }
                }
            }
            State::Settled { reference, .. } => State::Settled {
                reference: reference.max(goodput),
                below: 0,
            },
        };
        self.current
    }

    /// Adds a stream, measured against `baseline`, unless the bound is reached.
    fn probe(&mut self, baseline: f64) -> State {
        if self.current < self.max {
            self.current += 1;
            State::Probing { baseline }
        } else {
            State::Settled {
                reference: baseline,
                below: 0,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the tuner against a link whose goodput depends on the stream count only
    /// (after a first interval of slow start at a tenth of it); returns the count after
    /// each interval.
    fn settle(max: u8, goodput: impl Fn(u8) -> f64, intervals: usize) -> Vec<u8> {
        let mut tuner = StreamTuner::new(max);
        (0..intervals)
            .map(|interval| {
                let rate = goodput(tuner.current());
                tuner.observe(if interval == 0 { rate / 10.0 } else { rate })
            })
            .collect()
    }

    #[test]
    fn starts_with_one_stream() {
        assert_eq!(StreamTuner::new(16).current(), 1);
    }

    #[test]
    fn one_stream_that_fills_the_link_gets_one_companion_at_most() {
        // BBR on a lossy link: every count gives the same goodput. The slow first
        // interval must not pass for a gain.
        let counts = settle(8, |_| 100.0, 12);
        assert_eq!(counts, [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]);
    }

    #[test]
    fn adds_the_streams_a_window_limited_link_needs() {
        // Each stream is limited to 10 units (window / RTT, or loss) on a link of 40.
        let counts = settle(8, |n| (10.0 * f64::from(n)).min(40.0), 30);
        assert_eq!(&counts[..6], [1, 2, 3, 4, 5, 5]);
        assert!(counts[5..].iter().all(|&n| n == 5), "{counts:?}");
    }

    #[test]
    fn never_exceeds_the_bound() {
        let counts = settle(3, |n| f64::from(n) * 1000.0, 40);
        assert!(counts.iter().all(|&n| (1..=3).contains(&n)));
        assert_eq!(*counts.last().unwrap(), 3);
        let counts = settle(1, |n| f64::from(n) * 1000.0, 10);
        assert!(counts.iter().all(|&n| n == 1));
    }

    #[test]
    fn never_sheds_a_stream() {
        // Goodput that falls after the probing (a competing flow arrives), in bursts
        // too short to probe again.
        let mut tuner = StreamTuner::new(8);
        for goodput in [10.0, 100.0, 200.0, 300.0, 310.0] {
            tuner.observe(goodput);
        }
        assert_eq!(tuner.current(), 4);
        for goodput in [50.0, 20.0, 400.0, 5.0] {
            assert_eq!(tuner.observe(goodput), 4);
        }
    }

    #[test]
    fn a_sustained_drop_probes_again_while_streams_pay() {
        // Settled on a link one stream fills; then loss caps each stream at 20.
        let mut tuner = StreamTuner::new(8);
        for goodput in [10.0, 100.0, 100.0] {
            tuner.observe(goodput);
        }
        assert_eq!(tuner.current(), 2);
        let lossy = |n: u8| (20.0 * f64::from(n)).min(100.0);
        let counts: Vec<u8> = (0..12)
            .map(|_| tuner.observe(lossy(tuner.current())))
            .collect();
        // Two intervals below, the third probes; then every stream pays up to 5.
        assert_eq!(&counts[..3], [2, 2, 3]);
        assert_eq!(*counts.last().unwrap(), 6, "{counts:?}");
        assert!(counts.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn a_path_that_stays_slower_costs_one_probe() {
        let mut tuner = StreamTuner::new(8);
        for goodput in [10.0, 100.0, 100.0] {
            tuner.observe(goodput);
        }
        assert_eq!(tuner.current(), 2);
        // The link now gives 50 whatever the count.
        let counts: Vec<u8> = (0..20).map(|_| tuner.observe(50.0)).collect();
        assert_eq!(counts[2], 3);
        assert!(counts[3..].iter().all(|&n| n == 3), "{counts:?}");
    }

    #[test]
    fn partly_idle_intervals_between_transfers_do_not_probe() {
        // Short transfers: each shows one slow interval between idle ones.
        let mut tuner = StreamTuner::new(8);
        for goodput in [10.0, 100.0, 100.0] {
            tuner.observe(goodput);
        }
        for _ in 0..20 {
            assert_eq!(tuner.observe(30.0), 2);
            assert_eq!(tuner.observe(0.0), 2);
            assert_eq!(tuner.observe(10.0), 2);
            assert_eq!(tuner.observe(0.0), 2);
        }
    }

    #[test]
    fn a_gain_within_the_tolerance_ends_the_probing() {
        let mut tuner = StreamTuner::new(8);
        tuner.observe(10.0);
        assert_eq!(tuner.observe(100.0), 2);
        assert_eq!(tuner.observe(100.0 * (1.0 + TUNER_TOLERANCE)), 2);
        assert_eq!(tuner.observe(1000.0), 2);
    }

    #[test]
    fn idle_intervals_change_nothing() {
        let mut tuner = StreamTuner::new(4);
        for _ in 0..10 {
            assert_eq!(tuner.observe(0.0), 1);
        }
        // Nor do they count as the warm-up or the baseline.
        tuner.observe(10.0);
        assert_eq!(tuner.observe(0.0), 1);
        assert_eq!(tuner.observe(100.0), 2);
        assert_eq!(tuner.observe(0.0), 2);
        assert_eq!(tuner.observe(200.0), 3);
    }
}
