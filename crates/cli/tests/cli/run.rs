//! `aurora run` end to end on a small configuration: real processes (trainer, relays,
//! actors) on loopback, a scripted fault plan, and delta against full synchronisation.

use std::path::Path;

use crate::util::{Scratch, aurora, require_namespaces};
use serde_json::Value;

/// The tiny model on one-digit addition: it learns within seconds, so its weights move
/// at every step and the comparisons below are not between unchanged checkpoints. (Of
/// the hundred one-digit problems, seven distinct ones are held out.)
fn small_config(steps: u64, faults: &str) -> String {
    format!(
        r#"
steps = {steps}
prompts_per_step = 8
eval_every = 2
snapshot_every = 3
checkpoint_every = 4
held_out = 7
warmup_target_accuracy = 0.2
warmup_max_steps = 400

[model]
vocab_size = 21
hidden_size = 32
num_layers = 2
num_heads = 4
num_kv_heads = 2
head_dim = 8
intermediate_size = 64
max_seq_len = 48
rope_theta = 10000.0
rms_norm_eps = 1e-6
tie_embeddings = true

[task]
seed = 1
kind = {{ kind = "addition", digits = 1 }}

[warmup]
steps = 25
batch_size = 32
learning_rate = 3e-3

[rl]
algorithm = "grpo"
learning_rate = 3e-3
clip_epsilon = 0.2
kl_coef = 0.0
samples_per_prompt = 4
epochs = 1

[sampling]
samples_per_prompt = 4
temperature = 1.0
max_new_tokens = 3

[[regions]]
name = "us"
actors = 2

[[regions]]
name = "eu"
actors = 2
{faults}
"#
    )
}

fn metrics(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect()
}

/// Runs `config` in `dir` and checks that every actor ends on `version`.
#[track_caller]
fn run_to_the_end(config: &Path, dir: &Path, version: u64) {
    let run = aurora(&["run", "--config"])
        .arg(config)
        .arg("--dir")
        .arg(dir)
        .ok();
    assert!(
        run.stdout
            .contains(&format!("every actor runs the final version v{version}")),
        "{}",
        run.stdout
    );
}

/// Fails unless every one of `expected` is part of some step's events.
#[track_caller]
fn assert_events(steps: &[Value], expected: &[&str]) {
    let events: Vec<String> = steps
        .iter()
        .flat_map(|s| s["events"].as_array().unwrap().clone())
        .map(|e| e.as_str().unwrap().to_string())
        .collect();
    for expected in expected {
        assert!(
            events.iter().any(|e| e.contains(expected)),
            "no event '{expected}' in {events:?}"
        );
    }
}

