//! Scenario files: which regions exist and how links between them behave.
//!
//! A scenario is a TOML file (examples in `wan/scenarios/`):
//!
//! ```toml
//! name = "us-canada"
//! description = "One transcontinental link"
//! seed = 1                      # seeds every link's loss model (optional, default 0)
//!
//! [[regions]]
//! name = "us"
//! [[regions]]
//! name = "canada"
//!
//! [[links]]
//! between = ["us", "canada"]
//! rate_mbps = 1000              # each direction; absent: no rate limit
//! rtt_ms = 30                   # or delay_ms, the one-way delay; absent: no delay
//! loss = 0.001                  # probability that a packet is lost, each direction
//! loss_burst_packets = 3        # mean length of a loss burst (Gilbert-Elliott); absent: independent losses
//! queue_bytes = 3750000         # bottleneck queue; absent: one bandwidth-delay product
//! emulate = true                # false: a plain veth pair (only allowed without delay or loss)
//!
//! [sweep]                       # optional: the same scenario at each of these rates
//! rates_mbps = [250, 1000, 10000]
//! ```
//!
//! Every region must be reachable from every other one; traffic between regions that
//! share no link is forwarded along the path of least delay. Every size and count read
//! from a file is bounded by a `MAX_*` constant of this module.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::loss::LossModel;

/// Largest scenario file accepted.
pub const MAX_SCENARIO_BYTES: u64 = 1 << 20;
/// Most regions in one scenario (each is a network namespace with its own address).
pub const MAX_REGIONS: usize = 32;
/// Most links in one scenario.
pub const MAX_LINKS: usize = 128;
/// Longest region name; names become part of network namespace names.
pub const MAX_REGION_NAME_LEN: usize = 24;
/// Longest scenario name.
pub const MAX_SCENARIO_NAME_LEN: usize = 64;
/// Longest scenario description.
pub const MAX_DESCRIPTION_LEN: usize = 4096;
/// Fastest link rate accepted.
pub const MAX_RATE_MBPS: f64 = 100_000.0;
/// Longest one-way delay accepted.
pub const MAX_DELAY_MS: f64 = 10_000.0;
/// Largest bottleneck queue accepted.
pub const MAX_QUEUE_BYTES: u64 = 1 << 30;
/// Smallest bottleneck queue accepted: below a few packets TCP cannot work at all.
pub const MIN_QUEUE_BYTES: u64 = 16 * 1024;
/// Longest mean loss burst accepted.
pub const MAX_LOSS_BURST_PACKETS: f64 = 10_000.0;
/// Most rates in a sweep.
pub const MAX_SWEEP_POINTS: usize = 64;

/// A set of regions and the links between them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Seeds every link's loss model, so a run can be repeated packet for packet.
    #[serde(default)]
    pub seed: u64,
    pub regions: Vec<Region>,
    #[serde(default)]
    pub links: Vec<Link>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep: Option<Sweep>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Region {
    /// Lowercase letters, digits and `-`, starting with a letter.
    pub name: String,
}

/// A bidirectional link; both directions get the same rate, delay and loss.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub between: [String; 2],
    /// Rate of each direction in megabits per second; `None`: as fast as the machine goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_mbps: Option<f64>,
    /// Round-trip time added by the link (half in each direction).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rtt_ms: Option<f64>,
    /// One-way delay of each direction; an alternative to `rtt_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<f64>,
    /// Probability that a packet is lost, in each direction.
    #[serde(default)]
    pub loss: f64,
    /// Mean number of packets in a burst of losses; `None`: losses are independent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_burst_packets: Option<f64>,
    /// Bytes the bottleneck queue of each direction holds before it drops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_bytes: Option<u64>,
    /// Whether packets go through the userspace delay/loss emulator. `false` gives a
    /// plain veth pair (rate limit only), the baseline the emulator is measured against.
    #[serde(default = "emulate_by_default")]
    pub emulate: bool,
}

