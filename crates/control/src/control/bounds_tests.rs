//! Bounds and resilience: the configured limits, the state's round trip and restore (a
//! corrupt snapshot refused with a typed error), inflated or hostile reports, and preemption.

use super::tests::{Hub, V1, at, config, good_report, hash, registration};
use super::*;
use crate::config::PartialBatchPolicy;
use crate::restore::Snapshot;
use crate::scheduler::MilliTokensPerS;
use crate::values::{LeaseId, Permille};

#[test]
fn limit_max_actors() {
    let mut config = config();
    config.limits.max_actors = 2;
    let mut hub = Hub::new(config);
    hub.join(1);
    hub.join(2);
    let third = hub
        .core
        .register(ActorId(3), registration("eu", false, V1, None), at(0));
    assert_eq!(third, Err(MembershipError::ActorLimit { max: 2 }));
    hub.join(2);
    hub.core.leave(ActorId(1)).unwrap();
    hub.join(3);
}

#[test]
fn limit_max_batch_size() {
    let mut hub = Hub::with_actors(&[1]);
    let prompts: Vec<PromptId> = (0..513).map(PromptId).collect();
    assert_eq!(
        hub.core.open_step(&prompts, at(0)),
        Err(OpenStepError::BatchTooLarge {
            size: 513,
            max: 512
        })
    );
    assert!(hub.core.open_step(&prompts[..512], at(0)).is_ok());
}

#[test]
fn limit_max_leases_per_actor_bounds_claims_and_submissions() {
    let mut config = config();
    config.limits.max_leases_per_actor = 32;
    let mut hub = Hub::new(config);
    hub.join(1);
    hub.open(40, 0);
    let first = hub.claim(1, 0);
    assert_eq!(first.len(), 32);
    assert_eq!(hub.claim(1, 10).len(), 0, "at the limit");
    assert_eq!(hub.submit_all(1, &first[..5], 100, 20), 5);
    assert_eq!(
        hub.claim(1, 30).len(),
        5,
        "reservation is drawn on as leases free up"
    );
    let too_many = vec![good_report(&first[5], 100); 33];
    assert_eq!(
        hub.core.submit(ActorId(1), &too_many, at(40)),
        Err(SubmitError::TooManyResults { count: 33, max: 32 })
    );
}

#[test]
fn limit_max_pending_events() {
    let mut config = config();
    config.limits.max_pending_events = 3;
    let mut hub = Hub::new(config);
    for actor in 1..=5 {
        hub.join(actor);
        hub.core.leave(ActorId(actor)).unwrap();
    }
    assert_eq!(hub.events().len(), 3);
    assert_eq!(hub.core.events_dropped(), 2);
}

#[test]
fn the_whole_state_survives_a_json_round_trip() {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.measure(&[(1, 3_000), (2, 1_000)], 0);
    hub.open(8, 2_000);
    let grants = hub.claim(1, 2_000);
    let bad = RolloutReport {
        tokens: 0,
        ..good_report(&grants[0], 1)
    };
    hub.submit(1, &[bad], 2_100);
    // Restoring forgives silence up to the restore time; with every actor heard at
    // the clock there is nothing to forgive, so the copies must be identical.
    hub.core.heartbeat(ActorId(2), at(2_100)).unwrap();
    let json = serde_json::to_string(&hub.core).unwrap();
    let snapshot: Snapshot = serde_json::from_str(&json).unwrap();
    assert_eq!(snapshot, hub.core.snapshot());
    let mut restored = ControlPlane::restore(snapshot, at(2_100)).unwrap();
    assert_eq!(restored, hub.core);
    // Both copies continue identically.
    let reports: Vec<RolloutReport> = grants[1..]
        .iter()
        .map(|grant| good_report(grant, 300))
        .collect();
    let expected = hub.core.submit(ActorId(1), &reports, at(3_000));
    assert_eq!(restored.submit(ActorId(1), &reports, at(3_000)), expected);
    assert_eq!(restored, hub.core);
}

