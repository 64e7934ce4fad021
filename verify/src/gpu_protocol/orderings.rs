//! The orderings of the kernels' fences, loads and stores, each with the mutants that weaken it
//! (the module docs' "Mutants"), and the signal's tag match (`wait_signal`, `wait_signal_pre`;
//! mutant `gpu_tag_ge`): every role takes its orderings from here.

use ep_reference::sync::{fence, Ordering};

/// Batched dispatch's "`count_in(p, c.state + ST_SENT + KIND, 1u)`" (common.cuh
/// `count_in`: `atom.acq_rel`): publishes this block's stores to the block that completes the
/// count (release), and gives that block every earlier block's (acquire).
#[cfg(not(any(ep_mutant = "gpu_counter_release", ep_mutant = "gpu_counter_acquire")))]
pub(crate) const SENT_ADD: Ordering = Ordering::AcqRel;
// Mutant: the release half is gone; the last block no longer gets this block's stores.
#[cfg(ep_mutant = "gpu_counter_release")]
pub(crate) const SENT_ADD: Ordering = Ordering::Acquire;
// Mutant: the last block does not acquire the other blocks' stores.
#[cfg(ep_mutant = "gpu_counter_acquire")]
pub(crate) const SENT_ADD: Ordering = Ordering::Release;

/// Per-expert dispatch's `fence_rel(p)` of the block that owns the expert, before its signal.
#[inline]
pub(crate) fn fence_before_pe_signal() {
    #[cfg(not(ep_mutant = "gpu_signal_relaxed"))]
    fence(Ordering::AcqRel);
    #[cfg(ep_mutant = "gpu_signal_relaxed")]
    fence(Ordering::Acquire);
}

/// The `st_release(p, sig_bat(tab[d]) + rank, ...)` / `st_release(p, sig_pe(tab[d], R) + ...)`
/// of a signal word.
#[cfg(not(ep_mutant = "gpu_signal_relaxed"))]
pub(crate) const SIGNAL_STORE: Ordering = Ordering::Release;
#[cfg(ep_mutant = "gpu_signal_relaxed")]
pub(crate) const SIGNAL_STORE: Ordering = Ordering::Relaxed;

/// common.cuh `wait_signal`: `ld_acquire(p, addr)`.
#[cfg(not(ep_mutant = "gpu_wait_relaxed"))]
pub(crate) const SIGNAL_LOAD: Ordering = Ordering::Acquire;
#[cfg(ep_mutant = "gpu_wait_relaxed")]
pub(crate) const SIGNAL_LOAD: Ordering = Ordering::Relaxed;

/// Batched dispatch's receive half (stage 2): the pre-load of every NVLink source's signal at
/// kernel start, "`pre.sig0 = ld_acquire(p, sig_bat(me) + s)`", whose value
/// `wait_signal_pre` may take without another load (hook.rs `preload_signals`).
#[cfg(not(ep_mutant = "gpu_preload_relaxed"))]
pub(crate) const PRESIGNAL_LOAD: Ordering = Ordering::Acquire;
// Mutant: a relaxed pre-load; a signal taken from it orders none of the entries read after it.
#[cfg(ep_mutant = "gpu_preload_relaxed")]
pub(crate) const PRESIGNAL_LOAD: Ordering = Ordering::Relaxed;

/// frame.cuh `last_block_out`'s "`count_in(p, state + ST_EXIT + kind, ...)`" (`atom.acq_rel`):
/// publishes this block's reads to the last block out (release), and gives the last block out
/// every earlier block's before it acks (acquire).
#[cfg(not(any(ep_mutant = "gpu_exit_release", ep_mutant = "gpu_exit_acquire")))]
pub(crate) const EXIT_ADD: Ordering = Ordering::AcqRel;
// Mutant: a block's reads are no longer published to the last block out (hence to the ack).
#[cfg(ep_mutant = "gpu_exit_release")]
pub(crate) const EXIT_ADD: Ordering = Ordering::Acquire;
// Mutant: the last block out does not acquire the other blocks' reads before it acks.
#[cfg(ep_mutant = "gpu_exit_acquire")]
pub(crate) const EXIT_ADD: Ordering = Ordering::Release;

/// `frame_end`'s `st_release(p, ack_words(c.tab[s], p.R, KIND) + c.rank, c.epoch)` (per-expert:
/// `sig_pe_ack`) of an ack word.
#[cfg(not(ep_mutant = "gpu_ack_store_relaxed"))]
pub(crate) const ACK_STORE: Ordering = Ordering::Release;
#[cfg(ep_mutant = "gpu_ack_store_relaxed")]
pub(crate) const ACK_STORE: Ordering = Ordering::Relaxed;

/// common.cuh `wait_ack`: `ld_acquire(p, addr)`; also batched dispatch's pre-load
/// "`a.v0 = ld_acquire(p, ack_words(c.me, p.R, KIND) + a.peer)`".
#[cfg(not(ep_mutant = "gpu_ack_load_relaxed"))]
pub(crate) const ACK_LOAD: Ordering = Ordering::Acquire;
#[cfg(ep_mutant = "gpu_ack_load_relaxed")]
pub(crate) const ACK_LOAD: Ordering = Ordering::Relaxed;

/// `ld.volatile`, `atomicAdd`, `atomicCAS`, `atomicExch` and plain stores of state counters.
pub(crate) const RELAXED: Ordering = Ordering::Relaxed;

/// common.cuh `wait_signal`'s match, "`(v >> SIG_COUNT_BITS) == tag`", and `wait_signal_pre`'s
/// of the pre-loaded word, "`(v0 >> SIG_COUNT_BITS) == sig_tag(epoch)`": the word's tag must
/// equal this call's.
#[inline]
pub(crate) fn tag_matches(word_tag: u64, tag: u64) -> bool {
    #[cfg(not(ep_mutant = "gpu_tag_ge"))]
    return word_tag == tag;
    // Mutant: `>=`, as for acks; right for every pair of consecutive calls but the tag's wrap.
    #[cfg(ep_mutant = "gpu_tag_ge")]
    return word_tag >= tag;
}
