//! A failed rank's call (poison.cuh, common.cuh `SIG_POISON`): every block reads its device's
//! error word at its start (`s_fail`); a block of a group that failed before the launch, or
//! whose input is bad, stores the poison of the call in every signal word it owes a peer and
//! sends nothing else, then ends as a failed call (epoch and acks as ever). Receivers take a
//! poison of any call for the peer's failure (`waits::wait_signal`, `shrink::wait_peer_signals`).
//!
//! Mutants: `gpu_no_failed_check` (no `s_fail`: a failed group's launch runs the call, and its
//! data is the model's [`STALE`](crate::gpu_protocol::STALE)), `gpu_no_poison` (the check, but
//! nothing stored: the peers wait out their bounds).

use crate::gpu_protocol::orderings::SIGNAL_STORE;
use crate::gpu_protocol::peers::{is_gone, PeerSet};
use crate::gpu_protocol::state::{Group, Kind, Launch};
use crate::gpu_protocol::waits::failed;
use crate::gpu_protocol::words::{signal_word, SIG_POISON};

/// The block's look at its device's error word at its start: whether the group had failed
/// before this launch (the truth, whatever the kernel does with it).
pub(crate) fn group_failed(g: &Group, rank: usize) -> bool {
    // s_fail = p.refused || failed(p);
    failed(g.err(rank))
}

/// What the block does with it: `s_fail` (mutant `gpu_no_failed_check`: never set).
pub(crate) fn s_fail(group_failed: bool) -> bool {
    #[cfg(not(ep_mutant = "gpu_no_failed_check"))]
    return group_failed;
    #[cfg(ep_mutant = "gpu_no_failed_check")]
    return {
        let _ = group_failed;
        false
    };
}

/// poison.cuh `poison_peers`: "`st_release(p, signal_slot(p, tab, kind, rank, d, i % nl), w)`"
/// with `w = signal_word(epoch, SIG_POISON)`, for every destination not gone at the block's
/// start (every local expert's word of the per-expert kind); none from the fault hook's rank.
pub(crate) fn poison_signals(g: &Group, kp: &Launch, rank: usize, epoch: u64, gone: PeerSet) {
    // if (p.stage == 2 || rank == p.fault_rank) return;
    if kp.fault_rank == Some(rank) {
        return;
    }
    let (r_n, l_n) = (g.ranks.len(), g.setup.local_experts);
    let words = match g.setup.kind {
        Kind::Batched => 1,
        Kind::PerExpert => l_n,
    };
    for d in g.dests(rank).filter(|&d| !is_gone(gone, d)) {
        for l in 0..words {
            // batched: sig_bat(tab[d]) + rank; per-expert: sig_pe(tab[d], R) + (u64)l * R + rank
            let w = match g.setup.kind {
                Kind::Batched => rank,
                Kind::PerExpert => l * r_n + rank,
            };
            #[cfg(not(ep_mutant = "gpu_no_poison"))]
            g.ranks[d].sig[w].store(signal_word(epoch, SIG_POISON), SIGNAL_STORE);
            #[cfg(ep_mutant = "gpu_no_poison")]
            let _ = (w, epoch);
        }
    }
}
