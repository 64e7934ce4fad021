// batched_combine_send.cu: the batched combine's set-up and send (batched.cu's overview): the
// handle's routing and rows, and each owner's rows back to their sources in one block per
// source. The combine is this file, batched_combine_recv.cu and batched_combine.cu (the call and
// its stages), in that order, after the dispatch's (compile.rs BATCHED).
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
#undef KIND
