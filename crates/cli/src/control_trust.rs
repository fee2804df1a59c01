//! How a node of the control plane proves who it is, on the command line: the fleet's
//! certificates (`--ca --cert --key`, mutual TLS), or `--insecure-plaintext` (plain HTTP
//! with the fleet token from AURORA_TOKEN). A node given neither refuses to start, so
//! nobody runs the control plane in clear by forgetting a flag.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use aurora_hub::Security;
use aurora_node::ControlSecurity;
use aurora_trust::{NodeTls, TlsFiles};
use clap::Args;

#[derive(Args, Clone, Debug)]
pub struct ControlTrustArgs {
    /// The fleet CA's certificate (`ca.pem` of `aurora certs init`), for the control
    /// plane's mutual TLS.
    #[arg(long, requires_all = ["cert", "key"])]
    ca: Option<PathBuf>,
    /// This node's certificate (`aurora certs issue`): a trainer's to serve the control
    /// plane, an actor's (its id the actor's) to call it.
    #[arg(long, requires_all = ["ca", "key"])]
    cert: Option<PathBuf>,
    /// This node's private key.
    #[arg(long, requires_all = ["ca", "cert"])]
    key: Option<PathBuf>,
    /// INSECURE: plain HTTP with the fleet token from AURORA_TOKEN instead of
    /// certificates. Anyone on the path reads the tokens and can replay requests; for
    /// loopback and tests only.
    #[arg(long, conflicts_with_all = ["ca", "cert", "key"])]
    insecure_plaintext: bool,
}

impl ControlTrustArgs {
    /// The node's certificates, or `None` with `--insecure-plaintext`.
    fn certificates(&self) -> Result<Option<NodeTls>> {
        if self.insecure_plaintext {
            tracing::warn!(
                "--insecure-plaintext: the control plane runs over plain HTTP; its tokens cross \
                 the network in clear"
            );
            return Ok(None);
        }
        let (Some(ca), Some(cert), Some(key)) = (&self.ca, &self.cert, &self.key) else {
            bail!(
                "the control plane needs this node's certificates (--ca, --cert and --key, from \
                 `aurora certs`), or --insecure-plaintext to run it over plain HTTP with the \
                 fleet token"
            );
        };
        let files = TlsFiles {
            ca: ca.clone(),
            cert: cert.clone(),
            key: key.clone(),
        };
        let tls = NodeTls::load(&files).context("loading the control plane's certificates")?;
        Ok(Some(tls))
    }

    /// How the hub serves the control plane; `fleet_token` over plaintext.
    pub fn server(&self, fleet_token: &str) -> Result<Security> {
        Ok(match self.certificates()? {
            Some(tls) => Security::mutual_tls(&tls)?,
            None => Security::insecure_plaintext(fleet_token)?,
        })
    }

    /// How a client calls the control plane; `fleet_token` over plaintext.
    pub fn client(&self, fleet_token: &str) -> Result<ControlSecurity> {
        Ok(match self.certificates()? {
            Some(tls) => ControlSecurity::mutual_tls(&tls)?,
            None => ControlSecurity::InsecurePlaintext {
                fleet_token: fleet_token.to_owned(),
            },
        })
    }
}
