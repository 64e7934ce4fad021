// batched_combine.cu: the batched combine (batched.cu's overview), one body for its three
// stages: each owner's rows back to their sources in one block per source, and the reduction in
// k order on the source. Follows batched_dispatch.cu in the module (compile.rs BATCHED).
#define KIND KIND_BAT_COMBINE
// With zero_copy, a source on this GPU reads its rows in place: only other GPUs get a put.
__device__ __forceinline__ bool in_place(const KParams& p, int s) {
    return p.zero_copy && !via_nccl(p, s) && s >= p.rank_base && s < p.rank_base + p.ranks_here;
}

// The BF16 reduction of up to 8 slots over channels a multiple of 8 takes each selection's row
// from the handle, one warp per unit (reduce_slots), without a table of every selection's row in
// shared memory; LogFMT's reduction and the others read the table (combine_route).
__device__ __forceinline__ bool route_table(const KParams& p) { return p.logfmt || (p.H & 7) != 0 || p.K > 8; }
// reduce_slots' units: (token, 512-channel span).
__device__ __forceinline__ int slot_chunks(const KParams& p) { return (p.H + 511) / 512; }
// Selection i's handle data, as lane k < K of a reduction unit's warp loads it for slot k: its
// expert (the dispatch's checked routing, kept in topk) and, where NCCL or zero-copy needs it,
// its batch position (comb_pos). T*K entries each: loaded before n is known (an entry past n*K
// is never used). The caller's weight is loaded beside the rows (reduce_slots).
struct SlotLoad {
    int e;
    int pos;
};
__device__ __forceinline__ SlotLoad slot_load(const KParams& p, const Call& c, int i) {
    SlotLoad s;
    s.e = (int)((const i64*)c.me.topk)[i];
    s.pos = any_nccl(p) || p.zero_copy ? ((const int*)c.me.comb_pos)[i] : 0;
    return s;
}
// Selection i's row (0: no row: -1, or an owner masked or lost, `g`): in place on this GPU
// (zero_copy: the owner's y at its comb_map row), through NCCL at the owner's batch position
// past the first T*K rows, else at t*K + k, where the owner put it (row_tk).
__device__ __forceinline__ u64 slot_row(const KParams& p, const Call& c, const SlotLoad& s, int i, PeerSet g, const u64* ys) {
    if (s.e < 0 || is_gone(g, s.e / p.L)) return 0;
    const int d = s.e / p.L;
    const u64 rowb = 2ull * p.H, TK = (u64)p.T * p.K;
    const u8* cbuf = (const u8*)c.me.cmb_buf;
    if (in_place(p, d)) return (u64)((const u8*)ys[d - p.rank_base] + (u64)((const int*)c.tab[d].comb_map)[(u64)c.rank * TK + s.pos] * rowb);
    if (via_nccl(p, d)) return (u64)(cbuf + (TK + (u64)d * TK + (u64)s.pos) * rowb);
    return (u64)(cbuf + (u64)i * rowb);
}

// What the start of a combine loads ahead for later phases, so that the loads' latency overlaps
// the start.
struct CombinePre {
    // Thread 32 + s waits for source s's acknowledgement of the previous call; its first load of
    // the word is made at the start.
    AckWaiter ack;
    u64 sig0;  // presig_of (batched.cu): the first load of owner tid's signal
    // The routing and the batch positions of this thread's first two selections: the group's own
    // buffers (the handle), T*K entries each, so they are loaded before n is known (entries past
    // n*K are never used). The send half (stage 1) reduces nothing and needs neither.
    i64 pv0, pv1;
    int pp0, pp1;
    // Without the table: lane k < K's slot of this warp's first reduction unit.
    SlotLoad slot;
};
template <int STAGE>
__device__ __forceinline__ CombinePre combine_preload(const KParams& p, const Call& c) {
    const int R = p.R, tid = threadIdx.x;
    CombinePre pre;
    pre.ack = ack_waiter<KIND>(p, c, STAGE, 32, true);
    pre.sig0 = 0;
    // loom: gpu_protocol::preload_signals.
    if (presig_of<STAGE>(p, R, tid)) pre.sig0 = ld_acquire(p, sig_cb(c.me, R) + tid);
    const i64* topk = (const i64*)c.me.topk;
    const int* cpos = (const int*)c.me.comb_pos;
    const bool table = route_table(p);
    const int TKi = STAGE == 1 || !table ? 0 : p.T * p.K;
    pre.pv0 = tid < TKi ? topk[tid] : -1;
    pre.pp0 = tid < TKi ? cpos[tid] : -1;
    pre.pv1 = tid + NTHREADS < TKi ? topk[tid + NTHREADS] : -1;
    pre.pp1 = tid + NTHREADS < TKi ? cpos[tid + NTHREADS] : -1;
    pre.slot = SlotLoad{-1, 0};
    const int t0 = spread_warp(p, c.bid) / slot_chunks(p), lane = tid & 31;
    if (STAGE != 1 && !table && lane < p.K && t0 < p.T) pre.slot = slot_load(p, c, t0 * p.K + lane);
    return pre;
}

