// batched_dispatch_send.cu: the batched dispatch's set-up and send (batched.cu's overview): the
// preloads, the routing set-up and the checks, the one-rank path's direct rows, and the batches
// sent once per destination. The dispatch is this file, batched_dispatch_recv.cu and
// batched_dispatch.cu (the call and its stages), in that order (compile.rs BATCHED).
#define KIND KIND_BAT_DISPATCH
// Token t's entry in batch(this rank -> d) at position `pos` (d's receive region for this rank,
// or this rank's staging slot for d when d is reached through NCCL): payload segment g, and with
// the first segment the header: per slot (lanes < MAX_K) the local expert and index when the slot
// is bound for d, else NO_LOCAL; the token and its selection offset (*selp, read by lane 16 only).
__device__ __forceinline__ void store_entry(const KParams& p, const RankPtrs* tab, const RankPtrs& me, int rank, int d,
                                            int pos, const int* selp, const Seg& sg, const u16* xr, int g, int t,
                                            int my_dl, int my_idx) {
    const int lane = threadIdx.x & 31;
    u8* entry = via_nccl(p, d) ? (u8*)me.snd_buf + ((u64)d * p.T + pos) * p.entry_bytes
                               : (u8*)tab[d].bat_buf + ((u64)rank * p.T + pos) * p.entry_bytes;
    seg_store(p, sg, xr, g * 512, entry + HDR_BYTES);
    if (g == 0) {
        if (lane < MAX_K) {
            const bool mine = my_dl >= 0 && (my_dl >> 16) == d;
            ((u16*)(entry + 16))[lane] = mine ? (u16)(my_dl & 0xFFFF) : (u16)NO_LOCAL;
            ((u16*)(entry + 48))[lane] = mine ? (u16)my_idx : (u16)0;
        } else if (lane == 16) {
            ((int*)entry)[0] = t;
            ((int*)entry)[1] = *selp;
        }
    }
}

// The receive half (stage 2) of a call whose send half ran before it: thread s < R makes its
// first acquire load of source s's signal at the start (presig_of, batched.cu), and thread
// i < L*R also loads the row count of (l, s) = (i / R, i % R) behind its own acquire of s's
// signal (thread s < R: the selections s sent, too): taken by receive_counts when that signal
// carries this call's tag (the count was stored before it), else loaded again after the wait.
template <int STAGE>
__device__ __forceinline__ bool precnt_of(const KParams& p, int R, int tid) {
    return STAGE == 2 && tid < p.L * R && !via_nccl(p, tid % R) && !SHRINK(p);
}
// What the start of a dispatch loads ahead for later phases, so that the loads' latency overlaps
// the start and the routing loads.
struct DispatchPre {
    // Thread 32 + d waits for destination d's acknowledgement of the previous call
    // (dispatch_checked); its first load of the word is made at the start.
    AckWaiter ack;
    u64 sig0;        // presig_of, precnt_of: the first load of source tid % R's signal
    int pcnt, psel;  // precnt_of: the row count; presig_of: the selections sent
};
template <int STAGE>
__device__ __forceinline__ DispatchPre dispatch_preload(const KParams& p, const Call& c) {
    const RankPtrs& me = c.me;
    const int R = p.R, L = p.L, tid = threadIdx.x;
    DispatchPre pre;
    // loom: gpu_protocol::preload_acks, model batched_consecutive_calls.
    pre.ack = ack_waiter<KIND>(p, c, STAGE, 32, true);
    pre.sig0 = 0;
    pre.pcnt = 0;
    pre.psel = 0;
    if (precnt_of<STAGE>(p, R, tid)) {
        const int s = tid % R;
        pre.sig0 = ld_acquire(p, sig_bat(me) + s);
        pre.pcnt = ((const int*)me.bat_cnt)[s * L + tid / R];
        if (presig_of<STAGE>(p, R, tid)) pre.psel = ((const int*)me.bat_meta)[2 * tid + 1];
    }
    return pre;
}

