//! The run's metrics (one JSON line per step in `metrics.jsonl`) and its report: an HTML
//! page with SVG charts drawn by plotters, readable offline and diffable between runs.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use aurora_engine::TrainStats;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

/// Wall-clock time of one step's phases, in seconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct StepTimes {
    /// From opening the step to its last accepted rollout (the step the record's
    /// rollouts come from).
    pub generation_s: f64,
    /// The trainer's update on the step's rollouts and the BF16 export.
    pub training_s: f64,
    /// Extracting the delta (or, with `--sync full`, serialising the checkpoint).
    pub extraction_s: f64,
    /// From the start of the extraction (its segments stream as they are made, so this
    /// includes `extraction_s`) to the last actor having staged the version.
    pub transfer_s: f64,
    /// The slowest actor's activation (apply and hash check) of the version.
    pub activation_s: f64,
    /// How much weight sync lengthened the iteration that trained the version (see
    /// [`sync_held_s`]).
    #[serde(default)]
    pub sync_held_s: f64,
}

/// How much weight sync lengthens one iteration of the run's loop, in seconds. An
/// iteration opens a step on the newest version and ends once two things are done: the
/// trainer has trained the next version and every actor has staged it (a step opens only
/// on a version actors hold), and the actors have generated the step (each first
/// activating the version committed at the opening, paused at its batch boundary). All
/// times are from the opening: `trained` when the trainer's export is ready (extraction
/// starts), `staged` when every actor holds the new version, `generated` when the step's
/// last result is accepted, `activation` how long the actors' switch to the committed
/// version took. With sync free the iteration would end at max(trained, generated -
/// activation); it ends at max(staged, generated). Staging the actors do while they
/// generate, and activating while the trainer is still training, hold nothing up and
/// count for nothing; what the trainer or the actors wait for counts once.
pub fn sync_held_s(trained: f64, staged: f64, generated: f64, activation: f64) -> f64 {
    (staged.max(generated) - trained.max(generated - activation)).max(0.0)
}

/// One actor as the hub saw it at the end of a step.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ActorRecord {
    pub id: u64,
    pub region: String,
    pub version: u64,
    pub state: String,
    pub tokens_per_s: f64,
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StepRecord {
    pub step: u64,
    /// The version whose weights generated the step's rollouts.
    pub version: u64,
    /// The version the trainer produced from them.
    pub trained_version: u64,
    /// BLAKE3 weights hash of `trained_version` (docs/delta-format.md §2).
    pub weights_hash: String,
    /// The trainer's statistics of the step (reward, loss, clipping, KL, gradient).
    pub train: TrainStats,
    /// Held-out accuracy of `trained_version`, on the steps where it is evaluated.
    pub accuracy: Option<f64>,
    pub tokens: u64,
    pub tokens_per_s: f64,
    /// Bytes sent per receiver for the new version: the delta artifact, or the dense
    /// checkpoint with `--sync full`.
    pub sync_bytes: u64,
    pub dense_bytes: u64,
    /// BF16 elements of the new version that differ from the previous version's.
    pub changed_elements: u64,
    /// BF16 elements of the model.
    pub elements: u64,
    pub times: StepTimes,
    pub actors: Vec<ActorRecord>,
    /// What happened during the step (faults, joins, leaves).
    pub events: Vec<String>,
}

impl StepRecord {
    /// Share of the elements that changed in the new version.
    pub fn density(&self) -> f64 {
        self.changed_elements as f64 / self.elements.max(1) as f64
    }
}

/// The most a step may change, as a share of the elements, in the sparse regime: an RL
/// step at the paper's learning rates changes about 1%, and a delta that sparse is a
/// fiftieth of the checkpoint or less.
pub const SPARSE_DENSITY_MAX: f64 = 0.02;

