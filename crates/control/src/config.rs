//! Control plane settings, with every limit on memory in one place.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::lease::{LeaseConfig, MAX_COMPLETION_WINDOW};
use crate::scheduler::{MilliTokensPerS, NewActorEstimate, SchedulerConfig, SplitPolicy};
use crate::values::{Millis, Permille};

/// All control plane settings. Validated once by [`crate::ControlPlane::new`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Config {
    /// Bounds on every collection the core keeps.
    pub limits: Limits,
    /// Lease lifetime.
    pub lease: LeaseConfig,
    /// Batch split and throughput estimates.
    pub scheduler: SchedulerConfig,
    /// An actor silent for this long is declared dead and its leases return to the pool.
    pub heartbeat_timeout_ms: u64,
    /// When a step may finish with fewer than all its results; `None` waits for all.
    pub partial_batch: Option<PartialBatchPolicy>,
    /// Warning window after a preemption notice: the actor gets no new work, results
    /// for leases it already holds are accepted until the window ends (and the leases
    /// themselves are live), and then it is removed and its unfinished leases return
    /// to the pool. Zero removes it at once.
    pub preemption_grace_ms: u64,
}

/// Bounds on the core's state, so that no sequence of requests can grow it without
/// limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Most registered actors.
    pub max_actors: u32,
    /// Most prompts in one step's batch (and so jobs, and live leases).
    pub max_batch_size: u32,
    /// Most live leases one actor may hold, and most results in one submission: keeps
    /// one actor from hoarding a batch and bounds the size of every reply.
    pub max_leases_per_actor: u32,
    /// Most undelivered events; beyond it the oldest are dropped and counted.
    pub max_pending_events: u32,
    /// Most tokens one result may claim. Token counts feed the throughput estimate, so
    /// an absurd count would buy an actor an absurd share of the next batch.
    pub max_tokens_per_result: u64,
}

/// Lets a step finish without stragglers: once `after_ms` have passed since the step
/// opened, it completes as soon as `min_accepted` of its batch is accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartialBatchPolicy {
    /// Time after opening from which a partial batch is acceptable.
    pub after_ms: u64,
    /// Fraction of the batch that must be accepted (rounded up, at least one job).
    pub min_accepted: Permille,
}

impl PartialBatchPolicy {
    /// When a step opened at `opened_at` may start completing partially.
    pub fn deadline(self, opened_at: Millis) -> Millis {
        opened_at.saturating_add(self.after_ms)
    }

    /// The smallest accepted count that completes a step of `batch_size` partially:
    /// `min_accepted` of it rounded up, and at least one job.
    pub fn minimum_accepted(self, batch_size: u32) -> u32 {
        let minimum = self
            .min_accepted
            .of_rounded_up(u64::from(batch_size))
            .max(1);
        u32::try_from(minimum).unwrap_or(u32::MAX)
    }
}

/// Why a configuration was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// A limit or duration that must be positive is zero.
    #[error("{0} must be positive")]
    Zero(&'static str),
    /// `lease.min_ms` is above `lease.max_ms`.
    #[error("lease bounds are inverted: min {min_ms} ms > max {max_ms} ms")]
    LeaseBoundsInverted {
        /// The configured minimum.
        min_ms: u64,
        /// The configured maximum.
        max_ms: u64,
    },
    /// `lease.initial_ms` is outside `[min_ms, max_ms]`.
    #[error("initial lease {0} ms is outside the lease bounds")]
    InitialLeaseOutOfBounds(u64),
    /// The lease multiplier is outside 200..=300 percent of the median.
    #[error("lease multiplier {0}% is outside 200..=300%")]
    LeaseMultiplierOutOfRange(u16),
    /// The completion window is larger than [`MAX_COMPLETION_WINDOW`].
    #[error("completion window {0} is more than {MAX_COMPLETION_WINDOW}")]
    CompletionWindowTooLarge(u16),
    /// A new actor would start with a zero estimate and could be starved.
    #[error("the starting estimate of new actors must be positive")]
    ZeroNewActorEstimate,
    /// The cap on measured throughput is zero, so every sample would be zero.
    #[error("scheduler.max_sample_rate must be positive")]
    ZeroMaxSampleRate,
}

