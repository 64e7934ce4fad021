//! The receive hook's split of batched dispatch over NVLink / peer memory (the module docs'
//! "Launches"): the same kernel (batched_dispatch.cu `ep_batched::dispatch`) launched twice per call on
//! the rank's stream, stage 1 (the send half: the prologue, the input check, the ack waits, the
//! send and the signal; its `frame_end` publishes nothing) then stage 2 (the receive half: the
//! pre-load of its sources' signals, their waits and the entries; its `frame_end` publishes the
//! epoch and acks every source). Both halves read the same epoch (stage 1 leaves it).
//!
//! Batched combine's stage 2 pre-loads its `sig_cb` words the same way; it is not modelled
//! itself (the same pre-load and `wait_signal_pre` as here, on the combine's words), nor is
//! the split in shrink mode (the code follows the kernel, batched.cu `presig_of`: "`... &&
//! !SHRINK(p)`", but no model runs it) or in the wide build (its barriers: [`gone_word_thread`]
//! follows stage 0).
//!
//! [`gone_word_thread`]: crate::gpu_protocol::gone_word_thread

use crate::gpu_protocol::batched::{batched_receive, batched_send};
use crate::gpu_protocol::block::{
    block_start, finish, input_check, preload_acks, sender_wait_acks, Stage,
};
use crate::gpu_protocol::gone::{Gone, OR_ACKS};
use crate::gpu_protocol::orderings::PRESIGNAL_LOAD;
use crate::gpu_protocol::poison::poison_signals;
use crate::gpu_protocol::state::{BlockReport, Group, Input, Kind, Launch};

/// Role: the receive half's pre-load of every NVLink source's signal at kernel start, before
/// the epoch is read (thread `s < R`, batched.cu `presig_of`: "`STAGE == 2 && tid < R &&
/// !via_nccl(p, tid) && !SHRINK(p)`", then "`pre.sig0 = ld_acquire(p, sig_bat(me) + s)`").
/// Returns `sig0` per source, in `Group::sources` order, for `batched_receive`'s
/// `wait_signal_pre` (mutant `gpu_preload_relaxed`).
pub(crate) fn preload_signals(g: &Group, rank: usize) -> Vec<u64> {
    g.sources(rank)
        .map(|s| g.ranks[rank].sig[s].load(PRESIGNAL_LOAD))
        .collect()
}

/// One block of the send half (`p.stage` 1) of a batched dispatch over NVLink, in kernel
/// order: [`dispatch_block`]'s prologue, input check, poison and ack waits, then the send and
/// the signal; no receive ("`if (STAGE != 1 && !direct)`"), and `frame_end` with stage 1: the
/// last block out resets the exit counter and publishes neither the epoch nor the acks. The
/// narrow build.
///
/// [`dispatch_block`]: crate::gpu_protocol::dispatch_block
pub fn hook_send_block(
    g: &Group,
    kp: &Launch,
    input: &Input,
    rank: usize,
    bid: usize,
) -> BlockReport {
    assert_eq!(g.setup.kind, Kind::Batched, "the split of batched dispatch");
    let me = &g.ranks[rank];
    // a.waits = ... && stage != 2 && ...; if (preload && a.waits) a.v0 = ld_acquire(p, ack_words(c.me, p.R, KIND) + a.peer);
    let ack0 = preload_acks(g, rank);
    // (presig: p.stage == 2 only)
    // s_fail = p.refused || failed(p); s_epoch = ld_epoch(state, KIND) + 1ull;
    let (failed_before, mut rep) = block_start(g, rank);
    let epoch = rep.epoch;
    // GONE_INIT(); ... __syncthreads(); ... const PeerSet gone0 = GONE0();
    let mut set = Gone::new(g, None);
    let gone0 = set.init(g, kp, me);
    rep.gone = gone0;
    // s_n = p.stage == 2 ? 0 : read_ntok(...); the routing pass; in_bad = __syncthreads_or(bad) | s_bad;
    rep.bad_input = input_check(g, kp, rank);
    // if (s_fail<KIND> || in_bad) { poison_peers(p, c.tab, KIND, c.rank, c.gone0, c.epoch); return false; }
    // (poison_peers stores in stage 1: "if (p.stage == 2 || rank == p.fault_rank) return;")
    if rep.failed_start || rep.bad_input {
        poison_signals(g, kp, rank, epoch, gone0);
        rep.poisoned = true;
        rep.gone = set.live();
        finish(g, kp, rank, epoch, &mut rep, Stage::HOOK_SEND);
        return rep;
    }
    // else if (a.waits && a.v0 < c.epoch - 1ull) bad = !wait_ack(...);
    rep.failed_wait = sender_wait_acks(g, kp, rank, epoch, Some(&ack0), gone0, &mut set, &mut rep);
    // return !__syncthreads_or(wait_acks<KIND>(...));
    if !set.sync_or(OR_ACKS, rep.failed_wait.is_some()) {
        // GONE_SNAPSHOT(gone);
        let gone = set.snapshot();
        rep.gone = gone;
        // if (p.stage != 2 && !direct) { ---- send ... st_release(p, sig_bat(tab[d]) + rank, ...) }
        batched_send(g, kp, input, rank, bid, epoch, gone, failed_before);
        // if (p.stage != 1 && !direct): no receive in the send half
    } else {
        rep.gone = set.live();
    }
    // frame_end: if (stage == 1) return;  (no exit count, nothing published)
    finish(g, kp, rank, epoch, &mut rep, Stage::HOOK_SEND);
    rep
}

