// per_expert.cu: the per-expert path (docs/contract.md, "Per-expert (the reference)").
//
// Dispatch, on source rank s: block b owns experts e = b, b + B, ...; for each it lists the
//   tokens that selected e and writes every selection as its own message (a 16-byte header
//   {epoch low, token, slot, epoch high} + payload, quantized per message) into the owner's
//   region (l, s) at slot t; then one signal per (expert, source) with the count. On owner d:
//   block per local expert, for every source in order, wait for the (l, s) signal, find the
//   slots stamped with this call's epoch (token order), copy them into the canonical rows.
// Combine, on owner d: block per local expert copies every row back to its source's slot
//   t*K + k, then one signal per (expert, source). On s: wait for all E experts' signals and
//   reduce in k order.
// NCCL peers (bit d of p.nccl_mask; the call runs as stage 1 pack, host exchange, stage 2
//   unpack): dispatch stages the messages for d packed in expert order, entries of expert
//   (d, l) from d*T*K + (rows of d's experts before l), token order, and writes the header
//   (tokens, selections, rows per local expert) to snd_hdr; the host sends one message per
//   (d, l) into d's region (l, me) of pe_buf, entries 0..count, and the unpack reads count from
//   rcv_hdr instead of a signal and takes entries 0..count instead of scanning for the epoch.
//   Combine stages the rows of (l, s) for NCCL source s packed the same way from s*T*K; on s
//   they land from cmb_buf row T*K + npos(e) on (npos: selections of NCCL experts before e, in
//   expert order; the dispatch keeps each selection's row in comb_pos). No signals, no acks:
//   stream order puts this call's unpack before the next call's transfers.

#define PE_HDR 16

// The kernels are C++ functions in a namespace, as DeepEP's are: profilers show them as
// `ep_per_expert::dispatch` and `ep_per_expert::combine`, the names DeepEP's test (tests/utils.py bench_kineto)
// and engines' traces look for. compile.rs loads them by their mangled symbols.
namespace ep_per_expert {
__global__ void __launch_bounds__(NTHREADS, EP_MIN_BLOCKS) dispatch(KParams p, IoTable iot);
__global__ void __launch_bounds__(NTHREADS, EP_MIN_BLOCKS) combine(KParams p, IoTable iot);
}  // namespace ep_per_expert

#define KIND KIND_PE_DISPATCH
// The input check, then the acknowledgement wait. Returns false where the rank goes to the end
// (a failed group, bad input, or a failed wait).
__device__ __forceinline__ bool pe_dispatch_checked(const KParams& p, Call& c) {
    // Bad routing (or token count) is caught here, before anything is written (see
    // batched_dispatch_send.cu).
    const int in_bad = __syncthreads_or(load_topk<true>(p, (const i64*)c.io.topk, c.n, c.sm.sk, c.rank, false, PlaceOwner{c.sm.sdl, p.L})) | s_bad<KIND>;
    // A failed group, or this call's bad input, sends nothing valid: the poison instead of
    // this call's signals (see batched_dispatch_send.cu). loom: gpu_protocol::poison_signals, model
    // per_expert_failed_rank_poisons_enqueued_calls.
    if (s_fail<KIND> || in_bad) {
        poison_peers(p, c.tab, KIND, c.rank, c.gone0, c.epoch);
        return false;
    }
    // Thread d waits for destination d's acknowledgement of the previous call.
    // loom: gpu_protocol::sender_wait_acks, model per_expert_consecutive_calls.
    return !__syncthreads_or(wait_acks<KIND>(p, c, PH_DISPATCH_SEND, ack_waiter<KIND>(p, c, p.stage, 0, false)));
}

