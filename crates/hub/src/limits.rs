//! What one peer, and all of them together, may hold of the hub: connections, requests
//! in progress, and the time each wait may take ([`Limits`]); and the counter of slots
//! held per key ([`Counts`]) that enforces the caps.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Longest time to handle one request, from its head to the response: reading the
/// body (8 MiB at 10 Mbit/s takes under 7 s), waiting for a slot, and the call, whose
/// commit includes an fsync. A request that ran out of time gets a 408; its call may
/// still have taken effect, so clients retry (a retried result is then `duplicate`).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest time a connection may take to send a request head, and longest time an
/// idle keep-alive connection stays open.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest time a response may wait for the peer to take any of its bytes: a client that
/// stops reading would otherwise hold its connection, and the memory of the responses
/// queued behind, for as long as it likes. Progress restarts the wait, so a slow but
/// moving link is never cut.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(20);

/// Longest time a TLS handshake may take from the accepted connection: a round trip and
/// two certificate verifications, a fraction of a second across continents.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most requests handled at once; it bounds the memory held by request bodies
/// (`MAX_CONCURRENT_REQUESTS * MAX_BODY_BYTES`, about 516 MiB) and the blocking threads
/// waiting on the core. Further requests wait for a slot.
pub const MAX_CONCURRENT_REQUESTS: usize = 64;

/// The caps and timeouts of a served hub (docs/control-api.md, "Limits").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// See [`HANDSHAKE_TIMEOUT`].
    pub handshake_timeout: Duration,
    /// See [`HEADER_READ_TIMEOUT`].
    pub header_read_timeout: Duration,
    /// See [`REQUEST_TIMEOUT`].
    pub request_timeout: Duration,
    /// See [`WRITE_TIMEOUT`].
    pub write_timeout: Duration,
    /// Open connections, all peers together; more are closed at once.
    pub max_connections: usize,
    /// Open connections from one source address, counted from the accept, before the
    /// handshake: what an unauthenticated peer can hold.
    pub max_connections_per_address: usize,
    /// Open connections of one identity (certificate), counted after the handshake.
    pub max_connections_per_identity: usize,
    /// See [`MAX_CONCURRENT_REQUESTS`].
    pub max_requests: usize,
    /// Requests one peer (its identity, or its address over plaintext) may have in
    /// progress; one more is refused at once (429), so that no peer can take every slot
    /// of [`Limits::max_requests`].
    pub max_requests_per_peer: usize,
}

impl Default for Limits {
    /// Sized for the control core's largest membership (1,024 actors), each with a few
    /// pooled connections (heartbeats, version reports and claims run side by side).
    fn default() -> Limits {
        Limits {
            handshake_timeout: HANDSHAKE_TIMEOUT,
            header_read_timeout: HEADER_READ_TIMEOUT,
            request_timeout: REQUEST_TIMEOUT,
            write_timeout: WRITE_TIMEOUT,
            max_connections: 4096,
            // A region's actors may share one NAT address.
            max_connections_per_address: 256,
            max_connections_per_identity: 16,
            max_requests: MAX_CONCURRENT_REQUESTS,
            max_requests_per_peer: 8,
        }
    }
}

/// Slots held per key, each bounded: a connection or request takes one for as long as
/// it lives.
#[derive(Debug)]
pub(crate) struct Counts<K: Eq + Hash> {
    held: Arc<Mutex<HashMap<K, usize>>>,
}

impl<K: Eq + Hash> Default for Counts<K> {
    fn default() -> Counts<K> {
        Counts {
            held: Arc::default(),
        }
    }
}

impl<K: Eq + Hash + Clone> Counts<K> {
    /// A slot for `key`, unless `max` are held already.
    pub(crate) fn try_take(&self, key: K, max: usize) -> Option<Slot<K>> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(key.clone()).or_default();
        if *count >= max {
            // No slot: a key with none held is not kept.
            if *count == 0 {
                held.remove(&key);
            }
            return None;
        }
        *count += 1;
        Some(Slot {
            held: Arc::clone(&self.held),
            key,
        })
    }
}

/// A held slot, given back when dropped. Keys with no slot held are forgotten, so the
/// map holds only live peers.
#[derive(Debug)]
pub(crate) struct Slot<K: Eq + Hash> {
    held: Arc<Mutex<HashMap<K, usize>>>,
    key: K,
}

impl<K: Eq + Hash> Drop for Slot<K> {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_per_key_and_given_back_on_drop() {
        let counts = Counts::default();
        let a1 = counts.try_take("a", 2).unwrap();
        let _a2 = counts.try_take("a", 2).unwrap();
        assert!(counts.try_take("a", 2).is_none());
        let b = counts.try_take("b", 2).unwrap();
        drop(a1);
        assert!(counts.try_take("a", 2).is_some());
        drop(b);
        assert!(counts.try_take("c", 0).is_none());
        // Only "a" still holds a slot.
        assert_eq!(counts.held.lock().unwrap().len(), 1);
    }
}
