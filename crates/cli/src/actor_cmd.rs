//! `aurora actor`: a rollout actor's transport with the built-in idle engine: it stages
//! every delta and activates committed versions (docs/wire-protocol.md §7), from weights
//! on disk or, with `--join`, from a snapshot taken over the wire. The RL engine of
//! `aurora run` plugs into the same boundary.

use std::sync::Arc;

use anyhow::Result;
use aurora_transport::{IdleEngine, spawn_actor, spawn_joining_actor};
use clap::Args;

use crate::relay_cmd::{ActorStart, NodeArgs, report_activations, show_snapshot_progress};
use crate::signals::StopSignals;

#[derive(Args)]
pub struct ActorArgs {
    #[command(flatten)]
    node: NodeArgs,
}

pub fn run(args: ActorArgs) -> Result<()> {
    let ActorStart { config, weights } = args.node.actor()?;
    crate::runtime(None)?.block_on(async {
        let mut stop = StopSignals::new()?;
        let engine = Arc::new(IdleEngine::default());
        let actor = match weights {
            Some(weights) => spawn_actor(config, weights, engine).await?,
            None => spawn_joining_actor(config, engine).await?,
        };
        let reported = async {
            show_snapshot_progress(&actor, "joining", |status| status.active.is_some()).await;
            report_activations(&actor).await
        };
        tokio::select! {
            reported = reported => reported,
            signal = stop.recv() => {
                tracing::info!(signal, "asked to stop");
                Ok(())
            }
        }
    })
}
