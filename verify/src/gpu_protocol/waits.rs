//! The error word (common.cuh `failed`, `report_error`, `report_timeout`, `peer_bad`) and the
//! bounded waits of a call without shrink mode: for a signal with the call's tag (`wait_signal`;
//! `wait_signal_pre` after a pre-load) and for an ack (`wait_ack`), each stopped by the error
//! word and bounded by a `Deadline`; and the wait of a report that lost the claim, for the
//! winner's code (bounded by [`CLAIM_WAIT`]).

use std::cell::Cell;
use std::time::Duration;

use ep_reference::sync::{fence, AtomicU64, Deadline, Ordering};

use crate::gpu_protocol::orderings::{tag_matches, ACK_LOAD, RELAXED, SIGNAL_LOAD};
use crate::gpu_protocol::state::{ErrorWord, Group, Launch, WaitEnd};
use crate::gpu_protocol::words::{
    is_poison, sig_tag, ERR_PEER_DATA, ERR_PEER_FAILED, ERR_TIMEOUT, SIG_COUNT_BITS,
    SIG_COUNT_MASK, SIG_POISON,
};

/// common.cuh `failed`: `ld_volatile_u32(err) != 0`.
pub(crate) fn failed(e: &ErrorWord) -> bool {
    e.code.load(RELAXED) != 0
}

/// The bound of a claim loser's wait in [`report_error`], the kernel's 100 us
/// ("`globaltimer() - t0 < 100000ull`"): under loom 2 polls past the first (a [`Deadline`] of
/// N ms is N polls), with std 2 ms. A fixed bound, as the kernel's: not the launch's
/// `timeout_ns`, which may never expire.
///
/// The winner has nothing left to do but its six words, its fence and its `atomicExch`, with
/// no wait in between, so one poll after the loser's first yield would do whenever loom runs
/// the winner there. But loom can starve the winner: a preemption away from it before its
/// `atomicExch`, then one per further poll of the loser (or a step of a third thread that
/// yields, blocks or ends in between), so that a bound of any N polls runs out in some
/// interleaving at a large enough preemption bound (in `fault_two_ranks_one_device_both_time_out`
/// at LOOM_MAX_PREEMPTIONS=4, 3 polls past the first still run out, 4 no longer). Nor can the
/// wait be unbounded: the loser and another waiter of the same device whose bound never
/// expires would let loom explore the two yielding to each other for ever while the winner
/// waits to be scheduled. So the bound is small, and a wait that runs out is what the kernel
/// does when its winner stalls for the whole 100 us between its claim and its `atomicExch`:
/// the loser goes on without having seen the code. The model records it
/// ([`BlockReport::claim_unseen`]), and the tests' `check_exit` excuses that interleaving, and
/// only that one, for a last block out that misses the failure.
///
/// [`BlockReport::claim_unseen`]: crate::gpu_protocol::BlockReport::claim_unseen
pub(crate) const CLAIM_WAIT: Duration = Duration::from_millis(2);

/// What a thread's reports did with the claim since its block's last [`take_claim`]: no
/// kernel state, the model's record for a [`BlockReport`] (a block is one thread, `finish`
/// takes it at the block's end).
///
/// [`BlockReport`]: crate::gpu_protocol::BlockReport
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ClaimRecord {
    /// A report lost the claim and waited for the winner's code.
    pub(crate) lost: bool,
    /// ... and the wait ran out before the code was seen.
    pub(crate) unseen: bool,
}

#[cfg(ep_loom)]
loom::thread_local! {
    static CLAIM: Cell<ClaimRecord> = Cell::new(ClaimRecord::default());
}
#[cfg(not(ep_loom))]
std::thread_local! {
    static CLAIM: Cell<ClaimRecord> = Cell::new(ClaimRecord::default());
}

/// This thread's [`ClaimRecord`] since the last call, reset.
pub(crate) fn take_claim() -> ClaimRecord {
    CLAIM.with(Cell::take)
}

