//! `aurora`: the one binary. Subcommands are thin: parsing, progress and printing here,
//! all logic in the library crates.

mod actor_cmd;
mod bench;
mod bench_scale;
mod certs_cmd;
mod delta_cmd;
mod fleet;
mod hub_cmd;
mod limits_file;
mod procs;
mod relay_cmd;
mod run;
mod signals;
mod sim_cmd;
mod store_cmd;
mod synth_cmd;
mod trust_args;
mod wan_cmd;
mod wan_transfer;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "aurora",
    version,
    about = "RL post-training over commodity networks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the fleet's certificate authority and issue node certificates.
    #[command(subcommand)]
    Certs(certs_cmd::CertsCommand),
    /// Create, apply, inspect and combine delta checkpoints.
    #[command(subcommand)]
    Delta(delta_cmd::DeltaCommand),
    /// Run the trainer's node: the control plane's API over mutual TLS (--ca, --cert,
    /// --key) or --insecure-plaintext, the transport hub (token from AURORA_TOKEN).
    Hub(hub_cmd::HubArgs),
    /// Run a region's relay of the delta transport (token from AURORA_TOKEN).
    Relay(relay_cmd::RelayArgs),
    /// Run an actor of the delta transport with the idle engine (token from AURORA_TOKEN).
    Actor(actor_cmd::ActorArgs),
    /// List, verify, plan and prune a checkpoint store.
    #[command(subcommand)]
    Store(store_cmd::StoreCommand),
    /// Write a sequence of synthetic BF16 checkpoints of a Qwen3-architecture model.
    Synth(synth_cmd::SynthArgs),
    /// Benchmarks, each next to its baseline.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Deterministic simulations of the whole system.
    #[command(subcommand)]
    Sim(sim_cmd::SimCommand),
    /// Train a small model with GRPO over a hub, relays and actors on this machine.
    Run(run::RunArgs),
    /// A node of `aurora run` (started by it).
    #[command(subcommand, hide = true)]
    RunNode(run::NodeCommand),
    /// WAN emulation in network namespaces: capacity, benchmarks, probes (needs root).
    #[command(subcommand)]
    Wan(wan_cmd::WanCommand),
}

/// The environment variable holding the fleet token: kept off the command line, where
/// every user of the machine could read it in the process list.
pub(crate) const TOKEN_VARIABLE: &str = "AURORA_TOKEN";

/// One malloc arena for the whole process, set before any thread starts. A node's
/// threads (sockets, decodes, activation) each allocate and free megabytes per segment;
/// with glibc's default of up to eight arenas per core, what they freed stayed in their
/// arenas: an actor at a 4B delta peaked at 551 to 613 MB of anonymous memory, and at
/// 355 to 379 MB with one arena (BENCHMARKS.md). The model and the staged changes live
/// in mapped files; what the heap holds is small and short-lived.
fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes an allocator parameter; called at the start of main,
    // before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

fn main() -> ExitCode {
    one_malloc_arena();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AURORA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let outcome = match cli.command {
        Command::Certs(command) => certs_cmd::run(command),
        Command::Delta(command) => delta_cmd::run(command),
        Command::Store(command) => store_cmd::run(command),
        Command::Hub(args) => hub_cmd::run(args),
        Command::Relay(args) => relay_cmd::run(args),
        Command::Actor(args) => actor_cmd::run(args),
        Command::Synth(args) => synth_cmd::run(args),
        Command::Bench(command) => bench::run(command),
        Command::Sim(command) => sim_cmd::run(command),
        Command::Run(args) => run::run(args),
        Command::RunNode(command) => run::run_node(command),
        Command::Wan(command) => wan_cmd::run(command),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Writes `text` to stdout; a reader that went away (`aurora delta inspect D | head`) is
/// not an error.
pub(crate) fn print_stdout(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

/// A progress bar on stderr for long operations; hidden when stderr is not a terminal.
pub(crate) fn progress_bar(length: u64, message: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(length);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>12} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

/// A spinner on stderr for long operations whose progress the library does not report;
/// hidden when stderr is not a terminal.
pub(crate) fn spinner(message: &str) -> indicatif::ProgressBar {
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} {elapsed}")
            .expect("valid template"),
    );
    spinner.set_message(message.to_string());
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    spinner
}

/// A flag's value under its name, or under the name it had before the CLI took one
/// vocabulary (kept for one release, with a deprecation line).
fn renamed<T>(current: (Option<T>, &str), old: (Option<T>, &str)) -> Option<T> {
    let ((value, name), (old_value, old_name)) = (current, old);
    value.or_else(|| {
        let old_value = old_value?;
        tracing::warn!("{old_name} is deprecated and goes in the next release: use {name}");
        Some(old_value)
    })
}

/// The async runtime of a command that serves or joins the network; `workers` caps its
/// threads (the run's nodes share this machine's cores), the default is one per core.
fn runtime(workers: Option<usize>) -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context;
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = workers {
        builder.worker_threads(workers);
    }
    builder
        .enable_all()
        .build()
        .context("starting the async runtime")
}
