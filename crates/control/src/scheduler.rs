//! Who may work on a step and how much: the paper's Algorithm 1, made exact.
//!
//! * **Eligibility.** For a step on version `v`, an actor is eligible if its active
//!   version is `v`, or if it is `v - 1` with `v` staged; the latter must apply
//!   `Commit(v)` before its work. Anyone else is behind: gets nothing this step, and its
//!   estimate decays (below).
//! * **Split.** Eligible actor `a` gets `B_a = floor(B * tau_a / T)` jobs, `T` the sum
//!   of eligible estimates; the `B - sum(B_a)` left over go one each to the largest
//!   fractional remainders, so exactly `B` are assigned and nobody is more than one job
//!   from its exact share. Estimates are integers (milli-tokens per second), so the
//!   split is computed exactly in integer arithmetic rather than with floating point
//!   that could hand out `B + 1`.
//! * **Settlement.** Each settled submission updates `tau_a <- beta * tau_a +
//!   (1 - beta) * tokens / elapsed`.
//! * **Decay.** Each step an actor is too far behind to be eligible, `tau_a <- alpha *
//!   tau_a`: an actor that keeps falling behind is probably slower than its estimate
//!   says (or its link is), so when it comes back it starts with a smaller share
//!   and earns its way up.
//! * **New actors** start from a conservative estimate (the slowest known actor, or a
//!   floor): underestimating costs one step of idle time, overestimating costs expired
//!   leases and a late step.

use serde::{Deserialize, Serialize};

use crate::values::{Permille, Version};

/// A throughput (estimate or measurement) in milli-tokens per second. Thousandths keep
/// slow CPU actors (a few tokens per second) distinguishable while staying in exact
/// integer arithmetic. The unit is in the name and the value behind constructors, so a
/// tokens-per-second number cannot be passed where thousandths are meant.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct MilliTokensPerS(u64);

impl MilliTokensPerS {
    /// No throughput at all.
    pub const ZERO: MilliTokensPerS = MilliTokensPerS(0);

    /// A rate given in thousandths of a token per second.
    pub const fn from_milli_tokens_per_s(milli_tokens_per_s: u64) -> MilliTokensPerS {
        MilliTokensPerS(milli_tokens_per_s)
    }

    /// The rate in thousandths of a token per second.
    pub const fn milli_tokens_per_s(self) -> u64 {
        self.0
    }

    /// A whole number of tokens per second.
    pub const fn from_tokens_per_s(tokens_per_s: u64) -> MilliTokensPerS {
        MilliTokensPerS(tokens_per_s.saturating_mul(1000))
    }

    /// `tokens` generated in `elapsed_ms`, exactly; `None` for an empty interval, which
    /// carries no information about speed. See [`SchedulerConfig::plausible_sample`] for
    /// the bounded measurement the scheduler actually uses.
    pub fn measured(tokens: u64, elapsed_ms: u64) -> Option<MilliTokensPerS> {
        if elapsed_ms == 0 {
            return None;
        }
        let millitokens_per_s = u128::from(tokens) * 1_000_000 / u128::from(elapsed_ms);
        Some(MilliTokensPerS(
            u64::try_from(millitokens_per_s).unwrap_or(u64::MAX),
        ))
    }

    /// Tokens per second, for reports.
    pub fn tokens_per_s(self) -> f64 {
        // Precision loss above 2^53 milli-tokens/s is irrelevant for a report.
        self.0 as f64 / 1000.0
    }

    /// The moving average after one settlement: `weight * self + (1 - weight) * sample`.
    pub fn averaged_with(
        self,
        sample: MilliTokensPerS,
        weight_of_estimate: Permille,
    ) -> MilliTokensPerS {
        let weight = u128::from(weight_of_estimate.get());
        let sum = weight * u128::from(self.0) + (1000 - weight) * u128::from(sample.0);
        // A weighted mean of two u64 values fits in u64.
        MilliTokensPerS(u64::try_from((sum + 500) / 1000).unwrap_or(u64::MAX))
    }

    /// The estimate after one step spent behind: `alpha * self`.
    pub fn decayed(self, alpha: Permille) -> MilliTokensPerS {
        MilliTokensPerS(alpha.of(self.0))
    }
}

