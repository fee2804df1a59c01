use super::*;
use crate::paper::testbed::TRAINER_MFU;

fn link(rate_mbps: f64, rtt_ms: f64) -> Link {
    Link {
        rate_bps: rate_mbps * 1e6,
        rtt_s: rtt_ms / 1e3,
        loss: 1e-5,
    }
}

/// A trainer in `us`, `canada` behind one link, `australia` behind `canada`.
fn topology() -> Topology {
    Topology {
        regions: ["us", "canada", "australia", "mars"]
            .map(String::from)
            .to_vec(),
        links: vec![
            ("us".into(), "canada".into(), link(1000.0, 30.0)),
            ("canada".into(), "australia".into(), link(500.0, 200.0)),
        ],
    }
}

fn spec() -> FleetSpec {
    FleetSpec {
        format: FLEET_FORMAT,
        name: "test".into(),
        description: String::new(),
        topology: "unused.toml".into(),
        trainer_region: "us".into(),
        model: ModelChoice::Qwen3_4b,
        trainer_gpus: 2,
        trainer_mfu: TRAINER_MFU,
        dataset: DatasetChoice::Gsm8k,
        steps: 14,
        warm_up: 3,
        seeds: vec![1, 2],
        systems: vec![SystemChoice::PrimerlFull, SystemChoice::Aurora],
        link_low_share: 0.5,
        trainer_uplink_mbps: 10_000.0,
        decode_share: DECODE_ROOFLINE_SHARE,
        actors: vec![
            ActorGroup {
                region: "canada".into(),
                gpu: GpuChoice::A100,
                count: 2,
            },
            ActorGroup {
                region: "australia".into(),
                gpu: GpuChoice::L40,
                count: 2,
            },
        ],
        reclaims: Vec::new(),
        sweep: None,
    }
}

fn aurora_rate(report: &FleetReport, point: usize) -> Spread {
    report.points[point]
        .systems
        .iter()
        .find(|outcome| outcome.system == System::Aurora)
        .unwrap()
        .tokens_per_s
}

#[test]
fn the_documented_names_parse() {
    // docs/paper-eval.md, "Fleet files".
    for name in [
        "qwen3-4b",
        "qwen3-8b",
        "qwen3-14b",
        "qwen3-30b-a3b",
        "dense-70b",
    ] {
        serde_json::from_str::<ModelChoice>(&format!("\"{name}\"")).unwrap();
    }
    for name in [
        "primerl-full",
        "async2",
        "async4",
        "multistream",
        "ideal-single-dc",
        "aurorarl",
        "aurorarl-without-relays",
        "aurora",
    ] {
        serde_json::from_str::<SystemChoice>(&format!("\"{name}\"")).unwrap();
    }
    for name in [
        "rate_mbps",
        "rtt_ms",
        "loss",
        "link_low_share",
        "trainer_uplink_mbps",
        "trainer_gpus",
        "trainer_mfu",
        "decode_share",
        "actors_per_group",
    ] {
        let parameter: SweepParameter = serde_json::from_str(&format!("\"{name}\"")).unwrap();
        assert_eq!(parameter.name(), name);
    }
}

#[test]
fn a_path_through_another_region_adds_round_trips_and_keeps_the_slowest_rate() {
    let path = topology().path("us", "australia").unwrap();
    assert_eq!(path.rate_bps, 500e6);
    assert!((path.rtt_s - 0.23).abs() < 1e-12, "{}", path.rtt_s);
    assert!((path.loss - (1.0 - (1.0 - 1e-5_f64).powi(2))).abs() < 1e-15);
    assert_eq!(topology().path("us", "mars"), None);
    assert_eq!(topology().path("us", "venus"), None);
}

#[test]
fn a_fleet_runs_every_seed_and_point_and_records_every_step() {
    let mut spec = spec();
    spec.sweep = Some(FleetSweep {
        parameter: SweepParameter::ActorsPerGroup,
        values: vec![1.0, 3.0],
    });
    let report = run_fleet(&spec, &topology()).unwrap();
    assert_eq!(report.points.len(), 2);
    // 2 points x 2 seeds x 2 systems x 14 steps.
    assert_eq!(report.steps.len(), 2 * 2 * 2 * 14);
    for point in &report.points {
        for outcome in &point.systems {
            let rate = outcome.tokens_per_s;
            assert!(
                rate.min <= rate.mean && rate.mean <= rate.max && rate.min > 0.0,
                "{rate:?}"
            );
        }
    }
    let (few, many) = (aurora_rate(&report, 0), aurora_rate(&report, 1));
    assert!(many.mean > 1.5 * few.mean, "{few:?} {many:?}");
    assert_eq!(
        report,
        run_fleet(&spec, &topology()).unwrap(),
        "deterministic"
    );
    let csv = report.steps_csv();
    assert_eq!(csv.lines().count(), report.steps.len() + 1);
    let json = report.figures_json();
    assert_eq!(json["swept"], "actors_per_group");
    assert_eq!(json["points"].as_array().unwrap().len(), 2);
}

