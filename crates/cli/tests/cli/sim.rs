//! `aurora sim fleet`: every shipped fleet file runs on its shipped topology, its figures
//! written as JSON and CSV, and a fleet file that cannot run is refused naming why.

use std::path::Path;

use crate::util::aurora;

const FLEETS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../wan/fleets");

#[test]
fn every_shipped_fleet_runs_and_writes_its_figures() {
    let scratch = tempfile::tempdir().unwrap();
    let mut fleets: Vec<_> = std::fs::read_dir(FLEETS)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    fleets.sort();
    assert!(fleets.len() >= 3, "{fleets:?}");
    for fleet in fleets {
        let name = fleet.file_stem().unwrap().to_str().unwrap().to_owned();
        let json = scratch.path().join(format!("{name}.json"));
        let csv = scratch.path().join(format!("{name}.csv"));
        let steps = scratch.path().join(format!("{name}-steps.csv"));
        let stdout = aurora(&[
            "sim",
            "fleet",
            fleet.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
            "--csv",
            csv.to_str().unwrap(),
            "--steps-csv",
            steps.to_str().unwrap(),
        ])
        .ok()
        .stdout;
        assert!(stdout.contains(&format!("Fleet \"{name}\"")), "{stdout}");
        let figures: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let points = figures["points"].as_array().unwrap();
        assert!(!points.is_empty());
        for point in points {
            for system in point["systems"].as_array().unwrap() {
                let rate = &system["tokens_per_s"];
                assert!(rate["min"].as_f64().unwrap() > 0.0, "{name}: {point}");
                assert!(stdout.contains(system["system"].as_str().unwrap()));
            }
        }
        let rows = std::fs::read_to_string(&csv).unwrap().lines().count();
        let systems: usize = points
            .iter()
            .map(|point| point["systems"].as_array().unwrap().len())
            .sum();
        assert_eq!(rows, systems + 1, "{name}: a CSV row per point and system");
        assert!(std::fs::read_to_string(&steps).unwrap().lines().count() > systems);
    }
}

#[test]
fn a_fleet_that_cannot_run_is_refused_naming_why() {
    let scratch = tempfile::tempdir().unwrap();
    let topology = Path::new(FLEETS).join("../scenarios/paper-testbed.toml");
    let refused = |name: &str, body: &str| {
        let path = scratch.path().join(format!("{name}.toml"));
        std::fs::write(&path, body.replace("TOPOLOGY", topology.to_str().unwrap())).unwrap();
        let run = aurora(&["sim", "fleet", path.to_str().unwrap()]).fails();
        assert!(!run.stderr.contains("panicked"), "{name}: {}", run.stderr);
        run.stderr
    };
    let fleet = "format = 1\nname = \"x\"\ntopology = \"TOPOLOGY\"\ntrainer_region = \"us\"\n\
                 model = \"qwen3-4b\"\ntrainer_gpus = 2\ndataset = \"gsm8k\"\n";
    let actors = "[[actors]]\nregion = \"canada\"\ngpu = \"a100\"\n";
    let stderr = refused(
        "unknown-field",
        &format!("{fleet}colour = \"red\"\n{actors}"),
    );
    assert!(
        stderr.contains("not a valid fleet file") && stderr.contains("colour"),
        "{stderr}"
    );
    let stderr = refused(
        "unknown-region",
        &format!("{fleet}[[actors]]\nregion = \"mars\"\ngpu = \"a100\"\n"),
    );
    assert!(
        stderr.contains("region \"mars\": not in the topology"),
        "{stderr}"
    );
    let stderr = refused(
        "no-topology",
        &format!("{}{actors}", fleet.replace("TOPOLOGY", "nowhere.toml")),
    );
    assert!(stderr.contains("the topology of fleet"), "{stderr}");
    let stderr = refused(
        "bad-model",
        &format!("{}{actors}", fleet.replace("qwen3-4b", "qwen9")),
    );
    assert!(stderr.contains("qwen9"), "{stderr}");
}
