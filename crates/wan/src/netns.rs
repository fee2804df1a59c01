//! Network namespaces: their names, threads that run inside one, the `ip`/`tc`
//! commands that configure them, and the removal of namespaces left by dead runs.
//!
//! Configuration goes through the `ip` and `tc` programs (iproute2) rather than a
//! netlink crate: every step is a command a person can rerun by hand from the log
//! (`AURORA_LOG=debug`), iproute2 is on every machine that has network namespaces at
//! all, and a failed step's error carries the exact command and its stderr.

use std::path::Path;
use std::process::Command;
use std::sync::mpsc::sync_channel;
use std::thread::JoinHandle;

use crate::WanError;
use crate::sys;

/// Every namespace this crate creates is named `aurora-wan-PID-RUN-REGION`, PID being
/// the creating process, so namespaces of processes that died can be found and removed.
pub const NETNS_PREFIX: &str = "aurora-wan-";

/// A thread running inside a region's network namespace.
pub struct NetnsThread<T> {
    name: String,
    handle: JoinHandle<Option<T>>,
}

impl<T> NetnsThread<T> {
    /// Waits for the thread's result; a panic inside it is resumed here.
    pub fn join(self) -> Result<T, WanError> {
        match self.handle.join() {
            Ok(Some(value)) => Ok(value),
            // spawn_in_netns only returns a thread that entered its namespace, and
            // only a thread that failed to enter returns None.
            Ok(None) => Err(WanError::Panicked(self.name)),
            Err(payload) => std::panic::resume_unwind(payload),
        }
    }

    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }
}

/// Runs `f` on a new thread inside the namespace `netns`; returns once the thread is
/// inside. Sockets `f` creates belong to that namespace wherever they are used later.
pub fn spawn_in_netns<F, T>(netns: &str, name: String, f: F) -> Result<NetnsThread<T>, WanError>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let netns_error = |source| WanError::Netns {
        netns: netns.to_string(),
        source,
    };
    let fd = sys::open_netns(netns).map_err(netns_error)?;
    let (entered_tx, entered_rx) = sync_channel(1);
    let handle = std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            let entered = sys::enter_netns(&fd);
            drop(fd);
            let ok = entered.is_ok();
            let _ = entered_tx.send(entered);
            ok.then(f)
        })
        .map_err(|source| WanError::Io {
            what: format!("spawning thread {name}"),
            source,
        })?;
    match entered_rx.recv() {
        Ok(Ok(())) => Ok(NetnsThread { name, handle }),
        Ok(Err(source)) => {
            let _ = handle.join();
            Err(netns_error(source))
        }
        Err(_) => {
            let _ = handle.join();
            Err(WanError::Panicked(name))
        }
    }
}

/// Runs a configuration command, failing with the command line and its stderr.
pub fn run(program: &str, args: &[String]) -> Result<(), WanError> {
    let line = || format!("{program} {}", args.join(" "));
    tracing::debug!(command = line(), "wan");
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|source| WanError::Spawn {
            command: line(),
            source,
        })?;
    if output.status.success() {
        Ok(())
    } else {
        Err(WanError::Command {
            command: line(),
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
        })
    }
}

/// The process that created namespace `name`, if this crate named it.
pub fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(NETNS_PREFIX)?;
    let (pid, _) = rest.split_once('-')?;
    pid.parse().ok()
}

/// Removes the namespaces of runs whose process is gone (killed before its
/// [`crate::Network`] was dropped); returns their names. Safe to run concurrently with
/// live runs, whose processes exist.
pub fn remove_leftovers() -> Result<Vec<String>, WanError> {
    let entries = match std::fs::read_dir(sys::NETNS_DIR) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(WanError::Io {
                what: format!("listing {}", sys::NETNS_DIR),
                source,
            });
        }
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = owner_pid(&name) else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        delete_netns(&name)?;
        removed.push(name);
    }
    Ok(removed)
}

/// Deletes a namespace; one that is already gone (another process cleaning up the
/// same leftovers) is not an error.
pub fn delete_netns(name: &str) -> Result<(), WanError> {
    let exists = || Path::new(sys::NETNS_DIR).join(name).exists();
    if !exists() {
        return Ok(());
    }
    match run("ip", &["netns".into(), "del".into(), name.into()]) {
        Err(_) if !exists() => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pid_reads_only_our_names() {
        assert_eq!(owner_pid("aurora-wan-1234-0-us"), Some(1234));
        assert_eq!(owner_pid("aurora-wan-1234-7-us-east"), Some(1234));
        assert_eq!(owner_pid("aurora-wan-x-0-us"), None);
        assert_eq!(owner_pid("aurora-wan-1234"), None);
        assert_eq!(owner_pid("other-1234-0-us"), None);
    }

    #[test]
    fn a_failed_command_names_itself_and_its_stderr() {
        let error = run(
            "ip",
            &["link".into(), "show".into(), "no-such-device-x".into()],
        )
        .unwrap_err();
        let WanError::Command {
            command, stderr, ..
        } = &error
        else {
            panic!("{error}");
        };
        assert_eq!(command, "ip link show no-such-device-x");
        assert!(!stderr.is_empty());
        let error = run("no-such-program-aurora", &[]).unwrap_err().to_string();
        assert!(error.contains("no-such-program-aurora"), "{error}");
    }

    #[test]
    fn entering_a_missing_namespace_is_an_error() {
        let error = spawn_in_netns("aurora-wan-missing", "t".into(), || ())
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("aurora-wan-missing"), "{error}");
    }
}
