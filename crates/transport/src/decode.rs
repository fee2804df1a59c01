//! Where actors decode segments: a pool of threads at a lower priority than the process
//! (nice +10 on Linux), so a node answers its sockets and an engine generates before a
//! delta is decoded.
//!
//! Nodes may share one pool (several actors in one process: benchmarks, a local run).
//! It then takes turns between them, one segment each, instead of first come first
//! served: with a whole delta on hand at once, the nodes progress together and finish
//! together, as they would on machines of their own, instead of one after another. And
//! the cores see one thread each, not a pool per node competing for them.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::node::TransportError;

type Job = Box<dyn FnOnce() + Send>;

pub struct DecodePool {
    threads: rayon::ThreadPool,
    turns: Mutex<Turns>,
    next_member: AtomicU64,
}

/// Jobs waiting, by member, and the order in which members with jobs take their turn.
#[derive(Default)]
struct Turns {
    order: VecDeque<u64>,
    waiting: HashMap<u64, VecDeque<Job>>,
}

impl std::fmt::Debug for DecodePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodePool")
            .field("threads", &self.threads.current_num_threads())
            .finish()
    }
}

impl DecodePool {
    /// A pool of `threads` (one per core when `None`).
    pub fn new(threads: Option<usize>) -> Result<Arc<DecodePool>, TransportError> {
        let threads =
            threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("decode-{i}"))
            .start_handler(|_| lower_this_threads_priority())
            .build()
            .map_err(|e| TransportError::Pool(e.to_string()))?;
        Ok(Arc::new(DecodePool {
            threads,
            turns: Mutex::new(Turns::default()),
            next_member: AtomicU64::new(0),
        }))
    }

    /// A new member's key: each node that decodes on the pool takes one.
    pub(crate) fn member(&self) -> u64 {
        self.next_member.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs `job` on the pool in `member`'s next turn. Its own parallel work (a
    /// segment's chunks) runs on the pool's threads too.
    pub(crate) fn submit(self: &Arc<Self>, member: u64, job: impl FnOnce() + Send + 'static) {
        {
            let mut turns = self.turns.lock().expect("the turns are never poisoned");
            let queue = turns.waiting.entry(member).or_default();
            queue.push_back(Box::new(job));
            if queue.len() == 1 {
                turns.order.push_back(member);
            }
        }
        // One run per job submitted, each taking whichever job's turn it is then.
        let pool = self.clone();
        self.threads.spawn_fifo(move || {
            if let Some(job) = pool.next_job() {
                job();
            }
        });
    }

    fn next_job(&self) -> Option<Job> {
        let mut turns = self.turns.lock().expect("the turns are never poisoned");
        let member = turns.order.pop_front()?;
        let queue = turns.waiting.get_mut(&member)?;
        let job = queue.pop_front();
        if queue.is_empty() {
            turns.waiting.remove(&member);
        } else {
            turns.order.push_back(member);
        }
        job
    }
}

/// The bytes of segments a node has handed to its decodes and that are not decoded yet,
/// against [`crate::Limits::max_decode_backlog_bytes`]. Segments can cross a fast link
/// faster than a loaded machine decodes them; past the limit the node reads no more from
/// its upstreams until decodes catch up, so TCP holds the sender back instead of the node
/// holding the model again in segments waiting for their turn.
#[derive(Debug)]
pub(crate) struct DecodeBacklog {
    bytes: AtomicU64,
    limit: u64,
    drained: Notify,
}

impl DecodeBacklog {
    pub(crate) fn new(limit: u64) -> Arc<DecodeBacklog> {
        Arc::new(DecodeBacklog {
            bytes: AtomicU64::new(0),
            limit,
            drained: Notify::new(),
        })
    }

    /// A segment of `bytes` goes to the decode pool.
    pub(crate) fn submitted(&self, bytes: u64) {
        self.bytes.fetch_add(bytes, Ordering::SeqCst);
    }

    /// A segment of `bytes` is decoded (or failed to).
    pub(crate) fn decoded(&self, bytes: u64) {
        let before = self.bytes.fetch_sub(bytes, Ordering::SeqCst);
        if before - bytes <= self.limit {
            self.drained.notify_waiters();
        }
    }

    /// Returns once the backlog is within its limit.
    pub(crate) async fn room(&self) {
        loop {
            // Registered before the check, so a decode finishing between the two wakes it.
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.bytes.load(Ordering::SeqCst) <= self.limit {
                return;
            }
            drained.await;
        }
    }
}

/// Decoding is throughput work that must never delay a node's latency-bound work; the
/// scheduler still gives it every idle cycle.
fn lower_this_threads_priority() {
    #[cfg(target_os = "linux")]
    {
        const DECODE_NICE: libc::c_int = 10;
        // Linux keeps a nice value per thread: this changes the calling one only.
        // SAFETY: plain system calls on the calling thread, no memory is passed.
        let outcome = unsafe {
            let thread = libc::gettid() as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, thread, DECODE_NICE)
        };
        if outcome != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "decode threads keep their priority");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::sync::mpsc;
    use std::task::{Context, Poll, Waker};

    fn poll_once(future: std::pin::Pin<&mut impl Future<Output = ()>>) -> Poll<()> {
        future.poll(&mut Context::from_waker(Waker::noop()))
    }

    /// Reading waits while more than the limit waits to be decoded, and goes on once
    /// decodes bring it back within the limit.
    #[test]
    fn a_backlog_over_its_limit_holds_reading_until_decodes_drain_it() {
        let backlog = DecodeBacklog::new(100);
        backlog.submitted(100);
        assert!(
            poll_once(std::pin::pin!(backlog.room())).is_ready(),
            "at the limit"
        );
        backlog.submitted(60);
        let mut room = std::pin::pin!(backlog.room());
        assert!(poll_once(room.as_mut()).is_pending());
        backlog.decoded(30);
        assert!(poll_once(room.as_mut()).is_pending(), "still 130 bytes");
        backlog.decoded(60);
        assert!(poll_once(room.as_mut()).is_ready());
    }

    /// Jobs of three members queued before any runs come out one member at a time, in
    /// turn, whatever order they were queued in.
    #[test]
    fn members_take_turns() {
        let pool = DecodePool::new(Some(1)).unwrap();
        let (holder, a, b, c) = (pool.member(), pool.member(), pool.member(), pool.member());
        let (done_tx, done) = mpsc::channel();
        // Hold the only thread until every job is queued.
        let (started_tx, started) = mpsc::channel();
        let (release_tx, release) = mpsc::channel::<()>();
        pool.submit(holder, move || {
            started_tx.send(()).unwrap();
            release.recv().unwrap();
        });
        started.recv().unwrap();
        for (member, name, count) in [(a, 'a', 3), (b, 'b', 3), (c, 'c', 2)] {
            for _ in 0..count {
                let done_tx = done_tx.clone();
                pool.submit(member, move || done_tx.send(name).unwrap());
            }
        }
        release_tx.send(()).unwrap();
        let order: String = (0..8).map(|_| done.recv().unwrap()).collect();
        assert_eq!(order, "abcabcab");
    }
}
