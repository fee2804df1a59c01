//! Packet loss models, seeded so that a run can be repeated packet for packet.
//!
//! Pure: no clock, no I/O; the emulator asks [`Loss::drops`] once per packet.

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// Which packets a direction of a link loses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossModel {
    /// Each packet is lost independently with this probability.
    Bernoulli { probability: f64 },
    /// A two-state Markov chain (Gilbert-Elliott): a packet is lost with the loss
    /// probability of the current state, then the state may change.
    GilbertElliott {
        good_to_bad: f64,
        bad_to_good: f64,
        loss_in_good: f64,
        loss_in_bad: f64,
    },
}

impl LossModel {
    pub fn bernoulli(probability: f64) -> LossModel {
        LossModel::Bernoulli { probability }
    }

    /// Losses in bursts of `mean_burst_packets` on average (every packet of a burst is
    /// lost, none between bursts) with a long-run loss rate of `mean_loss`.
    pub fn bursty(mean_loss: f64, mean_burst_packets: f64) -> Result<LossModel, String> {
        if !(0.0..1.0).contains(&mean_loss) || !(1.0..=f64::INFINITY).contains(&mean_burst_packets)
        {
            return Err(format!(
                "bursty loss needs a loss in [0, 1) and a burst of at least one packet, \
                 not {mean_loss} and {mean_burst_packets}"
            ));
        }
        let bad_to_good = 1.0 / mean_burst_packets;
        // The stationary share of the bad state is the mean loss:
        // good_to_bad / (good_to_bad + bad_to_good) = mean_loss.
        let good_to_bad = mean_loss * bad_to_good / (1.0 - mean_loss);
        if good_to_bad > 1.0 {
            return Err(format!(
                "a mean loss of {mean_loss} cannot come in bursts of {mean_burst_packets} \
                 packets: the bursts would have to overlap"
            ));
        }
        Ok(LossModel::GilbertElliott {
            good_to_bad,
            bad_to_good,
            loss_in_good: 0.0,
            loss_in_bad: 1.0,
        })
    }

    /// The long-run fraction of packets lost.
    pub fn mean_loss(&self) -> f64 {
        match *self {
            LossModel::Bernoulli { probability } => probability,
            LossModel::GilbertElliott {
                good_to_bad,
                bad_to_good,
                loss_in_good,
                loss_in_bad,
            } => {
                let transitions = good_to_bad + bad_to_good;
                if transitions == 0.0 {
                    // The chain never leaves the good state it starts in.
                    return loss_in_good;
                }
                let bad_share = good_to_bad / transitions;
                (1.0 - bad_share) * loss_in_good + bad_share * loss_in_bad
            }
        }
    }
}

/// A loss model with its random state.
#[derive(Debug, Clone)]
pub struct Loss {
    model: LossModel,
    in_bad_state: bool,
    rng: Xoshiro256PlusPlus,
}

impl Loss {
    /// Starts in the good state; the same `seed` gives the same losses.
    pub fn new(model: LossModel, seed: u64) -> Loss {
        Loss {
            model,
            in_bad_state: false,
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
        }
    }

    /// Whether the next packet is lost. A probability outside [0, 1] saturates rather
    /// than panics.
    pub fn drops(&mut self) -> bool {
        match self.model {
            LossModel::Bernoulli { probability } => self.chance(probability),
            LossModel::GilbertElliott {
                good_to_bad,
                bad_to_good,
                loss_in_good,
                loss_in_bad,
            } => {
                let (loss, leave) = if self.in_bad_state {
                    (loss_in_bad, bad_to_good)
                } else {
                    (loss_in_good, good_to_bad)
                };
                let lost = self.chance(loss);
                if self.chance(leave) {
                    self.in_bad_state = !self.in_bad_state;
                }
                lost
            }
        }
    }

