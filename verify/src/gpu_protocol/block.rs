//! The roles every dispatch block runs around its sends and receives, in both kernels and
//! every stage: its epoch at the start, the device-side input check, the sender's ack waits
//! (with batched dispatch's pre-load of the acks), and at the end `last_block_out` (the exit
//! count, which carries whether any block saw the call fail) and `finish` (frame.cuh
//! `frame_end`), which writes a failed call's outputs and publishes the epoch and the acks.

use crate::gpu_protocol::gone::Gone;
use crate::gpu_protocol::orderings::{ACK_LOAD, ACK_STORE, EXIT_ADD, RELAXED};
use crate::gpu_protocol::peers::{is_gone, Build, PeerSet};
use crate::gpu_protocol::poison::{group_failed, s_fail};
use crate::gpu_protocol::shrink::{masked_peers, peer_masked, wait_peer_ack, Peer};
use crate::gpu_protocol::state::{BlockReport, Group, Launch, Rank, WaitEnd};
use crate::gpu_protocol::waits::{failed, report_error, take_claim, wait_ack};
use crate::gpu_protocol::words::{ERR_EXPERT_RANGE, EXIT_FAILED, PH_DISPATCH_SEND};

/// Role: thread 0's start of every block (frame.cuh `frame_start`), after its pre-loads: whether
/// the group had failed ("`fail = p.refused || failed(p)`", stored to `s_fail`;
/// `failed_before`, and the block's `s_fail` in the report) and this call's epoch
/// ([`block_epoch`]), in the report the block fills.
pub(crate) fn block_start(g: &Group, rank: usize) -> (bool, BlockReport) {
    // s_fail = p.refused || failed(p);
    let failed_before = group_failed(g, rank);
    let rep = BlockReport {
        epoch: block_epoch(&g.ranks[rank]),
        failed_start: s_fail(failed_before),
        ..BlockReport::default()
    };
    (failed_before, rep)
}