/// How a step's batch is divided among eligible actors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SplitPolicy {
    /// In proportion to throughput estimates (Algorithm 1).
    Proportional,
    /// Equal shares regardless of speed: the baseline the paper improves on, kept so
    /// the benchmark can measure the difference on the same code.
    Uniform,
}

/// The estimate a newly registered actor starts with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NewActorEstimate {
    /// Always this value.
    Fixed(MilliTokensPerS),
    /// The smallest estimate among current members, but never below `floor`; `floor`
    /// when there are none.
    MinimumOfKnown {
        /// Lower bound, and the value used for the first actor.
        floor: MilliTokensPerS,
    },
}

impl NewActorEstimate {
    /// The lowest estimate a newcomer can start from: the fixed value, or the floor.
    pub fn floor(self) -> MilliTokensPerS {
        match self {
            NewActorEstimate::Fixed(estimate) => estimate,
            NewActorEstimate::MinimumOfKnown { floor } => floor,
        }
    }

    /// The estimate for a newcomer given the estimates of the current members.
    pub fn for_newcomer(self, known: impl IntoIterator<Item = MilliTokensPerS>) -> MilliTokensPerS {
        match self {
            NewActorEstimate::Fixed(estimate) => estimate,
            NewActorEstimate::MinimumOfKnown { floor } => known
                .into_iter()
                .min()
                .map_or(floor, |slowest| slowest.max(floor)),
        }
    }
}

/// Scheduler settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// How batches are divided.
    pub split: SplitPolicy,
    /// `beta`: weight of the old estimate at each settlement. Higher is smoother and
    /// slower to follow drift.
    pub estimate_weight: Permille,
    /// `alpha`: factor applied to the estimate of an actor each step it is behind.
    pub behind_decay: Permille,
    /// Starting estimate of a new actor.
    pub new_actor_estimate: NewActorEstimate,
    /// Shortest interval a throughput sample is taken over: a submission arriving
    /// sooner after its leases were issued (or after the previous settlement) counts
    /// as if it took this long. Token counts are the actor's word; without a floor, a
    /// large count 1 ms after a claim would measure an absurd rate.
    pub min_sample_ms: u64,
    /// Highest rate a sample may measure, whatever the reported counts and times. It
    /// bounds the share one actor can claim with inflated counts in the long run;
    /// [`MAX_SAMPLE_GROWTH`] bounds how fast it can get there.
    pub max_sample_rate: MilliTokensPerS,
    /// `gamma`: factor applied to an actor's estimate when leases it held expire (once
    /// per call that finds any expired). An expiry is evidence the actor is slower
    /// than its estimate (or gone), so its share shrinks until results show otherwise.
    pub expiry_decay: Permille,
}

/// Most a settlement's sample may exceed the actor's current estimate, as a factor.
///
/// Token counts are the actor's word. Without this bound one inflated report would
/// move an estimate straight to `max_sample_rate` and buy its sender most of the next
/// batch; with it, a settlement can raise an estimate by at most `beta + (1 - beta) *
/// MAX_SAMPLE_GROWTH` (1.6x with the default `beta` of 0.8), while an honest actor
/// that really got faster still converges within a few settlements. The bound is
/// taken from at least the newcomer floor ([`NewActorEstimate::floor`]), so an estimate
/// decayed to nothing can still recover.
pub const MAX_SAMPLE_GROWTH: u64 = 4;

impl SchedulerConfig {
    /// The sample one settlement contributes to an actor whose estimate is `estimate`:
    /// `tokens` over `elapsed_ms` floored at `min_sample_ms`, capped at
    /// `max_sample_rate` and at [`MAX_SAMPLE_GROWTH`] times the larger of `estimate`
    /// and the newcomer floor.
    pub fn plausible_sample(
        &self,
        tokens: u64,
        elapsed_ms: u64,
        estimate: MilliTokensPerS,
    ) -> MilliTokensPerS {
        let growth_base = estimate.max(self.new_actor_estimate.floor());
        let growth_cap = MilliTokensPerS(growth_base.0.saturating_mul(MAX_SAMPLE_GROWTH));
        MilliTokensPerS::measured(tokens, elapsed_ms.max(self.min_sample_ms).max(1))
            .unwrap_or(MilliTokensPerS::ZERO)
            .min(self.max_sample_rate)
            .min(growth_cap)
    }
}

