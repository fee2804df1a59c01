//! The trust settings of `aurora_rl.Trainer` and `aurora_rl.Actor`, for both planes: the
//! node's certificate files (`ca`, `cert`, `key`: mutual TLS on the segment transport and
//! the control API), or `insecure_plaintext=True` (plain TCP and HTTP with the fleet
//! token). Neither is refused, so nobody runs in clear by leaving an argument out.

use std::path::PathBuf;

use crate::errors::usage_error;
use aurora_node::NodeTrust;
use aurora_trust::{PlaintextReach, TlsFiles};
use pyo3::prelude::*;

use crate::node::message_chain;

/// The arguments as the Python classes pass them.
pub(crate) struct TrustArgs {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub insecure_plaintext: bool,
    /// With `insecure_plaintext`: the network between the nodes is closed, so plaintext
    /// may leave loopback.
    pub insecure_closed_network: bool,
    /// Authenticates peers only over plaintext.
    pub fleet_token: String,
}

impl TrustArgs {
    pub fn load(self) -> PyResult<NodeTrust> {
        if self.insecure_closed_network && !self.insecure_plaintext {
            return Err(usage_error(
                "insecure_closed_network=True only widens insecure_plaintext=True",
            ));
        }
        match (self.ca, self.cert, self.key, self.insecure_plaintext) {
            (None, None, None, true) => {
                let reach = if self.insecure_closed_network {
                    PlaintextReach::ClosedNetwork
                } else {
                    PlaintextReach::Loopback
                };
                NodeTrust::insecure_plaintext(self.fleet_token, reach)
                    .map_err(|error| usage_error(message_chain(&error)))
            }
            (Some(ca), Some(cert), Some(key), false) => {
                NodeTrust::load(&TlsFiles { ca, cert, key }).map_err(|error| {
                    usage_error(format!(
                        "loading the node's certificates: {}",
                        message_chain(&error)
                    ))
                })
            }
            (.., true) => Err(usage_error(
                "give ca, cert and key, or insecure_plaintext=True, not both",
            )),
            _ => Err(usage_error(
                "the node needs ca, cert and key (files from `aurora certs`), or \
                 insecure_plaintext=True to run over plain TCP and HTTP with the fleet token",
            )),
        }
    }
}