#[test]
fn a_reclaimed_region_costs_throughput_and_its_replacements_win_some_back() {
    let rate = |reclaims: Vec<Reclaim>| {
        let spec = FleetSpec {
            reclaims,
            seeds: vec![1],
            ..spec()
        };
        aurora_rate(&run_fleet(&spec, &topology()).unwrap(), 0).mean
    };
    let reclaim = |replaced_at_step| Reclaim {
        region: "canada".into(),
        at_step: 4,
        replaced_at_step,
    };
    let undisturbed = rate(Vec::new());
    let reclaimed = rate(vec![reclaim(None)]);
    let replaced = rate(vec![reclaim(Some(7))]);
    assert!(reclaimed < 0.9 * undisturbed, "{reclaimed} {undisturbed}");
    assert!(replaced > reclaimed, "{replaced} {reclaimed}");
}

#[test]
fn a_reclaimed_region_is_sent_nothing_until_its_replacements_come() {
    let full_rate = |reclaims: Vec<Reclaim>| {
        let spec = FleetSpec {
            reclaims,
            seeds: vec![1],
            systems: vec![SystemChoice::PrimerlFull],
            ..spec()
        };
        run_fleet(&spec, &topology()).unwrap().points[0].systems[0]
            .tokens_per_s
            .mean
    };
    // The full broadcast waits for its slowest path, Australia's: once its pool is
    // gone the rest are served at Canada's pace.
    let far = |replaced_at_step| Reclaim {
        region: "australia".into(),
        at_step: 3,
        replaced_at_step,
    };
    let undisturbed = full_rate(Vec::new());
    assert!(full_rate(vec![far(None)]) > 1.5 * undisturbed);
    // Both regions reclaimed, the later one timed on the run the first slowed: the
    // fleet must keep an actor throughout.
    let canada = Reclaim {
        region: "canada".into(),
        at_step: 5,
        replaced_at_step: None,
    };
    let mut spec = FleetSpec {
        reclaims: vec![far(Some(9)), canada.clone()],
        ..spec()
    };
    let error = run_fleet(&spec, &topology()).unwrap_err().to_string();
    assert!(
        error.contains("from step 5 the fleet has no actor left"),
        "{error}"
    );
    spec.actors.push(ActorGroup {
        region: "us".into(),
        gpu: GpuChoice::A100,
        count: 1,
    });
    let report = run_fleet(&spec, &topology()).unwrap();
    assert!(aurora_rate(&report, 0).min > 0.0);
    spec.reclaims.push(canada);
    let error = run_fleet(&spec, &topology()).unwrap_err().to_string();
    assert!(error.contains("reclaimed twice"), "{error}");
}

#[test]
fn a_fleet_that_cannot_run_is_refused_naming_what_is_wrong() {
    let refused = |change: &dyn Fn(&mut FleetSpec)| {
        let mut spec = spec();
        change(&mut spec);
        run_fleet(&spec, &topology()).unwrap_err().to_string()
    };
    assert!(refused(&|spec| spec.format = 2).contains("fleet format 2"));
    assert!(
        refused(&|spec| spec.actors[0].region = "venus".into())
            .contains("\"venus\": not in the topology")
    );
    assert!(refused(&|spec| spec.actors[0].region = "mars".into()).contains("no link reaches it"));
    assert!(refused(&|spec| spec.warm_up = 14).contains("warm_up"));
    assert!(refused(&|spec| spec.seeds.clear()).contains("seeds"));
    assert!(refused(&|spec| spec.decode_share = 0.0).contains("decode_share"));
    assert!(refused(&|spec| spec.actors[1].count = 0).contains("no actors"));
    assert!(
        refused(&|spec| spec.reclaims.push(Reclaim {
            region: "us".into(),
            at_step: 3,
            replaced_at_step: None,
        }))
        .contains("no actors there")
    );
    assert!(
        refused(&|spec| spec.reclaims.push(Reclaim {
            region: "canada".into(),
            at_step: 5,
            replaced_at_step: Some(5),
        }))
        .contains("replaced_at_step")
    );
    assert!(
        refused(&|spec| spec.sweep = Some(FleetSweep {
            parameter: SweepParameter::Loss,
            values: vec![f64::NAN],
        }))
        .contains("sweep.values")
    );
    assert!(refused(&|spec| spec.actors[0].count = MAX_FLEET_ACTORS).contains("more than"));
    assert!(refused(&|spec| spec.warm_up = 0).contains("warm_up"));
    let sweep = |parameter, value| {
        move |spec: &mut FleetSpec| {
            spec.sweep = Some(FleetSweep {
                parameter,
                values: vec![value],
            })
        }
    };
    assert!(refused(&sweep(SweepParameter::RateMbps, 0.0)).contains("link us-canada"));
    assert!(refused(&sweep(SweepParameter::Loss, 1.5)).contains("link us-canada"));
    assert!(refused(&sweep(SweepParameter::ActorsPerGroup, 2.7)).contains("sweep.values"));
    assert!(refused(&|spec| spec.decode_share = 1e-9).contains("too close to the"));
}