    fn chance(&mut self, probability: f64) -> bool {
        // Skipping the draw for certain outcomes keeps a lossless link free of RNG work.
        if probability <= 0.0 {
            return false;
        }
        self.rng.random::<f64>() < probability
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn losses(model: LossModel, seed: u64, packets: usize) -> Vec<bool> {
        let mut loss = Loss::new(model, seed);
        (0..packets).map(|_| loss.drops()).collect()
    }

    /// Asserts `lost / packets` is within six standard deviations of `p` (binomial).
    fn check_rate(pattern: &[bool], p: f64, spread: f64) {
        let n = pattern.len() as f64;
        let lost = pattern.iter().filter(|&&l| l).count() as f64;
        let sd = (n * p * (1.0 - p)).sqrt() * spread;
        assert!(
            (lost - n * p).abs() <= 6.0 * sd,
            "lost {lost} of {n}, expected {} +- {}",
            n * p,
            6.0 * sd
        );
    }

    #[test]
    fn no_loss_and_certain_loss_are_exact() {
        assert!(!losses(LossModel::bernoulli(0.0), 1, 10_000).contains(&true));
        assert!(!losses(LossModel::bernoulli(1.0), 1, 10_000).contains(&false));
        assert!(!losses(LossModel::bernoulli(-3.0), 1, 100).contains(&true));
        assert!(!losses(LossModel::bernoulli(7.0), 1, 100).contains(&false));
        assert!(!losses(LossModel::bernoulli(f64::NAN), 1, 100).contains(&true));
    }

    #[test]
    fn bernoulli_loses_at_its_rate() {
        for p in [0.001, 0.01, 0.1, 0.5] {
            check_rate(&losses(LossModel::bernoulli(p), 7, 200_000), p, 1.0);
        }
    }

    #[test]
    fn bursty_loss_has_the_mean_rate_and_burst_length_asked_for() {
        let model = LossModel::bursty(0.01, 4.0).unwrap();
        assert!((model.mean_loss() - 0.01).abs() < 1e-12);
        let pattern = losses(model, 3, 1_000_000);
        // Bursts correlate losses, which widens the spread of the count by about
        // sqrt(2 * burst); 3x covers it.
        check_rate(&pattern, 0.01, 3.0);
        let bursts = pattern.windows(2).filter(|w| !w[0] && w[1]).count();
        let lost = pattern.iter().filter(|&&l| l).count();
        let mean_burst = lost as f64 / bursts as f64;
        assert!((3.6..4.4).contains(&mean_burst), "mean burst {mean_burst}");
    }

    #[test]
    fn bursty_loss_refuses_impossible_parameters() {
        assert!(LossModel::bursty(1.0, 2.0).is_err());
        assert!(LossModel::bursty(0.01, 0.5).is_err());
        assert!(LossModel::bursty(0.01, f64::NAN).is_err());
        let error = LossModel::bursty(0.6, 1.0).unwrap_err();
        assert!(error.contains("overlap"), "{error}");
        assert_eq!(
            LossModel::bursty(0.0, 3.0).unwrap().mean_loss(),
            0.0,
            "no loss stays no loss"
        );
    }

    #[test]
    fn mean_loss_of_a_chain_that_never_moves_is_its_good_state() {
        let model = LossModel::GilbertElliott {
            good_to_bad: 0.0,
            bad_to_good: 0.0,
            loss_in_good: 0.25,
            loss_in_bad: 1.0,
        };
        assert_eq!(model.mean_loss(), 0.25);
        check_rate(&losses(model, 5, 100_000), 0.25, 1.0);
    }

    proptest! {
        #[test]
        fn the_same_seed_repeats_the_same_losses(
            seed in any::<u64>(),
            p in 0.0..1.0f64,
            burst in 1.0..50.0f64,
        ) {
            prop_assert_eq!(
                losses(LossModel::bernoulli(p), seed, 500),
                losses(LossModel::bernoulli(p), seed, 500)
            );
            if let Ok(model) = LossModel::bursty(p, burst) {
                prop_assert_eq!(losses(model, seed, 500), losses(model, seed, 500));
            }
        }
    }
}