#[test]
fn resuming_after_an_outage_forgives_the_silence_but_not_the_leases() {
    let mut hub = Hub::with_actors(&[1]);
    hub.open(1, 0);
    let grant = hub.claim(1, 0)[0];
    let json = serde_json::to_string(&hub.core).unwrap();
    let snapshot: Snapshot = serde_json::from_str(&json).unwrap();
    // Down for 12 s: far past the heartbeat timeout and the lease.
    let mut restored = ControlPlane::restore(snapshot, at(12_000)).unwrap();
    assert!(restored.member(ActorId(1)).is_some());
    let late = restored.submit(ActorId(1), &[good_report(&grant, 100)], at(12_001));
    assert_eq!(late, Ok(vec![Err(Rejection::Late)]));
}

#[test]
fn from_snapshot_keeps_the_state_exactly_and_resume_does_the_rest_of_restore() {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.open(4, 0);
    hub.claim(1, 0);
    let json = serde_json::to_string(&hub.core).unwrap();
    let snapshot: Snapshot = serde_json::from_str(&json).unwrap();
    let mut exact = ControlPlane::from_snapshot(snapshot.clone()).unwrap();
    assert_eq!(exact, hub.core);
    // 12 s later: past the leases and the heartbeat timeout.
    exact.resume(at(12_000));
    assert_ne!(exact, hub.core);
    assert_eq!(exact, ControlPlane::restore(snapshot, at(12_000)).unwrap());
}

#[test]
fn new_refuses_an_invalid_config() {
    let mut invalid = config();
    invalid.limits.max_batch_size = 0;
    assert_eq!(
        ControlPlane::new(invalid),
        Err(ConfigError::Zero("limits.max_batch_size"))
    );
}

/// A snapshot of a core mid-step: two actors, actor 1 holding leases, actor 2 a
/// reservation, one step completed before.
fn mid_step_json() -> serde_json::Value {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.measure(&[(1, 3_000), (2, 1_000)], 0);
    hub.open(8, 2_000);
    hub.claim(1, 2_000);
    serde_json::to_value(&hub.core).unwrap()
}

/// Edits a valid snapshot and checks that restoring it fails with `expected`.
fn check_corrupt(edit: impl FnOnce(&mut serde_json::Value), expected: RestoreError) {
    let mut json = mid_step_json();
    let valid: Snapshot = serde_json::from_value(json.clone()).unwrap();
    assert!(ControlPlane::restore(valid, at(2_000)).is_ok());
    edit(&mut json);
    let snapshot: Snapshot = serde_json::from_value(json).unwrap();
    let error = ControlPlane::restore(snapshot, at(2_000)).unwrap_err();
    assert_eq!(error, expected, "{error}");
}

#[test]
fn restore_refuses_a_corrupt_snapshot_with_a_typed_error() {
    use serde_json::json;
    check_corrupt(
        |s| s["config"]["lease"]["min_ms"] = json!(70_000),
        RestoreError::Config(ConfigError::LeaseBoundsInverted {
            min_ms: 70_000,
            max_ms: 60_000,
        }),
    );
    check_corrupt(
        |s| s["config"]["limits"]["max_actors"] = json!(1),
        RestoreError::TooManyMembers { count: 2, max: 1 },
    );
    // Actor 2's reservation of 2 is raised above the 2 pooled jobs.
    check_corrupt(
        |s| s["ledger"]["step"]["reservations"]["2"] = json!(4),
        RestoreError::OverReserved {
            reserved: 4,
            pooled: 2,
        },
    );
    check_corrupt(
        |s| s["ledger"]["step"]["jobs"][0]["attempts"] = json!(5),
        RestoreError::LeaseAttempt {
            job: 0,
            attempt: 0,
            attempts: 5,
        },
    );
    check_corrupt(
        |s| s["ledger"]["step"]["jobs"][0]["state"]["Leased"]["holder"] = json!(9),
        RestoreError::UnknownHolder {
            job: 0,
            holder: ActorId(9),
        },
    );
    check_corrupt(
        |s| s["ledger"]["step"]["jobs"][1]["prompt"] = json!(0),
        RestoreError::DuplicatePrompt(PromptId(0)),
    );
    check_corrupt(
        |s| s["ledger"]["step"]["jobs"][0]["state"]["Leased"]["expires_at"] = json!(1_000),
        RestoreError::LeaseLifetime {
            job: 0,
            issued_at: at(2_000),
            expires_at: at(1_000),
        },
    );
    check_corrupt(
        |s| s["clock"] = json!(1_500),
        RestoreError::TimeAfterClock {
            what: "last heartbeat",
            at: at(2_000),
            clock: at(1_500),
        },
    );
    check_corrupt(
        |s| s["membership"]["members"]["1"]["estimate"] = json!(u64::MAX),
        RestoreError::ImplausibleEstimate(ActorId(1)),
    );
    check_corrupt(
        |s| s["ledger"]["next_step"] = json!(1),
        RestoreError::StepId {
            step: StepId(1),
            next: StepId(1),
        },
    );
    check_corrupt(
        |s| s["ledger"]["step"]["jobs"] = json!([]),
        RestoreError::BatchSize {
            step: StepId(1),
            size: 0,
            max: 512,
        },
    );
    let message = RestoreError::OverReserved {
        reserved: 4,
        pooled: 3,
    }
    .to_string();
    assert_eq!(message, "4 jobs reserved but only 3 pooled");
}