// ---- NCCL destinations: rows per expert (bm[e]), packed position of each expert's first row
// over the NCCL experts (pw[e]), tokens per destination (tot[d]); block 0 writes the headers.
// Routing only: no peer data.
__device__ __forceinline__ void pe_nccl_headers(const KParams& p, const Call& c) {
    const Smem& sm = c.sm;
    const RankPtrs& me = c.me;
    const int R = p.R, K = p.K, L = p.L, E = p.E, n = c.n, bid = c.bid, tid = threadIdx.x;
    for (int i = tid; i < E; i += NTHREADS) sm.bm[i] = 0;
    for (int i = tid; i < R; i += NTHREADS) sm.tot[i] = 0;
    __syncthreads();
    for (int i = tid; i < n * K; i += NTHREADS) {
        const int dl = sm.sdl[i];
        if (dl >= 0 && via_nccl(p, dl >> 16)) atomicAdd(&sm.bm[sm.sk[i]], 1);
    }
    for (int t = tid; t < n; t += NTHREADS) {
#if WIDE
        // Each NCCL destination of the token once (at its first slot).
        for (int k0 = 0; k0 < K; k0++) {
            const int dl0 = sm.sdl[t * K + k0];
            if (dl0 < 0 || !via_nccl(p, dl0 >> 16)) continue;
            bool seen = false;
            for (int k1 = 0; k1 < k0; k1++) {
                const int dl1 = sm.sdl[t * K + k1];
                seen |= dl1 >= 0 && (dl1 >> 16) == (dl0 >> 16);
            }
            if (!seen) atomicAdd(&sm.tot[dl0 >> 16], 1);
        }
#else
        u32 mask = 0u;
        for (int k = 0; k < K; k++) {
            const int dl = sm.sdl[t * K + k];
            if (dl >= 0) mask |= 1u << (dl >> 16);
        }
        for (u32 m = mask & p.nccl_mask[0]; m != 0u; m &= m - 1u) atomicAdd(&sm.tot[__ffs(m) - 1], 1);
#endif
    }
    __syncthreads();
    int run = 0;
    for (int c0 = 0; c0 < E; c0 += NTHREADS) {
        const int e = c0 + tid;
        int total;
        const int idx = block_excl_scan(e < E ? sm.bm[e] : 0, sm.scratch, &total);
        if (e < E) sm.pw[e] = run + idx;
        run += total;
    }
    __syncthreads();
    if (bid == 0) {
        int* hdr = (int*)me.snd_hdr;
        for (int i = tid; i < E; i += NTHREADS)
            if (via_nccl(p, i / L)) hdr[(i / L) * HDR_WORDS(L) + 2 + i % L] = sm.bm[i];
        for (int d = tid; d < R; d += NTHREADS)
            if (via_nccl(p, d)) {
                const int last = (d + 1) * L - 1;
                hdr[d * HDR_WORDS(L)] = sm.tot[d];
                hdr[d * HDR_WORDS(L) + 1] = sm.pw[last] + sm.bm[last] - sm.pw[d * L];
            }
    }
}

// ---- The send: one message per selection, one signal per expert.
__device__ __forceinline__ void pe_send(const KParams& p, const Call& c) {
    const Smem& sm = c.sm;
    const RankPtrs* tab = c.tab;
    const RankPtrs& me = c.me;
    const IoPtrs& io = c.io;
    const PeerSet gone = c.gone;
    const int R = p.R, K = p.K, L = p.L, T = p.T, E = p.E, n = c.n, rank = c.rank;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u64 epoch = c.epoch;
    const int segs = (p.H + 511) / 512;
    for (int e = c.bid; e < E; e += p.blocks_per_rank) {
        const int d = e / L, l = e % L;
        if (is_gone(gone, d)) continue;  // block-uniform
        const bool nc = via_nccl(p, d);
        // NVLink: d's region (l, me), slot = token; NCCL: this rank's staging, packed.
        u8* region = nc ? (u8*)me.snd_buf + ((u64)d * T * K + (sm.pw[e] - sm.pw[d * L])) * p.pe_entry_bytes
                        : (u8*)tab[d].pe_buf + ((u64)l * R + rank) * T * p.pe_entry_bytes;
        int count = 0;
        for (int c0 = 0; c0 < n; c0 += NTHREADS) {
            const int t = c0 + tid;
            int has = 0, slot = 0;
            if (t < n)
                for (int k = 0; k < K; k++)
                    if (sm.sk[t * K + k] == e) {
                        has = 1;
                        slot = k;
                    }
            int total;
            const int idx = block_excl_scan(has, sm.scratch, &total);
            if (has) {
                sm.m_a[idx] = t;
                sm.m_b[idx] = slot;
            }
            __syncthreads();
            for (int u = warp; u < total * segs; u += NWARPS) {
                const int m = u / segs, g = u % segs;
                const int tt = sm.m_a[m];
                u8* entry = region + (u64)(nc ? count + m : tt) * p.pe_entry_bytes;
                const u16* xr = (const u16*)io.x + (u64)tt * p.H;
                Seg sg = seg_load(p, xr, g * 512);
                seg_store(p, sg, xr, g * 512, entry + PE_HDR);
                if (g == 0 && lane == 0) {
                    ((u32*)entry)[0] = (u32)epoch;
                    ((int*)entry)[1] = tt;
                    ((int*)entry)[2] = sm.m_b[m];
                    ((u32*)entry)[3] = (u32)(epoch >> 32);
                    // Where (tt, slot) comes back in combine (cmb_buf row T*K + this).
                    if (nc) ((int*)me.comb_pos)[tt * K + sm.m_b[m]] = sm.pw[e] + count + m;
                }
            }
            count += total;
            __syncthreads();
        }
        __syncthreads();
        if (tid == 0 && rank != p.fault_rank && !nc) {
            fence_rel(p);
            // loom: gpu_protocol::per_expert_send, model per_expert_two_senders_one_receiver (mutant gpu_signal_relaxed).
            st_release(p, sig_pe(tab[d], R) + (u64)l * R + rank, signal_word(epoch, (u32)count));
        }
    }
}

