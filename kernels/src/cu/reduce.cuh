// The combine reduction of docs/contract.md (4): each token's weighted sum over its slots in
// ascending k, fused multiply-adds in f32, one bf16 rounding at the end; the shared sums
// (sum_span) and the per-expert combine's and batched combine's table path (reduce_tokens).
// Compiled after common.cuh (compile.rs HEADERS).

// One unit's weighted sums (reduce_spans, and batched combine's reduce_slots): per 8-channel
// chunk c0 + j * 256 of this lane below H, acc = 0; for k ascending over the valid slots (bit k
// of `valid`, k < K): acc = fmaf(w[k], float(y_k[h]), acc); stored as bf16 (round to nearest
// even) at out_row + c.
template <int NC, int KM>
__device__ __forceinline__ void sum_span(const uint4 (&yv)[NC][KM], const float (&w)[KM], u32 valid, int K, int H, int c0, u16* out_row) {
#pragma unroll
    for (int j = 0; j < NC; j++) {
        const int c = c0 + j * 256;
        if (c >= H) continue;
        float acc[8];
#pragma unroll
        for (int i = 0; i < 8; i++) acc[i] = 0.0f;
#pragma unroll
        for (int k = 0; k < KM; k++) {
            if (k < K && ((valid >> k) & 1u)) {
                const u32 yw[4] = {yv[j][k].x, yv[j][k].y, yv[j][k].z, yv[j][k].w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    acc[2 * i] = fmaf(w[k], __uint_as_float(yw[i] << 16), acc[2 * i]);
                    acc[2 * i + 1] = fmaf(w[k], __uint_as_float(yw[i] & 0xFFFF0000u), acc[2 * i + 1]);
                }
            }
        }
        uint4 o;
        o.x = (u32)f32_to_bf16_rne(acc[0]) | ((u32)f32_to_bf16_rne(acc[1]) << 16);
        o.y = (u32)f32_to_bf16_rne(acc[2]) | ((u32)f32_to_bf16_rne(acc[3]) << 16);
        o.z = (u32)f32_to_bf16_rne(acc[4]) | ((u32)f32_to_bf16_rne(acc[5]) << 16);
        o.w = (u32)f32_to_bf16_rne(acc[6]) | ((u32)f32_to_bf16_rne(acc[7]) << 16);
        *(uint4*)(out_row + c) = o;
    }
}
// The combine reduction of docs/contract.md for the tokens of one rank: for each token t and channel h,
// acc = 0; for k ascending over valid slots: acc = fmaf(w[t][k], float(y_row(t,k)[h]), acc);
// out = bf16_rne(acc). `rowbase[k]` is computed by the caller's functor ROW(t, k) -> row pointer.
// Units are (token, NC*256-channel span), spread over every warp of the rank's blocks; each lane
// holds NC 8-channel chunks of up to KM slots, all loaded before the first multiply-add.
template <int NC, int KM, typename RowFn>
__device__ __forceinline__ void reduce_spans(const KParams& p, const IoPtrs& io, int n, const int* sk, int bid, RowFn row_of) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int H = p.H, K = p.K;
    const float* wts = (const float*)io.weights;
    u16* out = (u16*)io.out;
    const int span = NC * 256;
    const int chunks = (H + span - 1) / span;
    for (int u = bid * NWARPS + warp; u < n * chunks; u += p.blocks_per_rank * NWARPS) {
        const int t = u / chunks;
        const int c0 = (u % chunks) * span + lane * 8;
        uint4 yv[NC][KM];
        float w[KM];
        u32 valid = 0u;
#pragma unroll
        for (int k = 0; k < KM; k++) {
            w[k] = 0.0f;
            if (k < K && sk[t * K + k] >= 0) {
                valid |= 1u << k;
                w[k] = wts[t * K + k];
                const u8* r = row_of(t, k);
#pragma unroll
                for (int j = 0; j < NC; j++)
                    if (c0 + j * 256 < H) yv[j][k] = *(const uint4*)(r + 2 * (c0 + j * 256));
            }
        }
        sum_span<NC, KM>(yv, w, valid, K, H, c0, out + (u64)t * H);
    }
}
// The reduction of rows whose channels are not a multiple of 8: a channel per lane, 32-channel
// units (reduce_tokens; batched combine's table path).
template <typename RowFn>
__device__ __forceinline__ void reduce_channels(const KParams& p, const IoPtrs& io, int n, const int* sk, int bid, RowFn row_of) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int H = p.H, K = p.K;
    const float* wts = (const float*)io.weights;
    u16* out = (u16*)io.out;
    const int chunks = (H + 31) / 32;
    for (int u = bid * NWARPS + warp; u < n * chunks; u += p.blocks_per_rank * NWARPS) {
        const int t = u / chunks;
        const int c = (u % chunks) * 32 + lane;
        if (c >= H) continue;
        float acc = 0.0f;
        for (int k = 0; k < K; k++) {
            if (sk[t * K + k] < 0) continue;
            u16 y = *(const u16*)(row_of(t, k) + 2 * c);
            acc = fmaf(wts[t * K + k], bf16_to_f32(y), acc);
        }
        out[(u64)t * H + c] = f32_to_bf16_rne(acc);
    }
}
template <typename RowFn>
__device__ __forceinline__ void reduce_tokens(const KParams& p, const IoPtrs& io, int n, const int* sk, int bid, RowFn row_of) {
    if ((p.H & 7) == 0) {
        // Up to 8 slots: 512-channel spans (16 loads in flight per lane); else 256 channels.
        if (p.K <= 8) reduce_spans<2, 8>(p, io, n, sk, bid, row_of);
        else reduce_spans<1, MAX_K>(p, io, n, sk, bid, row_of);
    } else {
        reduce_channels(p, io, n, sk, bid, row_of);
    }
}