/// Which regime a run's steps were in: sparse when every step changed at most
/// [`SPARSE_DENSITY_MAX`] of the elements, dense otherwise.
pub fn regime(steps: &[StepRecord]) -> String {
    let percent = 100.0 * SPARSE_DENSITY_MAX;
    let dense = steps
        .iter()
        .filter(|s| s.density() > SPARSE_DENSITY_MAX)
        .count();
    match dense {
        0 => format!("sparse regime (every step changed at most {percent}% of the elements)"),
        _ => format!(
            "dense regime ({dense} of {} steps changed more than {percent}% of the elements)",
            steps.len()
        ),
    }
}

/// The least and the most elements a step changed, as shares; None for no step.
pub fn density_range(steps: &[StepRecord]) -> Option<(f64, f64)> {
    let densities = steps.iter().map(StepRecord::density);
    let least = densities.clone().reduce(f64::min)?;
    Some((least, densities.fold(least, f64::max)))
}

pub fn read_metrics(path: &Path) -> Result<Vec<StepRecord>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(number, line)| {
            serde_json::from_str(line)
                .with_context(|| format!("{} line {}", path.display(), number + 1))
        })
        .collect()
}

/// Writes `report.html` for the steps of a run.
/// Writes the report of a run whose base policy (version 0) scored `base_accuracy` on
/// the held-out problems, when it was evaluated.
pub fn write_report(
    path: &Path,
    title: &str,
    base_accuracy: Option<f64>,
    steps: &[StepRecord],
) -> Result<()> {
    let html = render(title, base_accuracy, steps)?;
    std::fs::write(path, html).with_context(|| format!("writing {}", path.display()))
}

/// Charts first, each with the steps that had events (faults, joins, leaves) marked,
/// then the summary and the tables.
fn render(title: &str, base_accuracy: Option<f64>, steps: &[StepRecord]) -> Result<String> {
    let x = |s: &StepRecord| s.step as f64;
    let per_step = |f: &dyn Fn(&StepRecord) -> f64| -> Vec<(f64, f64)> {
        steps.iter().map(|s| (x(s), f(s))).collect()
    };
    let reward = per_step(&|s| f64::from(s.train.mean_reward));
    // The version a step trained is evaluated after it: the base at 0, step s's at s + 1.
    let accuracy: Vec<(f64, f64)> = base_accuracy
        .map(|a| (0.0, 100.0 * a))
        .into_iter()
        .chain(
            steps
                .iter()
                .filter_map(|s| s.accuracy.map(|a| (x(s) + 1.0, 100.0 * a))),
        )
        .collect();
    let marks: Vec<f64> = steps
        .iter()
        .filter(|s| !s.events.is_empty())
        .map(x)
        .collect();
    let mut actor_ids: Vec<u64> = steps
        .iter()
        .flat_map(|s| s.actors.iter().map(|a| a.id))
        .collect();
    actor_ids.sort_unstable();
    actor_ids.dedup();
    let versions: Vec<(String, Vec<(f64, f64)>)> = actor_ids
        .iter()
        .map(|id| {
            let points = steps
                .iter()
                .filter_map(|s| {
                    let actor = s.actors.iter().find(|a| a.id == *id)?;
                    Some((x(s), actor.version as f64))
                })
                .collect();
            (format!("actor {id}"), points)
        })
        .collect();

    let mut html = String::new();
    write!(
        html,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title>\
         <style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto}}\
         table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px;\
         text-align:right}}</style></head><body><h1>{title}</h1>"
    )?;
    if !marks.is_empty() {
        html.push_str("<p>Dashed lines mark the steps with events (listed at the end).</p>");
    }
    html.push_str(&chart(
        "Held-out accuracy (the base policy at 0) and mean reward",
        "percent",
        &marks,
        &[
            ("held-out accuracy", &accuracy),
            (
                "mean reward x 100",
                &reward.iter().map(|(x, r)| (*x, 100.0 * r)).collect(),
            ),
        ],
    )?);
    html.push_str(&chart(
        "Bytes per step, per receiver",
        "MB",
        &marks,
        &[
            ("sent", &per_step(&|s| s.sync_bytes as f64 / 1e6)),
            (
                "dense checkpoint",
                &per_step(&|s| s.dense_bytes as f64 / 1e6),
            ),
        ],
    )?);
    html.push_str(&chart(
        "Elements changed per step",
        "percent",
        &marks,
        &[("density", &per_step(&|s| 100.0 * s.density()))],
    )?);
    html.push_str(&chart(
        "Time weight sync added to each step",
        "seconds",
        &marks,
        &[("sync", &per_step(&|s| s.times.sync_held_s))],
    )?);
    let versions: Vec<(&str, &Vec<(f64, f64)>)> = versions
        .iter()
        .map(|(name, points)| (name.as_str(), points))
        .collect();
    html.push_str(&chart(
        "Version each actor runs",
        "version",
        &marks,
        &versions,
    )?);
    html.push_str(&chart(
        "Step time by phase",
        "seconds",
        &marks,
        &[
            ("generation", &per_step(&|s| s.times.generation_s)),
            ("training", &per_step(&|s| s.times.training_s)),
            ("extraction", &per_step(&|s| s.times.extraction_s)),
            ("transfer", &per_step(&|s| s.times.transfer_s)),
            ("activation", &per_step(&|s| s.times.activation_s)),
        ],
    )?);
    html.push_str(&chart(
        "Generation throughput",
        "tokens/s",
        &marks,
        &[("all actors", &per_step(&|s| s.tokens_per_s))],
    )?);
    html.push_str(&summary(base_accuracy, steps));
    html.push_str(&events(steps));
    html.push_str(&density_table(steps));
    html.push_str("</body></html>\n");
    Ok(html)
}