// ---- The receive: block per local expert, sources in order, slots in token order. Returns
// where the rank goes to the end (a failed wait or a bad count).
__device__ __forceinline__ void pe_receive(const KParams& p, Call& c) {
    const Smem& sm = c.sm;
    const RankPtrs& me = c.me;
    const IoPtrs& io = c.io;
    const int R = p.R, K = p.K, L = p.L, T = p.T, rank = c.rank, bid = c.bid;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u64 epoch = c.epoch;
    __shared__ int s_cnt;
    const u64 RT = (u64)R * T;
    for (int l = bid; l < L; l += p.blocks_per_rank) {
        int base = 0;
        for (int s = 0; s < R; s++) {
            // loom: gpu_protocol::per_expert_receive, models per_expert_two_senders_one_receiver, per_expert_consecutive_calls, per_expert_tag_wrap.
            // NCCL source: the count from its header (arrived before this launch, in stream
            // order), the entries packed from slot 0.
            const bool nc = via_nccl(p, s);
            if (tid == 0) {
                long long got;
                const long long t0 = clock64();
                if (nc) got = (long long)((const int*)me.rcv_hdr)[s * HDR_WORDS(L) + 2 + l];
                // Shrink mode: "arrived" is proposed once all L of s's signals are here, so
                // the blocks of the other local experts can rely on theirs.
                // loom: gpu_protocol::wait_peer_signals (agreement), models shrink_* (mutants gpu_no_agreement, gpu_masked_peer_waited).
                else if (SHRINK(p))
                    got = is_gone(c.gone, s) ? PEER_LOST
                                             : wait_peer_signals(peer_wait(p, me, KIND, DEC_RECV, rank, s, PH_DISPATCH_RECV),
                                                                 sig_pe(me, R) + s, (u64)R, L, l, epoch);
                else got = wait_signal(p, sig_pe(me, R) + (u64)l * R + s, epoch, rank, s, PH_DISPATCH_RECV);
                // Per local expert, as DeepEP counts it (its receive waits per expert too).
                if (!nc) add_wait_cost(io.wait_stats, s, t0);
                if (got == PEER_LOST) {
                    GONE_ADD(s);
                    got = 0;  // sends nothing in this call
                } else if ((nc || got >= 0) && peer_bad(p, rank, s, PF_PE_COUNT, got, T)) got = -1;
                s_cnt = (int)got;
            }
            __syncthreads();
            if (s == 0 && l == bid) PROF(3);
            const int cnt = s_cnt;
            if (cnt < 0) return;
            const int begin = base;
            const u8* region = (const u8*)me.pe_buf + ((u64)l * R + s) * T * p.pe_entry_bytes;
            for (int c0 = 0; c0 < T && base - begin < cnt; c0 += NTHREADS) {
                const int j = c0 + tid;
                // One 16-byte load of the header (epoch low word at [0], high word at [3]):
                // no second, dependent load in the scan.
                int has = 0;
                if (nc) {
                    has = j < cnt;
                } else if (j < T) {
                    const uint4 hv = *(const uint4*)(region + (u64)j * p.pe_entry_bytes);
                    has = hv.x == (u32)epoch && hv.w == (u32)(epoch >> 32);
                }
                int total;
                const int idx = block_excl_scan(has, sm.scratch, &total);
                if (has) sm.m_a[idx] = j;
                __syncthreads();
                const bool vec = (p.xrow & 15) == 0;
                if (vec)
                    block_copy_rows(
                        total, p.xrow, [&](int m) { return region + (u64)sm.m_a[m] * p.pe_entry_bytes + PE_HDR; },
                        [&](int m) { return (u8*)io.recv_x + ((u64)l * RT + base + m) * p.xrow; });
                for (int m = warp; m < total; m += NWARPS) {
                    const u8* h = region + (u64)sm.m_a[m] * p.pe_entry_bytes;
                    const u64 row = (u64)l * RT + base + m;
                    if (!vec) warp_copy((u8*)io.recv_x + row * p.xrow, h + PE_HDR, p.xrow);
                    if (p.spr) {
                        const u32* src = (const u32*)(h + PE_HDR + p.xrow);
                        const ScaleRow dst = scale_row(p, (void*)io.recv_scales, row);
                        for (int i = lane; i < p.spr; i += 32) dst.p[i * dst.step] = src[i];
                    }
                    if (lane == 0) {
                        // Peer-written: the token and slot index combine's write-back.
                        const int t = ((const int*)h)[1];
                        const int k = ((const int*)h)[2];
                        ((int*)io.src_info)[row] = t;
                        if (!peer_bad(p, rank, s, PF_PE_TOKEN, t, T - 1) && !peer_bad(p, rank, s, PF_PE_SLOT, k, K - 1))
                            ((int*)me.row_tk)[row] = t * K + k;
                    }
                }
                base += total;
                __syncthreads();
            }
            if (tid == 0) {
                // The caller's output, and the group's copy combine reads (the handle).
                ((int*)io.layout)[(l * R + s) * 2] = begin;
                ((int*)io.layout)[(l * R + s) * 2 + 1] = base - begin;
                ((int*)me.layout)[(l * R + s) * 2] = begin;
                ((int*)me.layout)[(l * R + s) * 2 + 1] = base - begin;
            }
            __syncthreads();
        }
        if (tid == 0) {
            ((int*)io.recv_count)[l] = base;
            ((int*)me.recv_count)[l] = base;
        }
    }
}

