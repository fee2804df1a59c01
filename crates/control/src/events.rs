//! Notifications the core produces for its driver, drained with
//! [`crate::ControlPlane::poll_event`].
//!
//! Events tell the driver what changed (to log it, push a relay change to a region, or
//! wake the trainer); they are never the only record of anything. The authoritative
//! state can always be queried, which is why the queue may drop its oldest entries
//! when the driver falls behind instead of growing without limit.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::restore::RestoreError;
use crate::values::{ActorId, LeaseId, Region, StepId, Version};

/// Something the driver may want to act on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// A lease ran out before its result arrived; its prompt is back in the pool.
    LeaseExpired {
        /// The lease that ran out.
        lease: LeaseId,
        /// The actor that held it.
        holder: ActorId,
    },
    /// An actor left the membership; its unfinished leases went back to the pool at once.
    ActorDeparted {
        /// The actor that left.
        actor: ActorId,
        /// How it left.
        reason: Departure,
        /// How many live leases it gave back.
        leases_returned: u32,
    },
    /// A region's relay changed; `None` means its actors must fetch from the hub or a
    /// peer relay until a relay-capable actor joins.
    RelayChanged {
        /// The region.
        region: Region,
        /// Its new relay.
        relay: Option<ActorId>,
    },
    /// A step finished: the trainer can consume its accepted results.
    StepCompleted {
        /// The step.
        step: StepId,
        /// The version its results were generated on.
        version: Version,
        /// Results accepted.
        accepted: u32,
        /// Prompts posted.
        batch_size: u32,
        /// Whether it finished under the partial-batch policy.
        partial: bool,
    },
}

/// How an actor left.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Departure {
    /// It said goodbye.
    Graceful,
    /// Its machine is being reclaimed (spot preemption notice).
    Preempted,
    /// It stopped sending heartbeats.
    HeartbeatTimeout,
}

/// Undelivered events, oldest first, bounded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct EventQueue {
    pending: VecDeque<Event>,
    max_pending: u32,
    dropped: u64,
}

impl EventQueue {
    /// An empty queue holding at most `max_pending` events.
    pub(crate) fn new(max_pending: u32) -> EventQueue {
        EventQueue {
            pending: VecDeque::new(),
            max_pending,
            dropped: 0,
        }
    }

    /// Queues `event`, dropping the oldest one if the queue is full.
    pub(crate) fn push(&mut self, event: Event) {
        let max_pending = usize::try_from(self.max_pending)
            .unwrap_or(usize::MAX)
            .max(1);
        while self.pending.len() >= max_pending {
            self.pending.pop_front();
            self.dropped += 1;
        }
        self.pending.push_back(event);
    }

    /// The oldest undelivered event.
    pub(crate) fn pop(&mut self) -> Option<Event> {
        self.pending.pop_front()
    }

    /// Checks a restored queue against the configured bound.
    pub(crate) fn check(&self, max_pending_events: u32) -> Result<(), RestoreError> {
        let too_many = self.pending.len() > usize::try_from(self.max_pending).unwrap_or(usize::MAX);
        if self.max_pending != max_pending_events || too_many {
            return Err(RestoreError::EventQueue {
                pending: self.pending.len(),
                bound: self.max_pending,
                max: max_pending_events,
            });
        }
        Ok(())
    }

    /// How many events were dropped because the queue was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expired(job: u32) -> Event {
        let lease = LeaseId {
            step: StepId(1),
            job,
            attempt: 0,
        };
        Event::LeaseExpired {
            lease,
            holder: ActorId(1),
        }
    }

    #[test]
    fn a_full_queue_drops_its_oldest_events_and_counts_them() {
        let mut queue = EventQueue::new(3);
        for job in 0..5 {
            queue.push(expired(job));
        }
        assert_eq!(queue.dropped(), 2);
        let delivered: Vec<Event> = std::iter::from_fn(|| queue.pop()).collect();
        assert_eq!(delivered, [expired(2), expired(3), expired(4)]);
    }
}