#[test]
fn an_earlier_now_never_relaxes_the_acceptance_rule() {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.open(4, 0);
    let grants = hub.claim(1, 0);
    assert_eq!(grants[0].expires_at, at(10_000));
    // The core hears of 10.5 s from another actor, without a tick.
    hub.core.heartbeat(ActorId(2), at(10_500)).unwrap();
    assert_eq!(hub.core.clock(), at(10_500));
    // A driver restarted on a clock that is behind hands in 9 s: still late.
    assert_eq!(
        hub.submit(1, &[good_report(&grants[0], 100)], 9_000),
        [Err(Rejection::Late)]
    );
    assert_eq!(hub.core.clock(), at(10_500));
    // The same holds across a restore at an earlier time than the snapshot's clock.
    let json = serde_json::to_string(&hub.core).unwrap();
    let snapshot: Snapshot = serde_json::from_str(&json).unwrap();
    let mut restored = ControlPlane::restore(snapshot, at(1_000)).unwrap();
    assert_eq!(restored.clock(), at(10_500));
    let late = restored.submit(ActorId(1), &[good_report(&grants[1], 100)], at(5_000));
    assert_eq!(late, Ok(vec![Err(Rejection::Late)]));
}

#[test]
fn inflated_token_counts_cannot_buy_the_next_batch() {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.measure(&[(1, 2_000), (2, 2_000)], 0);
    hub.open(8, 2_000);
    let grants = hub.claim(1, 2_000);
    // The most tokens a result may claim, 1 ms after the claim: 4 x 10,000 tokens in
    // 1 ms would be 40 million tokens/s.
    assert_eq!(hub.submit_all(1, &grants, 10_000, 2_001), 4);
    // The sample is taken over at least 1 s and capped at 10,000 tokens/s (here also
    // MAX_SAMPLE_GROWTH times the floor of 2,500).
    assert_eq!(hub.estimate(1), MilliTokensPerS::from_tokens_per_s(10_000));
    let theirs = hub.claim(2, 2_000);
    hub.submit_all(2, &theirs, 500, 3_000);
    assert_eq!(hub.estimate(2), MilliTokensPerS::from_tokens_per_s(2_000));
    hub.open(120, 4_000);
    // By the estimates 10,000 : 2,000, not 40 million : 2,000.
    assert_eq!(hub.claim(1, 4_000).len(), 100);
    assert_eq!(hub.claim(2, 4_000).len(), 20);
}

