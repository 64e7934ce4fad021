// batched_dispatch.cu: the batched dispatch (batched.cu's overview), one body for its three
// stages: the routing set-up and the checks, the batches sent once per destination, and the
// expansion of every source's batch into the canonical rows. The module is batched.cu, this file
// and batched_combine.cu, in that order (compile.rs BATCHED).
#define KIND KIND_BAT_DISPATCH
// One received unit of the expansion: a 512-byte chunk of an entry's payload, with the header
// fields this lane needs.
struct XUnit {
    int s, c;    // source rank, chunk
    u32 lx, ix;  // lanes < K: local expert of slot `lane` (or NO_LOCAL), index within (l, s)
    uint4 v;     // this lane's 16 payload bytes
};
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
        if (u + stride < n * segs) nxt = seg_fetch(p, (const u16*)io.x + (u64)((u + stride) / segs) * p.H, ((u + stride) % segs) * 512);
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
        if (u + stride < n * segs) nxt = seg_fetch(p, (const u16*)io.x + (u64)((u + stride) / segs) * p.H, ((u + stride) % segs) * 512);
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

// ---- The receive: every source's batch, expanded in parallel into the canonical rows (NCCL
// sources: the batch and its header arrived before this launch, in stream order).

// Thread s < R: the size of source s's batch, from its signal (or its NCCL header), into
// rcnt[s]. Returns false where the rank goes to the end (a failed wait, a poisoned or bad count).
template <int STAGE>
__device__ __forceinline__ bool receive_signals(const KParams& p, const Call& c, const DispatchPre& pre) {
    const Smem& sm = c.sm;
    const RankPtrs& me = c.me;
    const int R = p.R, L = p.L, T = p.T, rank = c.rank, tid = threadIdx.x;
    const u64 epoch = c.epoch;
    int bad = 0;
    if (tid < R) {
        long long cnt;
        const long long t0 = clock64();
        // loom: gpu_protocol::batched_unpack_block (NCCL, capacity: a poisoned count fails peer_bad), model capacity_bad_input_sender_header_poisoned.
        if (via_nccl(p, tid)) {
            cnt = ((const int*)me.rcv_hdr)[tid * HDR_WORDS(L)];
            // The host's poison left in place: the source's pack stage wrote no header (its
            // group had failed, or its input was bad), so nothing it sent is this call's.
            if (cnt == HDR_POISON) {
                report_peer_failed(p, rank, tid, PH_DISPATCH_RECV, epoch);
                cnt = -1;
            }
        }
        // Shrink mode: a masked source is not waited for, one whose wait runs out is masked
        // now (agreed by every block); either sends nothing in this call.
        // loom: gpu_protocol::wait_peer_signals (agreement), models shrink_* (mutants gpu_no_agreement, gpu_masked_peer_waited).
        else if (SHRINK(p))
            cnt = is_gone(c.gone, tid) ? PEER_LOST
                                       : wait_peer_signals(peer_wait(p, me, KIND, DEC_RECV, rank, tid, PH_DISPATCH_RECV), sig_bat(me) + tid, 0, 1, 0, epoch);
        // loom: gpu_protocol::batched_receive, models batched_two_senders_one_receiver, batched_consecutive_calls, batched_tag_wrap.
        else cnt = presig_of<STAGE>(p, R, tid) ? wait_signal_pre(p, sig_bat(me) + tid, pre.sig0, epoch, rank, tid, PH_DISPATCH_RECV)
                                               : wait_signal(p, sig_bat(me) + tid, epoch, rank, tid, PH_DISPATCH_RECV);
        // Every block waits for every source; block 0's wait is the one counted.
        if (c.bid == 0 && !via_nccl(p, tid)) add_wait_cost(c.io.wait_stats, tid, t0);
        if (cnt == PEER_LOST) {
            GONE_ADD(tid);
            cnt = 0;
        }
        bad = cnt < 0 || peer_bad(p, rank, tid, PF_BATCH_TOKENS, cnt, T);
        sm.rcnt[tid] = bad ? 0 : (int)cnt;
    }
    return !__syncthreads_or(bad);
}