// The routing set-up. Routing, checked (load_topk: topk_idx may come from the caller's device
// memory; a bad index is reported and read as -1, so nothing indexes with it). Each selection
// also counts itself: per token, selections bound for each destination; per expert, the bitmap
// of its tokens. Then per expert the selections before each bitmap word, and per destination each
// token's batch position and selection offset, and the totals. Returns this thread's verdict on
// the routing (dispatch_checked reduces it): nothing is written outside shared memory before.
__device__ __forceinline__ int route_positions(const KParams& p, const Call& c) {
    const Smem& sm = c.sm;
    const int R = p.R, K = p.K, L = p.L, T = p.T, E = p.E, n = c.n;
    const int W = (T + 31) / 32;
    const int tid = threadIdx.x;
    const PeerSet gone0 = c.gone0;
    const int bad = load_topk<true>(p, (const i64*)c.io.topk, n, sm.sk, c.rank, true, [&](int i, int e) {
        int dl = -1;
        // A selection of a masked rank's expert counts as -1 (sk keeps it: checked, and the
        // handle's routing; combine masks by the mask it sees).
        if (e >= 0 && !is_gone(gone0, e / L)) {
            const int t = i / K, d = e / L;
            dl = (d << 16) | (e - d * L);
#if !WIDE
            atomicAdd(&sm.tokpos[t * R + d], 1);
#endif
            atomicOr((u32*)&sm.bm[e * W + (t >> 5)], 1u << (t & 31));
        }
        sm.sdl[i] = dl;
    });
    // Per expert: selections before each bitmap word (the index of (t, k) within its expert).
    for (int e = tid; e < E; e += NTHREADS) {
        int run = 0;
        for (int w = 0; w < W; w++) {
            sm.pw[e * W + w] = run;
            run += __popc((u32)sm.bm[e * W + w]);
        }
    }
    PROF(9);  // thread 0's share of the per-expert prefix done
#if WIDE
    // Per destination d (a thread each): the bitmap of the tokens bound for d (the OR of its
    // experts' bitmaps), tokens and selections before each word, the totals.
    for (int d = tid; d < R; d += NTHREADS) {
        int rt = 0, rs = 0;
        for (int w = 0; w < W; w++) {
            u32 word = 0u;
            int sc = 0;
            for (int l = 0; l < L; l++) {
                const u32 b = (u32)sm.bm[(d * L + l) * W + w];
                word |= b;
                sc += __popc(b);
            }
            sm.dbm[d * W + w] = (int)word;
            sm.dpw[d * W + w] = rt;
            sm.spw[d * W + w] = rs;
            rt += __popc(word);
            rs += sc;
        }
        sm.tot[d] = rt;
        sm.tot[R + d] = rs;
    }
    __syncthreads();
    // Per slot (t, k) bound for d: t's batch position in batch(me -> d) and its selection offset
    // there (selections of d's experts by earlier tokens), the values the T x R table holds.
    for (int i = tid; i < n * K; i += NTHREADS) {
        const int dl = sm.sdl[i];
        if (dl < 0) continue;
        const int t = i / K, d = dl >> 16, w = t >> 5;
        const u32 below = (1u << (t & 31)) - 1u;
        int sp = sm.spw[d * W + w];
        for (int l = 0; l < L; l++) sp += __popc((u32)sm.bm[(d * L + l) * W + w] & below);
        sm.tokpos[i] = sm.dpw[d * W + w] + __popc((u32)sm.dbm[d * W + w] & below);
        sm.selpos[i] = sp;
    }
#else
    // Per destination (warp d): batch position of each token and selection offset.
    const int lane = tid & 31, warp = tid >> 5;
    for (int d = warp; d < R; d += NWARPS) {
        int base_tok = 0, base_sel = 0;
        for (int c0 = 0; c0 < n; c0 += 32) {
            const int t = c0 + lane;
            const int cnt = t < n ? sm.tokpos[t * R + d] : 0;
            const u32 bal = __ballot_sync(0xffffffffu, cnt > 0);
            int incl = cnt;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                int u = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += u;
            }
            if (t < n) {
                sm.tokpos[t * R + d] = base_tok + __popc(bal & ((1u << lane) - 1u));
                sm.selpos[t * R + d] = base_sel + incl - cnt;
            }
            base_tok += __popc(bal);
            base_sel += __shfl_sync(0xffffffffu, incl, 31);
        }
        if (lane == 0) {
            sm.tot[d] = base_tok;
            sm.tot[R + d] = base_sel;
        }
    }
