// batched.cu: per-destination batched dispatch and combine (DESIGN.md, "Per-destination batched").
//
// Dispatch, on source rank s, for every destination d:
//   every token bound for d is written once (deduplicated) into d's receive region for s, as
//   entry tokpos(t, d): a 64-byte header {src token, selection offset, -, -, local expert of each
//   slot or 0xFFFF} and the payload (bf16 row, or e4m3 row + scales). The region is contiguous
//   (entries 0..count), i.e. one put; when every block of s has finished its stores (block finish
//   counter), the last one stores the pair's one signal (epoch << 32 | count) with release.
// On destination d, block per local expert l: for every source s in order, wait for the signal,
//   scan the batch's headers for l (block prefix sum: batch order = source token order), and copy
//   the matching payloads into rows begin(l, s) + i: the canonical layout.
// Combine, on owner d, for every source s: the rows of every local expert that came from s, in
//   the order of batch(s->d)'s selections, go as one contiguous block into s's receive area for d,
//   then one signal. On s: wait for every owner's signal and reduce each token's slots in k order.
// All ranks of one GPU run in the same launch (blocks_per_rank blocks each), so that they are
// resident together and may wait for one another.

#define KIND KIND_BAT_DISPATCH
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) ep_batched_dispatch(KParams p) {
    extern __shared__ int smem_raw[];
    const RankPtrs* tab = (const RankPtrs*)p.table;
    const int bid = blockIdx.x % p.blocks_per_rank;
    const int rank = p.rank_base + blockIdx.x / p.blocks_per_rank;
    const RankPtrs& me = tab[rank];
    u32* state = (u32*)me.state;
    const int R = p.R, K = p.K, L = p.L, T = p.T;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    Smem sm = carve(p, smem_raw);
    __shared__ u32 s_epoch;
    __shared__ int s_n, s_cnt;
    if (tid == 0) {
        s_epoch = ld_volatile_u32(state + ST_EPOCH + KIND) + 1u;
        s_n = ((const int*)me.meta)[0];
    }
    __syncthreads();
    const u32 epoch = s_epoch;
    const int n = s_n;
    load_topk(p, me, n, sm.sk);
    // The previous call's batches must have been consumed before this call overwrites them.
    int bad = 0;
    if (tid < R) bad = !wait_ack(p, sig_bat_ack(me, R) + tid, epoch - 1u, epoch, rank, tid, PH_DISPATCH_SEND);
    __syncthreads();
    // Batch positions: warp w scans the tokens for destinations w, w + NWARPS, ...
    for (int d = warp; d < R; d += NWARPS) {
        int base_tok = 0, base_sel = 0;
        for (int c = 0; c < n; c += 32) {
            const int t = c + lane;
            int cnt = 0;
            if (t < n)
                for (int k = 0; k < K; k++) {
                    int e = sm.sk[t * K + k];
                    cnt += (e >= 0 && e / L == d);
                }
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
    if (__syncthreads_or(bad)) goto finish;
    {
        // ---- send: units (token, 512-channel segment) over all warps of this rank
        const int segs = (p.H + 511) / 512;
        for (int u = bid * NWARPS + warp; u < n * segs; u += p.blocks_per_rank * NWARPS) {
            const int t = u / segs, g = u % segs;
            u32 mask = 0u;
            for (int k = 0; k < K; k++) {
                int e = sm.sk[t * K + k];
                if (e >= 0) mask |= 1u << (e / L);
            }
            if (mask == 0u) continue;
            const u16* xr = (const u16*)me.x + (u64)t * p.H;
            Seg sg = seg_load(p, xr, g * 512);
            for (u32 m = mask; m != 0u; m &= m - 1u) {
                const int d = __ffs(m) - 1;
                u8* entry = (u8*)tab[d].bat_buf + ((u64)rank * T + sm.tokpos[t * R + d]) * p.entry_bytes;
                seg_store(p, sg, xr, g * 512, entry + HDR_BYTES);
                if (g == 0) {
                    if (lane < MAX_K) {
                        u16 lex = NO_LOCAL;
                        if (lane < K) {
                            int e = sm.sk[t * K + lane];
                            if (e >= 0 && e / L == d) lex = (u16)(e % L);
                        }
                        ((u16*)(entry + 16))[lane] = lex;
                    } else if (lane == 16) {
                        ((int*)entry)[0] = t;
                        ((int*)entry)[1] = sm.selpos[t * R + d];
                    }
                }
            }
            // Where (t, k) will come back in combine: its place in batch(owner -> me).
            if (g == 0 && lane < K) {
                int e = sm.sk[t * K + lane], pos = -1;
                if (e >= 0) {
                    const int d = e / L;
                    int r = 0;
                    for (int k = 0; k < lane; k++) {
                        int e2 = sm.sk[t * K + k];
                        r += (e2 >= 0 && e2 / L == d);
                    }
                    pos = sm.selpos[t * R + d] + r;
                }
                ((int*)me.comb_pos)[t * K + lane] = pos;
            }
        }
        // ---- one signal per (source, destination) once every block of this rank has sent
        __syncthreads();
        if (tid == 0) {
            fence_rel(p);
            u32 old = atomicAdd(state + ST_SENT + KIND, 1u);
            if (old == (u32)p.blocks_per_rank - 1u) {
                state[ST_SENT + KIND] = 0u;
                fence_rel(p);
                if (rank != p.fault_rank) {
                    for (int d = 0; d < R; d++) {
                        int* meta = (int*)tab[d].bat_meta + 2 * rank;
                        meta[0] = sm.tot[d];
                        meta[1] = sm.tot[R + d];
                    }
                    for (int d = 0; d < R; d++) st_release(p, sig_bat(tab[d]) + rank, signal_word(epoch, (u32)sm.tot[d]));
                }
            }
        }
        // ---- receive: block per local expert, sources in order
        const u64 RT = (u64)R * T;
        for (int l = bid; l < L; l += p.blocks_per_rank) {
            int base = 0;
            for (int s = 0; s < R; s++) {
                if (tid == 0) {
                    long long c = wait_signal(p, sig_bat(me) + s, epoch, rank, s, PH_DISPATCH_RECV);
                    s_cnt = (int)c;
                    if (c >= 0 && l == 0) ((int*)me.comb_cnt)[s] = ((const int*)me.bat_meta)[2 * s + 1];
                }
                __syncthreads();
                const int cnt = s_cnt;
                if (cnt < 0) goto finish;
                const int begin = base;
                const u8* region = (const u8*)me.bat_buf + (u64)s * T * p.entry_bytes;
                for (int c = 0; c < cnt; c += NTHREADS) {
                    const int j = c + tid;
                    int has = 0, slot = 0, cpos = 0;
                    if (j < cnt) {
                        const u8* h = region + (u64)j * p.entry_bytes;
                        const uint4 a = ((const uint4*)h)[1], b2 = ((const uint4*)h)[2];
                        const u32 w[8] = {a.x, a.y, a.z, a.w, b2.x, b2.y, b2.z, b2.w};
                        int nl = 0, pos = 0;
#pragma unroll
                        for (int k = 0; k < MAX_K; k++) {
                            const u32 v = (w[k >> 1] >> ((k & 1) * 16)) & 0xFFFFu;
                            if (k < K) {
                                if (v == (u32)l) {
                                    has = 1;
                                    slot = k;
                                    pos = nl;
                                }
                                nl += (v != NO_LOCAL);
                            }
                        }
                        if (has) cpos = ((const int*)h)[1] + pos;
                    }
                    int total;
                    const int idx = block_excl_scan(has, sm.scratch, &total);
                    if (has) {
                        sm.m_a[idx] = j;
                        sm.m_b[idx] = slot;
                        sm.m_c[idx] = cpos;
                    }
                    __syncthreads();
                    const bool vec = (p.xrow & 15) == 0;
                    if (vec)
                        block_copy_rows(
                            total, p.xrow, [&](int m) { return region + (u64)sm.m_a[m] * p.entry_bytes + HDR_BYTES; },
                            [&](int m) { return (u8*)me.recv_x + ((u64)l * RT + base + m) * p.xrow; });
                    for (int m = warp; m < total; m += NWARPS) {
                        const u8* h = region + (u64)sm.m_a[m] * p.entry_bytes;
                        const u64 row = (u64)l * RT + base + m;
                        if (!vec) warp_copy((u8*)me.recv_x + row * p.xrow, h + HDR_BYTES, p.xrow);
                        if (p.spr) {
                            const u32* src = (const u32*)(h + HDR_BYTES + p.xrow);
                            u32* dst = (u32*)me.recv_scales + row * p.spr;
                            for (int i = lane; i < p.spr; i += 32) dst[i] = src[i];
                        }
                        if (lane == 0) {
                            const int t = ((const int*)h)[0];
                            ((int*)me.src_info)[row] = t;
                            ((int*)me.row_tk)[row] = t * K + sm.m_b[m];
                            ((int*)me.comb_map)[(u64)s * T * K + sm.m_c[m]] = (int)row;
                        }
                    }
                    base += total;
                    __syncthreads();
                }
                if (tid == 0) {
                    ((int*)me.layout)[(l * R + s) * 2] = begin;
                    ((int*)me.layout)[(l * R + s) * 2 + 1] = base - begin;
                }
                __syncthreads();  // s_cnt is rewritten for the next source
            }
            if (tid == 0) ((int*)me.recv_count)[l] = base;
        }
    }
finish:
    if (last_block_out(p, state, KIND)) {
        if (threadIdx.x == 0) {
            state[ST_EPOCH + KIND] = epoch;
            for (int s = 0; s < R; s++) st_release(p, sig_bat_ack(tab[s], R) + rank, (u64)epoch);
        }
    }
}
#undef KIND

#define KIND KIND_BAT_COMBINE
#define SEGB 2048
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) ep_batched_combine(KParams p) {
    extern __shared__ int smem_raw[];
    const RankPtrs* tab = (const RankPtrs*)p.table;
    const int bid = blockIdx.x % p.blocks_per_rank;
    const int rank = p.rank_base + blockIdx.x / p.blocks_per_rank;
    const RankPtrs& me = tab[rank];
    u32* state = (u32*)me.state;
    const int R = p.R, K = p.K, L = p.L, T = p.T;
    const int tid = threadIdx.x, warp = tid >> 5;
    const u64 rowb = 2ull * p.H;
    Smem sm = carve(p, smem_raw);
    __shared__ u32 s_epoch;
    __shared__ int s_n;
    if (tid == 0) {
        s_epoch = ld_volatile_u32(state + ST_EPOCH + KIND) + 1u;
        s_n = ((const int*)me.meta)[0];
    }
    __syncthreads();
    const u32 epoch = s_epoch;
    const int n = s_n;
    load_topk(p, me, n, sm.sk);
    if (tid < R) sm.tot[tid] = ((const int*)me.comb_cnt)[tid];
    int bad = 0;
    if (tid < R) bad = !wait_ack(p, sig_cb_ack(me, R) + tid, epoch - 1u, epoch, rank, tid, PH_COMBINE_SEND);
    if (__syncthreads_or(bad)) goto finish;
    {
        // ---- send: batch(me -> s) = rows comb_map[s][0..cnt), to s's area for me
        const int G = (int)((rowb + SEGB - 1) / SEGB);
        int total = 0;
        for (int s = 0; s < R; s++) total += sm.tot[s];
        for (int u = bid * NWARPS + warp; u < total * G; u += p.blocks_per_rank * NWARPS) {
            int i = u / G;
            const int g = u % G;
            int s = 0;
            while (i >= sm.tot[s]) {
                i -= sm.tot[s];
                s++;
            }
            const u64 yrow = (u64)((const int*)me.comb_map)[(u64)s * T * K + i];
            const u8* src = (const u8*)me.y + yrow * rowb + (u64)g * SEGB;
            u8* dst = (u8*)tab[s].cmb_buf + ((u64)rank * T * K + i) * rowb + (u64)g * SEGB;
            const u64 left = rowb - (u64)g * SEGB;
            warp_copy(dst, src, (int)(left < SEGB ? left : SEGB));
        }
        __syncthreads();
        if (tid == 0) {
            fence_rel(p);
            u32 old = atomicAdd(state + ST_SENT + KIND, 1u);
            if (old == (u32)p.blocks_per_rank - 1u) {
                state[ST_SENT + KIND] = 0u;
                fence_rel(p);
                for (int s = 0; s < R; s++) st_release(p, sig_cb(tab[s], R) + rank, signal_word(epoch, (u32)sm.tot[s]));
            }
        }
        // ---- receive: every owner's batch, then the reduction in k order
        bad = 0;
        for (int d = tid; d < R; d += NTHREADS)
            bad |= wait_signal(p, sig_cb(me, R) + d, epoch, rank, d, PH_COMBINE_RECV) < 0;
        if (__syncthreads_or(bad)) goto finish;
        const int* cpos = (const int*)me.comb_pos;
        const u8* cbuf = (const u8*)me.cmb_buf;
        const u64 TK = (u64)T * K;
        reduce_tokens(p, me, n, sm.sk, bid, [&](int t, int k) -> const u8* {
            const int e = sm.sk[t * K + k];
            return cbuf + ((u64)(e / L) * TK + (u64)cpos[t * K + k]) * rowb;
        });
    }
finish:
    if (last_block_out(p, state, KIND)) {
        if (threadIdx.x == 0) {
            state[ST_EPOCH + KIND] = epoch;
            for (int d = 0; d < R; d++) st_release(p, sig_cb_ack(tab[d], R) + rank, (u64)epoch);
        }
    }
}
#undef KIND
#undef SEGB
