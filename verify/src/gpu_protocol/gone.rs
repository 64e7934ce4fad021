//! A block's set of gone peers in shrink mode (shrink.cuh `s_gone`, `GONE_INIT`, `GONE0`,
//! `GONE_ADD`, `GONE_SNAPSHOT`, `GONE_LIVE`), in both builds (`peers::Build`).
//!
//! - **Narrow** (R <= 32): `s_gone` is one shared u32; thread 0 writes it at the start, waiting
//!   threads `atomicOr` into it, and every thread copies it into its register after a barrier
//!   (`gone = s_gone`). The model's block is one thread, so the set is a local of that thread
//!   ([`Gone`] without [`BlockShared`]), exactly as before the wide build.
//! - **Wide** (R > 32): W words in shared memory. Thread 0 fills `s_gone` and `s_gone0` at the
//!   start (`GONE_INIT`), then a `__syncthreads()`; a lost peer goes into its word of `s_gone`
//!   (`GONE_ADD`, `atomicOr`); after the barrier that ends a wait phase (`__syncthreads_or`),
//!   `GONE_SNAPSHOT` has thread `tid < W` copy word `tid` of `s_gone` into `s_gone1`, then a
//!   `__syncthreads()`, then every thread reads `s_gone1`. The model keeps thread 0 (which
//!   runs the whole block as in the narrow build, word 0's copy included) and adds one thread
//!   per word past the first ([`gone_word_thread`]), which the harness spawns with the block:
//!   each passes the barriers thread 0 passes and copies its word. `s_gone` words are atomics
//!   (relaxed: `atomicOr`, and the copy's plain read after the barrier); `s_gone0` and
//!   `s_gone1` are loom cells, so a read of a word that no barrier orders after its copy is a
//!   causality violation. A `__syncthreads_or` is a barrier whose outcome thread 0 (the
//!   model's only voter: the block's waits are its) publishes before it arrives.
//!
//! Barriers that order no access of these words (the routing's, the send's, the per-expert
//! receive loop's) are left out of the word threads' part: their accesses all come before
//! the snapshot's barrier, and thread 0's after it.

#[cfg(ep_loom)]
use loom::sync::{Condvar, Mutex};
#[cfg(not(ep_loom))]
use std::sync::{Condvar, Mutex};

use ep_reference::sync::{AtomicU64, SharedRows};

use crate::gpu_protocol::orderings::RELAXED;
use crate::gpu_protocol::peers::{Build, PeerSet, WideMutant};
use crate::gpu_protocol::shrink::masked_peers;
use crate::gpu_protocol::state::{Group, Kind, Launch, Rank};

/// Which `__syncthreads_or` a vote is for: after the ack waits ("`return
/// !__syncthreads_or(wait_acks<KIND>(...));`"), after batched dispatch's receive waits ("`return
/// !__syncthreads_or(bad);`", receive_signals).
pub(crate) const OR_ACKS: usize = 0;
pub(crate) const OR_RECEIVE: usize = 1;

/// One block's shared memory for its gone set in the wide build (shrink.cuh `s_gone`,
/// `s_gone0`, `s_gone1`), and its barrier. A new one per block and launch (shared memory does
/// not outlive its block).
pub struct BlockShared {
    kind: Kind,
    bits: u32,
    mutant: Option<WideMutant>,
    /// `s_gone[W]`: the live set.
    live: Vec<AtomicU64>,
    /// `s_gone0[W]`: the set at the block's start (a u32 per row).
    first: SharedRows,
    /// `s_gone1[W]`: the latest snapshot.
    snap: SharedRows,
    /// Arrivals at the block's barriers so far: every thread passes them in the same order, so
    /// barrier k is passed once `(k + 1) * W` have arrived. A lock and a condition variable
    /// (loom's under `--cfg ep_loom`): `bar.sync` orders every access of the block's threads
    /// before it before every access after it (the PTX memory model), as the lock's release
    /// and acquire do; and a thread blocked on it is no spin loop for loom to unroll.
    arrived: Mutex<u64>,
    all_in: Condvar,
    /// Thread 0's vote at each `__syncthreads_or` ([`OR_ACKS`], [`OR_RECEIVE`]).
    votes: [AtomicU64; 2],
}

