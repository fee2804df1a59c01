use super::*;
use crate::config::{Limits, PartialBatchPolicy};
use crate::lease::LeaseConfig;
use crate::ledger::Completion;
use crate::scheduler::{MilliTokensPerS, NewActorEstimate, SchedulerConfig, SplitPolicy};
use crate::values::{Capabilities, LeaseId, Permille};

pub(super) const V1: Version = Version(1);
const V2: Version = Version(2);

pub(super) fn config() -> Config {
    Config {
        limits: Limits {
            max_actors: 8,
            max_batch_size: 512,
            max_leases_per_actor: 256,
            max_pending_events: 256,
            max_tokens_per_result: 10_000,
        },
        lease: LeaseConfig {
            initial_ms: 10_000,
            min_ms: 1_000,
            max_ms: 60_000,
            median_multiplier_percent: 250,
            completion_window: 16,
        },
        scheduler: SchedulerConfig {
            split: SplitPolicy::Proportional,
            // Zero weight on the old estimate: each settlement sets it, which keeps the
            // arithmetic of these tests obvious.
            estimate_weight: Permille::clamped(0),
            behind_decay: Permille::clamped(500),
            // A floor of a quarter of the rate cap keeps MAX_SAMPLE_GROWTH from binding
            // when `measure` sets an estimate in one settlement; it has its own tests.
            new_actor_estimate: NewActorEstimate::MinimumOfKnown {
                floor: MilliTokensPerS::from_tokens_per_s(2_500),
            },
            min_sample_ms: 1_000,
            max_sample_rate: MilliTokensPerS::from_tokens_per_s(10_000),
            expiry_decay: Permille::clamped(500),
        },
        heartbeat_timeout_ms: 5_000,
        partial_batch: None,
        // Most tests want a preemption to act at once; the window has its own tests.
        preemption_grace_ms: 0,
    }
}

pub(super) fn hash(version: Version) -> WeightsHash {
    let mut bytes = [0; 32];
    bytes[..8].copy_from_slice(&version.0.to_le_bytes());
    WeightsHash(bytes)
}

pub(super) fn at(ms: u64) -> Millis {
    Millis(ms)
}

pub(super) fn registration(
    region: &str,
    can_relay: bool,
    active: Version,
    staged: Option<Version>,
) -> Registration {
    Registration {
        region: Region::new(region).unwrap(),
        capabilities: Capabilities { can_relay },
        active,
        staged,
    }
}

pub(super) fn good_report(grant: &LeaseGrant, tokens: u64) -> RolloutReport {
    RolloutReport {
        lease: grant.lease,
        version: grant.version,
        weights_hash: hash(grant.version),
        tokens,
    }
}

/// A control plane with v1 published and helpers that unwrap the happy path.
pub(super) struct Hub {
    pub(super) core: ControlPlane,
}

impl Hub {
    pub(super) fn new(config: Config) -> Hub {
        let mut core = ControlPlane::new(config).unwrap();
        core.publish_version(V1, hash(V1)).unwrap();
        Hub { core }
    }

    pub(super) fn with_actors(actors: &[u64]) -> Hub {
        let mut hub = Hub::new(config());
        for &actor in actors {
            hub.join(actor);
        }
        hub
    }

    pub(super) fn join(&mut self, actor: u64) {
        let readiness =
            self.core
                .register(ActorId(actor), registration("eu", false, V1, None), at(0));
        assert_eq!(readiness, Ok(Readiness::Ready));
    }

    /// Opens a step of prompts `0..prompts`, taking the previous step's outcome first
    /// as a trainer would.
    pub(super) fn open(&mut self, prompts: u64, now: u64) -> StepId {
        self.core.take_step_outcome();
        let prompts: Vec<PromptId> = (0..prompts).map(PromptId).collect();
        self.core.open_step(&prompts, at(now)).unwrap()
    }

    pub(super) fn claim(&mut self, actor: u64, now: u64) -> Vec<LeaseGrant> {
        match self.core.claim(ActorId(actor), at(now)) {
            Ok(Assignment::Work {
                commit: None,
                leases,
            }) => leases,
            other => panic!("expected plain work for actor {actor}, got {other:?}"),
        }
    }

    pub(super) fn submit(
        &mut self,
        actor: u64,
        reports: &[RolloutReport],
        now: u64,
    ) -> Vec<Result<Accepted, Rejection>> {
        self.core.submit(ActorId(actor), reports, at(now)).unwrap()
    }

