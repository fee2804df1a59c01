//! The simulated world's fixed rules: its timings, h(version), how actors are numbered,
//! and the seeded generator behind every random choice. Shared by the scenarios and
//! the driver.

use aurora_control::{ActorId, Version, WeightsHash};

/// Heartbeat period of simulated actors; the hub's timeout is four periods.
pub(crate) const HEARTBEAT_MS: u64 = 1_000;
/// How often an idle actor asks for work.
pub(crate) const POLL_MS: u64 = 250;
/// Time the trainer leaves for a delta to reach the actors before opening a step.
pub(crate) const DISSEMINATION_ALLOWANCE_MS: u64 = 600;
/// Most a simulated driver's timer fires after the hub's deadline: a real one is
/// late too, and lateness is what exercises the core's lazy checks.
pub(crate) const MAX_TIMER_LAG_MS: u64 = 2_000;
/// Warning window of a preemption notice; below the heartbeat timeout.
pub(crate) const PREEMPTION_GRACE_MS: u64 = 3_000;
/// Prompts and actors up to which the driver checks the whole state after every event
/// (beyond, less often: `driver::full_check_every`).
pub(crate) const FULL_CHECK_BUDGET: u64 = 1_024;
/// A step that takes longer than this has stalled.
pub(crate) const STEP_TIME_LIMIT_MS: u64 = 600_000;

/// splitmix64 (Steele, Lea and Flood, 2014), written out so that a seed replays the
/// same run whatever the versions of the dependencies.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..bound` (zero when the bound is zero); the modulo bias is
    /// irrelevant at simulation bounds.
    pub(crate) fn below(&mut self, bound: u64) -> u64 {
        if bound == 0 {
            0
        } else {
            self.next_u64() % bound
        }
    }

    /// Uniform in `low..=high`.
    pub(crate) fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.below(high.saturating_sub(low) + 1)
    }

    pub(crate) fn chance(&mut self, permille: u64) -> bool {
        self.below(1000) < permille
    }
}

/// h(version) in the simulated world.
pub(crate) fn weights_hash(version: Version) -> WeightsHash {
    let mut bytes = [0; 32];
    let mut rng = SplitMix64(version.0);
    for chunk in bytes.chunks_mut(8) {
        chunk.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    WeightsHash(bytes)
}

/// Actors are numbered from 1 at the hub, from 0 in the scenario.
pub(crate) fn actor_id(index: usize) -> ActorId {
    ActorId(index as u64 + 1)
}

pub(crate) fn actor_index(actor: ActorId) -> Option<usize> {
    actor
        .0
        .checked_sub(1)
        .and_then(|index| usize::try_from(index).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_the_reference_sequence() {
        // First outputs for seed 1234567 from the reference C implementation.
        let mut rng = SplitMix64(1_234_567);
        let outputs = [rng.next_u64(), rng.next_u64(), rng.next_u64()];
        assert_eq!(
            outputs,
            [
                6_457_827_717_110_365_317,
                3_203_168_211_198_807_973,
                9_817_491_932_198_370_423
            ]
        );
    }
}
