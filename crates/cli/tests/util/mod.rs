//! Helpers for driving the real `aurora` binary: a command builder that shows the whole
//! invocation and its output when an expectation fails, a scratch directory with
//! checkpoint fixtures, and comparisons of checkpoints through the library.

use std::ffi::{OsStr, OsString};
use std::fmt::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use aurora_delta::{Checkpoint, Hash};

/// One invocation of the `aurora` binary.
pub struct Aurora {
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
}

/// What a finished invocation printed.
pub struct Run {
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// The `error: ...` line `main` prints for a failed command.
    pub fn error_line(&self) -> &str {
        self.stderr
            .lines()
            .find(|line| line.starts_with("error: "))
            .unwrap_or_else(|| panic!("no `error: ` line on stderr:\n{}", self.stderr))
    }
}

pub fn aurora(args: &[&str]) -> Aurora {
    Aurora {
        args: args.iter().map(OsString::from).collect(),
        envs: Vec::new(),
    }
}

impl Aurora {
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Aurora {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    pub fn env(mut self, key: &str, value: &str) -> Aurora {
        self.envs.push((key.into(), value.into()));
        self
    }

    fn output(&self) -> Output {
        Command::new(env!("CARGO_BIN_EXE_aurora"))
            .args(&self.args)
            // Only warnings and errors, without colour, so stderr is stable to match on.
            .env("AURORA_LOG", "warn")
            .env("NO_COLOR", "1")
            .env_remove("RUST_BACKTRACE")
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("the aurora binary runs")
    }

    fn shown(&self) -> String {
        let args: Vec<_> = self.args.iter().map(|a| a.to_string_lossy()).collect();
        format!("aurora {}", args.join(" "))
    }

    /// Runs the command and asserts it succeeded.
    pub fn ok(self) -> Run {
        let output = self.output();
        let run = to_run(&output);
        assert!(
            output.status.success(),
            "`{}` failed with {}\nstdout:\n{}\nstderr:\n{}",
            self.shown(),
            output.status,
            run.stdout,
            run.stderr
        );
        run
    }

    /// Runs the command and asserts it failed cleanly: a non-zero exit code, an
    /// `error: ` line, and no panic.
    pub fn fails(self) -> Run {
        let output = self.output();
        let run = to_run(&output);
        assert!(
            !output.status.success() && output.status.code().is_some(),
            "`{}` should have failed with an exit code but ended with {}\nstdout:\n{}\nstderr:\n{}",
            self.shown(),
            output.status,
            run.stdout,
            run.stderr
        );
        assert!(
            !run.stderr.contains("panicked"),
            "`{}` panicked instead of reporting an error:\n{}",
            self.shown(),
            run.stderr
        );
        run.error_line();
        run
    }
}

impl Aurora {
    /// Starts the command in a process group of its own and, once it prints a line
    /// containing `marker`, kills the whole group at once, as a machine that loses
    /// power would: every process it started dies with it.
    pub fn killed_at(self, marker: &str) {
        let (mut child, _, _) = self.signalled_at(marker, "KILL");
        child.wait().expect("the run is reaped");
        // The nodes were killed with it, but die on their own time: one still holding
        // its store's locks or ports would fail the next run over the directory. The
        // group is gone once no process answers a signal 0 (there is no event for it).
        let group = format!("-{}", child.id());
        while Command::new("kill")
            .args(["-0", "--", &group])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            std::thread::yield_now();
        }
    }

    /// Starts the command in a process group of its own and, once it prints a line
    /// containing `marker`, sends SIGINT to the whole group, as a terminal's Ctrl-C does;
    /// returns how the command ended and everything it printed on stdout.
    pub fn interrupted_at(self, marker: &str) -> (std::process::ExitStatus, String) {
        use std::io::Read;
        let (mut child, mut stdout, mut seen) = self.signalled_at(marker, "INT");
        stdout
            .read_to_string(&mut seen)
            .expect("the command's stdout");
        (child.wait().expect("the command is reaped"), seen)
    }

