//! From a scenario to the exact steps that build it: names, addresses, MAC addresses,
//! routes, rate limiter parameters and emulator settings. Pure, so the whole layout is
//! unit-tested without root; [`crate::Network::up`] only executes the steps in order.
//!
//! Addresses come from 198.18.0.0/15, the range reserved for benchmarking networks
//! (RFC 2544), so they can never be confused with a real network: region `r` (in
//! scenario order) is `198.18.0.(r+1)`, held on its loopback device so it stays
//! reachable whichever link a packet comes in on; link `l` is the subnet
//! `198.19.l.0/30`. Inside each namespace, link `l`'s veth end is `wvL` and its TUN
//! device `wtL`. Each region routes every other region's address along the path of
//! least delay (then fewest hops): into `wtL` for an emulated link, whose emulator
//! sends it out of `wvL`; straight out of `wvL` for a plain one.

use std::net::Ipv4Addr;
use std::time::Duration;

use crate::impair::ImpairmentConfig;
use crate::scenario::{MAX_LINKS, MAX_REGIONS, Scenario};

/// Each namespace's kernel settings, as paths under `/proc/sys` and their values: no
/// IPv6 (no neighbour discovery chatter through the emulator), forwarding (regions
/// may relay between links), no reverse-path filter (a packet may come back on another
/// device than the one its reply leaves by), socket buffers large enough for a 10 Gbps,
/// 100 ms path, and no cached ssthresh carried from one measurement to the next.
pub const NAMESPACE_SYSCTLS: [(&str, &str); 8] = [
    ("net/ipv6/conf/all/disable_ipv6", "1"),
    ("net/ipv6/conf/default/disable_ipv6", "1"),
    ("net/ipv4/ip_forward", "1"),
    ("net/ipv4/conf/all/rp_filter", "0"),
    ("net/ipv4/conf/default/rp_filter", "0"),
    ("net/ipv4/tcp_rmem", "4096 131072 268435456"),
    ("net/ipv4/tcp_wmem", "4096 16384 268435456"),
    ("net/ipv4/tcp_no_metrics_save", "1"),
];

/// Frames a TUN device holds for its emulator; the kernel drops beyond it. Enough for
/// what piles up between two reads, small enough that an emulator running at its
/// limit does not add seconds of queueing (a frame may be a 64 KiB super-packet).
pub const TUN_QUEUE_PACKETS: u32 = 1_000;
/// Largest delay line, for a link without a rate limit.
pub const MAX_DELAY_LINE_BYTES: usize = 256 << 20;
/// Smallest delay line.
pub const MIN_DELAY_LINE_BYTES: usize = 4 << 20;
/// A token bucket must pass a whole 64 KiB TCP super-packet (with the headers of each
/// of its segments) at once: a smaller one makes tbf cut the super-packet and drop
/// parts of it, which the emulator cannot count. Below 786 Mbps this is more than the
/// 1 ms burst of the rate, so a link idle for a while may send up to this much at once.
pub const MIN_BURST_BYTES: u64 = 96 * 1024;

const _: () = assert!(MAX_REGIONS < 255 && MAX_LINKS < 256);

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub regions: Vec<RegionPlan>,
    pub links: Vec<LinkPlan>,
    pub routes: Vec<RoutePlan>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RegionPlan {
    pub name: String,
    pub netns: String,
    pub address: Ipv4Addr,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LinkPlan {
    pub ends: [LinkEnd; 2],
    pub emulated: bool,
    pub rate: Option<RateLimit>,
    /// One per direction: `impairments[e]` applies to what end `e` sends.
    pub impairments: [ImpairmentConfig; 2],
    pub send_buffer_bytes: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LinkEnd {
    pub region: usize,
    pub veth: String,
    pub tun: String,
    pub address: Ipv4Addr,
    pub mac: [u8; 6],
}

/// A tbf on each veth end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub bits_per_s: u64,
    pub burst_bytes: u64,
    pub queue_bytes: u64,
}

/// Region `region` reaches region `destination` through end `end` of link `link`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutePlan {
    pub region: usize,
    pub destination: usize,
    pub link: usize,
    pub end: usize,
}