    pub(super) fn submit_all(
        &mut self,
        actor: u64,
        grants: &[LeaseGrant],
        tokens: u64,
        now: u64,
    ) -> usize {
        let reports: Vec<RolloutReport> = grants
            .iter()
            .map(|grant| good_report(grant, tokens))
            .collect();
        self.submit(actor, &reports, now)
            .iter()
            .filter(|outcome| outcome.is_ok())
            .count()
    }

    pub(super) fn progress(&self) -> StepProgress {
        self.core.step_progress().unwrap()
    }

    pub(super) fn events(&mut self) -> Vec<Event> {
        std::iter::from_fn(|| self.core.poll_event()).collect()
    }

    pub(super) fn estimate(&self, actor: u64) -> MilliTokensPerS {
        self.core.member(ActorId(actor)).unwrap().estimate
    }

    /// Runs a one-prompt-each step in which each actor settles `tokens_per_s` for one
    /// second, so that (with zero estimate weight) its estimate becomes exactly that.
    pub(super) fn measure(&mut self, speeds: &[(u64, u64)], now: u64) {
        self.open(speeds.len() as u64, now);
        for &(actor, tokens_per_s) in speeds {
            let grants = self.claim(actor, now);
            assert_eq!(grants.len(), 1);
            assert_eq!(
                self.submit_all(actor, &grants, tokens_per_s, now + 1_000),
                1
            );
        }
        assert!(self.progress().completion.is_some());
    }
}

#[test]
fn measured_h100_and_a100_reserve_300_prompts_200_100() {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.measure(&[(1, 5_000), (2, 2_500)], 0);
    assert_eq!(hub.estimate(1), MilliTokensPerS::from_tokens_per_s(5_000));
    hub.open(300, 2_000);
    assert_eq!(hub.claim(1, 2_000).len(), 200);
    assert_eq!(hub.claim(2, 2_000).len(), 100);
    assert_eq!(hub.progress().pooled, 0);
}

#[test]
fn a_full_batch_completes_the_step_once() {
    let mut hub = Hub::with_actors(&[1]);
    let step = hub.open(3, 0);
    let grants = hub.claim(1, 0);
    assert_eq!(hub.submit_all(1, &grants, 100, 500), 3);
    let completed = hub
        .events()
        .into_iter()
        .filter(|event| matches!(event, Event::StepCompleted { .. }));
    assert_eq!(
        completed.collect::<Vec<_>>(),
        [Event::StepCompleted {
            step,
            version: V1,
            accepted: 3,
            batch_size: 3,
            partial: false
        }]
    );
    let report = hub.core.step_report().unwrap();
    let accepted: Vec<PromptId> = report.accepted.iter().map(|&(prompt, _)| prompt).collect();
    assert_eq!(accepted, [PromptId(0), PromptId(1), PromptId(2)]);
    assert!(report.leased.is_empty() && report.pooled.is_empty());
    assert_eq!(hub.core.stats().accepted, 3);
}

/// Opens a one-prompt step leased to actor 1, runs `setup`, then submits the report
/// `edit` makes of that lease as `submitter`; checks the rejection and its counter.
fn check_rejection(
    setup: impl FnOnce(&mut Hub, &LeaseGrant),
    submitter: u64,
    edit: impl FnOnce(&mut RolloutReport),
    now: u64,
    expected: Rejection,
) {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.open(1, 0);
    let grant = hub.claim(1, 0)[0];
    setup(&mut hub, &grant);
    let mut report = good_report(&grant, 100);
    edit(&mut report);
    let accepted_before = hub.core.stats().accepted;
    let outcome = hub
        .core
        .submit(ActorId(submitter), &[report], at(now))
        .unwrap();
    assert_eq!(outcome, [Err(expected)]);
    assert_eq!(
        hub.core.stats().rejected.get(&expected),
        Some(&1),
        "{expected:?} not counted"
    );
    assert_eq!(hub.core.stats().accepted, accepted_before);
}