// Everything of a per-expert dispatch between the start and the end; it returns where the rank
// goes to the end early (a failed group, bad input, a failed wait or bad peer data).
__device__ __forceinline__ void pe_dispatch_call(const KParams& p, Call& c) {
    if (!pe_dispatch_checked(p, c)) return;
    GONE_SNAPSHOT(c.gone);  // masked, or lost at the acknowledgement: nothing is sent there
    PROF(1);
    // The device API's routing and token count, kept for this call's combine (its handle).
    if (c.bid == 0 && c.io.topk != c.me.topk) {
        for (int i = threadIdx.x; i < c.n * p.K; i += NTHREADS) ((i64*)c.me.topk)[i] = ((const i64*)c.io.topk)[i];
        if (threadIdx.x == 0) ((int*)c.me.meta)[0] = c.n;
    }
    if (any_nccl(p) && p.stage != 2) pe_nccl_headers(p, c);
    if (p.stage != 2) pe_send(p, c);  // stage 2: the receive half
    PROF(2);
    if (p.stage != 1) pe_receive(p, c);  // stage 1: the send half only
}

__global__ void __launch_bounds__(NTHREADS, EP_MIN_BLOCKS) ep_per_expert::dispatch(KParams p, IoTable iot) {
    Call c = call_of<KIND>(p);
    frame_start<KIND>(p, iot, c, NTOK_CALLER);
    frame_open<KIND>(p, c);
    pe_dispatch_call(p, c);
    frame_end<KIND>(p, c, p.stage);
}
#undef KIND