#endif
    PROF(10);  // thread 0's share of the per-destination scan done
    return bad;
}

// The input check's verdict, then the acknowledgement wait. Returns false where the rank goes
// to the end (a failed group, bad input, or a failed wait).
__device__ __forceinline__ bool dispatch_checked(const KParams& p, Call& c, const DispatchPre& pre, int bad) {
    // Bad routing (or token count) is caught here, before anything is written: the rank goes to
    // the end and sends the poison instead of its batches (below).
    // loom: gpu_protocol::input_check and dispatch_block, models bad_input_sender_peer_*, bad_input_receiver_then_enqueued_call.
    const int in_bad = __syncthreads_or(bad) | s_bad<KIND>;
    PROF(7);  // routing checked, positions known
    // A failed group, or this call's bad input, sends nothing valid: the poison instead of
    // this call's signals, so that every peer's matching call ends at once, naming this rank.
    // loom: gpu_protocol::poison_signals, models failed_rank_poisons_enqueued_calls, bad_input_sender_*.
    if (s_fail<KIND> || in_bad) {
        poison_peers(p, c.tab, KIND, c.rank, c.gone0, c.epoch);
        return false;
    }
    // The previous call's batches must have been consumed before this call overwrites them.
    // loom: gpu_protocol::sender_wait_acks, model batched_consecutive_calls (pre.ack.v0 was its first load: preload_acks).
    return !__syncthreads_or(wait_acks<KIND>(p, c, PH_DISPATCH_SEND, pre.ack));
}

// The x segment of send unit u (token u / segs, 512-channel segment u % segs; segs per row),
// fetched (seg_fetch: its loads stay in flight): the unit loops below fetch the next unit's while
// they store this one's, and dispatch_call fetches a warp's first at the start.
__device__ __forceinline__ Seg unit_fetch(const KParams& p, const IoPtrs& io, int u, int segs) {
    return seg_fetch(p, (const u16*)io.x + (u64)(u / segs) * p.H, (u % segs) * 512);
}