#[test]
fn a_run_survives_its_fault_plan_and_every_actor_ends_on_the_final_weights() {
    let scratch = Scratch::new();
    let config = scratch.write(
        "run.toml",
        small_config(
            6,
            r#"
[[faults]]
action = "kill-actor"
at_step = 2
actor = 1

[[faults]]
action = "kill-relay"
at_step = 3
region = "eu"

# A preemption notice: SIGTERM, to which the actor answers by leaving the fleet (its
# leases back at once) and exiting with status 0; the run fails otherwise (without the
# handler, SIGTERM ends a process with no exit status).
[[faults]]
action = "stop-actor"
at_step = 3
actor = 2

# Early: this model's last steps take some 50 ms each, less than a join (the control
# plane's word, a relay whose snapshot is older than the hub's, the hub's snapshot).
[[faults]]
action = "start-actor"
at_step = 2
region = "us"
"#,
        )
        .as_bytes(),
    );
    let dir = scratch.path("run");
    run_to_the_end(&config, &dir, 6);

    let steps = metrics(&dir);
    assert_eq!(steps.len(), 6);
    for (index, step) in steps.iter().enumerate() {
        assert_eq!(step["step"], index as u64);
        assert_eq!(step["trained_version"], index as u64 + 1);
    }
    assert_events(
        &steps,
        &[
            "killed actor 1",
            "killed the relay of region eu",
            "stopped actor 2 (region eu",
            "started actor 4 in region us",
        ],
    );
    // The newcomer joined from a snapshot, caught up and generated on the latest weights.
    let last = steps.last().unwrap();
    let newcomer = last["actors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == 4)
        .expect("actor 4 is a member at the end");
    assert!(newcomer["version"].as_u64().unwrap() >= 4, "{newcomer}");
    for gone in [1, 2] {
        assert!(
            !last["actors"]
                .as_array()
                .unwrap()
                .iter()
                .any(|a| a["id"] == gone),
            "actor {gone} is still a member"
        );
    }

    // Seven charts before any table, the fault steps dashed on them.
    let report = std::fs::read_to_string(dir.join("report.html")).unwrap();
    assert_eq!(report.matches("<svg").count(), 7);
    assert!(report.rfind("<svg").unwrap() < report.find("<table").unwrap());
    assert!(report.contains("Dashed lines mark the steps with events"));
    assert!(report.contains("killed actor 1"));

    // The store keeps every version's delta, a snapshot every third version (0, 3, 6),
    // the rollouts each version was trained on and the trainer's state at 0, 4 and the
    // end, all verified.
    let store = dir.join("store");
    let verified = aurora(&["store", "verify"]).arg(&store).ok();
    assert!(
        verified.stdout.contains("6 deltas, 3 snapshots")
            && verified
                .stdout
                .contains("6 rollouts and 3 trainer states verified"),
        "{}",
        verified.stdout
    );
}

#[test]
fn a_killed_trainer_resumes_and_the_run_ends_on_the_weights_of_an_unbroken_run() {
    let scratch = Scratch::new();
    let unbroken = scratch.write("unbroken.toml", small_config(6, "").as_bytes());
    // Killed as step 3 opens: version 2 is published, and the newest trainer state is
    // that of version 0, so the restarted trainer trains versions 1 and 2 again from
    // the stored rollouts and must reproduce their weights hashes.
    let killed = scratch.write(
        "killed.toml",
        small_config(
            6,
            r#"
[[faults]]
action = "kill-trainer"
at_step = 3
restart_after_s = 0.5
"#,
        )
        .as_bytes(),
    );
    let mut runs = Vec::new();
    for (config, name) in [(&unbroken, "unbroken"), (&killed, "killed")] {
        let dir = scratch.path(name);
        run_to_the_end(config, &dir, 6);
        runs.push(metrics(&dir));
    }
    let (unbroken, killed) = (&runs[0], &runs[1]);
    assert_eq!(killed.len(), 6, "every version is trained once: {killed:?}");
    for (u, k) in unbroken.iter().zip(killed) {
        assert_eq!(u["trained_version"], k["trained_version"]);
        assert_eq!(
            u["weights_hash"], k["weights_hash"],
            "version {}",
            u["trained_version"]
        );
        assert_eq!(u["train"], k["train"], "version {}", u["trained_version"]);
    }
    assert_events(
        killed,
        &[
            "killed the trainer",
            "it resumed at v2 (2 versions trained again)",
            "published",
        ],
    );
    // No actor restarted: the four of the start are the members at the end.
    let members: Vec<u64> = killed.last().unwrap()["actors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_u64().unwrap())
        .collect();
    assert_eq!(members, [0, 1, 2, 3]);
}

#[test]
fn a_run_that_died_whole_or_was_stopped_resumes_and_ends_on_the_weights_of_an_unbroken_run() {
    let scratch = Scratch::new();
    let config = scratch.write("run.toml", small_config(6, "").as_bytes());
    let unbroken = scratch.path("unbroken");
    run_to_the_end(&config, &unbroken, 6);
    // The same run, every one of its processes killed at once after step 2's record:
    // then resumed from its directory alone, with new relays and actors.
    let died = scratch.path("died");
    aurora(&["run", "--config"])
        .arg(&config)
        .arg("--dir")
        .arg(&died)
        .killed_at("step   2 ");
    let resumed = aurora(&["run", "--resume", "--dir"]).arg(&died).ok();
    assert!(
        resumed.stdout.contains("resumed at v")
            && resumed
                .stdout
                .contains("every actor runs the final version v6"),
        "{}",
        resumed.stdout
    );
    let (unbroken, died) = (metrics(&unbroken), metrics(&died));
    let versions: Vec<u64> = died
        .iter()
        .map(|s| s["trained_version"].as_u64().unwrap())
        .collect();
    // Each version once, in order, to the last (a record the killed run was about to
    // write is the only one that may be missing).
    assert!(
        versions.starts_with(&[1, 2, 3])
            && versions.last() == Some(&6)
            && versions.windows(2).all(|pair| pair[0] < pair[1]),
        "{versions:?}"
    );
    for record in &died {
        let version = record["trained_version"].as_u64().unwrap() as usize;
        assert_eq!(
            unbroken[version - 1]["weights_hash"],
            record["weights_hash"],
            "version {version}"
        );
    }
    // The same run stopped by a terminal's Ctrl-C after step 2's record (SIGINT to the
    // whole process group): the trainer finishes the version in hand and saves its
    // state, the actors leave, the relays send their subscribers on, and the run writes
    // its report, says how to go on and ends as interrupted. Resumed, it trains nothing
    // again and ends on the unbroken run's weights.
    let stopped = scratch.path("stopped");
    let (status, stdout) = aurora(&["run", "--config"])
        .arg(&config)
        .arg("--dir")
        .arg(&stopped)
        .interrupted_at("step   2 ");
    assert_eq!(status.code(), Some(130), "{stdout}");
    assert!(
        stdout.contains("stopping (SIGINT)")
            && stdout.contains("stopped at v")
            && stdout.contains("aurora run --resume --dir")
            && stopped.join("report.html").exists(),
        "{stdout}"
    );
    // A second Ctrl-C while the run stops ends it at once, as interrupted, with no
    // stop to report.
    let (status, stdout) = aurora(&["run", "--config"])
        .arg(&config)
        .arg("--dir")
        .arg(scratch.path("cut short"))
        .interrupted_twice_at("step   1 ", "stopping (SIGINT)");
    assert_eq!(status.code(), Some(130), "{stdout}");
    assert!(!stdout.contains("stopped at v"), "{stdout}");
    let resumed = aurora(&["run", "--resume", "--dir"]).arg(&stopped).ok();
    assert!(
        resumed.stdout.contains("(0 versions trained again")
            && resumed
                .stdout
                .contains("every actor runs the final version v6"),
        "{}",
        resumed.stdout
    );
    let stopped = metrics(&stopped);
    let versions: Vec<u64> = stopped
        .iter()
        .map(|s| s["trained_version"].as_u64().unwrap())
        .collect();
    // A graceful stop loses no record.
    assert_eq!(versions, [1, 2, 3, 4, 5, 6]);
    for record in &stopped {
        let version = record["trained_version"].as_u64().unwrap() as usize;
        assert_eq!(
            unbroken[version - 1]["weights_hash"],
            record["weights_hash"],
            "version {version}"
        );
    }
    // A directory with no run in it is refused, and nothing is started.
    let error = aurora(&["run", "--resume", "--dir"])
        .arg(scratch.path("nothing"))
        .fails();
    assert!(
        error.stderr.contains("resuming needs the run directory"),
        "{}",
        error.stderr
    );
}

#[test]
fn delta_and_full_sync_give_the_same_weights_and_rewards_at_every_step() {
    let scratch = Scratch::new();
    let config = scratch.write("run.toml", small_config(4, "").as_bytes());
    let dir = scratch.path("run");
    let mut runs = Vec::new();
    for sync in ["delta", "full"] {
        let run = aurora(&["run", "--sync", sync, "--config"])
            .arg(&config)
            .arg("--dir")
            .arg(&dir)
            .ok();
        runs.push(metrics(&dir));
        if sync == "delta" {
            assert_density_is_counted(&dir, &run.stdout, runs.last().unwrap());
        }
    }
    let (delta, full) = (&runs[0], &runs[1]);
    assert_eq!(delta.len(), 4);
    assert_eq!(full.len(), 4);
    let mut hashes = std::collections::BTreeSet::new();
    for (d, f) in delta.iter().zip(full) {
        assert_eq!(d["weights_hash"], f["weights_hash"], "step {}", d["step"]);
        assert_eq!(d["train"], f["train"], "step {}", d["step"]);
        assert_eq!(d["accuracy"], f["accuracy"], "step {}", d["step"]);
        assert!(
            d["sync_bytes"].as_u64() < f["sync_bytes"].as_u64(),
            "a delta is smaller than the checkpoint: {} vs {}",
            d["sync_bytes"],
            f["sync_bytes"]
        );
        // The whole checkpoint travels: its tensor data is all of the safetensors file
        // but the JSON header.
        assert!(
            f["sync_bytes"].as_f64().unwrap() > 0.9 * f["dense_bytes"].as_f64().unwrap(),
            "{f}"
        );
        hashes.insert(d["weights_hash"].as_str().unwrap().to_string());
    }
    assert_eq!(hashes.len(), 4, "the weights changed at every step");
}

/// Fails unless every step's changed elements are those its stored delta holds, and the
/// run's output and report state each step's density and the regime they make: the tiny
/// model at its learning rate changes most elements, the dense regime.
#[track_caller]
fn assert_density_is_counted(dir: &Path, stdout: &str, steps: &[Value]) {
    let report = std::fs::read_to_string(dir.join("report.html")).unwrap();
    for step in steps {
        let version = step["trained_version"].as_u64().unwrap().to_string();
        let stored: Value = serde_json::from_str(
            &aurora(&["store", "inspect", "--json"])
                .arg(dir.join("store"))
                .arg(&version)
                .ok()
                .stdout,
        )
        .unwrap();
        let stats = &stored["delta"]["stats"];
        assert_eq!(
            step["changed_elements"], stats["bytes"]["changed"],
            "v{version}"
        );
        assert_eq!(step["elements"], stats["elements"], "v{version}");
        let density = 100.0 * stats["density"].as_f64().unwrap();
        assert!(density > 2.0, "v{version}: {density}%");
        let row = format!(
            "<td>v{version}</td><td>{} of {}</td><td>{density:.3}%</td>",
            stats["bytes"]["changed"], stats["elements"]
        );
        assert!(report.contains(&row), "no {row} in the report");
    }
    let regime = "dense regime (4 of 4 steps changed more than 2% of the elements)";
    assert!(report.contains(regime), "no regime in the report");
    assert!(
        stdout.contains("elements changed per step: ") && stdout.contains(regime),
        "{stdout}"
    );
}

#[test]
fn a_run_across_an_emulated_wan_runs_each_region_in_its_namespace() {
    require_namespaces();
    let scratch = Scratch::new();
    let scenario = scratch.write(
        "scenario.toml",
        br#"
name = "two-regions"
[[regions]]
name = "us"
[[regions]]
name = "eu"
[[links]]
between = ["us", "eu"]
rate_mbps = 200
rtt_ms = 10
loss = 0.0
"#,
    );
    let network = format!(
        "[network]\nscenario = {:?}\ntrainer_region = \"us\"\n",
        scenario.to_str().unwrap()
    );
    let config = scratch.write("run.toml", small_config(3, &network).as_bytes());
    let dir = scratch.path("run");
    let run = aurora(&["run", "--config"])
        .arg(&config)
        .arg("--dir")
        .arg(&dir)
        .ok();
    // Each region's nodes listen on their namespace's address, not on loopback, and the
    // run still ends with every actor on the final weights.
    let placed = run
        .stdout
        .lines()
        .find(|line| line.starts_with("emulated WAN two-regions: trainer in us (198."))
        .unwrap_or_else(|| panic!("no placement line in {}", run.stdout));
    assert!(placed.contains("region eu at 198."), "{placed}");
    assert!(
        run.stdout.contains("every actor runs the final version v3"),
        "{}",
        run.stdout
    );
    assert_eq!(metrics(&dir).len(), 3);
}
