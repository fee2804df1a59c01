//! Whole runs under random and fixed scenarios, and the checker tried on planted bad
//! acceptances and step reports: tests that reach into the driver's state.

use std::collections::BTreeMap;

use aurora_control::{
    Accepted, ActorId, LeaseId, Millis, PromptId, Rejection, RolloutReport, SplitPolicy, StepId,
    StepOutcome, StepReport, Version,
};

use super::checker::{check_outcome, check_step_report};
use super::{PostedStep, Sim, run};
use crate::report::{StepRecord, TrainerCrashes};
use crate::scenario::{BatchedDecode, Fault, Liveness, Misbehavior, Scenario, ScheduledFault};
use crate::world::weights_hash;

const DEFAULT_SEEDS: std::ops::Range<u64> = 0..500;

/// Seeds to run: `AURORA_SIM_SEEDS` as one seed (`1234`) or a range (`0..5000`),
/// else [`DEFAULT_SEEDS`].
fn seeds() -> std::ops::Range<u64> {
    let default = DEFAULT_SEEDS;
    let Ok(spec) = std::env::var("AURORA_SIM_SEEDS") else {
        return default;
    };
    let parse = |text: &str| text.trim().parse::<u64>().ok();
    match spec.split_once("..") {
        Some((start, end)) => parse(start)
            .zip(parse(end))
            .map_or(default, |(start, end)| start..end),
        None => parse(&spec).map_or(default, |seed| seed..seed + 1),
    }
}

