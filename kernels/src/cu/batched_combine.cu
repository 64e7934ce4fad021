// batched_combine.cu: the batched combine (batched.cu's overview), one body for its three
// stages: the set-up and the send (batched_combine_send.cu), the receive
// (batched_combine_recv.cu), and here the call that runs them and the kernel. The last file of
// the module (compile.rs BATCHED).
#define KIND KIND_BAT_COMBINE
// Everything of a combine between the start and the end; it returns where the rank goes to the
// end early (a failed group, a failed wait), and after the send in the pack stage.
template <int STAGE>
__device__ __forceinline__ void combine_call(const KParams& p, Call& c, const CombinePre& pre, const u64* ys) {
    combine_route<STAGE>(p, c, pre, ys);
    // A failed group sends nothing valid (the rows of a failed dispatch are not this call's):
    // the poison instead of this call's signals, NaN rows to its NCCL peers.
    // loom: gpu_protocol::poison_signals.
    if (s_fail<KIND>) {
        poison_peers(p, c.tab, KIND, c.rank, c.gone0, c.epoch);
        poison_nccl_rows(p, c.me, c.gone0, c.bid);
        return;
    }
    // loom: not modelled itself; the same wait_ack as batched dispatch (model batched_consecutive_calls).
    if (__syncthreads_or(wait_acks<KIND>(p, c, PH_COMBINE_SEND, pre.ack))) return;
    GONE_SNAPSHOT(c.gone);  // masked, or lost at the acknowledgement: nothing goes back there
    PROF(1);
    // Every rank on this GPU and zero_copy: every row is read in place, and every row and
    // handle was complete when this launch started, so no put and no signal is needed.
    const bool all_local = p.zero_copy && p.ranks_here == p.R && !any_nccl(p);
    combine_send<STAGE>(p, c, all_local);
    if (STAGE == 1) return;  // pack stage: the reduction runs after the NCCL exchange
    combine_receive<STAGE>(p, c, pre, all_local, ys);
}

template <int STAGE>
__device__ __forceinline__ void combine_stage(const KParams& p, const IoTable& iot) {
    __shared__ u64 s_y[MAX_LOCAL];  // y of every rank of this launch (zero-copy reads)
    Call c = call_of<KIND>(p);
    frame_start<KIND>(p, iot, c, NTOK_HANDLE);  // n: the dispatch's count and routing (the handle)
    if (threadIdx.x < p.ranks_here) {
        const u64 y = iot.r[threadIdx.x].y;
        s_y[threadIdx.x] = y ? y : c.tab[p.rank_base + threadIdx.x].y;
    }
    const CombinePre pre = combine_preload<STAGE>(p, c);
    frame_open<KIND>(p, c);
    combine_call<STAGE>(p, c, pre, s_y);
    frame_end<KIND>(p, c, STAGE);
}
#undef KIND
__global__ void __launch_bounds__(NTHREADS, EP_MIN_BLOCKS) ep_batched::combine(KParams p, IoTable iot) {
    combine_stage<EP_STAGE>(p, iot);
}