/// Role: the start of every block (thread 0: "`epoch = ld_epoch(c.state, KIND) + 1ull`", stored to `s_epoch`): this call's epoch.
pub(crate) fn block_epoch(me: &Rank) -> u64 {
    // s_epoch = ld_epoch(state, KIND) + 1ull;
    // SAFETY: the only write is the previous launch's last block out (`frame_end`), which ended
    // before this launch started.
    let calls = unsafe {
        me.epoch
            .with_rows(0, 1, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    };
    calls + 1
}

/// Role: the device-side input check (common.cuh `load_topk<true>`, both kernels: the range
/// check, then the repeats loop): a bad index is reported before anything is written. Returns
/// `in_bad`.
pub(crate) fn input_check(g: &Group, kp: &Launch, rank: usize) -> bool {
    if kp.bad_input != Some(rank) {
        return false;
    }
    // report_error(p.err, ERR_EXPERT_RANGE, rank, token, slot, value, value >> 32, E);
    let e_n = (g.ranks.len() * g.setup.local_experts) as u32;
    report_error(
        g.err(rank),
        ERR_EXPERT_RANGE,
        [rank as u32, 0, 0, e_n, 0, e_n],
    );
    true
}

/// Role: batched dispatch's pre-load of every destination's ack, at kernel start, before the
/// epoch is read and before the routing checks (frame.cuh `ack_waiter`, thread `32 + d`,
/// `a.waits`: "`if (preload && a.waits) a.v0 = ld_acquire(p, ack_words(c.me, p.R, KIND) +
/// a.peer)`"). Per-expert dispatch has none. Returns `ack0` (the kernel's `a.v0`) per
/// destination, in `Group::dests` order.
pub(crate) fn preload_acks(g: &Group, rank: usize) -> Vec<u64> {
    g.dests(rank)
        .map(|d| g.ranks[rank].ack[d].load(ACK_LOAD))
        .collect()
}

/// Role: the sender of the next call waits for every destination's ack of the previous call
/// before it overwrites their buffers (frame.cuh `wait_acks`); skipped when the input is bad
/// (the rank has gone to the end before it). Batched (`ack0` given): thread `32 + d`, after the
/// routing checks, "`else if (a.waits && a.v0 < c.epoch - 1ull) bad = !wait_ack(...)`", then
/// "`return !__syncthreads_or(wait_acks<KIND>(...))`". Per-expert (`ack0` none: `a.v0` is 0):
/// threads `tid < R` after `load_topk`, `a.waits` = "`tid < R && stage != 2 &&
/// !via_nccl(p, tid)`".
/// Shrink mode (both kernels; `ack0` unused): a destination masked at the block's start
/// (`gone0`) is not waited for, the others with [`wait_peer_ack`]; one agreed lost joins `gone`
/// ("`if (r == PEER_LOST) GONE_ADD(d); else bad = !r;`").
#[allow(clippy::too_many_arguments)]
pub(crate) fn sender_wait_acks(
    g: &Group,
    kp: &Launch,
    rank: usize,
    epoch: u64,
    ack0: Option<&[u64]>,
    gone0: PeerSet,
    gone: &mut Gone<'_>,
    rep: &mut BlockReport,
) -> Option<WaitEnd> {
    let mut bad = None;
    #[cfg(not(ep_mutant = "gpu_no_ack_wait"))]
    for (i, d) in g.dests(rank).enumerate() {
        // if (a.waits && SHRINK(p)) { if (!is_gone(c.gone0, d)) { r = wait_peer_ack(...); ... } }
        if kp.shrink {
            if is_gone(gone0, d) {
                continue;
            }
            // wait_peer_ack(peer_wait(p, me, KIND, DEC_ACK, c.rank, d, phase), word, c.epoch - 1ull, c.epoch)
            match wait_peer_ack(g, kp, rank, d, epoch - 1, epoch, rep) {
                // if (r == PEER_LOST) GONE_ADD(d);
                Ok(Peer::Lost) => gone.add(d),
                Ok(Peer::Arrived(_)) => {}
                Err(e) => {
                    bad.get_or_insert(e);
                }
            }
            continue;
        }
        // a.v0 < c.epoch - 1ull: the pre-load (an acquire) did not see the ack yet.
        if ack0.is_some_and(|a| a[i] >= epoch - 1) {
            continue;
        }
        // wait_ack(p, word, c.epoch - 1ull, c.epoch, c.rank, d, phase)  (word: ack_words(me, p.R, KIND) + d)
        if let Err(e) = wait_ack(
            g,
            kp,
            &g.ranks[rank].ack[d],
            epoch - 1,
            epoch,
            rank,
            d,
            PH_DISPATCH_SEND,
        ) {
            bad.get_or_insert(e);
        }
    }
    #[cfg(ep_mutant = "gpu_no_ack_wait")]
    let _ = (g, kp, rank, epoch, ack0, gone0, gone, rep);
    bad
}

/// frame.cuh `last_block_out`'s add, "`f ? 1u + EXIT_FAILED : 1u`": one block out, and bit
/// 16 up one more if the block saw the group failed (mutant `gpu_exit_no_fail_flag`: always
/// `1u`, so that no block brings its flag and the last block out knows only its own).
fn exit_add(f: bool) -> u64 {
    #[cfg(not(ep_mutant = "gpu_exit_no_fail_flag"))]
    return if f { 1 + EXIT_FAILED } else { 1 };
    #[cfg(ep_mutant = "gpu_exit_no_fail_flag")]
    return {
        let _ = f;
        1
    };
}

/// Role: the end of every block (frame.cuh `last_block_out`, thread 0 after the block's
/// `__syncthreads()`): `fail_start` is the block's `s_fail` (the error word at its start).
/// Returns whether this block is the last one out and `*call_failed`: whether this block or
/// one out before it saw the group failed (at its start, or in the error word loaded here at
/// its end); for the last block out, whether any block of the rank's launch did.
fn last_block_out(g: &Group, rank: usize, fail_start: bool) -> (bool, bool) {
    let me = &g.ranks[rank];
    // __syncthreads(); if (threadIdx.x == 0) {
    // const bool f = fail_start || failed(p);
    let f = fail_start || failed(g.err(rank));
    // const u32 old = count_in(p, state + ST_EXIT + kind, f ? 1u + EXIT_FAILED : 1u);
    let old = me.exit.fetch_add(exit_add(f), EXIT_ADD);
    // s_last = ((old & (EXIT_FAILED - 1u)) == (u32)p.blocks_per_rank - 1u);
    let last = (old & (EXIT_FAILED - 1)) as usize == me.blocks - 1;
    // s_failed = f || old >= EXIT_FAILED;
    let call_failed = f || old >= EXIT_FAILED;
    // } __syncthreads(); *call_failed = s_failed != 0; return s_last != 0;
    // (the counter's reset: at the end of frame_end, `finish`)
    (last, call_failed)
}

/// Which launch of a call a block is in, as `frame_end` reads it: its stage and the transport of
/// the launch's sources (`via_nccl(p, s)`; a model's launch has every peer over one transport).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stage {
    /// `p.stage`: 0 the whole call; 1 the send half (NCCL: the pack); 2 the receive half (NCCL:
    /// the unpack).
    pub(crate) stage: u8,
    /// `via_nccl(p, s)` for every source: NCCL peers get no ack (the stream orders the next
    /// call's exchange after this call's unpack).
    pub(crate) nccl: bool,
}