/// Where an actor stands relative to a step's version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Eligibility {
    /// Active on the step's version: can work at once.
    Current,
    /// Active on the version before, with the step's version staged: can work after
    /// applying `Commit(step version)`.
    NeedsCommit,
    /// Anything else: gets no work this step.
    Behind,
}

impl Eligibility {
    /// Classifies an actor for a step on `step_version`.
    pub fn of(step_version: Version, active: Version, staged: Option<Version>) -> Eligibility {
        if active == step_version {
            Eligibility::Current
        } else if active.next() == Some(step_version) && staged == Some(step_version) {
            Eligibility::NeedsCommit
        } else {
            Eligibility::Behind
        }
    }

    /// Whether the actor may receive work.
    pub fn is_eligible(self) -> bool {
        self != Eligibility::Behind
    }
}

/// Divides `total` into one part per weight, proportional to the weights, by the
/// largest remainder method: parts sum to exactly `total` and each differs from its
/// exact share `total * w / sum(w)` by less than one. Ties in the remainder go to the
/// larger weight, then to the earlier index, so the result is deterministic.
///
/// With no weights there is no one to give work to and the result is empty. If every
/// weight is zero the shares are equal, because "no information" must not mean "no
/// work" (the batch would never finish).
pub fn split_proportionally(total: u32, weights: &[u64]) -> Vec<u32> {
    let weight_sum: u128 = weights.iter().map(|&weight| u128::from(weight)).sum();
    if weights.is_empty() {
        return Vec::new();
    }
    if weight_sum == 0 {
        return split_proportionally(total, &vec![1; weights.len()]);
    }
    let total_wide = u128::from(total);
    let mut parts = Vec::with_capacity(weights.len());
    let mut remainders = Vec::with_capacity(weights.len());
    for (index, &weight) in weights.iter().enumerate() {
        let scaled = total_wide * u128::from(weight);
        // Each quotient is at most `total`, so it fits in u32.
        parts.push(u32::try_from(scaled / weight_sum).unwrap_or(total));
        remainders.push((scaled % weight_sum, weight, index));
    }
    let assigned: u64 = parts.iter().map(|&part| u64::from(part)).sum();
    // Fewer than `weights.len()` jobs are left over: each remainder is below one share.
    let left_over = usize::try_from(u64::from(total) - assigned).unwrap_or(0);
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
    for &(_, _, index) in remainders.iter().take(left_over) {
        parts[index] += 1;
    }
    parts
}

