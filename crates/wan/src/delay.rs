//! The delay line: a FIFO that releases each packet a fixed delay after it entered,
//! bounded by bytes.
//!
//! Pure: time is an argument (`now`, the time since any fixed start), so tests drive it
//! without a clock.

use std::collections::VecDeque;
use std::time::Duration;

#[derive(Debug)]
pub struct DelayLine<T> {
    delay: Duration,
    capacity_bytes: usize,
    queued_bytes: usize,
    queue: VecDeque<Delayed<T>>,
}

#[derive(Debug)]
struct Delayed<T> {
    release_at: Duration,
    size_bytes: usize,
    item: T,
}

impl<T> DelayLine<T> {
    pub fn new(delay: Duration, capacity_bytes: usize) -> DelayLine<T> {
        DelayLine {
            delay,
            capacity_bytes,
            queued_bytes: 0,
            queue: VecDeque::new(),
        }
    }

    /// Queues `item` (of `size_bytes`) for release at `now + delay`, or gives it back if
    /// it would not fit. Releases stay in arrival order even if `now` goes backwards.
    pub fn push(&mut self, now: Duration, item: T, size_bytes: usize) -> Result<(), T> {
        if self.queued_bytes + size_bytes > self.capacity_bytes {
            return Err(item);
        }
        let release_at = match self.queue.back() {
            Some(last) => (now + self.delay).max(last.release_at),
            None => now + self.delay,
        };
        self.queued_bytes += size_bytes;
        self.queue.push_back(Delayed {
            release_at,
            size_bytes,
            item,
        });
        Ok(())
    }

    /// When the next packet is due, if any is queued.
    pub fn next_release(&self) -> Option<Duration> {
        self.queue.front().map(|delayed| delayed.release_at)
    }

    /// The oldest packet if it is due at `now`.
    pub fn pop_due(&mut self, now: Duration) -> Option<T> {
        if self.queue.front()?.release_at > now {
            return None;
        }
        let delayed = self.queue.pop_front()?;
        self.queued_bytes -= delayed.size_bytes;
        Some(delayed.item)
    }

    pub fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }

    /// Items queued: only the tests ask, the emulator bounds the line by bytes.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn releases_each_packet_exactly_one_delay_later() {
        let mut line = DelayLine::new(10 * MS, 1000);
        line.push(Duration::ZERO, 'a', 100).unwrap();
        line.push(3 * MS, 'b', 100).unwrap();
        assert_eq!(line.next_release(), Some(10 * MS));
        assert_eq!(line.pop_due(10 * MS - Duration::from_nanos(1)), None);
        assert_eq!(line.pop_due(10 * MS), Some('a'));
        assert_eq!(line.next_release(), Some(13 * MS));
        assert_eq!(line.pop_due(12 * MS), None);
        assert_eq!(line.pop_due(20 * MS), Some('b'));
        assert_eq!((line.next_release(), line.queued_bytes()), (None, 0));
        assert_eq!(line.len(), 0);
    }

    #[test]
    fn a_zero_delay_releases_at_once() {
        let mut line = DelayLine::new(Duration::ZERO, 1000);
        line.push(5 * MS, 1, 10).unwrap();
        assert_eq!(line.pop_due(5 * MS), Some(1));
    }

    #[test]
    fn refuses_what_does_not_fit_and_makes_room_on_release() {
        let mut line = DelayLine::new(MS, 250);
        line.push(Duration::ZERO, 1, 100).unwrap();
        line.push(Duration::ZERO, 2, 100).unwrap();
        assert_eq!(line.push(Duration::ZERO, 3, 51), Err(3));
        line.push(Duration::ZERO, 4, 50).unwrap();
        assert_eq!(line.queued_bytes(), 250);
        assert_eq!(line.pop_due(MS), Some(1));
        line.push(MS, 5, 100).unwrap();
        assert_eq!(line.len(), 3);
    }

    #[test]
    fn time_going_backwards_keeps_arrival_order() {
        let mut line = DelayLine::new(10 * MS, 1000);
        line.push(5 * MS, 'a', 1).unwrap();
        line.push(MS, 'b', 1).unwrap();
        assert_eq!(line.pop_due(15 * MS), Some('a'));
        assert_eq!(line.pop_due(15 * MS), Some('b'));
    }

    proptest! {
        /// Against a model: every accepted packet comes out in order, never before its
        /// arrival plus the delay, and the byte bound always holds.
        #[test]
        fn fifo_with_bounded_bytes(
            steps in proptest::collection::vec((0u64..5_000, 1usize..2_000, any::<bool>()), 1..200),
            delay_us in 0u64..10_000,
        ) {
            let delay = Duration::from_micros(delay_us);
            let mut line = DelayLine::new(delay, 16_000);
            let mut now = Duration::ZERO;
            let mut accepted = VecDeque::new();
            for (id, (advance_us, size, pop)) in steps.into_iter().enumerate() {
                now += Duration::from_micros(advance_us);
                if pop {
                    while let Some(released) = line.pop_due(now) {
                        let (expected, arrived) = accepted.pop_front().unwrap();
                        prop_assert_eq!(released, expected);
                        prop_assert!(arrived + delay <= now);
                    }
                    if let Some(next) = line.next_release() {
                        prop_assert!(next > now);
                    }
                } else if line.push(now, id, size).is_ok() {
                    accepted.push_back((id, now));
                } else {
                    prop_assert!(line.queued_bytes() + size > 16_000);
                }
                prop_assert!(line.queued_bytes() <= 16_000);
                prop_assert_eq!(line.len(), accepted.len());
            }
        }
    }
}
