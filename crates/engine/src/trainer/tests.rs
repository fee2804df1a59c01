use super::rl::advantages;
use super::state::check_state_len;
use super::*;
use crate::rollout::{RolloutGroup, SamplingConfig};
use crate::task::{Problem, Task};
use crate::tokenizer::{EOS, Tokenizer};

fn rl(algorithm: Algorithm) -> RlConfig {
    RlConfig {
        algorithm,
        learning_rate: 1e-3,
        clip_epsilon: 0.2,
        kl_coef: 0.0,
        samples_per_prompt: 4,
        epochs: 1,
    }
}

/// A group whose first completion is the solution and the others are wrong.
fn graded_group(problem: &Problem) -> RolloutGroup {
    let right = Tokenizer.encode_completion(&problem.solution).unwrap();
    let wrong = |text: &str| Tokenizer.encode_completion(text).unwrap();
    RolloutGroup {
        prompt_id: problem.prompt_id,
        completions: vec![right, wrong("0000"), wrong("1111"), wrong("2")],
    }
}

fn sequence_log_prob(policy: &Policy, problem: &Problem, completion: &[u32]) -> f64 {
    let prompt = Tokenizer.encode_prompt(&problem.prompt).unwrap();
    let batch = TokenBatch::new(&[(&prompt, completion)]).unwrap();
    let values = policy.log_probs(&batch.inputs, &batch.targets).unwrap();
    values
        .iter()
        .zip(&batch.mask)
        .map(|(v, m)| (v * m) as f64)
        .sum()
}

#[test]
fn every_weight_receives_a_nonzero_gradient() {
    let task = Task::addition(2, 0);
    for tie_embeddings in [true, false] {
        let config = ModelConfig {
            tie_embeddings,
            ..ModelConfig::tiny()
        };
        let trainer = Trainer::new(&config, 3).unwrap();
        let sequences: Vec<(Vec<u32>, Vec<u32>)> = (0..16)
            .map(|id| {
                let problem = task.problem(id).unwrap();
                (
                    Tokenizer.encode_prompt(&problem.prompt).unwrap(),
                    Tokenizer.encode_completion(&problem.solution).unwrap(),
                )
            })
            .collect();
        let (grads, loss) = trainer.supervised_gradients(&sequences).unwrap();
        assert!(
            loss > 2.0,
            "a fresh model should be near ln(21), got {loss}"
        );
        for (spec, grad) in config.tensors().iter().zip(&grads) {
            let values = model::f32_values(grad).unwrap();
            let nonzero = values.iter().filter(|v| **v != 0.0).count();
            assert!(values.iter().all(|v| v.is_finite()), "{}", spec.name);
            // Embedding rows of tokens absent from the batch legitimately get none
            // when the head is untied; every other tensor is reached everywhere.
            let required = if spec.name == "model.embed_tokens.weight" && !tie_embeddings {
                values.len() / 3
            } else {
                values.len()
            };
            assert!(
                nonzero >= required,
                "{}: {nonzero} of {} non-zero",
                spec.name,
                values.len()
            );
        }
    }
}