fn summary(base_accuracy: Option<f64>, steps: &[StepRecord]) -> String {
    let (Some(first), Some(last)) = (steps.first(), steps.last()) else {
        return "<p>No step completed.</p>".into();
    };
    let last_accuracy = steps.iter().rev().find_map(|s| s.accuracy);
    let percent = |a: Option<f64>| a.map_or("n/a".into(), |a| format!("{:.1}%", 100.0 * a));
    let sync: u64 = steps.iter().map(|s| s.sync_bytes).sum();
    let dense: u64 = steps.iter().map(|s| s.dense_bytes).sum();
    let (least, most) = density_range(steps).unwrap_or_default();
    format!(
        "<table><tr><th>steps</th><td>{}</td></tr>\
         <tr><th>mean reward, first and last step</th><td>{:.3} to {:.3}</td></tr>\
         <tr><th>held-out accuracy, base policy and last evaluation</th><td>{} to {}</td></tr>\
         <tr><th>bytes sent per receiver (all steps)</th><td>{:.2} MB of {:.2} MB dense ({:.1}x less)</td></tr>\
         <tr><th>elements changed per step</th><td>{:.3}% to {:.3}%: {}</td></tr>\
         <tr><th>final weights hash</th><td>{}</td></tr></table>",
        steps.len(),
        first.train.mean_reward,
        last.train.mean_reward,
        percent(base_accuracy),
        percent(last_accuracy),
        sync as f64 / 1e6,
        dense as f64 / 1e6,
        dense as f64 / sync.max(1) as f64,
        100.0 * least,
        100.0 * most,
        regime(steps),
        last.weights_hash,
    )
}

