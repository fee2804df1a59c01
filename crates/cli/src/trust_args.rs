//! How a node proves who it is, on the command line, for both planes at once: the
//! fleet's certificates (`--ca`, `--cert`, `--key`: mutual TLS on the segment transport
//! and the control API), or plaintext asked for by name (`--insecure-plaintext`, with the
//! fleet token in AURORA_TOKEN). Neither is an error: nothing falls back to plaintext by
//! itself.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use aurora_node::NodeTrust;
use aurora_trust::{PlaintextReach, TlsFiles};
use clap::Args;

use crate::TOKEN_VARIABLE;

#[derive(Args, Clone, Debug, Default)]
pub struct TrustArgs {
    /// The fleet CA's certificate (`ca.pem` of `aurora certs init`): peers must present a
    /// certificate it issued.
    #[arg(long, requires_all = ["cert", "key"], conflicts_with = "insecure_plaintext")]
    ca: Option<PathBuf>,
    /// This node's certificate (`aurora certs issue`), naming its role, id and region.
    #[arg(long, requires_all = ["ca", "key"])]
    cert: Option<PathBuf>,
    /// This node's private key (PEM).
    #[arg(long, requires_all = ["ca", "cert"])]
    key: Option<PathBuf>,
    /// INSECURE: plain TCP and HTTP, peers authenticated by the shared token in
    /// AURORA_TOKEN. Anyone on the path reads the weights and the tokens, replays requests
    /// and can impersonate a node. Loopback addresses only, unless
    /// --insecure-closed-network.
    #[arg(long)]
    insecure_plaintext: bool,
    /// INSECURE, with --insecure-plaintext: the network between the nodes is closed (an
    /// emulated WAN, a private test cluster), so plaintext may listen on and dial
    /// addresses beyond loopback.
    #[arg(long, requires = "insecure_plaintext")]
    insecure_closed_network: bool,
}

impl TrustArgs {
    pub fn load(&self) -> Result<NodeTrust> {
        match (&self.ca, &self.cert, &self.key, self.insecure_plaintext) {
            (Some(ca), Some(cert), Some(key), false) => {
                let files = TlsFiles {
                    ca: ca.clone(),
                    cert: cert.clone(),
                    key: key.clone(),
                };
                NodeTrust::load(&files).context("loading the node's TLS material")
            }
            (None, None, None, true) => {
                let reach = if self.insecure_closed_network {
                    PlaintextReach::ClosedNetwork
                } else {
                    PlaintextReach::Loopback
                };
                Ok(NodeTrust::insecure_plaintext(token()?, reach)?)
            }
            _ => bail!(
                "this node needs --ca, --cert and --key (the fleet's certificates, from \
                 `aurora certs`), or --insecure-plaintext to run without TLS"
            ),
        }
    }
}

/// The fleet token, from AURORA_TOKEN.
pub fn token() -> Result<String> {
    std::env::var(TOKEN_VARIABLE).with_context(|| format!("set the token in {TOKEN_VARIABLE}"))
}
