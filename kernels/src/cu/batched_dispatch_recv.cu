// batched_dispatch_recv.cu: the batched dispatch's receive (batched.cu's overview): every
// source's batch expanded into the canonical rows. Follows batched_dispatch_send.cu in the module
// (compile.rs BATCHED).
#define KIND KIND_BAT_DISPATCH
// One received unit of the expansion: a 512-byte chunk of an entry's payload, with the header
// fields this lane needs.
struct XUnit {
    int s, c;    // source rank, chunk
    u32 lx, ix;  // lanes < K: local expert of slot `lane` (or NO_LOCAL), index within (l, s)
    uint4 v;     // this lane's 16 payload bytes
};

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
#undef KIND