#[test]
fn every_rejection_reason_is_typed_and_counted() {
    let no_setup = |_: &mut Hub, _: &LeaseGrant| {};
    let lease_ms = 10_000;
    check_rejection(no_setup, 9, |_| {}, 10, Rejection::UnknownActor);
    check_rejection(
        no_setup,
        1,
        |r| r.lease.attempt = 1,
        10,
        Rejection::UnknownLease,
    );
    check_rejection(
        no_setup,
        1,
        |r| r.lease.job = 99,
        10,
        Rejection::UnknownLease,
    );
    check_rejection(
        no_setup,
        1,
        |r| r.lease.step = StepId(7),
        10,
        Rejection::UnknownLease,
    );
    check_rejection(no_setup, 2, |_| {}, 10, Rejection::NotLeaseHolder);
    check_rejection(no_setup, 1, |_| {}, lease_ms, Rejection::Late);
    check_rejection(no_setup, 1, |r| r.version = V2, 10, Rejection::WrongVersion);
    check_rejection(
        no_setup,
        1,
        |r| r.weights_hash = hash(V2),
        10,
        Rejection::WrongHash,
    );
    check_rejection(
        no_setup,
        1,
        |r| r.tokens = 0,
        10,
        Rejection::TokenCountOutOfRange,
    );
    check_rejection(
        no_setup,
        1,
        |r| r.tokens = 10_001,
        10,
        Rejection::TokenCountOutOfRange,
    );
    // The lease ran out and the job was re-issued to someone else.
    let reissued = |hub: &mut Hub, _: &LeaseGrant| {
        hub.core.heartbeat(ActorId(1), at(lease_ms - 1)).unwrap();
        hub.core.heartbeat(ActorId(2), at(lease_ms - 1)).unwrap();
        hub.core.tick(at(lease_ms));
        assert_eq!(hub.claim(2, lease_ms).len(), 1);
    };
    check_rejection(reissued, 1, |_| {}, lease_ms + 1, Rejection::Late);
    // The lease was accepted, and a later step is open.
    let next_step = |hub: &mut Hub, grant: &LeaseGrant| {
        assert_eq!(hub.submit_all(1, &[*grant], 100, 5), 1);
        hub.open(1, 6);
    };
    check_rejection(next_step, 1, |_| {}, 10, Rejection::StepClosed);
    // The job was accepted, which completed the one-prompt step.
    let completed = |hub: &mut Hub, grant: &LeaseGrant| {
        assert_eq!(hub.submit_all(1, &[*grant], 100, 5), 1);
    };
    check_rejection(completed, 1, |_| {}, 10, Rejection::StepClosed);
}

#[test]
fn a_job_is_accepted_at_most_once() {
    let mut hub = Hub::with_actors(&[1]);
    hub.open(2, 0);
    let grants = hub.claim(1, 0);
    let report = good_report(&grants[0], 100);
    let outcomes = hub.submit(1, &[report, report], 10);
    assert_eq!(
        outcomes[0],
        Ok(Accepted {
            lease: grants[0].lease,
            prompt: grants[0].prompt
        })
    );
    assert_eq!(outcomes[1], Err(Rejection::Duplicate));
    assert_eq!(hub.submit(1, &[report], 20), [Err(Rejection::Duplicate)]);
    assert_eq!(hub.progress().accepted, 1);
}

#[test]
fn expired_leases_return_their_prompts_at_tick() {
    let mut hub = Hub::with_actors(&[1]);
    hub.open(2, 0);
    let grants = hub.claim(1, 0);
    assert_eq!(
        hub.core.next_deadline(),
        Some(at(5_000)),
        "silence comes before expiry"
    );
    hub.core.heartbeat(ActorId(1), at(9_000)).unwrap();
    assert_eq!(hub.core.next_deadline(), Some(grants[0].expires_at));
    hub.core.tick(at(9_999));
    assert_eq!(hub.progress().leased, 2);
    hub.core.tick(at(10_000));
    assert_eq!((hub.progress().leased, hub.progress().pooled), (0, 2));
    let expired: Vec<LeaseId> = hub
        .events()
        .into_iter()
        .filter_map(|event| match event {
            Event::LeaseExpired {
                lease,
                holder: ActorId(1),
            } => Some(lease),
            _ => None,
        })
        .collect();
    assert_eq!(expired, [grants[0].lease, grants[1].lease]);
    assert_eq!(hub.core.stats().expired, 2);
    // The prompts are handed out again under new attempts.
    let again = hub.claim(1, 10_001);
    assert_eq!(
        again
            .iter()
            .map(|grant| grant.lease.attempt)
            .collect::<Vec<_>>(),
        [1, 1]
    );
}

