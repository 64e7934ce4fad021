//! One block of a stage-0 dispatch launch (the whole call over NVLink / peer memory): the
//! shared prologue and epilogue of every block and the kernel's own send and receive, in kernel
//! order.

use crate::gpu_protocol::batched::{batched_receive, batched_send};
use crate::gpu_protocol::block::{
    block_start, finish, input_check, preload_acks, sender_wait_acks, Stage,
};
use crate::gpu_protocol::gone::{BlockShared, Gone, OR_ACKS};
use crate::gpu_protocol::per_expert::{per_expert_receive, per_expert_send};
use crate::gpu_protocol::poison::poison_signals;
use crate::gpu_protocol::state::{BlockReport, Group, Input, Kind, Launch};

/// One block of one stage-0 dispatch launch, every role in kernel order (batched_dispatch.cu
/// `ep_batched::dispatch` / per_expert.cu `ep_per_expert::dispatch`), in the narrow build.
pub fn dispatch_block(
    g: &Group,
    kp: &Launch,
    input: &Input,
    rank: usize,
    bid: usize,
) -> BlockReport {
    dispatch_block_in(g, kp, input, rank, bid, None)
}

/// [`dispatch_block`] in either build: thread 0 of the block, whose gone set lives in `shared`
/// in the wide build (the block's other threads run [`gone_word_thread`] on it), and in thread
/// 0 alone in the narrow build (`None`).
///
/// [`gone_word_thread`]: crate::gpu_protocol::gone_word_thread
pub fn dispatch_block_in(
    g: &Group,
    kp: &Launch,
    input: &Input,
    rank: usize,
    bid: usize,
    shared: Option<&BlockShared>,
) -> BlockReport {
    let me = &g.ranks[rank];
    // Batched: thread 32 + d's first ld_acquire of the ack, before anything else.
    let ack0 = (g.setup.kind == Kind::Batched).then(|| preload_acks(g, rank));
    // s_fail = p.refused || failed(p); s_epoch = ld_epoch(state, KIND) + 1ull;
    let (failed_before, mut rep) = block_start(g, rank);
    let epoch = rep.epoch;
    // GONE_INIT(); ... __syncthreads(); ... const PeerSet gone0 = GONE0();
    let mut set = Gone::new(g, shared);
    let gone0 = set.init(g, kp, me);
    rep.gone = gone0;
    // in_bad = __syncthreads_or(bad) | s_bad<KIND>  (bad: load_topk<true>(...), both kernels)
    rep.bad_input = input_check(g, kp, rank);
    // if (s_fail<KIND> || in_bad) { poison_peers(p, c.tab, KIND, c.rank, c.gone0, c.epoch); return false; }
    if rep.failed_start || rep.bad_input {
        poison_signals(g, kp, rank, epoch, gone0);
        rep.poisoned = true;
        rep.gone = set.live();
        finish(g, kp, rank, epoch, &mut rep, Stage::WHOLE);
        return rep;
    }
    // wait_acks: if (a.waits && a.v0 < c.epoch - 1ull) bad = !wait_ack(...) (per-expert: tid < R)
    if !rep.bad_input {
        rep.failed_wait = sender_wait_acks(
            g,
            kp,
            rank,
            epoch,
            ack0.as_deref(),
            gone0,
            &mut set,
            &mut rep,
        );
    }
    // return !__syncthreads_or(wait_acks<KIND>(...));
    if !set.sync_or(OR_ACKS, rep.bad_input || rep.failed_wait.is_some()) {
        // GONE_SNAPSHOT(gone);  // masked, or lost at the acknowledgement: nothing is sent there
        let gone = set.snapshot();
        rep.gone = gone;
        match g.setup.kind {
            Kind::Batched => {
                batched_send(g, kp, input, rank, bid, epoch, gone, failed_before);
                batched_receive(g, kp, rank, bid, epoch, gone, None, &mut set, &mut rep);
            }
            Kind::PerExpert => {
                per_expert_send(g, kp, input, rank, bid, epoch, gone, failed_before);
                per_expert_receive(g, kp, rank, bid, epoch, gone, &mut set, &mut rep);
                rep.gone = set.live();
            }
        }
    } else {
        rep.gone = set.live();
    }
    finish(g, kp, rank, epoch, &mut rep, Stage::WHOLE);
    rep
}
