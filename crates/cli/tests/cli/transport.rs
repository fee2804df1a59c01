//! `aurora hub`, `aurora relay` and `aurora actor` as real processes on loopback: a store's
//! deltas reach an actor through a relay, verified and activated; an actor with no weights
//! (`--join`) takes the store's snapshot over the wire; a hub watching a directory
//! publishes each checkpoint a trainer saves there; and each node stops cleanly on SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::util::{Scratch, aurora, weights_hash};

const TOKEN: &str = "transport-token";

/// A running `aurora` process whose stdout lines arrive on a channel; killed on drop.
struct Process {
    child: Child,
    lines: mpsc::Receiver<String>,
    name: &'static str,
}

impl Process {
    fn start(name: &'static str, args: &[&std::ffi::OsStr]) -> Process {
        let mut child = Command::new(env!("CARGO_BIN_EXE_aurora"))
            .args(args)
            .env("AURORA_TOKEN", TOKEN)
            .env("AURORA_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        Process { child, lines, name }
    }

    /// The rest of the first line starting with `prefix`, waiting at most a minute.
    fn expect(&self, prefix: &str) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|e| panic!("{}: no line starting with {prefix:?}: {e}", self.name));
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.to_string();
            }
        }
    }

    /// Sends SIGTERM, as a cloud's preemption notice or a scheduler's stop does; the
    /// process then says `stopped` and ends with status 0.
    fn terminate(&mut self) {
        let pid = self.child.id() as i32;
        // SAFETY: kill(2) on a child this test started and has not reaped.
        assert_eq!(
            unsafe { libc::kill(pid, libc::SIGTERM) },
            0,
            "{}",
            self.name
        );
        self.expect("stopped");
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{} ended with {status}", self.name);
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn os(text: &str) -> &std::ffi::OsStr {
    std::ffi::OsStr::new(text)
}

/// A fleet CA in `dir` (`aurora certs init`).
fn fleet(dir: &std::path::Path) {
    aurora(&["certs", "init", "--dir"]).arg(dir).ok();
}

/// The segment transport's flags of node `id` of the fleet in `dir`, issuing its
/// certificate (`aurora certs issue`), and the fleet's signing key: the trainer's to
/// sign with, the public half for every other node to pin.
fn certified(dir: &std::path::Path, role: &str, id: &str, region: &str) -> Vec<std::ffi::OsString> {
    aurora(&[
        "certs", "issue", "--role", role, "--id", id, "--region", region, "--dir",
    ])
    .arg(dir)
    .ok();
    let file = |name: String| dir.join(name).into_os_string();
    let signing = match role {
        "trainer" => ["--signing-key".into(), file("signing.key".into())],
        _ => ["--trainer-key".into(), file("signing.pub".into())],
    };
    [
        "--ca".into(),
        file("ca.pem".into()),
        "--cert".into(),
        file(format!("nodes/{role}-{id}.pem")),
        "--key".into(),
        file(format!("nodes/{role}-{id}.key")),
    ]
    .into_iter()
    .chain(signing)
    .collect()
}

/// `aurora hub` on any free ports, with its store and database in `dir`.
fn start_hub(dir: &std::path::Path, extra: &[&std::ffi::OsStr]) -> Process {
    let mut args = vec![
        os("hub"),
        os("--dir"),
        dir.as_os_str(),
        os("--control-listen"),
        os("127.0.0.1:0"),
        os("--transport-listen"),
        os("127.0.0.1:0"),
    ];
    args.extend_from_slice(extra);
    Process::start("hub", &args)
}

#[test]
fn a_stored_chain_reaches_an_actor_through_a_relay_process() {
    let s = Scratch::new();
    let steps = s.synth("tiny", 3, &[]);
    // The hub's directory holds its store: filled here by `aurora store`, before the hub
    // runs (a running hub holds the store's lock; it takes new versions itself, `--watch`).
    // Every node with a certificate of the fleet's CA: mutual TLS on every connection,
    // and every version signed by the fleet's trainer key.
    let certs = s.path("fleet");
    fleet(&certs);
    let root = s.path("hub/store");
    aurora(&["store", "put-snapshot"])
        .arg(&root)
        .arg("0")
        .arg(&steps[0])
        .ok();
    for version in 1..=3u64 {
        let delta = s.diff(
            &steps[version as usize - 1],
            &steps[version as usize],
            "aurora",
            version - 1,
        );
        aurora(&["store", "put-delta", "--signing-key"])
            .arg(certs.join("signing.key"))
            .arg(&root)
            .arg(&delta)
            .ok();
    }
    let hub_tls = certified(&certs, "trainer", "hub", "hub");
    let hub_flags: Vec<&std::ffi::OsStr> = hub_tls.iter().map(|f| f.as_os_str()).collect();
    let hub = start_hub(&s.path("hub"), &hub_flags);
    // An actor of no control plane is told the run it serves; a relay learns it from
    // the hub, whose certificate is the trainer's.
    let run = hub.expect("run ");
    let hub_address = hub.expect("transport listening on ");
    let relay_tls = certified(&certs, "relay", "relay-eu", "eu");
    let relay_args: Vec<&std::ffi::OsStr> = [
        os("relay"),
        os("--transport-listen"),
        os("127.0.0.1:0"),
        os("--upstream"),
        os(&hub_address),
        os("--suspend-after-ms"),
        os("60000"),
    ]
    .into_iter()
    .chain(relay_tls.iter().map(|f| f.as_os_str()))
    .collect();
    let relay = Process::start("relay", &relay_args);
    let relay_address = relay.expect("listening on ");
    // The actor takes its settings from a file, its identity from its certificate.
    let config = s.write(
        "actor.toml",
        format!(
            "region = \"eu\"\nupstreams = [\"{relay_address}\", \"{hub_address}\"]\n\
             weights = \"{}\"\nversion = 0\nstreams = 3\nreturn-after-ms = 60000\n",
            steps[0].display()
        )
        .as_bytes(),
    );
    let actor_tls = certified(&certs, "actor", "1", "eu");
    let actor_args: Vec<&std::ffi::OsStr> = [
        os("actor"),
        os("--config"),
        config.as_os_str(),
        os("--run-id"),
        os(&run),
    ]
    .into_iter()
    .chain(actor_tls.iter().map(|f| f.as_os_str()))
    .collect();
    let actor = Process::start("actor", &actor_args);
    let expected = weights_hash(&steps[3]).to_hex();
    assert_eq!(actor.expect("active 3 "), expected);
    // The relay holds no weights. It started from the hub's newest version, so the
    // actor took versions 1 and 2 from the hub's store.
    relay.expect("holds 3");

    // No weights on this machine: the relay keeps no snapshot, the hub's store serves it.
    let newcomer_tls = certified(&certs, "actor", "2", "eu");
    let newcomer_args: Vec<&std::ffi::OsStr> = [
        os("actor"),
        os("--join"),
        os("--run-id"),
        os(&run),
        os("--upstream"),
        os(&relay_address),
        os("--upstream"),
        os(&hub_address),
    ]
    .into_iter()
    .chain(newcomer_tls.iter().map(|f| f.as_os_str()))
    .collect();
    let newcomer = Process::start("newcomer", &newcomer_args);
    // From the store's only snapshot (version 0), then the deltas.
    assert_eq!(newcomer.expect("active 3 "), expected);

    // A relay that keeps the snapshot it starts from serves a joiner that knows no other
    // upstream: the snapshot, then the deltas after it, all from the relay.
    let kept = s.path("relay-kept");
    std::fs::create_dir_all(&kept).unwrap();
    let keeping_tls = certified(&certs, "relay", "relay-eu-2", "eu");
    let keeping_args: Vec<&std::ffi::OsStr> = [
        os("relay"),
        os("--transport-listen"),
        os("127.0.0.1:0"),
        os("--upstream"),
        os(&hub_address),
        os("--snapshot-dir"),
        kept.as_os_str(),
    ]
    .into_iter()
    .chain(keeping_tls.iter().map(|f| f.as_os_str()))
    .collect();
    let keeping = Process::start("keeping relay", &keeping_args);
    let keeping_address = keeping.expect("listening on ");
    keeping.expect("holds 3");
    let joiner_tls = certified(&certs, "actor", "3", "eu");
    let joiner_args: Vec<&std::ffi::OsStr> = [
        os("actor"),
        os("--join"),
        os("--run-id"),
        os(&run),
        os("--upstream"),
        os(&keeping_address),
    ]
    .into_iter()
    .chain(joiner_tls.iter().map(|f| f.as_os_str()))
    .collect();
    let joiner = Process::start("joiner", &joiner_args);
    assert_eq!(joiner.expect("active 3 "), expected);
}

#[test]
fn an_actor_without_its_settings_says_what_is_missing() {
    let s = Scratch::new();
    let steps = s.synth("tiny", 0, &[]);
    let run = aurora(&["actor", "--id", "1", "--version", "0", "--weights"])
        .arg(&steps[0])
        .fails();
    crate::util::assert_error_mentions(&run, &["--upstream"]);
    let run = aurora(&["actor", "--id", "1", "--upstream", "127.0.0.1:9"]).fails();
    crate::util::assert_error_mentions(&run, &["--weights is required", "--join"]);
    // A joining actor takes its weights from an upstream, and has no subscribers to send
    // away.
    for (given, needle) in [
        (
            &["--version", "0"][..],
            "--join takes the weights from an upstream",
        ),
        (
            &["--suspend-after-ms", "100"],
            "--suspend-after-ms is a relay's setting",
        ),
        (
            &["--snapshot-dir", "/tmp"],
            "--snapshot-dir is a relay's setting",
        ),
    ] {
        let args = [
            &["actor", "--join", "--id", "1", "--upstream", "127.0.0.1:9"][..],
            given,
        ]
        .concat();
        let run = aurora(&args).fails();
        crate::util::assert_error_mentions(&run, &[needle]);
    }
    // A relay holds no weights, and says so to whoever gives it some.
    let weights = steps[0].to_str().unwrap();
    for given in [
        &["--join"][..],
        &["--weights", weights],
        &["--image-dir", "/tmp"],
    ] {
        let args = [
            &["relay", "--id", "r1", "--upstream", "127.0.0.1:9"][..],
            given,
        ]
        .concat();
        let run = aurora(&args).fails();
        crate::util::assert_error_mentions(&run, &["a relay holds no weights", given[0]]);
    }
    // Neither certificates nor plaintext asked for by name: nothing starts.
    let run = aurora(&["actor", "--join", "--id", "1", "--upstream", "127.0.0.1:9"]).fails();
    crate::util::assert_error_mentions(&run, &["--ca, --cert and --key", "--insecure-plaintext"]);
    let bad = s.write("bad.toml", b"id = \"a1\"\nstreams = \"many\"\n");
    let run = aurora(&["actor", "--config"]).arg(&bad).fails();
    crate::util::assert_error_mentions(&run, &["parsing", "bad.toml"]);
    // A session needs a stream: zero is refused where it is given, flag or file.
    let run = aurora(&[
        "relay",
        "--id",
        "r1",
        "--upstream",
        "127.0.0.1:9",
        "--streams",
        "0",
    ])
    .fails();
    crate::util::assert_error_mentions(&run, &["--streams", "zero"]);
    let zero = s.write("zero.toml", b"id = \"r1\"\nstreams = 0\n");
    let run = aurora(&["relay", "--upstream", "127.0.0.1:9", "--config"])
        .arg(&zero)
        .fails();
    crate::util::assert_error_mentions(&run, &["zero.toml"]);
    // Limits beyond the defaults are checked before anything starts, by key.
    let limits = s.write("limits.toml", b"[transport]\nmax_held_bytes = 0\n");
    let run = aurora(&["relay", "--id", "r1", "--upstream", "127.0.0.1:9"])
        .arg("--insecure-plaintext")
        .arg("--limits")
        .arg(&limits)
        .fails();
    crate::util::assert_error_mentions(
        &run,
        &["limits.toml", "transport.max_held_bytes must be at least 1"],
    );
    // So is the directory the model's image will live in.
    let run = aurora(&["actor", "--join", "--id", "1", "--upstream", "127.0.0.1:9"])
        .arg("--image-dir")
        .arg(s.path("no-such-dir"))
        .fails();
    crate::util::assert_error_mentions(&run, &["--image-dir", "no-such-dir", "not a directory"]);
    let limits = s.write("hub-limits.toml", b"[control]\nwrite_timeout = 5\n");
    let run = aurora(&["hub", "--insecure-plaintext", "--dir"])
        .arg(s.path("hub"))
        .arg("--limits")
        .arg(&limits)
        .fails();
    crate::util::assert_error_mentions(&run, &["hub-limits.toml"]);
    assert!(
        run.stderr.contains("unknown field `write_timeout`"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_hub_watching_a_directory_publishes_each_checkpoint_a_trainer_saves() {
    let s = Scratch::new();
    let steps = s.synth("tiny", 3, &[]);
    let watched = s.path("checkpoints");
    // What a trainer does: write the checkpoint, then the marker.
    let save = |step: usize, marker: bool| {
        let dir = watched.join(format!("checkpoint-{}", step * 100));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(&steps[step], dir.join("model.safetensors")).unwrap();
        if marker {
            std::fs::write(dir.join("COMPLETE"), b"").unwrap();
        }
    };
    let hub_dir = s.path("hub");
    let watch = [
        os("--watch"),
        watched.as_os_str(),
        os("--poll-ms"),
        os("20"),
        os("--insecure-plaintext"),
    ];
    save(0, true);
    let hub = start_hub(&hub_dir, &watch);
    let hub_address = hub.expect("transport listening on ");
    let hash = |step: usize| weights_hash(&steps[step]).to_hex();
    assert_eq!(hub.expect("published checkpoint-0 as version 0 "), hash(0));
    let actor = Process::start(
        "actor",
        &[
            os("actor"),
            os("--join"),
            os("--id"),
            os("1"),
            os("--region"),
            os("eu"),
            os("--upstream"),
            os(&hub_address),
            os("--insecure-plaintext"),
        ],
    );
    assert_eq!(actor.expect("active 0 "), hash(0));
    // Saved but not marked complete: left alone until it is.
    save(2, false);
    save(1, true);
    assert_eq!(
        hub.expect("published checkpoint-100 as version 1 "),
        hash(1)
    );
    assert_eq!(actor.expect("active 1 "), hash(1));
    std::fs::write(watched.join("checkpoint-200/COMPLETE"), b"").unwrap();
    assert_eq!(
        hub.expect("published checkpoint-200 as version 2 "),
        hash(2)
    );
    assert_eq!(actor.expect("active 2 "), hash(2));

    // A checkpoint marked complete that is not one (a truncated file, then garbage) is
    // set aside with the reason: the hub keeps serving, and the next one is published.
    let bad = watched.join("checkpoint-250");
    std::fs::create_dir_all(&bad).unwrap();
    let truncated = std::fs::read(&steps[2]).unwrap();
    std::fs::write(
        bad.join("model.safetensors"),
        &truncated[..truncated.len() / 2],
    )
    .unwrap();
    std::fs::write(bad.join("COMPLETE"), b"").unwrap();
    let reason = hub.expect("set aside checkpoint-250: ");
    assert!(reason.contains("model.safetensors"), "{reason}");

    // Restarted, the hub carries on from its directory: nothing published twice, the
    // next checkpoint is version 3. Even when it stopped after publishing a checkpoint
    // but before recording it: the store's version is matched to the checkpoint.
    drop(hub);
    let record_path = hub_dir.join("watched.json");
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record_path).unwrap()).unwrap();
    assert_eq!(record["versions"]["checkpoint-200"], 2);
    record["versions"]
        .as_object_mut()
        .unwrap()
        .remove("checkpoint-200");
    std::fs::write(&record_path, record.to_string()).unwrap();
    assert!(
        record["set_aside"]["checkpoint-250"].is_string(),
        "{record}"
    );
    let hub = start_hub(&hub_dir, &watch);
    hub.expect("transport listening on ");
    save(3, true);
    // The set-aside checkpoint is neither published nor tripped on again.
    assert_eq!(
        hub.expect("published "),
        format!("checkpoint-300 as version 3 {}", hash(3))
    );
}

#[test]
fn a_relay_and_a_hub_stop_cleanly_on_sigterm_and_the_relay_s_actor_moves_on() {
    let s = Scratch::new();
    let steps = s.synth("tiny", 2, &[]);
    let watched = s.path("checkpoints");
    let save = |step: usize| {
        let dir = watched.join(format!("checkpoint-{step}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(&steps[step], dir.join("model.safetensors")).unwrap();
        std::fs::write(dir.join("COMPLETE"), b"").unwrap();
    };
    save(0);
    let plaintext = os("--insecure-plaintext");
    let watch = [
        os("--watch"),
        watched.as_os_str(),
        os("--poll-ms"),
        os("20"),
        plaintext,
    ];
    let mut hub = start_hub(&s.path("hub"), &watch);
    let hub_address = hub.expect("transport listening on ");
    let hash = |step: usize| weights_hash(&steps[step]).to_hex();
    assert_eq!(hub.expect("published checkpoint-0 as version 0 "), hash(0));
    let mut relay = Process::start(
        "relay",
        &[
            os("relay"),
            os("--transport-listen"),
            os("127.0.0.1:0"),
            os("--id"),
            os("relay-eu"),
            os("--region"),
            os("eu"),
            os("--upstream"),
            os(&hub_address),
            plaintext,
        ],
    );
    let relay_address = relay.expect("listening on ");
    let actor = Process::start(
        "actor",
        &[
            os("actor"),
            os("--join"),
            os("--id"),
            os("1"),
            os("--region"),
            os("eu"),
            os("--upstream"),
            os(&relay_address),
            os("--upstream"),
            os(&hub_address),
            plaintext,
        ],
    );
    // It joined from the hub's snapshot, then subscribed to the relay for the deltas.
    assert_eq!(actor.expect("active 0 "), hash(0));

    // The relay sends its actor to the next upstream, the hub, which brings the next
    // version.
    relay.terminate();
    save(1);
    assert_eq!(hub.expect("published checkpoint-1 as version 1 "), hash(1));
    assert_eq!(actor.expect("active 1 "), hash(1));
    // The hub stops between versions, everything published stored.
    hub.terminate();
}
