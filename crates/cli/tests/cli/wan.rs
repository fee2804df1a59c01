//! `aurora wan` end to end: scenario checking anywhere, and (as root with network
//! namespaces, as in CI; elsewhere they fail) a probe and a short benchmark on a real emulated link.

use std::path::Path;
use std::process::{Command, Output};

use crate::util::require_namespaces;

const SCENARIOS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../wan/scenarios");

fn aurora(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_aurora"))
        .args(args)
        .env("AURORA_LOG", "warn")
        .env("NO_COLOR", "1")
        .output()
        .expect("the aurora binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `aurora args` and returns its stdout, failing the test with both streams if it
/// did not succeed.
fn succeeds(args: &[&str]) -> String {
    let output = aurora(args);
    assert!(
        output.status.success(),
        "aurora {args:?} failed\nstdout:\n{}\nstderr:\n{}",
        text(&output.stdout),
        text(&output.stderr)
    );
    text(&output.stdout)
}

/// A lossy 10 ms RTT link between `a` and `b`, at 200 Mbps.
fn write_small_scenario(directory: &Path) -> String {
    let path = directory.join("small.toml");
    std::fs::write(
        &path,
        r#"
        name = "small"
        [[regions]]
        name = "a"
        [[regions]]
        name = "b"
        [[links]]
        between = ["a", "b"]
        rate_mbps = 200
        rtt_ms = 10
        loss = 0.02
        "#,
    )
    .unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn check_describes_every_shipped_scenario() {
    let mut files: Vec<String> = std::fs::read_dir(SCENARIOS)
        .unwrap()
        .map(|entry| entry.unwrap().path().to_str().unwrap().to_string())
        .collect();
    files.sort();
    let mut args = vec!["wan", "check"];
    args.extend(files.iter().map(String::as_str));
    let stdout = succeeds(&args);
    for expected in [
        "us-canada: ",
        "us <-> canada: 1000 Mbps, RTT 30ms, loss 0.001",
        "four-regions: ",
        "hub <-> oceania: 1000 Mbps, RTT 250ms, loss 0.005 in bursts of 2",
        "lossy-50ms: ",
        "sweep over [250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0] Mbps",
    ] {
        assert!(
            stdout.contains(expected),
            "{expected:?} missing from\n{stdout}"
        );
    }
}

#[test]
fn check_names_what_is_wrong_with_a_scenario() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("bad.toml");
    std::fs::write(
        &path,
        "name = \"bad\"\n[[regions]]\nname = \"a\"\n[[links]]\nbetween = [\"a\", \"mars\"]\n",
    )
    .unwrap();
    let output = aurora(&["wan", "check", path.to_str().unwrap()]);
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("error: ") && stderr.contains("unknown region \"mars\""),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn probe_reports_the_delay_and_loss_of_a_link() {
    require_namespaces();
    let directory = tempfile::tempdir().unwrap();
    let scenario = write_small_scenario(directory.path());
    let stdout = succeeds(&[
        "wan",
        "probe",
        &scenario,
        "--round-trips",
        "5",
        "--datagrams",
        "2000",
    ]);
    // "a -> b: TCP round trip min 10.31 ms, ..."
    let min_ms: f64 = stdout
        .split("min ")
        .nth(1)
        .and_then(|rest| rest.split(" ms").next())
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("no minimum round trip in {stdout}"));
    // The link's delay is only ever exceeded, and a loaded machine may exceed it by any
    // amount: no upper bound.
    assert!(min_ms >= 10.0, "{stdout}");
    assert!(stdout.contains("of 2000 datagrams lost"), "{stdout}");
}

#[test]
fn bench_writes_one_row_per_transfer() {
    require_namespaces();
    let directory = tempfile::tempdir().unwrap();
    let scenario = write_small_scenario(directory.path());
    let json = directory.path().join("rows.json");
    let stdout = succeeds(&[
        "wan",
        "bench",
        &scenario,
        "--streams",
        "1,2",
        "--cc",
        "bbr",
        "--seconds",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(stdout.contains("small"), "{stdout}");
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (row, streams) in rows.iter().zip([1, 2]) {
        assert_eq!(row["congestion"], "bbr");
        assert_eq!(row["streams"], streams);
        let goodput = row["goodput_mbps"].as_f64().unwrap();
        assert!(goodput > 0.0 && goodput <= 200.0, "{row}");
        assert_eq!(row["report"]["streams"].as_array().unwrap().len(), streams);
    }
}

#[test]
fn transfer_fan_out_crosses_each_region_link_once_through_relays() {
    require_namespaces();
    let directory = tempfile::tempdir().unwrap();
    let scenario = directory.path().join("fan.toml");
    std::fs::write(
        &scenario,
        r#"
        name = "fan"
        [[regions]]
        name = "hub"
        [[regions]]
        name = "a"
        [[regions]]
        name = "b"
        [[links]]
        between = ["hub", "a"]
        rate_mbps = 200
        rtt_ms = 10
        [[links]]
        between = ["hub", "b"]
        rate_mbps = 200
        rtt_ms = 10
        "#,
    )
    .unwrap();
    let json = directory.path().join("fan.json");
    succeeds(&[
        "wan",
        "transfer",
        "fan-out",
        scenario.to_str().unwrap(),
        "--preset",
        "small",
        "--actors",
        "2",
        "--streams",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    let output: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = output["rows"].as_array().unwrap();
    // Each mode in plaintext, then over TLS right after.
    let modes: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| (r["mode"].as_str().unwrap(), r["security"].as_str().unwrap()))
        .collect();
    assert_eq!(
        modes,
        [
            ("direct", "plaintext"),
            ("direct", "tls"),
            ("relays", "plaintext"),
            ("relays", "tls"),
            ("cut-through", "plaintext"),
            ("cut-through", "tls"),
        ]
    );
    for row in rows {
        let members = row["members"].as_array().unwrap();
        assert_eq!(members.len(), 4, "{row}");
        for member in members {
            let (received, staged) = (member["received_s"].as_f64(), member["staged_s"].as_f64());
            assert!(
                received.unwrap() > 0.0 && staged.unwrap() >= received.unwrap(),
                "{row}"
            );
        }
        // The emulator's counters of the hub's two links: two copies each when every
        // actor subscribes to the hub, one (plus TCP/IP headers) through a relay.
        let links = row["links"].as_array().unwrap();
        assert_eq!(links.len(), 2, "{row}");
        for link in links {
            let copies = link["copies"].as_f64().unwrap();
            if row["mode"] == "direct" {
                assert!((1.9..2.5).contains(&copies), "{row}");
            } else {
                assert!((0.95..1.3).contains(&copies), "{row}");
            }
        }
    }
}

#[test]
fn exec_runs_a_program_that_finds_each_region_and_tears_the_network_down() {
    require_namespaces();
    let directory = tempfile::tempdir().unwrap();
    let scenario = write_small_scenario(directory.path());
    // b's namespace has a route to a's address (the emulated link's).
    let script = "ip netns exec \"$AURORA_WAN_B_NETNS\" ip route get \"$AURORA_WAN_A_ADDRESS\" >/dev/null \
        && echo \"$AURORA_WAN_A_NETNS\"";
    let stdout = succeeds(&["wan", "exec", &scenario, "--", "sh", "-c", script]);
    let netns = stdout.trim();
    assert!(netns.starts_with(aurora_wan::NETNS_PREFIX), "{stdout}");
    let listed = Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(
        !text(&listed.stdout).contains(netns),
        "the network was left up"
    );

    let failed = aurora(&["wan", "exec", &scenario, "--", "sh", "-c", "exit 3"]);
    assert!(!failed.status.success());
    assert!(
        text(&failed.stderr).contains("exit status: 3"),
        "{}",
        text(&failed.stderr)
    );
}
