//! The control plane's trust settings of `aurora_rl.Trainer` and `aurora_rl.Actor`: the
//! node's certificate files (`ca`, `cert`, `key`: mutual TLS), or
//! `insecure_plaintext=True` (plain HTTP with the fleet token). Neither is refused, so
//! nobody runs the control plane in clear by leaving an argument out.

use std::path::PathBuf;

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

impl ControlTrust {
    /// The node's certificates, or `None` with `insecure_plaintext`.
    fn certificates(self) -> PyResult<Option<NodeTls>> {
        match (self.ca, self.cert, self.key, self.insecure_plaintext) {
            (None, None, None, true) => Ok(None),
            (Some(ca), Some(cert), Some(key), false) => NodeTls::load(&TlsFiles { ca, cert, key })
                .map(Some)
                .map_err(|error| {
                    PyValueError::new_err(format!(
                        "loading the control plane's certificates: {}",
                        message_chain(&error)
                    ))
                }),
            (.., true) => Err(PyValueError::new_err(
                "give ca, cert and key, or insecure_plaintext=True, not both",
            )),
            _ => Err(PyValueError::new_err(
                "the control plane needs ca, cert and key (files from `aurora certs`), or \
                 insecure_plaintext=True to run it over plain HTTP with the fleet token",
            )),
        }
    }

    /// How a trainer node serves the control plane; `fleet_token` over plaintext.
    pub fn server(self, fleet_token: &str) -> PyResult<Security> {
        let security = match self.certificates()? {
            Some(tls) => Security::mutual_tls(&tls),
            None => Security::insecure_plaintext(fleet_token),
        };
        security.map_err(|error| PyValueError::new_err(message_chain(&error)))
    }

    /// How an actor node calls the control plane; `fleet_token` over plaintext.
    pub fn client(self, fleet_token: &str) -> PyResult<ControlSecurity> {
        match self.certificates()? {
            Some(tls) => ControlSecurity::mutual_tls(&tls)
                .map_err(|error| PyValueError::new_err(message_chain(&error))),
            None => Ok(ControlSecurity::InsecurePlaintext {
                fleet_token: fleet_token.to_owned(),
            }),
        }
    }
}
