//! The comparison as data, and as the text `aurora sim paper` prints.

use std::fmt;

use super::beyond::Beyond;
use super::tcp::TcpModel;

/// A difference from the paper above this share is flagged and must be explained.
pub const FLAG_THRESHOLD: f64 = 0.20;

/// A figure as the paper gives it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PaperFigure {
    /// One value.
    Value(f64),
    /// A range over the paper's configurations.
    Range(f64, f64),
    /// A bound the paper states ("over 500 s").
    AtLeast(f64),
}

/// One line of a comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// What is compared.
    pub label: String,
    /// The paper's figure, where it gives one.
    pub paper: Option<PaperFigure>,
    /// The simulation's figure.
    pub simulated: f64,
    /// The unit of both.
    pub unit: &'static str,
    /// Why the simulation differs by more than [`FLAG_THRESHOLD`], where it does.
    pub explanation: Option<&'static str>,
    /// The largest difference the documentation accepts for this row (the regression
    /// test holds the simulation to it).
    pub tolerance: f64,
    /// Whether the row changes one named input of the row above it to test its
    /// explanation, rather than being one of the paper's figures as section 7 ran it.
    pub what_if: bool,
}

impl Row {
    /// A figure the paper also gives.
    pub fn compared(
        label: impl Into<String>,
        paper: PaperFigure,
        simulated: f64,
        unit: &'static str,
    ) -> Row {
        Row {
            label: label.into(),
            paper: Some(paper),
            simulated,
            unit,
            explanation: None,
            tolerance: FLAG_THRESHOLD,
            what_if: false,
        }
    }

    /// A what-if: the figure above it with one named input changed, compared with the
    /// paper. It holds to no tolerance of its own: one that lands within
    /// [`FLAG_THRESHOLD`] explains the figure above it ([`PaperReport::tally`]), one that
    /// does not shows the input is not the reason.
    pub fn what_if(
        label: impl Into<String>,
        paper: PaperFigure,
        simulated: f64,
        unit: &'static str,
    ) -> Row {
        Row {
            what_if: true,
            tolerance: f64::INFINITY,
            ..Row::compared(label, paper, simulated, unit)
        }
    }

    /// A figure of the simulation alone.
    pub fn simulated(label: impl Into<String>, simulated: f64, unit: &'static str) -> Row {
        Row {
            label: label.into(),
            paper: None,
            simulated,
            unit,
            explanation: None,
            tolerance: f64::INFINITY,
            what_if: false,
        }
    }

    /// The reason for a difference above the threshold, and the difference the
    /// documentation accepts because of it.
    pub fn explained(mut self, explanation: &'static str, tolerance: f64) -> Row {
        self.explanation = Some(explanation);
        self.tolerance = tolerance;
        self
    }

    /// Relative difference from the paper: against its value, or against the nearer
    /// end of its range (zero inside it).
    pub fn difference(&self) -> Option<f64> {
        match self.paper? {
            PaperFigure::Value(paper) => Some(self.simulated / paper - 1.0),
            PaperFigure::Range(low, _) if self.simulated < low => Some(self.simulated / low - 1.0),
            PaperFigure::Range(_, high) if self.simulated > high => {
                Some(self.simulated / high - 1.0)
            }
            PaperFigure::Range(..) => Some(0.0),
            PaperFigure::AtLeast(bound) => Some((self.simulated / bound - 1.0).min(0.0)),
        }
    }

    /// Whether the difference is above the threshold.
    pub fn flagged(&self) -> bool {
        // A figure the model cannot give (NaN, infinite) is as far off as can be.
        self.difference()
            .is_some_and(|difference| difference.is_nan() || difference.abs() > FLAG_THRESHOLD)
    }
}

/// The rows of one of the paper's results.
#[derive(Clone, Debug, PartialEq)]
pub struct Section {
    /// The result, and where the paper gives it.
    pub title: String,
    /// The setting simulated.
    pub setting: String,
    /// The figures.
    pub rows: Vec<Row>,
}