/// Every step's density and bytes against the dense checkpoint.
fn density_table(steps: &[StepRecord]) -> String {
    if steps.is_empty() {
        return String::new();
    }
    let mut rows = String::new();
    for step in steps {
        let _ = write!(
            rows,
            "<tr><td>{}</td><td>v{}</td><td>{} of {}</td><td>{:.3}%</td><td>{:.1}</td>\
             <td>{:.1}</td><td>1:{:.0}</td></tr>",
            step.step,
            step.trained_version,
            step.changed_elements,
            step.elements,
            100.0 * step.density(),
            step.sync_bytes as f64 / 1e3,
            step.dense_bytes as f64 / 1e3,
            step.dense_bytes as f64 / step.sync_bytes.max(1) as f64,
        );
    }
    format!(
        "<h2>Density per step</h2><p>{}</p><table><tr><th>step</th><th>version</th>\
         <th>elements changed</th><th>density</th><th>KB sent</th><th>KB dense</th>\
         <th>sent : dense</th></tr>{rows}</table>",
        regime(steps)
    )
}

fn events(steps: &[StepRecord]) -> String {
    let mut rows = String::new();
    for step in steps {
        for event in &step.events {
            let _ = write!(
                rows,
                "<tr><td>{}</td><td style=\"text-align:left\">{}</td></tr>",
                step.step,
                escape(event)
            );
        }
    }
    if rows.is_empty() {
        return String::new();
    }
    format!("<h2>Events</h2><table><tr><th>step</th><th>event</th></tr>{rows}</table>")
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A line chart as inline SVG, with a dashed vertical line at each step of `marks`.
fn chart(
    title: &str,
    y_label: &str,
    marks: &[f64],
    series: &[(&str, &Vec<(f64, f64)>)],
) -> Result<String> {
    let points = series.iter().flat_map(|(_, s)| s.iter());
    let (mut x_max, mut y_max) = (1.0f64, 0.0f64);
    for &(x, y) in points {
        x_max = x_max.max(x);
        y_max = y_max.max(y);
    }
    let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 320)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_max, 0f64..y_max)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(y_label)
            .draw()
            .map_err(plot_error)?;
        for &mark in marks {
            chart
                .draw_series(DashedLineSeries::new(
                    [(mark, 0.0), (mark, y_max)],
                    6,
                    4,
                    RED.mix(0.6).stroke_width(1),
                ))
                .map_err(plot_error)?;
        }
        for (index, (name, points)) in series.iter().enumerate() {
            let color = Palette99::pick(index).to_rgba();
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(plot_error)?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(plot_error)?;
        root.present().map_err(plot_error)?;
    }
    Ok(format!("<div>{svg}</div>"))
}