// The rows of each local expert from each source (cls) and where they begin (beg), the
// selections each source sent (comb_cnt: the rows combine sends back), and the caller's and the
// handle's counts and layout. Returns false where the rank goes to the end (a bad count).
template <int STAGE>
__device__ __forceinline__ bool receive_counts(const KParams& p, const Call& c, const DispatchPre& pre) {
    const Smem& sm = c.sm;
    const RankPtrs& me = c.me;
    const IoPtrs& io = c.io;
    const PeerSet gone = c.gone;
    const int R = p.R, K = p.K, L = p.L, T = p.T, rank = c.rank, bid = c.bid, tid = threadIdx.x;
    int bad = 0;
    // Rows of each local expert from each source (peer-supplied: at most T each).
    // Thread i's first count was loaded at the start when its acquire saw this call's signal.
    const bool pre_in = precnt_of<STAGE>(p, R, tid) && sig_in(pre.sig0, c.epoch);
    for (int i = tid; i < L * R; i += NTHREADS) {
        const int s = i % R, l = i / R;
        const int cnt = is_gone(gone, s) ? 0
                        : via_nccl(p, s) ? ((const int*)me.rcv_hdr)[s * HDR_WORDS(L) + 2 + l]
                        : i == tid && pre_in ? pre.pcnt
                                             : ((const int*)me.bat_cnt)[s * L + l];
        const bool b = peer_bad(p, rank, s, PF_EXPERT_ROWS, cnt, T);
        bad |= b;
        sm.cls[i] = b ? 0 : cnt;
    }
    // Selections each source sent (rows combine sends back), block 0 only.
    int cc = 0;
    if (bid == 0 && tid < R && !is_gone(gone, tid)) {
        const int sel = via_nccl(p, tid)                         ? ((const int*)me.rcv_hdr)[tid * HDR_WORDS(L) + 1]
                        : presig_of<STAGE>(p, R, tid) && pre_in ? pre.psel
                                                                : ((const int*)me.bat_meta)[2 * tid + 1];
        cc = peer_bad(p, rank, tid, PF_SELECTIONS, sel, T * K) ? 0 : sel;
    }
    if (__syncthreads_or(bad)) return false;
    PROF(11);  // every row count loaded and bounded
    if (bid == 0 && tid < R) ((int*)me.comb_cnt)[tid] = cc;
    // begin(l, s) = rows of l from sources before s (canonical order)
    for (int l = tid; l < L; l += NTHREADS) {
        int b0 = 0;
        for (int s = 0; s < R; s++) {
            sm.beg[l * R + s] = b0;
            b0 += sm.cls[l * R + s];
        }
        if (bid == 0) {
            // The caller's outputs, and the group's copy combine reads (the handle).
            ((int*)io.recv_count)[l] = b0;
            ((int*)me.recv_count)[l] = b0;
            for (int s = 0; s < R; s++) {
                ((int*)io.layout)[(l * R + s) * 2] = sm.beg[l * R + s];
                ((int*)io.layout)[(l * R + s) * 2 + 1] = sm.cls[l * R + s];
                ((int*)me.layout)[(l * R + s) * 2] = sm.beg[l * R + s];
                ((int*)me.layout)[(l * R + s) * 2 + 1] = sm.cls[l * R + s];
            }
        }
    }
    __syncthreads();
    return true;
}