/// One bring-up step, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Create region `r`'s namespace, replacing a leftover of the same name.
    CreateNamespace(usize),
    Ip(Vec<String>),
    Tc(Vec<String>),
    /// Write [`NAMESPACE_SYSCTLS`] inside region `r`'s namespace.
    Sysctls(usize),
    /// Start the emulator of what `end` of `link` sends; creates its TUN device.
    StartEmulator {
        link: usize,
        end: usize,
    },
}

fn args(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|part| part.to_string()).collect()
}

pub fn format_mac(mac: [u8; 6]) -> String {
    mac.map(|byte| format!("{byte:02x}")).join(":")
}

impl Plan {
    /// Lays out a valid scenario; namespaces are named `netns_prefix` + region name.
    pub fn new(scenario: &Scenario, netns_prefix: &str) -> Plan {
        let regions: Vec<RegionPlan> = scenario
            .regions
            .iter()
            .enumerate()
            .map(|(index, region)| RegionPlan {
                name: region.name.clone(),
                netns: format!("{netns_prefix}{}", region.name),
                address: Ipv4Addr::new(198, 18, 0, index as u8 + 1),
            })
            .collect();
        let links: Vec<LinkPlan> = scenario
            .links
            .iter()
            .enumerate()
            .map(|(index, link)| {
                let end = |side: usize| LinkEnd {
                    region: scenario
                        .region_index(&link.between[side])
                        .expect("a validated scenario names only its regions"),
                    veth: format!("wv{index}"),
                    tun: format!("wt{index}"),
                    address: Ipv4Addr::new(198, 19, index as u8, side as u8 + 1),
                    mac: [0x02, 0x61, 0x77, 0x00, index as u8, side as u8 + 1],
                };
                let rate = link.rate_bits_per_s().map(|bits_per_s| RateLimit {
                    bits_per_s,
                    burst_bytes: (bits_per_s / 8 / 1000).max(MIN_BURST_BYTES),
                    queue_bytes: link.queue_bytes().expect("a rate has a queue"),
                });
                let delay = link.one_way_delay();
                let impairment = |side: usize| ImpairmentConfig {
                    delay,
                    loss: link
                        .loss_model()
                        .expect("a validated link has a loss model"),
                    seed: direction_seed(scenario.seed, index, side),
                    delay_line_bytes: delay_line_bytes(rate, delay),
                };
                LinkPlan {
                    ends: [end(0), end(1)],
                    emulated: link.emulate,
                    rate,
                    impairments: [impairment(0), impairment(1)],
                    // Every packet queued at the rate limiter is charged to the
                    // emulator's socket, at up to twice its size.
                    send_buffer_bytes: rate.map_or(0, |rate| 2 * rate.queue_bytes as usize)
                        + MIN_DELAY_LINE_BYTES,
                }
            })
            .collect();
        let routes = routes(regions.len(), &links);
        Plan {
            regions,
            links,
            routes,
        }
    }