#[test]
fn expiry_is_also_detected_lazily_without_a_tick() {
    let mut hub = Hub::with_actors(&[1]);
    hub.open(2, 0);
    let grants = hub.claim(1, 0);
    // A late result finds its own lease expired even though nobody ticked.
    assert_eq!(
        hub.submit(1, &[good_report(&grants[0], 100)], 10_000),
        [Err(Rejection::Late)]
    );
    assert_eq!(hub.core.stats().expired, 1);
    assert_eq!((hub.progress().pooled, hub.progress().leased), (1, 1));
    // A claim sweeps the pool first, so the other expired prompt is handed out too.
    assert_eq!(hub.claim(1, 10_000).len(), 2);
    assert_eq!(hub.core.stats().expired, 2);
}

#[test]
fn a_bad_result_revokes_its_lease_at_once() {
    let mut hub = Hub::with_actors(&[1]);
    hub.open(1, 0);
    let grant = hub.claim(1, 0)[0];
    let mut report = good_report(&grant, 100);
    report.weights_hash = hash(V2);
    assert_eq!(hub.submit(1, &[report], 10), [Err(Rejection::WrongHash)]);
    assert_eq!(hub.progress().pooled, 1);
    let again = hub.claim(1, 20);
    assert_eq!(again[0].lease.attempt, 1);
    assert_eq!(hub.submit_all(1, &again, 100, 30), 1);
}

#[test]
fn reservations_lapse_after_one_lease_lifetime() {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.open(10, 0);
    assert_eq!(hub.progress().reserved, 10);
    // Actor 2 never claims; before the lapse actor 1 only gets its own half.
    assert_eq!(hub.claim(1, 100).len(), 5);
    assert_eq!(hub.claim(1, 200).len(), 0);
    hub.core.heartbeat(ActorId(2), at(9_000)).unwrap();
    // After it, actor 1 gets its fair share of what actor 2 left unclaimed, each claim
    // again, so an actor that never shows up delays nobody for long.
    assert_eq!(hub.claim(1, 10_000).len(), 3);
    assert_eq!(hub.progress().reserved, 0);
    assert_eq!(hub.claim(1, 10_001).len(), 1);
    assert_eq!(hub.claim(1, 10_002).len(), 1);
}

#[test]
fn returned_prompts_are_shared_by_the_same_proportions() {
    let mut hub = Hub::with_actors(&[1, 2, 3]);
    hub.measure(&[(1, 3_000), (2, 1_000), (3, 2_000)], 0);
    hub.open(12, 2_000);
    assert_eq!(hub.claim(3, 2_000).len(), 4);
    assert_eq!(hub.claim(1, 2_000).len(), 6);
    assert_eq!(hub.claim(2, 2_000).len(), 2);
    hub.core.preempt(ActorId(3), at(0)).unwrap();
    assert_eq!(hub.progress().pooled, 4);
    // 4 returned prompts over the survivors' estimates 3000:1000.
    assert_eq!(hub.claim(1, 2_100).len(), 3);
    assert_eq!(hub.claim(2, 2_100).len(), 1);
}

#[test]
fn a_claimant_whose_share_rounds_to_zero_still_gets_one_prompt() {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.measure(&[(1, 9_000), (2, 100)], 0);
    hub.open(2, 2_000);
    // 2 * 9000 / 9100 rounds to 2: everything is reserved for the fast actor, which
    // then does not claim before the reservation lapses (2.5 x 1 s after opening).
    assert_eq!(hub.progress().reserved, 2);
    hub.core.heartbeat(ActorId(1), at(4_000)).unwrap();
    hub.core.heartbeat(ActorId(2), at(4_000)).unwrap();
    hub.core.tick(at(4_500));
    assert_eq!(hub.progress().reserved, 0);
    // The slow actor's share of the 2 unreserved prompts is 0.02: it still gets one.
    assert_eq!(hub.claim(2, 4_500).len(), 1);
}

