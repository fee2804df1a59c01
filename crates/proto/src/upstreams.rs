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

use crate::{Backoff, Receiver, SessionEnd};

/// The bound of the wait before a session after one loss; it doubles with each loss in
/// a row ([`Backoff`]).
pub const BACKOFF_BASE: Duration = Duration::from_millis(100);
/// The longest wait before a session: a relay or hub that keeps failing (down, or
/// refused for a bad signature or another run) is tried at most every few seconds.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A session that lasted this long worked, whatever ended it: the next loss waits
/// [`BACKOFF_BASE`] at most again. A Welcome alone proves nothing (an upstream whose
/// versions are refused welcomes every session), so it does not reset the backoff.
pub const HEALTHY_SESSION: Duration = Duration::from_secs(10);
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
    /// The wait before the next session, by sessions lost in a row.
    backoff: Backoff,
    /// When the current session was welcomed.
    welcomed_at: Option<Instant>,
    /// The current session is being left on purpose for the first upstream.
    back_to_first: bool,
    return_after: Option<Duration>,
    /// Multiplies `return_after`: doubled by each return that failed.
    return_factor: u32,
    ret: Return,
    /// The session on the first upstream is a return not yet proven: it has delivered
    /// no version and (once welcomed, at `returned_at`) lasted less than `return_after`.
    returning: bool,
    returned_at: Option<Instant>,
}

impl<A: Copy> Upstreams<A> {
    /// `addresses` in order of preference (none for a node that receives nothing, which
    /// never asks); `return_after`: how long a session stays on a fallback before going
    /// back to the first; `None` never. `seed` draws the backoff's jitter.
    pub fn new(addresses: Vec<A>, return_after: Option<Duration>, seed: u64) -> Upstreams<A> {
        Upstreams {
            addresses,
            current: 0,
            backoff: Backoff::new(BACKOFF_BASE, BACKOFF_MAX, seed),
            welcomed_at: None,
            back_to_first: false,
            return_after,
            return_factor: 1,
            ret: Return::No,
            returning: false,
            returned_at: None,
        }
    }

    /// The current (or next) session's upstream; none for a node without upstreams.
    pub fn current(&self) -> Option<A> {
        self.addresses.get(self.current).copied()
    }

    pub fn on_first(&self) -> bool {
        self.current == 0
    }

    /// The session's first Welcome arrived.
    pub fn connected(&mut self, now: Instant) {
        self.welcomed_at = Some(now);
        if self.on_first() {
            self.ret = Return::No;
            if self.returning {
                self.returned_at = Some(now);
            }
            return;
        }
        // A wait too long to represent is no return at all.
        self.ret = self
            .return_after
            .and_then(|after| after.checked_mul(self.return_factor))
            .and_then(|wait| now.checked_add(wait))
            .map_or(Return::No, Return::At);
    }

    /// The session delivered a version: it works (the backoff starts over), and a
    /// return that does has worked.
    pub fn delivered(&mut self) {
        self.backoff.reset();
        if self.on_first() {
            self.returning = false;
            self.returned_at = None;
            self.return_factor = 1;
        }
    }

    /// The current session is to be left for the first upstream; call it once the
    /// session is given up (a receiver whose session had already ended is not leaving
    /// on purpose). [`Upstreams::lost`] then names the first, at once.
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

    /// Gives `receiver`'s session up for the first upstream if it is time: the return
    /// is due and the receiver is between versions (it holds no part of one, or
    /// `delivered` one just now: what it holds of the next is resumed from the first
    /// upstream, so a fallback that is always mid-version is left all the same). Whether
    /// it did; [`Upstreams::lost`] then names the first.
    pub fn poll_return(&mut self, now: Instant, receiver: &mut Receiver, delivered: bool) -> bool {
        if self.due(now, delivered || !receiver.receiving())
            && receiver.abandon("returning to the first upstream")
        {
            self.leave_for_first();
            return true;
        }
        false
    }