impl Stage {
    /// Stage 0 over NVLink / peer memory: `dispatch_block`.
    pub(crate) const WHOLE: Stage = Stage {
        stage: 0,
        nccl: false,
    };
    /// The NCCL pack stage: `batched_pack_block`.
    pub(crate) const NCCL_PACK: Stage = Stage {
        stage: 1,
        nccl: true,
    };
    /// The NCCL unpack stage: `batched_unpack_block`.
    pub(crate) const NCCL_UNPACK: Stage = Stage {
        stage: 2,
        nccl: true,
    };
    /// The receive hook's send half over NVLink: `hook_send_block`.
    pub(crate) const HOOK_SEND: Stage = Stage {
        stage: 1,
        nccl: false,
    };
    /// The receive hook's receive half over NVLink: `hook_recv_block`.
    pub(crate) const HOOK_RECV: Stage = Stage {
        stage: 2,
        nccl: false,
    };
}

/// Role: the last block out writes a failed call's outputs, publishes the epoch and
/// acknowledges to every source that this rank consumed the call (frame.cuh `frame_end`, the
/// end of both dispatch kernels). Every block's `s_fail` ([`BlockReport::failed_start`], set
/// before) goes into the exit count ([`last_block_out`]), so the last block out writes the
/// failed call's outputs ("`if (last_out && call_failed) { if (dispatch)
/// fail_dispatch_outputs(p, c.io, me); ... }`":
/// [`BlockReport::failed_outputs`]) when any block of the launch saw the group failed, with
/// no look at the error word after the count. Stage 1 (the send half, NCCL's pack) counts no
/// exit, writes no outputs and publishes neither epoch nor acks ("`if (stage == 1) return;`":
/// its receive half does); stages 0 and 2 the epoch, and an ack to every source not over NCCL
/// ("`if (!via_nccl(p, s) && ...)`"): so stage 0 and the receive hook's stage 2 ack every
/// source, NCCL's unpack none.
/// Shrink mode: no ack to a source masked now (the mask read again by the last block out,
/// "`const u32 masked = masked_peers(p, me)`": masked before the call or lost in it; the wide
/// build reads the mask per peer as it acks, `END_MASKED(s)`).
pub(crate) fn finish(
    g: &Group,
    kp: &Launch,
    rank: usize,
    epoch: u64,
    rep: &mut BlockReport,
    stage: Stage,
) {
    let me = &g.ranks[rank];
    // (the model's record of this block's reports that lost the claim)
    let claim = take_claim();
    (rep.claim_lost, rep.claim_unseen) = (claim.lost, claim.unseen);
    // if (stage == 1) return;  (the send half: no exit count)
    if stage.stage == 1 {
        return;
    }
    // bool call_failed;
    // const bool last_out = last_block_out(p, c.state, KIND, s_fail<KIND>, &call_failed);
    // (s_fail: the block's `rep.failed_start`)
    (rep.last_out, rep.call_failed) = last_block_out(g, rank, rep.failed_start);
    // if (last_out && call_failed) { if (dispatch) fail_dispatch_outputs(p, c.io, me); ... }
    if rep.last_out && rep.call_failed {
        rep.failed_outputs = true;
    }
    // if (last_out && threadIdx.x == 0)
    if rep.last_out {
        // MASKED_AT_END();  // shrink: no ack to a masked peer
        // (narrow: const u32 masked = masked_peers(p, me); wide: nothing)
        let masked = (g.setup.build == Build::Narrow).then(|| masked_peers(g, kp, me));
        // for (int s = 0; s < p.R; s++) if (!via_nccl(p, s) && !END_MASKED(s))
        for s in g.sources(rank).filter(|_| !stage.nccl) {
            // st_release(p, ack_words(c.tab[s], p.R, KIND) + c.rank, c.epoch);
            // (END_MASKED(s): narrow is_gone(masked, s), wide peer_masked(p, me, s))
            let end_masked = match masked {
                Some(m) => is_gone(m, s),
                None => peer_masked(kp, me, s),
            };
            if !end_masked {
                g.ranks[s].ack[rank].store(epoch, ACK_STORE);
            }
        }
        // ((u64*)c.state)[ST_EPOCH64 + KIND] = c.epoch;
        // SAFETY: every block of this launch read the word before its exit count, which the
        // last block out acquired (`last_block_out`); the next launch starts after this one.
        unsafe {
            me.epoch
                .with_row_mut(0, |b| b.copy_from_slice(&epoch.to_le_bytes()))
        };
    }
    // if (last_out && threadIdx.x == 0) c.state[ST_EXIT + KIND] = 0u;
    if rep.last_out {
        me.exit.store(0, RELAXED);
    }
}
