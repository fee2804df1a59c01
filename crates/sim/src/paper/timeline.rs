//! The step pipeline: actors generate step n on a version at most `lag` behind it
//! while the trainer trains the next version from the step before and ships it.
//!
//! Version v is trained from step v-1's rollouts, once that step has been generated
//! and the trainer is free. The sender ships versions one at a time: in order (deltas
//! chain, each on its predecessor), or, for full checkpoints, always the newest
//! trained, skipping the rest. Step n may start once its actors are done with step n-1
//! and some version at least n-lag has arrived; activating a newer version pauses
//! generation at that batch boundary. With lag 1 and shipping faster than
//! generation, the step time is generation plus activation: the sync is hidden.

use std::ops::Range;

/// How a system moves each new version to the actors.
#[derive(Clone, Debug, PartialEq)]
pub struct SyncPlan {
    /// How many versions behind its step a generation may be.
    pub lag: u32,
    /// Seconds shipping a version holds the sender, shipment by shipment (cycled): the
    /// paths' rate moves between steps.
    pub ship_s: Vec<f64>,
    /// Seconds from the sender's last byte until the slowest actor has it staged.
    pub tail_s: f64,
    /// Seconds generation pauses to activate an arrived version.
    pub activation_s: f64,
    /// Whether the sender skips to the newest trained version (full checkpoints).
    pub skips_versions: bool,
}

impl SyncPlan {
    /// Seconds from a version's first shipment to its staging everywhere, on average
    /// over the paths' fluctuation.
    pub fn mean_sync_s(&self) -> f64 {
        let shipped_s = if self.ship_s.is_empty() {
            0.0
        } else {
            self.ship_s.iter().sum::<f64>() / self.ship_s.len() as f64
        };
        shipped_s + self.tail_s
    }
}

/// One step's generation, as the control core scheduled it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GeneratedStep {
    /// Seconds from the step's opening to its last accepted result.
    pub generation_s: f64,
    /// Accepted tokens.
    pub tokens: f64,
}

/// When a step ran in the pipeline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTiming {
    /// Generation ended.
    pub end_s: f64,
    /// Accepted tokens.
    pub tokens: f64,
}

/// Runs the pipeline over `steps`, training each version in `train_s`. A plan ships
/// at least once: an empty `ship_s` reads as instant shipping.
pub fn simulate(plan: &SyncPlan, train_s: f64, steps: &[GeneratedStep]) -> Vec<StepTiming> {
    let mut sender = Sender {
        plan,
        trained_at: vec![0.0],
        arrivals: vec![(0, 0.0)],
        free_at: 0.0,
    };
    let mut timings: Vec<StepTiming> = Vec::with_capacity(steps.len());
    let mut active = 0;
    for (index, step) in steps.iter().enumerate() {
        let needed = index.saturating_sub(plan.lag as usize);
        let ready_at = sender.arrival_of_at_least(needed);
        let previous_end = timings.last().map_or(0.0, |timing| timing.end_s);
        let mut start_s = previous_end.max(ready_at);
        let newest = sender.newest_arrived_by(start_s);
        if newest > active {
            active = newest;
            start_s += plan.activation_s;
        }
        let end_s = start_s + step.generation_s;
        timings.push(StepTiming {
            end_s,
            tokens: step.tokens,
        });
        let trainer_free = sender.trained_at.last().copied().unwrap_or(0.0);
        sender.trained_at.push(end_s.max(trainer_free) + train_s);
    }
    timings
}

/// `timings` with every step `saved_s` shorter: a trace whose recorded sync is replaced
/// by a faster one, the rest of each step kept as recorded.
pub fn substitute_sync(timings: &[StepTiming], saved_s: f64) -> Vec<StepTiming> {
    timings
        .iter()
        .enumerate()
        .map(|(index, timing)| StepTiming {
            end_s: timing.end_s - (index + 1) as f64 * saved_s,
            tokens: timing.tokens,
        })
        .collect()
}

/// Accepted tokens per second over `steps`, from the end of the step before them.
pub fn throughput(timings: &[StepTiming], steps: Range<usize>) -> f64 {
    let tokens: f64 = timings.get(steps.clone()).map_or(0.0, |window| {
        window.iter().map(|timing| timing.tokens).sum()
    });
    span_s(timings, &steps).map_or(0.0, |span_s| tokens / span_s)
}

/// Mean time per step over `steps`, from the end of the step before them.
pub fn mean_step_s(timings: &[StepTiming], steps: Range<usize>) -> f64 {
    span_s(timings, &steps).map_or(0.0, |span_s| span_s / steps.len() as f64)
}