/// Everything `aurora sim paper` prints.
#[derive(Clone, Debug, PartialEq)]
pub struct PaperReport {
    /// The calibrated transfer model.
    pub tcp: TcpModel,
    /// The random loss assumed on every path between regions.
    pub wan_loss: f64,
    /// The model's own check against `aurora wan`: (what, measured s, model s).
    pub transport_check: Vec<(String, f64, f64)>,
    /// One per result of the paper.
    pub sections: Vec<Section>,
    /// Beyond the paper.
    pub beyond: Beyond,
}

/// How the paper's figures fare: what-if rows are not among them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tally {
    /// Figures compared with the paper.
    pub compared: usize,
    /// Those within [`FLAG_THRESHOLD`].
    pub within: usize,
    /// Those beyond it followed by a what-if row that lands within it.
    pub explained_by_what_if: usize,
}

impl Tally {
    /// The share of the figures within [`FLAG_THRESHOLD`].
    pub fn within_share(&self) -> f64 {
        if self.compared == 0 {
            1.0
        } else {
            self.within as f64 / self.compared as f64
        }
    }
}

impl PaperReport {
    /// Every row, in print order.
    pub fn rows(&self) -> impl Iterator<Item = &Row> {
        self.sections.iter().flat_map(|section| &section.rows)
    }

    /// Counts the paper's figures: within the threshold, or beyond it with a what-if
    /// that lands among the rows right after it.
    pub fn tally(&self) -> Tally {
        let mut tally = Tally {
            compared: 0,
            within: 0,
            explained_by_what_if: 0,
        };
        for section in &self.sections {
            for (index, row) in section.rows.iter().enumerate() {
                if row.what_if || row.paper.is_none() {
                    continue;
                }
                tally.compared += 1;
                if !row.flagged() {
                    tally.within += 1;
                } else if section.rows[index + 1..]
                    .iter()
                    .take_while(|next| next.what_if)
                    .any(|next| !next.flagged())
                {
                    tally.explained_by_what_if += 1;
                }
            }
        }
        tally
    }

    /// Every figure as JSON, for a researcher's own plots: per section its rows, each with
    /// the simulated value, the paper's (a value, a range, or null), the difference, the
    /// tolerance the regression test holds it to and the explanation of a flagged one.
    pub fn figures_json(&self) -> serde_json::Value {
        let sections: Vec<serde_json::Value> = self
            .sections
            .iter()
            .map(|section| {
                let rows: Vec<serde_json::Value> = section
                    .rows
                    .iter()
                    .map(|row| {
                        let paper = row.paper.map(|paper| match paper {
                            PaperFigure::Value(value) => serde_json::json!({ "value": value }),
                            PaperFigure::Range(low, high) => {
                                serde_json::json!({ "low": low, "high": high })
                            }
                            PaperFigure::AtLeast(low) => serde_json::json!({ "low": low }),
                        });
                        serde_json::json!({
                            "label": row.label,
                            "unit": row.unit,
                            "simulated": row.simulated,
                            "paper": paper,
                            "difference": row.difference(),
                            "flagged": row.flagged(),
                            "tolerance": row.tolerance.is_finite().then_some(row.tolerance),
                            "what_if": row.what_if,
                            "explanation": row.explanation,
                        })
                    })
                    .collect();
                serde_json::json!({
                    "title": section.title,
                    "setting": section.setting,
                    "rows": rows,
                })
            })
            .collect();
        serde_json::json!({
            "wan_loss": self.wan_loss,
            "tcp": {
                "mathis_constant": self.tcp.mathis_constant,
                "goodput_efficiency": self.tcp.goodput_efficiency,
            },
            "sections": sections,
        })
    }