// The routing of the dispatch (the handle, checked then) and the address of every selection's
// row, in one pass: handle data of the dispatch, no wait needed. Two selections per thread are
// loaded before either is used. `ys`: y of every rank of this launch (zero-copy reads).
template <int STAGE>
__device__ __forceinline__ void combine_route(const KParams& p, const Call& c, const CombinePre& pre, const u64* ys) {
    const Smem& sm = c.sm;
    const RankPtrs* tab = c.tab;
    const RankPtrs& me = c.me;
    const int R = p.R, K = p.K, T = p.T, n = c.n, rank = c.rank, tid = threadIdx.x;
    const u64 rowb = 2ull * p.H;
    const PeerSet gone0 = c.gone0;  // a selection of a masked owner's expert counts as -1
    const i64* topk = (const i64*)me.topk;
    const int* cpos = (const int*)me.comb_pos;
    const u8* cbuf = (const u8*)me.cmb_buf;
    const u64 TK = (u64)T * K;
    // comb_map row of a selection whose owner d is read in place (-1: not local, no load).
    auto map_row = [&](i64 v, int pos) -> int {
        const int e = (int)v;
        if (e < 0 || is_gone(gone0, e / p.L)) return -1;
        const int d = e / p.L;
        return in_place(p, d) ? ((const int*)tab[d].comb_map)[(u64)rank * TK + pos] : -1;
    };
    auto route = [&](int i, i64 v, int pos, int mrow) {
        const int e = v >= 0 && is_gone(gone0, (int)v / p.L) ? -1 : (int)v;
        int dl = -1;
        u64 a = 0;
        if (e >= 0) {
            const int d = e / p.L;
            dl = (d << 16) | (e - d * p.L);
            // In place on this GPU (zero_copy); through NCCL at the owner's batch position
            // past the first T*K rows; else at t*K + k, where the owner put it (row_tk).
            a = in_place(p, d) ? (u64)((const u8*)ys[d - p.rank_base] + (u64)mrow * rowb)
                : via_nccl(p, d) ? (u64)(cbuf + (TK + (u64)d * TK + (u64)pos) * rowb)
                                 : (u64)(cbuf + (u64)i * rowb);
        }
        sm.sk[i] = e;
        sm.sdl[i] = dl;
        sm.rowp[i] = a;
    };
    for (int i0 = tid; i0 < (STAGE == 1 || !route_table(p) ? 0 : n * K); i0 += 2 * NTHREADS) {
        const int i1 = i0 + NTHREADS;
        const bool two = i1 < n * K;
        const bool first = i0 == tid;
        const i64 v0 = first ? pre.pv0 : topk[i0];
        const int pos0 = first ? pre.pp0 : cpos[i0];
        const i64 v1 = !two ? -1 : first ? pre.pv1 : topk[i1];
        const int pos1 = !two ? -1 : first ? pre.pp1 : cpos[i1];
        const int m0 = map_row(v0, pos0);
        const int m1 = map_row(v1, pos1);
        route(i0, v0, pos0, m0);
        if (two) route(i1, v1, pos1, m1);
    }
    PROF(8);  // thread 0's share of the row-address table done
    if (tid < R) sm.tot[tid] = ((const int*)me.comb_cnt)[tid];
}