    /// As [`Aurora::interrupted_at`], then a second Ctrl-C once a line containing `then`
    /// shows the first was taken.
    pub fn interrupted_twice_at(
        self,
        marker: &str,
        then: &str,
    ) -> (std::process::ExitStatus, String) {
        use std::io::{BufRead, Read};
        let (mut child, mut stdout, mut seen) = self.signalled_at(marker, "INT");
        let mut line = String::new();
        while !line.contains(then) {
            line.clear();
            if stdout.read_line(&mut line).expect("the command's stdout") == 0 {
                panic!("the command ended without printing {then:?}:\n{seen}");
            }
            seen.push_str(&line);
        }
        let group = -libc::pid_t::try_from(child.id()).expect("a pid");
        // SAFETY: kill(2) on the group of a child that is not reaped yet.
        assert_eq!(
            unsafe { libc::kill(group, libc::SIGINT) },
            0,
            "the second SIGINT"
        );
        stdout
            .read_to_string(&mut seen)
            .expect("the command's stdout");
        (child.wait().expect("the command is reaped"), seen)
    }

    /// Starts the command in a process group of its own, reads its stdout up to a line
    /// containing `marker` and sends `signal` to the group; returns the child, the rest of
    /// its stdout and what it printed up to the marker.
    fn signalled_at(
        self,
        marker: &str,
        signal: &str,
    ) -> (
        std::process::Child,
        std::io::BufReader<std::process::ChildStdout>,
        String,
    ) {
        use std::io::{BufRead, BufReader};
        use std::os::unix::process::CommandExt;
        use std::process::Stdio;
        let mut child = Command::new(env!("CARGO_BIN_EXE_aurora"))
            .args(&self.args)
            .env("AURORA_LOG", "warn")
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("the aurora binary runs");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut seen = String::new();
        let mut line = String::new();
        let found = loop {
            line.clear();
            if stdout.read_line(&mut line).unwrap_or(0) == 0 {
                break false;
            }
            seen.push_str(&line);
            if line.contains(marker) {
                break true;
            }
        };
        if !found {
            let status = child.wait().expect("the command is reaped");
            panic!(
                "`{}` ended ({status}) without printing {marker:?}:\n{seen}",
                self.shown()
            );
        }
        let group = format!("-{}", child.id());
        let sent = Command::new("kill")
            .args([&format!("-{signal}"), "--", &group])
            .status();
        assert!(
            sent.is_ok_and(|s| s.success()),
            "sending SIG{signal} to {group}"
        );
        (child, stdout, seen)
    }
}

