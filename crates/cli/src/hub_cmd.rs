use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use aurora_hub::{HubConfig, SystemClock};
use clap::Args;

/// Environment variable holding the bearer token: kept off the command line, where
/// every user of the machine could read it in the process list.
const TOKEN_VARIABLE: &str = "AURORA_TOKEN";

#[derive(Args)]
pub struct HubArgs {
    /// Address to listen on (port 0 picks a free one; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:7300")]
    listen: SocketAddr,
    /// The state database, created if missing and restored from if present.
    #[arg(long, default_value = "hub.redb")]
    state: PathBuf,
}

pub fn run(args: HubArgs) -> Result<()> {
    let token = std::env::var(TOKEN_VARIABLE)
        .with_context(|| format!("set the bearer token in {TOKEN_VARIABLE}"))?;
    let config = HubConfig {
        token,
        db_path: args.state,
        control: aurora_control::Config::default(),
        tick_interval_max: Duration::from_secs(1),
        clock: Arc::new(SystemClock::new()),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("listening on {}", args.listen))?;
        let address = listener.local_addr()?;
        // One line on stdout announces readiness to scripts and tests; logs go to stderr.
        println!("listening on {address}");
        std::io::stdout().flush()?;
        tracing::info!(%address, "hub serving");
        match aurora_hub::serve(config, listener).await? {}
    })
}