fn plot_error<E: std::fmt::Debug>(error: E) -> anyhow::Error {
    anyhow::anyhow!("drawing a chart: {error:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64, reward: f64, accuracy: Option<f64>) -> StepRecord {
        StepRecord {
            step,
            version: step,
            trained_version: step + 1,
            weights_hash: format!("{step:064x}"),
            train: TrainStats {
                mean_reward: reward as f32,
                ..TrainStats::default()
            },
            accuracy,
            tokens: 1000,
            tokens_per_s: 500.0,
            sync_bytes: 10_000,
            dense_bytes: 1_000_000,
            changed_elements: 5_000 * (step + 1),
            elements: 500_000,
            times: StepTimes {
                generation_s: 2.0,
                training_s: 1.0,
                extraction_s: 0.1,
                transfer_s: 0.2,
                activation_s: 0.05,
                sync_held_s: 0.2,
            },
            actors: vec![],
            events: if step == 1 {
                vec!["killed actor 2 <pid 7>".into()]
            } else {
                vec![]
            },
        }
    }

    #[test]
    fn the_report_shows_its_charts_first_from_the_base_policy_with_events_marked() {
        let mut steps = vec![
            step(0, 0.2, Some(0.25)),
            step(1, 0.4, None),
            step(2, 0.6, Some(0.55)),
        ];
        for s in &mut steps {
            s.actors = [1, 2]
                .map(|id| ActorRecord {
                    id,
                    region: "eu".into(),
                    version: s.version,
                    state: "active".into(),
                    tokens_per_s: 250.0,
                })
                .to_vec();
        }
        let html = render("run", Some(0.175), &steps).unwrap();
        for expected in [
            "Held-out accuracy (the base policy at 0)",
            "Bytes per step",
            "Elements changed per step",
            "Time weight sync added",
            "Version each actor runs",
            "actor 2",
            "Step time by phase",
            "Generation throughput",
            "17.5% to 55.0%",
            "0.200 to 0.600",
            "100.0x less",
            "killed actor 2 &lt;pid 7&gt;",
            "1.000% to 3.000%",
            "dense regime (1 of 3 steps changed more than 2% of the elements)",
            "<td>10000 of 500000</td><td>2.000%</td>",
            "1:100",
        ] {
            assert!(html.contains(expected), "missing {expected}");
        }
        assert_eq!(html.matches("<svg").count(), 7);
        // Every chart before the first table.
        assert!(html.rfind("<svg").unwrap() < html.find("<table").unwrap());
        // Step 1's event, dashed on every chart.
        assert!(html.contains("Dashed lines mark the steps with events"));
        for s in &mut steps {
            s.events.clear();
        }
        let unmarked = render("run", Some(0.175), &steps).unwrap();
        let lines = |html: &str| html.matches("<polyline").count();
        assert!(
            lines(&html) >= lines(&unmarked) + 7,
            "a dashed line on each chart"
        );
    }

    #[test]
    fn the_regime_is_sparse_only_when_every_step_changes_at_most_two_percent() {
        let check = |changed: &[u64], expected: &str| {
            let steps: Vec<StepRecord> = changed
                .iter()
                .enumerate()
                .map(|(index, &changed)| StepRecord {
                    changed_elements: changed,
                    ..step(index as u64, 0.0, None)
                })
                .collect();
            assert_eq!(regime(&steps), expected);
        };
        check(
            &[0, 10_000],
            "sparse regime (every step changed at most 2% of the elements)",
        );
        check(
            &[10_000, 10_001, 50],
            "dense regime (1 of 3 steps changed more than 2% of the elements)",
        );
    }

    #[test]
    fn metrics_lines_round_trip_and_a_bad_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let steps = vec![step(0, 0.1, None), step(1, 0.2, Some(0.3))];
        let text: String = steps
            .iter()
            .map(|s| serde_json::to_string(s).unwrap() + "\n")
            .collect();
        std::fs::write(&path, &text).unwrap();
        assert_eq!(read_metrics(&path).unwrap(), steps);
        std::fs::write(&path, text + "{not json\n").unwrap();
        let error = format!("{:#}", read_metrics(&path).unwrap_err());
        assert!(error.contains("line 3"), "{error}");
    }

    #[test]
    fn sync_holds_the_trainer_up_when_it_is_the_slower_side() {
        // Trained at 8 s, staged at 8.4 s; the actors were done at 3 s, 1.8 s of it
        // activating: only the wait for staging lengthened the iteration.
        let held = sync_held_s(8.0, 8.4, 3.0, 1.8);
        assert!((held - 0.4).abs() < 1e-9, "{held}");
    }

    #[test]
    fn sync_holds_the_actors_up_when_they_are_the_slower_side() {
        // Staged at 2.5 s, long before the actors finished at 9 s, 0.3 s of which they
        // spent activating: the staging was hidden, the activation was not.
        let held = sync_held_s(2.0, 2.5, 9.0, 0.3);
        assert!((held - 0.3).abs() < 1e-9, "{held}");
    }

    #[test]
    fn sync_counts_only_what_it_adds_past_the_other_side() {
        // Free sync would end at max(5, 6 - 1) = 5; the iteration ends at max(5.5, 6).
        let held = sync_held_s(5.0, 5.5, 6.0, 1.0);
        assert!((held - 1.0).abs() < 1e-9, "{held}");
        assert_eq!(sync_held_s(5.0, 5.0, 4.0, 0.0), 0.0);
    }
}