#[test]
fn random_scenarios_keep_every_invariant() {
    let mut failures = Vec::new();
    let mut rejected: BTreeMap<Rejection, u64> = BTreeMap::new();
    let (mut partial_steps, mut expired, mut restarts) = (0, 0, 0);
    let mut crashes = TrainerCrashes::default();
    for seed in seeds() {
        match run(&Scenario::random(seed)) {
            Ok(report) => {
                for (&reason, &count) in &report.stats.rejected {
                    *rejected.entry(reason).or_insert(0) += count;
                }
                partial_steps += report.steps.iter().filter(|step| step.partial).count();
                expired += report.stats.expired;
                restarts += report.hub_restarts;
                crashes.opening += report.trainer_crashes.opening;
                crashes.step_open += report.trainer_crashes.step_open;
                crashes.training += report.trainer_crashes.training;
            }
            Err(violation) => failures.push(violation.to_string()),
        }
    }
    assert!(
        failures.is_empty(),
        "{} seeds failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // Over the default seeds every fault must actually have bitten, or the run
    // proved nothing about it.
    if seeds() == DEFAULT_SEEDS {
        assert_eq!(
            rejected.len(),
            9,
            "some rejection reasons never happened: {rejected:?}"
        );
        assert!(
            partial_steps > 10 && expired > 1_000 && restarts > 100,
            "{partial_steps} {expired} {restarts}"
        );
        // The trainer crashed in each of its phases, the control plane with it.
        assert!(
            crashes.opening > 10 && crashes.step_open > 50 && crashes.training > 20,
            "{crashes:?}"
        );
    }
}

#[test]
fn a_seed_replays_exactly() {
    let first = run(&Scenario::random(7)).unwrap();
    let second = run(&Scenario::random(7)).unwrap();
    assert_eq!(first, second);
}

#[test]
fn without_heartbeats_a_dead_actor_s_prompts_wait_for_their_leases() {
    // The longest step: the one the second A100 died in, five seconds into the run.
    let longest_step_ms = |liveness| {
        let mut scenario = Scenario::a100_l40_pool(7, SplitPolicy::Proportional);
        scenario.liveness = liveness;
        scenario.faults = vec![ScheduledFault {
            at_ms: 5_000,
            fault: Fault::Die { actor: 1 },
        }];
        let report = run(&scenario).unwrap();
        assert_eq!(report.steps.len(), 10);
        report
            .steps
            .iter()
            .map(|step| step.step_ms())
            .max()
            .unwrap()
    };
    let heartbeats = longest_step_ms(Liveness::Heartbeats);
    let leases = longest_step_ms(Liveness::LeaseExpiry);
    // The first leases last at least 30 s; heartbeats find the dead within 4 s.
    assert!(leases > heartbeats + 20_000, "{leases} {heartbeats}");
}

#[test]
fn a_batched_engine_takes_its_longest_sequence_and_shares_each_weight_read() {
    let decode = BatchedDecode {
        iteration_us: 10_000,
        token_ns: 100_000,
        max_sequences: 256,
        sequences_per_prompt: 8,
    };
    // One prompt of 8 sequences of 1,000 tokens: 1,000 iterations of 10 ms, plus 0.1 ms
    // for each of its 8,000 tokens.
    assert_eq!(decode.batch_ms(&[8_000]), 10_000 + 800);
    // A short prompt beside it adds its tokens, not iterations.
    assert_eq!(decode.batch_ms(&[8_000, 800]), 10_000 + 880);
    // More sequences than the engine holds at once take more iterations.
    assert_eq!(decode.batch_ms(&vec![800; 64]), 200 * 10 + 5_120);
    assert!(decode.tokens_per_s(64) < decode.tokens_per_s(256));
    assert_eq!(decode.tokens_per_s(1_000), decode.tokens_per_s(256));
}

#[test]
fn an_invalid_scenario_is_an_error() {
    let mut scenario = Scenario::random(1);
    scenario.faults.push(ScheduledFault {
        at_ms: 5,
        fault: Fault::Die { actor: 99 },
    });
    let violation = run(&scenario).unwrap_err();
    assert!(
        violation
            .message
            .starts_with("invalid scenario: a fault targets actor 99"),
        "{violation}"
    );
    let mut scenario = Scenario::random(1);
    scenario.tokens_per_prompt = (10, 5);
    assert!(
        run(&scenario)
            .unwrap_err()
            .message
            .starts_with("invalid scenario")
    );
}

/// A generation limit cuts the rollouts drawn past it, and leaves the others as drawn.
#[test]
fn rollouts_drawn_past_the_limit_are_cut_at_it() {
    let mut scenario = Scenario::random(3);
    scenario.tokens_per_prompt = (50, 600);
    let drawn: Vec<u64> = (0..1_000)
        .map(|p| scenario.tokens_for(PromptId(p)))
        .collect();
    scenario.rollout_limit = Some(300);
    let cut: Vec<u64> = (0..1_000)
        .map(|p| scenario.tokens_for(PromptId(p)))
        .collect();
    assert!(drawn.iter().any(|&tokens| tokens > 300));
    for (&drawn, &cut) in drawn.iter().zip(&cut) {
        assert_eq!(cut, drawn.min(300));
    }
    assert!(run(&scenario).is_ok());
    scenario.rollout_limit = Some(0);
    let refused = run(&scenario).unwrap_err();
    assert!(
        refused.message.contains("a rollout limit of 0 tokens"),
        "{refused}"
    );
}

#[test]
fn the_checker_catches_a_lost_step() {
    // Only actor 0 exists and it dies: the step can never complete.
    let mut scenario = Scenario::random(3);
    scenario.actors.truncate(1);
    scenario.faults = vec![ScheduledFault {
        at_ms: 100,
        fault: Fault::Die { actor: 0 },
    }];
    let violation = run(&scenario).unwrap_err();
    assert!(violation.message.starts_with("stalled"), "{violation}");
    assert!(violation.to_string().contains("AURORA_SIM_SEEDS=3"));
}

#[test]
fn an_actor_exaggerating_its_tokens_does_not_grab_the_batch() {
    // An L40 (1,000 tokens/s of 6,800) reports 100,000 tokens per result, 100 to
    // 500 times its output, for one batch once the estimates have converged.
    let mut scenario = Scenario::a100_l40_pool(42, SplitPolicy::Proportional);
    let fault_at = Millis(60_000);
    scenario.faults = vec![ScheduledFault {
        at_ms: fault_at.0,
        fault: Fault::Misbehave {
            actor: 2,
            misbehavior: Misbehavior::ExaggerateTokens,
        },
    }];
    let report = run(&scenario).unwrap();
    let liar = |step: &StepRecord| {
        step.estimates
            .iter()
            .find(|(label, _)| label == "L40-1")
            .map(|&(_, estimate)| estimate)
            .unwrap()
    };
    let honest = report
        .steps
        .iter()
        .rfind(|step| step.completed_at < fault_at)
        .map(liar)
        .unwrap();
    let after = report
        .steps
        .iter()
        .filter(|step| step.completed_at >= fault_at)
        .map(liar)
        .fold(0.0, f64::max);
    // One settlement: 0.7 x + 0.3 x 4x = 1.9x at most of an estimate that is at
    // most the true 1,000 tokens/s, where the rate cap alone (20,000 tokens/s)
    // would have allowed 0.7 x + 6,000, over 6x, a majority of every later batch.
    assert!(
        after > honest * 1.2,
        "the lie did not land: {honest} {after}"
    );
    assert!(after <= 1_900.0, "{honest} -> {after}");
}

/// A simulation stopped at its first grant, with that grant and a result for it
/// that the checker must accept.
fn at_first_grant() -> (Sim<'static>, LeaseId, RolloutReport, Accepted) {
    let scenario: &'static Scenario = Box::leak(Box::new(Scenario::random(11)));
    let mut sim = Sim::new(scenario).unwrap();
    for _ in 0..10_000 {
        if !sim.grants.is_empty() {
            break;
        }
        sim.advance().unwrap();
    }
    let (&lease, grant) = sim.grants.iter().next().unwrap();
    let prompt = *sim.posted[&lease.step]
        .prompts
        .iter()
        .nth(lease.job as usize)
        .unwrap();
    let report = RolloutReport {
        lease,
        version: grant.version,
        weights_hash: weights_hash(grant.version),
        tokens: 100,
    };
    (sim, lease, report, Accepted { lease, prompt })
}

fn check_planted(
    plant: impl FnOnce(&mut Sim<'static>, &mut RolloutReport, &mut Accepted),
    expected: &str,
) {
    let (mut sim, lease, mut report, mut accepted) = at_first_grant();
    let actor = sim.grants[&lease].actor;
    plant(&mut sim, &mut report, &mut accepted);
    let violation = sim.check_accepted(actor, &report, accepted).unwrap_err();
    assert!(violation.message.contains(expected), "{violation}");
}

#[test]
fn the_checker_catches_planted_bad_acceptances() {
    // The unplanted acceptance passes, so each failure below is the plant's.
    let (mut sim, lease, report, accepted) = at_first_grant();
    let actor = sim.grants[&lease].actor;
    sim.check_accepted(actor, &report, accepted).unwrap();
    check_planted(
        |sim, report, _| sim.now = sim.grants[&report.lease].expires_at,
        "at or after its expiry",
    );
    check_planted(
        |sim, report, accepted| {
            let actor = sim.grants[&report.lease].actor;
            sim.check_accepted(actor, report, *accepted).unwrap();
        },
        "twice",
    );
    check_planted(
        |_, report, _| {
            report.version = Version(report.version.0 + 1);
            report.weights_hash = weights_hash(report.version);
        },
        "generated on",
    );
    check_planted(|_, report, _| report.weights_hash.0[0] ^= 1, "generated on");
    check_planted(
        |sim, _, accepted| accepted.prompt = PromptId(sim.next_prompt + 7),
        "never posted",
    );
}

fn posted(prompts: u64) -> PostedStep {
    PostedStep {
        version: Version(1),
        opened_at: Millis(0),
        prompts: (0..prompts).map(PromptId).collect(),
        accepted: BTreeMap::from([(PromptId(0), ActorId(1))]),
        accepted_tokens: 0,
    }
}

fn check_report(edit: impl FnOnce(&mut StepReport), expected: Option<&str>) {
    let mut report = StepReport {
        step: StepId(0),
        version: Version(1),
        accepted: vec![(PromptId(0), ActorId(1))],
        leased: vec![(PromptId(1), ActorId(2))],
        pooled: vec![PromptId(2), PromptId(3)],
        completion: None,
    };
    edit(&mut report);
    let holder = |prompt: PromptId| (prompt == PromptId(1)).then_some(ActorId(2));
    let outcome = check_step_report(&posted(4), &report, holder);
    match expected {
        None => assert_eq!(outcome, Ok(())),
        Some(expected) => {
            let problem = outcome.unwrap_err();
            assert!(problem.contains(expected), "{problem}");
        }
    }
}

#[test]
fn the_checker_catches_planted_bad_step_reports() {
    check_report(|_| {}, None);
    check_report(|r| r.pooled.push(PromptId(0)), Some("listed twice"));
    check_report(|r| r.pooled.pop().map(drop).unwrap_or(()), Some("lost"));
    check_report(|r| r.pooled.push(PromptId(99)), Some("never posted"));
    check_report(
        |r| {
            r.pooled.retain(|&p| p != PromptId(2));
            r.accepted.push((PromptId(2), ActorId(1)));
        },
        Some("differ from the actors"),
    );
    check_report(|r| r.leased[0].1 = ActorId(3), Some("not granted it last"));
    let outcome = StepOutcome {
        step: StepId(0),
        version: Version(1),
        accepted: vec![(PromptId(0), ActorId(1)), (PromptId(0), ActorId(1))],
        unfinished: vec![PromptId(1), PromptId(2), PromptId(3)],
        completion: aurora_control::Completion {
            at: Millis(5),
            partial: false,
        },
    };
    assert!(check_outcome(&posted(4), &outcome).is_err(), "duplicate");
}
