//! The Prometheus text exposition of the core's counters and gauges and of the hub's
//! refusals (`GET /metrics`, listed in `docs/control-api.md`).

use std::fmt::Write as _;

use aurora_api::{REJECTIONS, rejection_reason};
use aurora_control::ControlPlane;

use crate::refusals::{METRICS, Refusal};

/// Renders the Prometheus text exposition of the core's counters and gauges, and of
/// `refusals` (every kind, zeros included).
pub(crate) fn render(
    core: &ControlPlane,
    leases_issued: u64,
    refusals: &[(Refusal, u64)],
) -> String {
    let stats = core.stats();
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
        // Writing to a String cannot fail.
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{name}{labels} {value}");
        }
    };
    metric(
        "aurora_results_accepted_total",
        "counter",
        "Results accepted.",
        &[("", stats.accepted)],
    );
    let rejected: Vec<(String, u64)> = REJECTIONS
        .iter()
        .map(|rejection| {
            let count = stats.rejected.get(rejection).copied().unwrap_or(0);
            let labels = format!("{{reason=\"{}\"}}", rejection_reason(*rejection));
            (labels, count)
        })
        .collect();
    let rejected: Vec<(&str, u64)> = rejected
        .iter()
        .map(|(labels, count)| (labels.as_str(), *count))
        .collect();
    metric(
        "aurora_results_rejected_total",
        "counter",
        "Results rejected, by reason.",
        &rejected,
    );
    metric(
        "aurora_leases_issued_total",
        "counter",
        "Leases handed out by this hub process.",
        &[("", leases_issued)],
    );
    metric(
        "aurora_leases_expired_total",
        "counter",
        "Leases that ran out before their result arrived.",
        &[("", stats.expired)],
    );
    metric(
        "aurora_events_dropped_total",
        "counter",
        "Core events dropped before the hub drained them.",
        &[("", core.events_dropped())],
    );
    let members = core.members();
    let leaving = members
        .values()
        .filter(|member| member.leaving_at.is_some())
        .count();
    let live = members.len() - leaving;
    metric(
        "aurora_actors",
        "gauge",
        "Registered actors, by state.",
        &[
            ("{state=\"live\"}", count(live)),
            ("{state=\"leaving\"}", count(leaving)),
        ],
    );
    metric(
        "aurora_lease_lifetime_ms",
        "gauge",
        "Lifetime of a lease issued now.",
        &[("", core.lease_ms())],
    );
    if let Some((version, _)) = core.latest_version() {
        metric(
            "aurora_latest_version",
            "gauge",
            "Latest published version.",
            &[("", version.0)],
        );
    }
    if let Some(progress) = core.step_progress() {
        metric(
            "aurora_step",
            "gauge",
            "Current or last step.",
            &[("", progress.step.0)],
        );
        metric(
            "aurora_step_jobs",
            "gauge",
            "Jobs of the current or last step, by state.",
            &[
                ("{state=\"batch\"}", u64::from(progress.batch_size)),
                ("{state=\"accepted\"}", u64::from(progress.accepted)),
                ("{state=\"leased\"}", u64::from(progress.leased)),
                ("{state=\"pooled\"}", u64::from(progress.pooled)),
                ("{state=\"reserved\"}", u64::from(progress.reserved)),
            ],
        );
        metric(
            "aurora_step_complete",
            "gauge",
            "Whether the current or last step has completed.",
            &[("", u64::from(progress.completion.is_some()))],
        );
    }
    for (name, help) in METRICS {
        let samples: Vec<(String, u64)> = refusals
            .iter()
            .filter_map(|(refusal, count)| {
                let (metric, key, label) = refusal.metric();
                (metric == name).then(|| (format!("{{{key}=\"{label}\"}}"), *count))
            })
            .collect();
        let samples: Vec<(&str, u64)> = samples
            .iter()
            .map(|(labels, count)| (labels.as_str(), *count))
            .collect();
        metric(name, "counter", help, &samples);
    }
    out
}

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}