#[test]
fn one_inflated_settlement_raises_an_estimate_at_most_1_6_times_by_default() {
    let mut config = Config::default();
    config.limits.max_tokens_per_result = 1 << 20;
    let mut hub = Hub::new(config);
    for actor in 1..=4 {
        hub.join(actor);
    }
    // Four equal actors, 2,000 tokens/s each after a few honest steps.
    let mut now = 0;
    for _ in 0..40 {
        hub.open(4, now);
        for actor in 1..=4 {
            let grants = hub.claim(actor, now);
            hub.submit_all(
                actor,
                &grants,
                2_000 / grants.len().max(1) as u64,
                now + 1_000,
            );
        }
        now += 2_000;
    }
    let honest = hub.estimate(1);
    assert!(honest.tokens_per_s() > 1_900.0, "{honest:?}");
    // Actor 1 claims a million tokens per result, 500 times its real output.
    hub.open(4, now);
    let grants = hub.claim(1, now);
    hub.submit_all(1, &grants, 1 << 20, now + 1_000);
    let inflated = hub.estimate(1);
    // 0.8 x honest + 0.2 x (4 x honest), within the average's rounding.
    assert!(
        inflated.milli_tokens_per_s() <= honest.milli_tokens_per_s() * 16 / 10 + 1,
        "{honest:?} -> {inflated:?}"
    );
    // Its share of the next batch: at most 1.6 / 4.6 of it (within the one job of
    // rounding), not nearly all.
    for actor in 2..=4 {
        let grants = hub.claim(actor, now);
        hub.submit_all(
            actor,
            &grants,
            2_000 / grants.len().max(1) as u64,
            now + 1_000,
        );
    }
    hub.open(460, now + 2_000);
    let share = hub.claim(1, now + 2_000).len();
    assert!(share <= 161, "{share} of 460");
}

#[test]
fn an_actor_whose_leases_keep_expiring_loses_share() {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.measure(&[(1, 2_000), (2, 2_000)], 0);
    let mut now = 2_000;
    let mut shares = Vec::new();
    for _ in 0..3 {
        hub.open(40, now);
        let mine = hub.claim(1, now).len();
        shares.push(mine);
        // Actor 2 delivers at a steady 2,000 tokens/s (one second per claim); actor 1
        // stays alive but never answers its leases.
        let steady = |grants: &[LeaseGrant]| 2_000 / grants.len().max(1) as u64;
        let theirs = hub.claim(2, now);
        hub.submit_all(2, &theirs, steady(&theirs), now + 1_000);
        let expiry = hub.core.next_deadline().unwrap().0;
        while now < expiry {
            now = (now + 1_000).min(expiry);
            hub.core.heartbeat(ActorId(1), at(now)).unwrap();
            hub.core.heartbeat(ActorId(2), at(now)).unwrap();
        }
        hub.core.tick(at(now));
        for _ in 0..40 {
            if hub.progress().completion.is_some() {
                break;
            }
            let rest = hub.claim(2, now);
            now += 1_000;
            hub.submit_all(2, &rest, steady(&rest), now);
            hub.core.heartbeat(ActorId(1), at(now)).unwrap();
        }
        assert!(hub.progress().completion.is_some());
        now += 1_000;
    }
    assert!(
        shares.windows(2).all(|pair| pair[1] < pair[0]),
        "shares {shares:?}"
    );
    assert!(hub.estimate(1) < hub.estimate(2));
}

#[test]
fn a_completed_steps_outcome_is_handed_over_before_the_next_step() {
    let mut config = config();
    config.partial_batch = Some(PartialBatchPolicy {
        after_ms: 1_000,
        min_accepted: Permille::clamped(500),
    });
    let mut hub = Hub::new(config);
    hub.join(1);
    hub.join(2);
    let prompts: Vec<PromptId> = (10..14).map(PromptId).collect();
    let step = hub.core.open_step(&prompts, at(0)).unwrap();
    assert_eq!(hub.core.take_step_outcome(), None, "the step is still open");
    let grants = hub.claim(1, 0);
    hub.claim(2, 0);
    assert_eq!(hub.submit_all(1, &grants, 100, 1_500), 2);
    // Completed partially: two results in, two prompts unfinished.
    assert_eq!(
        hub.core.open_step(&[PromptId(20)], at(1_600)),
        Err(OpenStepError::OutcomeNotTaken(step))
    );
    let peeked = hub.core.step_outcome();
    assert_eq!(hub.core.step_outcome(), peeked, "looking takes nothing");
    let outcome = hub.core.take_step_outcome().unwrap();
    assert_eq!(peeked.as_ref(), Some(&outcome));
    assert_eq!(hub.core.step_outcome(), None, "taken");
    assert_eq!(outcome.step, step);
    assert_eq!(
        outcome.accepted,
        [(PromptId(10), ActorId(1)), (PromptId(11), ActorId(1))]
    );
    assert_eq!(outcome.unfinished, [PromptId(12), PromptId(13)]);
    assert!(outcome.completion.partial);
    assert_eq!(hub.core.take_step_outcome(), None, "handed out once");
    assert!(hub.core.open_step(&[PromptId(12)], at(1_600)).is_ok());
}

