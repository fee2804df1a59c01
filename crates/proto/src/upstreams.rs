//! Which upstream a receiving node's next session goes to, and when
//! (docs/wire-protocol.md §6.4): the policy alone, over time and events given by its
//! driver, so the tokio driver and the simulation share it.
//!
//! The first upstream is preferred (the region's relay): a lost session moves on to the
//! next one, in turn, after a backoff. A session that settles on any other upstream goes
//! back to the first after `return_after`, between two versions; otherwise an actor that
//! fell back to the hub while its relay was down would stay there, and its region would
//! cost the hub's uplink one copy of every version per actor for the rest of the run.

use std::time::{Duration, Instant};

/// The backoff before a session grows by this much with each loss in a row.
const BACKOFF_STEP: Duration = Duration::from_millis(50);
/// The longest backoff before a session.
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// Each return to the first upstream that delivers nothing doubles the wait before the
/// next, up to this many times `return_after`: a relay that stays down costs a dial now
/// and then, not one every `return_after`.
const RETURN_FACTOR_MAX: u32 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Return {
    /// On the first upstream, or never returning.
    No,
    /// On a fallback: going back at this instant.
    At(Instant),
    /// Due, waiting for the receiver to be between versions.
    Due,
}

/// The upstreams of one node, `A` naming each (an address, or a simulated node).
#[derive(Debug, Clone)]
pub struct Upstreams<A> {
    addresses: Vec<A>,
    /// Index of the current (or next) session's upstream.
    current: usize,
    /// Sessions lost in a row.
    failures: u32,
    /// The current session is being left on purpose for the first upstream.
    back_to_first: bool,
    return_after: Option<Duration>,
    /// Multiplies `return_after`: doubled by each return that delivered nothing.
    return_factor: u32,
    ret: Return,
    /// The session on the first upstream is a return that has delivered nothing yet.
    returning: bool,
}

impl<A: Copy> Upstreams<A> {
    /// `addresses` in order of preference (none for a node that receives nothing, which
    /// never asks); `return_after`: how long a session stays on a fallback before going
    /// back to the first; `None` never.
    pub fn new(addresses: Vec<A>, return_after: Option<Duration>) -> Upstreams<A> {
        Upstreams {
            addresses,
            current: 0,
            failures: 0,
            back_to_first: false,
            return_after,
            return_factor: 1,
            ret: Return::No,
            returning: false,
        }
    }

    pub fn current(&self) -> A {
        self.addresses[self.current]
    }

    pub fn on_first(&self) -> bool {
        self.current == 0
    }

    /// The session's first Welcome arrived.
    pub fn connected(&mut self, now: Instant) {
        self.failures = 0;
        self.ret = match self.return_after {
            Some(after) if !self.on_first() => Return::At(now + after * self.return_factor),
            _ => Return::No,
        };
    }

    /// The session delivered a version: a return that does has worked.
    pub fn delivered(&mut self) {
        if self.on_first() {
            self.returning = false;
            self.return_factor = 1;
        }
    }

    /// The current session is to be left for the first upstream (the caller abandons
    /// it; [`Upstreams::lost`] then names the first, at once).
    pub fn leave_for_first(&mut self) {
        self.back_to_first = true;
        self.ret = Return::No;
    }

    /// Whether the current session is being left on purpose for the first upstream.
    pub fn leaving_for_first(&self) -> bool {
        self.back_to_first
    }

    /// When the driver must look at the return again ([`Upstreams::poll_return`]).
    pub fn return_at(&self) -> Option<Instant> {
        match self.ret {
            Return::At(at) => Some(at),
            Return::No | Return::Due => None,
        }
    }

    /// Whether to leave the current session for the first upstream now: its time has
    /// come and the receiver is between versions (`receiving` is false). A true answer
    /// has already called [`Upstreams::leave_for_first`].
    pub fn poll_return(&mut self, now: Instant, receiving: bool) -> bool {
        if matches!(self.ret, Return::At(at) if now >= at) {
            self.ret = Return::Due;
        }
        if self.ret == Return::Due && !receiving {
            self.leave_for_first();
            return true;
        }
        false
    }