#define KIND KIND_PE_COMBINE
#define SEGB 2048
// ---- The send: every row of local expert l back to its source's slot t*K+k; then one signal per
// (expert, source).
__device__ __forceinline__ void pe_combine_send(const KParams& p, const Call& c) {
    const Smem& sm = c.sm;
    const RankPtrs* tab = c.tab;
    const RankPtrs& me = c.me;
    const IoPtrs& io = c.io;
    const PeerSet gone = c.gone;
    const int R = p.R, K = p.K, L = p.L, T = p.T, rank = c.rank, bid = c.bid;
    const int tid = threadIdx.x, warp = tid >> 5;
    const u64 epoch = c.epoch;
    const u64 rowb = 2ull * p.H;
    const u64 crow = (u64)p.cmb_row;  // LogFMT: cmb_buf's row stride (a raw LogFMT row)
    const u64 RT = (u64)R * T;
    const int G = (int)((rowb + SEGB - 1) / SEGB);
    const int* layout = (const int*)me.layout;
    const u64 TK = (u64)T * K;
    // NCCL sources: rows of (l, s) staged packed from s*T*K in expert order; beg[l*R+s] =
    // rows of s's earlier experts (the host sizes the messages from the same headers).
    if (any_nccl(p)) {
        for (int s = tid; s < R; s += NTHREADS) {
            int run = 0;
            for (int l = 0; l < L; l++) {
                sm.beg[l * R + s] = run;
                run += layout[(l * R + s) * 2 + 1];
            }
        }
        __syncthreads();
    }
    for (int l = bid; l < L; l += p.blocks_per_rank) {
        const int cnt = ((const int*)me.recv_count)[l];
        // LogFMT: the block encodes the expert's rows straight into their slots (never over
        // NCCL: the host refuses it there), in rounds of lf_encode_rows.
        const int rpr = p.logfmt ? min(LF_ROWS, LF_UNITS / (p.H / LF_GROUP)) : 1;
        for (int r0 = 0; p.logfmt && r0 < cnt; r0 += rpr) {
            const int nr = min(rpr, cnt - r0);
            if (tid < nr) {
                const int i = r0 + tid;
                int s = 0;
                while (s + 1 < R && i >= layout[(l * R + s + 1) * 2]) s++;
                const u64 row = (u64)l * RT + i;
                const u64 tk = (u64)((const int*)me.row_tk)[row];
                lf_s_dst[tid] = is_gone(gone, s) ? 0ull : (u64)((u8*)tab[s].cmb_buf + tk * crow);
                lf_s_src[tid] = (u64)((const u8*)io.y + row * rowb);
            }
            lf_encode_rows(nr, p.H, p.prof);
        }
        for (int u = warp; !p.logfmt && u < cnt * G; u += NWARPS) {
            const int i = u / G, g = u % G;
            int s = 0;
            while (s + 1 < R && i >= layout[(l * R + s + 1) * 2]) s++;
            if (is_gone(gone, s)) continue;
            const u64 row = (u64)l * RT + i;
            const u64 tk = (u64)((const int*)me.row_tk)[row];
            const u8* src = (const u8*)io.y + row * rowb + (u64)g * SEGB;
            u8* dst;
            if (via_nccl(p, s)) {
                const u64 at = (u64)sm.beg[l * R + s] + (u64)(i - layout[(l * R + s) * 2]);
                if (at >= TK) continue;  // past T*K: headers the host refused already
                dst = (u8*)me.snd_buf + ((u64)s * TK + at) * rowb + (u64)g * SEGB;
            } else {
                dst = (u8*)tab[s].cmb_buf + tk * rowb + (u64)g * SEGB;
            }
            const u64 left = rowb - (u64)g * SEGB;
            warp_copy(dst, src, (int)(left < SEGB ? left : SEGB));
        }
        __syncthreads();
        for (int s = tid; s < R; s += NTHREADS) {
            if (via_nccl(p, s) || rank == p.fault_rank || is_gone(gone, s)) continue;
            fence_rel(p);
            // loom: not modelled itself; fence + release store after __syncthreads, as per-expert dispatch
            // (model per_expert_two_senders_one_receiver).
            st_release(p, sig_pc(tab[s], R, L) + (u64)rank * L + l, signal_word(epoch, (u32)layout[(l * R + s) * 2 + 1]));
        }
    }
}

