//! The run's settings: built-in defaults (the README's run), overridable by a TOML file
//! (`aurora run --config FILE`); the effective settings are written to the run directory
//! and every node reads them from there, so all processes agree.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use aurora_engine::{ModelConfig, RlConfig, SamplingConfig, Task, WarmupConfig};
use serde::{Deserialize, Serialize};

/// How each new version reaches the actors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// A sparse `aurora` delta per step.
    Delta,
    /// The whole checkpoint per step (the baseline), through the same path.
    Full,
}

/// Where a run's settings start from; a `--config` file overrides any of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// The README's run: the default model learns two-digit addition within minutes, and
    /// most of its BF16 elements change at every step (the dense regime).
    Default,
    /// The paper's systems regime: a model of 50 million parameters at a learning rate
    /// small against its weights, so that at most 2% of the BF16 elements change per
    /// step. It shows delta against full sync; learning at this rate takes hundreds of
    /// steps.
    Sparse,
}

impl Preset {
    pub fn config(self) -> RunConfig {
        match self {
            Preset::Default => RunConfig::default(),
            Preset::Sparse => RunConfig::sparse(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RegionConfig {
    pub name: String,
    /// Actors started in this region at the beginning of the run.
    pub actors: usize,
}

/// A scripted fault, applied when the trainer starts step `at_step`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, tag = "action", rename_all = "kebab-case")]
pub enum Fault {
    /// SIGKILL of an actor (numbered from 0 in start order).
    KillActor { at_step: u64, actor: usize },
    /// SIGTERM to an actor, as a cloud's preemption notice or a scheduler's stop: it
    /// leaves the fleet (its leases back to the pool at once) and exits.
    StopActor { at_step: u64, actor: usize },
    /// A new actor joins a region: snapshot plus catch-up, then eligible.
    StartActor { at_step: u64, region: String },
    /// SIGKILL of a region's relay; its actors fall back to the hub.
    KillRelay { at_step: u64, region: String },
    /// SIGKILL of the trainer node (trainer, control plane, transport hub, store) once
    /// the step opens, and a restart on the same ports `restart_after_s` later: it
    /// reopens the store and the control plane's journal and resumes from its newest
    /// checkpointed state while relays and actors keep generating.
    KillTrainer { at_step: u64, restart_after_s: f64 },
}

impl Fault {
    pub fn at_step(&self) -> u64 {
        match self {
            Fault::KillActor { at_step, .. }
            | Fault::StopActor { at_step, .. }
            | Fault::StartActor { at_step, .. }
            | Fault::KillRelay { at_step, .. }
            | Fault::KillTrainer { at_step, .. } => *at_step,
        }
    }
}

/// Runs the nodes across an emulated WAN (network namespaces, see `crates/wan`) instead
/// of loopback: the trainer in one region of the scenario, each run region's relay and
/// actors in the scenario region of the same name. Needs root.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NetworkConfig {
    /// A scenario file (`wan/scenarios/*.toml`), relative to the working directory.
    pub scenario: PathBuf,
    /// The scenario region of the trainer (control plane, transport hub, store).
    pub trainer_region: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// RL steps after the warm-up.
    pub steps: u64,
    pub seed: u64,
    pub sync: SyncMode,
    pub prompts_per_step: u64,
    /// Held-out evaluation every this many steps (and after the last).
    pub eval_every: u64,
    /// A full snapshot goes to the checkpoint store every this many versions (and of the
    /// initial version): what an actor that joins with no weights starts from,
    /// and where a composed catch-up rebuilds its base.
    pub snapshot_every: u64,
    /// The trainer's state (FP32 master weights, optimizer moments, counters) goes to
    /// the store every this many versions (and of the initial and the final version):
    /// a restarted trainer resumes from the newest and trains forward on the stored
    /// rollouts.
    pub checkpoint_every: u64,
    pub held_out: usize,
    /// Parallel TCP streams per transfer session.
    pub streams: u8,
    pub model: ModelConfig,
    pub task: Task,
    /// One chunk of the supervised warm-up, repeated until the held-out accuracy
    /// reaches `warmup_target_accuracy` or `warmup_max_steps` are done.
    pub warmup: WarmupConfig,
    pub warmup_target_accuracy: f64,
    pub warmup_max_steps: u64,
    pub rl: RlConfig,
    pub sampling: SamplingConfig,
    pub regions: Vec<RegionConfig>,
    pub faults: Vec<Fault>,
    /// Loopback when absent.
    pub network: Option<NetworkConfig>,
}

impl Default for RunConfig {
    /// The README's run: the engine's default model on two-digit addition, with the
    /// engine's tuned warm-up and GRPO settings (80 steps of 32 prompts), two regions of
    /// two actors.
    fn default() -> Self {
        let task = Task::addition(2, 1);
        let rl = RlConfig::default();
        RunConfig {
            steps: 80,
            seed: 1,
            sync: SyncMode::Delta,
            prompts_per_step: 32,
            eval_every: 10,
            snapshot_every: 5,
            checkpoint_every: 5,
            held_out: 200,
            streams: 4,
            model: ModelConfig::default(),
            task,
            warmup: WarmupConfig::default(),
            warmup_target_accuracy: 0.15,
            warmup_max_steps: 1000,
            rl,
            sampling: SamplingConfig {
                samples_per_prompt: rl.samples_per_prompt,
                temperature: 1.0,
                max_new_tokens: task.max_completion_tokens(),
            },
            regions: vec![
                RegionConfig {
                    name: "us".into(),
                    actors: 2,
                },
                RegionConfig {
                    name: "eu".into(),
                    actors: 2,
                },
            ],
            faults: Vec::new(),
            network: None,
        }
    }
}

impl RunConfig {
    /// The sparse preset ([`Preset::Sparse`]). The learning rate is chosen against the
    /// weights: a BF16 element changes when its FP32 master weight crosses a rounding
    /// boundary, so a step of size s changes an element w with probability about
    /// s / ulp(w), where ulp(w) is |w| * 2^-8 to |w| * 2^-7, and Adam's steps are at most
    /// about `learning_rate` (exactly that on the first step). Over this model's initial
    /// weights (standard deviation 0.02, 0.005 for the output projections) that predicts
    /// under 2% of the elements at 2e-7; every run measures it (`StepRecord`).
    pub fn sparse() -> Self {
        let task = Task::addition(1, 1);
        let rl = RlConfig {
            learning_rate: 2e-7,
            ..RlConfig::default()
        };
        RunConfig {
            steps: 12,
            prompts_per_step: 4,
            eval_every: 12,
            // A snapshot is 100 MB to write and the trainer's state 600 MB (FP32 weights
            // and two moments); no actor joins this run and no trainer is killed, so the
            // one snapshot is the initial version's and the states are the first and the
            // last.
            snapshot_every: 100,
            checkpoint_every: 100,
            held_out: 7,
            model: ModelConfig::xlarge(),
            task,
            // A fixed warm-up with no accuracy target: GRPO needs groups whose rewards
            // differ, not a good policy, and each warm-up step of this model takes
            // seconds.
            warmup: WarmupConfig {
                steps: 50,
                batch_size: 32,
                learning_rate: 1e-3,
            },
            warmup_target_accuracy: 0.0,
            warmup_max_steps: 50,
            rl,
            sampling: SamplingConfig {
                samples_per_prompt: rl.samples_per_prompt,
                temperature: 1.0,
                max_new_tokens: task.max_completion_tokens(),
            },
            ..RunConfig::default()
        }
    }

    /// Reads `path` over the defaults.
    pub fn load(path: &Path) -> Result<RunConfig> {
        Self::load_over(&RunConfig::default(), path)
    }

    /// Reads `path` as overrides of `base`: each setting the file names replaces the
    /// base's whole (a `[model]` table names every field of the model, as over the
    /// defaults).
    pub fn load_over(base: &RunConfig, path: &Path) -> Result<RunConfig> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let config =
            Self::parse_over(base, &text).with_context(|| format!("parsing {}", path.display()))?;
        config
            .validate()
            .with_context(|| format!("checking {}", path.display()))?;
        Ok(config)
    }

    fn parse_over(base: &RunConfig, text: &str) -> Result<RunConfig> {
        let overrides: toml::Table = toml::from_str(text)?;
        let mut merged = toml::Table::try_from(base).context("serialising the base settings")?;
        merged.extend(overrides);
        Ok(merged.try_into()?)
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let text = toml::to_string_pretty(self).context("serialising the run config")?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    }

    pub fn validate(&self) -> Result<()> {
        ensure!(self.steps > 0, "steps must be at least 1");
        ensure!(
            self.prompts_per_step > 0,
            "prompts_per_step must be at least 1"
        );
        ensure!(self.eval_every > 0, "eval_every must be at least 1");
        ensure!(self.snapshot_every > 0, "snapshot_every must be at least 1");
        ensure!(
            self.checkpoint_every > 0,
            "checkpoint_every must be at least 1"
        );

        ensure!(
            (0.0..=1.0).contains(&self.warmup_target_accuracy),
            "warmup_target_accuracy must be within 0 to 1"
        );
        ensure!(
            self.warmup.steps > 0 && self.warmup.steps <= self.warmup_max_steps.max(1),
            "warmup.steps (one chunk) must be 1 to warmup_max_steps"
        );
        // Warm-up problems use ids with bit 62 set and held-out ones bit 63 (see
        // aurora_engine::HELD_OUT_ID_BIT): RL prompt ids stay below.
        ensure!(
            self.steps.saturating_mul(self.prompts_per_step) < 1 << 62,
            "steps * prompts_per_step must stay below 2^62"
        );
        ensure!(
            (1..=16).contains(&self.streams),
            "streams must be 1 to 16, not {}",
            self.streams
        );
        ensure!(
            self.sampling.samples_per_prompt == self.rl.samples_per_prompt,
            "sampling.samples_per_prompt ({}) and rl.samples_per_prompt ({}) differ",
            self.sampling.samples_per_prompt,
            self.rl.samples_per_prompt
        );
        ensure!(!self.regions.is_empty(), "at least one region is needed");
        for (index, region) in self.regions.iter().enumerate() {
            ensure!(
                !region.name.is_empty()
                    && region
                        .name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-'),
                "region name '{}' must be non-empty letters, digits and '-'",
                region.name
            );
            if self.regions[..index].iter().any(|r| r.name == region.name) {
                bail!("region '{}' is listed twice", region.name);
            }
        }
        let actors: usize = self.regions.iter().map(|r| r.actors).sum();
        ensure!(actors > 0, "at least one actor is needed");
        for fault in &self.faults {
            ensure!(
                fault.at_step() < self.steps,
                "fault {fault:?} is after the last step"
            );
            match fault {
                Fault::KillActor { actor, .. } | Fault::StopActor { actor, .. } => ensure!(
                    *actor < actors + self.started_before(fault.at_step()),
                    "fault {fault:?}: no actor {actor} exists by then"
                ),
                Fault::StartActor { region, .. } | Fault::KillRelay { region, .. } => ensure!(
                    self.regions.iter().any(|r| &r.name == region),
                    "fault {fault:?}: no region '{region}'"
                ),
                Fault::KillTrainer {
                    restart_after_s, ..
                } => ensure!(
                    restart_after_s.is_finite() && (0.0..=3600.0).contains(restart_after_s),
                    "fault {fault:?}: restart_after_s must be 0 to 3600 seconds"
                ),
            }
        }
        self.model.validate()?;
        self.task.validate()?;
        self.rl.validate()?;
        self.sampling.validate()?;
        Ok(())
    }

    /// Actors started by faults before `step`.
    fn started_before(&self, step: u64) -> usize {
        self.faults
            .iter()
            .filter(|f| matches!(f, Fault::StartActor { at_step, .. } if *at_step < step))
            .count()
    }

    /// The prompts of a step: consecutive ids, so every run draws the same problems.
    pub fn prompts(&self, step: u64) -> Vec<u64> {
        (step * self.prompts_per_step..(step + 1) * self.prompts_per_step).collect()
    }

    /// The sampling seed of every rollout generated on `version`: with the prompt id and
    /// sample index it fixes each completion, whoever generates it.
    pub fn sampling_seed(&self, version: u64) -> u64 {
        self.seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_valid_and_round_trips_through_toml() {
        let config = RunConfig::default();
        config.validate().unwrap();
        let text = toml::to_string_pretty(&config).unwrap();
        assert_eq!(toml::from_str::<RunConfig>(&text).unwrap(), config);
    }

    #[test]
    fn the_sparse_preset_is_valid_and_its_checkpoint_is_bandwidth_bound() {
        let sparse = Preset::Sparse.config();
        sparse.validate().unwrap();
        // Tens of MB of BF16: most of a second over 1 Gbps, against 3 MB by default.
        let dense_bytes = 2 * sparse.model.parameters();
        assert!(
            (80_000_000..120_000_000).contains(&dense_bytes),
            "{dense_bytes}"
        );
        assert!(
            sparse.rl.learning_rate <= 1e-6,
            "{}",
            sparse.rl.learning_rate
        );
        assert_eq!(Preset::Default.config(), RunConfig::default());
    }

    #[test]
    fn a_file_overrides_the_preset_setting_by_setting() {
        let sparse = Preset::Sparse.config();
        let over = RunConfig::parse_over(
            &sparse,
            include_str!("../../../../examples/runs/us-canada.toml"),
        )
        .unwrap();
        over.validate().unwrap();
        let regions: Vec<&str> = over.regions.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(regions, ["us", "canada"]);
        assert!(over.network.is_some());
        assert_eq!(over.model, sparse.model);
        assert_eq!(over.rl, sparse.rl);
        assert_eq!(over.steps, sparse.steps);
        let error = RunConfig::parse_over(&sparse, "stepz = 3").unwrap_err();
        assert!(format!("{error:#}").contains("stepz"), "{error:#}");
    }

    #[test]
    fn a_partial_file_keeps_the_defaults_and_a_fault_plan_parses() {
        let text = r#"
            steps = 12
            sync = "full"
            [[faults]]
            action = "kill-actor"
            at_step = 6
            actor = 2
            [[faults]]
            action = "kill-relay"
            at_step = 8
            region = "eu"
            [[faults]]
            action = "start-actor"
            at_step = 10
            region = "us"
        "#;
        let config: RunConfig = toml::from_str(text).unwrap();
        config.validate().unwrap();
        assert_eq!(config.steps, 12);
        assert_eq!(config.sync, SyncMode::Full);
        assert_eq!(config.faults.len(), 3);
        assert_eq!(
            config.prompts_per_step,
            RunConfig::default().prompts_per_step
        );
    }

    #[test]
    fn bad_settings_are_named() {
        let check = |text: &str, expected: &str| {
            let error = match toml::from_str::<RunConfig>(text) {
                Ok(config) => format!("{:#}", config.validate().unwrap_err()),
                Err(error) => error.to_string(),
            };
            assert!(error.contains(expected), "{error}");
        };
        check("steps = 0", "steps must be at least 1");
        check("stepz = 3", "stepz");
        check(
            "[[faults]]\naction = \"kill-relay\"\nat_step = 1\nregion = \"mars\"",
            "no region 'mars'",
        );
        check(
            "[[faults]]\naction = \"kill-actor\"\nat_step = 1\nactor = 9",
            "no actor 9",
        );
        check("streams = 0", "streams must be 1 to 16");
    }
}
