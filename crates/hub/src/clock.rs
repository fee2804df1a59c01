//! Where the hub reads time: a [`Clock`], monotonic in production ([`SystemClock`]),
//! moved by hand in tests ([`ManualClock`]).
//!
//! The core never reads a clock; the hub hands it `now` on every call. Lease deadlines
//! and heartbeat times are stored in the core's snapshot on this clock, so its origin
//! must stay the same across restarts of the hub: a restarted hub then sees the time
//! that passed while it was down, and outstanding leases are honoured or expire as if
//! it had never stopped.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use aurora_control::Millis;

/// A source of time for the hub.
pub trait Clock: fmt::Debug + Send + Sync {
    /// The current time, in milliseconds from an origin that does not change when the
    /// hub restarts.
    fn now(&self) -> Millis;
}

/// Production time: the wall clock read once, when the clock is created, then
/// advanced by the monotonic clock.
///
/// Reading the wall clock once gives an origin shared across restarts (the Unix epoch),
/// so the downtime of a restart counts; advancing monotonically means that a wall
/// clock stepped while the hub runs (NTP, an operator) moves no deadline. A wall clock
/// that was set back across a restart only freezes the hub's time until it catches
/// up, since the core never lets time run backwards.
#[derive(Debug)]
pub struct SystemClock {
    started: Instant,
    started_at: Millis,
}

impl SystemClock {
    /// A clock starting at the wall clock's current time.
    pub fn new() -> SystemClock {
        // A wall clock before 1970 is misconfigured; the core's high-water mark then
        // holds time at the stored clock until this one passes it.
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        SystemClock {
            started: Instant::now(),
            started_at: Millis(u64::try_from(since_epoch.as_millis()).unwrap_or(u64::MAX)),
        }
    }
}

impl Default for SystemClock {
    fn default() -> SystemClock {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        let elapsed_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.started_at.saturating_add(elapsed_ms)
    }
}

/// Time that moves only when told: for tests and simulations that drive a hub, also
/// across restarts (share one clock between the hub instances).
#[derive(Debug, Default)]
pub struct ManualClock {
    now_ms: AtomicU64,
}

impl ManualClock {
    /// A clock reading `start`.
    pub fn new(start: Millis) -> ManualClock {
        ManualClock {
            now_ms: AtomicU64::new(start.0),
        }
    }

    /// Moves the clock forward by `duration_ms` (saturating at the end of time).
    pub fn advance(&self, duration_ms: u64) {
        // A failed update cannot happen: the closure always returns a value.
        let _ = self
            .now_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                Some(now.saturating_add(duration_ms))
            });
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Millis {
        Millis(self.now_ms.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let clock = ManualClock::new(Millis(5));
        assert_eq!(clock.now(), Millis(5));
        clock.advance(10);
        assert_eq!(clock.now(), Millis(15));
        clock.advance(u64::MAX);
        assert_eq!(clock.now(), Millis(u64::MAX));
    }

    #[test]
    fn the_system_clock_starts_at_the_wall_clock_and_never_goes_back() {
        let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let clock = SystemClock::new();
        let first = clock.now();
        assert!(first.0 >= u64::try_from(before.as_millis()).unwrap());
        assert!(clock.now() >= first);
    }
}
