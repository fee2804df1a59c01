use std::path::PathBuf;

use anyhow::{Context, Result};
use aurora_synth::{ModelShape, PRESETS, SynthConfig, preset};
use clap::Args;

#[derive(Args)]
pub struct SynthArgs {
    /// Model shape: tiny, small, medium, 0.6b, 1.7b, 4b or 8b.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Optimizer steps to write after the initial checkpoint.
    #[arg(long, default_value_t = 3)]
    pub steps: u64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 1e-6)]
    pub lr: f32,
    /// Store norm gains as F32 (the rest stays BF16).
    #[arg(long)]
    pub f32_norms: bool,
    /// Directory for step-NNNNN.safetensors files.
    #[arg(long, short)]
    pub out: PathBuf,
}

/// The model shape of preset `name`, or an error listing the known ones.
pub fn shape(name: &str) -> Result<ModelShape> {
    preset(name).with_context(|| {
        let names: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
        format!("unknown preset '{name}' (known: {})", names.join(", "))
    })
}

pub fn run(args: SynthArgs) -> Result<()> {
    let shape = shape(&args.preset)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let config = SynthConfig {
        learning_rate: args.lr,
        f32_norms: args.f32_norms,
        ..SynthConfig::new(shape, args.seed)
    };
    tracing::info!(
        preset = %args.preset,
        parameters = shape.parameters(),
        steps = args.steps,
        lr = args.lr,
        "generating synthetic checkpoints"
    );
    // One tensor at a time: memory holds the largest tensor's training state, not the
    // model's, so the 8B shape is written on a machine of 24 GiB.
    let paths: Vec<PathBuf> = (0..=args.steps)
        .map(|step| args.out.join(format!("step-{step:05}.safetensors")))
        .collect();
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>12} [{bar:30}] {bytes}/{total_bytes} eta {eta}",
        )
        .expect("valid template"),
    );
    bar.set_message("synth");
    aurora_synth::write_checkpoints(&config, 0, &paths, |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    println!(
        "wrote {} checkpoints of {} parameters to {}",
        args.steps + 1,
        shape.parameters(),
        args.out.display()
    );
    Ok(())
}
