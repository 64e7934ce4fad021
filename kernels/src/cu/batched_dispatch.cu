// batched_dispatch.cu: the batched dispatch (batched.cu's overview), one body for its three
// stages: the set-up and the send (batched_dispatch_send.cu), the receive
// (batched_dispatch_recv.cu), and here the call that runs them and the kernel. The module is
// batched.cu, the dispatch's three files, then the combine's (compile.rs BATCHED).
#define KIND KIND_BAT_DISPATCH
// Everything of a dispatch between the start and the end; it returns where the rank goes to
// the end early (a failed group, bad input, a failed wait or bad peer data).
template <int STAGE>
__device__ __forceinline__ void dispatch_call(const KParams& p, Call& c, const DispatchPre& pre) {
    const RankPtrs& me = c.me;
    const IoPtrs& io = c.io;
    const int n = c.n, tid = threadIdx.x;
    // This warp's first send unit (token, 512-channel segment): its x loads are issued now and
    // stay in flight through the routing set-up (reads only: nothing is written before the checks).
    const int segs = (p.H + 511) / 512;
    const int u_first = spread_warp(p, c.bid);
    // One rank, whole call, no NCCL: the rank is its only destination and source, and its rows
    // go straight to the canonical layout (direct_rows).
#if WIDE
    const bool direct = false;  // R > 32
#else
    const bool direct = p.R == 1 && STAGE == 0 && p.nccl_mask[0] == 0u;
#endif
    Seg x0 = {};
    if (STAGE != 2 && u_first < n * segs) x0 = unit_fetch(p, io, u_first, segs);
    // The receive half (stage 2) skips the routing set-up: it reads only the counts and the
    // batches its sources sent (a failed group: nothing; poison_peers sends nothing in stage 2).
    if (STAGE == 2) {
        if (s_fail<KIND>) return;
    } else if (!dispatch_checked(p, c, pre, route_positions(p, c)))
        return;
    // Masked, or lost at the acknowledgement: nothing is sent there (agreed by every block).
    GONE_SNAPSHOT(c.gone);
    PROF(1);
    // The device API's routing and token count, kept for this call's combine (its handle): sk
    // holds the checked indices, equal to topk_idx's values.
    if (c.bid == 0 && STAGE != 2 && io.topk != me.topk) {
        for (int i = tid; i < n * p.K; i += NTHREADS) ((i64*)me.topk)[i] = (i64)c.sm.sk[i];
        if (tid == 0) ((int*)me.meta)[0] = n;
    }
    if (direct) direct_rows(p, c, x0, u_first);
    if (STAGE != 2 && !direct) send_batches(p, c, x0, u_first);
    if (STAGE != 1 && !direct) receive_batches<STAGE>(p, c, pre);
}

template <int STAGE>
__device__ __forceinline__ void dispatch_stage(const KParams& p, const IoTable& iot) {
    Call c = call_of<KIND>(p);
    const DispatchPre pre = dispatch_preload<STAGE>(p, c);
    // The receive half reads no routing: its send half checked the count and the routing.
    frame_start<KIND>(p, iot, c, STAGE == 2 ? NTOK_NONE : NTOK_CALLER);
    // The per-token and per-expert tallies start at zero (their whole extent: n is not known yet).
    if (STAGE != 2) {
        for (int i = threadIdx.x; i < p.E * ((p.T + 31) / 32); i += NTHREADS) c.sm.bm[i] = 0;
#if !WIDE
        for (int i = threadIdx.x; i < p.T * p.R; i += NTHREADS) c.sm.tokpos[i] = 0;
#endif
    }
    frame_open<KIND>(p, c);
    dispatch_call<STAGE>(p, c, pre);
    frame_end<KIND>(p, c, STAGE);
}
#undef KIND
__global__ void __launch_bounds__(NTHREADS, EP_MIN_BLOCKS) ep_batched::dispatch(KParams p, IoTable iot) {
    dispatch_stage<EP_STAGE>(p, iot);
}