#[test]
fn rl_steps_move_every_tensor_toward_the_rewarded_samples() {
    let task = Task::addition(3, 1);
    for algorithm in [Algorithm::Grpo, Algorithm::Rloo] {
        let mut trainer = Trainer::new(&ModelConfig::tiny(), 4).unwrap();
        let before = trainer.master_values().unwrap();
        let behaviour = trainer.policy().unwrap();
        let problems: Vec<Problem> = (0..3).map(|id| task.problem(id).unwrap()).collect();
        let groups: Vec<RolloutGroup> = problems.iter().map(graded_group).collect();
        let stats = trainer
            .train_step(&task, &groups, &behaviour, None, &rl(algorithm))
            .unwrap();
        assert_eq!(
            (stats.groups, stats.samples, stats.groups_without_signal),
            (3, 12, 0)
        );
        assert_eq!(stats.mean_reward, 0.25);
        assert_eq!(
            stats.tokens,
            groups.iter().map(RolloutGroup::tokens).sum::<usize>()
        );
        assert!(
            stats.kl_behaviour.abs() < 1e-3,
            "BF16 and FP32 barely differ: {}",
            stats.kl_behaviour
        );
        assert_eq!(stats.kl_reference, None);
        assert!(stats.grad_norm > 0.0);

        let after = trainer.master_values().unwrap();
        for ((spec, old), new) in ModelConfig::tiny()
            .tensors()
            .iter()
            .zip(&before)
            .zip(&after)
        {
            assert_ne!(old, new, "{} did not move", spec.name);
        }
        let updated = trainer.policy().unwrap();
        for (problem, group) in problems.iter().zip(&groups) {
            let gain = |completion: &[u32]| {
                sequence_log_prob(&updated, problem, completion)
                    - sequence_log_prob(&behaviour, problem, completion)
            };
            assert!(
                gain(&group.completions[0]) > 0.0,
                "{algorithm:?}: rewarded sample lost probability"
            );
            assert!(
                gain(&group.completions[1]) < 0.0,
                "{algorithm:?}: unrewarded sample gained probability"
            );
        }
    }
}

#[test]
fn trainer_and_policy_can_move_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Trainer>();
    assert_send_sync::<Policy>();
}

#[test]
fn advantages_follow_each_algorithm() {
    let grpo = advantages(Algorithm::Grpo, &[1.0, 0.0, 0.0, 1.0]);
    for (value, expected) in grpo.iter().zip([1.0, -1.0, -1.0, 1.0]) {
        assert!((value - expected).abs() < 1e-5, "{grpo:?}");
    }
    assert_eq!(advantages(Algorithm::Grpo, &[1.0; 4]), vec![0.0; 4]);
    assert_eq!(advantages(Algorithm::Rloo, &[0.0; 3]), vec![0.0; 3]);
    assert_eq!(
        advantages(Algorithm::Rloo, &[1.0, 0.0, 0.0]),
        vec![1.0, -0.5, -0.5]
    );
}

#[test]
fn kl_penalty_and_epochs_are_reported() {
    let task = Task::addition(3, 1);
    let mut trainer = Trainer::new(&ModelConfig::tiny(), 6).unwrap();
    let reference = trainer.policy().unwrap();
    let groups: Vec<RolloutGroup> = (0..2)
        .map(|id| graded_group(&task.problem(id).unwrap()))
        .collect();
    let config = RlConfig {
        kl_coef: 0.1,
        epochs: 4,
        learning_rate: 1e-2,
        ..rl(Algorithm::Grpo)
    };
    let first = trainer
        .train_step(&task, &groups, &reference, Some(&reference), &config)
        .unwrap();
    assert!(first.kl_reference.unwrap() < 1e-3);
    assert!(
        first.clip_fraction > 0.0,
        "four large epochs must clip some ratios"
    );
    let behaviour = trainer.policy().unwrap();
    let second = trainer
        .train_step(&task, &groups, &behaviour, Some(&reference), &config)
        .unwrap();
    assert!(second.kl_reference.unwrap() > first.kl_reference.unwrap());
    assert_eq!(trainer.rl_steps(), 2);
}