// Entry j of the concatenated batches (source order): its header, and its source.
__device__ __forceinline__ const u8* entry_of(const KParams& p, const Call& c, int j, int& s) {
    s = 0;
    while (j >= c.sm.rcnt[s]) {
        j -= c.sm.rcnt[s];
        s++;
    }
    return (const u8*)c.me.bat_buf + ((u64)s * p.T + j) * p.entry_bytes;
}
// Peer-written header: a local expert below L and an index below the rows of (l, s), or the slot
// is skipped and the error reported. Checked where the header is used, so that the loads of all
// four units stay in flight (receive_batches).
__device__ __forceinline__ u32 checked_slot(const KParams& p, const Call& c, u32 lx, u32 ix, int s) {
    const int L = p.L, R = p.R;
    if (lx != NO_LOCAL && (lx >= (u32)L || ix >= (u32)c.sm.cls[lx * R + s])) {
        if (lx >= (u32)L) report_error(p, ERR_PEER_DATA, c.rank, s, PF_HDR_LOCAL, lx, 0u, L - 1);
        else report_error(p, ERR_PEER_DATA, c.rank, s, PF_HDR_INDEX, ix, 0u, c.sm.cls[lx * R + s] - 1);
        return NO_LOCAL;
    }
    return lx;
}
// Unit u's loads (entry u / Cx, chunk u % Cx; rcx = 1 / Cx): its header fields and this lane's
// payload bytes.
__device__ __forceinline__ void load_unit(const KParams& p, const Call& c, int u, int Cx, float rcx, XUnit& x) {
    const int lane = threadIdx.x & 31;
    const int j = div_rcp(u, Cx, rcx);
    const int ch = u - j * Cx;
    const u8* h = entry_of(p, c, j, x.s);
    x.c = ch;
    x.lx = NO_LOCAL;
    x.ix = 0;
    if (lane < p.K) {
        x.lx = ((const u16*)(h + 16))[lane];
        x.ix = ((const u16*)(h + 48))[lane];
    }
    const int off = ch * 512 + lane * 16;
    if (off < p.xrow) x.v = *(const uint4*)(h + HDR_BYTES + off);
}
// Slot `lane`'s place (lanes < K whose slot is bound here, lx != NO_LOCAL): the row within local
// expert lx's region (r) and the row of the whole receive area (l * R * T + r). Every slot lane
// computes its own at once, so that the stores below take them by shuffles and no store waits
// on a chain of shared-memory loads (the per-slot chain cost about 0.12 us a slot at T = 1).
__device__ __forceinline__ u64 place_of(const KParams& p, const Call& c, u32 lx, u32 ix, int s, int& r) {
    r = 0;
    if (lx == NO_LOCAL) return 0;
    r = c.sm.beg[lx * p.R + s] + (int)ix;
    return (u64)lx * ((u64)p.R * p.T) + (u64)r;
}
// A loaded unit's stores: its payload bytes into the row of every slot it is bound for.
__device__ __forceinline__ void store_unit(const KParams& p, const Call& c, const XUnit& x) {
    const int lane = threadIdx.x & 31;
    const u32 lx = checked_slot(p, c, x.lx, x.ix, x.s);
    int r;
    const u64 rk = place_of(p, c, lx, x.ix, x.s, r);
    const int off = x.c * 512 + lane * 16;
    const u32 slots = __ballot_sync(0xffffffffu, lx != NO_LOCAL);
    u8* base = (u8*)c.io.recv_x + off;
    for (u32 m = slots; m != 0u; m &= m - 1u) {
        const u64 row = __shfl_sync(0xffffffffu, rk, __ffs(m) - 1);
        if (off < p.xrow) *(uint4*)(base + row * p.xrow) = x.v;
    }
}
// The tail of entry j: the scales (loaded once, up to 128 words: 4 per lane, and stored to every
// slot's row; wider rows copy them word by word), the row itself when rows are not 16-byte
// multiples, and the places combine reads back (lane k stores slot k's).
__device__ __forceinline__ void store_tail(const KParams& p, const Call& c, int j) {
    const RankPtrs& me = c.me;
    const IoPtrs& io = c.io;
    const int K = p.K, T = p.T, rank = c.rank, lane = threadIdx.x & 31;
    const int TK = T * K;
    const bool vec = (p.xrow & 15) == 0;
    int s;
    const u8* h = entry_of(p, c, j, s);
    const u32 ix = lane < K ? ((const u16*)(h + 48))[lane] : 0u;
    const u32 lx = checked_slot(p, c, lane < K ? ((const u16*)(h + 16))[lane] : NO_LOCAL, ix, s);
    const int t = ((const int*)h)[0];
    const int sel = ((const int*)h)[1];
    const u32* src = (const u32*)(h + HDR_BYTES + p.xrow);
    const bool sreg = p.spr <= 128;
    u32 sv[4];
#pragma unroll
    for (int z = 0; z < 4; z++) {
        const int w = z * 32 + lane;
        sv[z] = sreg && w < p.spr ? src[w] : 0u;
    }
    const u32 slots = __ballot_sync(0xffffffffu, lx != NO_LOCAL);
    // The selection offset indexes comb_map, and the token (in row_tk, t*K + k) the
    // row combine puts back in the source's receive area: both bounded.
    if (slots != 0u && (sel < 0 || sel > TK - __popc(slots))) {
        if (lane == 0) report_error(p, ERR_PEER_DATA, rank, s, PF_HDR_SEL, (u32)sel, 0u, (u32)(TK - __popc(slots)));
        return;
    }
    if (slots != 0u && (t < 0 || t >= T)) {
        if (lane == 0) report_error(p, ERR_PEER_DATA, rank, s, PF_HDR_TOKEN, (u32)t, 0u, (u32)(T - 1));
        return;
    }
    int r;
    const u64 rk = place_of(p, c, lx, ix, s, r);
    if (lx != NO_LOCAL) {
        ((int*)io.src_info)[rk] = t;
        ((int*)me.row_tk)[rk] = t * K + lane;
        ((int*)me.comb_map)[(u64)s * TK + sel + __popc(slots & ((1u << lane) - 1u))] = (int)rk;
    }
    if (!vec)
        for (u32 m = slots; m != 0u; m &= m - 1u)
            warp_copy((u8*)io.recv_x + __shfl_sync(0xffffffffu, rk, __ffs(m) - 1) * p.xrow, h + HDR_BYTES, p.xrow);
    if (!p.spr) return;
    // Slot `lane`'s scale row; the warp stores each slot's in turn.
    const ScaleRow mine = scale_row(p, (void*)io.recv_scales, lx == NO_LOCAL ? 0 : (u64)lx, (u64)r);
    if (sreg) {
        for (u32 m = slots; m != 0u; m &= m - 1u) {
            u32* dst = (u32*)__shfl_sync(0xffffffffu, (u64)mine.p, __ffs(m) - 1);
#pragma unroll
            for (int z = 0; z < 4; z++) {
                const int w = z * 32 + lane;
                if (w < p.spr) dst[w * mine.step] = sv[z];
            }
        }
    } else {
        for (u32 m = slots; m != 0u; m &= m - 1u) {
            u32* dst = (u32*)__shfl_sync(0xffffffffu, (u64)mine.p, __ffs(m) - 1);
            for (int z = lane; z < p.spr; z += 32) dst[z * mine.step] = src[z];
        }
    }
}
// The expansion: the entries' payload chunks in units over every warp of this rank (four units'
// loads in flight per warp, all issued before any store), then one tail per entry.
template <int STAGE>
__device__ __forceinline__ void receive_batches(const KParams& p, Call& c, const DispatchPre& pre) {
    if (!receive_signals<STAGE>(p, c, pre)) return;
    GONE_SNAPSHOT(c.gone);  // + the sources lost in this call: their counts below are 0
    PROF(3);
    const bool vec = (p.xrow & 15) == 0;
    const int Cx = vec ? (p.xrow + 511) / 512 : 0;  // 512-byte chunks of the row
    const float rcx = Cx ? __frcp_rn((float)Cx) : 0.0f;  // div_rcp corrects the quotient
    int entries = 0;
#pragma unroll 1
    for (int s = 0; s < p.R; s++) entries += c.sm.rcnt[s];
    // Units: first every entry's payload chunks (entry u / Cx, chunk u % Cx), then one tail per
    // entry (its scales, token and indices), over every warp of this rank.
    const int units = entries * Cx;
    const int nw = p.blocks_per_rank * NWARPS;
    // Units u0 + q*nw (q < 4, so that every warp gets work). The first four units' loads go out
    // now, ahead of the row counts they need.
    XUnit xq[4];
    int u0 = spread_warp(p, c.bid);
#pragma unroll
    for (int q = 0; q < 4; q++)
        if (u0 + q * nw < units) load_unit(p, c, u0 + q * nw, Cx, rcx, xq[q]);
    if (!receive_counts<STAGE>(p, c, pre)) return;
    if (STAGE == 2) PROF(6);  // the receive half: row counts and places known
    while (u0 < units) {
#pragma unroll
        for (int q = 0; q < 4; q++)
            if (u0 + q * nw < units) store_unit(p, c, xq[q]);
        u0 += 4 * nw;
#pragma unroll
        for (int q = 0; q < 4; q++)
            if (u0 + q * nw < units) load_unit(p, c, u0 + q * nw, Cx, rcx, xq[q]);
    }
    // The tails: unit units + j is entry j's, on the warp that unit index falls to.
    int ut = spread_warp(p, c.bid);
    if (ut < units) ut += (units - ut + nw - 1) / nw * nw;
    for (; ut < units + entries; ut += nw) store_tail(p, c, ut - units);
}

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
    if (STAGE != 2 && u_first < n * segs) x0 = seg_fetch(p, (const u16*)io.x + (u64)(u_first / segs) * p.H, (u_first % segs) * 512);
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