impl BlockShared {
    /// A block of `g`'s wide build: W threads ([`BlockShared::threads`]).
    pub fn new(g: &Group) -> BlockShared {
        let build = g.setup.build;
        assert!(
            matches!(build, Build::Wide { .. }),
            "the narrow build has none"
        );
        let w = build.words(g.ranks.len());
        BlockShared {
            kind: g.setup.kind,
            bits: build.word_bits(),
            mutant: build.mutant(),
            live: (0..w).map(|_| AtomicU64::new(0)).collect(),
            first: SharedRows::new(w, 4),
            snap: SharedRows::new(w, 4),
            arrived: Mutex::new(0),
            all_in: Condvar::new(),
            votes: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    /// The model's threads of the block: W (thread 0 and one per word past the first).
    pub fn threads(&self) -> usize {
        self.live.len()
    }

    /// `__syncthreads()`: arrives, and waits until every thread arrived at the `passed`-th
    /// barrier of this thread (counting from 0), which it then has passed.
    fn barrier(&self, passed: &mut u64) {
        let all = (*passed + 1) * self.threads() as u64;
        let mut n = self.arrived.lock().expect("no thread panics holding it");
        *n += 1;
        if *n >= all {
            self.all_in.notify_all();
        }
        // Unbounded: a barrier does not time out (every thread of the block gets there).
        while *n < all {
            n = self.all_in.wait(n).expect("no thread panics holding it");
        }
        *passed += 1;
    }

    /// `GONE_SNAPSHOT`'s copy by thread `tid`: "`if (threadIdx.x < EP_MASK_WORDS)
    /// s_gone1[threadIdx.x] = s_gone[threadIdx.x]`".
    fn copy_word(&self, tid: usize) {
        // Mutant: only thread 0 copies (its word 0).
        if tid > 0 && self.mutant == Some(WideMutant::FirstWordOnly) {
            return;
        }
        let v = self.live[tid].load(RELAXED) as u32;
        write_word(&self.snap, tid, v);
    }

    /// `GONE_SNAPSHOT`'s barrier.
    fn snapshot_barrier(&self, passed: &mut u64) {
        // Mutant: no barrier between the copies and the reads.
        if self.mutant != Some(WideMutant::NoSnapshotBarrier) {
            self.barrier(passed);
        }
    }

    /// `__syncthreads_or` as a thread other than 0 passes it: thread 0's vote.
    fn vote(&self, which: usize, passed: &mut u64) -> bool {
        self.barrier(passed);
        self.votes[which].load(RELAXED) != 0
    }

    fn read_set(&self, rows: &SharedRows) -> PeerSet {
        let mut s = PeerSet::empty(self.bits);
        for i in 0..self.threads() {
            s.set_word(i, read_word(rows, i));
        }
        s
    }
}

fn write_word(rows: &SharedRows, i: usize, v: u32) {
    // SAFETY: word i of `s_gone0` / `s_gone1` is written by one thread of the block (thread 0 at
    // the start, thread i at a snapshot), between the barriers that order it after every read
    // of the word's previous value and before every read of this one; loom checks both.
    unsafe { rows.with_row_mut(i, |b| b.copy_from_slice(&v.to_le_bytes())) }
}

fn read_word(rows: &SharedRows, i: usize) -> u32 {
    // SAFETY: read after the barrier that follows the word's write (see `write_word`).
    unsafe { rows.with_rows(i, 1, |b| u32::from_le_bytes(b.try_into().expect("4 bytes"))) }
}

/// Thread `tid` (1..W) of a wide-build dispatch block: its part in the block's gone set (the
/// barriers around it, and its word's copy at each snapshot), in kernel order. Runs beside
/// thread 0's [`dispatch_block_in`] on the same [`BlockShared`].
///
/// [`dispatch_block_in`]: crate::gpu_protocol::dispatch_block_in
pub fn gone_word_thread(shared: &BlockShared, tid: usize) {
    assert!((1..shared.threads()).contains(&tid), "thread {tid}");
    let mut passed = 0;
    // GONE_INIT (thread 0); __syncthreads();
    shared.barrier(&mut passed);
    // return !__syncthreads_or(wait_acks<KIND>(...));
    if shared.vote(OR_ACKS, &mut passed) {
        return;
    }
    // GONE_SNAPSHOT(gone);  // masked, or lost at the acknowledgement
    shared.copy_word(tid);
    shared.snapshot_barrier(&mut passed);
    if shared.kind == Kind::Batched {
        // return !__syncthreads_or(bad);  (receive_signals)
        if shared.vote(OR_RECEIVE, &mut passed) {
            return;
        }
        // GONE_SNAPSHOT(gone);  // + the sources lost in this call
        shared.copy_word(tid);
        shared.snapshot_barrier(&mut passed);
    }
}

/// Thread 0's handle on its block's gone set.
pub(crate) struct Gone<'a> {
    /// The wide build's shared words; `None`: the narrow build.
    shared: Option<&'a BlockShared>,
    /// The narrow build's `s_gone`.
    live: PeerSet,
    /// Barriers thread 0 passed.
    passed: u64,
}

impl<'a> Gone<'a> {
    pub(crate) fn new(g: &Group, shared: Option<&'a BlockShared>) -> Gone<'a> {
        match (g.setup.build, shared) {
            (Build::Narrow, None) | (Build::Wide { .. }, Some(_)) => {}
            (b, s) => panic!("{b:?} with block memory: {}", s.is_some()),
        }
        Gone {
            shared,
            live: PeerSet::empty(g.setup.build.word_bits()),
            passed: 0,
        }
    }

    /// `GONE_INIT()` by thread 0 (`s_gone = masked_peers(p, me)`; wide: `masked_peers_into(p,
    /// me, s_gone)` and its copy into `s_gone0`), the `__syncthreads()` after it, and `GONE0()`:
    /// the peers masked at the block's start.
    pub(crate) fn init(&mut self, g: &Group, kp: &Launch, me: &Rank) -> PeerSet {
        let m = masked_peers(g, kp, me);
        let Some(sh) = self.shared else {
            self.live = m;
            return m;
        };
        for i in 0..sh.threads() {
            sh.live[i].store(m.word(i) as u64, RELAXED);
            write_word(&sh.first, i, m.word(i));
        }
        sh.barrier(&mut self.passed);
        sh.read_set(&sh.first)
    }

    /// `GONE_ADD(d)`: "`atomicOr(&s_gone, 1u << (d))`" (wide: "`atomicOr(&s_gone[(d) >> 5], 1u
    /// << ((d) & 31))`").
    pub(crate) fn add(&mut self, d: usize) {
        let Some(sh) = self.shared else {
            self.live.insert(d);
            return;
        };
        let (w, bit) = self.live.place(d);
        sh.live[w].fetch_or(bit as u64, RELAXED);
    }

    /// `__syncthreads_or(bad)` ([`OR_ACKS`] or [`OR_RECEIVE`]): thread 0's vote is the block's.
    pub(crate) fn sync_or(&mut self, which: usize, bad: bool) -> bool {
        if let Some(sh) = self.shared {
            sh.votes[which].store(bad as u64, RELAXED);
            sh.barrier(&mut self.passed);
        }
        bad
    }

    /// `GONE_SNAPSHOT(g)`: narrow "`g = s_gone`"; wide: thread 0 copies word 0, the barrier,
    /// then the read of every word of `s_gone1`.
    pub(crate) fn snapshot(&mut self) -> PeerSet {
        let Some(sh) = self.shared else {
            return self.live;
        };
        sh.copy_word(0);
        sh.snapshot_barrier(&mut self.passed);
        sh.read_set(&sh.snap)
    }

    /// `GONE_LIVE()` as thread 0 reads it (its own adds: the model's waits are all thread 0's).
    pub(crate) fn live(&self) -> PeerSet {
        let Some(sh) = self.shared else {
            return self.live;
        };
        let mut s = PeerSet::empty(sh.bits);
        for (i, w) in sh.live.iter().enumerate() {
            s.set_word(i, w.load(RELAXED) as u32);
        }
        s
    }
}