#[test]
fn a_partial_batch_completes_after_its_deadline_with_the_minimum() {
    let mut config = config();
    config.partial_batch = Some(PartialBatchPolicy {
        after_ms: 3_000,
        min_accepted: Permille::clamped(750),
    });
    let mut hub = Hub::new(config);
    hub.join(1);
    hub.open(4, 0);
    let grants = hub.claim(1, 0);
    assert_eq!(hub.submit_all(1, &grants[..2], 100, 1_000), 2);
    hub.core.tick(at(3_000));
    assert_eq!(
        hub.progress().completion,
        None,
        "2 of 4 is below the 75% minimum"
    );
    assert_eq!(hub.submit_all(1, &grants[2..3], 100, 3_500), 1);
    assert_eq!(
        hub.progress().completion,
        Some(Completion {
            at: at(3_500),
            partial: true
        })
    );
    // The straggler's result now belongs to a closed step, and its prompt is reported.
    assert_eq!(
        hub.submit(1, &[good_report(&grants[3], 100)], 3_600),
        [Err(Rejection::StepClosed)]
    );
    assert_eq!(hub.core.step_report().unwrap().pooled, [grants[3].prompt]);
}

#[test]
fn a_result_after_the_partial_deadline_completes_the_step_without_a_tick() {
    let mut config = config();
    config.partial_batch = Some(PartialBatchPolicy {
        after_ms: 3_000,
        min_accepted: Permille::clamped(500),
    });
    let mut hub = Hub::new(config);
    hub.join(1);
    hub.open(2, 0);
    let grants = hub.claim(1, 0);
    assert_eq!(hub.submit_all(1, &grants[..1], 100, 2_999), 1);
    assert_eq!(hub.progress().completion, None, "before the deadline");
    let accepted_at_deadline = hub.submit_all(1, &grants[1..], 100_000, 3_000);
    assert_eq!(
        accepted_at_deadline, 0,
        "rejected for its token count, not for the step"
    );
    assert_eq!(
        hub.progress().completion,
        Some(Completion {
            at: at(3_000),
            partial: true
        })
    );
}

#[test]
fn a_partial_batch_that_already_has_the_minimum_completes_at_the_deadline() {
    let mut config = config();
    config.partial_batch = Some(PartialBatchPolicy {
        after_ms: 3_000,
        min_accepted: Permille::clamped(500),
    });
    let mut hub = Hub::new(config);
    hub.join(1);
    hub.open(4, 0);
    let grants = hub.claim(1, 0);
    hub.submit_all(1, &grants[..2], 100, 1_000);
    hub.core.heartbeat(ActorId(1), at(2_000)).unwrap();
    assert_eq!(hub.core.next_deadline(), Some(at(3_000)));
    hub.core.tick(at(3_000));
    assert_eq!(
        hub.progress().completion,
        Some(Completion {
            at: at(3_000),
            partial: true
        })
    );
    assert_eq!(hub.progress().leased, 0, "completion voids live leases");
}

#[test]
fn an_actor_with_the_step_version_staged_gets_commit_with_its_work() {
    let mut hub = Hub::with_actors(&[1]);
    hub.measure(&[(1, 1_000)], 0);
    hub.core.publish_version(V2, hash(V2)).unwrap();
    let staged = hub
        .core
        .report_versions(ActorId(1), V1, Some(V2), at(1_500));
    assert_eq!(staged, Ok(Readiness::Ready));
    hub.open(2, 2_000);
    let Ok(Assignment::Work { commit, leases }) = hub.core.claim(ActorId(1), at(2_000)) else {
        panic!("expected work");
    };
    assert_eq!(commit, Some(V2));
    assert!(leases.iter().all(|grant| grant.version == V2));
    assert_eq!(
        hub.core.report_versions(ActorId(1), V2, None, at(2_100)),
        Ok(Readiness::Ready)
    );
    assert_eq!(hub.claim(1, 2_200).len(), 0);
}

#[test]
fn an_actor_further_behind_gets_nothing_and_its_estimate_decays() {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.measure(&[(1, 1_000), (2, 4_000)], 0);
    hub.core.publish_version(V2, hash(V2)).unwrap();
    hub.core
        .report_versions(ActorId(1), V1, Some(V2), at(1_500))
        .unwrap();
    hub.open(10, 2_000);
    assert_eq!(hub.estimate(2), MilliTokensPerS::from_tokens_per_s(2_000));
    assert_eq!(
        hub.core.claim(ActorId(2), at(2_000)),
        Ok(Assignment::CatchUp { target: V2 })
    );
    // The eligible actor was reserved the whole batch despite being slower.
    assert_eq!(hub.progress().reserved, 10);
    assert_eq!(
        hub.core
            .claim(ActorId(1), at(2_000))
            .map(|a| matches!(a, Assignment::Work { .. })),
        Ok(true)
    );
    assert_eq!(hub.progress().pooled, 0);
}

