//! Choosing the number of parallel streams from what they deliver
//! (docs/wire-protocol.md §6.5).
//!
//! Parallel TCP streams help on long fat links (each stream's window grows on its own,
//! a loss halves one stream, not all) and cost fairness and memory elsewhere. The tuner
//! hill-climbs on measured goodput: from the configured count (the start and upper
//! bound) it probes one stream fewer and keeps the cut when goodput does not drop, and
//! probes one more (up to the bound) and keeps it only when goodput rises. After a probe
//! that did not pay it holds for a few intervals.

/// Relative goodput change that counts as a gain or a loss; smaller changes are noise.
pub const TUNER_TOLERANCE: f64 = 0.05;
/// Intervals to wait after a probe that did not pay.
pub const TUNER_HOLD_INTERVALS: u32 = 4;

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Steady { hold: u32 },
    Probing { step: i8, baseline: f64 },
}

#[derive(Debug, Clone)]
pub struct StreamTuner {
    max: u8,
    current: u8,
    state: State,
}

impl StreamTuner {
    pub fn new(max: u8) -> StreamTuner {
        assert!(max > 0, "at least one stream");
        StreamTuner {
            max,
            current: max,
            state: State::Steady { hold: 0 },
        }
    }

    pub fn current(&self) -> u8 {
        self.current
    }

    /// Takes the goodput (bytes per second) of the last interval, run at
    /// [`StreamTuner::current`] streams, and returns the count for the next one. An idle
    /// interval (zero goodput) says nothing and changes nothing.
    pub fn observe(&mut self, goodput: f64) -> u8 {
        if goodput <= 0.0 {
            return self.current;
        }
        match self.state {
            State::Steady { hold } if hold > 0 => {
                self.state = State::Steady { hold: hold - 1 };
            }
            State::Steady { .. } => {
                let step = if self.current < self.max { 1 } else { -1 };
                if step < 0 && self.current == 1 {
                    self.state = State::Steady {
                        hold: TUNER_HOLD_INTERVALS,
                    };
                } else {
                    self.probe(step, goodput);
                }
            }
            State::Probing { step, baseline } => {
                let paid = if step > 0 {
                    goodput > baseline * (1.0 + TUNER_TOLERANCE)
                } else {
                    goodput >= baseline * (1.0 - TUNER_TOLERANCE)
                };
                let can_continue = if step > 0 {
                    self.current < self.max
                } else {
                    self.current > 1
                };
                if !paid {
                    self.current = (i16::from(self.current) - i16::from(step)) as u8;
                    self.state = State::Steady {
                        hold: TUNER_HOLD_INTERVALS,
                    };
                } else if can_continue {
                    // Keep comparing against the best goodput seen on the way.
                    self.probe(step, goodput.max(baseline));
                } else {
                    self.state = State::Steady {
                        hold: TUNER_HOLD_INTERVALS,
                    };
                }
            }
        }
        self.current
    }

    fn probe(&mut self, step: i8, baseline: f64) {
        self.current = (i16::from(self.current) + i16::from(step)) as u8;
        self.state = State::Probing { step, baseline };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the tuner against a link whose goodput depends on the stream count only.
    fn settle(max: u8, goodput: impl Fn(u8) -> f64, intervals: usize) -> Vec<u8> {
        let mut tuner = StreamTuner::new(max);
        (0..intervals)
            .map(|_| tuner.observe(goodput(tuner.current())))
            .collect()
    }

    #[test]
    fn shrinks_while_fewer_streams_lose_nothing() {
        // A link one stream fills: every stream count gives the same goodput.
        let counts = settle(8, |_| 100.0, 12);
        assert_eq!(*counts.last().unwrap(), 1);
    }

    #[test]
    fn keeps_the_streams_a_window_limited_link_needs() {
        // Each stream is limited to 10 units (window / RTT) on a link of 40.
        let counts = settle(8, |n| (10.0 * f64::from(n)).min(40.0), 30);
        assert!(
            counts[10..].iter().all(|&n| (4..=5).contains(&n)),
            "{counts:?}"
        );
    }

    #[test]
    fn never_exceeds_the_bound_nor_goes_below_one() {
        let counts = settle(3, |n| f64::from(n) * 1000.0, 40);
        assert!(counts.iter().all(|&n| (1..=3).contains(&n)));
        assert_eq!(*counts.last().unwrap(), 3);
    }

    #[test]
    fn idle_intervals_change_nothing() {
        let mut tuner = StreamTuner::new(4);
        for _ in 0..10 {
            assert_eq!(tuner.observe(0.0), 4);
        }
    }
}
