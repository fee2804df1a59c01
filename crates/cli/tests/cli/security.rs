//! The secure defaults of the `aurora` binary (docs/security.md §6): the fleet's roots
//! are never overwritten, names that would collide with them or alias another node are
//! refused, key files others may read are refused, plaintext stays on loopback unless
//! the network is said closed, and a node with certificates takes no unsigned version
//! unless told so by name. Each refusal names what was wrong.

use std::os::unix::fs::PermissionsExt;

use crate::util::{Scratch, assert_error_mentions, aurora};

/// `aurora certs init` in a new fleet directory.
fn fleet(s: &Scratch) -> std::path::PathBuf {
    let dir = s.path("fleet");
    aurora(&["certs", "init", "--dir"]).arg(&dir).ok();
    dir
}

fn issue(dir: &std::path::Path, role: &str, id: &str) -> crate::util::Aurora {
    aurora(&[
        "certs", "issue", "--role", role, "--id", id, "--region", "eu", "--dir",
    ])
    .arg(dir)
}

#[test]
fn the_fleet_s_roots_are_never_overwritten_and_reserved_or_aliased_names_are_refused() {
    let s = Scratch::new();
    let dir = fleet(&s);
    let ca = std::fs::read(dir.join("ca.key")).unwrap();
    let signing = std::fs::read(dir.join("signing.key")).unwrap();

    // A second init, and an init where only the signing key is left, change nothing.
    let again = aurora(&["certs", "init", "--dir"]).arg(&dir).fails();
    assert_error_mentions(&again, &["exists already"]);
    let partial = s.path("partial");
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::copy(dir.join("signing.key"), partial.join("signing.key")).unwrap();
    let refused = aurora(&["certs", "init", "--dir"]).arg(&partial).fails();
    assert_error_mentions(&refused, &["signing.key", "never overwritten"]);
    assert!(!partial.join("ca.pem").exists(), "nothing half made");

    // The names of the fleet's own files are no node's.
    for id in ["ca", "signing"] {
        let refused = issue(&dir, "actor", id).fails();
        assert_error_mentions(&refused, &["reserved"]);
        let refused = issue(&dir, "relay", id).fails();
        assert_error_mentions(&refused, &["reserved"]);
    }
    // One actor, one spelling: 042 would act as actor 42.
    let refused = issue(&dir, "actor", "042").fails();
    assert_error_mentions(&refused, &["not canonical", "leading zeros"]);
    assert_eq!(std::fs::read(dir.join("ca.key")).unwrap(), ca);
    assert_eq!(std::fs::read(dir.join("signing.key")).unwrap(), signing);

    // Node files live under nodes/, one pair per identity, never replaced unless asked.
    let issued = issue(&dir, "actor", "42").ok();
    assert!(
        issued.stdout.contains("nodes/actor-42.pem"),
        "{}",
        issued.stdout
    );
    let key = dir.join("nodes/actor-42.key");
    let first = std::fs::read(&key).unwrap();
    let refused = issue(&dir, "actor", "42").fails();
    assert_error_mentions(&refused, &["exists already", "--overwrite"]);
    assert_eq!(std::fs::read(&key).unwrap(), first);
    issue(&dir, "actor", "42").arg("--overwrite").ok();
    assert_ne!(std::fs::read(&key).unwrap(), first);
    // Another role may share the id: its files are its own.
    issue(&dir, "relay", "42").ok();
    assert!(dir.join("nodes/relay-42.key").exists());
}

