//! The hub's journal: a restart rebuilds the live core exactly from the checkpoint
//! and the records after it, a damaged record is a typed error naming it, leases
//! claimed after the checkpoint keep their deadlines across a replay, and a call that
//! cannot be saved stops the hub.

mod common;

use std::time::Duration;

use aurora_api::RolloutResult;
use aurora_control::{
    ActorId, Assignment, Capabilities, Config, ControlPlane, LeaseGrant, PromptId, Region,
    Registration, RolloutReport, Version, WeightsHash,
};
use aurora_hub::{CallError, Clock, LoadError, OpenError, PersistError};
use axum::http::StatusCode;
use common::{HASH, StoppedHub, TestHub, error_message};
use redb::{ReadableTable, TableDefinition};
use serde_json::value::RawValue;

const STATE: TableDefinition<u64, &[u8]> = TableDefinition::new("control_state");
const JOURNAL: TableDefinition<u64, &[u8]> = TableDefinition::new("journal");

/// Core settings with short leases (10 s) and a heartbeat timeout longer than them.
fn short_leases() -> Config {
    let mut config = Config::default();
    config.lease.initial_ms = 10_000;
    config.lease.min_ms = 10_000;
    config.heartbeat_timeout_ms = 60_000;
    config
}

fn registration(active: u64) -> Registration {
    Registration {
        region: Region::new("eu-west").unwrap(),
        capabilities: Capabilities { can_relay: true },
        active: Version(active),
        staged: None,
    }
}

/// h(v) in these tests.
fn hash(version: Version) -> WeightsHash {
    if version == Version(1) {
        HASH
    } else {
        WeightsHash([u8::try_from(version.0).unwrap(); 32])
    }
}

/// One result per lease, claiming `weights_hash`, with a payload naming its prompt.
fn results(leases: &[LeaseGrant], weights_hash: WeightsHash) -> Vec<RolloutResult> {
    leases
        .iter()
        .map(|grant| RolloutResult {
            report: RolloutReport {
                lease: grant.lease,
                version: grant.version,
                weights_hash,
                tokens: 500,
            },
            payload: RawValue::from_string(format!("{{\"prompt\":{}}}", grant.prompt.0)).unwrap(),
        })
        .collect()
}

/// Claims work for `actor`, activating the Commit it comes with; `None` if the
/// actor gets no work (not a member, leaving, behind, no step).
fn claim(hub: &TestHub, actor: u64) -> Option<Vec<LeaseGrant>> {
    let assignment = match hub.hub.claim(ActorId(actor)) {
        Ok((assignment, _)) => assignment,
        Err(CallError::UnknownActor(_)) => return None,
        Err(error) => panic!("claim: {error}"),
    };
    let Assignment::Work { commit, leases } = assignment else {
        return None;
    };
    if let Some(version) = commit {
        hub.hub
            .report_versions(ActorId(actor), version, None)
            .unwrap();
    }
    Some(leases)
}

/// The checkpoint's key and the journal's records (sequence number and text).
fn journal(stopped: &StoppedHub) -> (u64, Vec<(u64, String)>) {
    stopped.read_db(|txn| {
        let state = txn.open_table(STATE).unwrap();
        let (key, _) = state.first().unwrap().unwrap();
        let records = txn.open_table(JOURNAL).unwrap();
        let records = records
            .iter()
            .unwrap()
            .map(|entry| {
                let (seq, text) = entry.unwrap();
                (
                    seq.value(),
                    String::from_utf8(text.value().to_vec()).unwrap(),
                )
            })
            .collect();
        (key.value(), records)
    })
}

/// Restarts the hub (on the same clock, with no time passing) and checks that the
/// rebuilt core equals the live one carried on by the restart. Returns the hub and
/// the number of journal records the restart replayed after its checkpoint.
fn restart_and_compare(hub: TestHub) -> (TestHub, usize) {
    let now = hub.clock.now();
    let expected: ControlPlane = hub.hub.inspect(|core| {
        let mut core = core.clone();
        core.resume(now);
        core
    });
    let stopped = hub.stop();
    let (checkpoint, records) = journal(&stopped);
    assert!(checkpoint > 1, "no checkpoint after the first");
    let hub = stopped.reopen().unwrap();
    hub.hub.inspect(|core| assert_eq!(core, &expected));
    (hub, records.len())
}