/// From the end of the step before `steps` to the end of their last.
fn span_s(timings: &[StepTiming], steps: &Range<usize>) -> Option<f64> {
    let before = timings.get(steps.start.checked_sub(1)?)?;
    let last = timings.get(steps.end.checked_sub(1)?)?;
    (steps.end > steps.start).then_some(last.end_s - before.end_s)
}

struct Sender<'a> {
    plan: &'a SyncPlan,
    /// When each version was trained (version 0 is the start).
    trained_at: Vec<f64>,
    /// Versions shipped, in order, with when they were staged at every actor.
    arrivals: Vec<(usize, f64)>,
    free_at: f64,
}

impl Sender<'_> {
    /// Ships versions until one at least `version` is on its way; returns its arrival.
    /// The caller only asks for versions already trained or being trained.
    fn arrival_of_at_least(&mut self, version: usize) -> f64 {
        loop {
            if let Some(&(_, at)) = self
                .arrivals
                .iter()
                .find(|(shipped, _)| *shipped >= version)
            {
                return at;
            }
            let last_shipped = self.arrivals.last().map_or(0, |&(shipped, _)| shipped);
            let next = last_shipped + 1;
            let Some(&next_trained_at) = self.trained_at.get(next) else {
                // Nothing newer will ever be trained before this step runs.
                return f64::INFINITY;
            };
            let start = self.free_at.max(next_trained_at);
            let shipped = if self.plan.skips_versions {
                self.trained_at
                    .iter()
                    .rposition(|&trained| trained <= start)
                    .unwrap_or(next)
                    .max(next)
            } else {
                next
            };
            let shipment = self.arrivals.len() - 1;
            let ship_s = self
                .plan
                .ship_s
                .get(shipment % self.plan.ship_s.len().max(1))
                .copied()
                .unwrap_or(0.0);
            self.free_at = start + ship_s;
            self.arrivals
                .push((shipped, self.free_at + self.plan.tail_s));
        }
    }

    fn newest_arrived_by(&self, time_s: f64) -> usize {
        self.arrivals
            .iter()
            .filter(|&&(_, at)| at <= time_s)
            .map(|&(version, _)| version)
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(count: usize, generation_s: f64) -> Vec<GeneratedStep> {
        vec![
            GeneratedStep {
                generation_s,
                tokens: 1000.0,
            };
            count
        ]
    }

    fn plan(lag: u32, ship_s: f64, skips_versions: bool) -> SyncPlan {
        SyncPlan {
            lag,
            ship_s: vec![ship_s],
            tail_s: 0.0,
            activation_s: 0.0,
            skips_versions,
        }
    }

    #[test]
    fn a_sync_shorter_than_generation_is_hidden_by_one_step_of_lag() {
        let timings = simulate(&plan(1, 5.0, false), 10.0, &steps(30, 20.0));
        assert!((mean_step_s(&timings, 5..30) - 20.0).abs() < 1e-9);
    }

    #[test]
    fn with_one_step_of_lag_a_long_sync_costs_its_share_of_two_steps() {
        // Step n needs version n-1, trained from step n-2: every two steps take one
        // generation, one training and one shipment (20 + 10 + 25 s).
        let timings = simulate(&plan(1, 25.0, false), 10.0, &steps(40, 20.0));
        let step_s = mean_step_s(&timings, 10..40);
        assert!((step_s - 27.5).abs() < 1e-9, "{step_s}");
    }

    #[test]
    fn a_sender_slower_than_generation_sets_the_pace_unless_versions_may_be_older() {
        let full = |lag| {
            let timings = simulate(&plan(lag, 100.0, true), 10.0, &steps(80, 20.0));
            mean_step_s(&timings, 20..80)
        };
        // With one step of lag the version a step needs was trained from the step
        // before it, so each shipment serves one step; more lag lets the newest
        // version, skipping the rest, serve several.
        assert!((full(1) - 100.0).abs() < 1e-6, "{}", full(1));
        assert!(full(2) < 0.8 * full(1), "{} {}", full(2), full(1));
        assert!(full(4) < full(2), "{} {}", full(4), full(2));
        assert!(full(4) >= 20.0);
    }

    #[test]
    fn a_substituted_sync_shortens_every_step_even_where_it_was_hidden() {
        let timings = simulate(&plan(1, 5.0, false), 10.0, &steps(30, 20.0));
        let faster = substitute_sync(&timings, 4.0);
        assert!((mean_step_s(&faster, 5..30) - 16.0).abs() < 1e-9);
    }

    #[test]
    fn activation_pauses_every_step() {
        let mut with_pause = plan(1, 1.0, false);
        with_pause.activation_s = 2.0;
        let timings = simulate(&with_pause, 1.0, &steps(20, 10.0));
        assert!((mean_step_s(&timings, 5..20) - 12.0).abs() < 1e-9);
        assert!((throughput(&timings, 5..20) - 1000.0 / 12.0).abs() < 1e-9);
    }
}
