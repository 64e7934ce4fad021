// batched_combine_recv.cu: the batched combine's receive (batched.cu's overview): every owner's
// batch, then the reduction in k order on the source. Follows batched_combine_send.cu in the
// module (compile.rs BATCHED).
#define KIND KIND_BAT_COMBINE
// ---- The receive: every owner's batch, then the reduction in k order.

// The BF16 reduction (reduce_spans' sums, sum_span) with each unit's slots taken from the handle:
// lane k < K of the unit's warp finds slot k's row (slot_row over its handle loads: `sl`, made at
// kernel start, for the warp's first unit; a later unit's at the start of its turn) and loads
// its weight, and the warp takes both by shuffles. `g`: the owners masked or lost in this call.
template <int NC, int KM>
__device__ __forceinline__ void reduce_slots(const KParams& p, const Call& c, SlotLoad sl, PeerSet g, const u64* ys) {
    const int lane = threadIdx.x & 31;
    const int H = p.H, K = p.K;
    const float* wts = (const float*)c.io.weights;
    u16* out = (u16*)c.io.out;
    const int span = NC * 256;
    const int chunks = (H + span - 1) / span;  // slot_chunks(p)
    const int units = c.n * chunks, nw = p.blocks_per_rank * NWARPS;
    const int u_first = spread_warp(p, c.bid);
    for (int u = u_first; u < units; u += nw) {
        const int t = u / chunks;
        const int i = t * K + lane;
        if (lane < K && u != u_first) sl = slot_load(p, c, i);
        const u64 row = lane < K ? slot_row(p, c, sl, i, g, ys) : 0;
        const float wl = lane < K ? wts[i] : 0.0f;
        const u32 valid = __ballot_sync(0xffffffffu, row != 0);
        const int c0 = (u % chunks) * span + lane * 8;
        uint4 yv[NC][KM];
        float w[KM];
#pragma unroll
        for (int k = 0; k < KM; k++) {
            const u8* r = (const u8*)__shfl_sync(0xffffffffu, row, k);
            w[k] = __shfl_sync(0xffffffffu, wl, k);
            if (k < K && ((valid >> k) & 1u)) {
#pragma unroll
                for (int j = 0; j < NC; j++)
                    if (c0 + j * 256 < H) yv[j][k] = *(const uint4*)(r + 2 * (c0 + j * 256));
            }
        }
        sum_span<NC, KM>(yv, w, valid, K, H, c0, out + (u64)t * H);
    }
}

template <int STAGE>
__device__ __forceinline__ void combine_receive(const KParams& p, const Call& c, const CombinePre& pre, bool all_local, const u64* ys) {
    const Smem& sm = c.sm;
    const RankPtrs& me = c.me;
    const IoPtrs& io = c.io;
    const PeerSet gone = c.gone;
    const int R = p.R, K = p.K, n = c.n, rank = c.rank, bid = c.bid, tid = threadIdx.x;
    const u64 epoch = c.epoch;
    int bad = 0;
    // Every block waits for every owner; block 0's wait is the one counted (wait_stats).
    for (int d = tid; d < R && !all_local; d += NTHREADS) {
        if (via_nccl(p, d)) continue;
        const long long t0 = clock64();
        if (SHRINK(p)) {
            if (is_gone(gone, d)) continue;
            const long long cnt = wait_peer_signals(peer_wait(p, me, KIND, DEC_RECV, rank, d, PH_COMBINE_RECV), sig_cb(me, R) + d, 0, 1, 0, epoch);
            if (cnt == PEER_LOST) GONE_ADD(d);
            else bad |= cnt < 0;
        } else {
            // loom: not modelled itself; the same wait_signal as batched dispatch (model batched_two_senders_one_receiver).
            bad |= (presig_of<STAGE>(p, R, d) && d == tid ? wait_signal_pre(p, sig_cb(me, R) + d, pre.sig0, epoch, rank, d, PH_COMBINE_RECV)
                                                          : wait_signal(p, sig_cb(me, R) + d, epoch, rank, d, PH_COMBINE_RECV)) < 0;
        }
        if (bid == 0) add_wait_cost(io.wait_stats, d, t0);
    }
    if (__syncthreads_or(bad)) return;
    if (route_table(p) && gone_differs(GONE_LIVE(), c.gone0)) {
        // Owners lost in this call: their selections count as -1 in the reduction.
        const PeerSet g = GONE_LIVE();
        for (int i = tid; i < n * K; i += NTHREADS)
            if (sm.sk[i] >= 0 && is_gone(g, sm.sk[i] / p.L)) sm.sk[i] = -1;
        __syncthreads();
    }
    PROF(3);
    // LogFMT: every row at cmb_buf + (t*K + k) * cmb_row (rowp, at the bf16 stride, unused).
    if (p.logfmt) lf_reduce_tokens(p, io, me, n, sm.sk, bid);
    else if (!route_table(p)) reduce_slots<2, 8>(p, c, pre.slot, GONE_LIVE(), ys);
    else {
        const auto row_of = [&](int t, int k) -> const u8* { return (const u8*)sm.rowp[t * K + k]; };
        if ((p.H & 7) == 0) reduce_spans<1, MAX_K>(p, io, n, sm.sk, bid, row_of);  // K > 8
        else reduce_channels(p, io, n, sm.sk, bid, row_of);
    }
}
#undef KIND