impl Config {
    /// Checks every field; the core relies on these bounds holding.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive: [(&'static str, u64); 9] = [
            ("limits.max_actors", self.limits.max_actors.into()),
            ("limits.max_batch_size", self.limits.max_batch_size.into()),
            (
                "limits.max_leases_per_actor",
                self.limits.max_leases_per_actor.into(),
            ),
            (
                "limits.max_pending_events",
                self.limits.max_pending_events.into(),
            ),
            (
                "limits.max_tokens_per_result",
                self.limits.max_tokens_per_result,
            ),
            ("lease.min_ms", self.lease.min_ms),
            (
                "lease.completion_window",
                self.lease.completion_window.into(),
            ),
            ("heartbeat_timeout_ms", self.heartbeat_timeout_ms),
            ("scheduler.min_sample_ms", self.scheduler.min_sample_ms),
        ];
        if let Some(&(name, _)) = positive.iter().find(|&&(_, value)| value == 0) {
            return Err(ConfigError::Zero(name));
        }
        let lease = &self.lease;
        if lease.min_ms > lease.max_ms {
            return Err(ConfigError::LeaseBoundsInverted {
                min_ms: lease.min_ms,
                max_ms: lease.max_ms,
            });
        }
        if !(lease.min_ms..=lease.max_ms).contains(&lease.initial_ms) {
            return Err(ConfigError::InitialLeaseOutOfBounds(lease.initial_ms));
        }
        if !(200..=300).contains(&lease.median_multiplier_percent) {
            return Err(ConfigError::LeaseMultiplierOutOfRange(
                lease.median_multiplier_percent,
            ));
        }
        if lease.completion_window > MAX_COMPLETION_WINDOW {
            return Err(ConfigError::CompletionWindowTooLarge(
                lease.completion_window,
            ));
        }
        if self.scheduler.new_actor_estimate.floor() == MilliTokensPerS::ZERO {
            return Err(ConfigError::ZeroNewActorEstimate);
        }
        if self.scheduler.max_sample_rate == MilliTokensPerS::ZERO {
            return Err(ConfigError::ZeroMaxSampleRate);
        }
        Ok(())
    }
}

impl Default for Config {
    /// Settings for LLM rollouts of tens of seconds to minutes over the internet.
    fn default() -> Config {
        Config {
            limits: Limits {
                max_actors: 1024,
                max_batch_size: 16_384,
                max_leases_per_actor: 2048,
                max_pending_events: 8192,
                max_tokens_per_result: 1 << 20,
            },
            lease: LeaseConfig {
                initial_ms: 300_000,
                min_ms: 10_000,
                max_ms: 1_800_000,
                median_multiplier_percent: 250,
                completion_window: 1024,
            },
            scheduler: SchedulerConfig {
                split: SplitPolicy::Proportional,
                estimate_weight: Permille::clamped(800),
                behind_decay: Permille::clamped(500),
                new_actor_estimate: NewActorEstimate::MinimumOfKnown {
                    floor: MilliTokensPerS::from_tokens_per_s(100),
                },
                min_sample_ms: 1_000,
                // Far above one GPU's decoding rate, far below what would let one
                // inflated report take a whole batch from a pool of real actors.
                max_sample_rate: MilliTokensPerS::from_tokens_per_s(200_000),
                expiry_decay: Permille::clamped(700),
            },
            heartbeat_timeout_ms: 30_000,
            partial_batch: None,
            preemption_grace_ms: 30_000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_config(edit: impl FnOnce(&mut Config), expected: Result<(), ConfigError>) {
        let mut config = Config::default();
        edit(&mut config);
        assert_eq!(config.validate(), expected);
    }

    #[test]
    fn default_config_is_valid() {
        check_config(|_| {}, Ok(()));
    }

    #[test]
    fn invalid_configs_are_refused() {
        check_config(
            |c| c.limits.max_actors = 0,
            Err(ConfigError::Zero("limits.max_actors")),
        );
        check_config(
            |c| c.heartbeat_timeout_ms = 0,
            Err(ConfigError::Zero("heartbeat_timeout_ms")),
        );
        check_config(
            |c| c.lease.min_ms = c.lease.max_ms + 1,
            Err(ConfigError::LeaseBoundsInverted {
                min_ms: 1_800_001,
                max_ms: 1_800_000,
            }),
        );
        check_config(
            |c| c.lease.initial_ms = 1,
            Err(ConfigError::InitialLeaseOutOfBounds(1)),
        );
        check_config(
            |c| c.lease.median_multiplier_percent = 199,
            Err(ConfigError::LeaseMultiplierOutOfRange(199)),
        );
        check_config(
            |c| c.lease.median_multiplier_percent = 301,
            Err(ConfigError::LeaseMultiplierOutOfRange(301)),
        );
        check_config(
            |c| c.lease.completion_window = MAX_COMPLETION_WINDOW + 1,
            Err(ConfigError::CompletionWindowTooLarge(
                MAX_COMPLETION_WINDOW + 1,
            )),
        );
        check_config(
            |c| c.scheduler.new_actor_estimate = NewActorEstimate::Fixed(MilliTokensPerS::ZERO),
            Err(ConfigError::ZeroNewActorEstimate),
        );
        check_config(
            |c| c.scheduler.min_sample_ms = 0,
            Err(ConfigError::Zero("scheduler.min_sample_ms")),
        );
        check_config(
            |c| c.scheduler.max_sample_rate = MilliTokensPerS::ZERO,
            Err(ConfigError::ZeroMaxSampleRate),
        );
    }
}