    /// Every step of the bring-up, in order.
    pub fn steps(&self) -> Vec<Step> {
        let mut steps = Vec::new();
        for (index, region) in self.regions.iter().enumerate() {
            let ns = region.netns.as_str();
            steps.push(Step::CreateNamespace(index));
            steps.push(Step::Sysctls(index));
            steps.push(Step::Ip(args(&["-n", ns, "link", "set", "lo", "up"])));
            let address = format!("{}/32", region.address);
            steps.push(Step::Ip(args(&[
                "-n", ns, "addr", "add", &address, "dev", "lo",
            ])));
        }
        for (index, link) in self.links.iter().enumerate() {
            let [a, b] = &link.ends;
            steps.push(Step::Ip(args(&[
                "-n",
                &self.regions[a.region].netns,
                "link",
                "add",
                &a.veth,
                "address",
                &format_mac(a.mac),
                "type",
                "veth",
                "peer",
                "name",
                &b.veth,
                "address",
                &format_mac(b.mac),
                "netns",
                &self.regions[b.region].netns,
            ])));
            for (side, end) in link.ends.iter().enumerate() {
                let ns = self.regions[end.region].netns.as_str();
                let address = format!("{}/30", end.address);
                steps.push(Step::Ip(args(&[
                    "-n", ns, "addr", "add", &address, "dev", &end.veth,
                ])));
                steps.push(Step::Ip(args(&["-n", ns, "link", "set", &end.veth, "up"])));
                if let Some(rate) = link.rate {
                    steps.push(Step::Tc(args(&[
                        "-n",
                        ns,
                        "qdisc",
                        "replace",
                        "dev",
                        &end.veth,
                        "root",
                        "tbf",
                        "rate",
                        &format!("{}bit", rate.bits_per_s),
                        "burst",
                        &rate.burst_bytes.to_string(),
                        "limit",
                        &rate.queue_bytes.to_string(),
                    ])));
                }
                if link.emulated {
                    steps.push(Step::StartEmulator {
                        link: index,
                        end: side,
                    });
                    steps.push(Step::Ip(args(&[
                        "-n",
                        ns,
                        "link",
                        "set",
                        &end.tun,
                        "txqueuelen",
                        &TUN_QUEUE_PACKETS.to_string(),
                        "up",
                    ])));
                }
            }
        }
        for route in &self.routes {
            let region = &self.regions[route.region];
            let link = &self.links[route.link];
            let end = &link.ends[route.end];
            let destination = format!("{}/32", self.regions[route.destination].address);
            let source = region.address.to_string();
            let mut command = args(&["-n", &region.netns, "route", "add", &destination]);
            if link.emulated {
                command.extend(args(&["dev", &end.tun]));
            } else {
                let peer = link.ends[1 - route.end].address.to_string();
                command.extend(args(&["via", &peer, "dev", &end.veth]));
            }
            command.extend(args(&["src", &source]));
            steps.push(Step::Ip(command));
        }
        steps
    }

    pub fn region_index(&self, name: &str) -> Option<usize> {
        self.regions.iter().position(|region| region.name == name)
    }
}

