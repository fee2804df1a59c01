//! How long a lease lasts.
//!
//! **Lease lifetime rule.** A lease lasts `multiplier * median` of the most recent
//! completion times (issue to accepted result, of a job's first lease only: a job
//! issued again goes out at the step's tail in a small claim, and its time says
//! nothing of a batch's), with the multiplier between 2 and 3,
//! clamped to `[min_ms, max_ms]`; before any completion is known it lasts
//! `initial_ms`. An expired lease counts as a completion that took its whole lifetime
//! (it took at least that long), so that the lifetime grows when the pool slows down
//! instead of only ever sampling the jobs fast enough to beat their lease.
//!
//! The median rather than the mean, because one actor stuck behind a partition would
//! drag a mean up and with it every lease, delaying the detection of the next failure.
//! Two to three times, because with the batch split in proportion to throughput every
//! actor should finish near the median, so a lease that runs out
//! at twice to three times that is a strong sign the holder is gone or crawling, while
//! leaving room for the ordinary spread in response lengths.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// Most completion samples the median may be taken over. The median is computed by
/// sorting a copy once per claim, so the window must stay small.
pub const MAX_COMPLETION_WINDOW: u16 = 4096;

/// Lease lifetime settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseConfig {
    /// Lifetime before any completion time is known.
    pub initial_ms: u64,
    /// Shortest lifetime, however fast recent completions were.
    pub min_ms: u64,
    /// Longest lifetime, however slow recent completions were.
    pub max_ms: u64,
    /// Lifetime as a percentage of the median completion time, 200..=300.
    pub median_multiplier_percent: u16,
    /// How many recent completion times (one per job) the median is taken over,
    /// 1..=[`MAX_COMPLETION_WINDOW`]. It should span at least one step's batch: an
    /// actor generates its claim as one batch, so a job's completion time is the time
    /// of the claim it came in. Over a whole step, the median is that of the claims
    /// that carried most of the batch; over a short window it is that of the small
    /// re-issues at the step's tail, which finish fast and would cut every lease of
    /// the next step short.
    pub completion_window: u16,
}

/// Recent completion times and the lease lifetime they imply.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LeaseTimer {
    recent_completions_ms: VecDeque<u64>,
}

impl LeaseTimer {
    /// Remembers how long a job took from issue to result (or to expiry).
    pub(crate) fn record_completion(&mut self, elapsed_ms: u64, config: &LeaseConfig) {
        let window = usize::from(config.completion_window.clamp(1, MAX_COMPLETION_WINDOW));
        while self.recent_completions_ms.len() >= window {
            self.recent_completions_ms.pop_front();
        }
        self.recent_completions_ms.push_back(elapsed_ms);
    }

    /// How many completion samples are held.
    pub(crate) fn len(&self) -> usize {
        self.recent_completions_ms.len()
    }

    /// The lifetime of a lease issued now.
    pub(crate) fn lease_ms(&self, config: &LeaseConfig) -> u64 {
        let Some(median_ms) = self.median_completion_ms() else {
            return config.initial_ms;
        };
        let scaled = median_ms.saturating_mul(u64::from(config.median_multiplier_percent)) / 100;
        scaled.clamp(config.min_ms, config.max_ms)
    }

    /// The upper median: with an even count, the larger middle value, erring toward
    /// longer leases.
    fn median_completion_ms(&self) -> Option<u64> {
        let mut sorted: Vec<u64> = self.recent_completions_ms.iter().copied().collect();
        sorted.sort_unstable();
        sorted.get(sorted.len() / 2).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: LeaseConfig = LeaseConfig {
        initial_ms: 30_000,
        min_ms: 1_000,
        max_ms: 60_000,
        median_multiplier_percent: 250,
        completion_window: 4,
    };

    fn check_lease_ms(completions_ms: &[u64], expected_ms: u64) {
        let mut timer = LeaseTimer::default();
        for &elapsed_ms in completions_ms {
            timer.record_completion(elapsed_ms, &CONFIG);
        }
        assert_eq!(
            timer.lease_ms(&CONFIG),
            expected_ms,
            "after {completions_ms:?}"
        );
    }

    #[test]
    fn lease_is_a_multiple_of_the_recent_median() {
        check_lease_ms(&[], 30_000);
        check_lease_ms(&[4_000], 10_000);
        // One straggler does not move the median.
        check_lease_ms(&[4_000, 4_000, 50_000], 10_000);
        // Even count: the upper median.
        check_lease_ms(&[2_000, 4_000], 10_000);
    }

    #[test]
    fn lease_is_clamped_to_its_bounds() {
        check_lease_ms(&[10], 1_000);
        check_lease_ms(&[100_000], 60_000);
        check_lease_ms(&[u64::MAX], 60_000);
    }

    #[test]
    fn only_the_configured_window_of_completions_counts() {
        // The four slow samples push the four fast ones out of the window.
        check_lease_ms(
            &[1_000, 1_000, 1_000, 1_000, 8_000, 8_000, 8_000, 8_000],
            20_000,
        );
        let mut timer = LeaseTimer::default();
        for elapsed_ms in 0..100 {
            timer.record_completion(elapsed_ms, &CONFIG);
        }
        assert_eq!(
            timer.recent_completions_ms.len(),
            usize::from(CONFIG.completion_window)
        );
    }
}