#[test]
fn train_step_refuses_bad_input_by_reason() {
    let task = Task::addition(3, 1);
    let mut trainer = Trainer::new(&ModelConfig::tiny(), 7).unwrap();
    let behaviour = trainer.policy().unwrap();
    let good = graded_group(&task.problem(0).unwrap());
    let mut check =
        |groups: &[RolloutGroup], config: RlConfig, behaviour: &Policy, expected: &str| {
            let message = trainer
                .train_step(&task, groups, behaviour, None, &config)
                .unwrap_err()
                .to_string();
            assert!(message.contains(expected), "{message}");
        };
    let base = rl(Algorithm::Grpo);
    check(&[], base, &behaviour, "0 groups");
    check(
        &[good.clone(), good.clone()],
        base,
        &behaviour,
        "prompt 0: appears twice",
    );
    let mut hostile = good.clone();
    hostile.completions[2] = vec![99, EOS];
    check(&[hostile], base, &behaviour, "invalid token 99");
    check(
        std::slice::from_ref(&good),
        RlConfig {
            samples_per_prompt: 3,
            ..base
        },
        &behaviour,
        "4 completions, expected 3",
    );
    check(
        std::slice::from_ref(&good),
        RlConfig {
            kl_coef: 0.5,
            ..base
        },
        &behaviour,
        "needs a reference policy",
    );
    check(
        std::slice::from_ref(&good),
        RlConfig { epochs: 0, ..base },
        &behaviour,
        "epochs 0",
    );
    check(
        std::slice::from_ref(&good),
        RlConfig {
            epochs: MAX_EPOCHS + 1,
            ..base
        },
        &behaviour,
        "epochs 17",
    );
    check(
        std::slice::from_ref(&good),
        RlConfig {
            samples_per_prompt: 1,
            ..base
        },
        &behaviour,
        "samples_per_prompt 1",
    );
    check(
        std::slice::from_ref(&good),
        RlConfig {
            learning_rate: f64::NAN,
            ..base
        },
        &behaviour,
        "learning_rate",
    );
    check(
        std::slice::from_ref(&good),
        RlConfig {
            clip_epsilon: 0.0,
            ..base
        },
        &behaviour,
        "clip_epsilon",
    );
    let other = Trainer::new(
        &ModelConfig {
            tie_embeddings: false,
            ..ModelConfig::tiny()
        },
        7,
    )
    .unwrap();
    check(
        std::slice::from_ref(&good),
        base,
        &other.policy().unwrap(),
        "another model configuration",
    );
    let too_many: Vec<RolloutGroup> = (0..=MAX_GROUPS_PER_STEP as u64)
        .map(|prompt_id| RolloutGroup {
            prompt_id,
            ..good.clone()
        })
        .collect();
    check(&too_many, base, &behaviour, "4097 groups");
    assert_eq!(trainer.rl_steps(), 0);
    assert_eq!(trainer.policy().unwrap().config(), behaviour.config());

    let warmup = WarmupConfig::default();
    for (bad, expected) in [
        (
            WarmupConfig {
                batch_size: 0,
                ..warmup
            },
            "batch_size 0",
        ),
        (
            WarmupConfig {
                batch_size: MAX_WARMUP_BATCH + 1,
                ..warmup
            },
            "batch_size 4097",
        ),
        (
            WarmupConfig {
                learning_rate: 1.0,
                ..warmup
            },
            "warm-up learning_rate 1",
        ),
    ] {
        let message = trainer.warmup(&task, &bad, |_| {}).unwrap_err().to_string();
        assert!(message.contains(expected), "{message}");
    }
    assert_eq!(trainer.warmup_steps(), 0);
}

#[test]
fn training_is_a_pure_function_of_seed_and_inputs() {
    let task = Task::addition(2, 2);
    let warmup = WarmupConfig {
        steps: 2,
        batch_size: 16,
        learning_rate: 3e-3,
    };
    let run = |seed: u64, order: &dyn Fn(&mut Vec<RolloutGroup>)| {
        let mut trainer = Trainer::new(&ModelConfig::tiny(), seed).unwrap();
        trainer.warmup(&task, &warmup, |_| {}).unwrap();
        let behaviour = trainer.policy().unwrap();
        let problems: Vec<Problem> = (0..4).map(|id| task.problem(id).unwrap()).collect();
        let sampling = SamplingConfig {
            samples_per_prompt: 4,
            temperature: 1.0,
            max_new_tokens: task.max_completion_tokens(),
        };
        let mut groups = behaviour.generate(&problems, &sampling, 9).unwrap().groups;
        order(&mut groups);
        trainer
            .train_step(&task, &groups, &behaviour, None, &rl(Algorithm::Grpo))
            .unwrap();
        trainer.export_bf16().unwrap()
    };
    let first = run(1, &|_| {});
    assert_eq!(
        first,
        run(1, &|groups| groups.reverse()),
        "arrival order changed the result"
    );
    assert_ne!(first, run(2, &|_| {}));
}

