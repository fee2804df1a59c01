//! `--limits FILE`: what a node lets its peers make it do, beyond the defaults (caps on
//! connections and requests, timeouts, build and memory budgets; docs/security.md). A
//! TOML file with a `[control]` table (the control API, `aurora hub` only) and a
//! `[transport]` table (the segment transport, every node); each key is optional and one
//! left out keeps its default, an unknown one is an error naming it. Times are in seconds.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Deserialize;

/// Every node's limits, defaults unless the file says otherwise.
#[derive(Clone, Debug, Default)]
pub struct NodeLimits {
    pub control: aurora_hub::Limits,
    pub transport: aurora_transport::Limits,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitsFile {
    #[serde(default)]
    control: ControlLimits,
    #[serde(default)]
    transport: TransportLimits,
}

/// `aurora_hub::Limits`, each key optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ControlLimits {
    handshake_timeout_s: Option<f64>,
    header_read_timeout_s: Option<f64>,
    request_timeout_s: Option<f64>,
    write_timeout_s: Option<f64>,
    max_connections: Option<usize>,
    max_connections_per_address: Option<usize>,
    max_connections_per_identity: Option<usize>,
    max_requests: Option<usize>,
    max_requests_per_peer: Option<usize>,
}

/// `aurora_transport::Limits`, each key optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TransportLimits {
    handshake_timeout_s: Option<f64>,
    max_connections: Option<usize>,
    max_unauthenticated_per_address: Option<usize>,
    max_connections_per_peer: Option<usize>,
    max_builds: Option<usize>,
    max_build_bytes: Option<u64>,
    max_held_bytes: Option<u64>,
    max_decode_backlog_bytes: Option<u64>,
    frame_read_timeout_s: Option<f64>,
    min_frame_read_rate: Option<u64>,
}

impl NodeLimits {
    /// The defaults, with what `path` (if any) sets.
    pub fn load(path: Option<&Path>) -> Result<NodeLimits> {
        let Some(path) = path else {
            return Ok(NodeLimits::default());
        };
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let file: LimitsFile =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        file.apply()
            .with_context(|| format!("checking {}", path.display()))
    }
}

/// Sets a limit from its key in the file, if given, with the key's name for errors.
macro_rules! set {
    ($check:ident, $table:ident . $key:ident => $target:expr) => {
        $check(
            &mut $target,
            $table.$key,
            concat!(stringify!($table), ".", stringify!($key)),
        )?
    };
}

impl LimitsFile {
    fn apply(self) -> Result<NodeLimits> {
        let mut limits = NodeLimits::default();
        let LimitsFile { control, transport } = self;
        let to = &mut limits.control;
        set!(set_seconds, control.handshake_timeout_s => to.handshake_timeout);
        set!(set_seconds, control.header_read_timeout_s => to.header_read_timeout);
        set!(set_seconds, control.request_timeout_s => to.request_timeout);
        set!(set_seconds, control.write_timeout_s => to.write_timeout);
        set!(set_count, control.max_connections => to.max_connections);
        set!(set_count, control.max_connections_per_address => to.max_connections_per_address);
        set!(set_count, control.max_connections_per_identity => to.max_connections_per_identity);
        set!(set_count, control.max_requests => to.max_requests);
        set!(set_count, control.max_requests_per_peer => to.max_requests_per_peer);
        let to = &mut limits.transport;
        set!(set_seconds, transport.handshake_timeout_s => to.handshake_timeout);
        set!(set_count, transport.max_connections => to.max_connections);
        set!(set_count, transport.max_unauthenticated_per_address => to.max_unauthenticated_per_address);
        set!(set_count, transport.max_connections_per_peer => to.max_connections_per_peer);
        set!(set_count, transport.max_builds => to.max_builds);
        set!(set_count, transport.max_build_bytes => to.max_build_bytes);
        set!(set_count, transport.max_held_bytes => to.max_held_bytes);
        set!(set_count, transport.max_decode_backlog_bytes => to.max_decode_backlog_bytes);
        set!(set_seconds, transport.frame_read_timeout_s => to.frame_read_timeout);
        set!(set_count, transport.min_frame_read_rate => to.min_frame_read_rate);
        Ok(limits)
    }
}

/// A wait of `seconds`, which must be positive and finite: a zero or endless timeout
/// is no bound.
fn set_seconds(target: &mut Duration, seconds: Option<f64>, key: &str) -> Result<()> {
    if let Some(seconds) = seconds {
        anyhow::ensure!(
            seconds.is_finite() && seconds > 0.0 && seconds <= 86_400.0,
            "{key} must be more than 0 and at most a day, not {seconds}"
        );
        *target = Duration::from_secs_f64(seconds);
    }
    Ok(())
}

/// A cap of at least 1: a cap of zero would refuse every peer.
fn set_count<T: Copy + PartialOrd + From<u8> + std::fmt::Display>(
    target: &mut T,
    value: Option<T>,
    key: &str,
) -> Result<()> {
    if let Some(value) = value {
        anyhow::ensure!(value >= T::from(1), "{key} must be at least 1, not {value}");
        *target = value;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<NodeLimits> {
        toml::from_str::<LimitsFile>(text)?.apply()
    }

    #[test]
    fn keys_left_out_keep_their_defaults() {
        let limits = parse(
            "[control]\nwrite_timeout_s = 5.5\nmax_requests_per_peer = 2\n\
             [transport]\nmax_held_bytes = 40000000000\nmax_builds = 1\n",
        )
        .unwrap();
        let control = aurora_hub::Limits {
            write_timeout: Duration::from_millis(5500),
            max_requests_per_peer: 2,
            ..aurora_hub::Limits::default()
        };
        let transport = aurora_transport::Limits {
            max_held_bytes: 40_000_000_000,
            max_builds: 1,
            ..aurora_transport::Limits::default()
        };
        assert_eq!(limits.control, control);
        assert_eq!(limits.transport, transport);
        let empty = parse("").unwrap();
        assert_eq!(empty.control, aurora_hub::Limits::default());
        assert_eq!(empty.transport, aurora_transport::Limits::default());
    }

    #[test]
    fn unknown_keys_and_unbounded_values_are_refused_by_name() {
        let unknown = parse("[transport]\nmax_held = 1\n").unwrap_err();
        assert!(
            format!("{unknown:#}").contains("unknown field `max_held`"),
            "{unknown:#}"
        );
        let zero = parse("[transport]\nmax_builds = 0\n").unwrap_err();
        assert_eq!(
            zero.to_string(),
            "transport.max_builds must be at least 1, not 0"
        );
        let endless = parse("[control]\nrequest_timeout_s = 0.0\n").unwrap_err();
        assert_eq!(
            endless.to_string(),
            "control.request_timeout_s must be more than 0 and at most a day, not 0"
        );
    }
}
