//! `aurora sim paper`: the paper's evaluation reproduced by the deterministic simulator.

use std::path::PathBuf;

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
}

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
    }
}