fn preempting_hub() -> (Hub, Vec<LeaseGrant>) {
    let mut config = config();
    config.preemption_grace_ms = 3_000;
    let mut hub = Hub::new(config);
    hub.join(1);
    hub.join(2);
    hub.open(8, 0);
    let grants = hub.claim(1, 0);
    assert_eq!(grants.len(), 4);
    hub.core.preempt(ActorId(1), at(1_000)).unwrap();
    (hub, grants)
}

#[test]
fn a_preempted_actor_delivers_within_its_window_and_gets_no_new_work() {
    let (mut hub, grants) = preempting_hub();
    assert_eq!(
        hub.core.claim(ActorId(1), at(1_100)),
        Ok(Assignment::Leaving {
            leaving_at: at(4_000)
        })
    );
    // The whole batch goes to actor 2 now, but not actor 1's live leases.
    assert_eq!(hub.claim(2, 1_100).len(), 4);
    assert_eq!(hub.submit_all(1, &grants[..3], 100, 3_999), 3);
    assert!(hub.core.member(ActorId(1)).is_some());
    assert_eq!(hub.core.next_deadline(), Some(at(4_000)));
    hub.core.tick(at(4_000));
    assert!(hub.core.member(ActorId(1)).is_none());
    assert!(hub.events().contains(&Event::ActorDeparted {
        actor: ActorId(1),
        reason: Departure::Preempted,
        leases_returned: 1,
    }));
    assert_eq!((hub.progress().accepted, hub.progress().pooled), (3, 1));
}

#[test]
fn a_result_after_the_preemption_window_is_refused_without_a_tick() {
    let (mut hub, grants) = preempting_hub();
    let late = hub
        .core
        .submit(ActorId(1), &[good_report(&grants[0], 100)], at(4_000));
    assert_eq!(late, Ok(vec![Err(Rejection::UnknownActor)]));
    assert_eq!(hub.progress().pooled, 8);
    // A second notice never extends the window.
    let (mut hub, _) = preempting_hub();
    hub.core.preempt(ActorId(1), at(2_000)).unwrap();
    assert_eq!(
        hub.core.member(ActorId(1)).unwrap().leaving_at,
        Some(at(4_000))
    );
}

