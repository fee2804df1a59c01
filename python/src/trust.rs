//! The trust settings of `aurora_rl.Trainer` and `aurora_rl.Actor`, for both planes: the
//! node's certificate files (`ca`, `cert`, `key`: mutual TLS on the segment transport and
//! the control API), or `insecure_plaintext=True` (plain TCP and HTTP with the fleet
//! token). Neither is refused, so nobody runs in clear by leaving an argument out.

use std::path::PathBuf;
use std::sync::Arc;

use aurora_hub::Security;
use aurora_node::ControlSecurity;
use aurora_trust::{NodeTls, TlsFiles};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::node::message_chain;

/// The arguments as the Python classes pass them.
pub(crate) struct ControlTrust {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub insecure_plaintext: bool,
}

/// The node's certificates, or `None` with `insecure_plaintext`.
pub(crate) struct Trust {
    pub tls: Option<Arc<NodeTls>>,
}

impl ControlTrust {
    pub fn load(self) -> PyResult<Trust> {
        let tls = match (self.ca, self.cert, self.key, self.insecure_plaintext) {
            (None, None, None, true) => Ok(None),
            (Some(ca), Some(cert), Some(key), false) => NodeTls::load(&TlsFiles { ca, cert, key })
                .map(|tls| Some(Arc::new(tls)))
                .map_err(|error| {
                    PyValueError::new_err(format!(
                        "loading the node's certificates: {}",
                        message_chain(&error)
                    ))
                }),
            (.., true) => Err(PyValueError::new_err(
                "give ca, cert and key, or insecure_plaintext=True, not both",
            )),
            _ => Err(PyValueError::new_err(
                "the node needs ca, cert and key (files from `aurora certs`), or \
                 insecure_plaintext=True to run over plain TCP and HTTP with the fleet token",
            )),
        }?;
        Ok(Trust { tls })
    }
}

impl Trust {
    /// How a trainer node serves the control plane; `fleet_token` over plaintext.
    pub fn server(&self, fleet_token: &str) -> PyResult<Security> {
        let security = match &self.tls {
            Some(tls) => Security::mutual_tls(tls),
            None => Security::insecure_plaintext(fleet_token),
        };
        security.map_err(|error| PyValueError::new_err(message_chain(&error)))
    }

    /// How an actor node calls the control plane; `fleet_token` over plaintext.
    pub fn client(&self, fleet_token: &str) -> PyResult<ControlSecurity> {
        match &self.tls {
            Some(tls) => ControlSecurity::mutual_tls(tls)
                .map_err(|error| PyValueError::new_err(message_chain(&error))),
            None => Ok(ControlSecurity::InsecurePlaintext {
                fleet_token: fleet_token.to_owned(),
            }),
        }
    }
}