/// common.cuh `report_error_at` (`report_error`): the first error of the device writes the
/// details, then raises the code; a later one waits, bounded, until it sees the code raised,
/// so that whoever reported sees `failed(p)` from then on: `last_block_out`
/// counts a block as failed by what it sees, and a block of another rank of the same device
/// may hold the claim.
pub(crate) fn report_error(e: &ErrorWord, code: u32, words: [u32; 6]) {
    // if (atomicCAS(w + 7, 0u, 1u) == 0u)
    if e.claim.compare_exchange(0, 1, RELAXED, RELAXED).is_ok() {
        // w[1] = a; ... w[6] = f;
        // SAFETY: only the claim's one winner writes the row, once; the host reads it after
        // every block of the launch ended.
        unsafe {
            e.fields.with_row_mut(0, |b| {
                for (i, w) in words.iter().enumerate() {
                    b[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
                }
            })
        }
        // __threadfence_system();
        fence(Ordering::SeqCst);
        // atomicExch(w, code);
        e.code.swap(code as u64, RELAXED);
    } else {
        // (mutant gpu_loser_no_wait: no wait, as before 5b0efe0)
        #[cfg(not(ep_mutant = "gpu_loser_no_wait"))]
        loser_wait(e);
    }
}

/// `report_error_at`'s wait of a report that lost the claim ("`} else {`" of the claim's
/// `if`): until the code is nonzero, at most [`CLAIM_WAIT`].
#[cfg_attr(ep_mutant = "gpu_loser_no_wait", allow(dead_code))]
fn loser_wait(e: &ErrorWord) {
    // const u64 t0 = globaltimer();
    let deadline = Deadline::after(CLAIM_WAIT);
    // while (ld_volatile_u32(w) == 0u && globaltimer() - t0 < 100000ull) {}
    let seen = deadline.spin_until(|| failed(e).then_some(())).is_some();
    CLAIM.with(|c| {
        let was = c.get();
        c.set(ClaimRecord {
            lost: true,
            unseen: was.unseen || !seen,
        })
    });
}

/// common.cuh `report_timeout`: rank, peer, phase, call (low), waited us, call (high).
pub(crate) fn report_timeout(
    e: &ErrorWord,
    rank: usize,
    peer: usize,
    phase: u32,
    call: u64,
    waited: u64,
) {
    let words = [
        rank as u32,
        peer as u32,
        phase,
        call as u32,
        (waited * 1000) as u32,
        (call >> 32) as u32,
    ];
    report_error(e, ERR_TIMEOUT, words);
}

/// common.cuh `report_peer_failed`: rank, peer, phase, call (low), 0, call (high).
pub(crate) fn report_peer_failed(e: &ErrorWord, rank: usize, peer: usize, phase: u32, call: u64) {
    let words = [
        rank as u32,
        peer as u32,
        phase,
        call as u32,
        0,
        (call >> 32) as u32,
    ];
    report_error(e, ERR_PEER_FAILED, words);
}

/// common.cuh `peer_bad`: a peer-supplied `value` outside [0, limit] is reported.
pub(crate) fn peer_bad(
    e: &ErrorWord,
    rank: usize,
    peer: usize,
    field: u32,
    value: i64,
    limit: i64,
) -> bool {
    if (0..=limit).contains(&value) {
        return false;
    }
    let words = [
        rank as u32,
        peer as u32,
        field,
        value as u32,
        0,
        limit as u32,
    ];
    report_error(e, ERR_PEER_DATA, words);
    true
}

/// common.cuh `wait_signal`: waits until the word carries this call's tag; returns its count.
#[allow(clippy::too_many_arguments)]
pub(crate) fn wait_signal(
    g: &Group,
    kp: &Launch,
    addr: &AtomicU64,
    epoch: u64,
    rank: usize,
    peer: usize,
    phase: u32,
) -> Result<u32, WaitEnd> {
    let e = g.err(rank);
    // u64 t0 = globaltimer();
    let deadline = Deadline::after(kp.timeout);
    // const u64 tag = sig_tag(epoch);
    let tag = sig_tag(epoch);
    let got = deadline.spin_until(|| {
        // u64 v = ld_acquire(p, addr);
        let v = addr.load(SIGNAL_LOAD);
        // if ((v >> SIG_COUNT_BITS) == tag && (v & SIG_COUNT_MASK) != SIG_POISON) return (long long)(v & SIG_COUNT_MASK);
        if tag_matches(v >> SIG_COUNT_BITS, tag) && (v & SIG_COUNT_MASK) != SIG_POISON as u64 {
            return Some(Ok((v & SIG_COUNT_MASK) as u32));
        }
        // if (is_poison(v)) { report_peer_failed(p, rank, peer, phase, epoch); return -1; }
        if is_poison(v) {
            report_peer_failed(e, rank, peer, phase, epoch);
            return Some(Err(WaitEnd::PeerFailed));
        }
        // if ((++spins & 63u) == 0u) { if (failed(p)) return -1; ... }
        if failed(e) {
            return Some(Err(WaitEnd::SawError));
        }
        None
    });
    got.unwrap_or_else(|| {
        // if (now - t0 > p.timeout_ns) { report_timeout(p, rank, peer, phase, epoch, now - t0); return -1; }
        report_timeout(e, rank, peer, phase, epoch, deadline.waited_ms());
        Err(WaitEnd::TimedOut)
    })
}

/// common.cuh `wait_signal_pre`: [`wait_signal`] whose first acquire load of `addr` (`v0`) was
/// made at kernel start (batched dispatch's receive half: hook.rs `preload_signals`). A word of
/// this call already in is taken from `v0` with no further load; a stale one (an earlier call's
/// tag) or the poison go to `wait_signal`, which loads the word again (and reports the poison).
#[allow(clippy::too_many_arguments)]
pub(crate) fn wait_signal_pre(
    g: &Group,
    kp: &Launch,
    addr: &AtomicU64,
    v0: u64,
    epoch: u64,
    rank: usize,
    peer: usize,
    phase: u32,
) -> Result<u32, WaitEnd> {
    // if ((v0 >> SIG_COUNT_BITS) == sig_tag(epoch) && (v0 & SIG_COUNT_MASK) != SIG_POISON) return (long long)(v0 & SIG_COUNT_MASK);
    if preload_takes(v0, epoch) {
        return Ok((v0 & SIG_COUNT_MASK) as u32);
    }
    // return wait_signal(p, addr, epoch, rank, peer, phase);
    wait_signal(g, kp, addr, epoch, rank, peer, phase)
}

/// `wait_signal_pre`'s test of the pre-loaded word: "`(v0 >> SIG_COUNT_BITS) == sig_tag(epoch)
/// && (v0 & SIG_COUNT_MASK) != SIG_POISON`", this call's signal.
pub(crate) fn preload_takes(v0: u64, epoch: u64) -> bool {
    tag_matches(v0 >> SIG_COUNT_BITS, sig_tag(epoch)) && (v0 & SIG_COUNT_MASK) != SIG_POISON as u64
}

/// common.cuh `wait_ack`: waits until the ack word is at least `need` (u64 epochs).
#[allow(clippy::too_many_arguments)]
pub(crate) fn wait_ack(
    g: &Group,
    kp: &Launch,
    addr: &AtomicU64,
    need: u64,
    call: u64,
    rank: usize,
    peer: usize,
    phase: u32,
) -> Result<(), WaitEnd> {
    let e = g.err(rank);
    let deadline = Deadline::after(kp.timeout);
    let got = deadline.spin_until(|| {
        // u64 v = ld_acquire(p, addr); if (v >= need) return true;
        if addr.load(ACK_LOAD) >= need {
            return Some(Ok(()));
        }
        // if (failed(p)) return false;
        if failed(e) {
            return Some(Err(WaitEnd::SawError));
        }
        None
    });
    got.unwrap_or_else(|| {
        report_timeout(e, rank, peer, phase, call, deadline.waited_ms());
        Err(WaitEnd::TimedOut)
    })
}
