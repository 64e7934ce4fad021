// logfmt.cuh: LogFMT-10, the combine's optional row format (docs/contract.md "4.1 LogFMT"),
// bit-identical to ep_reference::numerics::logfmt (the math) and logfmt_wire (the bytes).
// IEEE f32 only, every rounding step written out (__fadd_rn, __fmul_rn, __fdiv_rn, __fmaf_rn:
// the module is compiled with --fmad=false anyway); no log2f/exp2f: the log is the exact table
// below plus the exponent, the exp the fixed polynomial below.
//
// A row of H = 128 G channels on the wire: G meta words of 4 bytes (amax bits | amin bits << 16,
// the magnitudes' largest and smallest bf16 bits), then the G bodies in channel order: 160 bytes
// for a packed group (field i, sign << 9 | code, at bits 10i..10i+9 of the body as one
// little-endian bit string), 256 for a raw one (its bf16 values). A warp handles a group at a
// time: lane j holds channels 4j..4j+3, i.e. bits 40j..40j+39 (bytes 5j..5j+4) of a packed body
// and bytes 8j..8j+7 of a raw one. Bodies start 4-aligned (metas and bodies are multiples of 4
// bytes) in rows whose stride (KParams.cmb_row) is a multiple of 4.

#define LF_GROUP 128
#define LF_META_BYTES 4
#define LF_PACKED_BYTES 160
#define LF_RAW_BYTES 256
#define LF_TOP_CODE 511
// Groups per unit of the reduction (1024 channels).
#define LF_SPAN 8

// log2(1 + m/128) rounded to the nearest f32, as bits (ep_reference::numerics::logfmt::
// LOG2_MANTISSA; kernels/tests/logfmt_header.rs checks that the two tables agree).
__device__ const u32 LF_LOG2_MANTISSA[128] = {
    0x00000000u, 0x3C37F286u, 0x3CB73CB4u, 0x3D08E68Fu, 0x3D35D69Cu, 0x3D626FD6u, 0x3D8759C5u, 0x3D9D517Fu,
    0x3DB31FB8u, 0x3DC8C50Bu, 0x3DDE4212u, 0x3DF39761u, 0x3E0462C4u, 0x3E0EE68Du, 0x3E19574Fu, 0x3E23B550u,
    0x3E2E00D2u, 0x3E383A17u, 0x3E42615Fu, 0x3E4C76E8u, 0x3E567AF1u, 0x3E606DB6u, 0x3E6A4F72u, 0x3E74205Fu,
    0x3E7DE0B6u, 0x3E83C857u, 0x3E88983Fu, 0x3E8D602Eu, 0x3E92203Du, 0x3E96D888u, 0x3E9B8926u, 0x3EA03232u,
    0x3EA4D3C2u, 0x3EA96DF0u, 0x3EAE00D2u, 0x3EB28C7Fu, 0x3EB7110Eu, 0x3EBB8E96u, 0x3EC0052Bu, 0x3EC474E4u,
    0x3EC8DDD4u, 0x3ECD4012u, 0x3ED19BB0u, 0x3ED5F0C4u, 0x3EDA3F60u, 0x3EDE8797u, 0x3EE2C97Du, 0x3EE70525u,
    0x3EEB3A9Fu, 0x3EEF69FFu, 0x3EF39355u, 0x3EF7B6B4u, 0x3EFBD42Bu, 0x3EFFEBCDu, 0x3F01FED4u, 0x3F0404E8u,
    0x3F060828u, 0x3F08089Eu, 0x3F0A0650u, 0x3F0C0146u, 0x3F0DF989u, 0x3F0FEF1Fu, 0x3F11E20Fu, 0x3F13D260u,
    0x3F15C01Au, 0x3F17AB44u, 0x3F1993E3u, 0x3F1B7A00u, 0x3F1D5DA0u, 0x3F1F3ECAu, 0x3F211D84u, 0x3F22F9D5u,
    0x3F24D3C2u, 0x3F26AB53u, 0x3F28808Cu, 0x3F2A5374u, 0x3F2C2411u, 0x3F2DF268u, 0x3F2FBE80u, 0x3F31885Cu,
    0x3F335004u, 0x3F35157Du, 0x3F36D8CBu, 0x3F3899F5u, 0x3F3A58FFu, 0x3F3C15EEu, 0x3F3DD0C8u, 0x3F3F8991u,
    0x3F41404Fu, 0x3F42F506u, 0x3F44A7BAu, 0x3F465872u, 0x3F480731u, 0x3F49B3FBu, 0x3F4B5ED7u, 0x3F4D07C7u,
    0x3F4EAED0u, 0x3F5053F7u, 0x3F51F740u, 0x3F5398AFu, 0x3F553848u, 0x3F56D60Fu, 0x3F587209u, 0x3F5A0C3Au,
    0x3F5BA4A4u, 0x3F5D3B4Eu, 0x3F5ED039u, 0x3F60636Au, 0x3F61F4E5u, 0x3F6384ADu, 0x3F6512C7u, 0x3F669F35u,
    0x3F6829FBu, 0x3F69B31Eu, 0x3F6B3A9Fu, 0x3F6CC083u, 0x3F6E44CDu, 0x3F6FC781u, 0x3F7148A1u, 0x3F72C832u,
    0x3F744636u, 0x3F75C2B0u, 0x3F773DA4u, 0x3F78B714u, 0x3F7A2F04u, 0x3F7BA578u, 0x3F7D1A71u, 0x3F7E8DF2u,
};
// 2^f ~ 1 + f(a1 + f(a2 + f(a3 + f(a4 + f(a5 + f a6))))) on [0, 1], a1..a6 as f32 bits
// (ep_reference::numerics::logfmt::EXP2_POLY, checked by the same test).
#define LF_EXP2_A1 0x3F317216u
#define LF_EXP2_A2 0x3E75FEACu
#define LF_EXP2_A3 0x3D634488u
#define LF_EXP2_A4 0x3C1E85CCu
#define LF_EXP2_A5 0x3AA36B0Fu
#define LF_EXP2_A6 0x3962A0F9u