    /// The session ended: moves to the upstream of the next one and says how long to
    /// wait before it.
    pub fn lost(&mut self) -> Duration {
        self.ret = Return::No;
        if std::mem::take(&mut self.back_to_first) {
            self.current = 0;
            self.returning = true;
            return Duration::ZERO;
        }
        if std::mem::take(&mut self.returning) {
            self.return_factor = (self.return_factor * 2).min(RETURN_FACTOR_MAX);
        }
        self.current = (self.current + 1) % self.addresses.len();
        self.failures += 1;
        (BACKOFF_STEP * self.failures).min(BACKOFF_MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstreams(return_after: Option<Duration>) -> Upstreams<&'static str> {
        Upstreams::new(vec!["relay", "hub"], return_after)
    }

    const AFTER: Duration = Duration::from_secs(30);

    #[test]
    fn losses_move_on_in_turn_with_a_growing_bounded_backoff() {
        let mut u = upstreams(Some(AFTER));
        assert!(u.on_first());
        assert_eq!(u.lost(), Duration::from_millis(50));
        assert_eq!(u.current(), "hub");
        assert_eq!(u.lost(), Duration::from_millis(100));
        assert!(u.on_first(), "in turn, back to the first");
        for _ in 0..100 {
            u.lost();
        }
        assert_eq!(u.lost(), BACKOFF_MAX);
        u.connected(Instant::now());
        u.lost();
        assert_eq!(
            u.lost(),
            Duration::from_millis(100),
            "a Welcome resets the count"
        );
    }

    #[test]
    fn a_session_on_a_fallback_returns_to_the_first_between_versions() {
        let now = Instant::now();
        let mut u = upstreams(Some(AFTER));
        u.lost();
        u.connected(now);
        assert_eq!(u.return_at(), Some(now + AFTER));
        assert!(!u.poll_return(now + AFTER / 2, false), "not yet");
        // Due while a version is arriving: it waits for the version, not for a timer.
        assert!(!u.poll_return(now + AFTER, true));
        assert_eq!(u.return_at(), None);
        assert!(!u.poll_return(now + AFTER, true));
        assert!(u.poll_return(now + AFTER, false));
        assert_eq!(u.lost(), Duration::ZERO, "straight to the first");
        assert!(u.on_first());
        // Settled on the first: no return to schedule.
        u.connected(now);
        assert_eq!(u.return_at(), None);
        assert!(!u.poll_return(now + 10 * AFTER, false));
    }

    #[test]
    fn returns_that_deliver_nothing_wait_longer_each_time_up_to_a_bound() {
        let now = Instant::now();
        let mut u = upstreams(Some(AFTER));
        u.lost();
        let mut waits = Vec::new();
        for _ in 0..7 {
            u.connected(now);
            waits.push(u.return_at().unwrap() - now);
            assert!(u.poll_return(now + 100 * AFTER, false));
            assert_eq!(u.lost(), Duration::ZERO);
            // The first upstream is still down: its session ends before a delivery.
            u.lost();
            assert!(!u.on_first());
        }
        let factors: Vec<u32> = waits.iter().map(|w| (w.as_secs() / 30) as u32).collect();
        assert_eq!(factors, [1, 2, 4, 8, 16, 16, 16]);
        // A return that delivers a version resets the wait.
        u.connected(now);
        assert!(u.poll_return(now + 100 * AFTER, false));
        u.lost();
        u.connected(now);
        u.delivered();
        u.lost();
        u.connected(now);
        assert_eq!(u.return_at(), Some(now + AFTER));
    }

    #[test]
    fn one_upstream_or_no_return_after_never_returns() {
        let now = Instant::now();
        let mut single = Upstreams::new(vec!["hub"], Some(AFTER));
        single.lost();
        assert!(single.on_first());
        single.connected(now);
        assert_eq!(single.return_at(), None);
        let mut never = upstreams(None);
        never.lost();
        never.connected(now);
        assert_eq!(never.return_at(), None);
        assert!(!never.poll_return(now + 100 * AFTER, false));
    }
}