    fn due(&mut self, now: Instant, between_versions: bool) -> bool {
        if matches!(self.ret, Return::At(at) if now >= at) {
            self.ret = Return::Due;
        }
        self.ret == Return::Due && between_versions
    }

    /// The session ended at `now` for `reason`: moves to the upstream of the next one
    /// and says how long to wait before it.
    pub fn lost(&mut self, now: Instant, reason: &SessionEnd) -> Duration {
        self.ret = Return::No;
        if self
            .welcomed_at
            .take()
            .is_some_and(|at| now.saturating_duration_since(at) >= HEALTHY_SESSION)
        {
            self.backoff.reset();
        }
        if std::mem::take(&mut self.back_to_first) {
            self.current = 0;
            self.returning = true;
            self.returned_at = None;
            return Duration::ZERO;
        }
        if std::mem::take(&mut self.returning) {
            // A relay given up for bringing nothing of a committed version has not
            // worked, however long it kept the session.
            let lasted = match (self.returned_at.take(), self.return_after) {
                (Some(at), Some(after)) => {
                    now.saturating_duration_since(at) >= after
                        && !matches!(reason, SessionEnd::Behind { .. })
                }
                _ => false,
            };
            self.return_factor = if lasted {
                1
            } else {
                (self.return_factor * 2).min(RETURN_FACTOR_MAX)
            };
        }
        if !self.addresses.is_empty() {
            self.current = (self.current + 1) % self.addresses.len();
        }
        self.backoff.failed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstreams(return_after: Option<Duration>) -> Upstreams<&'static str> {
        Upstreams::new(vec!["relay", "hub"], return_after, 1)
    }

    /// Whether `wait` is what the `n`th loss in a row may draw (n from 1).
    fn drawn_for(wait: Duration, n: u32) -> bool {
        let bound = (BACKOFF_BASE * 2u32.pow(n.min(10) - 1)).min(BACKOFF_MAX);
        wait >= bound / 2 && wait <= bound
    }

    const AFTER: Duration = Duration::from_secs(30);
    const LOST: SessionEnd = SessionEnd::StreamsClosed;

    /// Leaves a fallback for the first upstream as `poll_return` does once it is due.
    fn go_back(u: &mut Upstreams<&'static str>, now: Instant) {
        assert!(u.due(now, true));
        u.leave_for_first();
        assert_eq!(u.lost(now, &LOST), Duration::ZERO, "straight to the first");
        assert!(u.on_first());
    }

    #[test]
    fn losses_move_on_in_turn_with_a_growing_bounded_backoff() {
        let now = Instant::now();
        let mut u = upstreams(Some(AFTER));
        assert!(u.on_first());
        assert!(drawn_for(u.lost(now, &LOST), 1));
        assert_eq!(u.current(), Some("hub"));
        assert!(drawn_for(u.lost(now, &LOST), 2));
        assert!(u.on_first(), "in turn, back to the first");
        for n in 3..100 {
            assert!(drawn_for(u.lost(now, &LOST), n));
        }
        let capped = u.lost(now, &LOST);
        assert!(capped >= BACKOFF_MAX / 2 && capped <= BACKOFF_MAX);
    }

    #[test]
    fn an_upstream_that_welcomes_then_fails_every_session_is_tried_less_and_less_often() {
        // What a wrong trainer key or another run looks like: each session is welcomed,
        // then refused at its first Offer. Opening alone resets nothing.
        let mut now = Instant::now();
        let mut u = Upstreams::new(vec!["hub"], None, 9);
        let mut tries = 0;
        let start = now;
        while now < start + Duration::from_secs(60) {
            u.connected(now);
            now += Duration::from_millis(20) + u.lost(now + Duration::from_millis(20), &LOST);
            tries += 1;
        }
        assert!(tries < 25, "{tries} sessions in a minute");
        // A session that worked for a while starts the backoff over; so does a delivery.
        u.connected(now);
        assert!(drawn_for(u.lost(now + HEALTHY_SESSION, &LOST), 1));
        u.lost(now, &LOST);
        u.connected(now);
        u.delivered();
        assert!(drawn_for(u.lost(now, &LOST), 1));
    }