// log2 of a positive normal bf16 magnitude (bits in 0x0080..0x7F80): exponent + table, one add.
__device__ __forceinline__ float lf_log2_bf16(u32 bits) {
    const int e = (int)(bits >> 7) - 127;
    return __fadd_rn((float)e, __uint_as_float(__ldg(&LF_LOG2_MANTISSA[bits & 0x7Fu])));
}
// 2^y for y in [-126, 0]: n = floor(y), f = y - n, the polynomial at f by Horner with fma,
// times 2^n (pow2i, fp8.cuh: exact, the result is normal).
__device__ __forceinline__ float lf_exp2(float y) {
    const float n = floorf(y);
    const float f = __fsub_rn(y, n);
    float q = __uint_as_float(LF_EXP2_A6);
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A5));
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A4));
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A3));
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A2));
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A1));
    return __fmul_rn(__fmaf_rn(q, f, 1.0f), pow2i((int)n));
}

// Whether the group of meta word `meta` travels packed: 2^-93 <= amax < 1 (bits 0x1100..0x3F80)
// and amin < amax.
__device__ __forceinline__ bool lf_packed(u32 meta) {
    const u32 amax = meta & 0xFFFFu, amin = meta >> 16;
    return amax >= 0x1100u && amax < 0x3F80u && amin < amax;
}
// A packed group's grid: point c in 1..511 is 2^(la - (511 - c) step); 0 is zero.
struct LfGrid {
    float la;    // log2(amax)
    float step;  // (la - max(log2(amin), la - 32)) / 510; la - 32 where amin is zero or subnormal
};
__device__ __forceinline__ LfGrid lf_grid(u32 meta) {
    const u32 amax = meta & 0xFFFFu, amin = meta >> 16;
    LfGrid g;
    g.la = lf_log2_bf16(amax);
    const float floor32 = __fsub_rn(g.la, 32.0f);
    const float lmin = amin < 0x0080u ? floor32 : fmaxf(lf_log2_bf16(amin), floor32);
    g.step = __fdiv_rn(__fsub_rn(g.la, lmin), 510.0f);
    return g;
}
// The magnitude code c decodes to.
__device__ __forceinline__ float lf_magnitude(const LfGrid& g, u32 c) {
    if (c == 0u) return 0.0f;
    return lf_exp2(__fmaf_rn(-(float)(LF_TOP_CODE - c), g.step, g.la));
}
// The code of magnitude bits `a` (sign cleared, at most amax): the largest c in 0..511 with
// c == 0 or (m(c-1) + m(c)) * 0.5 <= a. The reference's guess from the log domain, then its
// corrections against the thresholds (which do not decrease), so the guess never changes the
// result; m(c) is carried from one step to the next.
__device__ __forceinline__ u32 lf_code(const LfGrid& g, u32 a) {
    const float av = __uint_as_float(a << 16);
    u32 c = 0u;
    if (a >= 0x0080u) {
        const float t = __fadd_rn(__fdiv_rn(__fsub_rn(lf_log2_bf16(a), g.la), g.step), 511.5f);
        // Clamped to [0, 511] and truncated; a NaN guess is 0, as the reference's cast gives.
        c = t >= 0.0f ? (t <= 511.0f ? (u32)__float2int_rz(t) : 511u) : 0u;
    }
    float mc = lf_magnitude(g, c);
    while (c < LF_TOP_CODE) {
        const float next = lf_magnitude(g, c + 1u);
        if (__fmul_rn(__fadd_rn(mc, next), 0.5f) > av) break;
        c++;
        mc = next;
    }
    while (c > 0u) {
        const float prev = lf_magnitude(g, c - 1u);
        if (!(__fmul_rn(__fadd_rn(prev, mc), 0.5f) > av)) break;
        c--;
        mc = prev;
    }
    return c;
}
// The value a 10-bit field decodes to (sign << 9 | code); a zero code keeps its sign.
__device__ __forceinline__ float lf_decode(const LfGrid& g, u32 field) {
    const float m = lf_magnitude(g, field & LF_TOP_CODE);
    return (field & 0x200u) ? -m : m;
}

