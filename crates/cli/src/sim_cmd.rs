//! `aurora sim paper`: the paper's evaluation reproduced by the deterministic simulator.

use anyhow::{Result, anyhow};
use clap::Subcommand;

#[derive(Subcommand)]
pub enum SimCommand {
    /// Simulate the paper's evaluation at its scale (4B to 14B, up to four regions, every
    /// baseline) and print each figure beside the paper's, then the scales past it.
    Paper,
}

pub fn run(command: SimCommand) -> Result<()> {
    match command {
        SimCommand::Paper => {
            let report = aurora_sim::paper::paper_evaluation()
                .map_err(|violation| anyhow!("the simulation broke an invariant: {violation}"))?;
            crate::print_stdout(&format!("{report}\n"))
        }
    }
}