#[test]
fn a_restart_replays_the_journal_after_the_checkpoint_to_the_live_state() {
    const BATCH: u64 = 40;
    let prompts: Vec<u64> = (0..BATCH).collect();
    let mut hub = TestHub::with_config_and_step(short_leases(), &prompts);
    for actor in 1..=4 {
        hub.hub.register(ActorId(actor), registration(1)).unwrap();
    }
    // Records replayed by each restart: one after every round of calls, and one after
    // every step opens.
    let mut replayed = Vec::new();
    let mut version = Version(1);
    for step in 1..=4u64 {
        let mut rounds = 0;
        loop {
            rounds += 1;
            assert!(rounds < 50, "step {step} never completed");
            for actor in 1..=3 {
                let Some(leases) = claim(&hub, actor) else {
                    continue;
                };
                let (wrong, right) = match leases.split_first() {
                    // In a step's first round, one result with a wrong hash (rejected,
                    // its prompt back in the pool).
                    Some((first, rest)) if rounds == 1 => (std::slice::from_ref(first), rest),
                    _ => (&[][..], &leases[..]),
                };
                for (leases, weights_hash) in
                    [(wrong, WeightsHash([1; 32])), (right, hash(version))]
                {
                    hub.hub
                        .submit(ActorId(actor), &results(leases, weights_hash))
                        .unwrap();
                }
            }
            if rounds == 1 {
                // Actor 4 claims and never answers: its leases expire at a tick.
                claim(&hub, 4);
            }
            hub.clock.advance(3_500);
            hub.hub.heartbeat(ActorId(4)).unwrap();
            hub.hub.tick().unwrap();
            match (step, rounds) {
                (2, 1) => hub.hub.preempt(ActorId(3)).unwrap(),
                (3, 1) => {
                    hub.hub
                        .register(ActorId(3), registration(version.0))
                        .unwrap();
                    hub.hub.leave(ActorId(2)).unwrap();
                }
                (4, 1) => {
                    hub.hub
                        .register(ActorId(2), registration(version.0))
                        .unwrap();
                }
                _ => {}
            }
            let taken = hub.hub.take_step_outcome().unwrap();
            let count;
            (hub, count) = restart_and_compare(hub);
            replayed.push(count);
            if let Some(taken) = taken {
                assert_eq!(taken.rollouts.len(), taken.outcome.accepted.len());
                break;
            }
        }
        version = Version(version.0 + 1);
        hub.hub.publish_version(version, hash(version)).unwrap();
        let members: Vec<ActorId> = hub
            .hub
            .inspect(|core| core.members().keys().copied().collect());
        for actor in members {
            hub.hub
                .report_versions(actor, Version(version.0 - 1), Some(version))
                .unwrap();
        }
        let next: Vec<PromptId> = (step * 100..step * 100 + BATCH).map(PromptId).collect();
        hub.hub.open_step(&next).unwrap();
        let count;
        (hub, count) = restart_and_compare(hub);
        replayed.push(count);
    }
    let stats = hub.hub.inspect(|core| core.stats().clone());
    assert!(stats.expired > 0, "{stats:?}");
    assert!(stats.rejected.values().sum::<u64>() > 0, "{stats:?}");
    assert!(replayed.iter().any(|&count| count >= 10), "{replayed:?}");
}

#[test]
fn a_damaged_journal_record_is_a_typed_error_naming_it() {
    let hub = TestHub::with_step(&[10, 11]);
    hub.hub.register(ActorId(1), registration(1)).unwrap();
    hub.hub.heartbeat(ActorId(1)).unwrap();
    hub.hub.claim(ActorId(1)).unwrap();
    let stopped = hub.stop();
    let (_, records) = journal(&stopped);
    assert!(records.len() >= 2, "{records:?}");
    let (last, text) = records.last().unwrap().clone();

    let damaged: [&[u8]; 4] = [
        // Truncated.
        &text.as_bytes()[..text.len() / 2],
        // Not a call.
        br#"{"at":5,"call":{"Launch":{}}}"#,
        // A call with a value no actor could send.
        br#"{"at":5,"call":{"Register":{"actor":9,"registration":{"region":"eu west","capabilities":{"can_relay":false},"active":1,"staged":null}}}}"#,
        b"",
    ];
    for bytes in damaged {
        stopped.edit_db(|txn| {
            txn.open_table(JOURNAL)
                .unwrap()
                .insert(last, bytes)
                .unwrap();
        });
        match stopped.open() {
            Err(OpenError::Load(error @ LoadError::CorruptRecord { seq, .. })) => {
                assert_eq!(seq, last);
                let message = error.to_string();
                let expected = format!("journal record {last} is not a valid call: ");
                assert!(message.starts_with(&expected), "{message}");
            }
            Err(other) => panic!("expected a corrupt record, got {other}"),
            Ok(_) => panic!("a damaged record was replayed"),
        }
    }

    // A record missing from the middle.
    let (first, _) = records[0];
    stopped.edit_db(|txn| {
        txn.open_table(JOURNAL).unwrap().remove(first + 1).unwrap();
    });
    match stopped.open() {
        Err(OpenError::Load(error @ LoadError::JournalGap { .. })) => assert_eq!(
            error.to_string(),
            format!(
                "journal record {} where record {} was expected",
                first + 2,
                first + 1
            )
        ),
        Err(other) => panic!("expected a gap, got {other}"),
        Ok(_) => panic!("a journal with a gap was replayed"),
    }

    // Two checkpoints, then none.
    let (checkpoint, _) = journal(&stopped);
    stopped.edit_db(|txn| {
        let mut state = txn.open_table(STATE).unwrap();
        let text = state.get(checkpoint).unwrap().unwrap().value().to_vec();
        state.insert(checkpoint + 100, text.as_slice()).unwrap();
    });
    match stopped.open() {
        Err(OpenError::Load(LoadError::Checkpoints(2))) => {}
        Err(other) => panic!("expected two checkpoints, got {other}"),
        Ok(_) => panic!("two checkpoints were accepted"),
    }
    stopped.edit_db(|txn| {
        txn.open_table(STATE).unwrap().retain(|_, _| false).unwrap();
    });
    match stopped.open() {
        Err(OpenError::Load(error @ LoadError::NoCheckpoint(_))) => assert_eq!(
            error.to_string(),
            format!("the journal starts at record {first} but there is no checkpoint")
        ),
        Err(other) => panic!("expected no checkpoint, got {other}"),
        Ok(_) => panic!("a journal without a checkpoint was replayed"),
    }
}