#[test]
fn a_rejoining_actor_is_told_to_catch_up_until_it_reports_a_usable_version() {
    let mut hub = Hub::with_actors(&[1]);
    for version in 2..=4 {
        hub.core
            .publish_version(Version(version), hash(Version(version)))
            .unwrap();
    }
    let stale = hub
        .core
        .register(ActorId(2), registration("eu", false, V1, None), at(0));
    assert_eq!(stale, Ok(Readiness::CatchUp { target: Version(4) }));
    let staged = hub
        .core
        .report_versions(ActorId(2), Version(3), Some(Version(4)), at(10));
    assert_eq!(staged, Ok(Readiness::Ready));
    assert_eq!(
        hub.core
            .report_versions(ActorId(2), Version(4), None, at(20)),
        Ok(Readiness::Ready)
    );
    assert_eq!(
        hub.core
            .report_versions(ActorId(2), Version(2), None, at(30)),
        Ok(Readiness::CatchUp { target: Version(4) })
    );
}

fn check_versions_refused(active: u64, staged: Option<u64>, expected: MembershipError) {
    let mut hub = Hub::with_actors(&[1]);
    let reg = registration("eu", false, Version(active), staged.map(Version));
    assert_eq!(
        hub.core.register(ActorId(2), reg, at(0)),
        Err(expected.clone())
    );
    let report = hub
        .core
        .report_versions(ActorId(1), Version(active), staged.map(Version), at(0));
    assert_eq!(report, Err(expected));
}

#[test]
fn reported_versions_are_checked() {
    check_versions_refused(
        2,
        None,
        MembershipError::VersionNotPublished {
            version: V2,
            latest: V1,
        },
    );
    check_versions_refused(
        1,
        Some(2),
        MembershipError::VersionNotPublished {
            version: V2,
            latest: V1,
        },
    );
    check_versions_refused(
        0,
        Some(2),
        MembershipError::StagedNotNext {
            active: Version(0),
            staged: V2,
        },
    );
    check_versions_refused(
        1,
        Some(1),
        MembershipError::StagedNotNext {
            active: V1,
            staged: V1,
        },
    );
    let mut empty = ControlPlane::new(config()).unwrap();
    let reg = registration("eu", false, V1, None);
    assert_eq!(
        empty.register(ActorId(1), reg, at(0)),
        Err(MembershipError::NothingPublished)
    );
    assert_eq!(
        hub_report_unknown(),
        Err(MembershipError::UnknownActor(UnknownActor(ActorId(9))))
    );
}

fn hub_report_unknown() -> Result<Readiness, MembershipError> {
    Hub::with_actors(&[])
        .core
        .report_versions(ActorId(9), V1, None, at(0))
}

#[test]
fn a_silent_actor_is_removed_and_its_leases_return_at_once() {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.open(4, 0);
    let grants_of_1 = hub.claim(1, 0);
    hub.claim(2, 0);
    hub.core.heartbeat(ActorId(2), at(4_000)).unwrap();
    hub.core.tick(at(4_999));
    assert!(hub.core.member(ActorId(1)).is_some());
    hub.core.tick(at(5_000));
    assert!(hub.core.member(ActorId(1)).is_none());
    let departed = Event::ActorDeparted {
        actor: ActorId(1),
        reason: Departure::HeartbeatTimeout,
        leases_returned: 2,
    };
    assert!(hub.events().contains(&departed));
    // Its leases returned well before their expiry at 10 s; actor 2 keeps its own.
    assert_eq!((hub.progress().pooled, hub.progress().leased), (2, 2));
    let late = hub
        .core
        .submit(ActorId(1), &[good_report(&grants_of_1[0], 100)], at(5_001));
    assert_eq!(late, Ok(vec![Err(Rejection::UnknownActor)]));
}