// Word w (bytes 4w..4w+3) of a packed body whose lane j holds bits 40j..40j+39 in v (the low
// 40 bits). All 32 lanes call it (shuffles); a w past 39 gives a value nobody stores.
__device__ __forceinline__ u32 lf_body_word(u64 v, int w) {
    const int a = (4 * w) / 5;       // the lane holding bit 32w
    const int o = 32 * w - 40 * a;   // its offset there, 0..32
    const u64 lo = __shfl_sync(0xffffffffu, v, a & 31);
    const u64 hi = __shfl_sync(0xffffffffu, v, (a + 1) & 31);
    return (u32)((lo >> o) | (hi << (40 - o)));
}

// Encodes the bf16 row `src` (H = 128 G channels, 8-aligned) into `dst` (4-aligned, room for
// G (4 + 256) bytes) with one warp: every lane calls it. Returns the bytes written. Out of line
// (scalar arguments): one copy per module, however many stages call it.
__device__ __noinline__ u32 lf_encode_row(u8* dst, const u8* src, int H) {
    const int lane = threadIdx.x & 31;
    const int G = H / LF_GROUP;
    u32 at = (u32)G * LF_META_BYTES;
    for (int g = 0; g < G; g++) {
        const uint2 v = *(const uint2*)(src + (u64)g * LF_RAW_BYTES + lane * 8);
        // Channel i of this lane: bits 16(i % 2).. of word i / 2.
        auto bf = [&](int i) -> u32 { return ((i < 2 ? v.x : v.y) >> (16 * (i & 1))) & 0xFFFFu; };
        u32 mx = 0u, mn = 0x7FFFu;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            mx = max(mx, bf(i) & 0x7FFFu);
            mn = min(mn, bf(i) & 0x7FFFu);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            mn = min(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        }
        const u32 meta = mx | (mn << 16);
        if (lane == 0) *(u32*)(dst + (u64)g * LF_META_BYTES) = meta;
        u8* body = dst + at;
        if (lf_packed(meta)) {
            const LfGrid gr = lf_grid(meta);
            u64 bits = 0ull;
            // Not unrolled: one copy of lf_code (its loops are the bulk of the encoder's code).
#pragma unroll 1
            for (int i = 0; i < 4; i++) {
                const u32 b = bf(i);
                const u32 field = ((b >> 15) << 9) | lf_code(gr, b & 0x7FFFu);
                bits |= (u64)field << (10 * i);
            }
            const u32 w0 = lf_body_word(bits, lane);
            const u32 w1 = lf_body_word(bits, lane + 32);
            *(u32*)(body + 4 * lane) = w0;
            if (lane < 8) *(u32*)(body + 128 + 4 * lane) = w1;
            at += LF_PACKED_BYTES;
        } else {
            *(u32*)(body + 8 * lane) = v.x;
            *(u32*)(body + 8 * lane + 4) = v.y;
            at += LF_RAW_BYTES;
        }
    }
    return at;
}

// The values of this lane's 4 channels (4 lane .. 4 lane + 3) of a group with meta word `meta`
// whose body starts at `body`, as the receiver uses them: decoded fields, or raw bf16.
__device__ __forceinline__ void lf_group_values(u32 meta, const u8* body, float v[4]) {
    const int lane = threadIdx.x & 31;
    if (lf_packed(meta)) {
        const LfGrid gr = lf_grid(meta);
        const int at = 5 * lane;
        const u32* w = (const u32*)(body + (at & ~3));
        const u64 bits = (((u64)w[1] << 32) | (u64)w[0]) >> (8 * (at & 3));
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = lf_decode(gr, (u32)(bits >> (10 * i)) & 0x3FFu);
    } else {
        const u32* w = (const u32*)(body + 8 * lane);
        const u32 w0 = w[0], w1 = w[1];
        v[0] = __uint_as_float(w0 << 16);
        v[1] = __uint_as_float(w0 & 0xFFFF0000u);
        v[2] = __uint_as_float(w1 << 16);
        v[3] = __uint_as_float(w1 & 0xFFFF0000u);
    }
}