#[test]
fn leases_claimed_after_the_checkpoint_are_honoured_or_expire_after_a_replay() {
    let hub = TestHub::with_config_and_step(short_leases(), &[10, 11]);
    hub.hub.register(ActorId(1), registration(1)).unwrap();
    let leases = claim(&hub, 1).unwrap();
    assert_eq!(leases.len(), 2);

    // 4 s in, the hub goes down for 4 s: 8 s of the 10 s lease have passed. The
    // claim is in the journal, so the replay must re-create the leases themselves.
    hub.clock.advance(4_000);
    let stopped = hub.stop();
    let (_, records) = journal(&stopped);
    let (_, last) = records.last().unwrap();
    assert!(last.contains(r#""call":{"Claim":{"actor":1}}"#), "{last}");
    stopped.clock().advance(4_000);
    let hub = stopped.reopen().unwrap();
    let outcomes = hub
        .hub
        .submit(ActorId(1), &results(&leases[..1], HASH))
        .unwrap();
    assert_eq!(outcomes[0].unwrap().prompt, PromptId(10));

    // Down again for 3 s: the other lease ran out during the outage, and its prompt
    // goes to the next claimant.
    hub.clock.advance(3_000);
    let hub = hub.restart();
    let late = hub
        .hub
        .submit(ActorId(1), &results(&leases[1..], HASH))
        .unwrap();
    assert_eq!(late[0], Err(aurora_control::Rejection::Late));
    hub.hub.register(ActorId(2), registration(1)).unwrap();
    let theirs = claim(&hub, 2).unwrap();
    assert_eq!(theirs.len(), 1);
    assert_eq!(
        (theirs[0].prompt, theirs[0].lease.attempt),
        (PromptId(11), 1)
    );
}

#[tokio::test]
async fn a_call_that_cannot_be_saved_stops_the_hub_until_it_restarts() {
    let hub = TestHub::with_step(&[10]);
    let token = hub.register(1).await;
    // Move the checkpoint and the journal to the end of the sequence numbers, so that
    // the restart takes the last one and the first call after it finds none left.
    let stopped = hub.stop();
    stopped.edit_db(|txn| {
        let mut state = txn.open_table(STATE).unwrap();
        let checkpoint = state.pop_first().unwrap().unwrap().1.value().to_vec();
        let mut journal = txn.open_table(JOURNAL).unwrap();
        let mut records = Vec::new();
        while let Some((_, record)) = journal.pop_first().unwrap() {
            records.push(record.value().to_vec());
        }
        let first = u64::MAX - 1 - u64::try_from(records.len()).unwrap();
        state.insert(first, checkpoint.as_slice()).unwrap();
        for (seq, record) in (first..).zip(&records) {
            journal.insert(seq, record.as_slice()).unwrap();
        }
    });
    let hub = stopped.reopen().unwrap();
    // `aurora_hub::serve` exits when this resolves: not before the failure, at once after.
    let stopped_now = || tokio::time::timeout(Duration::ZERO, hub.hub.wait_stopped());
    assert!(stopped_now().await.is_err(), "the hub is serving");

    let (status, body) = hub.post("/v1/heartbeat", &token, r#"{"actor":1}"#).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(stopped_now().await.is_ok(), "the hub has stopped");
    assert_eq!(
        error_message(&body),
        "the journal's sequence numbers are exhausted; the hub has stopped: restart it to \
         carry on from its database"
    );
    let (status, body) = hub.post("/v1/heartbeat", &token, r#"{"actor":1}"#).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        error_message(&body),
        "the hub stopped after failing to save a call; restart it to carry on from its database"
    );
    // Status and metrics could show the unsaved call, so they are refused too.
    for path in ["/v1/status", "/metrics"] {
        let (status, _) = hub
            .call(axum::http::Method::GET, path, Some(common::FLEET), "")
            .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{path}");
    }
    assert!(matches!(hub.hub.tick(), Err(CallError::Stopped)));
    assert!(matches!(
        hub.hub.take_step_outcome(),
        Err(CallError::Stopped)
    ));
    // The unsaved heartbeat is gone after a restart, which here cannot save its own
    // record either.
    match hub.stop().reopen() {
        Err(OpenError::Resume(PersistError::SequenceExhausted)) => {}
        Err(other) => panic!("expected exhausted sequence numbers, got {other}"),
        Ok(_) => panic!("the hub restarted without sequence numbers"),
    }
}

/// The sequence number of the next call, from [`journal`]'s answer.
fn next_record((checkpoint, records): &(u64, Vec<(u64, String)>)) -> u64 {
    records.last().map_or(*checkpoint, |(seq, _)| seq + 1)
}

/// The core as a restart at the clock's time would carry it on from `core`.
fn resumed(hub: &TestHub, core: &ControlPlane) -> ControlPlane {
    let mut core = core.clone();
    core.resume(hub.clock.now());
    core
}

#[test]
fn a_crash_loses_at_most_the_idle_claims_and_heartbeats_after_the_last_synced_call() {
    let hub = TestHub::with_config_and_step(short_leases(), &[10, 11]);
    hub.hub.register(ActorId(1), registration(1)).unwrap();
    assert_eq!(claim(&hub, 1).unwrap().len(), 2);
    // A granted lease is synced before the claim is answered.
    let leased = |hub: &TestHub| {
        hub.hub
            .inspect(|core| core.step_report().unwrap().leased.len())
    };
    assert_eq!(leased(&hub.crash_image().reopen().unwrap()), 2);
    hub.hub.register(ActorId(2), registration(1)).unwrap();
    let synced = (
        journal(&hub.crash_image()),
        hub.hub.inspect(ControlPlane::clone),
    );
    // Actor 2 finds nothing left, again and again, and both send heartbeats: none of
    // these calls waits for the disk, and none is a promise a restart must keep.
    for _ in 0..20 {
        hub.clock.advance(50);
        assert_eq!(claim(&hub, 2).unwrap(), []);
        hub.hub.heartbeat(ActorId(1)).unwrap();
    }
    let image = hub.crash_image();
    assert_eq!(journal(&image), synced.0, "an idle call was synced");
    // A process killed now restarts from the last synced call: a state the live hub
    // passed through, carried on by the restart.
    let restarted = image.reopen().unwrap();
    assert_eq!(
        restarted.hub.inspect(ControlPlane::clone),
        resumed(&hub, &synced.1)
    );

    // A call that waits for the disk takes the unsynced ones before it along.
    hub.hub.register(ActorId(3), registration(1)).unwrap();
    let image = hub.crash_image();
    assert_eq!(next_record(&journal(&image)), next_record(&synced.0) + 41);
    assert_eq!(
        image.reopen().unwrap().hub.inspect(ControlPlane::clone),
        resumed(&hub, &hub.hub.inspect(ControlPlane::clone)),
    );
}

#[tokio::test(start_paused = true)]
async fn a_wait_on_the_core_wakes_on_the_call_that_satisfies_it_without_polling() {
    let hub = TestHub::with_step(&[10]);
    hub.hub.register(ActorId(1), registration(1)).unwrap();
    let waiting = hub.hub.clone();
    let staged = tokio::spawn(async move {
        waiting
            .wait_for(|core| {
                core.member(ActorId(1))
                    .and_then(|member| member.staged)
                    .filter(|&staged| staged >= Version(2))
            })
            .await
    });
    // The waiter looks once and finds nothing; calls that change other things wake it
    // to look again, and it goes back to waiting.
    tokio::task::yield_now().await;
    hub.hub.heartbeat(ActorId(1)).unwrap();
    hub.hub
        .publish_version(Version(2), hash(Version(2)))
        .unwrap();
    tokio::task::yield_now().await;
    assert!(!staged.is_finished());

    let reported = tokio::time::Instant::now();
    hub.hub
        .report_versions(ActorId(1), Version(1), Some(Version(2)))
        .unwrap();
    assert_eq!(staged.await.unwrap(), Version(2));
    // The clock is paused and advances only when every task sleeps: a waiter that
    // polled on a timer would have moved it.
    assert_eq!(reported.elapsed(), Duration::ZERO);
}