// ---- The send: batch(me -> s) = rows comb_map[s][0..cnt), to s's area for me; then one signal
// per (owner, source) once every block of this rank has sent. Units of 512 bytes (16 per lane),
// eight in flight per warp. `all_local`: every row is read in place, no signal is needed.
template <int STAGE>
__device__ __forceinline__ void combine_send(const KParams& p, const Call& c, bool all_local) {
    const Smem& sm = c.sm;
    const RankPtrs* tab = c.tab;
    const RankPtrs& me = c.me;
    const IoPtrs& io = c.io;
    const PeerSet gone = c.gone;
    const int R = p.R, K = p.K, T = p.T, rank = c.rank, bid = c.bid;
    const int tid = threadIdx.x, warp = tid >> 5;
    const u64 rowb = 2ull * p.H;
    const u64 crow = (u64)p.cmb_row;  // LogFMT: cmb_buf's row stride (a raw LogFMT row)
    // Sources this rank sends nothing to: on this GPU (zero-copy), masked or lost.
    auto skip = [&](int s) { return in_place(p, s) || is_gone(gone, s); };
    // Where row i of batch(me -> s) (row yrow of y) goes: NCCL staging at the batch position;
    // else s's receive area at its (t, k), row_tk[yrow] = t*K + k (bounded at the dispatch).
    auto put_row = [&](int s, int i, u64 yrow) -> u8* {
        return via_nccl(p, s) ? (u8*)me.snd_buf + ((u64)s * T * K + i) * rowb
                              : (u8*)tab[s].cmb_buf + (u64)((const int*)me.row_tk)[yrow] * rowb;
    };
    int total = 0;
    for (int s = 0; s < R; s++) total += skip(s) ? 0 : sm.tot[s];
    const int nw = p.blocks_per_rank * NWARPS;
    const int lane = tid & 31;
    if (STAGE == 2) {
        // unpack stage: the rows went out in the pack stage
    } else if (p.logfmt) {
        // LogFMT: the block encodes its rows (u = bid, bid + blocks_per_rank, ...) straight
        // into their slots, s's receive area at its (t, k) with the LogFMT stride (never over
        // NCCL: the host refuses it there; and zero_copy is off, so every row is put), in
        // rounds of lf_encode_rows.
        const int rpr = min(LF_ROWS, LF_UNITS / (p.H / LF_GROUP));
        const int mine = total > bid ? (total - bid + p.blocks_per_rank - 1) / p.blocks_per_rank : 0;
        for (int r0 = 0; r0 < mine; r0 += rpr) {
            const int nr = min(rpr, mine - r0);
            if (tid < nr) {
                int i = bid + (r0 + tid) * p.blocks_per_rank, s = 0;
                while (skip(s) || i >= sm.tot[s]) {
                    if (!skip(s)) i -= sm.tot[s];
                    s++;
                }
                const u64 yrow = (u64)((const int*)me.comb_map)[(u64)s * T * K + i];
                lf_s_dst[tid] = (u64)((u8*)tab[s].cmb_buf + (u64)((const int*)me.row_tk)[yrow] * crow);
                lf_s_src[tid] = (u64)((const u8*)io.y + yrow * rowb);
            }
            lf_encode_rows(nr, p.H, p.prof);
        }
    } else if ((rowb & 15) == 0) {
        const int C = (int)((rowb + 511) / 512);
        const int units = total * C;
        for (int u0 = bid * NWARPS + warp; u0 < units; u0 += 8 * nw) {
            uint4 v[8];
            u8* dst[8];
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const int u = u0 + q * nw;
                dst[q] = 0;
                if (u < units) {
                    int i = u / C;
                    const u64 off = (u64)(u % C) * 512 + lane * 16;
                    int s = 0;
                    while (skip(s) || i >= sm.tot[s]) {
                        if (!skip(s)) i -= sm.tot[s];
                        s++;
                    }
                    if (off < rowb) {
                        const u64 yrow = (u64)((const int*)me.comb_map)[(u64)s * T * K + i];
                        v[q] = *(const uint4*)((const u8*)io.y + yrow * rowb + off);
                        dst[q] = put_row(s, i, yrow) + off;
                    }
                }
            }
#pragma unroll
            for (int q = 0; q < 8; q++)
                if (dst[q]) *(uint4*)dst[q] = v[q];
        }
    } else {
        for (int u = bid * NWARPS + warp; u < total; u += nw) {
            int i = u, s = 0;
            while (skip(s) || i >= sm.tot[s]) {
                if (!skip(s)) i -= sm.tot[s];
                s++;
            }
            const u64 yrow = (u64)((const int*)me.comb_map)[(u64)s * T * K + i];
            warp_copy(put_row(s, i, yrow), (const u8*)io.y + yrow * rowb, (int)rowb);
        }
    }
    __syncthreads();
    PROF(2);
    if (tid == 0 && !all_local && STAGE != 2) {
        // loom: not modelled itself; the same counter + signal as batched dispatch (model
        // batched_two_senders_one_receiver).
        if (count_in(p, c.state + ST_SENT + KIND, 1u) == (u32)p.blocks_per_rank - 1u) {
            if (rank != p.fault_rank)
                for (int s = 0; s < R; s++)
                    if (!via_nccl(p, s) && !is_gone(gone, s)) st_release(p, sig_cb(tab[s], R) + rank, signal_word(c.epoch, (u32)sm.tot[s]));
            c.state[ST_SENT + KIND] = 0u;  // for the next launch (batched dispatch's send says why here)
        }
    }
}

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