// One rank, whole call, no NCCL: the rank is its only destination and source, and its rows go
// straight from x to the canonical layout (begin(l, 0) = 0: the row of (t, k) is its index within
// its expert); no batch, no signal, no expansion. `nxt`: this warp's first unit's x segment,
// fetched at the start of the set-up.
// loom: not modelled, and needs no model (no cross-rank protocol): gpu_protocol's module docs, "The one-rank path".
__device__ __forceinline__ void direct_rows(const KParams& p, const Call& c, Seg nxt, int u_first) {
    const Smem& sm = c.sm;
    const RankPtrs& me = c.me;
    const IoPtrs& io = c.io;
    const int K = p.K, L = p.L, T = p.T, n = c.n;
    const int W = (T + 31) / 32;
    const int tid = threadIdx.x, lane = tid & 31;
    const int segs = (p.H + 511) / 512;
    const int stride = p.blocks_per_rank * NWARPS;
    for (int u = u_first; u < n * segs; u += stride) {
        const int t = u / segs, g = u % segs;
        // This unit's x segment was fetched one step ahead; the next one's loads go out now,
        // before this unit's stores.
        Seg sg = nxt;
        if (u + stride < n * segs) nxt = unit_fetch(p, io, u + stride, segs);
        // this lane's slot (lanes < K): local expert and row, or -1
        int my_row = -1, my_l = 0;
        if (lane < K) {
            const int e = sm.sk[t * K + lane];
            my_l = e;
            if (e >= 0) {
                const u32 word = (u32)sm.bm[e * W + (t >> 5)];
                my_row = e * T + sm.pw[e * W + (t >> 5)] + __popc(word & ((1u << (t & 31)) - 1u));
            }
        }
        const u32 slots = __ballot_sync(0xffffffffu, my_row >= 0);
        if (slots == 0u) continue;
        const u16* xr = (const u16*)io.x + (u64)t * p.H;
        seg_quant(p, sg);
        for (u32 m = slots; m != 0u; m &= m - 1u) {
            const int k = __ffs(m) - 1;
            const u64 row = (u64)__shfl_sync(0xffffffffu, my_row, k);
            const int l = __shfl_sync(0xffffffffu, my_l, k);
            seg_store_xs(p, sg, xr, g * 512, (u8*)io.recv_x + row * p.xrow, scale_row(p, (void*)io.recv_scales, (u64)l, row - (u64)l * T));
        }
        if (g == 0 && lane < K) {
            // (t, k)'s place among the rank's selections (token order, then k): comb_pos on
            // the source side, comb_map on the owner's, the same place.
            int pos = -1;
            if (my_row >= 0) {
                pos = sm.selpos[t] + __popc(slots & ((1u << lane) - 1u));
                ((int*)io.src_info)[my_row] = t;
                ((int*)me.row_tk)[my_row] = t * K + lane;
                ((int*)me.comb_map)[pos] = my_row;
            }
            ((int*)me.comb_pos)[t * K + lane] = pos;
        }
    }
    PROF(2);  // this block's rows written (thread 0's warp)
    if (c.bid == 0) {
        // The caller's outputs, and the group's copy combine reads (the handle).
        for (int l = tid; l < L; l += NTHREADS) {
            const int cnt = sm.pw[l * W + W - 1] + __popc((u32)sm.bm[l * W + W - 1]);
            ((int*)io.recv_count)[l] = cnt;
            ((int*)me.recv_count)[l] = cnt;
            ((int*)io.layout)[l * 2] = 0;
            ((int*)io.layout)[l * 2 + 1] = cnt;
            ((int*)me.layout)[l * 2] = 0;
            ((int*)me.layout)[l * 2 + 1] = cnt;
        }
        if (tid == 0) ((int*)me.comb_cnt)[0] = sm.tot[1];
    }
}

