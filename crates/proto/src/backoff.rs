//! How long to wait before the next try of something that failed: an upstream session,
//! a call of the control plane. Every retry loop of a node uses this one policy.
//!
//! The wait doubles with each failure in a row, from `base` up to `max`, and is drawn
//! uniformly from the upper half of that bound ("equal jitter"): never less than half
//! of it, so a node that keeps failing slows down whatever it draws, and never the same
//! for two nodes, so the actors of a relay that went down do not all come back at the
//! same instant. The draws come from a small generator seeded by the caller (the
//! driver from the operating system, the simulation from its seed), so this stays free
//! of I/O and deterministic under test.

use std::time::Duration;

/// Exponential backoff with equal jitter.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    failures: u32,
    /// SplitMix64's state: one 64-bit draw per wait.
    state: u64,
}

impl Backoff {
    /// A backoff from `base` (the first wait's bound) up to `max`, drawing from `seed`.
    pub fn new(base: Duration, max: Duration, seed: u64) -> Backoff {
        Backoff {
            base,
            max: max.max(base),
            failures: 0,
            state: seed,
        }
    }

    /// Failures in a row so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// One more failure: the wait before the next try.
    pub fn failed(&mut self) -> Duration {
        let bound = self
            .base
            .checked_mul(1u32.checked_shl(self.failures).unwrap_or(u32::MAX))
            .map_or(self.max, |bound| bound.min(self.max));
        self.failures = self.failures.saturating_add(1);
        let half = bound / 2;
        half + bound.saturating_sub(half).mul_f64(self.unit())
    }

    /// The thing worked: the next failure waits `base` at most again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// A draw in [0, 1).
    fn unit(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(5);

    #[test]
    fn waits_double_up_to_the_cap_never_below_half_the_bound() {
        let mut backoff = Backoff::new(BASE, MAX, 7);
        let mut bound = BASE;
        for _ in 0..40 {
            let wait = backoff.failed();
            assert!(
                wait >= bound / 2 && wait <= bound,
                "{wait:?} against {bound:?}"
            );
            bound = (bound * 2).min(MAX);
        }
        assert_eq!(backoff.failures(), 40);
        backoff.reset();
        assert!(backoff.failed() <= BASE);
    }

    #[test]
    fn nodes_seeded_apart_draw_apart_and_a_seed_repeats_its_draws() {
        let draws = |seed| {
            let mut backoff = Backoff::new(BASE, MAX, seed);
            (0..8).map(|_| backoff.failed()).collect::<Vec<_>>()
        };
        assert_eq!(draws(1), draws(1));
        assert_ne!(draws(1), draws(2));
        // A hundred failing nodes do not all retry at once: their first waits spread
        // over the upper half of the bound.
        let firsts: std::collections::BTreeSet<_> = (0..100).map(|seed| draws(seed)[0]).collect();
        assert!(firsts.len() > 90, "{}", firsts.len());
    }

    #[test]
    fn a_failure_count_past_any_shift_stays_at_the_cap() {
        let mut backoff = Backoff::new(BASE, MAX, 3);
        backoff.failures = u32::MAX - 1;
        for _ in 0..3 {
            let wait = backoff.failed();
            assert!(wait >= MAX / 2 && wait <= MAX, "{wait:?}");
        }
    }
}