/// Distinct, reproducible loss seeds for every direction of every link.
fn direction_seed(seed: u64, link: usize, end: usize) -> u64 {
    seed ^ ((link as u64) << 1 | end as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// What a direction can have in flight during its delay, four times over (slow start
/// doubles the rate each round trip and BBR's startup sends at 2.89 times it before a
/// loss or a full pipe is noticed), plus its queue; without a rate limit, the largest
/// line.
fn delay_line_bytes(rate: Option<RateLimit>, delay: Duration) -> usize {
    let Some(rate) = rate else {
        return MAX_DELAY_LINE_BYTES;
    };
    let in_flight = rate.bits_per_s as f64 / 8.0 * delay.as_secs_f64();
    ((4.0 * in_flight) as usize + rate.queue_bytes as usize)
        .clamp(MIN_DELAY_LINE_BYTES, MAX_DELAY_LINE_BYTES)
}

/// For every ordered pair of regions, the first link of the least-delay path (fewest
/// hops among equals, lowest link index among those): Dijkstra from each region.
fn routes(region_count: usize, links: &[LinkPlan]) -> Vec<RoutePlan> {
    let mut routes = Vec::new();
    for source in 0..region_count {
        // (delay, hops, first link and its end at the source) per region.
        let mut best: Vec<Option<(Duration, usize, usize, usize)>> = vec![None; region_count];
        let mut settled = vec![false; region_count];
        best[source] = Some((Duration::ZERO, 0, usize::MAX, usize::MAX));
        while let Some(current) = (0..region_count)
            .filter(|&r| !settled[r] && best[r].is_some())
            .min_by_key(|&r| best[r].map(|(delay, hops, ..)| (delay, hops)))
        {
            settled[current] = true;
            let (delay, hops, first_link, first_end) = best[current].expect("filtered");
            for (index, link) in links.iter().enumerate() {
                for side in 0..2 {
                    if link.ends[side].region != current {
                        continue;
                    }
                    let next = link.ends[1 - side].region;
                    let candidate = (
                        delay + link.impairments[side].delay,
                        hops + 1,
                        if current == source { index } else { first_link },
                        if current == source { side } else { first_end },
                    );
                    let better = match best[next] {
                        None => true,
                        Some((d, h, ..)) => (candidate.0, candidate.1) < (d, h),
                    };
                    if !settled[next] && better {
                        best[next] = Some(candidate);
                    }
                }
            }
        }
        for (destination, entry) in best.iter().enumerate() {
            if let Some((_, _, link, end)) = *entry
                && destination != source
            {
                routes.push(RoutePlan {
                    region: source,
                    destination,
                    link,
                    end,
                });
            }
        }
    }
    routes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::LossModel;
    use crate::scenario::Link;

    fn star() -> Scenario {
        Scenario::parse(
            r#"
            name = "star"
            seed = 9
            [[regions]]
            name = "hub"
            [[regions]]
            name = "near"
            [[regions]]
            name = "far"
            [[links]]
            between = ["hub", "near"]
            rate_mbps = 1000
            rtt_ms = 20
            loss = 0.001
            [[links]]
            between = ["far", "hub"]
            rate_mbps = 100
            delay_ms = 100
            "#,
            "test",
        )
        .unwrap()
    }

    fn find_step<'a>(steps: &'a [Step], needle: &[&str]) -> &'a Step {
        steps
            .iter()
            .find(|step| match step {
                Step::Ip(words) | Step::Tc(words) => {
                    needle.iter().all(|n| words.contains(&n.to_string()))
                }
                _ => false,
            })
            .unwrap_or_else(|| panic!("no step with {needle:?} in {steps:#?}"))
    }

    #[test]
    fn lays_out_names_addresses_and_macs() {
        let plan = Plan::new(&star(), "aurora-wan-1-0-");
        let names: Vec<_> = plan
            .regions
            .iter()
            .map(|r| (&r.netns[..], r.address))
            .collect();
        assert_eq!(
            names,
            [
                ("aurora-wan-1-0-hub", Ipv4Addr::new(198, 18, 0, 1)),
                ("aurora-wan-1-0-near", Ipv4Addr::new(198, 18, 0, 2)),
                ("aurora-wan-1-0-far", Ipv4Addr::new(198, 18, 0, 3)),
            ]
        );
        let far_link = &plan.links[1];
        assert_eq!(
            far_link.ends[0],
            LinkEnd {
                region: 2,
                veth: "wv1".into(),
                tun: "wt1".into(),
                address: Ipv4Addr::new(198, 19, 1, 1),
                mac: [0x02, 0x61, 0x77, 0x00, 1, 1],
            }
        );
        assert_eq!(far_link.ends[1].region, 0);
        assert_eq!(format_mac(far_link.ends[1].mac), "02:61:77:00:01:02");
    }

    #[test]
    fn derives_rate_limits_and_impairments() {
        let plan = Plan::new(&star(), "p-");
        let near = &plan.links[0];
        assert_eq!(
            near.rate,
            Some(RateLimit {
                bits_per_s: 1_000_000_000,
                burst_bytes: 125_000,
                queue_bytes: 2_500_000,
            })
        );
        let [to_near, from_near] = near.impairments;
        assert_eq!(to_near.delay, Duration::from_millis(10));
        assert_eq!(to_near.loss, LossModel::bernoulli(0.001));
        assert_ne!(to_near.seed, from_near.seed);
        assert_ne!(to_near.seed, plan.links[1].impairments[0].seed);
        // 4 x 1.25 MB in flight during 10 ms, plus the queue.
        assert_eq!(to_near.delay_line_bytes, 4 * 1_250_000 + 2_500_000);
        assert_eq!(near.send_buffer_bytes, 2 * 2_500_000 + MIN_DELAY_LINE_BYTES);
        // The same scenario gives the same seeds; another scenario seed, others.
        assert_eq!(Plan::new(&star(), "q-").links, plan.links);
        let mut reseeded = star();
        reseeded.seed = 10;
        assert_ne!(
            Plan::new(&reseeded, "p-").links[0].impairments,
            near.impairments
        );
    }

    #[test]
    fn slow_links_still_get_a_usable_bucket_and_line() {
        let mut link = Link::new("a", "b");
        link.rate_mbps = Some(1.0);
        let plan = Plan::new(&Scenario::point_to_point("slow", link), "p-");
        let rate = plan.links[0].rate.unwrap();
        assert_eq!(rate.burst_bytes, MIN_BURST_BYTES);
        assert_eq!(
            plan.links[0].impairments[0].delay_line_bytes,
            MIN_DELAY_LINE_BYTES
        );
        let unlimited = Plan::new(&Scenario::point_to_point("u", Link::new("a", "b")), "p-");
        assert_eq!(unlimited.links[0].rate, None);
        assert_eq!(
            unlimited.links[0].impairments[0].delay_line_bytes,
            MAX_DELAY_LINE_BYTES
        );
    }

    #[test]
    fn routes_through_the_hub_and_along_least_delay() {
        let plan = Plan::new(&star(), "p-");
        let route = |from: usize, to: usize| {
            plan.routes
                .iter()
                .find(|r| r.region == from && r.destination == to)
                .map(|r| (r.link, r.end))
                .unwrap()
        };
        assert_eq!(plan.routes.len(), 6);
        assert_eq!(route(1, 2), (0, 1), "near reaches far through the hub");
        assert_eq!(route(2, 1), (1, 0));
        assert_eq!(route(0, 2), (1, 1));

        // A triangle whose direct link is slower than the two-hop detour.
        let mut scenario = star();
        let mut direct = Link::new("near", "far");
        direct.delay_ms = Some(500.0);
        scenario.links.push(direct);
        scenario.validate().unwrap();
        let plan = Plan::new(&scenario, "p-");
        let near_to_far = plan
            .routes
            .iter()
            .find(|r| r.region == 1 && r.destination == 2);
        assert_eq!(near_to_far.map(|r| r.link), Some(0));
        scenario.links[2].delay_ms = Some(1.0);
        let plan = Plan::new(&scenario, "p-");
        let near_to_far = plan
            .routes
            .iter()
            .find(|r| r.region == 1 && r.destination == 2);
        assert_eq!(near_to_far.map(|r| r.link), Some(2));
    }

    #[test]
    fn steps_build_regions_before_links_and_routes_last() {
        let plan = Plan::new(&star(), "p-");
        let steps = plan.steps();
        assert_eq!(steps[0], Step::CreateNamespace(0));
        assert_eq!(steps[1], Step::Sysctls(0));
        assert_eq!(
            find_step(&steps, &["p-near", "addr", "198.18.0.2/32"]),
            &Step::Ip(args(&[
                "-n",
                "p-near",
                "addr",
                "add",
                "198.18.0.2/32",
                "dev",
                "lo"
            ]))
        );
        assert_eq!(
            find_step(&steps, &["p-far", "tbf"]),
            &Step::Tc(args(&[
                "-n",
                "p-far",
                "qdisc",
                "replace",
                "dev",
                "wv1",
                "root",
                "tbf",
                "rate",
                "100000000bit",
                "burst",
                "98304",
                "limit",
                "2500000",
            ]))
        );
        assert_eq!(
            find_step(&steps, &["p-hub", "route", "198.18.0.3/32"]),
            &Step::Ip(args(&[
                "-n",
                "p-hub",
                "route",
                "add",
                "198.18.0.3/32",
                "dev",
                "wt1",
                "src",
                "198.18.0.1",
            ]))
        );
        let emulators = steps
            .iter()
            .filter(|s| matches!(s, Step::StartEmulator { .. }))
            .count();
        assert_eq!(emulators, 4);
        let first_route = steps
            .iter()
            .position(|s| matches!(s, Step::Ip(w) if w.contains(&"route".to_string())))
            .unwrap();
        let last_emulator = steps
            .iter()
            .rposition(|s| matches!(s, Step::StartEmulator { .. }))
            .unwrap();
        assert!(last_emulator < first_route);
    }

    #[test]
    fn plain_links_route_to_the_peer_and_start_no_emulator() {
        let mut link = Link::new("a", "b");
        link.emulate = false;
        let plan = Plan::new(&Scenario::point_to_point("plain", link), "p-");
        let steps = plan.steps();
        assert!(
            !steps
                .iter()
                .any(|s| matches!(s, Step::StartEmulator { .. }))
        );
        assert!(!steps.iter().any(|s| matches!(s, Step::Tc(_))));
        assert_eq!(
            find_step(&steps, &["p-a", "route"]),
            &Step::Ip(args(&[
                "-n",
                "p-a",
                "route",
                "add",
                "198.18.0.2/32",
                "via",
                "198.19.0.2",
                "dev",
                "wv0",
                "src",
                "198.18.0.1",
            ]))
        );
    }
}
