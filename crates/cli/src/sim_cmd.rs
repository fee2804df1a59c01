//! `aurora sim paper`: the paper's evaluation reproduced by the deterministic simulator;
//! `aurora sim fleet`: the same model on a researcher's own topology and fleet.

use std::path::{Path, PathBuf};

use aurora_sim::paper::Link;
use aurora_sim::paper::fleet::{FleetSpec, Topology, run_fleet};

use anyhow::{Context, Result, anyhow};
use clap::Subcommand;

#[derive(Subcommand)]
pub enum SimCommand {
    /// Simulate the paper's evaluation at its scale (4B to 14B, up to four regions, every
    /// baseline) and print each figure beside the paper's, then the scales past it.
    Paper {
        /// Also write every figure, with the paper's and the difference, as JSON.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Also write every figure as CSV, a row each.
        #[arg(long, value_name = "FILE")]
        csv: Option<PathBuf>,
    },
    /// Run a fleet file (docs/paper-eval.md, "Fleet files"): its topology (a
    /// wan/scenarios file), actors, reclaims, seeds and sweep, every system compared.
    Fleet {
        /// The fleet file.
        file: PathBuf,
        /// Also write every point and system, with the spread over seeds, as JSON.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Also write every point and system as CSV, a row each.
        #[arg(long, value_name = "FILE")]
        csv: Option<PathBuf>,
        /// Also write every step of every run as CSV.
        #[arg(long, value_name = "FILE")]
        steps_csv: Option<PathBuf>,
    },
}

/// Largest fleet file read.
const MAX_FLEET_FILE_BYTES: u64 = 1 << 20;

pub fn run(command: SimCommand) -> Result<()> {
    match command {
        SimCommand::Paper { json, csv } => {
            let report = aurora_sim::paper::paper_evaluation()
                .map_err(|violation| anyhow!("the simulation broke an invariant: {violation}"))?;
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&report.figures_json())?;
                std::fs::write(&path, text + "\n")
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if let Some(path) = csv {
                std::fs::write(&path, report.figures_csv())
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            crate::print_stdout(&format!("{report}\n"))
        }
        SimCommand::Fleet {
            file,
            json,
            csv,
            steps_csv,
        } => {
            let (spec, topology) = load_fleet(&file)?;
            let report = run_fleet(&spec, &topology)
                .with_context(|| format!("running fleet {}", file.display()))?;
            write_if(json.as_deref(), || {
                serde_json::to_string_pretty(&report.figures_json()).map(|text| text + "\n")
            })?;
            write_if(csv.as_deref(), || Ok(report.figures_csv()))?;
            write_if(steps_csv.as_deref(), || Ok(report.steps_csv()))?;
            crate::print_stdout(&format!("{report}\n"))
        }
    }
}

fn write_if(path: Option<&Path>, text: impl FnOnce() -> serde_json::Result<String>) -> Result<()> {
    if let Some(path) = path {
        std::fs::write(path, text()?).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Reads a fleet file and the topology it names (relative to it).
fn load_fleet(file: &Path) -> Result<(FleetSpec, Topology)> {
    let size = std::fs::metadata(file)
        .with_context(|| format!("reading fleet {}", file.display()))?
        .len();
    if size > MAX_FLEET_FILE_BYTES {
        return Err(anyhow!(
            "fleet {} is {size} bytes, more than {MAX_FLEET_FILE_BYTES}",
            file.display()
        ));
    }
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading fleet {}", file.display()))?;
    let spec: FleetSpec = toml::from_str(&text)
        .with_context(|| format!("fleet {} is not a valid fleet file", file.display()))?;
    let scenario_path = file.parent().unwrap_or(Path::new(".")).join(&spec.topology);
    let scenario = aurora_wan::Scenario::load(&scenario_path)
        .with_context(|| format!("the topology of fleet {}", file.display()))?;
    let mut links = Vec::with_capacity(scenario.links.len());
    for link in &scenario.links {
        let [a, b] = &link.between;
        let rate_mbps = link.rate_mbps.ok_or_else(|| {
            anyhow!(
                "topology {}: the link between {a} and {b} has no rate_mbps, which the simulation needs",
                scenario_path.display()
            )
        })?;
        let rtt_ms = link
            .rtt_ms
            .or(link.delay_ms.map(|delay| 2.0 * delay))
            .unwrap_or(0.0);
        links.push((
            a.clone(),
            b.clone(),
            Link {
                rate_bps: rate_mbps * 1e6,
                rtt_s: rtt_ms / 1e3,
                loss: link.loss,
            },
        ));
    }
    let topology = Topology {
        regions: scenario
            .regions
            .iter()
            .map(|region| region.name.clone())
            .collect(),
        links,
    };
    Ok((spec, topology))
}
