//! The supervised warm-up that makes the base policy, cached in the run directory under
//! a key of everything that determines it, so a rerun starts training at once.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use aurora_engine::Trainer;

use super::config::RunConfig;

/// The warmed-up trainer for `config`: loaded from the cache when present, trained and
/// cached otherwise: chunks of `config.warmup` until the held-out accuracy reaches the
/// target (deterministic, like everything the trainer does). Progress goes to stdout as
/// `warmup ...` lines.
pub fn warmed_up(config: &RunConfig, run_dir: &Path) -> Result<Trainer> {
    let path = cache_path(config, run_dir)?;
    if let Ok(bytes) = std::fs::read(&path) {
        match Trainer::load_state(&bytes) {
            Ok(trainer) => {
                tracing::info!(path = %path.display(), "warm-up loaded from the cache");
                return Ok(trainer);
            }
            Err(error) => {
                tracing::warn!(path = %path.display(), "ignoring a bad warm-up cache: {error}")
            }
        }
    }
    let mut trainer = Trainer::new(&config.model, config.seed)?;
    let held_out = config.task.held_out(config.held_out)?;
    let mut done = 0;
    loop {
        let mut loss = 0.0;
        trainer.warmup(&config.task, &config.warmup, |progress| {
            loss = progress.loss
        })?;
        done += config.warmup.steps;
        let accuracy = trainer
            .policy()?
            .accuracy(&config.task, &held_out)?
            .fraction();
        let mut stdout = std::io::stdout().lock();
        writeln!(
            stdout,
            "warmup {done} steps, loss {loss:.4}, held-out accuracy {:.1}%",
            100.0 * accuracy
        )?;
        stdout.flush()?;
        if accuracy >= config.warmup_target_accuracy
            || done + config.warmup.steps > config.warmup_max_steps
        {
            break;
        }
    }
    // RL starts with fresh optimiser moments: the supervised ones point elsewhere.
    trainer.reset_optimizer()?;
    let state = trainer.save_state()?;
    aurora_checkpoint::write_atomically::<aurora_checkpoint::FileError>(&path, |writer| {
        writer
            .write_all(&state)
            .map_err(|source| aurora_checkpoint::FileError::Io {
                path: path.clone(),
                source,
            })
    })
    .with_context(|| format!("caching the warm-up in {}", path.display()))?;
    Ok(trainer)
}

fn cache_path(config: &RunConfig, run_dir: &Path) -> Result<PathBuf> {
    let key = serde_json::to_vec(&(
        &config.model,
        &config.task,
        &config.warmup,
        config.warmup_target_accuracy,
        config.warmup_max_steps,
        config.held_out,
        config.seed,
    ))?;
    let hash = blake3::hash(&key).to_hex();
    Ok(run_dir.join(format!("warmup-{}.state", &hash[..16])))
}
