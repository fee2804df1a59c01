//! The whole RL loop in one process, with timings: warm up until the held-out greedy
//! accuracy reaches a target, then GRPO steps on sampled rollouts, exactly as `aurora
//! run` splits them between the trainer and the actors.
//!
//! `cargo run -p aurora-engine --example train -- [steps] [target]`
//! (defaults: 30 RL steps, warm-up target 0.15). RAYON_NUM_THREADS sets the threads.

use std::time::Instant;

use aurora_engine::{ModelConfig, Problem, RlConfig, SamplingConfig, Task, Trainer, WarmupConfig};

const PROMPTS_PER_STEP: u64 = 16;
const WARMUP_STEPS_MAX: u64 = 1000;

fn main() -> aurora_engine::Result<()> {
    let mut args = std::env::args().skip(1);
    let rl_steps: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(30);
    let target: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(0.15);

    let config = ModelConfig::default();
    let task = Task::addition(3, 1);
    let held_out = task.held_out(200)?;
    let mut trainer = Trainer::new(&config, 0)?;
    println!("{} parameters", config.parameters());

    let started = Instant::now();
    let warmup = WarmupConfig::default();
    loop {
        let mut loss = 0.0;
        trainer.warmup(&task, &warmup, |progress| loss = progress.loss)?;
        let accuracy = trainer.policy()?.accuracy(&task, &held_out)?;
        println!(
            "warm-up {:4}  loss {loss:.3}  held-out {:.3}  {:.1} s",
            trainer.warmup_steps(),
            accuracy.fraction(),
            started.elapsed().as_secs_f64()
        );
        if accuracy.fraction() >= target || trainer.warmup_steps() >= WARMUP_STEPS_MAX {
            break;
        }
    }
    trainer.reset_optimizer()?;

    let rl = RlConfig::default();
    let sampling = SamplingConfig {
        samples_per_prompt: rl.samples_per_prompt,
        temperature: 1.0,
        max_new_tokens: task.max_completion_tokens(),
    };
    for step in 0..rl_steps {
        let behaviour = trainer.policy()?;
        let problems: Vec<Problem> = (step * PROMPTS_PER_STEP..(step + 1) * PROMPTS_PER_STEP)
            .map(|id| task.problem(id))
            .collect::<aurora_engine::Result<_>>()?;
        let generation = behaviour.generate(&problems, &sampling, step)?;
        let training = Instant::now();
        let stats = trainer.train_step(&task, &generation.groups, &behaviour, None, &rl)?;
        let train_s = training.elapsed().as_secs_f64();
        let accuracy = if (step + 1) % 5 == 0 {
            format!(
                "{:.3}",
                trainer.policy()?.accuracy(&task, &held_out)?.fraction()
            )
        } else {
            "-".into()
        };
        println!(
            "step {:3}  reward {:.3}  generate {:.2} s ({} tokens)  train {train_s:.2} s  held-out {accuracy}  {:.1} s",
            step + 1,
            stats.mean_reward,
            generation.elapsed.as_secs_f64(),
            generation.tokens_generated,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
