//! The same work under different thread counts must give the same bytes: the run
//! compares weights hashes between processes, and actors may run any number of threads.
//!
//! candle takes its thread count from RAYON_NUM_THREADS when each matrix product runs,
//! so the test re-runs itself as child processes with different values and compares
//! what they computed. The model is large enough that the matrix products do split
//! across threads (gemm threads products above 48 * 48 * 256 multiply-adds).

use std::process::Command;

use aurora_engine::{
    Algorithm, ModelConfig, Problem, RlConfig, SamplingConfig, Task, Trainer, WarmupConfig,
};

const CHILD: &str = "AURORA_ENGINE_THREADS_CHILD";
const TEST_NAME: &str = "results_do_not_depend_on_the_thread_count";

/// Warm-up, sampling and an RL step; the hash of the completions, the exported BF16
/// weights and the trainer state.
fn scenario() -> String {
    let config = ModelConfig {
        hidden_size: 64,
        intermediate_size: 256,
        ..ModelConfig::tiny()
    };
    let task = Task::addition(3, 1);
    let mut trainer = Trainer::new(&config, 21).unwrap();
    let warmup = WarmupConfig {
        steps: 2,
        batch_size: 96,
        learning_rate: 3e-3,
    };
    trainer.warmup(&task, &warmup, |_| {}).unwrap();
    let behaviour = trainer.policy().unwrap();
    let problems: Vec<Problem> = (0..6).map(|id| task.problem(id).unwrap()).collect();
    let sampling = SamplingConfig {
        samples_per_prompt: 8,
        temperature: 1.0,
        max_new_tokens: task.max_completion_tokens(),
    };
    let generation = behaviour.generate(&problems, &sampling, 5).unwrap();
    let rl = RlConfig {
        algorithm: Algorithm::Grpo,
        learning_rate: 1e-3,
        clip_epsilon: 0.2,
        kl_coef: 0.0,
        samples_per_prompt: 8,
        epochs: 2,
    };
    trainer
        .train_step(&task, &generation.groups, &behaviour, None, &rl)
        .unwrap();
    let mut hasher = blake3::Hasher::new();
    hasher.update(&serde_json::to_vec(&generation.groups).unwrap());
    hasher.update(&trainer.export_bf16().unwrap());
    hasher.update(&trainer.save_state().unwrap());
    hasher.finalize().to_hex().to_string()
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    if std::env::var_os(CHILD).is_some() {
        println!("scenario-hash {}", scenario());
        return;
    }
    let here = scenario();
    for threads in ["1", "2", "3"] {
        let output = Command::new(std::env::current_exe().unwrap())
            .args([TEST_NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .env("RAYON_NUM_THREADS", threads)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "child with {threads} threads failed: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        // libtest prints the test's name on the same line, before the hash.
        let hash = stdout
            .split("scenario-hash ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("child with {threads} threads printed no hash: {stdout}"));
        assert_eq!(
            hash, here,
            "RAYON_NUM_THREADS={threads} computed other bytes"
        );
    }
}
