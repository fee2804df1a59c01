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
    /// Also serve the delta transport here (port 0 picks one; the bound address is
    /// printed), from the checkpoint store given with --store.
    #[arg(long, requires = "store")]
    transport_listen: Option<SocketAddr>,
    /// The checkpoint store whose deltas the transport serves; its latest version is
    /// committed.
    #[arg(long, requires = "transport_listen")]
    store: Option<PathBuf>,
}

pub fn run(args: HubArgs) -> Result<()> {
    let token = std::env::var(TOKEN_VARIABLE)
        .with_context(|| format!("set the bearer token in {TOKEN_VARIABLE}"))?;
    let transport_token = token.clone().into_bytes();
    let config = HubConfig {
        token,
        db_path: args.state,
        control: aurora_control::Config::default(),
        tick_interval_max: Duration::from_secs(1),
        clock: Arc::new(SystemClock::new()),
    };
    crate::runtime(None)?.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("listening on {}", args.listen))?;
        let address = listener.local_addr()?;
        // Kept alive while the hub serves.
        let _transport = match (args.transport_listen, &args.store) {
            (Some(listen), Some(root)) => Some(serve_store(listen, root, transport_token).await?),
            _ => None,
        };
        // One line on stdout announces readiness to scripts and tests; logs go to stderr.
        println!("listening on {address}");
        std::io::stdout().flush()?;
        tracing::info!(%address, "hub serving");
        match aurora_hub::serve(config, listener).await? {}
    })
}

/// Serves the deltas of the store at `root` over the transport and commits its latest
/// version.
async fn serve_store(
    listen: SocketAddr,
    root: &std::path::Path,
    token: Vec<u8>,
) -> Result<aurora_transport::NodeHandle> {
    let store = aurora_store::Store::open(root)
        .with_context(|| format!("opening the store {}", root.display()))?;
    let (deltas, snapshots) = store.records()?;
    let latest = deltas
        .values()
        .map(|d| (d.version, d.target_hash))
        .chain(snapshots.values().map(|s| (s.version, s.weights_hash)))
        .max_by_key(|(version, _)| *version);
    let identity = aurora_proto::Identity {
        role: aurora_proto::Role::Hub,
        peer_id: "hub".into(),
        region: "hub".into(),
    };
    let mut config = aurora_transport::NodeConfig::new(identity, token);
    config.listen = Some(listen);
    let node = aurora_transport::spawn_hub(config, Some(Arc::new(store))).await?;
    if let Some((version, hash)) = latest {
        node.commit(aurora_proto::VersionRef { version, hash })
            .await?;
    }
    let address = node.local_addr().context("the transport listens")?;
    println!("transport listening on {address}");
    Ok(node)
}
