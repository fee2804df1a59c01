//! Fixed scenarios run for a benchmark to print, returning plain data rather than a
//! verdict.

use aurora_control::SplitPolicy;

use crate::report::{ActorReport, StepRecord, Violation};
use crate::{Scenario, run};

/// Mean step time and idle time of one split policy.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyOutcome {
    /// Mean time from opening a step to its completion.
    pub mean_step_ms: u64,
    /// Idle time over the time actors could have been working, 0..=1.
    pub idle_fraction: f64,
    /// Per-actor busy and idle time.
    pub actors: Vec<ActorReport>,
    /// Every step.
    pub steps: Vec<StepRecord>,
}

/// Proportional against uniform split on the same pool and prompts.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitComparison {
    /// Algorithm 1.
    pub proportional: PolicyOutcome,
    /// Equal shares.
    pub uniform: PolicyOutcome,
}

/// Runs the same A100 + L40 pool (two of each, no faults, identical prompts) under the
/// proportional and the uniform split.
pub fn compare_split_policies(seed: u64) -> Result<SplitComparison, Violation> {
    let outcome = |split| {
        let report = run(&Scenario::a100_l40_pool(seed, split))?;
        let windows: u64 = report.steps.iter().map(StepRecord::step_ms).sum();
        let idle: u64 = report.actors.iter().map(|actor| actor.idle_ms).sum();
        let possible = windows * report.actors.len() as u64;
        Ok(PolicyOutcome {
            mean_step_ms: windows / report.steps.len().max(1) as u64,
            idle_fraction: idle as f64 / possible.max(1) as f64,
            actors: report.actors,
            steps: report.steps,
        })
    };
    Ok(SplitComparison {
        proportional: outcome(SplitPolicy::Proportional)?,
        uniform: outcome(SplitPolicy::Uniform)?,
    })
}

/// Step-by-step throughput of a three-actor pool through the preemption of one A100
/// and its rejoin (see [`Scenario::preemption_and_rejoin`]).
pub fn preemption_timeline(seed: u64) -> Result<Vec<StepRecord>, Violation> {
    run(&Scenario::preemption_and_rejoin(seed)).map(|report| report.steps)
}

#[cfg(test)]
mod tests {
    use aurora_control::Millis;

    use super::*;

    #[test]
    fn proportional_split_beats_uniform_on_an_a100_l40_pool() {
        let comparison = compare_split_policies(42).unwrap();
        let (proportional, uniform) = (&comparison.proportional, &comparison.uniform);
        assert!(
            proportional.mean_step_ms * 10 < uniform.mean_step_ms * 9,
            "proportional {} ms vs uniform {} ms",
            proportional.mean_step_ms,
            uniform.mean_step_ms
        );
        assert!(
            proportional.idle_fraction < uniform.idle_fraction / 2.0,
            "{comparison:?}"
        );
    }

    #[test]
    fn throughput_dips_through_a_preemption_and_recovers_after_the_rejoin() {
        let timeline = preemption_timeline(42).unwrap();
        assert_eq!(timeline.len(), 24);
        let mean_goodput = |steps: &[&StepRecord]| {
            steps
                .iter()
                .map(|step| step.goodput_tokens_per_s())
                .sum::<f64>()
                / steps.len() as f64
        };
        let preemption = Millis(Scenario::PREEMPTION_AT_MS);
        // Steady state before: the estimates have converged after the first steps.
        let before: Vec<&StepRecord> = timeline
            .iter()
            .filter(|s| s.opened_at > Millis(60_000) && s.completed_at < preemption)
            .collect();
        let during: Vec<&StepRecord> = timeline.iter().filter(|s| s.live_actors == 2).collect();
        let after: Vec<&StepRecord> = timeline[timeline.len() - 3..].iter().collect();
        assert!(before.len() >= 3 && during.len() >= 3, "{timeline:#?}");
        assert!(
            after.iter().all(|step| step.live_actors == 3),
            "{timeline:#?}"
        );
        // The survivors (3,400 of 5,800 tokens/s) carry on at their speed: no step stalls.
        let (before, during, after) = (
            mean_goodput(&before),
            mean_goodput(&during),
            mean_goodput(&after),
        );
        assert!(
            during < 0.75 * before && during > 0.45 * before,
            "{before} {during} {timeline:#?}"
        );
        assert!(after > 0.9 * before, "{before} {after} {timeline:#?}");
        assert!(
            timeline.iter().all(|step| step.step_ms() < 40_000),
            "{timeline:#?}"
        );
    }
}