    #[test]
    fn a_session_on_a_fallback_returns_to_the_first_between_versions() {
        let now = Instant::now();
        let mut u = upstreams(Some(AFTER));
        u.lost(now, &LOST);
        u.connected(now);
        assert_eq!(u.return_at(), Some(now + AFTER));
        assert!(!u.due(now + AFTER / 2, true), "not yet");
        // Due while part of a version is held: it waits for the receiver, not a timer.
        assert!(!u.due(now + AFTER, false));
        assert_eq!(u.return_at(), None);
        assert!(!u.due(now + AFTER, false));
        go_back(&mut u, now + AFTER);
        // Settled on the first: no return to schedule.
        u.connected(now + AFTER);
        assert_eq!(u.return_at(), None);
        assert!(!u.due(now + 10 * AFTER, true));
    }

    #[test]
    fn failed_returns_wait_longer_each_time_up_to_a_bound_and_a_working_one_resets() {
        let now = Instant::now();
        let mut u = upstreams(Some(AFTER));
        u.lost(now, &LOST);
        let mut waits = Vec::new();
        for _ in 0..7 {
            u.connected(now);
            waits.push(u.return_at().unwrap() - now);
            go_back(&mut u, now + 100 * AFTER);
            // The first upstream is still down: its session ends before a Welcome.
            u.lost(now + 100 * AFTER, &LOST);
            assert!(!u.on_first());
        }
        let factors: Vec<u64> = waits.iter().map(|w| w.as_secs() / 30).collect();
        assert_eq!(factors, [1, 2, 4, 8, 16, 16, 16]);
        // Welcomed, then lost within `return_after` with nothing delivered: failed too.
        let late = now + 100 * AFTER;
        u.return_factor = 2;
        u.connected(now);
        go_back(&mut u, late);
        u.connected(now);
        u.lost(now + AFTER / 2, &LOST);
        u.connected(now);
        assert_eq!(u.return_at(), Some(now + 4 * AFTER));
        // A return that delivers a version has worked.
        go_back(&mut u, late);
        u.connected(now);
        u.delivered();
        u.lost(now, &LOST);
        u.connected(now);
        assert_eq!(u.return_at(), Some(now + AFTER));
        // So has one that lasts `return_after`, whether or not versions came.
        u.return_factor = 8;
        go_back(&mut u, late);
        u.connected(now);
        u.lost(now + AFTER, &LOST);
        u.connected(now);
        assert_eq!(u.return_at(), Some(now + AFTER));
        // But not one given up for bringing nothing of a committed version, however
        // long it lasted.
        go_back(&mut u, late);
        u.connected(now);
        let behind = SessionEnd::Behind {
            version: 3,
            waited: 2 * AFTER,
        };
        u.lost(now + 2 * AFTER, &behind);
        u.connected(now);
        assert_eq!(u.return_at(), Some(now + 2 * AFTER));
    }

    #[test]
    fn one_upstream_none_or_no_return_after_never_returns_nor_panics() {
        let now = Instant::now();
        let mut single = Upstreams::new(vec!["hub"], Some(AFTER), 1);
        single.lost(now, &LOST);
        assert!(single.on_first());
        single.connected(now);
        assert_eq!(single.return_at(), None);
        let mut never = upstreams(None);
        never.lost(now, &LOST);
        never.connected(now);
        assert_eq!(never.return_at(), None);
        assert!(!never.due(now + 100 * AFTER, true));
        // A wait past what an instant can hold is no return.
        let mut forever = upstreams(Some(Duration::MAX));
        forever.lost(now, &LOST);
        forever.connected(now);
        assert_eq!(forever.return_at(), None);
        let mut none: Upstreams<&str> = Upstreams::new(vec![], Some(AFTER), 1);
        assert_eq!(none.current(), None);
        assert!(drawn_for(none.lost(now, &LOST), 1));
    }
}