fn to_run(output: &Output) -> Run {
    Run {
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Asserts that the error line of `run` mentions every one of `needles` (ASCII case
/// ignored).
#[track_caller]
pub fn assert_error_mentions(run: &Run, needles: &[&str]) {
    let line = run.error_line().to_ascii_lowercase();
    for needle in needles {
        assert!(
            line.contains(&needle.to_ascii_lowercase()),
            "the error should mention {needle:?}:\n{}",
            run.stderr
        );
    }
}

/// A scratch directory, removed when dropped.
pub struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    pub fn new() -> Scratch {
        Scratch {
            dir: tempfile::tempdir().expect("a temporary directory"),
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes `steps + 1` synthetic checkpoints (step 0 to `steps`) and returns their
    /// paths in order.
    pub fn synth(&self, preset: &str, steps: u64, extra: &[&str]) -> Vec<PathBuf> {
        let out = self.path(&format!("{preset}-ckpt"));
        let mut command = aurora(&["synth", "--preset", preset, "--seed", "7"])
            .arg("--steps")
            .arg(steps.to_string())
            .arg("--out")
            .arg(&out);
        for arg in extra {
            command = command.arg(arg);
        }
        command.ok();
        let paths: Vec<PathBuf> = (0..=steps)
            .map(|step| out.join(format!("step-{step:05}.safetensors")))
            .collect();
        for path in &paths {
            assert!(path.is_file(), "synth did not write {}", path.display());
        }
        paths
    }

    /// Extracts the delta from `base` to `target` with the given encoding, naming it as
    /// the step from `base_version` to the next.
    pub fn diff(&self, base: &Path, target: &Path, encoding: &str, base_version: u64) -> PathBuf {
        let out = self.path(&format!("d{}-{encoding}.adelta", base_version + 1));
        aurora(&["delta", "diff"])
            .arg(base)
            .arg(target)
            .arg("-o")
            .arg(&out)
            .arg("--encoding")
            .arg(encoding)
            .arg("--base-version")
            .arg(base_version.to_string())
            .ok();
        out
    }

    /// Copies `from` to a new file of the scratch directory.
    pub fn copy(&self, from: &Path, name: &str) -> PathBuf {
        let to = self.path(name);
        std::fs::copy(from, &to).expect("copy a fixture");
        to
    }

    /// Writes `bytes` to a new file of the scratch directory.
    pub fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, bytes).expect("write a fixture");
        path
    }
}

pub fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The weights hash of a safetensors file, computed by the library.
pub fn weights_hash(path: &Path) -> Hash {
    let bytes = read(path);
    Checkpoint::from_safetensors(&bytes)
        .unwrap_or_else(|e| panic!("{} is not a checkpoint: {e}", path.display()))
        .weights_hash()
}

/// Asserts that two safetensors files hold the same tensors: names, dtypes, shapes and
/// bytes, and so the same weights hash. Reports the first difference rather than
/// dumping megabytes of data.
#[track_caller]
pub fn assert_same_weights(actual: &Path, expected: &Path) {
    let actual_bytes = read(actual);
    let expected_bytes = read(expected);
    let a = Checkpoint::from_safetensors(&actual_bytes)
        .unwrap_or_else(|e| panic!("{} is not a checkpoint: {e}", actual.display()));
    let e = Checkpoint::from_safetensors(&expected_bytes)
        .unwrap_or_else(|e| panic!("{} is not a checkpoint: {e}", expected.display()));
    let names = |c: &Checkpoint<'_>| -> Vec<String> {
        c.tensors().iter().map(|t| t.name.clone()).collect()
    };
    assert_eq!(
        names(&a),
        names(&e),
        "{} and {} hold different tensors",
        actual.display(),
        expected.display()
    );
    for (x, y) in a.tensors().iter().zip(e.tensors()) {
        assert_eq!(
            (x.dtype, &x.shape),
            (y.dtype, &y.shape),
            "tensor '{}' differs in dtype or shape",
            x.name
        );
        if let Some(at) = first_difference(x.data, y.data) {
            panic!(
                "tensor '{}' of {} differs from {} first at byte {at} of {}",
                x.name,
                actual.display(),
                expected.display(),
                x.data.len()
            );
        }
    }
    assert_eq!(a.weights_hash(), e.weights_hash());
}

/// Asserts that two files are byte-identical, reporting where they first differ.
#[track_caller]
pub fn assert_same_file(actual: &Path, expected_bytes: &[u8]) {
    let actual_bytes = read(actual);
    assert_eq!(
        actual_bytes.len(),
        expected_bytes.len(),
        "{} changed length",
        actual.display()
    );
    if let Some(at) = first_difference(&actual_bytes, expected_bytes) {
        panic!("{} differs first at byte {at}", actual.display());
    }
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

/// Where the parts of a delta file lie (docs/delta-format.md §4), read from the raw
/// bytes so that tests can damage one part on purpose.
pub struct DeltaRegions {
    pub header: Range<usize>,
    pub segments: Range<usize>,
    pub table: Range<usize>,
    pub trailer: Range<usize>,
}

pub fn delta_regions(bytes: &[u8]) -> DeltaRegions {
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let header_len = u32_at(12);
    let trailer_start = bytes.len() - 48;
    let table_len = u32_at(trailer_start);
    let regions = DeltaRegions {
        header: 16..16 + header_len,
        segments: 16 + header_len..trailer_start - table_len,
        table: trailer_start - table_len..trailer_start,
        trailer: trailer_start..bytes.len(),
    };
    assert_eq!(&bytes[bytes.len() - 8..], b"ADLTEND\n", "not a whole delta");
    assert!(
        !regions.segments.is_empty(),
        "the fixture delta has no segment bytes to damage"
    );
    regions
}

/// Hex of a byte string, for messages.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}

/// The WAN tests build network namespaces; CI runs as root with `ip netns`, so a machine
/// without them fails these tests rather than skipping them.
pub fn require_namespaces() {
    if let Some(reason) = aurora_wan::unavailable_reason() {
        panic!("this test builds network namespaces and cannot run here: {reason}");
    }
}