/// One block of the receive half (`p.stage` 2) of a batched dispatch over NVLink, in kernel
/// order: the signals' pre-load (`preload_signals`; no ack pre-load, "`a.waits = ... &&
/// stage != 2`"), the prologue without the token count (`NTOK_NONE`: `s_n` is 0), no routing
/// set-up, input check or ack wait ("`if (STAGE == 2) { if (s_fail<KIND>) return; } else ...`":
/// its send half checked the input, and a failed group reads nothing), no send, then the
/// receive with `wait_signal_pre` on the pre-loaded words, and `frame_end` with stage 2 over
/// NVLink: the last block out publishes the epoch and acks
/// every source. The narrow build.
pub fn hook_recv_block(g: &Group, kp: &Launch, rank: usize, bid: usize) -> BlockReport {
    assert_eq!(g.setup.kind, Kind::Batched, "the split of batched dispatch");
    let me = &g.ranks[rank];
    // presig_of<STAGE>(p, R, tid) = STAGE == 2 && tid < R && !via_nccl(p, tid) && !SHRINK(p);
    // if (precnt_of<STAGE>(p, R, tid)) pre.sig0 = ld_acquire(p, sig_bat(me) + tid % R);
    let sig0 = (!kp.shrink).then(|| preload_signals(g, rank));
    // s_fail = p.refused || failed(p); s_epoch = ld_epoch(state, KIND) + 1ull;
    let (_, mut rep) = block_start(g, rank);
    let epoch = rep.epoch; // the send half published none: the same epoch
                           // GONE_INIT(); ... __syncthreads(); ... const PeerSet gone0 = GONE0();
    let mut set = Gone::new(g, None);
    let gone0 = set.init(g, kp, me);
    rep.gone = gone0;
    // if (STAGE == 2) { if (s_fail<KIND>) return; }  (no poison: poison_peers stores nothing in stage 2)
    if !rep.failed_start {
        // GONE_SNAPSHOT(gone);
        let gone = set.snapshot();
        rep.gone = gone;
        // if (p.stage != 2 && !direct): no send in the receive half
        // if (p.stage != 1 && !direct) { ---- receive ... }
        batched_receive(
            g,
            kp,
            rank,
            bid,
            epoch,
            gone,
            sig0.as_deref(),
            &mut set,
            &mut rep,
        );
    } else {
        rep.gone = set.live();
    }
    // frame_end: if (last_out) { for (s ...) if (!via_nccl(p, s) && ...) st_release(ack); epoch }
    finish(g, kp, rank, epoch, &mut rep, Stage::HOOK_RECV);
    rep
}
