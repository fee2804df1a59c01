//! A scenario brought up: namespaces, veths, rate limiters, emulators and routes, torn
//! down when the [`Network`] is dropped.

use std::io::Write;
use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::emulator::{Emulator, EmulatorSpec};
use crate::impair::Counters;
use crate::netns::{self, NETNS_PREFIX, NetnsThread, spawn_in_netns};
use crate::plan::{NAMESPACE_SYSCTLS, Plan, Step};
use crate::scenario::Scenario;
use crate::{WanError, sys};

/// Distinguishes the networks one process brings up (tests run several at once).
static NEXT_RUN: AtomicU64 = AtomicU64::new(0);

/// The running emulation of a scenario. Dropping it stops the emulators and deletes the
/// namespaces (and with them every device); [`Network::down`] does the same and reports
/// errors.
pub struct Network {
    scenario: Scenario,
    plan: Plan,
    /// Namespaces created so far, so a bring-up that fails halfway removes them.
    created: Vec<String>,
    emulators: Vec<DirectionEmulator>,
}

struct DirectionEmulator {
    link: usize,
    end: usize,
    emulator: Emulator,
}

/// One direction of an emulated link and its packet counts.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DirectionCounters {
    pub link: usize,
    pub from: String,
    pub to: String,
    pub counters: Counters,
}

/// Why this machine cannot run network emulation, found by creating and deleting a
/// namespace; `None` if it can.
pub fn unavailable_reason() -> Option<String> {
    if !sys::is_root() {
        return Some("network namespaces need root (effective uid 0)".to_string());
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Some("/dev/net/tun is missing".to_string());
    }
    let probe = format!(
        "{NETNS_PREFIX}{}-{}-probe",
        std::process::id(),
        NEXT_RUN.fetch_add(1, Ordering::Relaxed)
    );
    let created = netns::run("ip", &["netns".into(), "add".into(), probe.clone()]);
    let deleted = netns::delete_netns(&probe);
    match created.and(deleted) {
        Ok(()) => None,
        Err(error) => Some(format!("`ip netns` does not work here: {error}")),
    }
}

impl Network {
    /// Builds `scenario` in fresh namespaces, after removing those of dead runs.
    pub fn up(scenario: &Scenario) -> Result<Network, WanError> {
        scenario.validate()?;
        if !sys::is_root() {
            return Err(WanError::NotRoot);
        }
        let removed = netns::remove_leftovers()?;
        if !removed.is_empty() {
            tracing::info!(?removed, "removed namespaces of runs that died");
        }
        let prefix = format!(
            "{NETNS_PREFIX}{}-{}-",
            std::process::id(),
            NEXT_RUN.fetch_add(1, Ordering::Relaxed)
        );
        let plan = Plan::new(scenario, &prefix);
        let steps = plan.steps();
        let mut network = Network {
            scenario: scenario.clone(),
            plan,
            created: Vec::new(),
            emulators: Vec::new(),
        };
        // On error, dropping `network` removes whatever was built.
        for step in steps {
            network.execute(step)?;
        }
        tracing::info!(scenario = scenario.name, "network up");
        Ok(network)
    }

    fn execute(&mut self, step: Step) -> Result<(), WanError> {
        match step {
            Step::CreateNamespace(region) => {
                let name = self.plan.regions[region].netns.clone();
                // A namespace of an earlier run of this very process id (the pid was
                // reused) is in the way: it is ours to replace.
                netns::delete_netns(&name)?;
                netns::run("ip", &["netns".into(), "add".into(), name.clone()])?;
                self.created.push(name);
                Ok(())
            }
            Step::Ip(args) => netns::run("ip", &args),
            Step::Tc(args) => netns::run("tc", &args),
            Step::Sysctls(region) => {
                let netns = self.plan.regions[region].netns.clone();
                let writes = spawn_in_netns(&netns, "wan sysctl".into(), write_sysctls)?;
                writes.join()?.map_err(|source| WanError::Io {
                    what: format!("setting sysctls in {netns}"),
                    source,
                })
            }
            Step::StartEmulator { link, end } => {
                let plan = &self.plan.links[link];
                let (from, to) = (&plan.ends[end], &plan.ends[1 - end]);
                let spec = EmulatorSpec {
                    label: format!(
                        "link {link} {}->{}",
                        self.plan.regions[from.region].name, self.plan.regions[to.region].name
                    ),
                    netns: self.plan.regions[from.region].netns.clone(),
                    tun: from.tun.clone(),
                    veth: from.veth.clone(),
                    local_mac: from.mac,
                    peer_mac: to.mac,
                    send_buffer_bytes: plan.send_buffer_bytes,
                    impairment: plan.impairments[end],
                };
                let emulator = Emulator::start(spec)?;
                self.emulators.push(DirectionEmulator {
                    link,
                    end,
                    emulator,
                });
                Ok(())
            }
        }
    }