fn emulate_by_default() -> bool {
    true
}

/// Rates at which to repeat the scenario, replacing every link's rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sweep {
    pub rates_mbps: Vec<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("cannot read scenario {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("scenario {path} is larger than MAX_SCENARIO_BYTES ({MAX_SCENARIO_BYTES} bytes)")]
    TooLarge { path: PathBuf },
    #[error("scenario {origin} is not valid TOML for a scenario: {message}")]
    Syntax { origin: String, message: String },
    #[error("scenario {scenario:?}: {problem}")]
    Invalid { scenario: String, problem: String },
}

impl Scenario {
    /// Reads, parses and validates a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let read_error = |source| ScenarioError::Read {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(read_error)?;
        let mut text = String::new();
        file.take(MAX_SCENARIO_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(read_error)?;
        if text.len() as u64 > MAX_SCENARIO_BYTES {
            return Err(ScenarioError::TooLarge {
                path: path.to_path_buf(),
            });
        }
        Scenario::parse(&text, &path.display().to_string())
    }

    /// Parses and validates scenario text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Scenario, ScenarioError> {
        if text.len() as u64 > MAX_SCENARIO_BYTES {
            return Err(ScenarioError::TooLarge {
                path: PathBuf::from(origin),
            });
        }
        let scenario: Scenario = toml::from_str(text).map_err(|error| ScenarioError::Syntax {
            origin: origin.to_string(),
            message: error.to_string(),
        })?;
        scenario.validate()?;
        Ok(scenario)
    }

    /// Two regions `a` and `b` joined by `link`, whose `between` is overwritten.
    pub fn point_to_point(name: &str, link: Link) -> Scenario {
        let regions = ["a", "b"].map(|name| Region {
            name: name.to_string(),
        });
        Scenario {
            name: name.to_string(),
            description: String::new(),
            seed: 0,
            links: vec![Link {
                between: regions.clone().map(|region| region.name),
                ..link
            }],
            regions: regions.to_vec(),
            sweep: None,
        }
    }

    /// Checks every rule of the format; [`Scenario::load`] and [`Scenario::parse`] call
    /// it, and so does [`crate::Network::up`] for scenarios built in code.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        self.check().map_err(|problem| ScenarioError::Invalid {
            scenario: self.name.clone(),
            problem,
        })
    }

    fn check(&self) -> Result<(), String> {
        if self.name.is_empty() || self.name.len() > MAX_SCENARIO_NAME_LEN {
            return Err(format!(
                "the name must have 1 to MAX_SCENARIO_NAME_LEN ({MAX_SCENARIO_NAME_LEN}) bytes"
            ));
        }
        if self.description.len() > MAX_DESCRIPTION_LEN {
            return Err(format!(
                "the description is longer than MAX_DESCRIPTION_LEN ({MAX_DESCRIPTION_LEN}) bytes"
            ));
        }
        if self.regions.is_empty() || self.regions.len() > MAX_REGIONS {
            return Err(format!(
                "a scenario has 1 to MAX_REGIONS ({MAX_REGIONS}) regions, not {}",
                self.regions.len()
            ));
        }
        if self.links.len() > MAX_LINKS {
            return Err(format!(
                "{} links is more than MAX_LINKS ({MAX_LINKS})",
                self.links.len()
            ));
        }
        let mut names = BTreeSet::new();
        for region in &self.regions {
            check_region_name(&region.name)?;
            if !names.insert(region.name.as_str()) {
                return Err(format!("region {:?} is declared twice", region.name));
            }
        }
        let mut pairs = BTreeSet::new();
        for link in &self.links {
            let [a, b] = &link.between;
            for end in [a, b] {
                if !names.contains(end.as_str()) {
                    return Err(format!("link {a}-{b} names an unknown region {end:?}"));
                }
            }
            if a == b {
                return Err(format!("link {a}-{b} joins a region to itself"));
            }
            if !pairs.insert(if a < b { (a, b) } else { (b, a) }) {
                return Err(format!("regions {a} and {b} are joined by two links"));
            }
            link.check()
                .map_err(|problem| format!("link {a}-{b}: {problem}"))?;
        }
        if let Some(unreachable) = self.first_unreachable_region() {
            return Err(format!(
                "region {unreachable:?} cannot be reached from region {:?}",
                self.regions[0].name
            ));
        }
        if let Some(sweep) = &self.sweep {
            if sweep.rates_mbps.is_empty() || sweep.rates_mbps.len() > MAX_SWEEP_POINTS {
                return Err(format!(
                    "a sweep has 1 to MAX_SWEEP_POINTS ({MAX_SWEEP_POINTS}) rates, not {}",
                    sweep.rates_mbps.len()
                ));
            }
            for &rate in &sweep.rates_mbps {
                check_rate(rate).map_err(|problem| format!("sweep: {problem}"))?;
            }
        }
        Ok(())
    }

    fn first_unreachable_region(&self) -> Option<&str> {
        let mut reached = BTreeSet::from([self.regions[0].name.as_str()]);
        loop {
            let before = reached.len();
            for link in &self.links {
                let [a, b] = &link.between;
                if reached.contains(a.as_str()) || reached.contains(b.as_str()) {
                    reached.extend([a.as_str(), b.as_str()]);
                }
            }
            if reached.len() == before {
                break;
            }
        }
        self.regions
            .iter()
            .map(|region| region.name.as_str())
            .find(|name| !reached.contains(name))
    }

    /// Index of the region called `name`.
    pub fn region_index(&self, name: &str) -> Option<usize> {
        self.regions.iter().position(|region| region.name == name)
    }

    /// The scenario once per rate of its `[sweep]`, each named `NAME@RATEmbps` with
    /// every link at that rate and without the sweep; empty without a sweep.
    pub fn sweep_points(&self) -> Vec<Scenario> {
        let Some(sweep) = &self.sweep else {
            return Vec::new();
        };
        sweep
            .rates_mbps
            .iter()
            .map(|&rate_mbps| {
                let mut point = self.clone();
                point.name = format!("{}@{rate_mbps}mbps", self.name);
                point.sweep = None;
                for link in &mut point.links {
                    link.rate_mbps = Some(rate_mbps);
                }
                point
            })
            .collect()
    }

    /// Every rate (links and sweep) multiplied by `factor`, for a machine that cannot
    /// sustain the scenario's rates: the proportions between links stay the same.
    pub fn scale_rates(&self, factor: f64) -> Result<Scenario, ScenarioError> {
        let mut scaled = self.clone();
        for link in &mut scaled.links {
            link.rate_mbps = link.rate_mbps.map(|rate| rate * factor);
        }
        if let Some(sweep) = &mut scaled.sweep {
            for rate in &mut sweep.rates_mbps {
                *rate *= factor;
            }
        }
        scaled.validate()?;
        Ok(scaled)
    }
}

