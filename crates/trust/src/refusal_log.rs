//! How many log lines strangers can cause. Every refusal is counted, but a flood of
//! them (a scan, a connection storm, a peer retrying a bad certificate) must not
//! become a flood of log lines that fills a disk or buries the one line that matters.
//! Each reason gets [`LINES_PER_WINDOW`] lines per [`WINDOW`]; the first line of the
//! next window says how many were left out meanwhile, so the log still accounts for
//! every refusal together with the counters.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Lines logged per reason in one window before the rest are only counted.
pub const LINES_PER_WINDOW: u64 = 32;

/// The window over which [`LINES_PER_WINDOW`] applies.
pub const WINDOW: Duration = Duration::from_secs(60);

/// Whether to log a refusal, decided per reason `R`.
#[derive(Debug)]
pub struct RefusalLog<R> {
    reasons: Mutex<HashMap<R, Window>>,
}

impl<R> Default for RefusalLog<R> {
    fn default() -> RefusalLog<R> {
        RefusalLog {
            reasons: Mutex::new(HashMap::new()),
        }
    }
}

#[derive(Debug)]
struct Window {
    started: Instant,
    logged: u64,
    /// Left out in this window.
    skipped: u64,
}

/// What [`RefusalLog::admit`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Log this refusal; `skipped_before` of the same reason were left out of the log
    /// in the window before.
    Log { skipped_before: u64 },
    /// Count it only: the reason has had its lines for this window.
    Skip,
}

impl<R: Eq + Hash> RefusalLog<R> {
    /// Decides for one refusal of `reason` at `now`.
    pub fn admit(&self, reason: R, now: Instant) -> Admission {
        let mut reasons = self.reasons.lock().unwrap_or_else(PoisonError::into_inner);
        let window = reasons.entry(reason).or_insert(Window {
            started: now,
            logged: 0,
            skipped: 0,
        });
        let mut skipped_before = 0;
        if now.saturating_duration_since(window.started) >= WINDOW {
            skipped_before = window.skipped;
            *window = Window {
                started: now,
                logged: 0,
                skipped: 0,
            };
        }
        if window.logged < LINES_PER_WINDOW {
            window.logged += 1;
            Admission::Log { skipped_before }
        } else {
            window.skipped += 1;
            Admission::Skip
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_logs_a_window_s_lines_then_says_how_many_it_left_out() {
        let log = RefusalLog::default();
        let start = Instant::now();
        let decisions: Vec<Admission> = (0..100).map(|_| log.admit("flood", start)).collect();
        let logged = decisions
            .iter()
            .filter(|decision| matches!(decision, Admission::Log { .. }))
            .count() as u64;
        assert_eq!(logged, LINES_PER_WINDOW);
        assert!(
            decisions[..LINES_PER_WINDOW as usize]
                .iter()
                .all(|decision| *decision == Admission::Log { skipped_before: 0 })
        );

        // Another reason has a budget of its own.
        assert_eq!(
            log.admit("other", start),
            Admission::Log { skipped_before: 0 }
        );
        // Still within the window: skipped.
        assert_eq!(log.admit("flood", start + WINDOW / 2), Admission::Skip);
        // The next window's first line accounts for the 69 left out.
        assert_eq!(
            log.admit("flood", start + WINDOW),
            Admission::Log {
                skipped_before: 100 - LINES_PER_WINDOW + 1
            }
        );
        assert_eq!(
            log.admit("flood", start + WINDOW),
            Admission::Log { skipped_before: 0 }
        );
    }

    #[test]
    fn an_earlier_instant_never_opens_a_window() {
        let log = RefusalLog::default();
        let start = Instant::now() + WINDOW;
        for _ in 0..LINES_PER_WINDOW {
            log.admit("reason", start);
        }
        assert_eq!(log.admit("reason", start - WINDOW), Admission::Skip);
    }
}
