//! How a node proves who it is, on the command line, for both planes at once: the
//! fleet's certificates (`--ca`, `--cert`, `--key`: mutual TLS on the segment transport
//! and the control API), or plaintext asked for by name (`--insecure-plaintext`, with the
//! fleet token in AURORA_TOKEN). Neither is an error: nothing falls back to plaintext by
//! itself.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use aurora_node::ControlSecurity;
use aurora_trust::{NodeTls, TlsFiles};
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
    /// and can impersonate a node. For loopback and closed test networks only.
    #[arg(long)]
    insecure_plaintext: bool,
}

/// What a node's flags gave: its TLS material, or `None` where plaintext was asked for by
/// name.
pub struct NodeTrust {
    pub tls: Option<Arc<NodeTls>>,
}

impl TrustArgs {
    pub fn load(&self) -> Result<NodeTrust> {
        Ok(NodeTrust { tls: self.tls()? })
    }

    fn tls(&self) -> Result<Option<Arc<NodeTls>>> {
        match (&self.ca, &self.cert, &self.key, self.insecure_plaintext) {
            (Some(ca), Some(cert), Some(key), false) => {
                let files = TlsFiles {
                    ca: ca.clone(),
                    cert: cert.clone(),
                    key: key.clone(),
                };
                let tls = NodeTls::load(&files).context("loading the node's TLS material")?;
                Ok(Some(Arc::new(tls)))
            }
            (None, None, None, true) => {
                tracing::warn!(
                    "--insecure-plaintext: weights, tokens and control calls cross the network \
                     in clear"
                );
                Ok(None)
            }
            _ => bail!(
                "this node needs --ca, --cert and --key (the fleet's certificates, from \
                 `aurora certs`), or --insecure-plaintext to run without TLS"
            ),
        }
    }
}

impl NodeTrust {
    /// The segment transport's security.
    pub fn transport(&self) -> Result<aurora_transport::Security> {
        Ok(match self.tls.clone() {
            Some(tls) => aurora_transport::Security::Tls(tls),
            None => aurora_transport::Security::InsecurePlaintext {
                token: token()?.into_bytes(),
            },
        })
    }

    /// How the hub serves the control plane.
    pub fn control_server(&self) -> Result<aurora_hub::Security> {
        Ok(match &self.tls {
            Some(tls) => aurora_hub::Security::mutual_tls(tls)?,
            None => aurora_hub::Security::insecure_plaintext(&token()?)?,
        })
    }

    /// How a client calls the control plane.
    pub fn control_client(&self) -> Result<ControlSecurity> {
        Ok(match &self.tls {
            Some(tls) => ControlSecurity::mutual_tls(tls)?,
            None => ControlSecurity::InsecurePlaintext {
                fleet_token: token()?,
            },
        })
    }
}

/// The fleet token, from AURORA_TOKEN.
pub fn token() -> Result<String> {
    std::env::var(TOKEN_VARIABLE).with_context(|| format!("set the token in {TOKEN_VARIABLE}"))
}
