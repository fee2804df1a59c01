//! `examples/python/worker.py`, the standard-library Python actor, against a real hub
//! on a socket: two steps, the second on a new version it must stage and commit, and
//! its payloads handed to the trainer.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use aurora_control::{ActorId, PromptId, Version, WeightsHash};
use aurora_hub::{StepResults, run};
use common::{FLEET, TestHub, plaintext};

/// Reads the worker's stdout until it has reported `count` more accepted results.
fn wait_for_accepted(lines: &mut impl Iterator<Item = std::io::Result<String>>, count: usize) {
    let mut seen = 0;
    while seen < count {
        let line = lines
            .next()
            .expect("the worker stopped before reporting its results")
            .unwrap();
        assert!(!line.starts_with("rejected"), "{line}");
        if line.starts_with("accepted ") {
            seen += 1;
        }
    }
}

fn check_rollouts(results: &StepResults, prompts: &[u64], version: u64) {
    assert_eq!(results.outcome.version, Version(version));
    assert!(results.outcome.unfinished.is_empty());
    let found: Vec<(u64, ActorId)> = results
        .rollouts
        .iter()
        .map(|rollout| (rollout.prompt.0, rollout.actor))
        .collect();
    let expected: Vec<(u64, ActorId)> = prompts.iter().map(|&p| (p, ActorId(7))).collect();
    assert_eq!(found, expected);
    for rollout in &results.rollouts {
        let payload: serde_json::Value = serde_json::from_str(rollout.payload.get()).unwrap();
        assert_eq!(payload["prompt"], rollout.prompt.0);
        assert_eq!(payload["version"], version);
        assert_eq!(
            payload["completion"],
            format!("rollout of prompt {} on v{version}", rollout.prompt.0)
        );
    }
}

fn finish(mut worker: Child) -> String {
    let status = worker.wait().unwrap();
    let mut stderr = String::new();
    worker
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(status.success(), "the worker failed: {stderr}");
    stderr
}

#[test]
fn the_python_worker_generates_two_steps_through_a_version_change() {
    if let Err(error) = Command::new("python3").arg("--version").output() {
        panic!("this test runs the example worker and needs python3 on PATH: {error}");
    }
    let hub = TestHub::with_step(&[10, 11, 12]);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    runtime.spawn(run(Arc::clone(&hub.hub), listener, plaintext()));

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/python/worker.py");
    let mut worker = Command::new("python3")
        .arg(&script)
        .args(["--hub", &format!("http://{addr}"), "--actor", "7"])
        .args(["--results", "6", "--poll-ms", "20"])
        .env("AURORA_TOKEN", FLEET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(worker.stdout.take().unwrap()).lines();

    wait_for_accepted(&mut lines, 3);
    let first = hub.hub.take_step_outcome().unwrap().unwrap();
    check_rollouts(&first, &[10, 11, 12], 1);

    // The next step is on v2: the worker is told to catch up, stages v2, and gets the
    // Commit with its work.
    hub.hub
        .publish_version(Version(2), WeightsHash([9; 32]))
        .unwrap();
    hub.hub
        .open_step(&[PromptId(22), PromptId(20), PromptId(21)])
        .unwrap();
    wait_for_accepted(&mut lines, 3);
    let log = finish(worker);
    let second = hub.hub.take_step_outcome().unwrap().unwrap();
    check_rollouts(&second, &[20, 21, 22], 2);
    assert!(log.contains("activated v2"), "{log}");
    // It left when done.
    assert!(hub.hub.inspect(|core| core.members().is_empty()));
}