// The combine reduction of docs/contract.md over LogFMT rows (H a multiple of 128): for each
// token t and channel h, acc = 0; for k ascending over valid slots (sk[t*K+k] >= 0): acc =
// fma(w[t][k], value(row(t, k), h), acc); out = bf16_rne(acc), value as lf_group_values gives
// it. Row (t, k) is the encoded row at cbuf + (t*K + k) * crow, where its owner put it (both
// paths; LogFMT never reads in place nor through NCCL). Units are (token, LF_SPAN groups),
// spread over every warp of the rank's blocks; lane k < K keeps slot k's row, weight and the
// offset of its next body (the sum of the sizes before it, from the meta words: a unit starts
// with that prefix, counted by the whole warp), and hands them to every lane by shuffles.
// Out of line (scalar arguments): one copy per module, however many stages call it.
__device__ __noinline__ void lf_reduce_at(u64 cbuf, u64 crow, const int* sk, int n, int H, int K, int bid, int blocks_per_rank,
                                          u64 weights, u64 outp) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int G = H / LF_GROUP;
    const int spans = (G + LF_SPAN - 1) / LF_SPAN;
    const float* wts = (const float*)weights;
    u16* out = (u16*)outp;
    for (int u = bid * NWARPS + warp; u < n * spans; u += blocks_per_rank * NWARPS) {
        const int t = u / spans;
        const int g0 = (u - t * spans) * LF_SPAN;
        const int g1 = min(G, g0 + LF_SPAN);
        const bool mine = lane < K && sk[t * K + lane] >= 0;
        const u8* my_row = mine ? (const u8*)cbuf + ((u64)t * K + lane) * crow : (const u8*)0;
        const float my_w = mine ? wts[t * K + lane] : 0.0f;
        const u32 valid = __ballot_sync(0xffffffffu, mine);
        u32 my_at = 0u;
        for (int k = 0; k < K; k++) {
            if (!((valid >> k) & 1u)) continue;
            const u8* r = (const u8*)__shfl_sync(0xffffffffu, (u64)my_row, k);
            int packed = 0;
            for (int j = lane; j < g0; j += 32) packed += lf_packed(*(const u32*)(r + (u64)j * LF_META_BYTES)) ? 1 : 0;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) packed += __shfl_xor_sync(0xffffffffu, packed, o);
            if (lane == k) my_at = (u32)G * LF_META_BYTES + (u32)packed * LF_PACKED_BYTES + (u32)(g0 - packed) * LF_RAW_BYTES;
        }
        for (int g = g0; g < g1; g++) {
            const u32 my_meta = mine ? *(const u32*)(my_row + (u64)g * LF_META_BYTES) : 0u;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int k = 0; k < K; k++) {
                if (!((valid >> k) & 1u)) continue;
                const u8* r = (const u8*)__shfl_sync(0xffffffffu, (u64)my_row, k);
                const u32 meta = __shfl_sync(0xffffffffu, my_meta, k);
                const u32 at = __shfl_sync(0xffffffffu, my_at, k);
                const float w = __shfl_sync(0xffffffffu, my_w, k);
                float v[4];
                lf_group_values(meta, r + at, v);
#pragma unroll
                for (int i = 0; i < 4; i++) acc[i] = __fmaf_rn(w, v[i], acc[i]);
            }
            if (mine) my_at += lf_packed(my_meta) ? LF_PACKED_BYTES : LF_RAW_BYTES;
            uint2 o;
            o.x = (u32)f32_to_bf16_rne(acc[0]) | ((u32)f32_to_bf16_rne(acc[1]) << 16);
            o.y = (u32)f32_to_bf16_rne(acc[2]) | ((u32)f32_to_bf16_rne(acc[3]) << 16);
            *(uint2*)(out + (u64)t * H + (u64)g * LF_GROUP + 4 * lane) = o;
        }
    }
}
__device__ __forceinline__ void lf_reduce_tokens(const KParams& p, const IoPtrs& io, const RankPtrs& me, int n, const int* sk, int bid) {
    lf_reduce_at(me.cmb_buf, (u64)p.cmb_row, sk, n, p.H, p.K, bid, p.blocks_per_rank, io.weights, io.out);
}
