//! How far a node running in plaintext may reach (docs/security.md §2).
//!
//! Plaintext (`--insecure-plaintext`) sends weights and tokens in clear, so by default it
//! stays on loopback: a node refuses to listen on, or dial, any other address. A second,
//! separate setting (`--insecure-closed-network`, `insecure_closed_network=True`) says
//! the network between the nodes is closed (an emulated WAN in network namespaces, a
//! private test cluster), and only then does plaintext leave the machine. One typo'd
//! flag can therefore never put a fleet's weights on the internet in clear.

use std::net::SocketAddr;

/// Where plaintext connections may go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PlaintextReach {
    /// Loopback addresses only.
    #[default]
    Loopback,
    /// Any address: the operator said the network between the nodes is closed.
    ClosedNetwork,
}

/// A plaintext node asked to listen on, or dial, an address beyond its reach.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{what} {address} is not a loopback address: plaintext stays on this machine unless the \
     node is told the network between the nodes is closed (--insecure-closed-network, \
     insecure_closed_network=True); across any other network use certificates"
)]
pub struct BeyondLoopback {
    /// What the address is for, e.g. `the control plane's listen address`.
    pub what: &'static str,
    pub address: SocketAddr,
}

impl PlaintextReach {
    /// Whether a plaintext socket may use `address` (`what` names it in the error). A
    /// wildcard address (`0.0.0.0`, `::`) listens on every interface, so it is not
    /// loopback.
    pub fn check(self, what: &'static str, address: SocketAddr) -> Result<(), BeyondLoopback> {
        match self {
            PlaintextReach::ClosedNetwork => Ok(()),
            PlaintextReach::Loopback if address.ip().is_loopback() => Ok(()),
            PlaintextReach::Loopback => Err(BeyondLoopback { what, address }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plaintext_stays_on_loopback_unless_the_network_is_said_closed() {
        let loopback: [SocketAddr; 3] = [
            "127.0.0.1:7300".parse().unwrap(),
            "127.8.9.10:1".parse().unwrap(),
            "[::1]:7300".parse().unwrap(),
        ];
        let beyond: [SocketAddr; 4] = [
            "0.0.0.0:7300".parse().unwrap(),
            "10.0.0.2:7301".parse().unwrap(),
            "[::]:7300".parse().unwrap(),
            "203.0.113.9:443".parse().unwrap(),
        ];
        for address in loopback {
            assert_eq!(PlaintextReach::Loopback.check("listen", address), Ok(()));
        }
        for address in beyond {
            let error = PlaintextReach::Loopback
                .check("listen", address)
                .unwrap_err();
            assert!(error.to_string().contains(&address.to_string()), "{error}");
            assert_eq!(
                PlaintextReach::ClosedNetwork.check("listen", address),
                Ok(())
            );
        }
    }
}