#[test]
fn warmup_in_pieces_equals_warmup_at_once_and_state_resumes_exactly() {
    let task = Task::countdown(3, 9, 4);
    let config = |steps| WarmupConfig {
        steps,
        batch_size: 8,
        learning_rate: 3e-3,
    };
    let mut whole = Trainer::new(&ModelConfig::tiny(), 8).unwrap();
    let mut losses = Vec::new();
    whole.warmup(&task, &config(3), |p| losses.push(p)).unwrap();
    assert_eq!(
        losses.iter().map(|p| p.step).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );

    let mut pieces = Trainer::new(&ModelConfig::tiny(), 8).unwrap();
    pieces.warmup(&task, &config(1), |_| {}).unwrap();
    let saved = pieces.save_state().unwrap();
    let mut resumed = Trainer::load_state(&saved).unwrap();
    assert_eq!(resumed.save_state().unwrap(), saved);
    assert_eq!(resumed.warmup_steps(), 1);
    resumed.warmup(&task, &config(2), |_| {}).unwrap();
    assert_eq!(resumed.export_bf16().unwrap(), whole.export_bf16().unwrap());
    assert_eq!(resumed.save_state().unwrap(), whole.save_state().unwrap());

    whole.reset_optimizer().unwrap();
    assert_ne!(whole.save_state().unwrap(), resumed.save_state().unwrap());
    assert_eq!(whole.export_bf16().unwrap(), resumed.export_bf16().unwrap());
}

#[test]
fn load_state_refuses_what_is_not_a_trainer_state() {
    let trainer = Trainer::new(&ModelConfig::tiny(), 9).unwrap();
    let saved = trainer.save_state().unwrap();
    let check = |bytes: &[u8], expected: &str| {
        let message = match Trainer::load_state(bytes) {
            Ok(_) => panic!("accepted"),
            Err(error) => error.to_string(),
        };
        assert!(message.contains(expected), "{message}");
    };
    check(&saved[..saved.len() - 3], "not a valid safetensors");
    check(&trainer.export_bf16().unwrap(), "not a trainer state");
    let text = String::from_utf8_lossy(&saved).into_owned();
    let header_end = text.find("\"__metadata__\"").unwrap();
    let mut forged = saved.clone();
    let version = text[header_end..].find("\\\"version\\\":1").unwrap() + header_end;
    forged[version + 12] = b'7';
    check(&forged, "version 7, expected");
    let mut forged = saved.clone();
    let hidden = text[header_end..].find("\\\"hidden_size\\\":32").unwrap() + header_end;
    forged[hidden + 17] = b'4';
    check(&forged, "shape [21, 32], expected [21, 34]");
    check_state_len(MAX_STATE_BYTES).unwrap();
    let message = check_state_len(MAX_STATE_BYTES + 1)
        .unwrap_err()
        .to_string();
    assert!(message.contains("exceed"), "{message}");
}

#[test]
fn warmup_teaches_the_tiny_model_beyond_a_random_policy() {
    // One-digit addition has 100 problems; the split holds out 7 of them, so the
    // model must generalise from the other 93 to solve any.
    let task = Task::addition(1, 5);
    let held_out = task.held_out(7).unwrap();
    let mut trainer = Trainer::new(&ModelConfig::tiny(), 11).unwrap();
    let random = trainer
        .policy()
        .unwrap()
        .accuracy(&task, &held_out)
        .unwrap();
    let mut losses = Vec::new();
    let config = WarmupConfig {
        steps: 200,
        batch_size: 32,
        learning_rate: 1e-2,
    };
    trainer
        .warmup(&task, &config, |p| losses.push(p.loss))
        .unwrap();
    let policy = trainer.policy().unwrap();
    let trained = policy.accuracy(&task, &held_out).unwrap();
    let training: Vec<Problem> = (0..50).map(|id| task.problem(id).unwrap()).collect();
    let seen = policy.accuracy(&task, &training).unwrap();
    assert!(losses[losses.len() - 1] < losses[0] / 3.0, "{losses:?}");
    assert_eq!(random.correct, 0);
    assert!(seen.fraction() >= 0.5, "{seen:?} on training problems");
    assert!(
        trained.correct >= 2,
        "{trained:?} after warm-up, {random:?} before"
    );
}