fn check_departure(
    depart: impl FnOnce(&mut ControlPlane) -> Result<(), UnknownActor>,
    reason: Departure,
) {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.open(4, 0);
    hub.claim(1, 0);
    let grants_of_2 = hub.claim(2, 0);
    depart(&mut hub.core).unwrap();
    assert!(hub.events().contains(&Event::ActorDeparted {
        actor: ActorId(1),
        reason,
        leases_returned: 2
    }));
    assert_eq!((hub.progress().pooled, hub.progress().leased), (2, 2));
    // The survivor carries on: its leases are untouched and it gets the returned work.
    assert_eq!(hub.submit_all(2, &grants_of_2, 100, 10), 2);
    assert_eq!(hub.claim(2, 20).len(), 2);
}

#[test]
fn leave_and_preemption_return_leases_at_once_and_survivors_carry_on() {
    check_departure(|core| core.leave(ActorId(1)), Departure::Graceful);
    check_departure(|core| core.preempt(ActorId(1), at(0)), Departure::Preempted);
    let mut hub = Hub::with_actors(&[]);
    assert_eq!(hub.core.leave(ActorId(1)), Err(UnknownActor(ActorId(1))));
    assert_eq!(
        hub.core.preempt(ActorId(1), at(0)),
        Err(UnknownActor(ActorId(1)))
    );
    assert_eq!(
        hub.core.heartbeat(ActorId(1), at(0)),
        Err(UnknownActor(ActorId(1)))
    );
    assert_eq!(
        hub.core.claim(ActorId(1), at(0)),
        Err(UnknownActor(ActorId(1)))
    );
}

#[test]
fn a_reregistration_voids_the_previous_incarnations_leases() {
    let mut hub = Hub::with_actors(&[1]);
    hub.measure(&[(1, 2_000)], 0);
    hub.open(2, 2_000);
    let old = hub.claim(1, 2_000);
    hub.join(1);
    assert_eq!(
        hub.estimate(1),
        MilliTokensPerS::from_tokens_per_s(2_000),
        "same machine, same estimate"
    );
    assert_eq!(hub.progress().pooled, 2);
    assert_eq!(
        hub.submit(1, &[good_report(&old[0], 100)], 2_100),
        [Err(Rejection::Late)]
    );
}

#[test]
fn relays_are_kept_on_joins_and_reassigned_when_they_go() {
    let mut hub = Hub::new(config());
    let join = |hub: &mut Hub, actor: u64, region: &str, can_relay: bool| {
        hub.core
            .register(
                ActorId(actor),
                registration(region, can_relay, V1, None),
                at(0),
            )
            .unwrap();
    };
    join(&mut hub, 5, "eu", true);
    join(&mut hub, 3, "eu", true);
    join(&mut hub, 1, "eu", false);
    join(&mut hub, 7, "us", false);
    let eu = Region::new("eu").unwrap();
    assert_eq!(
        hub.core.relays().get(&eu),
        Some(&ActorId(5)),
        "a join does not move the relay"
    );
    assert_eq!(hub.core.relays().len(), 1, "us has nobody who can relay");
    hub.core.preempt(ActorId(5), at(0)).unwrap();
    assert_eq!(hub.core.relays().get(&eu), Some(&ActorId(3)));
    // Re-registering in another region hands the role on as well.
    join(&mut hub, 3, "us", true);
    let us = Region::new("us").unwrap();
    assert_eq!(hub.core.relays().get(&us), Some(&ActorId(3)));
    assert_eq!(hub.core.relays().get(&eu), None);
    let changes: Vec<(String, Option<ActorId>)> = hub
        .events()
        .into_iter()
        .filter_map(|event| match event {
            Event::RelayChanged { region, relay } => Some((region.to_string(), relay)),
            _ => None,
        })
        .collect();
    let expected = [
        ("eu".to_owned(), Some(ActorId(5))),
        ("eu".to_owned(), Some(ActorId(3))),
        ("eu".to_owned(), None),
        ("us".to_owned(), Some(ActorId(3))),
    ];
    assert_eq!(changes, expected);
}

#[test]
fn a_new_actor_starts_at_the_slowest_known_estimate() {
    let mut hub = Hub::with_actors(&[1, 2]);
    hub.measure(&[(1, 9_000), (2, 3_000)], 0);
    hub.join(3);
    assert_eq!(hub.estimate(3), MilliTokensPerS::from_tokens_per_s(3_000));
    // Never below the floor.
    let mut hub = Hub::with_actors(&[1]);
    hub.measure(&[(1, 1_200)], 0);
    hub.join(2);
    assert_eq!(hub.estimate(2), MilliTokensPerS::from_tokens_per_s(2_500));
}