/// Splits `total` jobs over actors by Algorithm 1: one part per actor, in order;
/// actors that are [`Eligibility::Behind`] get zero, the eligible ones share `total`
/// by `policy`. If nobody is eligible, every part is zero and the jobs stay unassigned.
pub fn split_among_eligible(
    total: u32,
    actors: &[(Eligibility, MilliTokensPerS)],
    policy: SplitPolicy,
) -> Vec<u32> {
    let eligible_weights: Vec<u64> = actors
        .iter()
        .filter(|(eligibility, _)| eligibility.is_eligible())
        .map(|&(_, estimate)| match policy {
            SplitPolicy::Proportional => estimate.0,
            SplitPolicy::Uniform => 1,
        })
        .collect();
    let mut eligible_parts = split_proportionally(total, &eligible_weights).into_iter();
    actors
        .iter()
        .map(|(eligibility, _)| {
            if eligibility.is_eligible() {
                eligible_parts.next().unwrap_or(0)
            } else {
                0
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn check_split(total: u32, weights: &[u64], expected: &[u32]) {
        assert_eq!(
            split_proportionally(total, weights),
            expected,
            "{total} over {weights:?}"
        );
    }

    #[test]
    fn h100_and_a100_split_300_requests_200_100() {
        let h100 = (
            Eligibility::Current,
            MilliTokensPerS::from_tokens_per_s(5_000),
        );
        let a100 = (
            Eligibility::Current,
            MilliTokensPerS::from_tokens_per_s(2_500),
        );
        assert_eq!(
            split_among_eligible(300, &[h100, a100], SplitPolicy::Proportional),
            [200, 100]
        );
    }

    #[test]
    fn uniform_policy_ignores_estimates() {
        let h100 = (
            Eligibility::Current,
            MilliTokensPerS::from_tokens_per_s(5_000),
        );
        let a100 = (
            Eligibility::NeedsCommit,
            MilliTokensPerS::from_tokens_per_s(2_500),
        );
        assert_eq!(
            split_among_eligible(301, &[h100, a100], SplitPolicy::Uniform),
            [151, 150]
        );
    }

    #[test]
    fn behind_actors_are_left_out_of_the_split() {
        let fast_but_behind = (
            Eligibility::Behind,
            MilliTokensPerS::from_tokens_per_s(9_000),
        );
        let slow = (
            Eligibility::Current,
            MilliTokensPerS::from_tokens_per_s(1_000),
        );
        let split = split_among_eligible(50, &[fast_but_behind, slow], SplitPolicy::Proportional);
        assert_eq!(split, [0, 50]);
        let nobody = split_among_eligible(50, &[fast_but_behind], SplitPolicy::Proportional);
        assert_eq!(nobody, [0]);
    }

    #[test]
    fn split_edge_cases() {
        // Largest remainders: 10 * [1, 1, 1] / 3 = 3.33 each, the first index wins the tie.
        check_split(10, &[1, 1, 1], &[4, 3, 3]);
        // 7 * [5, 3] / 8 = [4.375, 2.625]: the larger remainder gets the spare job.
        check_split(7, &[5, 3], &[4, 3]);
        // Equal remainders go to the larger weight before the earlier index.
        check_split(1, &[1, 3, 3], &[0, 1, 0]);
        check_split(0, &[4, 2], &[0, 0]);
        check_split(5, &[], &[]);
        check_split(5, &[0, 0], &[3, 2]);
        check_split(5, &[0, 7], &[0, 5]);
        check_split(
            u32::MAX,
            &[u64::MAX, u64::MAX],
            &[u32::MAX / 2 + 1, u32::MAX / 2],
        );
    }

    fn check_eligibility(active: u64, staged: Option<u64>, expected: Eligibility) {
        let actual = Eligibility::of(Version(5), Version(active), staged.map(Version));
        assert_eq!(actual, expected, "active {active}, staged {staged:?}");
    }

    #[test]
    fn eligibility_follows_algorithm_1() {
        check_eligibility(5, None, Eligibility::Current);
        check_eligibility(5, Some(6), Eligibility::Current);
        check_eligibility(4, Some(5), Eligibility::NeedsCommit);
        check_eligibility(4, None, Eligibility::Behind);
        check_eligibility(4, Some(4), Eligibility::Behind);
        check_eligibility(3, Some(4), Eligibility::Behind);
        check_eligibility(3, Some(5), Eligibility::Behind);
        check_eligibility(6, None, Eligibility::Behind);
    }

    #[test]
    fn estimates_average_and_decay_exactly() {
        let beta = Permille::new(800).unwrap();
        let old = MilliTokensPerS::from_tokens_per_s(1_000);
        let sample = MilliTokensPerS::from_tokens_per_s(2_000);
        assert_eq!(
            old.averaged_with(sample, beta),
            MilliTokensPerS::from_tokens_per_s(1_200)
        );
        assert_eq!(old.averaged_with(old, beta), old);
        assert_eq!(
            old.decayed(Permille::new(500).unwrap()),
            MilliTokensPerS::from_tokens_per_s(500)
        );
        assert_eq!(
            MilliTokensPerS::measured(3_000, 1_500),
            Some(MilliTokensPerS::from_tokens_per_s(2_000))
        );
        assert_eq!(MilliTokensPerS::measured(3_000, 0), None);
        assert_eq!(
            MilliTokensPerS::measured(u64::MAX, 1),
            Some(MilliTokensPerS(u64::MAX))
        );
    }

    #[test]
    fn a_sample_grows_at_most_max_sample_growth_times_the_estimate() {
        let config = SchedulerConfig {
            split: SplitPolicy::Proportional,
            estimate_weight: Permille::clamped(800),
            behind_decay: Permille::clamped(500),
            new_actor_estimate: NewActorEstimate::MinimumOfKnown {
                floor: MilliTokensPerS::from_tokens_per_s(100),
            },
            min_sample_ms: 1_000,
            max_sample_rate: MilliTokensPerS::from_tokens_per_s(200_000),
            expiry_decay: Permille::clamped(700),
        };
        let estimate = MilliTokensPerS::from_tokens_per_s(2_000);
        let check = |tokens, elapsed_ms, estimate, expected_tokens_per_s| {
            assert_eq!(
                config.plausible_sample(tokens, elapsed_ms, estimate),
                MilliTokensPerS::from_tokens_per_s(expected_tokens_per_s),
                "{tokens} tokens in {elapsed_ms} ms at {estimate:?}"
            );
        };
        // Honest samples below the bound pass unchanged, faster or slower.
        check(7_000, 1_000, estimate, 7_000);
        check(500, 1_000, estimate, 500);
        // 100x the estimate counts as 4x.
        check(200_000, 1_000, estimate, 8_000);
        // An estimate decayed to nothing grows from the newcomer floor.
        check(5_000, 1_000, MilliTokensPerS::ZERO, 400);
        // One inflated settlement moves the average by at most 1.6x.
        let sample = config.plausible_sample(u64::MAX, 1, estimate);
        assert_eq!(
            estimate.averaged_with(sample, config.estimate_weight),
            MilliTokensPerS::from_tokens_per_s(3_200)
        );
    }

    #[test]
    fn newcomers_start_at_the_slowest_known_estimate_or_the_floor() {
        let floor = MilliTokensPerS::from_tokens_per_s(100);
        let rule = NewActorEstimate::MinimumOfKnown { floor };
        let known = [
            MilliTokensPerS::from_tokens_per_s(900),
            MilliTokensPerS::from_tokens_per_s(400),
        ];
        assert_eq!(
            rule.for_newcomer(known),
            MilliTokensPerS::from_tokens_per_s(400)
        );
        assert_eq!(
            rule.for_newcomer([MilliTokensPerS::from_tokens_per_s(20)]),
            floor
        );
        assert_eq!(rule.for_newcomer([]), floor);
        assert_eq!(NewActorEstimate::Fixed(floor).for_newcomer(known), floor);
    }

    proptest! {
        #[test]
        fn split_assigns_exactly_the_total(
            total in 0u32..100_000,
            weights in prop::collection::vec(0u64..1_000_000_000, 1..40),
        ) {
            let parts = split_proportionally(total, &weights);
            prop_assert_eq!(parts.len(), weights.len());
            prop_assert_eq!(parts.iter().map(|&p| u64::from(p)).sum::<u64>(), u64::from(total));
        }

        #[test]
        fn split_is_proportional_within_one(
            total in 0u32..100_000,
            weights in prop::collection::vec(0u64..1_000_000_000, 1..40),
        ) {
            let parts = split_proportionally(total, &weights);
            let sum: u128 = weights.iter().map(|&w| u128::from(w)).sum();
            prop_assume!(sum > 0);
            for (&part, &weight) in parts.iter().zip(&weights) {
                // |part - total * w / sum| < 1, compared exactly by scaling with sum.
                let exact = u128::from(total) * u128::from(weight);
                let part = u128::from(part) * sum;
                prop_assert!(part.abs_diff(exact) < sum, "part {part} exact {exact} sum {sum}");
            }
        }

        #[test]
        fn behind_actors_get_nothing_and_eligible_ones_share_everything(
            total in 0u32..10_000,
            actors in prop::collection::vec((0u64..10_000, 0u64..4, prop::option::of(0u64..4)), 0..20),
        ) {
            let step_version = Version(2);
            let standings: Vec<(Eligibility, MilliTokensPerS)> = actors
                .iter()
                .map(|&(speed, active, staged)| {
                    (Eligibility::of(step_version, Version(active), staged.map(Version)), MilliTokensPerS(speed))
                })
                .collect();
            let parts = split_among_eligible(total, &standings, SplitPolicy::Proportional);
            prop_assert_eq!(parts.len(), standings.len());
            let mut eligible_weights = Vec::new();
            let mut eligible_parts = Vec::new();
            for (&part, &(eligibility, estimate)) in parts.iter().zip(&standings) {
                if eligibility.is_eligible() {
                    eligible_weights.push(estimate.0);
                    eligible_parts.push(part);
                } else {
                    prop_assert_eq!(part, 0);
                }
            }
            let assigned: u32 = parts.iter().sum();
            prop_assert_eq!(assigned, if eligible_weights.is_empty() { 0 } else { total });
            // Among the eligible, the parts are exactly the plain proportional split.
            prop_assert_eq!(eligible_parts, split_proportionally(total, &eligible_weights));
        }
    }
}
