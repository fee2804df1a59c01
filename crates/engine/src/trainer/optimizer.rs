//! The AdamW update of the master weights, with global-norm clipping, and its reset:
//! the one place the weights and moments change during training.

use candle_core::Tensor;

use super::Trainer;
use crate::error::{ComputeContext, EngineError, Result};

impl Trainer {
    /// One AdamW step with global-norm clipping; returns the norm before clipping. A
    /// non-finite gradient is refused before any weight changes.
    pub(super) fn apply_gradients(
        &mut self,
        grads: Vec<Tensor>,
        learning_rate: f64,
    ) -> Result<f32> {
        let mut squares = 0f64;
        for grad in &grads {
            squares += grad
                .sqr()
                .and_then(|g| g.sum_all())
                .and_then(|s| s.to_scalar::<f32>())
                .context("gradient norm")? as f64;
        }
        let norm = squares.sqrt();
        if !norm.is_finite() {
            return Err(EngineError::Training(format!(
                "gradient norm is {norm}; weights left unchanged"
            )));
        }
        let o = self.optimizer;
        let scale = if norm > o.max_grad_norm {
            o.max_grad_norm / norm
        } else {
            1.0
        };
        self.adam_steps += 1;
        let step = i32::try_from(self.adam_steps).unwrap_or(i32::MAX);
        let first_correction = 1.0 - o.beta1.powi(step);
        let second_correction = 1.0 - o.beta2.powi(step);
        for (param, grad) in self.params.iter_mut().zip(grads) {
            let update = (|| -> candle_core::Result<()> {
                let grad = grad.affine(scale, 0.0)?;
                param.first_moment = (param.first_moment.affine(o.beta1, 0.0)?
                    + grad.affine(1.0 - o.beta1, 0.0)?)?;
                param.second_moment = (param.second_moment.affine(o.beta2, 0.0)?
                    + grad.sqr()?.affine(1.0 - o.beta2, 0.0)?)?;
                let denominator = (param
                    .second_moment
                    .affine(1.0 / second_correction, 0.0)?
                    .sqrt()?
                    + o.epsilon)?;
                let step = param
                    .first_moment
                    .affine(1.0 / first_correction, 0.0)?
                    .div(&denominator)?;
                let weights = param.var.as_tensor();
                let decayed = if param.decays {
                    weights.affine(1.0 - learning_rate * o.weight_decay, 0.0)?
                } else {
                    weights.clone()
                };
                param
                    .var
                    .set(&(decayed - step.affine(learning_rate, 0.0)?)?)
            })();
            update.context("AdamW update")?;
        }
        Ok(norm as f32)
    }

    /// Forgets the AdamW moments (a fresh optimizer on the same weights), as between
    /// the warm-up and RL, whose gradients have another scale.
    pub fn reset_optimizer(&mut self) -> Result<()> {
        for param in &mut self.params {
            param.first_moment = param
                .first_moment
                .zeros_like()
                .context("optimizer moments")?;
            param.second_moment = param
                .second_moment
                .zeros_like()
                .context("optimizer moments")?;
        }
        self.adam_steps = 0;
        Ok(())
    }
}