// ---- The receive: every expert's signal, then the reduction in k order.
__device__ __forceinline__ void pe_combine_receive(const KParams& p, const Call& c) {
    const Smem& sm = c.sm;
    const RankPtrs& me = c.me;
    const IoPtrs& io = c.io;
    const PeerSet gone = c.gone;
    const int R = p.R, K = p.K, L = p.L, T = p.T, E = p.E, n = c.n, rank = c.rank, bid = c.bid;
    const int tid = threadIdx.x;
    const u64 epoch = c.epoch;
    const u64 rowb = 2ull * p.H;
    const u64 TK = (u64)T * K;
    int bad = 0;
    if (SHRINK(p)) {
        // One thread per owner: "arrived" once all L of its experts' signals are here.
        for (int d = tid; d < R; d += NTHREADS) {
            if (via_nccl(p, d) || is_gone(gone, d)) continue;
            const long long t0 = clock64();
            const long long got = wait_peer_signals(peer_wait(p, me, KIND, DEC_RECV, rank, d, PH_COMBINE_RECV),
                                                    sig_pc(me, R, L) + (u64)d * L, 1, L, -1, epoch);
            if (bid == 0) add_wait_cost(io.wait_stats, d, t0);
            if (got == PEER_LOST) GONE_ADD(d);
            else bad |= got < 0;
        }
    } else {
        // Every block waits for every expert's signal; block 0's waits are the ones counted
        // (wait_stats: one per expert of each owner, as the per-expert dispatch counts).
        for (int e = tid; e < E; e += NTHREADS) {
            if (via_nccl(p, e / L)) continue;
            const long long t0 = clock64();
            // loom: not modelled itself; the same wait_signal as per-expert dispatch (model per_expert_two_senders_one_receiver).
            bad |= wait_signal(p, sig_pc(me, R, L) + e, epoch, rank, e / L, PH_COMBINE_RECV) < 0;
            if (bid == 0) add_wait_cost(io.wait_stats, e / L, t0);
        }
    }
    if (__syncthreads_or(bad)) return;
    if (gone_any(GONE_LIVE())) {
        // Masked owners (before or in this call): their selections count as -1.
        const PeerSet g = GONE_LIVE();
        for (int i = tid; i < n * K; i += NTHREADS)
            if (sm.sk[i] >= 0 && is_gone(g, sm.sk[i] / L)) sm.sk[i] = -1;
        __syncthreads();
    }
    PROF(3);
    const u8* cbuf = (const u8*)me.cmb_buf;
    const int* cpos = (const int*)me.comb_pos;
    // NCCL owners' rows from row T*K on (their position from this rank's dispatch).
    // LogFMT (never with NCCL): every row at cmb_buf + (t*K + k) * cmb_row.
    if (p.logfmt) lf_reduce_tokens(p, io, me, n, sm.sk, bid);
    else reduce_tokens(p, io, n, sm.sk, bid, [&](int t, int k) -> const u8* {
        const u64 i = via_nccl(p, sm.sk[t * K + k] / L) ? TK + (u64)cpos[t * K + k] : (u64)t * K + k;
        return cbuf + i * rowb;
    });
}

// Everything of a per-expert combine between the start and the end; it returns where the rank
// goes to the end early (a failed group, a failed wait).
__device__ __forceinline__ void pe_combine_call(const KParams& p, Call& c) {
    load_topk<false>(p, (const i64*)c.me.topk, c.n, c.sm.sk, c.rank, false, PlaceOwner{c.sm.sdl, p.L});
    __syncthreads();
    // A failed group sends nothing valid: the poison instead of this call's signals, NaN rows to
    // its NCCL peers.
    if (s_fail<KIND>) {
        poison_peers(p, c.tab, KIND, c.rank, c.gone0, c.epoch);
        poison_nccl_rows(p, c.me, c.gone0, c.bid);
        return;
    }
    // Thread s waits for source s's acknowledgement of the previous call.
    // loom: not modelled itself; the same wait_ack as per-expert dispatch (model per_expert_consecutive_calls).
    if (__syncthreads_or(wait_acks<KIND>(p, c, PH_COMBINE_SEND, ack_waiter<KIND>(p, c, p.stage, 0, false)))) return;
    GONE_SNAPSHOT(c.gone);  // masked, or lost at the acknowledgement: no row goes back there
    PROF(1);
    if (p.stage != 2) pe_combine_send(p, c);
    PROF(2);
    if (p.stage == 1) return;  // send half only
    pe_combine_receive(p, c);
}

__global__ void __launch_bounds__(NTHREADS, EP_MIN_BLOCKS) ep_per_expert::combine(KParams p, IoTable iot) {
    Call c = call_of<KIND>(p);
    frame_start<KIND>(p, iot, c, NTOK_HANDLE);  // n: the dispatch's count and routing (the handle)
    frame_open<KIND>(p, c);
    pe_combine_call(p, c);
    frame_end<KIND>(p, c, p.stage);
}
#undef KIND
#undef SEGB
