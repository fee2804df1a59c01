//! How a node's segment transport is secured, from the flags every command that runs
//! one takes: the fleet's certificates (`--ca`, `--cert`, `--key`), or plaintext asked
//! for by name (`--insecure-plaintext`, with the token in `AURORA_TOKEN`). Neither is
//! an error: nothing falls back to plaintext by itself.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use aurora_transport::Security;
use aurora_trust::{NodeTls, TlsFiles};
use clap::Args;

use crate::TOKEN_VARIABLE;

/// The segment transport's security flags.
#[derive(Args, Clone, Debug, Default)]
pub struct SecurityArgs {
    /// The fleet CA's certificate (PEM): peers must present a certificate it issued.
    #[arg(long, requires_all = ["cert", "key"], conflicts_with = "insecure_plaintext")]
    ca: Option<PathBuf>,
    /// This node's certificate (PEM), issued by the fleet CA with its role, id and region
    /// (`aurora certs issue`).
    #[arg(long, requires_all = ["ca", "key"])]
    cert: Option<PathBuf>,
    /// This node's private key (PEM).
    #[arg(long, requires_all = ["ca", "cert"])]
    key: Option<PathBuf>,
    /// Run the segment transport over plain TCP, peers authenticated by the shared token
    /// in AURORA_TOKEN: anyone on the path reads the weights and the token and can
    /// impersonate a node. For loopback and closed test networks only.
    #[arg(long)]
    insecure_plaintext: bool,
}

impl SecurityArgs {
    /// The node's TLS material, or `None` where plaintext was asked for by name.
    pub fn tls(&self) -> Result<Option<Arc<NodeTls>>> {
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
            (None, None, None, true) => Ok(None),
            _ => bail!(
                "the segment transport needs --ca, --cert and --key (the fleet's \
                 certificates), or --insecure-plaintext to run without TLS"
            ),
        }
    }

    /// The node's security: TLS, or insecure plaintext with the token in AURORA_TOKEN.
    pub fn security(&self) -> Result<Security> {
        Ok(match self.tls()? {
            Some(tls) => Security::Tls(tls),
            None => Security::InsecurePlaintext {
                token: token()?.into_bytes(),
            },
        })
    }
}

/// The fleet token, from AURORA_TOKEN.
pub fn token() -> Result<String> {
    std::env::var(TOKEN_VARIABLE).with_context(|| format!("set the token in {TOKEN_VARIABLE}"))
}
