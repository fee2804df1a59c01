//! The whole RL loop in one process, with timings: warm up until the held-out greedy
//! accuracy reaches a target (or load a saved warm-up), then GRPO steps on sampled
//! rollouts, exactly as `aurora run` splits them between the trainer and the actors,
//! including its one-step lag: step k's rollouts come from the policy before the
//! previous update.
//!
//! `cargo run -p aurora-engine --example train -- [key=value ...]`, keys (defaults):
//! steps (80), target (0.15, the warm-up's held-out accuracy), state (a trainer state
//! file: loaded if it exists, else written after the warm-up), prompts (32), lr, epochs,
//! temperature (1.0), lag (1), seed (0), digits (2). RAYON_NUM_THREADS sets
//! the threads.

use std::collections::HashMap;
use std::time::Instant;

use aurora_engine::{
    EngineError, ModelConfig, Policy, Problem, RlConfig, SamplingConfig, Task, Trainer,
    WarmupConfig,
};

const WARMUP_STEPS_MAX: u64 = 1000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: HashMap<String, String> = std::env::args()
        .skip(1)
        .filter_map(|arg| {
            let (key, value) = arg.split_once('=')?;
            Some((key.to_string(), value.to_string()))
        })
        .collect();
    let get = |key: &str, default: &str| -> String {
        args.get(key).cloned().unwrap_or_else(|| default.into())
    };
    let number = |key: &str, default: &str| -> aurora_engine::Result<f64> {
        get(key, default)
            .parse()
            .map_err(|_| EngineError::Training(format!("{key} must be a number")))
    };
    let rl_steps = number("steps", "80")? as u64;
    let prompts_per_step = number("prompts", "32")? as u64;
    let lag = number("lag", "1")? as usize;
    let seed = number("seed", "0")? as u64;

    let config = ModelConfig::default();
    let digits = number("digits", "2")? as u32;
    let task = Task::addition(digits, 1);
    let held_out = task.held_out(200)?;
    let started = Instant::now();
    let state = args.get("state").map(std::path::PathBuf::from);
    let mut trainer = match state.as_deref().filter(|path| path.exists()) {
        Some(path) => Trainer::load_state(&std::fs::read(path)?)?,
        None => {
            let mut trainer = Trainer::new(&config, 0)?;
            warm_up(&mut trainer, &task, &held_out, number("target", "0.15")?)?;
            if let Some(path) = &state {
                std::fs::write(path, trainer.save_state()?)?;
            }
            trainer
        }
    };
    trainer.reset_optimizer()?;
    println!(
        "{} parameters, base held-out {:.3}",
        config.parameters(),
        trainer.policy()?.accuracy(&task, &held_out)?.fraction()
    );

    let defaults = RlConfig::default();
    let rl = RlConfig {
        learning_rate: number("lr", &defaults.learning_rate.to_string())?,
        epochs: number("epochs", &defaults.epochs.to_string())? as usize,
        ..defaults
    };
    let sampling = SamplingConfig {
        samples_per_prompt: rl.samples_per_prompt,
        temperature: number("temperature", "1.0")? as f32,
        max_new_tokens: task.max_completion_tokens(),
    };
    // The policies of the last `lag + 1` versions, newest last.
    let mut versions: Vec<Policy> = vec![trainer.policy()?];
    for step in 0..rl_steps {
        let behaviour = &versions[0];
        let problems: Vec<Problem> = (step * prompts_per_step..(step + 1) * prompts_per_step)
            .map(|id| task.problem(id))
            .collect::<aurora_engine::Result<_>>()?;
        let generation = behaviour.generate(&problems, &sampling, seed + step)?;
        let training = Instant::now();
        let stats = trainer.train_step(&task, &generation.groups, behaviour, None, &rl)?;
        let train_s = training.elapsed().as_secs_f64();
        versions.push(trainer.policy()?);
        if versions.len() > lag + 1 {
            versions.remove(0);
        }
        let accuracy = if (step + 1) % 5 == 0 {
            format!(
                "{:.3}",
                trainer.policy()?.accuracy(&task, &held_out)?.fraction()
            )
        } else {
            "-".into()
        };
        println!(
            "step {:3}  reward {:.3}  solved {:.3}  clip {:.3}  kl {:.4}  generate {:.2} s  train {train_s:.2} s  held-out {accuracy}  {:.1} s",
            step + 1,
            stats.mean_reward,
            stats.solved,
            stats.clip_fraction,
            stats.kl_behaviour,
            generation.elapsed.as_secs_f64(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

fn warm_up(
    trainer: &mut Trainer,
    task: &Task,
    held_out: &[Problem],
    target: f64,
) -> aurora_engine::Result<()> {
    let started = Instant::now();
    let warmup = WarmupConfig::default();
    loop {
        let mut loss = 0.0;
        trainer.warmup(task, &warmup, |progress| loss = progress.loss)?;
        let accuracy = trainer.policy()?.accuracy(task, held_out)?;
        println!(
            "warm-up {:4}  loss {loss:.3}  held-out {:.3}  {:.1} s",
            trainer.warmup_steps(),
            accuracy.fraction(),
            started.elapsed().as_secs_f64()
        );
        if accuracy.fraction() >= target || trainer.warmup_steps() >= WARMUP_STEPS_MAX {
            return Ok(());
        }
    }
}
