//! The node processes of `aurora run` and `aurora bench scale`: each node is the `aurora`
//! binary itself with a role, its stderr (logs) in `logs/<name>.log`, its stdout read
//! line by line as events.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The line a node's reader sends when the node's stdout closes: it has exited.
pub const CLOSED: &str = "\0closed";

/// A line a child printed on stdout, tagged with the child's name.
#[derive(Debug, Clone)]
pub struct Line {
    pub from: String,
    pub text: String,
}

/// A running node. Dropping it kills the process, so an aborted run leaves none behind.
pub struct Node {
    pub name: String,
    child: Child,
}

impl Node {
    /// Starts `command` (the `aurora` binary, directly or through `ip netns exec`) with
    /// `args` and the run's environment; every stdout line goes to `lines`, stderr to
    /// `<run_dir>/logs/<name>.log`.
    pub fn spawn(
        name: &str,
        mut command: Command,
        args: &[String],
        env: &[(&str, &str)],
        run_dir: &Path,
        lines: mpsc::Sender<Line>,
    ) -> Result<Node> {
        let logs = run_dir.join("logs");
        std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        let log_path = logs.join(format!("{name}.log"));
        let log =
            File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log));
        for (key, value) in env {
            command.env(key, value);
        }
        // A node must not outlive the run that started it, also when the run is killed
        // without the chance to drop its nodes. `ip netns exec` keeps the setting: it is
        // not set-user-ID.
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting node {name}"))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let from = name.to_string();
        std::thread::Builder::new()
            .name(format!("{name}-stdout"))
            .spawn(move || {
                for text in BufReader::new(stdout).lines().map_while(Result::ok) {
                    let line = Line {
                        from: from.clone(),
                        text,
                    };
                    if lines.send(line).is_err() {
                        return;
                    }
                }
                let _ = lines.send(Line {
                    from,
                    text: CLOSED.into(),
                });
            })
            .context("starting a reader thread")?;
        Ok(Node {
            name: name.to_string(),
            child,
        })
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Kills the process at once (SIGKILL: a crash, not a graceful leave).
    pub fn kill(&mut self) -> Result<()> {
        if self.child.try_wait()?.is_none() {
            self.child
                .kill()
                .with_context(|| format!("killing {}", self.name))?;
        }
        self.child.wait()?;
        Ok(())
    }

    /// Asks the process to stop (SIGTERM) and waits up to `timeout` for it to end; kills
    /// it past that. Returns how it ended.
    pub fn stop(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        self.terminate()?;
        self.wait_within(timeout)
    }

    /// Asks the process to stop (SIGTERM), without waiting for it.
    pub fn terminate(&self) -> Result<()> {
        let pid = libc::pid_t::try_from(self.child.id()).context("a process id beyond pid_t")?;
        // SAFETY: kill(2) with a pid this child still holds: it is not reaped until a
        // wait.
        if unsafe { libc::kill(pid, libc::SIGTERM) } == -1 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("asking {} to stop", self.name));
        }
        Ok(())
    }

    /// Waits up to `timeout` for a process asked to stop to end; kills it past that.
    pub fn wait_within(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill()?;
        bail!(
            "{} did not stop within {timeout:?} of SIGTERM: killed",
            self.name
        )
    }

    /// Waits for the process to end.
    pub fn wait(&mut self) -> Result<std::process::ExitStatus> {
        Ok(self.child.wait()?)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// Waits for a line from `from` that starts with `prefix` and returns the rest, passing
/// every other line to `other`. Fails after `timeout` or if every sender is gone.
pub fn expect_line(
    lines: &mpsc::Receiver<Line>,
    from: &str,
    prefix: &str,
    timeout: Duration,
    mut other: impl FnMut(Line),
) -> Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) if line.from == from && line.text.starts_with(prefix) => {
                return Ok(line.text[prefix.len()..].trim().to_string());
            }
            Ok(line) if line.from == from && line.text == CLOSED => {
                bail!("{from} exited before printing '{prefix}'; see logs/{from}.log")
            }
            Ok(line) => other(line),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                bail!("{from} did not print '{prefix}' within {timeout:?}")
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("every node has exited"),
        }
    }
}