#[test]
fn key_files_others_may_read_are_refused_by_every_node() {
    let s = Scratch::new();
    let dir = fleet(&s);
    issue(&dir, "relay", "relay-eu").ok();
    let key = dir.join("nodes/relay-relay-eu.key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let refused = aurora(&[
        "relay",
        "--transport-listen",
        "127.0.0.1:0",
        "--upstream",
        "127.0.0.1:9",
    ])
    .arg("--ca")
    .arg(dir.join("ca.pem"))
    .arg("--cert")
    .arg(dir.join("nodes/relay-relay-eu.pem"))
    .arg("--key")
    .arg(&key)
    .arg("--trainer-key")
    .arg(dir.join("signing.pub"))
    .fails();
    assert_error_mentions(&refused, &["relay-relay-eu.key", "mode 644", "chmod 600"]);
    // The CA's key too, when a certificate is issued with it.
    std::fs::set_permissions(dir.join("ca.key"), std::fs::Permissions::from_mode(0o640)).unwrap();
    let refused = issue(&dir, "actor", "7").fails();
    assert_error_mentions(&refused, &["ca.key", "mode 640"]);
    // And the trainer's signing key.
    std::fs::set_permissions(
        dir.join("signing.key"),
        std::fs::Permissions::from_mode(0o604),
    )
    .unwrap();
    let refused = aurora(&["hub", "--insecure-plaintext", "--dir"])
        .arg(s.path("hub"))
        .arg("--signing-key")
        .arg(dir.join("signing.key"))
        .env("AURORA_TOKEN", "token")
        .fails();
    assert_error_mentions(&refused, &["signing.key", "mode 604"]);
}

#[test]
fn a_node_with_certificates_takes_no_unsigned_version_unless_told_by_name() {
    let s = Scratch::new();
    let dir = fleet(&s);
    issue(&dir, "actor", "3").ok();
    let steps = s.synth("tiny", 0, &[]);
    let tls = |command: crate::util::Aurora| {
        command
            .arg("--ca")
            .arg(dir.join("ca.pem"))
            .arg("--cert")
            .arg(dir.join("nodes/actor-3.pem"))
            .arg("--key")
            .arg(dir.join("nodes/actor-3.key"))
    };
    let actor = || {
        tls(
            aurora(&["actor", "--version", "0", "--upstream", "127.0.0.1:9"])
                .arg("--weights")
                .arg(&steps[0]),
        )
    };
    let refused = actor().fails();
    assert_error_mentions(&refused, &["pins no trainer key", "--insecure-unsigned"]);
    // Both at once contradict each other.
    let refused = actor()
        .arg("--trainer-key")
        .arg(dir.join("signing.pub"))
        .arg("--insecure-unsigned")
        .fails();
    assert_error_mentions(&refused, &["cannot be used with"]);
    // A hub with certificates and no signing key: the same.
    issue(&dir, "trainer", "trainer").ok();
    let refused = aurora(&[
        "hub",
        "--control-listen",
        "127.0.0.1:0",
        "--transport-listen",
    ])
    .arg("127.0.0.1:0")
    .arg("--dir")
    .arg(s.path("hub"))
    .arg("--ca")
    .arg(dir.join("ca.pem"))
    .arg("--cert")
    .arg(dir.join("nodes/trainer-trainer.pem"))
    .arg("--key")
    .arg(dir.join("nodes/trainer-trainer.key"))
    .fails();
    assert_error_mentions(&refused, &["no signing key", "--insecure-unsigned"]);
}

#[test]
fn plaintext_stays_on_loopback_unless_the_network_is_said_closed() {
    let s = Scratch::new();
    let refused = aurora(&[
        "hub",
        "--insecure-plaintext",
        "--control-listen",
        "0.0.0.0:0",
        "--dir",
    ])
    .arg(s.path("hub"))
    .env("AURORA_TOKEN", "token")
    .fails();
    assert_error_mentions(&refused, &["0.0.0.0:0", "not a loopback address"]);
    let refused = aurora(&[
        "relay",
        "--insecure-plaintext",
        "--id",
        "relay",
        "--transport-listen",
        "127.0.0.1:0",
        "--upstream",
        "192.0.2.1:7301",
    ])
    .env("AURORA_TOKEN", "token")
    .fails();
    assert_error_mentions(&refused, &["192.0.2.1:7301", "not a loopback address"]);
    // The second flag alone means nothing.
    let refused = aurora(&[
        "relay",
        "--insecure-closed-network",
        "--upstream",
        "127.0.0.1:9",
    ])
    .fails();
    assert_error_mentions(&refused, &["required arguments were not provided"]);
    assert!(
        refused.stderr.contains("--insecure-plaintext"),
        "{}",
        refused.stderr
    );
}