mod hostile {
    //! Random operation sequences, hostile ones included, against the whole core:
    //! nothing panics, every invariant holds after every call, no prompt is accepted
    //! twice, and nothing is accepted at or after its lease's expiry as the core saw
    //! time.

    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Register {
            actor: u64,
            behind: bool,
        },
        Heartbeat {
            actor: u64,
        },
        Leave {
            actor: u64,
        },
        Preempt {
            actor: u64,
        },
        Claim {
            actor: u64,
        },
        /// Submits the `pick`-th known grant (or a forged lease) with a twist.
        Submit {
            actor: u64,
            pick: usize,
            forge: Option<LeaseId>,
            tokens: u64,
            twist: u8,
        },
        Tick,
        Open {
            size: u64,
        },
        TakeOutcome,
        Publish,
        Restart,
    }

    fn op() -> impl Strategy<Value = Op> {
        let actor = 0u64..5;
        prop_oneof![
            1 => (actor.clone(), any::<bool>()).prop_map(|(actor, behind)| Op::Register { actor, behind }),
            1 => actor.clone().prop_map(|actor| Op::Heartbeat { actor }),
            1 => actor.clone().prop_map(|actor| Op::Leave { actor }),
            1 => actor.clone().prop_map(|actor| Op::Preempt { actor }),
            3 => actor.clone().prop_map(|actor| Op::Claim { actor }),
            6 => (
                actor,
                any::<usize>(),
                prop::option::weighted(
                    0.2,
                    (0u64..4, 0u32..40, 0u64..4).prop_map(|(step, job, attempt)| LeaseId {
                        step: StepId(step),
                        job,
                        attempt
                    })
                ),
                prop_oneof![Just(0u64), 1u64..20_000, Just(u64::MAX)],
                0u8..6,
            )
                .prop_map(|(actor, pick, forge, tokens, twist)| Op::Submit {
                    actor,
                    pick,
                    forge,
                    tokens,
                    twist
                }),
            2 => Just(Op::Tick),
            1 => (0u64..40).prop_map(|size| Op::Open { size }),
            1 => Just(Op::TakeOutcome),
            1 => Just(Op::Publish),
            1 => Just(Op::Restart),
        ]
    }

    fn run(ops: &[(Op, i64)], grace_ms: u64) -> Result<(), TestCaseError> {
        let mut config = config();
        config.preemption_grace_ms = grace_ms;
        config.limits.max_actors = 4;
        config.limits.max_leases_per_actor = 16;
        let mut hub = Hub::new(config);
        let mut version = V1;
        let mut now: u64 = 0;
        let mut next_prompt = 0;
        let mut grants: Vec<LeaseGrant> = Vec::new();
        let mut accepted: BTreeSet<PromptId> = BTreeSet::new();
        for (op, dt) in ops {
            // Time mostly moves forward but sometimes jumps back.
            now = now.saturating_add_signed(*dt);
            let t = at(now);
            let core = &mut hub.core;
            match op.clone() {
                Op::Register { actor, behind } => {
                    let active = if behind {
                        Version(version.0 - 1)
                    } else {
                        version
                    };
                    let _ = core.register(
                        ActorId(actor),
                        registration("eu", actor % 2 == 0, active, None),
                        t,
                    );
                }
                Op::Heartbeat { actor } => {
                    let _ = core.heartbeat(ActorId(actor), t);
                }
                Op::Leave { actor } => {
                    let _ = core.leave(ActorId(actor));
                }
                Op::Preempt { actor } => {
                    let _ = core.preempt(ActorId(actor), t);
                }
                Op::Claim { actor } => {
                    if let Ok(Assignment::Work { leases, .. }) = core.claim(ActorId(actor), t) {
                        grants.extend(leases);
                    }
                }
                Op::Submit {
                    actor,
                    pick,
                    forge,
                    tokens,
                    twist,
                } => {
                    let Some(grant) = grants.get(pick % grants.len().max(1)).copied() else {
                        continue;
                    };
                    let mut report = good_report(&grant, tokens);
                    if let Some(lease) = forge {
                        report.lease = lease;
                    }
                    match twist {
                        0 => report.version = Version(report.version.0 + 1),
                        1 => report.weights_hash = hash(Version(99)),
                        _ => {}
                    }
                    let before = core.clock();
                    let outcomes = core.submit(ActorId(actor), &[report], t).unwrap();
                    if let Ok(ok) = outcomes[0] {
                        prop_assert!(accepted.insert(ok.prompt), "{} accepted twice", ok.prompt);
                        prop_assert!(forge.is_none() && twist > 1);
                        prop_assert!(core.clock().max(before) < grant.expires_at);
                        prop_assert_eq!(ok.prompt, grant.prompt);
                    }
                }
                Op::Tick => core.tick(t),
                Op::Open { size } => {
                    let prompts: Vec<PromptId> =
                        (next_prompt..next_prompt + size).map(PromptId).collect();
                    if core.open_step(&prompts, t).is_ok() {
                        next_prompt += size;
                    }
                }
                Op::TakeOutcome => {
                    if let Some(outcome) = core.take_step_outcome() {
                        for (prompt, _) in &outcome.accepted {
                            prop_assert!(accepted.contains(prompt));
                        }
                    }
                }
                Op::Publish => {
                    let next = Version(version.0 + 1);
                    if core.publish_version(next, hash(next)).is_ok() {
                        version = next;
                    }
                }
                Op::Restart => {
                    let json = serde_json::to_string(&*core).unwrap();
                    let snapshot: Snapshot = serde_json::from_str(&json).unwrap();
                    *core = ControlPlane::restore(snapshot, t).unwrap();
                }
            }
            let _ = hub.events();
            if let Err(error) = hub.core.check_invariants() {
                return Err(TestCaseError::fail(format!("after {op:?}: {error}")));
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn hostile_operation_sequences_keep_every_invariant(
            ops in prop::collection::vec((op(), -3_000i64..6_000), 1..120),
            grace_ms in prop_oneof![Just(0u64), 1u64..8_000],
        ) {
            run(&ops, grace_ms)?;
        }
    }
}