fn check_region_name(name: &str) -> Result<(), String> {
    let well_formed = name.len() <= MAX_REGION_NAME_LEN
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if well_formed {
        Ok(())
    } else {
        Err(format!(
            "region name {name:?} must be 1 to MAX_REGION_NAME_LEN ({MAX_REGION_NAME_LEN}) \
             lowercase letters, digits or '-', starting with a letter"
        ))
    }
}

fn check_rate(rate_mbps: f64) -> Result<(), String> {
    if rate_mbps.is_finite() && rate_mbps > 0.0 && rate_mbps <= MAX_RATE_MBPS {
        Ok(())
    } else {
        Err(format!(
            "rate {rate_mbps} Mbps is not in (0, MAX_RATE_MBPS = {MAX_RATE_MBPS}]"
        ))
    }
}

impl Link {
    /// A link between `a` and `b` with no rate limit, delay or loss, through the emulator.
    pub fn new(a: &str, b: &str) -> Link {
        Link {
            between: [a.to_string(), b.to_string()],
            rate_mbps: None,
            rtt_ms: None,
            delay_ms: None,
            loss: 0.0,
            loss_burst_packets: None,
            queue_bytes: None,
            emulate: true,
        }
    }

    fn check(&self) -> Result<(), String> {
        if let Some(rate) = self.rate_mbps {
            check_rate(rate)?;
        }
        if self.rtt_ms.is_some() && self.delay_ms.is_some() {
            return Err("give rtt_ms or delay_ms, not both".to_string());
        }
        let one_way_ms = self.one_way_delay_ms();
        if !(one_way_ms.is_finite() && (0.0..=MAX_DELAY_MS).contains(&one_way_ms)) {
            return Err(format!(
                "one-way delay {one_way_ms} ms is not in [0, MAX_DELAY_MS = {MAX_DELAY_MS}]"
            ));
        }
        if !(0.0..=1.0).contains(&self.loss) {
            return Err(format!("loss {} is not a probability", self.loss));
        }
        if let Some(burst) = self.loss_burst_packets
            && !(burst.is_finite() && (1.0..=MAX_LOSS_BURST_PACKETS).contains(&burst))
        {
            return Err(format!(
                "loss_burst_packets {burst} is not in [1, MAX_LOSS_BURST_PACKETS = \
                 {MAX_LOSS_BURST_PACKETS}]"
            ));
        }
        self.loss_model()?;
        if let Some(queue) = self.queue_bytes
            && !(MIN_QUEUE_BYTES..=MAX_QUEUE_BYTES).contains(&queue)
        {
            return Err(format!(
                "queue_bytes {queue} is not in [MIN_QUEUE_BYTES = {MIN_QUEUE_BYTES}, \
                 MAX_QUEUE_BYTES = {MAX_QUEUE_BYTES}]"
            ));
        }
        if self.queue_bytes.is_some() && self.rate_mbps.is_none() {
            return Err("queue_bytes needs a rate_mbps: only a rate limit queues".to_string());
        }
        if !self.emulate && (one_way_ms > 0.0 || self.loss > 0.0) {
            return Err("delay and loss need the emulator (emulate = true)".to_string());
        }
        Ok(())
    }