    pub fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    fn region(&self, name: &str) -> Result<&crate::plan::RegionPlan, WanError> {
        self.plan
            .region_index(name)
            .map(|index| &self.plan.regions[index])
            .ok_or_else(|| WanError::UnknownRegion(name.to_string()))
    }

    /// The region's address: bind and connect to it from any region.
    pub fn address(&self, region: &str) -> Result<Ipv4Addr, WanError> {
        Ok(self.region(region)?.address)
    }

    /// The name of the region's network namespace (`ip netns exec NAME ...`).
    pub fn netns(&self, region: &str) -> Result<&str, WanError> {
        Ok(&self.region(region)?.netns)
    }

    /// A command that runs `program` inside the region's namespace, through
    /// `ip netns exec`; add arguments and run it as usual.
    pub fn command(&self, region: &str, program: &str) -> Result<Command, WanError> {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", self.netns(region)?, program]);
        Ok(command)
    }

    /// Runs `f` on a new thread inside the region's namespace. Sockets it creates
    /// (std, socket2, or tokio ones built from them) stay in that namespace, so a
    /// tokio runtime can be built on that thread, or the sockets handed elsewhere.
    pub fn spawn_in<F, T>(&self, region: &str, f: F) -> Result<NetnsThread<T>, WanError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let netns = self.netns(region)?;
        spawn_in_netns(netns, format!("wan {region}"), f)
    }

    /// [`Network::spawn_in`], then waits for the result.
    pub fn run_in<F, T>(&self, region: &str, f: F) -> Result<T, WanError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        self.spawn_in(region, f)?.join()
    }

    /// Packet counts of every emulated direction.
    pub fn counters(&self) -> Vec<DirectionCounters> {
        self.emulators
            .iter()
            .map(|direction| {
                let ends = &self.plan.links[direction.link].ends;
                let name = |end: usize| self.plan.regions[ends[end].region].name.clone();
                DirectionCounters {
                    link: direction.link,
                    from: name(direction.end),
                    to: name(1 - direction.end),
                    counters: direction.emulator.counters(),
                }
            })
            .collect()
    }

    /// Stops the emulators and deletes the namespaces; reports the first error after
    /// trying everything.
    pub fn down(mut self) -> Result<(), WanError> {
        self.tear_down()
    }

    fn tear_down(&mut self) -> Result<(), WanError> {
        let mut first_error = None;
        for mut direction in self.emulators.drain(..) {
            if let Err(error) = direction.emulator.stop() {
                tracing::warn!(?error, emulator = direction.emulator.label(), "stopping");
                first_error.get_or_insert(error);
            }
        }
        for name in self.created.drain(..).rev() {
            if let Err(error) = netns::delete_netns(&name) {
                tracing::warn!(?error, "deleting a namespace");
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // Errors were logged; a destructor has nobody to return them to.
        let _ = self.tear_down();
    }
}

fn write_sysctls() -> std::io::Result<()> {
    for (path, value) in NAMESPACE_SYSCTLS {
        let path = format!("/proc/sys/{path}");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|error| std::io::Error::new(error.kind(), format!("{path}: {error}")))?;
        file.write_all(value.as_bytes())
            .map_err(|error| std::io::Error::new(error.kind(), format!("{path}: {error}")))?;
    }
    Ok(())
}