#[test]
fn throughput_is_measured_from_the_later_of_issue_and_last_settlement() {
    let mut hub = Hub::with_actors(&[1]);
    hub.open(4, 0);
    let grants = hub.claim(1, 0);
    // Two submissions out of one batch: the second covers only its own second.
    hub.submit_all(1, &grants[..2], 1_000, 1_000);
    assert_eq!(hub.estimate(1), MilliTokensPerS::from_tokens_per_s(2_000));
    hub.submit_all(1, &grants[2..], 1_500, 2_000);
    assert_eq!(hub.estimate(1), MilliTokensPerS::from_tokens_per_s(3_000));
}

#[test]
fn the_lease_lifetime_follows_completion_times() {
    let mut hub = Hub::with_actors(&[1]);
    assert_eq!(hub.core.lease_ms(), 10_000);
    hub.open(3, 0);
    let grants = hub.claim(1, 0);
    hub.submit_all(1, &grants, 100, 2_000);
    assert_eq!(hub.core.lease_ms(), 5_000);
    hub.open(1, 3_000);
    assert_eq!(hub.claim(1, 3_000)[0].expires_at, at(8_000));
}

#[test]
fn expired_leases_lengthen_the_next_lease() {
    let mut hub = Hub::with_actors(&[1]);
    hub.measure(&[(1, 1_000)], 0);
    assert_eq!(hub.core.lease_ms(), 2_500);
    hub.open(4, 2_000);
    hub.claim(1, 2_000);
    hub.core.heartbeat(ActorId(1), at(4_000)).unwrap();
    hub.core.tick(at(4_500));
    assert_eq!(hub.core.stats().expired, 4);
    // Samples 1000, 2500 x 4: the median is the expired lifetime, and the next lease
    // is 2.5 times that.
    assert_eq!(hub.core.lease_ms(), 6_250);
}

#[test]
fn publishing_and_opening_follow_the_step_order() {
    let mut hub = Hub::with_actors(&[1]);
    assert_eq!(
        hub.core.publish_version(V1, hash(V1)),
        Err(PublishError::NotNext {
            latest: V1,
            offered: V1
        })
    );
    assert_eq!(
        hub.core.publish_version(Version(3), hash(V2)),
        Err(PublishError::NotNext {
            latest: V1,
            offered: Version(3)
        })
    );
    let step = hub.open(1, 0);
    // One-step asynchrony: the next version is published while actors still generate
    // on this one, and their results are judged by the step's own version and hash.
    assert_eq!(hub.core.publish_version(V2, hash(V2)), Ok(()));
    assert_eq!(hub.core.latest_version(), Some((V2, hash(V2))));
    assert_eq!(
        hub.core.open_step(&[PromptId(9)], at(0)),
        Err(OpenStepError::StepStillOpen(step))
    );
    let grants = hub.claim(1, 0);
    assert!(grants.iter().all(|grant| grant.version == V1));
    hub.submit_all(1, &grants, 100, 10);
    assert_eq!(
        hub.core.open_step(&[PromptId(9)], at(20)),
        Err(OpenStepError::OutcomeNotTaken(step))
    );
    let outcome = hub.core.take_step_outcome().expect("the step completed");
    assert_eq!((outcome.version, outcome.accepted.len()), (V1, 1));
    assert_eq!(
        hub.core.open_step(&[], at(20)),
        Err(OpenStepError::EmptyBatch)
    );
    let twice = [PromptId(1), PromptId(2), PromptId(1)];
    assert_eq!(
        hub.core.open_step(&twice, at(20)),
        Err(OpenStepError::DuplicatePrompt(PromptId(1)))
    );
    let mut empty = ControlPlane::new(config()).unwrap();
    assert_eq!(
        empty.open_step(&[PromptId(1)], at(0)),
        Err(OpenStepError::NothingPublished)
    );
    assert_eq!(
        empty.claim(ActorId(1), at(0)),
        Err(UnknownActor(ActorId(1)))
    );
    empty.publish_version(V1, hash(V1)).unwrap();
    empty
        .register(ActorId(1), registration("eu", false, V1, None), at(0))
        .unwrap();
    assert_eq!(empty.claim(ActorId(1), at(0)), Ok(Assignment::NoOpenStep));
}