    /// Every figure as CSV, a row each: section, figure, unit, simulated, the paper's
    /// value or range (`paper_low`, `paper_high`; equal for a value, empty for none),
    /// the difference and the tolerance (both shares, empty where none).
    pub fn figures_csv(&self) -> String {
        let field = |text: &str| format!("\"{}\"", text.replace('"', "\"\""));
        let number = |value: Option<f64>| value.map_or(String::new(), |v| format!("{v}"));
        let mut out = String::from(
            "section,figure,unit,simulated,paper_low,paper_high,difference,tolerance\n",
        );
        for section in &self.sections {
            for row in &section.rows {
                let (low, high) = match row.paper {
                    Some(PaperFigure::Value(value)) => (Some(value), Some(value)),
                    Some(PaperFigure::Range(low, high)) => (Some(low), Some(high)),
                    Some(PaperFigure::AtLeast(low)) => (Some(low), None),
                    None => (None, None),
                };
                out.push_str(&format!(
                    "{},{},{},{},{},{},{},{}\n",
                    field(&section.title),
                    field(&row.label),
                    field(row.unit),
                    row.simulated,
                    number(low),
                    number(high),
                    number(row.difference()),
                    number(row.tolerance.is_finite().then_some(row.tolerance)),
                ));
            }
        }
        out
    }
}

fn value(number: f64, unit: &str) -> String {
    let digits = match number.abs() {
        n if n >= 1000.0 => 0,
        n if n >= 100.0 => 1,
        n if n >= 10.0 => 2,
        _ => 3,
    };
    format!("{number:.digits$} {unit}")
}

impl fmt::Display for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let paper = match self.paper {
            None => "-".to_owned(),
            Some(PaperFigure::Value(paper)) => value(paper, self.unit),
            Some(PaperFigure::Range(low, high)) => {
                format!("{}-{}", value(low, "").trim_end(), value(high, self.unit))
            }
            Some(PaperFigure::AtLeast(low)) => format!("over {}", value(low, self.unit)),
        };
        let difference = self
            .difference()
            .map_or_else(String::new, |d| format!("{:+.1}%", 100.0 * d));
        let flag = if self.flagged() { "!" } else { "" };
        write!(
            f,
            "  {:<62} {:>18} {:>16} {:>9} {flag}",
            self.label,
            paper,
            value(self.simulated, self.unit),
            difference
        )?;
        if let (true, Some(why)) = (self.flagged(), self.explanation) {
            write!(f, "\n      why: {why}")?;
        }
        Ok(())
    }
}

impl fmt::Display for PaperReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "The paper's evaluation (section 7 of AuroraRL), simulated on section 7.1's testbed: \
             the control core under virtual time, a TCP model, measured codec costs \
             (docs/paper-eval.md).\n"
        )?;
        writeln!(
            f,
            "TCP model: C = {:.2} in the loss bound (fitted to `aurora wan bench`, CUBIC, 0.1% loss), \
             goodput {:.1}% of the rate (BBR sweep); loss between regions {:.2e} (an assumption)",
            self.tcp.mathis_constant,
            100.0 * self.tcp.goodput_efficiency,
            self.wan_loss
        )?;
        writeln!(
            f,
            "  the model against the segment transport (`aurora wan transfer encodings`):"
        )?;
        for (what, measured, model) in &self.transport_check {
            writeln!(
                f,
                "    {what:<40} measured {measured:>7.3} s, model {model:>7.3} s ({:+.1}%)",
                100.0 * (model / measured - 1.0)
            )?;
        }
        writeln!(
            f,
            "\n  {:<62} {:>18} {:>16} {:>9}",
            "figure", "paper", "simulated", "diff"
        )?;
        for section in &self.sections {
            writeln!(f, "\n{}\n  ({})", section.title, section.setting)?;
            for row in &section.rows {
                writeln!(f, "{row}")?;
            }
        }
        let tally = self.tally();
        writeln!(
            f,
            "\n{} of {} figures within {:.0}% of the paper ({:.0}%); of the {} beyond it, {} \
             explained by a what-if that lands, {} not (marked !, each with why)",
            tally.within,
            tally.compared,
            100.0 * FLAG_THRESHOLD,
            100.0 * tally.within_share(),
            tally.compared - tally.within,
            tally.explained_by_what_if,
            tally.compared - tally.within - tally.explained_by_what_if,
        )?;
        write!(f, "\n{}", self.beyond)
    }
}