    fn one_way_delay_ms(&self) -> f64 {
        match (self.rtt_ms, self.delay_ms) {
            (Some(rtt), _) => rtt / 2.0,
            (None, Some(delay)) => delay,
            (None, None) => 0.0,
        }
    }

    /// The delay each direction adds.
    pub fn one_way_delay(&self) -> Duration {
        Duration::from_secs_f64(self.one_way_delay_ms() / 1000.0)
    }

    /// The loss model of each direction.
    pub fn loss_model(&self) -> Result<LossModel, String> {
        match self.loss_burst_packets {
            None => Ok(LossModel::bernoulli(self.loss)),
            Some(burst) => LossModel::bursty(self.loss, burst),
        }
    }

    /// Rate of each direction in bits per second, if limited.
    pub fn rate_bits_per_s(&self) -> Option<u64> {
        self.rate_mbps.map(|rate| (rate * 1e6).round() as u64)
    }

    /// The bottleneck queue: as configured, else one bandwidth-delay product (the
    /// classic buffer size rule), never below `MIN_QUEUE_BYTES`; `None` without a rate.
    pub fn queue_bytes(&self) -> Option<u64> {
        let rate_bits_per_s = self.rate_bits_per_s()?;
        Some(self.queue_bytes.unwrap_or_else(|| {
            let rtt_s = 2.0 * self.one_way_delay().as_secs_f64();
            ((rate_bits_per_s as f64 / 8.0 * rtt_s) as u64).clamp(MIN_QUEUE_BYTES, MAX_QUEUE_BYTES)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_REGIONS: &str = r#"
        name = "t"
        [[regions]]
        name = "a"
        [[regions]]
        name = "b"
        [[links]]
        between = ["a", "b"]
        rate_mbps = 1000
        rtt_ms = 30
        loss = 0.001
    "#;

    fn parse(text: &str) -> Result<Scenario, ScenarioError> {
        Scenario::parse(text, "test")
    }

    /// Asserts that `text` is refused with an error mentioning `needle`.
    fn check_refused(text: &str, needle: &str) {
        match parse(text) {
            Ok(scenario) => panic!("accepted {scenario:?}, wanted an error about {needle:?}"),
            Err(error) => {
                let message = error.to_string();
                assert!(message.contains(needle), "{message:?} lacks {needle:?}");
            }
        }
    }

    fn with_link_field(field: &str) -> String {
        format!("{TWO_REGIONS}\n{field}\n")
    }

    #[test]
    fn parses_a_link_with_every_field_derived() {
        let scenario = parse(TWO_REGIONS).unwrap();
        let link = &scenario.links[0];
        assert_eq!(link.one_way_delay(), Duration::from_millis(15));
        assert_eq!(link.rate_bits_per_s(), Some(1_000_000_000));
        // 1 Gbps x 30 ms.
        assert_eq!(link.queue_bytes(), Some(3_750_000));
        assert!(link.emulate);
        assert_eq!(link.loss_model().unwrap(), LossModel::bernoulli(0.001));
    }

    #[test]
    fn one_way_delay_may_be_given_instead_of_rtt() {
        let text = TWO_REGIONS.replace("rtt_ms = 30", "delay_ms = 7.5");
        assert_eq!(
            parse(&text).unwrap().links[0].one_way_delay(),
            Duration::from_micros(7500)
        );
        check_refused(&with_link_field("delay_ms = 2"), "not both");
    }

    #[test]
    fn refuses_malformed_toml_and_unknown_fields() {
        check_refused("name = ", "not valid TOML");
        check_refused(&with_link_field("jitter_ms = 2"), "jitter_ms");
    }

    #[test]
    fn refuses_inconsistent_topologies() {
        check_refused(
            &TWO_REGIONS.replace("between = [\"a\", \"b\"]", "between = [\"a\", \"c\"]"),
            "unknown region \"c\"",
        );
        check_refused(
            &TWO_REGIONS.replace("between = [\"a\", \"b\"]", "between = [\"a\", \"a\"]"),
            "to itself",
        );
        check_refused(
            &format!("{TWO_REGIONS}\n[[links]]\nbetween = [\"b\", \"a\"]\n"),
            "two links",
        );
        check_refused(
            &format!("{TWO_REGIONS}\n[[regions]]\nname = \"c\"\n"),
            "\"c\" cannot be reached",
        );
        check_refused(
            &TWO_REGIONS.replace("name = \"b\"", "name = \"a\""),
            "declared twice",
        );
        check_refused("name = \"t\"\nregions = []\n", "MAX_REGIONS");
    }

    #[test]
    fn refuses_region_names_that_cannot_name_a_namespace() {
        for bad in [
            "A",
            "1a",
            "a_b",
            "a/b",
            "",
            &"a".repeat(MAX_REGION_NAME_LEN + 1),
        ] {
            check_refused(
                &TWO_REGIONS.replace("name = \"b\"", &format!("name = {bad:?}")),
                "MAX_REGION_NAME_LEN",
            );
        }
        let longest = "b".repeat(MAX_REGION_NAME_LEN);
        let text = TWO_REGIONS.replace("\"b\"", &format!("{longest:?}"));
        assert!(parse(&text).is_ok());
    }

    #[test]
    fn every_limit_is_enforced() {
        check_refused(
            &TWO_REGIONS.replace("rate_mbps = 1000", "rate_mbps = 100001"),
            "MAX_RATE_MBPS",
        );
        check_refused(
            &TWO_REGIONS.replace("rate_mbps = 1000", "rate_mbps = 0"),
            "MAX_RATE_MBPS",
        );
        check_refused(
            &TWO_REGIONS.replace("rate_mbps = 1000", "rate_mbps = nan"),
            "MAX_RATE_MBPS",
        );
        check_refused(
            &TWO_REGIONS.replace("rtt_ms = 30", "rtt_ms = 20002"),
            "MAX_DELAY_MS",
        );
        check_refused(
            &TWO_REGIONS.replace("rtt_ms = 30", "rtt_ms = -1"),
            "MAX_DELAY_MS",
        );
        assert!(parse(&TWO_REGIONS.replace("rtt_ms = 30", "rtt_ms = 20000")).is_ok());
        check_refused(
            &TWO_REGIONS.replace("loss = 0.001", "loss = 1.5"),
            "not a probability",
        );
        check_refused(
            &with_link_field(&format!("queue_bytes = {}", MAX_QUEUE_BYTES + 1)),
            "MAX_QUEUE_BYTES",
        );
        check_refused(
            &with_link_field(&format!("queue_bytes = {}", MIN_QUEUE_BYTES - 1)),
            "MIN_QUEUE_BYTES",
        );
        check_refused(
            &with_link_field("loss_burst_packets = 10001"),
            "MAX_LOSS_BURST_PACKETS",
        );
        check_refused(
            &with_link_field("loss_burst_packets = 0.5"),
            "MAX_LOSS_BURST_PACKETS",
        );
        check_refused(
            &format!("{TWO_REGIONS}\n[sweep]\nrates_mbps = []\n"),
            "MAX_SWEEP_POINTS",
        );
        let too_many = vec!["1"; MAX_SWEEP_POINTS + 1].join(", ");
        check_refused(
            &format!("{TWO_REGIONS}\n[sweep]\nrates_mbps = [{too_many}]\n"),
            "MAX_SWEEP_POINTS",
        );
        check_refused(
            &TWO_REGIONS.replace("name = \"t\"", &format!("name = {:?}", "n".repeat(65))),
            "MAX_SCENARIO_NAME_LEN",
        );
        check_refused(
            &format!(
                "description = {:?}\n{TWO_REGIONS}",
                "d".repeat(MAX_DESCRIPTION_LEN + 1)
            ),
            "MAX_DESCRIPTION_LEN",
        );
    }

    #[test]
    fn counts_are_bounded() {
        let regions: String = (0..=MAX_REGIONS)
            .map(|i| format!("[[regions]]\nname = \"r{i}\"\n"))
            .collect();
        check_refused(&format!("name = \"t\"\n{regions}"), "MAX_REGIONS");

        // A star of MAX_REGIONS regions has MAX_REGIONS - 1 links; make it a full
        // graph on enough regions to exceed MAX_LINKS.
        let size = 17;
        let regions: String = (0..size)
            .map(|i| format!("[[regions]]\nname = \"r{i}\"\n"))
            .collect();
        let links: String = (0..size)
            .flat_map(|i| ((i + 1)..size).map(move |j| (i, j)))
            .map(|(i, j)| format!("[[links]]\nbetween = [\"r{i}\", \"r{j}\"]\n"))
            .collect();
        assert!(size * (size - 1) / 2 > MAX_LINKS);
        check_refused(&format!("name = \"t\"\n{regions}{links}"), "MAX_LINKS");
    }

    #[test]
    fn plain_veth_links_cannot_delay_or_lose() {
        let text = TWO_REGIONS.replace("rate_mbps = 1000", "rate_mbps = 1000\nemulate = false");
        check_refused(&text, "need the emulator");
        let plain = "name = \"t\"\n[[regions]]\nname = \"a\"\n[[regions]]\nname = \"b\"\n\
                     [[links]]\nbetween = [\"a\", \"b\"]\nemulate = false\n";
        assert!(!parse(plain).unwrap().links[0].emulate);
    }

    #[test]
    fn queue_needs_a_rate_and_defaults_to_a_floor() {
        let no_rate = TWO_REGIONS.replace("rate_mbps = 1000", "queue_bytes = 100000");
        check_refused(&no_rate, "needs a rate_mbps");
        let slow_and_near = TWO_REGIONS
            .replace("rate_mbps = 1000", "rate_mbps = 1")
            .replace("rtt_ms = 30", "rtt_ms = 1");
        assert_eq!(
            parse(&slow_and_near).unwrap().links[0].queue_bytes(),
            Some(MIN_QUEUE_BYTES)
        );
    }

    #[test]
    fn load_bounds_the_file_size() {
        let directory = std::env::temp_dir().join(format!("aurora-wan-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let path = directory.join("big.toml");
        let padding = "#".repeat(MAX_SCENARIO_BYTES as usize);
        std::fs::write(&path, format!("{TWO_REGIONS}\n{padding}")).unwrap();
        let error = Scenario::load(&path).unwrap_err();
        assert!(matches!(error, ScenarioError::TooLarge { .. }), "{error}");
        assert!(error.to_string().contains("MAX_SCENARIO_BYTES"));

        std::fs::write(&path, TWO_REGIONS).unwrap();
        assert_eq!(Scenario::load(&path).unwrap(), parse(TWO_REGIONS).unwrap());
        let missing = Scenario::load(&directory.join("missing.toml")).unwrap_err();
        assert!(missing.to_string().contains("missing.toml"), "{missing}");
        std::fs::remove_dir_all(&directory).unwrap();
    }

    #[test]
    fn sweep_points_replace_every_rate() {
        let text = format!("{TWO_REGIONS}\n[sweep]\nrates_mbps = [250, 10000]\n");
        let points = parse(&text).unwrap().sweep_points();
        let rates: Vec<_> = points.iter().map(|p| p.links[0].rate_mbps).collect();
        assert_eq!(rates, [Some(250.0), Some(10000.0)]);
        assert_eq!(points[0].name, "t@250mbps");
        assert!(
            points
                .iter()
                .all(|p| p.sweep.is_none() && p.validate().is_ok())
        );
        assert!(parse(TWO_REGIONS).unwrap().sweep_points().is_empty());
    }

    #[test]
    fn scaling_keeps_proportions_and_revalidates() {
        let text = format!("{TWO_REGIONS}\n[sweep]\nrates_mbps = [250, 10000]\n");
        let scaled = parse(&text).unwrap().scale_rates(0.5).unwrap();
        assert_eq!(scaled.links[0].rate_mbps, Some(500.0));
        assert_eq!(scaled.sweep.unwrap().rates_mbps, [125.0, 5000.0]);
        let error = parse(TWO_REGIONS).unwrap().scale_rates(1000.0).unwrap_err();
        assert!(error.to_string().contains("MAX_RATE_MBPS"), "{error}");
    }

    #[test]
    fn point_to_point_is_valid_and_round_trips_through_toml() {
        let mut link = Link::new("x", "y");
        link.rtt_ms = Some(50.0);
        link.loss = 0.001;
        let scenario = Scenario::point_to_point("p", link);
        scenario.validate().unwrap();
        assert_eq!(scenario.links[0].between, ["a", "b"]);
        let text = toml::to_string(&scenario).unwrap();
        assert_eq!(parse(&text).unwrap(), scenario);
    }

    #[test]
    fn shipped_scenarios_are_valid() {
        let directory = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../wan/scenarios");
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&directory).unwrap() {
            let path = entry.unwrap().path();
            let scenario = Scenario::load(&path).unwrap_or_else(|e| panic!("{e}"));
            names.push(scenario.name);
        }
        names.sort();
        assert_eq!(
            names,
            [
                "bandwidth-sweep",
                "four-regions",
                "lossy-50ms",
                "paper-testbed",
                "two-regions",
                "us-canada"
            ]
        );
    }
}