// The send: units (token, 512-channel segment) over all warps of this rank, each token's entry
// written once into the batch of every destination it is bound for; then one signal per
// (source, destination) once every block of this rank has sent. `nxt` as direct_rows.
__device__ __forceinline__ void send_batches(const KParams& p, const Call& c, Seg nxt, int u_first) {
    const Smem& sm = c.sm;
    const RankPtrs* tab = c.tab;
    const RankPtrs& me = c.me;
    const IoPtrs& io = c.io;
    const PeerSet gone = c.gone;
    const int R = p.R, K = p.K, L = p.L, T = p.T, E = p.E, n = c.n, rank = c.rank, bid = c.bid;
    const int W = (T + 31) / 32;
    const int tid = threadIdx.x, lane = tid & 31;
    const int segs = (p.H + 511) / 512;
    const int stride = p.blocks_per_rank * NWARPS;
    for (int u = u_first; u < n * segs; u += stride) {
        const int t = u / segs, g = u % segs;
        // This unit's x segment was fetched one step ahead; the next one's loads go out now,
        // before this unit's stores.
        Seg sg = nxt;
        if (u + stride < n * segs) nxt = unit_fetch(p, io, u + stride, segs);
#if WIDE
        // The token's destinations, from its K slots (each at its first slot, below).
        bool any = false;
        for (int k = 0; k < K; k++) {
            const int dl = sm.sdl[t * K + k];
            any |= dl >= 0 && !is_gone(gone, dl >> 16);
        }
        if (!any) continue;
#else
        u32 mask = 0u;
        for (int k = 0; k < K; k++) {
            const int dl = sm.sdl[t * K + k];
            if (dl >= 0) mask |= 1u << (dl >> 16);
        }
        mask &= ~gone;
        if (mask == 0u) continue;
#endif
        const u16* xr = (const u16*)io.x + (u64)t * p.H;
        seg_quant(p, sg);
        // this lane's slot (lanes < K): owner, local expert, index within the expert
        int my_dl = -1, my_idx = 0;
        if (g == 0 && lane < K) {
            my_dl = sm.sdl[t * K + lane];
            if (my_dl >= 0) {
                const int e = sm.sk[t * K + lane];
                const u32 word = (u32)sm.bm[e * W + (t >> 5)];
                my_idx = sm.pw[e * W + (t >> 5)] + __popc(word & ((1u << (t & 31)) - 1u));
            }
        }
#if WIDE
        // The token's entry in batch(me -> d) for each of its destinations, at the first slot
        // bound there: `at` = t*K + k indexes tokpos and selpos (POS_ENTRIES).
        for (int k0 = 0; k0 < K; k0++) {
            const int dl0 = sm.sdl[t * K + k0];
            if (dl0 < 0 || is_gone(gone, dl0 >> 16)) continue;
            const int d = dl0 >> 16;
            bool seen = false;
#pragma unroll 4  // fewer than K <= 16 slots: a partial unroll is enough
            for (int k1 = 0; k1 < k0; k1++) {
                const int dl1 = sm.sdl[t * K + k1];
                seen |= dl1 >= 0 && (dl1 >> 16) == d;
            }
            if (seen) continue;
            const int at = t * K + k0;
            store_entry(p, tab, me, rank, d, sm.tokpos[at], &sm.selpos[at], sg, xr, g, t, my_dl, my_idx);
        }
#else
        for (u32 m = mask; m != 0u; m &= m - 1u) {
            const int d = __ffs(m) - 1;
            store_entry(p, tab, me, rank, d, sm.tokpos[t * R + d], &sm.selpos[t * R + d], sg, xr, g, t, my_dl, my_idx);
        }
#endif
        // Where (t, k) will come back in combine: its place in batch(owner -> me).
        if (g == 0 && lane < K) {
            int pos = -1;
            if (my_dl >= 0) {
                const int d = my_dl >> 16;
                int r = 0;
#pragma unroll 4  // as above
                for (int k = 0; k < lane; k++) {
                    const int dl2 = sm.sdl[t * K + k];
                    r += (dl2 >= 0 && (dl2 >> 16) == d);
                }
#if WIDE
                pos = sm.selpos[t * K + lane] + r;
#else
                pos = sm.selpos[t * R + d] + r;
#endif
            }
            ((int*)me.comb_pos)[t * K + lane] = pos;
        }
    }
    // ---- one signal per (source, destination) once every block of this rank has sent;
    // Every block ships its share of the per-expert row counts each destination needs (all
    // blocks hold them); block 0 the batch sizes.
    for (int i = bid * NTHREADS + tid; i < E; i += p.blocks_per_rank * NTHREADS) {
        const int d = i / L, l = i % L;
        if (is_gone(gone, d)) continue;
        int* cnt = via_nccl(p, d) ? (int*)me.snd_hdr + d * HDR_WORDS(L) + 2 : (int*)tab[d].bat_cnt + rank * L;
        cnt[l] = sm.pw[i * W + W - 1] + __popc((u32)sm.bm[i * W + W - 1]);
    }
    // loom: gpu_protocol::batched_pack_block (NCCL: the header over the host's poison), model capacity_bad_input_sender_header_poisoned.
    if (bid == 0 && tid < R && !is_gone(gone, tid)) {
        int* meta = via_nccl(p, tid) ? (int*)me.snd_hdr + tid * HDR_WORDS(L) : (int*)tab[tid].bat_meta + 2 * rank;
        meta[0] = sm.tot[tid];
        meta[1] = sm.tot[R + tid];
    }
    __syncthreads();
    PROF(2);
    if (tid == 0) {
        // loom: gpu_protocol::batched_send (counter, signal), model batched_two_senders_one_receiver.
        if (count_in(p, c.state + ST_SENT + KIND, 1u) == (u32)p.blocks_per_rank - 1u) {
            if (rank != p.fault_rank)
                for (int d = 0; d < R; d++)
                    if (!via_nccl(p, d) && !is_gone(gone, d)) st_release(p, sig_bat(tab[d]) + rank, signal_word(c.epoch, (u32)sm.tot[d]));
            // Reset for the next launch of the kind, which starts after this one ends (stream
            // order): after the signals, so that their release does not wait for it.
            c.state[ST_SENT + KIND] = 0u;
        }
    }
}
#undef KIND
