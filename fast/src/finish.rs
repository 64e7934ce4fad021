//! The finish counter of docs/contract.md's signaling protocol: how the sender of a batch knows that
//! every staging worker is done with it.
//!
//! One counter per destination. The call's owner opens it with `FINISHED_SUM_TAG`; each staged
//! unit adds 1; the worker that counted the units adds `FINISHED_SUM_TAG - count`. The value
//! reaches `2 * FINISHED_SUM_TAG` exactly when both the count is known and that many units are
//! staged: before the counting add the value is `TAG + staged < 2 * TAG` (staged < TAG), after
//! it the value is `2 * TAG - (count - staged)`.
//!
//! # The ordering argument
//!
//! Each staging worker writes its rows with plain stores, then adds with `Release`. The counting
//! worker stores the count (`Relaxed`), then adds with `Release`. All of these are read-modify-
//! writes of one atomic, so each release add heads a release sequence that every later add
//! continues. The sender's `Acquire` load that reads `2 * TAG` reads the last add of all, and so
//! synchronizes with every release add before it: every staged row and the count happen-before
//! the sender's next step, the release [`Signal::post`](ep_reference::transport::Signal::post)
//! that hands the batch to the receiver. A `Relaxed` load here (the loom mutant
//! `finish_relaxed`) would let the sender post while a worker's rows are still unordered, and the
//! receiver could read them stale.
//!
//! The counter is reset by the call's owner after it has joined every worker (join orders all
//! of the workers' accesses before the reset), so the next call's opening add starts from 0.

use ep_reference::sync::{AtomicU64, Deadline, Ordering};

/// Added once when a call opens, and once by the counting worker.
pub const FINISHED_SUM_TAG: u64 = 1 << 32;

#[cfg(not(ep_mutant = "finish_relaxed"))]
const DONE_LOAD: Ordering = Ordering::Acquire;
/// Mutant for the loom self-check: the sender no longer acquires the workers' rows.
#[cfg(ep_mutant = "finish_relaxed")]
const DONE_LOAD: Ordering = Ordering::Relaxed;

#[derive(Debug)]
pub struct FinishCounter {
    value: AtomicU64,
    count: AtomicU64,
}

impl Default for FinishCounter {
    fn default() -> Self {
        FinishCounter::new()
    }
}

impl FinishCounter {
    pub fn new() -> FinishCounter {
        FinishCounter {
            value: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Marks the call as started. Runs before the workers start (their spawn orders it).
    pub fn open(&self) {
        self.value.fetch_add(FINISHED_SUM_TAG, Ordering::Relaxed);
    }

    /// `n` units are staged; their writes precede this in program order.
    pub fn staged(&self, n: u64) {
        self.value.fetch_add(n, Ordering::Release);
    }

    /// The counting worker's contribution: there are `count` units in all.
    pub fn counted(&self, count: u64) {
        debug_assert!(count < FINISHED_SUM_TAG);
        self.count.store(count, Ordering::Relaxed);
        self.value
            .fetch_add(FINISHED_SUM_TAG - count, Ordering::Release);
    }

    /// Waits until every unit is staged and returns the count, or `None` past the deadline.
    pub fn wait_done(&self, deadline: &Deadline) -> Option<u64> {
        deadline.spin_until(|| {
            (self.value.load(DONE_LOAD) == 2 * FINISHED_SUM_TAG)
                .then(|| self.count.load(Ordering::Relaxed))
        })
    }

    /// Back to zero for the next call; only after every worker of this call was joined.
    pub fn reset(&self) {
        self.value.store(0, Ordering::Relaxed);
    }
}
